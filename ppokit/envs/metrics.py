"""Episode statistics for text environments: outcome rates, illegal actions, turns, returns.

A rollout keeps one :class:`EpisodeTracker` per running episode (per seat in
self-play), feeds it every :class:`~ppokit.envs.checks.StepResult` of that seat, and
hands the finished :class:`EpisodeRecord` objects to :func:`episode_metrics` for the
iteration's metrics line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .base import OUTCOMES
from .checks import StepResult

__all__ = ["EpisodeRecord", "EpisodeTracker", "episode_metrics"]


@dataclass
class EpisodeRecord:
    """One finished episode of one seat."""

    episode_return: float = 0.0  # undiscounted sum of the seat's rewards
    turns: int = 0  # actions the seat took
    outcome: str | None = None  # "win" | "draw" | "loss" | None
    illegal_actions: int = 0
    truncated: bool = False
    failed: bool = False  # the environment raised (step_or_fail)
    seat: int | None = None


class EpisodeTracker:
    """Accumulates one seat's episode from its step results."""

    def __init__(self, seat: int | None = None) -> None:
        self.record = EpisodeRecord(seat=seat)

    def add(self, result: StepResult) -> None:
        """A step taken by this seat."""
        r = self.record
        r.episode_return += result.reward
        r.turns += 1
        r.illegal_actions += int(bool(result.info.get("illegal", False)))
        if result.done:
            r.outcome = result.info.get("outcome", r.outcome)
            r.truncated = result.truncated
            r.failed = result.failed

    def finish(self, reward: float = 0.0, outcome: str | None = None) -> EpisodeRecord:
        """Close the episode; ``reward``/``outcome``: what a seat that did not make the
        last move gets at the end (``info["rewards"][seat]``, ``info["outcomes"][seat]``)."""
        self.record.episode_return += reward
        if outcome is not None:
            self.record.outcome = outcome
        return self.record


def episode_metrics(records: Sequence[EpisodeRecord], prefix: str = "env/") -> dict[str, float]:
    """Means over finished episodes, as ``{prefix + key: value}``.

    - ``episodes``; ``return_mean``, ``return_std`` (population), ``return_min``, ``return_max``
    - ``turns_mean``, ``turns_max``
    - ``win_rate``, ``draw_rate``, ``loss_rate``: outcomes / episodes (an episode without
      an outcome counts in none of them)
    - ``illegal_action_rate``: illegal actions / actions; ``illegal_episode_rate``:
      episodes with an illegal action / episodes
    - ``truncated_rate``, ``failure_rate``
    - with seats recorded, the outcome rates and ``return_mean`` per seat as
      ``seat{s}/...``

    No episodes: ``{prefix + "episodes": 0}``.
    """
    n = len(records)
    if n == 0:
        return {f"{prefix}episodes": 0}
    returns = [r.episode_return for r in records]
    mean = sum(returns) / n
    turns = sum(r.turns for r in records)
    out = {
        "episodes": n,
        "return_mean": mean,
        "return_std": math.sqrt(sum((x - mean) ** 2 for x in returns) / n),
        "return_min": min(returns),
        "return_max": max(returns),
        "turns_mean": turns / n,
        "turns_max": max(r.turns for r in records),
        "illegal_action_rate": sum(r.illegal_actions for r in records) / turns if turns else 0.0,
        "illegal_episode_rate": sum(r.illegal_actions > 0 for r in records) / n,
        "truncated_rate": sum(r.truncated for r in records) / n,
        "failure_rate": sum(r.failed for r in records) / n,
    }
    for outcome in OUTCOMES:
        out[f"{outcome}_rate"] = sum(r.outcome == outcome for r in records) / n
    seats = sorted({r.seat for r in records if r.seat is not None})
    for seat in seats:
        mine = [r for r in records if r.seat == seat]
        out[f"seat{seat}/episodes"] = len(mine)
        out[f"seat{seat}/return_mean"] = sum(r.episode_return for r in mine) / len(mine)
        for outcome in OUTCOMES:
            out[f"seat{seat}/{outcome}_rate"] = sum(r.outcome == outcome for r in mine) / len(mine)
    return {prefix + k: float(v) for k, v in out.items()}
