"""The clipped PPO policy loss: values, gradients, dual clip, sequence and GSPO-token levels, metrics."""

import math

import pytest
import torch

from ppokit.algo import POLICY_LOSSES, aggregate, policy_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
D = torch.float64


def _t(x):
    return torch.tensor(x, dtype=D)


def test_registered_under_clip_ppo_and_vanilla():
    for name in ("clip", "ppo", "vanilla"):
        assert POLICY_LOSSES.get(name).fn is policy_loss


@pytest.mark.parametrize("mode", MODES)
def test_ratio_one_gives_minus_aggregated_advantage(mode):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 6, generator=g, dtype=D)
    adv = torch.randn(4, 6, generator=g, dtype=D)
    mask = torch.rand(4, 6, generator=g) < 0.7
    mask[:, 0] = True
    loss, metrics = policy_loss(old.clone(), old, adv, mask, agg_mode=mode)
    torch.testing.assert_close(loss, -aggregate(adv, mask, mode), rtol=0, atol=1e-14)
    assert metrics["clipfrac"].item() == 0.0 and metrics["approx_kl_k1"].item() == 0.0
    assert metrics["ratio_mean"].item() == 1.0 == metrics["ratio_max"].item() == metrics["ratio_min"].item()


def _grad_case():
    """Hand-picked ratios (away from the clip boundaries) for A > 0 and A < 0."""
    ratios = [0.5, 0.85, 0.95, 1.0, 1.2, 1.29, 1.31, 2.0]
    lo, hi = 0.1, 0.3  # asymmetric: clip range [0.9, 1.3]
    rows_r, rows_a = [], []
    for sign in (+1.0, -1.0):
        rows_r.append(ratios)
        rows_a.append([sign * (0.5 + 0.25 * i) for i in range(len(ratios))])
    old = torch.full((2, len(ratios)), -1.5, dtype=D)
    logp = (old + torch.log(_t(rows_r))).requires_grad_()
    return logp, old, _t(rows_a), lo, hi


def test_gradient_is_zero_exactly_where_clipped_and_unclipped_elsewhere():
    logp, old, adv, lo, hi = _grad_case()
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, metrics = policy_loss(logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi)
    (grad,) = torch.autograd.grad(loss, logp)
    n = mask.sum().item()
    ratio = torch.exp(logp.detach() - old)
    n_clipped = {+1: 0, -1: 0}
    n_free = {+1: 0, -1: 0}
    expected_loss = 0.0
    for b in range(2):
        for t in range(adv.shape[1]):
            a, r = adv[b, t].item(), ratio[b, t].item()
            clipped = (a > 0 and r > 1 + hi) or (a < 0 and r < 1 - lo)
            sign = 1 if a > 0 else -1
            expected_loss += max(-a * r, -a * min(max(r, 1 - lo), 1 + hi)) / n
            if clipped:
                n_clipped[sign] += 1
                assert grad[b, t].item() == 0.0, (b, t)
            else:
                n_free[sign] += 1
                # d/dlogp (-A r) / N = -A r / N
                assert grad[b, t].item() == pytest.approx(-a * r / n, rel=1e-14, abs=0), (b, t)
    assert min(n_clipped.values()) >= 1 and min(n_free.values()) >= 1  # all four cases exercised
    assert loss.item() == pytest.approx(expected_loss, abs=1e-14)
    assert metrics["clipfrac"].item() == pytest.approx(sum(n_clipped.values()) / n)
    assert metrics["clipfrac_upper"].item() == pytest.approx(n_clipped[1] / n)
    assert metrics["clipfrac_lower"].item() == pytest.approx(n_clipped[-1] / n)


def test_asymmetric_bounds_clip_at_their_own_side():
    old = torch.zeros(1, 4, dtype=D)
    r = _t([[0.85, 0.85, 1.25, 1.25]])
    adv = _t([[-1.0, -1.0, 1.0, 1.0]])
    mask = torch.ones(1, 4)
    # lower 0.1 clips r=0.85 for A<0; upper 0.3 does not clip r=1.25 for A>0
    loss, m = policy_loss(torch.log(r), old, adv, mask, lower_clip_ratio=0.1, upper_clip_ratio=0.3)
    assert loss.item() == pytest.approx((0.9 + 0.9 - 1.25 - 1.25) / 4, abs=1e-14)
    assert m["clipfrac_lower"].item() == 0.5 and m["clipfrac_upper"].item() == 0.0
    # swapped: lower 0.3 does not clip 0.85; upper 0.1 clips 1.25
    loss, m = policy_loss(torch.log(r), old, adv, mask, lower_clip_ratio=0.3, upper_clip_ratio=0.1)
    assert loss.item() == pytest.approx((0.85 + 0.85 - 1.1 - 1.1) / 4, abs=1e-14)
    assert m["clipfrac_lower"].item() == 0.0 and m["clipfrac_upper"].item() == 0.5


