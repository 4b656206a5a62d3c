"""ppokit's objectives against verl 0.9.1's, on random float64 inputs (max abs difference <= 1e-6).

verl is not a dependency of ppokit (it pulls Ray, vLLM and more); its algorithm modules import
with a handful of light packages. Set-up, once (registries only, no network beyond them)::

    pip download verl==0.9.1 --no-deps -d /tmp/verlwheel
    python -m zipfile -e /tmp/verlwheel/verl-0.9.1-py3-none-any.whl /tmp/verlpkg
    pip install --no-deps --target /tmp/verldeps omegaconf antlr4-python3-runtime==4.9.3 \
        tensordict pyvers orjson codetiming
    PYTHONPATH=/tmp/verlpkg:/tmp/verldeps python bench/verl_parity.py

Each check prints its name, the largest difference of the loss and of its gradient w.r.t.
``log_prob`` (and of the metrics they share), and PASS or FAIL; the exit status is 1 on any FAIL.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

TOLERANCE = 1e-6
CHECKS: list[tuple[str, Callable[[], dict[str, float]]]] = []


def check(name: str):
    """Register a parity check: a function returning ``{quantity: max abs difference}``."""

    def decorator(fn: Callable[[], dict[str, float]]):
        CHECKS.append((name, fn))
        return fn

    return decorator


def random_batch(seed: int, rows: int = 6, cols: int = 9, spread: float = 0.3) -> dict[str, torch.Tensor]:
    """float64 log-probs near each other, signed advantages, a mask with ragged rows (one row empty
    is avoided: verl's means divide by counts + 1e-8)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3 - 0.05
    log_prob = (old + torch.randn(rows, cols, generator=g, dtype=torch.float64) * spread).clamp(max=-1e-3)
    adv = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).to(torch.float64)
    return {"old_log_prob": old, "log_prob": log_prob, "advantages": adv, "mask": mask}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs().max().item()


def main() -> int:
    try:
        import verl  # noqa: F401
    except ImportError:
        print("verl is not importable: see this script's docstring for the set-up", file=sys.stderr)
        return 2
    failed = 0
    for name, fn in CHECKS:
        diffs = fn()
        worst = max(diffs.values()) if diffs else 0.0
        ok = worst <= TOLERANCE
        failed += not ok
        detail = ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
        print(f"{'PASS' if ok else 'FAIL'}  {name:<40} {detail}")
    print(f"{len(CHECKS) - failed} of {len(CHECKS)} checks within {TOLERANCE:g}")
    return 1 if failed else 0


# ---- policy losses ------------------------------------------------------------------------------

# (verl's loss name, ppokit's AlgoConfig settings, the verl ActorConfig/PolicyLossConfig fields, agg mode)
LOSS_CASES = [
    ("vanilla", {"lower_clip_ratio": 0.2, "upper_clip_ratio": 0.28, "clip_ratio_c": 3.0}, {}, "token-mean"),
    ("cispo", {"lower_clip_ratio": 0.2, "upper_clip_ratio": 0.28}, {}, "token-mean"),
    ("cispo", {"lower_clip_ratio": 0.9, "upper_clip_ratio": 4.0}, {}, "seq-mean-token-mean"),
    ("dppo_tv", {"lower_clip_ratio": 0.05, "upper_clip_ratio": 0.08, "clip_ratio_c": 1.5}, {}, "token-mean"),
    ("dppo_kl", {"lower_clip_ratio": 0.02, "upper_clip_ratio": 0.03, "clip_ratio_c": 1.5}, {}, "token-mean"),
    ("gpg", {}, {}, "token-mean"),
    ("dro", {"dro_beta": 0.3}, {}, "seq-mean-token-sum"),
    ("sapo", {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}, {}, "seq-mean-token-mean"),
    ("geo_mean", {"lower_clip_ratio": 0.3, "upper_clip_ratio": 0.2}, {}, "seq-mean-token-mean"),
    (
        "clip_cov",
        {
            "lower_clip_ratio": 0.2,
            "upper_clip_ratio": 0.2,
            "clip_cov_ratio": 0.1,
            "clip_cov_lb": 0.05,
            "clip_cov_ub": 5.0,
        },
        {},
        "token-mean",
    ),
    ("kl_cov", {"kl_cov_ratio": 0.1, "kl_cov_coef": 0.4}, {"ppo_kl_coef": 0.4}, "token-mean"),
]
VERL_LOSS_FIELDS = {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "dro_beta"}


