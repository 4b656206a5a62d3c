"""Rejection rules and bypass mode in a whole single-turn run: the tiny model, the HF engine with its
behaviour log-probs lowered by SHIFT on every even row (r = pi_old / pi_engine = e^SHIFT there)."""

from __future__ import annotations

import math

import torch
from test_rollout_engine_seam import SHIFT, run_config, sevens, spy_corrections  # noqa: F401  (a fixture)

from ppokit.lm.scoring import Scorer
from ppokit.persistence.rundir import read_metrics


def even_rows(mask: torch.Tensor) -> torch.Tensor:
    return (torch.arange(mask.shape[0]) % 2 == 0)[:, None].expand_as(mask)


def test_a_k3_rule_drops_the_shifted_rows_and_logs_it(tiny_dir, tmp_path, sevens, monkeypatch):  # noqa: F811
    """verl's decoupled_k3_rs: k3 = e^0.3 - 1.3 = 0.05 per token on the even rows, ~0 on the others."""
    from ppokit.workloads import train

    seen = spy_corrections(monkeypatch)
    cfg = run_config(
        tiny_dir, tmp_path, sevens, 2, rollout_correction_rs="seq_mean_k3", rollout_correction_rs_threshold=0.01
    )
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(seen) == 2 == len(rows)
    for batch, row in zip(seen, rows):
        mask = batch["mask"].bool()
        even = even_rows(mask)
        assert float(batch["correction_keep"][mask & even].sum()) == 0.0  # every shifted row rejected
        assert bool((batch["correction_keep"][mask & ~even] == 1).all())  # the others kept
        assert bool((batch["correction_weight"][mask & ~even] == 1).all())  # no weight: rejection only
        has_token = mask.any(-1)
        assert abs(row["correction_masked_frac"] - float(even[mask].float().mean())) < 1e-6
        assert abs(row["correction_seq_masked_frac"] - float(even[:, 0][has_token].float().mean())) < 1e-6
        k3 = math.exp(SHIFT) - 1 - SHIFT
        assert abs(row["correction_rs_seq_mean_k3_max"] - k3) < 1e-4


def test_bypass_runs_without_the_scorers_actor_pass(tiny_dir, tmp_path, sevens, monkeypatch):  # noqa: F811
    """verl's bypass_ppo_clip: old_log_prob are the engine's own, no actor pass scores them, and the
    mismatch is measured by the update's first forward (e^SHIFT on the even rows)."""
    from ppokit.workloads import train

    seen = spy_corrections(monkeypatch)
    scored = []
    real = Scorer.forward_passes

    def spy(self, tensors, old_log_prob=True):
        out = real(self, tensors, old_log_prob)
        scored.append(sorted(out))
        return out

    monkeypatch.setattr(Scorer, "forward_passes", spy)
    cfg = run_config(tiny_dir, tmp_path, sevens, 2, rollout_correction_bypass=True)
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(seen) == 2 == len(rows) and scored
    assert all("old_log_prob" not in keys and "old_values" in keys for keys in scored)  # critic only
    for batch, row in zip(seen, rows):
        assert torch.equal(batch["old_log_prob"], batch["rollout_log_prob"])
        assert "correction_weight" not in batch and "correction_keep" not in batch
        assert abs(row["mismatch_ratio_max"] - math.exp(SHIFT)) < 1e-3 * math.exp(SHIFT)
        assert abs(row["mismatch_ratio_min"] - 1.0) < 1e-3
        assert row["mismatch_kl"] > 0.01
