"""Rollout correction (TIS, MIS) and the mismatch metrics against float64 loops written out."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit import algo
from ppokit.algo import UnknownNameError


def random_case(seed: int = 0, b: int = 6, t: int = 7, scale: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=g, dtype=torch.float64) - 2.0
    rollout = old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    mask[1] = 0.0  # a row without a token
    old[mask == 0] = float("inf")  # padding may hold anything
    rollout[mask == 0] = float("nan")
    return old, rollout, mask


def naive_rho(old, rollout, mask, level):
    """rho per token, row by row in Python floats (module formula), 1 on padding."""
    out = torch.ones_like(old)
    for b in range(old.shape[0]):
        logs = [float(old[b, t] - rollout[b, t]) for t in range(old.shape[1]) if mask[b, t]]
        for t in range(old.shape[1]):
            if not mask[b, t]:
                continue
            if level == "token":
                value = float(old[b, t] - rollout[b, t])
            elif level == "sequence":
                value = sum(logs)
            else:
                value = sum(logs) / max(len(logs), 1)
            out[b, t] = math.exp(min(max(value, -20.0), 20.0))
    return out


def naive_correction(old, rollout, mask, mode, level, cap, lower):
    rho = naive_rho(old, rollout, mask, level)
    weight, keep = torch.zeros_like(old), torch.zeros_like(old)
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[b, t]:
                continue
            r = float(rho[b, t])
            if mode == "none":
                weight[b, t], keep[b, t] = 1.0, 1.0
            elif mode == "tis":
                weight[b, t], keep[b, t] = min(r, cap), 1.0
            else:
                inside = lower <= r <= cap
                weight[b, t], keep[b, t] = (r if inside else 0.0), float(inside)
    return weight, keep


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_the_ratio_of_each_level(level):
    old, rollout, mask = random_case()
    rho = algo.correction_ratio(old, rollout, mask, level)
    torch.testing.assert_close(rho, naive_rho(old, rollout, mask, level), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "mode,level,cap,lower",
    [
        ("none", "token", 2.0, None),
        ("tis", "token", 1.3, None),
        ("tis", "sequence", 2.0, None),
        ("mis", "token", 1.3, None),
        ("mis", "token", 1.3, 0.0),
        ("mis", "sequence", 3.0, 0.0),  # TRL's default: a sequence's ratio, masked above 3
        ("mis", "geometric", 1.1, 0.9),
    ],
)
def test_weights_and_kept_tokens_match_the_formula(mode, level, cap, lower):
    old, rollout, mask = random_case(seed=3)
    weight, keep, metrics = algo.rollout_correction(old, rollout, mask, mode=mode, level=level, cap=cap, lower=lower)
    want_weight, want_keep = naive_correction(
        old, rollout, mask, mode, level, cap, 1.0 / cap if lower is None else lower
    )
    torch.testing.assert_close(weight, want_weight, rtol=1e-12, atol=0)
    torch.testing.assert_close(keep, want_keep, rtol=0, atol=0)
    kept = want_keep.bool()
    assert float(metrics["correction_weight_mean"]) == pytest.approx(
        float(want_weight[kept].mean()) if kept.any() else 0.0, rel=1e-12
    )
    valid = mask.bool()
    rho = naive_rho(old, rollout, mask, level)
    if mode == "tis":
        assert float(metrics["correction_truncated_frac"]) == pytest.approx(float((rho[valid] > cap).double().mean()))
        assert 0 < float(metrics["correction_truncated_frac"]) < 1  # the case exercises both sides
    if mode == "mis":
        assert float(metrics["correction_masked_frac"]) == pytest.approx(float((want_keep[valid] == 0).double().mean()))
        assert 0 < float(metrics["correction_masked_frac"]) < 1
    assert not weight.isnan().any() and not keep.isnan().any()  # nan / inf padding selected away


def test_float32_inputs_agree_with_float64():
    old, rollout, mask = random_case(seed=5)
    old, rollout = old.masked_fill(mask == 0, 0.0), rollout.masked_fill(mask == 0, 0.0)
    w64, k64, _ = algo.rollout_correction(old, rollout, mask, mode="tis", level="sequence", cap=2.0)
    w32, k32, _ = algo.rollout_correction(old.float(), rollout.float(), mask.float(), mode="tis", level="sequence")
    torch.testing.assert_close(w32.double(), w64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k32.double(), k64)


def test_identical_log_probs_change_nothing():
    old, _, mask = random_case(seed=1)
    old = old.masked_fill(mask == 0, 0.0)
    for mode in ("tis", "mis"):
        weight, keep, _ = algo.rollout_correction(old, old.clone(), mask, mode=mode, level="sequence", cap=1.5)
        torch.testing.assert_close(weight, mask)
        torch.testing.assert_close(keep, mask)
    metrics = algo.mismatch_metrics(old, old.clone(), mask)
    assert float(metrics["mismatch_kl"]) == 0.0 and float(metrics["mismatch_kl_k1"]) == 0.0
    assert float(metrics["mismatch_ratio_max"]) == 1.0 == float(metrics["mismatch_ratio_min"])


def test_mismatch_metrics_match_a_loop():
    old, rollout, mask = random_case(seed=7)
    metrics = algo.mismatch_metrics(old, rollout, mask)
    logs = [float(old[b, t] - rollout[b, t]) for b in range(old.shape[0]) for t in range(old.shape[1]) if mask[b, t]]
    k3 = sum(math.exp(x) - 1 - x for x in logs) / len(logs)
    assert float(metrics["mismatch_kl"]) == pytest.approx(k3, rel=1e-12)
    assert float(metrics["mismatch_kl_k1"]) == pytest.approx(-sum(logs) / len(logs), rel=1e-12)
    assert float(metrics["mismatch_ratio_max"]) == pytest.approx(math.exp(max(logs)), rel=1e-12)
    assert float(metrics["mismatch_ratio_min"]) == pytest.approx(math.exp(min(logs)), rel=1e-12)
    assert float(metrics["mismatch_kl"]) > 0


def test_no_token_at_all_and_a_single_token():
    empty = torch.zeros(2, 3)
    metrics = algo.mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), empty)
    assert {k: float(v) for k, v in metrics.items()} == {
        "mismatch_kl": 0.0,
        "mismatch_kl_k1": 0.0,
        "mismatch_ratio_max": 1.0,
        "mismatch_ratio_min": 1.0,
    }
    weight, keep, m = algo.rollout_correction(torch.zeros(2, 3), torch.ones(2, 3), empty, mode="mis")
    assert float(weight.abs().sum()) == 0 and float(keep.sum()) == 0 and float(m["correction_weight_mean"]) == 0.0
    one = torch.tensor([[1.0]])
    old, rollout = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])  # r = e^0.5 = 1.65
    assert float(algo.rollout_correction(old, rollout, one, mode="tis", cap=1.5)[0]) == 1.5
    assert float(algo.rollout_correction(old, rollout, one, mode="mis", cap=1.5)[1]) == 0.0
    assert float(algo.rollout_correction(old, rollout, one, mode="mis", cap=2.0)[0]) == pytest.approx(math.exp(0.5))


def test_huge_log_ratios_stay_finite():
    mask = torch.ones(1, 4)
    old = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-80.0, -1.0, -2.0, -3.0]])  # r = e^80 on the first token
    rho = algo.correction_ratio(old, rollout, mask, "sequence")
    assert torch.isfinite(rho).all() and float(rho[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-6)
    weight, keep, _ = algo.rollout_correction(old, rollout, mask, mode="mis", level="token", cap=2.0)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 1.0]] and weight.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert float(algo.mismatch_metrics(old, rollout, mask)["mismatch_ratio_max"]) == pytest.approx(math.exp(20.0))


def test_bad_names_and_arguments_are_clear():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(UnknownNameError, match="did you mean 'tis'"):
        algo.rollout_correction(x, x, m, mode="tsi")
    with pytest.raises(ValueError, match="level 'row'"):
        algo.rollout_correction(x, x, m, mode="tis", level="row")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        algo.rollout_correction(x, x, m, mode="tis", cap=0.5)
    with pytest.raises(ValueError, match="share one"):
        algo.mismatch_metrics(x, torch.zeros(2, 4), m)
    assert algo.ROLLOUT_CORRECTIONS.names() == ("none", "tis", "mis")


# ---- rejection rules (verl's rollout_rs), their combination with a weight, the weight's metrics


def naive_statistic(old, rollout, mask, rule):
    """(B, T) the statistic each token is tested by (a row's value on each of its tokens), from Python
    floats, and (B,) the row values (None for token rules)."""
    kind = rule[-2:]

    def k(x):
        x = min(max(x, -20.0), 20.0)
        return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[kind]

    per_token = torch.zeros_like(old)
    rows = torch.zeros(old.shape[0], dtype=torch.float64)
    for b in range(old.shape[0]):
        values = [k(float(old[b, t] - rollout[b, t])) for t in range(old.shape[1]) if mask[b, t]]
        if rule.startswith("seq_sum"):
            rows[b] = sum(values)
        elif rule.startswith("seq_mean"):
            rows[b] = sum(values) / len(values) if values else 0.0
        elif rule.startswith("seq_max"):
            rows[b] = max(values) if values else 0.0
        for t in range(old.shape[1]):
            if mask[b, t]:
                per_token[b, t] = k(float(old[b, t] - rollout[b, t])) if rule.startswith("token") else rows[b]
    return per_token, (None if rule.startswith("token") else rows)


def naive_keep(old, rollout, mask, rules):
    keep = mask.clone()
    for name, lower, upper in rules:
        stat, _ = naive_statistic(old, rollout, mask, name)
        for b in range(old.shape[0]):
            for t in range(old.shape[1]):
                if not mask[b, t]:
                    continue
                s = float(stat[b, t])
                ok = math.log(lower) <= s <= math.log(upper) if name.endswith("k1") else s <= upper
                keep[b, t] *= float(ok)
    return keep


RULE_CASES = [
    ("token_k1", 0.8, 1.25),
    ("token_k2", None, 0.02),
    ("token_k3", None, 0.02),
    ("seq_sum_k1", 0.5, 2.0),
    ("seq_sum_k2", None, 0.15),
    ("seq_sum_k3", None, 0.15),
    ("seq_mean_k1", 0.95, 1.05),
    ("seq_mean_k2", None, 0.03),
    ("seq_mean_k3", None, 0.03),
    ("seq_max_k2", None, 0.08),
    ("seq_max_k3", None, 0.08),
]


def test_every_verl_rule_is_covered():
    assert tuple(name for name, _, _ in RULE_CASES) == algo.REJECTION_RULES


@pytest.mark.parametrize("rule", RULE_CASES, ids=[r[0] for r in RULE_CASES])
def test_each_rejection_rule_matches_a_loop(rule):
    old, rollout, mask = random_case(seed=11, b=10, t=9, scale=0.25)
    keep, metrics = algo.rollout_rejection(old, rollout, mask, [rule])
    want = naive_keep(old, rollout, mask, [rule])
    torch.testing.assert_close(keep, want, rtol=0, atol=0)
    valid = mask.bool()
    assert 0 < float(want[valid].sum()) < int(valid.sum())  # the case keeps some tokens and drops some
    name = rule[0]
    stat, rows = naive_statistic(old, rollout, mask, name)
    assert float(metrics[f"correction_rs_{name}_masked_frac"]) == pytest.approx(
        float((want[valid] == 0).double().mean()), rel=1e-12
    )
    assert float(metrics[f"correction_rs_{name}_mean"]) == pytest.approx(float(stat[valid].mean()), rel=1e-10)
    has_row = valid.any(-1)
    top = float(stat[valid].max()) if rows is None else float(rows[has_row].max())
    assert float(metrics[f"correction_rs_{name}_max"]) == pytest.approx(top, rel=1e-10)
    got = algo.rejection_statistic(old, rollout, mask, name)
    torch.testing.assert_close(got, stat if rows is None else rows, rtol=1e-12, atol=1e-15)
    assert not keep.isnan().any()  # inf / nan padding selected away


def test_rules_combine_and_a_sequence_rule_drops_whole_rows():
    old, rollout, mask = random_case(seed=12, b=10, t=9, scale=0.25)
    rules = [("token_k1", 0.7, 1.4), ("seq_max_k3", None, 0.08)]
    keep, metrics = algo.rollout_rejection(old, rollout, mask, rules)
    want = naive_keep(old, rollout, mask, rules)
    torch.testing.assert_close(keep, want, rtol=0, atol=0)
    row_keep, _ = algo.rollout_rejection(old, rollout, mask, rules[1:])
    for b in range(mask.shape[0]):  # a row rule keeps all of a row's tokens or none
        assert float(row_keep[b].sum()) in (0.0, float(mask[b].sum()))
    valid = mask.bool()
    assert 0 < float(keep[valid].sum()) < int(valid.sum())
    assert float(keep[valid].sum()) < float(row_keep[valid].sum())  # the token rule dropped more


@pytest.mark.parametrize(
    "mode,level,cap,lower,rules",
    [
        ("tis", "token", 1.2, None, [("seq_mean_k3", None, 0.03)]),  # verl's decoupled_k3_rs_token_tis
        ("tis", "sequence", 2.0, None, [("seq_sum_k1", 0.5, 2.0)]),  # verl's decoupled_seq_is_rs
        ("tis", "sequence", 2.0, None, [("seq_mean_k1", 0.95, 1.05)]),  # decoupled_geo_rs_seq_tis
        ("none", "token", 2.0, None, [("seq_mean_k3", None, 0.03)]),  # decoupled_k3_rs
        ("mis", "token", 1.3, None, [("seq_max_k2", None, 0.08)]),
    ],
)
def test_a_weight_and_rules_together(mode, level, cap, lower, rules):
    old, rollout, mask = random_case(seed=13, b=10, t=9, scale=0.25)
    weight, keep, metrics = algo.rollout_correction(
        old, rollout, mask, mode=mode, level=level, cap=cap, lower=lower, rejection=rules
    )
    band = 1.0 / cap if lower is None else lower
    is_weight, is_keep = naive_correction(old, rollout, mask, mode, level, cap, band)
    rs_keep = naive_keep(old, rollout, mask, rules)
    torch.testing.assert_close(keep, is_keep * rs_keep, rtol=0, atol=0)
    torch.testing.assert_close(weight, is_weight * rs_keep, rtol=1e-12, atol=0)
    valid = mask.bool()
    dropped = (keep == 0) & valid
    assert 0 < int(dropped.sum()) < int(valid.sum())
    assert float(metrics["correction_masked_frac"]) == pytest.approx(float(dropped[valid].double().mean()))
    rows = valid.any(-1)
    seq_dropped = [bool(dropped[b].any()) for b in range(mask.shape[0]) if rows[b]]
    assert float(metrics["correction_seq_masked_frac"]) == pytest.approx(sum(seq_dropped) / len(seq_dropped))
    if mode != "none":
        w = [float(is_weight[b, t]) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
        ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w))  # (sum w)^2 / (N sum w^2)
        assert float(metrics["correction_ess"]) == pytest.approx(ess, rel=1e-12)
        assert float(metrics["correction_weight_max"]) == pytest.approx(max(w), rel=1e-12)
        assert float(metrics["correction_weight_min"]) == pytest.approx(min(w), rel=1e-12)
        assert 0 < float(metrics["correction_ess"]) < 1
    else:
        assert "correction_ess" not in metrics and "correction_weight_max" not in metrics
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


def test_cap_one_truncates_every_ratio_above_one_and_ess_is_one_for_equal_weights():
    old, rollout, mask = random_case(seed=14)
    weight, _, metrics = algo.rollout_correction(old, rollout, mask, mode="tis", level="token", cap=1.0)
    rho = naive_rho(old, rollout, mask, "token")
    torch.testing.assert_close(weight, rho.clamp(max=1.0) * mask, rtol=1e-12, atol=0)
    assert float(metrics["correction_weight_max"]) == 1.0
    same = old.masked_fill(mask == 0, 0.0)
    _, _, equal = algo.rollout_correction(same, same - 0.1 * mask, mask, mode="tis", level="token", cap=2.0)
    assert float(equal["correction_ess"]) == pytest.approx(1.0, rel=1e-12)  # every weight e^0.1


def test_the_bounds_are_inclusive():
    mask = torch.ones(1, 2, dtype=torch.float64)
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # log r = 0.5: k2 = 0.125 exactly
    kept, _ = algo.rollout_rejection(old, rollout, mask, [("token_k2", None, 0.125)])
    dropped, _ = algo.rollout_rejection(old, rollout, mask, [("token_k2", None, 0.1249)])
    assert kept.tolist() == [[1.0, 1.0]] and dropped.tolist() == [[0.0, 1.0]]


def test_no_valid_token_and_empty_rows():
    empty = torch.zeros(3, 4)
    old, rollout = torch.full((3, 4), float("nan")), torch.full((3, 4), float("inf"))
    rules = [("seq_mean_k3", None, 0.01), ("token_k1", 0.5, 2.0), ("seq_max_k2", None, 0.1)]
    weight, keep, metrics = algo.rollout_correction(old, rollout, empty, mode="tis", rejection=rules)
    assert float(weight.abs().sum()) == 0 and float(keep.sum()) == 0
    for key, value in metrics.items():
        assert math.isfinite(float(value)), key
    assert float(metrics["correction_masked_frac"]) == 0.0 and float(metrics["correction_seq_masked_frac"]) == 0.0
    assert float(metrics["correction_ess"]) == 0.0
    # an empty row among others: its statistic is 0, it is not counted as a masked sequence
    old, rollout, mask = random_case(seed=15)  # row 1 has no token
    stat = algo.rejection_statistic(old, rollout, mask, "seq_mean_k3")
    assert float(stat[1]) == 0.0 and torch.isfinite(stat).all()
    _, _, metrics = algo.rollout_correction(old, rollout, mask, rejection=[("seq_mean_k3", None, 1e-9)])
    assert float(metrics["correction_seq_masked_frac"]) == 1.0  # every row with a token loses it


def test_a_k1_rule_without_a_band_and_an_unknown_rule_are_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs a ratio band"):
        algo.rollout_rejection(x, x, m, [("seq_sum_k1", None, 2.0)])
    with pytest.raises(ValueError, match="unknown rejection rule 'seq_max_k1'"):
        algo.rollout_rejection(x, x, m, [("seq_max_k1", 0.5, 2.0)])