def _verl_actor_config(settings: dict, policy_fields: dict, agg_mode: str):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = PolicyLossConfig(**{k: v for k, v in settings.items() if k in VERL_LOSS_FIELDS}, **policy_fields)
    fields = {
        "clip_ratio_low": settings.get("lower_clip_ratio", 0.2),
        "clip_ratio_high": settings.get("upper_clip_ratio", 0.2),
        "clip_ratio_c": settings.get("clip_ratio_c", 3.0),
        "tau_pos": settings.get("sapo_tau_pos", 1.0),
        "tau_neg": settings.get("sapo_tau_neg", 1.05),
    }
    return ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        loss_agg_mode=agg_mode,
        policy_loss=policy,
        **fields,
    )


def _loss_check(verl_name: str, settings: dict, policy_fields: dict, agg_mode: str, seed: int):
    def run() -> dict[str, float]:
        import verl.trainer.ppo.core_algos as core

        from ppokit.algo import PolicyLossInputs, get_policy_loss
        from ppokit.config import AlgoConfig

        batch = random_batch(seed)
        ours_lp = batch["log_prob"].clone().requires_grad_(True)
        theirs_lp = batch["log_prob"].clone().requires_grad_(True)
        torch.manual_seed(seed)  # clip_cov draws its tokens from the global generator, as verl does
        ours, ours_metrics = get_policy_loss(verl_name)(
            PolicyLossInputs(ours_lp, batch["old_log_prob"], batch["advantages"], batch["mask"], agg_mode=agg_mode),
            AlgoConfig(loss_mode=verl_name, **settings),
        )
        torch.manual_seed(seed)
        theirs, theirs_metrics = core.get_policy_loss_fn(verl_name)(
            batch["old_log_prob"],
            theirs_lp,
            batch["advantages"],
            batch["mask"],
            agg_mode,
            _verl_actor_config(settings, policy_fields, agg_mode),
        )
        diffs = {
            "loss": max_diff(ours, theirs),
            "grad": max_diff(torch.autograd.grad(ours, ours_lp)[0], torch.autograd.grad(theirs, theirs_lp)[0]),
        }
        # verl's pg_clipfrac: geo_mean's counts A > 0 only; clip_cov's counts the covariance rule only
        ours_clipfrac = {"geo_mean": "clipfrac_upper", "clip_cov": "clip_cov_frac"}.get(verl_name, "clipfrac")
        if "actor/pg_clipfrac" in theirs_metrics and verl_name != "sapo":
            diffs["clipfrac"] = abs(ours_metrics[ours_clipfrac].item() - theirs_metrics["actor/pg_clipfrac"])
        if "actor/ppo_kl" in theirs_metrics and verl_name != "kl_cov":  # kl_cov's is the mean |log r|
            diffs["approx_kl_k1"] = abs(ours_metrics["approx_kl_k1"].item() - theirs_metrics["actor/ppo_kl"])
        return diffs

    return run


for _i, (_name, _settings, _fields, _mode) in enumerate(LOSS_CASES):
    for _seed in (0, 1):
        check(f"policy loss {_name} ({_mode}, seed {_seed})")(
            _loss_check(_name, _settings, _fields, _mode, 10 * _i + _seed)
        )


# ---- rollout correction -------------------------------------------------------------------------
# ppokit.algo.rollout_correction against verl's rollout_corr_helper on random_batch: old_log_prob
# is pi_old (the trainer's), log_prob stands for the engine's behaviour log-probs. Weights are
# compared on the valid tokens; verl's rejection is its modified response mask, ppokit's the keep.


def _verl_correction(b, **kwargs):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    proto, verl_mask, metrics = compute_rollout_correction_and_rejection_mask(
        b["old_log_prob"], b["log_prob"], b["mask"], **kwargs
    )
    weights = proto.batch["rollout_is_weights"] if proto is not None else None
    return weights, verl_mask, {k.removeprefix("rollout_corr/"): v for k, v in metrics.items()}


def _scalar_diff(ours: torch.Tensor, theirs: float) -> float:
    return abs(float(ours) - float(theirs))


