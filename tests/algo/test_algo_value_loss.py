"""Value loss: squared / clipped / Huber against plain-loop references."""

import pytest
import torch

from ppokit.algo import explained_variance, value_loss

D = torch.float64


def _huber(x, d):
    return 0.5 * x * x if abs(x) <= d else d * (abs(x) - 0.5 * d)


def naive_value_loss(v, old, ret, mask, clip=None, delta=None):
    """token-mean of per-position losses, with plain Python loops."""
    f = (lambda x: 0.5 * x * x) if delta is None else (lambda x: _huber(x, delta))
    total, n, clipped = 0.0, 0, 0
    for b in range(len(v)):
        for t in range(len(v[0])):
            if not mask[b][t]:
                continue
            l1 = f(v[b][t] - ret[b][t])
            if clip is not None:
                vc = old[b][t] + min(max(v[b][t] - old[b][t], -clip), clip)
                l2 = f(vc - ret[b][t])
                clipped += l2 > l1
                l1 = max(l1, l2)
            total += l1
            n += 1
    return total / n, clipped / n


def _case(seed, B=5, T=8):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=D)
    v = old + 0.6 * torch.randn(B, T, generator=g, dtype=D)
    ret = old + 2.0 * torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, 0] = True
    return v, old, ret, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clip", [None, 0.2, 1.0])
@pytest.mark.parametrize("delta", [None, 0.5])
def test_value_loss_matches_naive(seed, clip, delta):
    v, old, ret, mask = _case(seed)
    loss, m = value_loss(v, old, ret, mask, clip_value=clip, huber_delta=delta)
    ref, ref_clipfrac = naive_value_loss(v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), clip, delta)
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    assert m["vf_clipfrac"].item() == pytest.approx(ref_clipfrac, abs=1e-12)
    if clip == 0.2:
        assert 0 < m["vf_clipfrac"].item() < 1  # the case really exercises clipping


def test_huge_huber_delta_equals_squared_and_small_delta_is_linear():
    v, old, ret, mask = _case(2)
    sq, _ = value_loss(v, old, ret, mask, clip_value=0.3)
    hub, _ = value_loss(v, old, ret, mask, clip_value=0.3, huber_delta=1e6)
    assert hub.item() == pytest.approx(sq.item(), abs=1e-13)
    # for a tiny delta, Huber ~ delta * |x|
    tiny, _ = value_loss(v, None, ret, mask, huber_delta=1e-9)
    l1 = ((v - ret).abs() * mask).sum() / mask.sum() * 1e-9
    assert tiny.item() == pytest.approx(l1.item(), rel=1e-6)


def test_value_loss_gradient_and_clipping_hand_case():
    old = torch.zeros(1, 3, dtype=D)
    ret = torch.tensor([[1.0, 1.0, -1.0]], dtype=D)
    v = torch.tensor([[0.5, 2.0, 0.1]], dtype=D, requires_grad=True)
    loss, m = value_loss(v, old, ret, torch.ones(1, 3), clip_value=0.2)
    # pos 0: |0.5-1| = .5 vs clipped |0.2-1| = .8 -> clipped term larger, no grad through V
    # pos 1: |2-1| = 1 vs |0.2-1| = .8 -> unclipped; pos 2: |0.1+1| = 1.1 vs same (in range) -> tie, unclipped
    expected = (0.5 * 0.8**2 + 0.5 * 1.0**2 + 0.5 * 1.1**2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-14)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 1.0 / 3, 1.1 / 3]], dtype=D), rtol=0, atol=1e-14)


def test_value_metrics():
    v, old, ret, mask = _case(3)
    _, m = value_loss(v.requires_grad_(), old, ret, mask)
    assert set(m) == {"vf_clipfrac", "explained_variance", "value_mean", "return_mean"}
    assert all(x.dim() == 0 and not x.requires_grad for x in m.values())
    assert m["vf_clipfrac"].item() == 0.0
    assert m["explained_variance"].item() == pytest.approx(explained_variance(v.detach(), ret, mask).item())
    assert m["explained_variance"].item() != pytest.approx(explained_variance(old, ret, mask).item())
    assert m["value_mean"].item() == pytest.approx(v.detach()[mask].mean().item(), abs=1e-12)
    assert m["return_mean"].item() == pytest.approx(ret[mask].mean().item(), abs=1e-12)


def test_padding_garbage_does_not_reach_the_gradient():
    v = torch.tensor([[1.0, float("nan")]], dtype=D, requires_grad=True)
    ret = torch.tensor([[0.0, float("inf")]], dtype=D)
    loss, m = value_loss(v, torch.zeros(1, 2, dtype=D), ret, torch.tensor([[1, 0]]), clip_value=0.5)
    loss.backward()
    assert loss.item() == 0.5 and torch.isfinite(v.grad).all()


def test_value_loss_validation():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"returns shape \(2, 2\) != values shape \(2, 3\)"):
        value_loss(x, x, torch.zeros(2, 2), x)
    with pytest.raises(ValueError, match="clip_value needs old_values"):
        value_loss(x, None, x, x, clip_value=0.2)
    with pytest.raises(ValueError, match="clip_value must be > 0"):
        value_loss(x, x, x, x, clip_value=0.0)
    with pytest.raises(ValueError, match="huber_delta must be > 0"):
        value_loss(x, x, x, x, huber_delta=-1.0)


def test_without_diagnostics_same_loss_and_clipfrac():
    g = torch.Generator().manual_seed(12)
    v, old, ret = (torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(5, 7, generator=g) > 0.3
    full_loss, full = value_loss(v, old, ret, mask, clip_value=0.2)
    loss, small = value_loss(v, old, ret, mask, clip_value=0.2, diagnostics=False)
    assert torch.equal(loss, full_loss)
    assert set(small) == {"vf_clipfrac"} and torch.equal(small["vf_clipfrac"], full["vf_clipfrac"])