def test_dual_clip():
    c = 3.0
    old = torch.zeros(1, 4, dtype=D)
    r = _t([[20.0, 2.0, 20.0, 0.5]])
    adv = _t([[-2.0, -2.0, 1.5, -1.0]])
    logp = torch.log(r).requires_grad_()
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = policy_loss(logp, old, adv, mask, clip_ratio_c=c)
    (grad,) = torch.autograd.grad(loss, logp)
    # pos 0: A<0, huge ratio -> -A c, zero grad; pos 1: A<0, 1.2 < r < c -> -A r, live grad;
    # pos 2: A>0 unaffected by dual clip -> -A (1 + 0.2), zero grad; pos 3: A<0, r < 0.8 -> -A 0.8, zero grad
    per = [2.0 * c, 2.0 * 2.0, -1.5 * 1.2, 1.0 * 0.8]
    assert loss.item() == pytest.approx(sum(per) / 4, abs=1e-14)
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0 and grad[0, 3].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(2.0 * 2.0 / 4, rel=1e-14)
    assert m["clipfrac_dual"].item() == 0.25
    assert m["clipfrac"].item() == 0.75  # dual + upper + lower: every position with a zeroed gradient
    no_dual, _ = policy_loss(logp, old, adv, mask)
    assert no_dual.item() == pytest.approx((2.0 * 20.0 + per[1] + per[2] + per[3]) / 4, abs=1e-12)


