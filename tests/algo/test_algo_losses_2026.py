"""CISPO, DPPO (TV, KL), GPG, DRO, SAPO, GMPO, Clip-Cov and KL-Cov against float64 loops.

Each naive version walks the valid tokens one by one with Python floats (and torch scalars
where a gradient is wanted), so neither a broadcast nor a mask can hide a mistake.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.algo import (
    aggregation_normalizer,
    cispo_loss,
    clip_cov_loss,
    dppo_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    kl_cov_loss,
    sapo_loss,
)

D = torch.float64


def _case(seed: int, rows: int = 5, cols: int = 7, spread: float = 0.4):
    """log-probs of sampled tokens (< 0), old ones nearby, signed advantages, ragged mask with an
    empty row, garbage (inf, nan) in the padding."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g, dtype=D) * 2.5 - 0.02
    logp = (old + torch.randn(rows, cols, generator=g, dtype=D) * spread).clamp(max=-1e-4)
    adv = torch.randn(rows, cols, generator=g, dtype=D)
    lengths = torch.tensor([cols, 3, 0, 1, cols - 2][:rows])
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    logp = torch.where(mask, logp, torch.tensor(float("inf"), dtype=D)).requires_grad_(True)
    old = torch.where(mask, old, torch.tensor(float("nan"), dtype=D))
    adv = torch.where(mask, adv, torch.tensor(float("-inf"), dtype=D))
    return logp, old, adv, mask


def _valid(mask):
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


def _token_mean(terms):
    """Naive token-mean of a list of torch scalars."""
    return sum(terms) / len(terms)


