"""Held-out accuracy of a single-turn language-model run: before, during and after training."""

from __future__ import annotations

from typing import Any

from ppokit.config import Config
from ppokit.lm.evaluate import heldout_results
from ppokit.lm.rewards.pool import check_error_limit
from ppokit.stopping import EarlyStop


class LMEvaluator:
    """Greedy held-out accuracy (mean reward of ``data.reward`` or the task's verifier):
    before training, every ``data.eval_every`` iterations and after training. ``reward``:
    the run's reward scorer (the reward pool: a failing or hanging sample gets
    ``data.reward_on_error`` and is counted as ``eval_reward_errors``)."""

    at_start = True

    def __init__(self, cfg: Config, engine, items: list[dict], reward):
        self.engine, self.items, self.reward = engine, items, reward
        self.every = cfg.data.eval_every
        self.max_reward_errors = cfg.data.max_reward_errors
        self.before: float | None = None
        self.early_stop = EarlyStop(
            "held-out accuracy", cfg.data.stop_at_accuracy, "data.stop_at_accuracy", cfg.train.eval_patience
        )

    def evaluate(self, phase: str) -> dict[str, float]:
        _, results = heldout_results(self.engine, self.items, self.reward)
        check_error_limit(results, self.max_reward_errors, getattr(self.reward, "name", "reward"))
        accuracy = sum(results.scores) / len(results.scores)
        if phase == "before":
            self.before = accuracy
        key = {"before": "eval_accuracy_before", "final": "eval_accuracy_after"}.get(phase, "eval_accuracy")
        out = {key: accuracy}
        if results.num_errors:
            out["eval_reward_errors"] = float(results.num_errors)
        return out

    def message(self, phase: str, metrics: dict[str, float]) -> str | None:
        if phase == "before":
            return f"held-out accuracy before PPO: {metrics['eval_accuracy_before']:.1%} ({len(self.items)} prompts)"
        if phase == "final":
            before = f" (before: {self.before:.1%})" if self.before is not None else ""
            return f"held-out accuracy after PPO: {metrics['eval_accuracy_after']:.1%}{before}"
        return None

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        return self.early_stop.update(metrics.get("eval_accuracy"))

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before, "early_stop": self.early_stop.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before = state.get("before")
        self.early_stop.load_state_dict(state.get("early_stop", {}))

    def close(self) -> None:
        pass
