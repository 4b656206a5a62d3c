"""Chunked log-probs and entropy from logits."""

import pytest
import torch
from torch.distributions import Categorical

from ppokit.algo import entropy_from_logits, log_probs_from_logits

D = torch.float64


def _logits(seed, shape=(3, 5, 13), scale=3.0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=D) * scale).to(dtype)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_entropy_matches_categorical_and_gradient(chunk_size):
    z = _logits(0).requires_grad_()
    ref_z = z.detach().clone().requires_grad_()
    h = entropy_from_logits(z, chunk_size=chunk_size)
    ref = Categorical(logits=ref_z).entropy()
    assert h.shape == (3, 5) and h.dtype == D
    torch.testing.assert_close(h, ref, rtol=0, atol=1e-12)
    w = torch.randn(3, 5, dtype=D)
    (gz,) = torch.autograd.grad((h * w).sum(), z)
    (gref,) = torch.autograd.grad((ref * w).sum(), ref_z)
    torch.testing.assert_close(gz, gref, rtol=0, atol=1e-12)


def test_entropy_chunked_equals_unchunked():
    z = _logits(1, shape=(4, 7, 9))
    full = entropy_from_logits(z, chunk_size=10_000)
    for cs in (1, 3, 5, 27):
        torch.testing.assert_close(entropy_from_logits(z, chunk_size=cs), full, rtol=0, atol=1e-14)


def test_entropy_gradcheck():
    z = _logits(2, shape=(2, 3, 5)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk_size=4), (z,))


def test_entropy_extreme_and_banned_logits():
    z = _logits(3, scale=1e4)  # spreads of ~1e4: plain softmax * log would give NaN/inf
    z.requires_grad_()
    h = entropy_from_logits(z, chunk_size=2)
    assert torch.isfinite(h).all() and (h >= -1e-12).all()
    torch.testing.assert_close(h, Categorical(logits=z.detach()).entropy(), rtol=0, atol=1e-9)
    h.sum().backward()
    assert torch.isfinite(z.grad).all()
    # uniform over V -> log V; -inf logits are banned tokens that contribute nothing
    assert entropy_from_logits(torch.zeros(2, 8, dtype=D)).tolist() == pytest.approx(
        [torch.log(torch.tensor(8.0)).item()] * 2
    )
    banned = torch.zeros(1, 6, dtype=D)
    banned[0, :2] = float("-inf")
    banned.requires_grad_()
    hb = entropy_from_logits(banned)
    assert hb.item() == pytest.approx(torch.log(torch.tensor(4.0, dtype=D)).item(), abs=1e-14)
    hb.backward()
    assert torch.isfinite(banned.grad).all()


def test_entropy_bf16_computes_in_float32():
    z32 = _logits(4, dtype=torch.float32)
    zb = z32.bfloat16().requires_grad_()
    h = entropy_from_logits(zb, chunk_size=4)
    assert h.dtype == torch.float32
    ref = Categorical(logits=zb.detach().float()).entropy()
    torch.testing.assert_close(h, ref, rtol=0, atol=1e-5)
    h.sum().backward()
    assert zb.grad.dtype == torch.bfloat16 and torch.isfinite(zb.grad.float()).all()


@pytest.mark.parametrize("chunk_size", [1, 6, 1024])
def test_log_probs_match_log_softmax_gather(chunk_size):
    z = _logits(5).requires_grad_()
    labels = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(0))
    out = log_probs_from_logits(z, labels, chunk_size=chunk_size)
    ref_z = z.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_z, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    w = torch.randn(3, 5, dtype=D)
    (g1,) = torch.autograd.grad((out * w).sum(), z)
    (g2,) = torch.autograd.grad((ref * w).sum(), ref_z)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_log_probs_gradcheck_and_bf16():
    z = _logits(6, shape=(2, 3, 4)).requires_grad_()
    labels = torch.tensor([[0, 3, 1], [2, 2, 0]])
    assert torch.autograd.gradcheck(lambda x: log_probs_from_logits(x, labels, chunk_size=2), (z,))
    zb = _logits(6, shape=(2, 3, 4), scale=20.0, dtype=torch.bfloat16)
    out = log_probs_from_logits(zb, labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(zb.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_logits_validation():
    z = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"labels shape \(2, 4\) != logits shape without vocab \(2, 3\)"):
        log_probs_from_logits(z, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        log_probs_from_logits(z, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(z, chunk_size=0)