def test_metrics_hand_case():
    old = torch.zeros(1, 4, dtype=D)
    r = [0.5, 1.5, 1.1, 7.0]  # last position is padding
    logp = torch.log(_t([r]))
    adv = _t([[-1.0, 1.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = policy_loss(logp, old, adv, mask)
    valid = r[:3]
    k1 = sum(-math.log(x) for x in valid) / 3
    k3 = sum((x - 1) - math.log(x) for x in valid) / 3
    expected = {
        "clipfrac": 2 / 3,
        "clipfrac_lower": 1 / 3,
        "clipfrac_upper": 1 / 3,
        "clipfrac_dual": 0.0,
        "approx_kl_k1": k1,
        "approx_kl_k3": k3,
        "ratio_mean": 3.1 / 3,
        "ratio_max": 1.5,
        "ratio_min": 0.5,
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        assert m[k].dim() == 0 and not m[k].requires_grad, k
        assert m[k].item() == pytest.approx(v, abs=1e-14), k
    assert loss.item() == pytest.approx((0.8 - 1.2 - 1.1) / 3, abs=1e-14)
    # dual clip c = 1.4: A = -1 at r = 1.5 > c is a dual hit; r = 0.5 stays a lower-clip hit
    _, m2 = policy_loss(logp, old, _t([[-1.0, -1.0, 1.0, 5.0]]), mask, clip_ratio_c=1.4)
    assert m2["clipfrac_dual"].item() == pytest.approx(1 / 3) and m2["clipfrac"].item() == pytest.approx(2 / 3)


def test_metrics_are_detached_and_loss_has_grad():
    logp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(2, 3, dtype=D), torch.ones(2, 3, dtype=D), torch.ones(2, 3))
    assert loss.requires_grad and loss.dim() == 0
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_masked_garbage_does_not_leak():
    logp = _t([[-1.0, float("inf"), -2.0]]).requires_grad_()
    old = _t([[-1.1, float("-inf"), float("nan")]])
    old[0, 2] = -2.0
    adv = _t([[1.0, float("nan"), -1.0]])
    mask = torch.tensor([[True, False, True]])
    loss, m = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0
    assert all(torch.isfinite(v) for v in m.values())


def _naive_sequence_loss(logp, old, adv, mask, lo, hi, c, mode):
    """Per-sequence PPO written with per-row loops (torch scalars, so it has gradients)."""
    B, T = logp.shape
    per_row, row_len = [], []
    for b in range(B):
        s = logp.new_zeros(())
        a_sum, n = 0.0, 0
        for t in range(T):
            if mask[b, t]:
                s = s + (logp[b, t] - old[b, t])
                a_sum += adv[b, t].item()
                n += 1
        a = a_sum / n if n else 0.0
        r = torch.exp(s)
        loss_b = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
        if c is not None and a < 0:
            loss_b = torch.minimum(loss_b, logp.new_tensor(-a * c))
        per_row.append(loss_b)
        row_len.append(n)
    if mode == "seq-mean-token-mean":
        return sum(l if n else 0.0 for l, n in zip(per_row, row_len)) / B
    if mode == "token-mean":
        return sum(l * n for l, n in zip(per_row, row_len)) / max(sum(row_len), 1)
    if mode == "seq-mean-token-sum":
        return sum(l * n for l, n in zip(per_row, row_len)) / B
    return sum(l * n for l, n in zip(per_row, row_len)) / (B * T)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("c", [None, 2.0])
def test_sequence_level_matches_naive(mode, c):
    g = torch.Generator().manual_seed(4)
    B, T = 6, 5
    old = torch.randn(B, T, generator=g, dtype=D) - 2
    logp = (old + 0.15 * torch.randn(B, T, generator=g, dtype=D)).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = True
    mask[3] = False  # an empty row
    lo, hi = 0.1, 0.15
    loss, m = policy_loss(
        logp,
        old,
        adv,
        mask,
        lower_clip_ratio=lo,
        upper_clip_ratio=hi,
        clip_ratio_c=c,
        agg_mode=mode,
        ratio_level="sequence",
    )
    ref = _naive_sequence_loss(logp, old, adv, mask, lo, hi, c, mode)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-13)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-13)
    assert 0.0 <= m["clipfrac"].item() <= 1.0
    if mode == "seq-mean-token-mean":  # -(1/N) sum_i min(A_i r_i, A_i clip(r_i)) with N = B
        seq_adv = torch.stack([adv[b][mask[b]].mean() if mask[b].any() else adv.new_zeros(()) for b in range(B)])
        r = torch.exp(((logp.detach() - old) * mask).sum(-1))
        direct = -torch.minimum(seq_adv * r, seq_adv * r.clamp(1 - lo, 1 + hi)).sum() / B
        if c is None:
            assert loss.item() == pytest.approx(direct.item(), abs=1e-13)


def test_sequence_level_accepts_one_advantage_per_row():
    g = torch.Generator().manual_seed(5)
    old = torch.randn(3, 4, generator=g, dtype=D)
    logp = old + 0.3 * torch.randn(3, 4, generator=g, dtype=D)
    a = torch.randn(3, generator=g, dtype=D)
    mask = torch.ones(3, 4)
    l1, m1 = policy_loss(logp, old, a, mask, ratio_level="sequence")
    l2, m2 = policy_loss(logp, old, a[:, None].expand(3, 4), mask, ratio_level="sequence")
    assert l1.item() == pytest.approx(l2.item(), abs=1e-14)
    # sequence metrics are per row: ratio_max is a row's product of token ratios
    seq_r = torch.exp((logp - old).sum(-1))
    assert m1["ratio_max"].item() == pytest.approx(seq_r.max().item(), rel=1e-12)


def test_validation():
    x = torch.zeros(2, 3)
    ok = dict(log_prob=x, old_log_prob=x, advantages=x, mask=x)

    def call(**kw):
        args = {**ok, **kw}
        return policy_loss(
            args.pop("log_prob"), args.pop("old_log_prob"), args.pop("advantages"), args.pop("mask"), **args
        )

    for c in (1.0, 0.5, -3.0):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            call(clip_ratio_c=c)
    for lo in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"lower_clip_ratio must be in \[0, 1\)"):
            call(lower_clip_ratio=lo)
    with pytest.raises(ValueError, match="upper_clip_ratio"):
        call(upper_clip_ratio=-0.1)
    with pytest.raises(ValueError, match="ratio_level"):
        call(ratio_level="seq")
    with pytest.raises(ValueError, match=r"old_log_prob shape \(2, 4\) != log_prob shape \(2, 3\)"):
        call(old_log_prob=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"advantages shape \(3,\)"):
        call(advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="did you mean 'token-mean'"):
        call(agg_mode="token-man")
    call(clip_ratio_c=1.01, lower_clip_ratio=0.0, upper_clip_ratio=0.0)  # edges are fine


