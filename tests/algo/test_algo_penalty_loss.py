"""PPO with an adaptive KL penalty (the PPO paper's second variant): value, gradient, metrics, registry."""

import inspect
import math

import pytest
import torch

from ppokit.algo import (
    POLICY_LOSSES,
    PolicyLossInputs,
    UnknownNameError,
    aggregate,
    aggregation_normalizer,
    get_policy_loss,
    policy_loss,
    ppo_penalty_loss,
)
from ppokit.config import AlgoConfig

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LEVELS = ["token", "sequence", "gspo"]
D = torch.float64


def _agg_weights(mask, mode):
    """w[b][t]: the weight of a valid position's loss in ``mode`` (0 elsewhere), by loops."""
    B, T = mask.shape
    lens = [int(sum(bool(mask[b, t]) for t in range(T))) for b in range(B)]
    n_tok = max(sum(lens), 1)
    per_mode = {
        "token-mean": lambda b: 1.0 / n_tok,
        "seq-mean-token-sum": lambda b: 1.0 / B,
        "seq-mean-token-mean": lambda b: 1.0 / (B * lens[b]),
        "seq-mean-token-sum-norm": lambda b: 1.0 / (B * T),
    }[mode]
    return [[per_mode(b) if mask[b, t] else 0.0 for t in range(T)] for b in range(B)]


def _naive_penalty(logp, old, adv, mask, beta, mode, level):
    """The penalty loss and its gradient w.r.t. logp, by loops in float64.

    L_bt = -A rho + beta ((r_t - 1) - log r_t); d/d logp_bt of the KL term: beta (r_t - 1).
    token: rho = r_t, d/d logp_bt = r_t; sequence: rho = prod_t r_t with the row's mean
    advantage, on every token, d rho / d logp_bt' = rho; gspo: rho = s_b = (prod_t r_t)^(1/n_b),
    d rho_bt / d logp_bt = s_b (and 0 for t' != t, the stop-gradient of GSPO-token).
    """
    B, T = logp.shape
    w = _agg_weights(mask, mode)
    loss, grad = 0.0, torch.zeros(B, T, dtype=D)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        if not valid:
            continue
        lr = {t: logp[b, t].item() - old[b, t].item() for t in valid}
        a_row = sum(adv[b, t].item() for t in valid) / len(valid)
        r_seq = math.exp(sum(lr.values()))
        s = math.exp(sum(lr.values()) / len(valid))
        for t in valid:
            r = math.exp(lr[t])
            kl = (r - 1) - lr[t]
            if level == "token":
                surr, d_surr = -adv[b, t].item() * r, -adv[b, t].item() * r
            elif level == "gspo":
                surr, d_surr = -adv[b, t].item() * s, -adv[b, t].item() * s
            else:
                surr, d_surr = -a_row * r_seq, 0.0
                for t2 in valid:  # this token's copy of the row loss moves with every token of the row
                    grad[b, t2] += w[b][t] * (-a_row * r_seq)
            loss += w[b][t] * (surr + beta * kl)
            grad[b, t] += w[b][t] * (d_surr + beta * (r - 1))
    return loss, grad


def _case(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=D) - 2
    logp = old + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = True
    mask[1] = False  # an empty row
    mask[2] = False
    mask[2, 4] = True  # a single-token row
    logp = torch.where(mask, logp, torch.full_like(logp, float("-inf")))  # garbage padding
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    adv = torch.where(mask, adv, torch.full_like(adv, float("inf")))
    return logp.requires_grad_(), old, adv, mask


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_naive(mode, level):
    for seed, beta in ((0, 0.5), (1, 3.0), (2, 0.0)):
        logp, old, adv, mask = _case(seed)
        loss, m = ppo_penalty_loss(logp, old, adv, mask, agg_mode=mode, ratio_level=level, penalty_coef=beta)
        (grad,) = torch.autograd.grad(loss, logp)
        ref_loss, ref_grad = _naive_penalty(logp.detach(), old, adv, mask, beta, mode, level)
        assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
        assert (grad[~mask] == 0).all()


