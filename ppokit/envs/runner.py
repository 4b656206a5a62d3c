"""Play episodes with plain Python policies: the reference loop a multi-turn rollout follows.

A policy here is a function ``(observation, info) -> action text`` (a scripted expert,
a random player, or a wrapper around a model's generate). :func:`play_episode` is the
whole protocol in one place:

1. ``checked_reset(env, seed)``; ``info["player"]`` (two-player games) says who acts.
2. Each turn: the acting seat's policy writes an action from the latest observation;
   ``step_or_fail`` applies it (an exception in the environment ends the episode with
   ``failure_reward`` and ``info["env_error"]``).
3. The step's reward belongs to the seat that acted. When a two-player episode ends,
   every *other* seat ``s`` gets ``info["rewards"][s]`` on its own last turn (self-play:
   o's loss when x completes a line).
4. The episode stops at ``terminated`` or ``truncated`` (or after ``max_turns``,
   counted as truncated).

:meth:`Episode.seat_turns` and :meth:`Episode.seat_rewards` give each seat its turns
and per-turn rewards: the input of turn-level credit (:mod:`ppokit.algo.turns`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Observation
from .checks import checked_reset, env_label, step_or_fail
from .metrics import EpisodeRecord, EpisodeTracker, episode_metrics

__all__ = ["Episode", "Policy", "Turn", "evaluate_policy", "expert_policy", "play_episode", "random_legal_policy"]

Policy = Callable[[Observation, dict], str]


@dataclass
class Turn:
    """One action: what the acting seat saw, what it wrote, and what came back."""

    observation: Observation
    action: str
    reward: float  # the step's reward (the acting seat's); final rewards of other seats are added separately
    player: int | None
    info: dict
    terminated: bool = False
    truncated: bool = False


@dataclass
class Episode:
    """A played episode: its turns and one :class:`EpisodeRecord` per seat."""

    turns: list[Turn] = field(default_factory=list)
    reset_info: dict = field(default_factory=dict)
    records: dict[int | None, EpisodeRecord] = field(default_factory=dict)
    final_rewards: dict[int | None, float] = field(default_factory=dict)  # added to a non-mover's last turn

    def seat_turns(self, seat: int | None = None) -> list[Turn]:
        """The turns ``seat`` took (``None``: single-player, all turns)."""
        return [t for t in self.turns if t.player == seat]

    def seat_rewards(self, seat: int | None = None) -> list[float]:
        """Per-turn rewards of ``seat``'s turns, the final reward of a non-mover on its last turn."""
        rewards = [t.reward for t in self.seat_turns(seat)]
        if rewards:
            rewards[-1] += self.final_rewards.get(seat, 0.0)
        return rewards


def _policy_for(policy: Policy | Mapping[int, Policy], player: int | None) -> Policy:
    if isinstance(policy, Mapping):
        return policy[player]
    return policy


def play_episode(
    env: Any,
    policy: Policy | Mapping[int, Policy],
    *,
    seed: int | None = None,
    options: dict | None = None,
    max_turns: int = 10_000,
    failure_reward: float = 0.0,
    name: str | None = None,
) -> Episode:
    """Play one episode; ``policy`` is one function for every seat or ``{seat: function}``."""
    observation, info = checked_reset(env, seed=seed, options=options, name=name)
    episode = Episode(reset_info=dict(info))
    trackers: dict[int | None, EpisodeTracker] = {}
    player = info.get("player")
    if player is None and "seat" in info:
        player = info["seat"]  # a two-player env playing the other seat itself
    for _ in range(max_turns):
        action = _policy_for(policy, player)(observation, info)
        result = step_or_fail(env, action, failure_reward=failure_reward, name=name)
        trackers.setdefault(player, EpisodeTracker(player)).add(result)
        episode.turns.append(
            Turn(observation, action, result.reward, player, result.info, result.terminated, result.truncated)
        )
        observation, info = result.observation, result.info
        if result.done:
            rewards = info.get("rewards")
            outcomes = info.get("outcomes")
            for seat, tracker in trackers.items():
                if seat is not None and seat != player and rewards is not None:
                    episode.final_rewards[seat] = float(rewards[seat])
                    tracker.finish(float(rewards[seat]), outcomes[seat] if outcomes else None)
                    tracker.record.truncated, tracker.record.failed = result.truncated, result.failed
            break
        if "player" in info:
            player = info["player"]
    else:
        for tracker in trackers.values():
            tracker.record.truncated = True
        if episode.turns:
            episode.turns[-1].truncated = True
    episode.records = {seat: tracker.record for seat, tracker in trackers.items()}
    return episode


def evaluate_policy(
    env: Any,
    policy: Policy | Mapping[int, Policy],
    *,
    episodes: int,
    seed: int = 0,
    seats: Sequence[int] | None = None,
    prefix: str = "env/",
) -> dict[str, float]:
    """:func:`~ppokit.envs.metrics.episode_metrics` over ``episodes`` episodes with seeds
    ``seed, seed + 1, ...``; ``seats``: whose records count (default: all)."""
    records: list[EpisodeRecord] = []
    for i in range(episodes):
        episode = play_episode(env, policy, seed=seed + i)
        records += [r for s, r in episode.records.items() if seats is None or s in seats]
    return episode_metrics(records, prefix)


def expert_policy(env: Any) -> Policy:
    """The environment's own ``expert_action()`` as a policy (built-ins have one)."""
    if not callable(getattr(env, "expert_action", None)):
        raise TypeError(f"environment '{env_label(env)}' has no expert_action()")
    return lambda observation, info: env.expert_action()


def random_legal_policy(rng: random.Random) -> Policy:
    """Uniform among ``info["legal_actions"]`` (environments that list them)."""

    def policy(observation: Observation, info: dict) -> str:
        legal = info.get("legal_actions")
        if not legal:
            raise ValueError("random_legal_policy needs info['legal_actions']")
        return rng.choice(list(legal))

    return policy