def test_without_diagnostics_same_loss_and_logged_subset():
    g = torch.Generator().manual_seed(11)
    lp, old, adv = (torch.randn(6, 9, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(6, 9, generator=g) > 0.3
    full_loss, full = policy_loss(lp, old, adv, mask, clip_ratio_c=3.0)
    loss, small = policy_loss(lp, old, adv, mask, clip_ratio_c=3.0, diagnostics=False)
    assert torch.equal(loss, full_loss)
    assert set(small) == {"clipfrac", "approx_kl_k1", "approx_kl_k3", "ratio_max"}
    for key, value in small.items():
        assert torch.equal(value, full[key]), key


# ----------------------------------------------------------------------------- GSPO-token


def _agg_weights(mask, mode):
    """w[b][t]: the weight of a valid position's loss in ``mode`` (0 elsewhere), by loops."""
    B, T = mask.shape
    lens = [int(sum(bool(mask[b, t]) for t in range(T))) for b in range(B)]
    n_tok = max(sum(lens), 1)
    w = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                w[b][t] = {
                    "token-mean": 1.0 / n_tok,
                    "seq-mean-token-sum": 1.0 / B,
                    "seq-mean-token-mean": 1.0 / (B * lens[b]),
                    "seq-mean-token-sum-norm": 1.0 / (B * T),
                }[mode]
    return w


def _naive_gspo(logp, old, adv, mask, lo, hi, c, mode):
    """GSPO-token by loops in float64: loss and its gradient w.r.t. logp, written out.

    s_b = exp(mean over valid t of (logp - old)); L_bt = max(-A s_b, -A clip(s_b)) (dual clip
    for A < 0); d L_bt / d logp_bt = -A s_b where no clip is active, else 0; d/d logp_bt' = 0.
    """
    B, T = logp.shape
    w = _agg_weights(mask, mode)
    loss, grad = 0.0, torch.zeros(B, T, dtype=D)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        if not valid:
            continue
        s = math.exp(sum(logp[b, t].item() - old[b, t].item() for t in valid) / len(valid))
        for t in valid:
            a = adv[b, t].item()
            clipped_s = min(max(s, 1 - lo), 1 + hi)
            value = max(-a * s, -a * clipped_s)
            free = (-a * s >= -a * clipped_s) and not ((a > 0 and s > 1 + hi) or (a < 0 and s < 1 - lo))
            if c is not None and a < 0 and -a * c < value:
                value, free = -a * c, False
            loss += w[b][t] * value
            grad[b, t] = w[b][t] * (-a * s) if free else 0.0
    return loss, grad


def _gspo_case(seed, B=6, T=7, spread=1e-3):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=D) - 2
    logp = old + spread * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = True
    mask[1] = False  # an empty row
    mask[2] = False
    mask[2, 3] = True  # a single-token row
    # padding holds garbage; the loss must not see it
    logp = torch.where(mask, logp, torch.full_like(logp, float("inf")))
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    return logp.requires_grad_(), old, adv, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("c", [None, 3.0])
def test_gspo_matches_naive(mode, c):
    lo, hi = 3e-4, 4e-4  # the GSPO paper's clip range
    for seed in range(3):
        logp, old, adv, mask = _gspo_case(seed)
        loss, m = policy_loss(
            logp,
            old,
            adv,
            mask,
            lower_clip_ratio=lo,
            upper_clip_ratio=hi,
            clip_ratio_c=c,
            agg_mode=mode,
            ratio_level="gspo",
        )
        (grad,) = torch.autograd.grad(loss, logp)
        ref_loss, ref_grad = _naive_gspo(logp.detach(), old, adv, mask, lo, hi, c, mode)
        assert loss.item() == pytest.approx(ref_loss, abs=1e-13)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
        assert 0.0 < m["clipfrac"].item() < 1.0  # both clipped and free tokens are exercised


def test_gspo_with_one_advantage_per_row_has_the_gradient_of_the_sequence_objective():
    """GSPO: J = -(1/B) sum_b min(s_b A_b, clip(s_b) A_b), s_b = exp(mean_t log-ratio), by autograd per row."""
    lo, hi = 3e-4, 4e-4
    logp, old, _, mask = _gspo_case(7, B=8, T=6, spread=4e-3)
    a = torch.randn(8, generator=torch.Generator().manual_seed(8), dtype=D)
    B = logp.shape[0]

    def sequence_objective(weight_by_len):
        total = logp.new_zeros(())
        for b in range(B):
            valid = [t for t in range(logp.shape[1]) if mask[b, t]]
            if not valid:
                continue
            s = torch.exp(sum(logp[b, t] - old[b, t] for t in valid) / len(valid))
            row = torch.maximum(-a[b] * s, -a[b] * s.clamp(1 - lo, 1 + hi))
            total = total + row * (len(valid) if weight_by_len else 1)
        return total

    clipped_rows = 0
    for adv in (a, a[:, None].expand_as(logp).clone()):  # (B,) or equal per-token advantages
        loss, m = policy_loss(
            logp,
            old,
            adv,
            mask,
            lower_clip_ratio=lo,
            upper_clip_ratio=hi,
            agg_mode="seq-mean-token-mean",
            ratio_level="gspo",
        )
        ref = sequence_objective(False) / B
        g1, g2 = (torch.autograd.grad(x, logp)[0] for x in (loss, ref))
        assert loss.item() == pytest.approx(ref.item(), abs=1e-14)
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-16)
        clipped_rows = (g1.abs().sum(-1) == 0).sum().item() - 1  # minus the empty row
        # token-mean weighs each row by its token count
        loss, _ = policy_loss(
            logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi, agg_mode="token-mean", ratio_level="gspo"
        )
        ref = sequence_objective(True) / mask.sum()
        g1, g2 = (torch.autograd.grad(x, logp)[0] for x in (loss, ref))
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-16)
    assert 0 < clipped_rows < B - 1  # some rows clipped, some free


