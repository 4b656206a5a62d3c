"""What a user must hear about a run while it runs: PPO with nothing to learn from, or running away.

The run loop hands every iteration's metrics to :meth:`RunHealth.check`, which returns the
lines to print (each said once per run). It reads metrics by name, so any workload that
logs them is watched:

**No signal** (``reward_std``, logged by the language-model source): when every sampled
response of the first :data:`NO_SIGNAL_ITERATIONS` iterations got the same reward, the
advantages are zero (group estimators) or the critic's noise (GAE), and PPO learns
nothing. The usual causes, each with its field: sampling too hot for the model
(``rollout.temperature``; the held-out check before PPO compares greedy and sampled
accuracy), responses cut short (``truncated_frac``, ``rollout.max_new_tokens``), a task
the model cannot do yet (a warm start, ``data.sft_epochs``).

**Runaway updates** (``approx_kl``, ``clipfrac``): PPO's clipped objective keeps each update
near the policy that sampled the batch; an update whose mean KL to it (k3 estimator)
exceeds :data:`KL_ALARM`, or that clips more than :data:`CLIPFRAC_ALARM` of its tokens,
has left that region, most often from a learning rate made for another mode (LoRA
adapters take rates ~100x a full fine-tune's). Measured on the ``arith`` preset
(docs/performance.md, "Run health"): its LoRA updates stay under approx_kl 0.05; the same
preset in full mode, at the LoRA learning rate, starts at 0.5 and its held-out accuracy
falls to 0%.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CLIPFRAC_ALARM", "KL_ALARM", "NO_SIGNAL_ITERATIONS", "RunHealth"]

NO_SIGNAL_ITERATIONS = 2  # iterations in a row from the start without any reward variance
KL_ALARM = 0.2  # approx_kl (k3) of one iteration's update
CLIPFRAC_ALARM = 0.5  # the share of clipped tokens of one iteration's update


class RunHealth:
    """Watches a run's metrics (module docstring); ``cfg``: the run's config, for the advice."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.flat_iterations = 0  # iterations in a row, from the start, whose rewards were all equal
        self.said: set[str] = set()

    def check(self, iteration: int, metrics: dict[str, Any]) -> list[str]:
        """The lines to print after ``iteration`` (each kind once per run)."""
        lines = [self._no_signal(iteration, metrics), self._runaway(iteration, metrics)]
        return [line for line in lines if line]

    def _once(self, kind: str, line: str) -> str | None:
        if kind in self.said:
            return None
        self.said.add(kind)
        return line

    def _no_signal(self, iteration: int, metrics: dict[str, Any]) -> str | None:
        std = _number(metrics.get("reward_std"))
        if std is None or iteration != self.flat_iterations:  # only a run's first iterations count
            return None
        if std > 0:
            self.flat_iterations = -1  # the run has had a signal: never again
            return None
        self.flat_iterations += 1
        if self.flat_iterations < NO_SIGNAL_ITERATIONS:
            return None
        reward = _number(metrics.get("reward_mean"))
        r = self.cfg.rollout
        fixes = [f"lower rollout.temperature (now {r.temperature:g}) if greedy answers score better than sampled ones"]
        truncated = _number(metrics.get("truncated_frac"))
        if truncated:
            cut = f"{truncated:.0%} of responses were cut"
            fixes.append(f"raise rollout.max_new_tokens (now {r.max_new_tokens}): {cut}")
        fixes.append("warm-start on examples of the task (data.sft_epochs) or use an easier task")
        scored = f"the same reward ({reward:g})" if reward is not None else "the same reward"
        return self._once(
            "no_signal",
            f"iterations 0-{iteration}: every sampled response got {scored}, so PPO has nothing to learn "
            f"from; {'; '.join(fixes)}",
        )

    def _runaway(self, iteration: int, metrics: dict[str, Any]) -> str | None:
        kl, clipped = _number(metrics.get("approx_kl")), _number(metrics.get("clipfrac"))
        too_far = (kl is not None and kl > KL_ALARM) or (clipped is not None and clipped > CLIPFRAC_ALARM)
        if not too_far:
            return None
        t = self.cfg.train
        measured = ", ".join(
            text
            for text in (
                f"approx_kl {kl:.3g} (alarm above {KL_ALARM:g})" if kl is not None else "",
                f"clip fraction {clipped:.2f} (alarm above {CLIPFRAC_ALARM:g})" if clipped is not None else "",
            )
            if text
        )
        mode = getattr(getattr(self.cfg, "model", None), "mode", None)
        rate = f"lower train.learning_rate (now {t.learning_rate:g}"
        rate += "; full fine-tuning usually wants 1e-6 to 1e-5)" if mode == "full" else ")"
        return self._once(
            "runaway",
            f"iteration {iteration}: the update moved the policy far beyond PPO's clip range ({measured}); "
            f"{rate}, or fewer train.epochs (now {t.epochs})",
        )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