def _sides(keep: torch.Tensor, mask: torch.Tensor) -> None:
    """A rejection check means something only when the batch has kept and dropped tokens."""
    valid = keep[mask != 0]
    assert 0 < float(valid.sum()) < valid.numel(), "the thresholds keep all or nothing: pick others"


def _is_check(level: str, threshold: float | str, seed: int) -> dict[str, float]:
    from ppokit import algo

    b = random_batch(seed, rows=8, cols=12, spread=0.2)
    their_w, _, theirs = _verl_correction(b, rollout_is=level, rollout_is_threshold=threshold)
    if isinstance(threshold, str):  # verl's IcePop "lower_upper": ppokit's mis band
        lower, cap = (float(v) for v in threshold.split("_"))
        mode = "mis"
    else:
        lower, cap, mode = None, float(threshold), "tis"
    w, keep, ours = algo.rollout_correction(
        b["old_log_prob"], b["log_prob"], b["mask"], mode=mode, level=level, cap=cap, lower=lower
    )
    m = b["mask"] != 0
    diffs = {
        "weight": max_diff(w[m], their_w[m]),
        "ess": _scalar_diff(ours["correction_ess"], theirs["rollout_is_eff_sample_size"]),
    }
    if mode == "tis":  # every valid token kept: verl's mean over the valid tokens is ppokit's
        diffs["weight_mean"] = _scalar_diff(ours["correction_weight_mean"], theirs["rollout_is_mean"])
        if level == "token":
            diffs["truncated_frac"] = _scalar_diff(
                ours["correction_truncated_frac"], theirs["rollout_is_ratio_fraction_high"]
            )
    else:
        _sides(keep, b["mask"])
        diffs["masked_frac"] = _scalar_diff(ours["correction_masked_frac"], theirs["rollout_is_oob_ratio"])
    if level == "token":  # verl's sequence-level max / min are the untruncated ratios
        diffs["weight_max"] = _scalar_diff(ours["correction_weight_max"], theirs["rollout_is_max"])
        diffs["weight_min"] = _scalar_diff(ours["correction_weight_min"], theirs["rollout_is_min"])
    return diffs


@check("rollout_is token (tis, C=1.2)")
def _tis_token() -> dict[str, float]:
    return _is_check("token", 1.2, seed=11)


@check("rollout_is sequence (tis, C=2)")
def _tis_sequence() -> dict[str, float]:
    return _is_check("sequence", 2.0, seed=12)


@check("rollout_is token IcePop (mis 0.8_1.25)")
def _icepop_token() -> dict[str, float]:
    return _is_check("token", "0.8_1.25", seed=13)


@check("rollout_is sequence IcePop (mis 0.8_1.25)")
def _icepop_sequence() -> dict[str, float]:
    return _is_check("sequence", "0.8_1.25", seed=14)


def _rs_check(rs: str, threshold: float | str, seed: int, **is_kwargs) -> dict[str, float]:
    from ppokit import algo
    from ppokit.config import parse_rejection_rules

    b = random_batch(seed, rows=10, cols=12, spread=0.25)
    their_w, their_mask, theirs = _verl_correction(b, rollout_rs=rs, rollout_rs_threshold=threshold, **is_kwargs)
    rules = parse_rejection_rules(rs, threshold)
    mode, level, cap = "none", "token", 2.0
    if is_kwargs:
        mode, level, cap = "tis", is_kwargs["rollout_is"], float(is_kwargs["rollout_is_threshold"])
    w, keep, ours = algo.rollout_correction(
        b["old_log_prob"], b["log_prob"], b["mask"], mode=mode, level=level, cap=cap, rejection=rules
    )
    _sides(keep, b["mask"])
    m = b["mask"] != 0
    diffs = {
        "keep": max_diff(keep, their_mask),
        "masked_frac": _scalar_diff(ours["correction_masked_frac"], theirs["rollout_rs_masked_fraction"]),
        "seq_masked_frac": _scalar_diff(ours["correction_seq_masked_frac"], theirs["rollout_rs_seq_masked_fraction"]),
    }
    for name, _, _ in rules:
        diffs[f"{name}_masked_frac"] = _scalar_diff(
            ours[f"correction_rs_{name}_masked_frac"], theirs[f"rollout_rs_{name}_masked_fraction"]
        )
        diffs[f"{name}_mean"] = _scalar_diff(ours[f"correction_rs_{name}_mean"], theirs[f"rollout_rs_{name}_mean"])
        diffs[f"{name}_max"] = _scalar_diff(ours[f"correction_rs_{name}_max"], theirs[f"rollout_rs_{name}_max"])
    if their_w is not None:  # ppokit zeroes the weight of a rejected token; verl drops it through the mask
        kept = m & (their_mask != 0)
        diffs["weight"] = max_diff(w[kept], their_w[kept])
        diffs["ess"] = _scalar_diff(ours["correction_ess"], theirs["rollout_is_eff_sample_size"])
    return diffs