def test_gspo_on_single_token_rows_is_token_level_ppo():
    g = torch.Generator().manual_seed(12)
    old = torch.randn(5, 4, generator=g, dtype=D)
    logp = (old + 0.3 * torch.randn(5, 4, generator=g, dtype=D)).requires_grad_()
    adv = torch.randn(5, 4, generator=g, dtype=D)
    mask = torch.zeros(5, 4, dtype=torch.bool)
    mask[torch.arange(5), torch.tensor([0, 3, 1, 2, 0])] = True
    for mode in MODES:
        l1, m1 = policy_loss(logp, old, adv, mask, agg_mode=mode, ratio_level="gspo", clip_ratio_c=2.0)
        l2, m2 = policy_loss(logp, old, adv, mask, agg_mode=mode, ratio_level="token", clip_ratio_c=2.0)
        assert l1.item() == pytest.approx(l2.item(), abs=1e-15)
        torch.testing.assert_close(
            torch.autograd.grad(l1, logp)[0], torch.autograd.grad(l2, logp)[0], rtol=1e-14, atol=0
        )
        for k in m1:
            assert m1[k].item() == pytest.approx(m2[k].item(), abs=1e-14), k


def test_gspo_and_sequence_clipfrac_count_tokens_and_rows():
    hi, lo = 0.1, 0.1
    x = math.log(1.2)  # every token of row 0: s_0 = 1.2 (gspo), r_0 = 1.2^3 (sequence); both > 1 + hi
    old = torch.zeros(2, 4, dtype=D)
    logp = _t([[x, x, x, 0.0], [math.log(1.05), 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = _t([[1.0, -1.0, 2.0, 9.0], [1.0, 0.0, 0.0, 0.0]])
    _, m = policy_loss(logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi, ratio_level="gspo")
    # tokens: row 0's two A > 0 tokens are clipped above, its A < 0 token is free, row 1 is free
    assert m["clipfrac"].item() == pytest.approx(2 / 4) and m["clipfrac_upper"].item() == pytest.approx(2 / 4)
    assert m["clipfrac_lower"].item() == 0.0
    assert m["ratio_max"].item() == pytest.approx(1.2, rel=1e-14)
    assert m["ratio_min"].item() == pytest.approx(1.05, rel=1e-14)
    assert m["ratio_mean"].item() == pytest.approx((3 * 1.2 + 1.05) / 4, rel=1e-14)
    # the sequence level counts rows: row 0 (mean advantage 2/3 > 0, r = 1.728) is clipped, row 1 is not
    _, m = policy_loss(logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi, ratio_level="sequence")
    assert m["clipfrac"].item() == pytest.approx(1 / 2) and m["ratio_max"].item() == pytest.approx(1.2**3)


def test_gspo_gradient_vanishes_only_where_clipped_and_ignores_padding():
    logp, old, adv, mask = _gspo_case(3, spread=5e-4)
    loss, _ = policy_loss(logp, old, adv, mask, lower_clip_ratio=3e-4, upper_clip_ratio=4e-4, ratio_level="gspo")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()
    s = torch.exp(torch.where(mask, logp.detach() - old, 0.0).sum(-1) / mask.sum(-1).clamp(min=1))  # (B,)
    clipped = ((adv > 0) & (s[:, None] > 1 + 4e-4)) | ((adv < 0) & (s[:, None] < 1 - 3e-4))
    assert ((logp.grad == 0) == (clipped | ~mask)).all()