def test_metrics():
    old = torch.zeros(2, 3, dtype=D)
    r = [[0.5, 1.5, 9.0], [2.0, 1.0, 1.0]]  # [0, 2] and [1, 2] are padding
    logp = torch.log(torch.tensor(r, dtype=D))
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.ones(2, 3, dtype=D)
    _, m = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=1.0)
    valid = [0.5, 1.5, 2.0, 1.0]
    k3 = sum((x - 1) - math.log(x) for x in valid) / 4
    expected = {
        "kl_old": k3,
        "clipfrac": 0.0,
        "approx_kl_k1": sum(-math.log(x) for x in valid) / 4,
        "approx_kl_k3": k3,
        "ratio_max": 2.0,
        "ratio_mean": 5.0 / 4,
        "ratio_min": 0.5,
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        assert m[k].dim() == 0 and not m[k].requires_grad and m[k].dtype == D, k
        assert m[k].item() == pytest.approx(v, abs=1e-14), k
    _, small = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=1.0, diagnostics=False)
    assert set(small) == {"kl_old", "clipfrac", "approx_kl_k1", "approx_kl_k3", "ratio_max"}
    for k, v in small.items():
        assert torch.equal(v, m[k]), k
    # sequence level: ratios per row (the product of the token ratios), the KL stays per token
    _, ms = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=1.0, ratio_level="sequence")
    assert ms["ratio_max"].item() == pytest.approx(2.0) and ms["ratio_min"].item() == pytest.approx(0.75)
    assert ms["kl_old"].item() == pytest.approx(k3, abs=1e-14)


def test_at_ratio_one_the_penalty_is_zero_and_pulls_nowhere():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=g, dtype=D)
    adv = torch.randn(4, 5, generator=g, dtype=D)
    mask = torch.rand(4, 5, generator=g) < 0.8
    for mode in MODES:
        logp = old.clone().requires_grad_()
        loss, m = ppo_penalty_loss(logp, old, adv, mask, agg_mode=mode, penalty_coef=10.0)
        free, _ = ppo_penalty_loss(logp, old, adv, mask, agg_mode=mode, penalty_coef=0.0)
        assert loss.item() == pytest.approx(-aggregate(adv, mask, mode).item(), abs=1e-15)
        g1, g2 = (torch.autograd.grad(x, logp)[0] for x in (loss, free))
        torch.testing.assert_close(g1, g2, rtol=0, atol=0)  # d KL_t / d log pi_t = r_t - 1 = 0
        assert m["kl_old"].item() == 0.0


def test_the_penalty_grows_with_the_coefficient_and_is_never_negative():
    logp, old, adv, mask = _case(4)
    l0, m = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=0.0)
    l1, _ = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=1.0)
    l2, _ = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=2.0)
    assert m["kl_old"].item() > 0
    assert (l1 - l0).item() == pytest.approx(m["kl_old"].item(), rel=1e-12)  # token-mean of KL_t
    assert (l2 - l0).item() == pytest.approx(2 * m["kl_old"].item(), rel=1e-12)


def test_tensor_coefficient_and_validation():
    logp, old, adv, mask = _case(5)
    a, _ = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=0.3)
    b, _ = ppo_penalty_loss(logp, old, adv, mask, penalty_coef=torch.tensor(0.3, dtype=D))
    assert a.item() == b.item()
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="penalty_coef must be a finite number >= 0"):
            ppo_penalty_loss(logp, old, adv, mask, penalty_coef=bad)
    with pytest.raises(ValueError, match="penalty_coef must be a number or a 0-dim tensor"):
        ppo_penalty_loss(logp, old, adv, mask, penalty_coef=torch.ones(2))
    with pytest.raises(TypeError, match="penalty_coef"):
        ppo_penalty_loss(logp, old, adv, mask)  # no silent default for the coefficient
    with pytest.raises(ValueError, match="ratio_level"):
        ppo_penalty_loss(logp, old, adv, mask, penalty_coef=0.1, ratio_level="seq")
    with pytest.raises(ValueError, match="did you mean 'token-mean'"):
        ppo_penalty_loss(logp, old, adv, mask, penalty_coef=0.1, agg_mode="token_mean")
    with pytest.raises(ValueError, match=r"mask shape \(6, 6\)"):
        ppo_penalty_loss(logp, old, adv, mask[:, :6], penalty_coef=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_add_up_to_the_mini_batch(mode):
    logp, old, adv, mask = _case(6, B=8, T=5)
    adv = torch.where(mask, adv, 0.0)
    n = aggregation_normalizer(mask, mode)
    full, _ = ppo_penalty_loss(logp, old, adv, mask, agg_mode=mode, normalizer=n, horizon=5, penalty_coef=0.7)
    parts = [
        ppo_penalty_loss(
            logp[i : i + 3],
            old[i : i + 3],
            adv[i : i + 3],
            mask[i : i + 3],
            agg_mode=mode,
            normalizer=n,
            horizon=5,
            penalty_coef=0.7,
        )[0]
        for i in range(0, 8, 3)
    ]
    g_full = torch.autograd.grad(full, logp)[0]
    g_parts = torch.autograd.grad(sum(parts), logp)[0]
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-14)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-16)


# ----------------------------------------------------------------------------- registry


