"""Ending a run early on its periodic evaluations: a target reached, or no more progress.

:class:`EarlyStop` follows one score of the periodic evaluations (held-out accuracy, win
rate, mean return) and says why training should stop after one of them:

- the score reached the target (``data.stop_at_accuracy``, ``textenv.stop_at_win_rate``,
  ``env.stop_at_return``);
- ``train.eval_patience`` evaluations in a row did not beat the best score so far: the
  gain has stopped growing. The first periodic evaluation sets the best; the one before
  training does not count (PPO's first iterations may dip below it).

An evaluator (:class:`ppokit.components.Evaluator`) calls :meth:`EarlyStop.update` from its
``stop_reason`` and keeps :meth:`EarlyStop.state_dict` in its own, so that a resumed run
stops where the uninterrupted one would. The run loop prints the reason, and ends the run
as if its last iteration had come (final evaluation, final checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EarlyStop:
    """Stop on ``target`` or after ``patience`` evaluations without a new best.

    ``label`` names the score in the reason (``"held-out accuracy"``), ``fmt`` formats it
    (``"{:.1%}"``); ``target_field`` and ``patience_field`` are the config fields the reason
    names. ``target`` None and ``patience`` None or 0 switch each rule off.
    """

    label: str
    target: float | None = None
    target_field: str = ""
    patience: int | None = None
    patience_field: str = "train.eval_patience"
    fmt: str = "{:.1%}"
    best: float | None = None
    since_best: int = 0

    def update(self, score: float | None) -> str | None:
        """Record a periodic evaluation's ``score``; returns the reason to stop, or None. A
        missing score (None) changes nothing."""
        if score is None:
            return None
        if self.best is None or score > self.best:
            self.best, self.since_best = float(score), 0
        else:
            self.since_best += 1
        show = self.fmt.format
        if self.target is not None and score >= self.target:
            return f"{self.label} {show(score)} >= {self.target_field}={self.target:g}"
        if self.patience and self.since_best >= self.patience:
            return (
                f"{self.label} has not improved on its best ({show(self.best)}) in {self.since_best} "
                f"evaluations ({self.patience_field}={self.patience})"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "since_best": self.since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.since_best = int(state.get("since_best", 0))
