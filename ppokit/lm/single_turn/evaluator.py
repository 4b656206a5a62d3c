"""Held-out accuracy of a single-turn language-model run: before, during and after training."""

from __future__ import annotations

from typing import Any

from ppokit.config import Config
from ppokit.lm.evaluate import heldout_results
from ppokit.lm.rewards.pool import check_error_limit
from ppokit.monitoring.stopping import EarlyStop
from ppokit.persistence.resume import own_random_stream

# below this share of the greedy accuracy, the sampled responses are the thing to fix
SAMPLED_SHARE = 0.5


class LMEvaluator:
    """Greedy held-out accuracy (mean reward of ``data.reward`` or the task's verifier):
    before training, every ``data.eval_every`` iterations and after training. ``reward``:
    the run's reward scorer (the reward pool: a failing or hanging sample gets
    ``data.reward_on_error`` and is counted as ``eval_reward_errors``).

    Before training it also scores one response per prompt sampled as the rollouts are
    (``eval_sampled_accuracy_before``): PPO learns from sampled responses, and a model whose
    greedy answers score while its sampled ones do not (a real model at temperature 1.0)
    gives PPO nothing to learn from; the message says so and what to change. The sample
    draws from a generator of its own (seeded by the run's seed), so the run's random
    stream, and with it every rollout, is the same with or without this check."""

    at_start = True
    releases_memory = True

    def __init__(self, cfg: Config, engine, items: list[dict], reward):
        self.engine, self.items, self.reward = engine, items, reward
        self.seed, self.temperature = cfg.seed, cfg.rollout.temperature
        self.sft_epochs = cfg.data.sft_epochs
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
        if phase == "before":
            out["eval_sampled_accuracy_before"] = self._sampled_accuracy()
        return out

    def _sampled_accuracy(self) -> float:
        """Mean reward of one sampled response per held-out prompt, on a random stream of its own."""
        with own_random_stream(self.seed):
            _, results = heldout_results(self.engine, self.items, self.reward, greedy=False)
        return sum(results.scores) / len(results.scores)

    def message(self, phase: str, metrics: dict[str, float]) -> str | None:
        if phase == "before":
            greedy = metrics["eval_accuracy_before"]
            sampled = metrics.get("eval_sampled_accuracy_before")
            line = f"held-out accuracy before PPO: {greedy:.1%} ({len(self.items)} prompts)"
            if sampled is None:
                return line
            line += f"; sampled at temperature {self.temperature:g}: {sampled:.1%}"
            hint = self._hint(greedy, sampled)
            return f"{line}\n{hint}" if hint else line
        if phase == "final":
            before = f" (before: {self.before:.1%})" if self.before is not None else ""
            return f"held-out accuracy after PPO: {metrics['eval_accuracy_after']:.1%}{before}"
        return None

    def _hint(self, greedy: float, sampled: float) -> str | None:
        """What to change when the sampled responses give PPO little or nothing to learn from."""
        if sampled >= SAMPLED_SHARE * greedy and sampled > 0:
            return None
        if greedy == 0 and sampled == 0:
            warm = "" if self.sft_epochs else " (data.sft_epochs)"
            return (
                "no held-out response earns a reward, greedy or sampled: PPO starts without a signal; warm-start "
                f"on examples of the task{warm}, use an easier task, or a model that solves some of it"
            )
        return (
            f"sampled responses score {sampled:.1%} where greedy ones score {greedy:.1%}: PPO learns from "
            f"sampled responses; lower rollout.temperature (now {self.temperature:g}; 0.6-0.8 for chat models)"
        )

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        return self.early_stop.update(metrics.get("eval_accuracy"))

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before, "early_stop": self.early_stop.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before = state.get("before")
        self.early_stop.load_state_dict(state.get("early_stop", {}))

    def close(self) -> None:
        pass