_RS_CASES = {  # thresholds that keep some and drop some of random_batch's tokens / rows
    "token_k1": "0.8_1.25",
    "token_k2": 0.02,
    "token_k3": 0.02,
    "seq_sum_k1": "0.5_2.0",
    "seq_sum_k2": 0.3,
    "seq_sum_k3": 0.3,
    "seq_mean_k1": "0.95_1.05",
    "seq_mean_k2": 0.03,
    "seq_mean_k3": 0.03,
    "seq_max_k2": 0.1,
    "seq_max_k3": 0.1,
}


def _register_rs(rule: str, threshold: float | str, seed: int) -> None:
    check(f"rollout_rs {rule} ({threshold})")(lambda: _rs_check(rule, threshold, seed))


for _seed, (_rule, _threshold) in enumerate(_RS_CASES.items()):
    _register_rs(_rule, _threshold, 20 + _seed)


@check("rollout_rs seq_sum_k1 one number (2 = 0.5_2)")
def _rs_k1_single() -> dict[str, float]:
    return _rs_check("seq_sum_k1", 2.0, seed=40)


@check("rollout_rs token_k1,seq_max_k3 (two rules)")
def _rs_two_rules() -> dict[str, float]:
    return _rs_check("token_k1,seq_max_k3", "0.7_1.4,0.15", seed=41)


@check("preset decoupled_k3_rs_token_tis")
def _k3_rs_token_tis() -> dict[str, float]:
    return _rs_check("seq_mean_k3", 0.03, seed=42, rollout_is="token", rollout_is_threshold=1.2)


@check("preset decoupled_seq_is_rs")
def _seq_is_rs() -> dict[str, float]:
    return _rs_check("seq_sum_k1", "0.5_2.0", seed=43, rollout_is="sequence", rollout_is_threshold=2.0)


@check("preset decoupled_geo_rs_seq_tis")
def _geo_rs_seq_tis() -> dict[str, float]:
    return _rs_check("seq_mean_k1", "0.95_1.05", seed=44, rollout_is="sequence", rollout_is_threshold=2.0)


@check("mismatch kl (verl kl, k3_kl)")
def _mismatch() -> dict[str, float]:
    from ppokit import algo

    b = random_batch(50, rows=8, cols=12, spread=0.2)
    _, _, theirs = _verl_correction(b, rollout_is=None)
    ours = algo.mismatch_metrics(b["old_log_prob"], b["log_prob"], b["mask"])
    return {
        "kl_k1": _scalar_diff(ours["mismatch_kl_k1"], theirs["kl"]),
        "kl_k3": _scalar_diff(ours["mismatch_kl"], theirs["k3_kl"]),
    }


@check("bypass ppo_clip + seq_mean_k3 (keep)")
def _bypass_rs() -> dict[str, float]:
    """verl's bypass mode tests the rules on the current log-probs against the engine's: ppokit's
    trainer calls rollout_rejection(log_prob, rollout_log_prob, ...) the same way."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from ppokit import algo
    from ppokit.config import parse_rejection_rules

    b = random_batch(51, rows=10, cols=12, spread=0.25)
    current, engine = b["log_prob"], b["old_log_prob"]
    their_mask, _ = compute_rollout_rejection_mask(current - engine, b["mask"], "seq_mean_k3", 0.03)
    keep, _ = algo.rollout_rejection(current, engine, b["mask"], parse_rejection_rules("seq_mean_k3", 0.03))
    _sides(keep, b["mask"])
    return {"keep": max_diff(keep, their_mask)}


if __name__ == "__main__":
    sys.exit(main())
