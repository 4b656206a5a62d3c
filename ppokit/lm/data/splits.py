"""Disjoint splits of a procedural task's problems by a fixed hash: held-out, warm start, training.

A problem goes to one of :data:`BUCKETS` buckets by the CRC-32 of a key that identifies it
(its question text, its numbers and target), whatever the seed or size: bucket < first cut:
``"eval"``; < second cut: ``"sft"``; else ``"train"``. So the held-out problems of one run
never appear in another's training set.
"""

from __future__ import annotations

import zlib

from ppokit.errors import UserError

__all__ = ["ASKED_BY", "BUCKETS", "hashed_split", "split_cuts"]

BUCKETS = 1000
# the setting that asks a run's task for the problems of each split, for messages
ASKED_BY = {"train": "the task's size option", "eval": "data.eval_size", "sft": "data.sft_examples"}


def split_cuts(where: str, eval_fraction: float, sft_fraction: float) -> tuple[int, int]:
    """The two bucket cuts of ``eval_fraction`` and ``sft_fraction``; UserError (naming ``where``)
    when a fraction is not in [1 / BUCKETS, 1) or they leave no problems for training."""
    for label, value in (("eval_fraction", eval_fraction), ("sft_fraction", sft_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 / BUCKETS <= value < 1:
            raise UserError(f"{where}: {label} must be between {1 / BUCKETS} and 1 (got {value!r})")
    cuts = (round(eval_fraction * BUCKETS), round((eval_fraction + sft_fraction) * BUCKETS))
    if not 0 < cuts[0] < cuts[1] < BUCKETS:
        raise UserError(
            f"{where}: eval_fraction={eval_fraction} and sft_fraction={sft_fraction} leave no problems "
            "for training; make their sum < 1"
        )
    return cuts


def hashed_split(key: bytes, cuts: tuple[int, int]) -> str:
    """The split of the problem identified by ``key``: ``"eval"``, ``"sft"`` or ``"train"``."""
    bucket = zlib.crc32(key) % BUCKETS
    return "eval" if bucket < cuts[0] else "sft" if bucket < cuts[1] else "train"
