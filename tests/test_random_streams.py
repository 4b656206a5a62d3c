"""An evaluation's own random stream: the same numbers each time, the run's stream untouched."""

from __future__ import annotations

import torch

from ppokit.persistence.resume import own_random_stream


def test_own_random_stream_repeats_and_leaves_the_run_s_stream_as_it_was():
    torch.manual_seed(3)
    expected = torch.rand(4)  # what the run draws next without an evaluation
    torch.manual_seed(3)
    with own_random_stream(7):
        first = torch.rand(4)
    with own_random_stream(7):
        second = torch.rand(4)
    with own_random_stream(8):
        other = torch.rand(4)
    assert torch.equal(first, second) and not torch.equal(first, other)
    assert torch.equal(torch.rand(4), expected)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(4), first)  # the stream is torch's own, seeded with the given seed