def _check(loss, naive, logp):
    assert loss.item() == pytest.approx(naive.item(), rel=1e-12, abs=1e-14)
    g = torch.autograd.grad(loss, logp, retain_graph=True)[0]
    g_naive = torch.autograd.grad(naive, logp)[0]
    assert torch.isfinite(g).all()  # padding held inf/nan: its gradient is exactly 0
    torch.testing.assert_close(g, g_naive, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_against_a_loop(seed):
    logp, old, adv, mask = _case(seed, spread=0.6)
    lo, hi = 0.3, 0.25
    terms, clipped = [], 0
    for b, t in _valid(mask):
        r = math.exp(logp[b, t].item() - old[b, t].item())
        w = min(max(r, 1 - lo), 1 + hi)
        clipped += w != r
        terms.append(-w * adv[b, t].item() * logp[b, t])
    loss, metrics = cispo_loss(logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi)
    _check(loss, _token_mean(terms), logp)
    assert metrics["clipfrac"].item() == pytest.approx(clipped / len(terms))
    assert 0 < clipped < len(terms)


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dppo_against_a_loop(divergence, seed):
    logp, old, adv, mask = _case(seed, spread=0.8)
    d_lo, d_hi, cap = 0.05, 0.08, 1.7
    terms, outside, truncated = [], 0, 0
    for b, t in _valid(mask):
        lp, q_log, a = logp[b, t].item(), old[b, t].item(), adv[b, t].item()
        p, q = math.exp(lp), math.exp(q_log)
        r = p / q
        if divergence == "tv":
            inside = (p - q <= d_hi) if a > 0 else (p - q >= -d_lo)
        else:
            kl = q * (q_log - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            inside = (kl <= d_hi or p <= q) if a > 0 else (kl <= d_lo or p >= q)
        outside += not inside
        truncated += inside and r > cap
        terms.append(-a * min(r, cap) * logp[b, t] * float(inside))
    loss, metrics = dppo_loss(
        logp, old, adv, mask, divergence=divergence, lower_divergence=d_lo, upper_divergence=d_hi, ratio_cap=cap
    )
    _check(loss, _token_mean(terms), logp)
    assert metrics["clipfrac"].item() == pytest.approx(outside / len(terms))
    assert metrics["clipfrac_truncated"].item() == pytest.approx(truncated / len(terms))
    assert 0 < outside < len(terms)


def test_gpg_and_dro_against_loops():
    logp, old, adv, mask = _case(3)
    beta = 0.7
    gpg_terms, dro_terms = [], []
    for b, t in _valid(mask):
        a = adv[b, t].item()
        gpg_terms.append(-a * logp[b, t])
        dro_terms.append(-(a * logp[b, t] - beta / 2 * (logp[b, t] - old[b, t].item()) ** 2))
    _check(gpg_loss(logp, old, adv, mask)[0], _token_mean(gpg_terms), logp)
    _check(dro_loss(logp, old, adv, mask, beta=beta)[0], _token_mean(dro_terms), logp)
    with pytest.raises(ValueError, match="dro needs beta > 0"):
        dro_loss(logp, old, adv, mask, beta=None)


@pytest.mark.parametrize("seed", [0, 4])
def test_sapo_against_a_loop_and_ppo_at_ratio_one(seed):
    logp, old, adv, mask = _case(seed)
    tau_pos, tau_neg = 1.0, 1.6
    terms = []
    for b, t in _valid(mask):
        a = adv[b, t].item()
        tau = tau_pos if a > 0 else tau_neg
        r = torch.exp(logp[b, t] - old[b, t].item())
        terms.append(-a * torch.sigmoid(tau * (r - 1)) * 4 / tau)
    loss, _ = sapo_loss(logp, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    _check(loss, _token_mean(terms), logp)
    # at r = 1 the gate's gradient is PPO's: d/dlogpi [-A r] = -A
    same = old.detach().clone().requires_grad_(True)
    loss, metrics = sapo_loss(same, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    grad = torch.autograd.grad(loss, same)[0]
    count = mask.sum()
    torch.testing.assert_close(grad[mask], -adv[mask] / count, rtol=1e-12, atol=0)
    assert metrics["gate_mean"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 5])
def test_geo_mean_against_a_loop(seed):
    logp, old, adv, mask = _case(seed, spread=0.5)
    lo, hi = 0.3, 0.2
    row_losses, rows = [], mask.shape[0]
    for b in range(rows):
        tokens = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not tokens:
            continue
        logs, advs = [], []
        for t in tokens:
            a = adv[b, t].item()
            lr = logp[b, t] - old[b, t].item()
            clipped = lr.clamp(-lo, hi)
            s = (a > 0) - (a < 0)
            logs.append(s * torch.minimum(s * lr, s * clipped))
            advs.append(a)
        row_losses.append(-(sum(advs) / len(advs)) * torch.exp(sum(logs) / len(logs)))
    naive = sum(row_losses) / rows  # seq-mean-token-mean: every row counts, the empty one as 0
    loss, metrics = geo_mean_loss(
        logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi, agg_mode="seq-mean-token-mean"
    )
    _check(loss, naive, logp)
    assert 0 < metrics["clipfrac"].item() < 1


def test_geo_mean_takes_one_advantage_per_row():
    logp, old, adv, mask = _case(6)
    row_adv = torch.tensor([0.5, -1.0, 2.0, 0.3, -0.2], dtype=D)
    per_token = torch.where(mask, row_adv[:, None].expand_as(mask), 0.0)
    a, _ = geo_mean_loss(logp, old, row_adv, mask)
    b, _ = geo_mean_loss(logp, old, per_token, mask)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def _cov(adv, logp, mask):
    pairs = _valid(mask)
    mean_a = sum(adv[b, t].item() for b, t in pairs) / len(pairs)
    mean_p = sum(logp[b, t].item() for b, t in pairs) / len(pairs)
    return {(b, t): (adv[b, t].item() - mean_a) * (logp[b, t].item() - mean_p) for b, t in pairs}


def test_clip_cov_stops_the_gradient_of_drawn_tokens_in_the_band():
    logp, old, adv, mask = _case(7, spread=0.3)
    adv = torch.where(mask, adv * 4, adv)  # covariances reach the band (1, 5)
    lo, hi, ratio = 0.2, 0.2, 0.25
    cov = _cov(adv, logp, mask)
    torch.manual_seed(0)
    loss, metrics = clip_cov_loss(
        logp, old, adv, mask, lower_clip_ratio=lo, upper_clip_ratio=hi, cov_ratio=ratio, cov_lower=1.0, cov_upper=5.0
    )
    grad = torch.autograd.grad(loss, logp)[0]
    pairs = _valid(mask)
    n_select = max(int(ratio * len(pairs)), 1)
    stopped, terms, candidates = [], [], 0
    for b, t in pairs:
        a = adv[b, t].item()
        r = math.exp(logp[b, t].item() - old[b, t].item())
        surr, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
        ppo_clipped = clipped > surr
        in_band = 1.0 < cov[b, t] < 5.0 and not ppo_clipped
        candidates += in_band
        if grad[b, t] == 0 and not ppo_clipped:
            stopped.append((b, t))
            assert in_band, (b, t)  # only band tokens are ever stopped
        terms.append(max(surr, clipped) * (0.0 if (b, t) in stopped else 1.0))
    assert len(stopped) == min(n_select, candidates) > 0
    assert loss.item() == pytest.approx(sum(terms) / len(pairs), rel=1e-12)
    assert metrics["clip_cov_frac"].item() == pytest.approx(len(stopped) / len(pairs))


def test_kl_cov_penalises_the_largest_covariances():
    logp, old, adv, mask = _case(8)
    ratio, coef = 0.3, 0.5
    cov = _cov(adv, logp, mask)
    pairs = _valid(mask)
    n = max(int(ratio * len(pairs)), 1)
    top = set(sorted(pairs, key=lambda p: cov[p], reverse=True)[:n])
    terms = []
    for b, t in pairs:
        lr = logp[b, t] - old[b, t].item()
        term = -adv[b, t].item() * torch.exp(lr)
        terms.append(term + coef * lr.abs() if (b, t) in top else term)
    loss, metrics = kl_cov_loss(logp, old, adv, mask, cov_ratio=ratio, coef=coef)
    _check(loss, _token_mean(terms), logp)
    assert metrics["kl_cov_frac"].item() == pytest.approx(n / len(pairs))
    assert metrics["clipfrac"].item() == 0


LOSSES = {
    "cispo": lambda *x, **k: cispo_loss(*x, lower_clip_ratio=0.2, upper_clip_ratio=0.3, **k),
    "dppo_tv": lambda *x, **k: dppo_loss(*x, divergence="tv", **k),
    "dppo_kl": lambda *x, **k: dppo_loss(*x, divergence="kl", **k),
    "gpg": gpg_loss,
    "dro": lambda *x, **k: dro_loss(*x, beta=0.2, **k),
    "sapo": sapo_loss,
    "geo_mean": geo_mean_loss,
    "kl_cov": lambda *x, **k: kl_cov_loss(*x, cov_ratio=1.0, **k),  # every token: no per-split selection
}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_micro_batches_with_the_whole_normaliser_add_up(name, mode):
    """What the trainer does: the loss of row splits, each normalised by the whole batch, sums to
    the whole batch's loss, and so do the gradients."""
    logp, old, adv, mask = _case(9)
    fn = LOSSES[name]
    full, _ = fn(logp, old, adv, mask, agg_mode=mode, horizon=7)
    normalizer = aggregation_normalizer(mask, mode)
    parts = [
        fn(
            logp[i : i + 2],
            old[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            agg_mode=mode,
            normalizer=normalizer,
            horizon=7,
        )[0]
        for i in range(0, 5, 2)
    ]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(
        torch.autograd.grad(sum(parts), logp, retain_graph=True)[0], torch.autograd.grad(full, logp)[0]
    )


@pytest.mark.parametrize("name", list(LOSSES) + ["clip_cov"])
def test_all_masked_gives_zero_and_finite_metrics(name):
    logp, old, adv, mask = _case(10)
    none = torch.zeros_like(mask)
    fn = LOSSES.get(name, clip_cov_loss)
    loss, metrics = fn(logp, old, adv, none)
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())
    grad = torch.autograd.grad(loss, logp, allow_unused=True)[0]
    assert grad is None or (grad == 0).all()


def test_bad_hyperparameters_are_one_line_errors():
    logp, old, adv, mask = _case(0)
    with pytest.raises(ValueError, match="lower_clip_ratio must be in"):
        cispo_loss(logp, old, adv, mask, lower_clip_ratio=1.0)
    with pytest.raises(ValueError, match="divergence must be tv or kl"):
        dppo_loss(logp, old, adv, mask, divergence="js")
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        sapo_loss(logp, old, adv, mask, tau_neg=0.0)
    with pytest.raises(ValueError, match="clip_cov_ratio must be in"):
        clip_cov_loss(logp, old, adv, mask, cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_coef must be >= 0"):
        kl_cov_loss(logp, old, adv, mask, coef=-1.0)