def test_registry_lookup_and_errors():
    assert get_policy_loss("clip").fn is policy_loss
    assert get_policy_loss("clip") is get_policy_loss("ppo") is get_policy_loss("vanilla")
    assert get_policy_loss("penalty").fn is ppo_penalty_loss
    assert get_policy_loss("penalty") is get_policy_loss("ppo_penalty")
    with pytest.raises(UnknownNameError, match=r"^unknown policy loss 'penalti'; did you mean 'penalty'\? valid: "):
        get_policy_loss("penalti")
    with pytest.raises(UnknownNameError, match="did you mean 'clip'"):
        get_policy_loss("clp")


COMMON_KEYWORDS = {"agg_mode", "normalizer", "horizon", "diagnostics"}
OWN_KEYWORDS = {
    "clip": {"lower_clip_ratio", "upper_clip_ratio", "clip_ratio_c", "ratio_level"},
    "penalty": {"penalty_coef", "ratio_level"},
    "cispo": {"lower_clip_ratio", "upper_clip_ratio"},
    "dppo_tv": {"divergence", "lower_divergence", "upper_divergence", "ratio_cap"},
    "dppo_kl": {"divergence", "lower_divergence", "upper_divergence", "ratio_cap"},
    "gpg": set(),
    "dro": {"beta"},
    "sapo": {"tau_pos", "tau_neg"},
    "geo_mean": {"lower_clip_ratio", "upper_clip_ratio"},
    "clip_cov": {"lower_clip_ratio", "upper_clip_ratio", "cov_ratio", "cov_lower", "cov_upper"},
    "kl_cov": {"cov_ratio", "coef"},
}


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_loss_has_the_uniform_signature(name):
    params = list(inspect.signature(get_policy_loss(name).fn).parameters.values())
    assert [p.name for p in params[:4]] == ["log_prob", "old_log_prob", "advantages", "mask"]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params[:4])
    keywords = {p.name for p in params[4:]}
    assert all(p.kind == p.KEYWORD_ONLY for p in params[4:])
    assert keywords == COMMON_KEYWORDS | OWN_KEYWORDS[name]
    assert set(OWN_KEYWORDS) == set(POLICY_LOSSES.names())  # a new loss must be listed here


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_loss_reads_its_settings_from_the_algo_config(name):
    """The one call a trainer makes: the settings each loss reads exist on AlgoConfig, and the
    registered call equals the function called with them as keywords."""
    logp, old, adv, mask = _case(11)
    adv = torch.where(mask, adv, 0.0)
    a = AlgoConfig(loss_mode=name, dro_beta=0.3, clip_ratio_c=3.0)
    inputs = PolicyLossInputs(logp, old, adv, mask, agg_mode="seq-mean-token-mean", penalty_coef=0.2)
    entry = get_policy_loss(name)
    own = entry.settings(a, inputs)
    assert set(own) == OWN_KEYWORDS[name] - {"divergence"}
    torch.manual_seed(0)  # clip_cov draws its tokens
    via_registry, metrics = entry(inputs, a)
    torch.manual_seed(0)
    direct, _ = entry.fn(logp, old, adv, mask, agg_mode="seq-mean-token-mean", **own)
    assert via_registry.item() == direct.item()
    for key in ("clipfrac", "approx_kl_k1", "approx_kl_k3", "ratio_max"):  # what a trainer logs of any loss
        assert metrics[key].dim() == 0 and torch.isfinite(metrics[key]), key


@pytest.mark.parametrize("level", LEVELS)
def test_generic_call_through_the_registry(level):
    """Both PPO losses called the same way; with no clipping active and beta = 0 they agree."""
    logp, old, adv, mask = _case(7)
    adv = torch.where(mask, adv, 0.0)
    a = AlgoConfig(lower_clip_ratio=0.999, upper_clip_ratio=1e6, ratio_level=level)
    inputs = PolicyLossInputs(logp, old, adv, mask, agg_mode="seq-mean-token-mean", penalty_coef=0.0)
    results = {name: get_policy_loss(name)(inputs, a) for name in ("clip", "penalty")}
    (lc, mc), (lp, mp) = results["clip"], results["penalty"]
    assert lc.item() == pytest.approx(lp.item(), rel=1e-13)
    torch.testing.assert_close(
        torch.autograd.grad(lc, logp)[0], torch.autograd.grad(lp, logp)[0], rtol=1e-12, atol=1e-16
    )
    for key in ("clipfrac", "approx_kl_k1", "approx_kl_k3", "ratio_max"):  # what a trainer logs for either
        assert mc[key].item() == pytest.approx(mp[key].item(), abs=1e-14), key
