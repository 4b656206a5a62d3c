"""Playing many text-environment episodes at once with language models.

:class:`EpisodePlayer` follows :func:`ppokit.envs.runner.play_episode` (the reference loop with
Python policies) for a whole batch of episodes::

    reset every environment (seeded); each seat's first observation goes into its Stream
    while episodes are live:
        cut the episodes a budget stops (max_turns, the episode token budget, the context)
        for each actor (the current policy, a past opponent): ONE generate over the
            prompts of the live episodes whose acting seat it plays
        step each environment with its action's text; rewards to the acting seat's turn
        finished episodes drop out; the others' next observation goes to the next acting seat

Only the current policy's seats become :class:`Trajectory` objects (what PPO trains on); every
seat's outcome is recorded (:class:`PlayResult`). A cut episode is truncated and bootstraps from
the value of its next prompt; an environment that raises ends its episode with
``failure_reward``. Budgets, truncation and failures: docs/multiturn.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ppokit.envs.checks import checked_reset, step_or_fail
from ppokit.envs.metrics import EpisodeRecord, EpisodeTracker
from ppokit.envs.selfplay import CURRENT
from ppokit.lm.multi_turn.streams import Stream, StreamCodec
from ppokit.monitoring.peak_memory import phase_peak

__all__ = ["EpisodePlayer", "PlayResult", "Trajectory", "TurnData", "TRUNCATION_REASONS"]

TRUNCATION_REASONS = ("max_turns", "episode_tokens", "context", "env")

# (actor id, prompt token lists, greedy) -> (action token lists as sampled, their decoded texts)
# or (..., the engine's behaviour log-prob of each action token, or None): the rollout engine's
# rollout_log_prob, carried into the batch for the trainer's rollout correction
Generate = Callable[
    [str, list[list[int]], bool],
    tuple[list[list[int]], list[str]] | tuple[list[list[int]], list[str], list[list[float]] | None],
]


@dataclass
class TurnData:
    """One action of a trained seat."""

    prompt_ids: list[int]  # the tokens the action was generated from
    action_ids: list[int]  # as sampled, up to and including the stop token
    reward: float = 0.0
    observation: Any = ""  # the observation the action answered (for samples.jsonl)
    action_text: str = ""
    # the engine's behaviour log-prob of each action token (len(action_ids)); None when it gave none
    action_log_probs: list[float] | None = None
    # rollout.off_policy_steps on a Ray worker: the scorer's log-prob of each action token under the
    # weights that played it (len(action_ids)), taken there right after the play; the batch's old_log_prob
    behaviour_log_probs: list[float] | None = None


@dataclass
class Trajectory:
    """One seat of one episode played by the current policy: the rows PPO trains on."""

    episode: int
    seat: int | None
    stream: Stream
    turns: list[TurnData] = field(default_factory=list)
    truncated: bool = False
    bootstrap_ids: list[int] | None = None  # the next prompt, when it bootstraps
    record: EpisodeRecord | None = None

    @property
    def episode_return(self) -> float:
        return sum(t.reward for t in self.turns)


@dataclass
class PlayResult:
    """The trajectories of the current policy, every seat's record, and what was measured."""

    trajectories: list[Trajectory]
    records: list[dict[int | None, EpisodeRecord]]  # per episode: seat -> record
    actors: list[dict[int | None, str]]  # per episode: seat -> actor id
    truncations: dict[str, int]
    failures: int
    first_error: str | None
    time_generate: float
    time_env: float
    peak_gb_generate: float  # the largest peak memory of a generation call (ppokit.monitoring.peak_memory)
    generated_tokens: int
    actions: int = 0  # replies generated
    cut_replies: int = 0  # of them, cut by max_new_tokens before a stop token


class _Episode:
    def __init__(self, index: int, env: Any):
        self.index, self.env = index, env
        self.streams: dict[int | None, Stream] = {}
        self.trackers: dict[int | None, EpisodeTracker] = {}
        self.trajectories: dict[int | None, Trajectory] = {}
        self.actors: dict[int | None, str] = {}
        self.seat: int | None = None  # the seat to act
        self.observation: Any = None
        self.steps = 0
        self.done = False


class EpisodePlayer:
    """Plays batches of episodes (module docstring).

    Budgets (a cut episode is truncated, each cut counted by reason): ``max_turns`` environment
    steps per episode (all seats); ``max_episode_tokens``: a seat's
    :attr:`~ppokit.lm.multi_turn.streams.Stream.episode_tokens` plus ``max_new_tokens`` must fit
    before a turn starts; ``context``: the prompt plus ``max_new_tokens`` must fit the model's
    positions. ``max_new_tokens`` cuts a reply, not the episode: the cut reply is the action, and
    such replies are counted (``PlayResult.cut_replies``). With ``bootstrap`` a truncated seat about
    to act bootstraps from the value of its next prompt; the seat not to move ends with 0.
    """

    def __init__(
        self,
        envs: Sequence[Any],
        codec: StreamCodec,
        generate: Generate,
        *,
        max_turns: int,
        max_new_tokens: int,
        context: int | None,
        max_episode_tokens: int | None = None,
        bootstrap: bool = True,
        failure_reward: float = 0.0,
        env_name: str = "the environment",
    ):
        self.envs = list(envs)
        self.codec, self.generate = codec, generate
        self.max_turns, self.max_new_tokens, self.context = max_turns, max_new_tokens, context
        self.max_episode_tokens, self.bootstrap = max_episode_tokens, bootstrap
        self.failure_reward, self.env_name = failure_reward, env_name

    def play(
        self,
        seeds: Sequence[int],
        *,
        seat_actors: Callable[[int, dict], dict[int | None, str]],
        greedy: bool = False,
        options: Sequence[dict | None] | None = None,
    ) -> PlayResult:
        """Play ``len(seeds)`` episodes (episode i on ``envs[i]``, reset with ``seeds[i]``)."""
        if len(seeds) > len(self.envs):
            raise ValueError(f"{len(seeds)} episodes but only {len(self.envs)} environments")
        result = PlayResult(
            trajectories=[],
            records=[],
            actors=[],
            truncations=dict.fromkeys(TRUNCATION_REASONS, 0),
            failures=0,
            first_error=None,
            time_generate=0.0,
            time_env=0.0,
            peak_gb_generate=0.0,
            generated_tokens=0,
        )
        start = time.perf_counter()
        episodes = [self._start(i, seed, seat_actors, options[i] if options else None) for i, seed in enumerate(seeds)]
        result.time_env += time.perf_counter() - start
        live = list(episodes)
        while live:
            ready = [ep for ep in live if self._within_budget(ep, result.truncations)]
            actions = self._replies(ready, greedy, result)
            start = time.perf_counter()
            for ep in ready:
                action_ids, text, log_probs = actions[ep.index]
                failed = self._step(ep, action_ids, text, result.truncations, log_probs)
                if failed is not None:
                    result.failures += 1
                    result.first_error = result.first_error or failed
            result.time_env += time.perf_counter() - start
            live = [ep for ep in ready if not ep.done]
        for ep in episodes:
            result.trajectories += [
                ep.trajectories[s] for s in sorted(ep.trajectories, key=_seat_key) if ep.trajectories[s].turns
            ]
        result.records = [{s: t.record for s, t in ep.trackers.items()} for ep in episodes]
        result.actors = [ep.actors for ep in episodes]
        return result

    def _start(
        self, index: int, seed: int, seat_actors: Callable[[int, dict], dict[int | None, str]], options: dict | None
    ) -> _Episode:
        """Episode ``index`` reset with ``seed``, its actors chosen and its first observation read."""
        ep = _Episode(index, self.envs[index])
        obs, info = checked_reset(ep.env, seed=seed, options=options, name=self.env_name)
        ep.actors = dict(seat_actors(index, info))
        ep.seat = _acting_seat(info)
        self._observe(ep, ep.seat, obs)
        return ep

    def _within_budget(self, ep: _Episode, truncations: dict[str, int]) -> bool:
        """Whether ``ep`` may take another turn; if not, it is truncated and its reason counted."""
        reason = self._budget_cut(ep)
        if reason is None:
            return True
        truncations[reason] += 1
        self._truncate(ep, bootstrap_seat=ep.seat)
        return False

    def _replies(
        self, ready: list[_Episode], greedy: bool, result: PlayResult
    ) -> dict[int, tuple[list[int], str, list[float] | None]]:
        """Each ready episode's reply (token ids, text, behaviour log-probs), one generation call per
        actor; the calls' time, peak memory, tokens and cut replies counted in ``result``."""
        by_actor: dict[str, list[_Episode]] = {}
        for ep in ready:
            by_actor.setdefault(ep.actors.get(ep.seat, CURRENT), []).append(ep)
        actions: dict[int, tuple[list[int], str, list[float] | None]] = {}
        for actor, group in by_actor.items():
            start = time.perf_counter()
            with phase_peak() as peak:
                out = self.generate(actor, [ep.streams[ep.seat].prompt() for ep in group], greedy)
            result.time_generate += time.perf_counter() - start
            result.peak_gb_generate = max(result.peak_gb_generate, peak.gb)
            ids, texts = out[0], out[1]
            log_probs = out[2] if len(out) > 2 and out[2] is not None else [None] * len(ids)
            for ep, a, text, lp in zip(group, ids, texts, log_probs):
                if lp is not None and len(lp) != len(a):
                    raise ValueError(f"generate gave {len(lp)} log-probs for a reply of {len(a)} tokens")
                actions[ep.index] = (a, text, lp)
                result.generated_tokens += len(a)
                result.cut_replies += len(a) >= self.max_new_tokens and a[-1] not in self.codec.stop_ids
            result.actions += len(group)
        return actions

    # ------------------------------------------------------------------ one episode
    def _observe(self, ep: _Episode, seat: int | None, observation: Any) -> None:
        stream = ep.streams.get(seat)
        if stream is None:
            stream = ep.streams[seat] = self.codec.new_stream()
        stream.observe(observation)
        ep.observation = observation

    def _budget_cut(self, ep: _Episode) -> str | None:
        stream = ep.streams[ep.seat]
        need = len(stream.ids) + self.max_new_tokens
        if self.context is not None and need > self.context:
            return "context"
        if (
            self.max_episode_tokens is not None
            and stream.episode_tokens + self.max_new_tokens > self.max_episode_tokens
        ):
            return "episode_tokens"
        return None

    def _step(
        self,
        ep: _Episode,
        action_ids: list[int],
        text: str,
        truncations: dict[str, int],
        log_probs: list[float] | None = None,
    ) -> str | None:
        """Apply one action; returns the error text when the environment raised."""
        seat = ep.seat
        stream = ep.streams[seat]
        prompt = stream.prompt()
        stream.act(action_ids)
        result = step_or_fail(ep.env, text, failure_reward=self.failure_reward, name=self.env_name)
        ep.steps += 1
        ep.trackers.setdefault(seat, EpisodeTracker(seat)).add(result)
        if ep.actors.get(seat, CURRENT) == CURRENT:
            trajectory = ep.trajectories.get(seat)
            if trajectory is None:
                trajectory = ep.trajectories[seat] = Trajectory(ep.index, seat, stream)
            trajectory.turns.append(TurnData(prompt, list(action_ids), result.reward, ep.observation, text, log_probs))
        info = result.info
        if result.done:
            ep.done = True
            rewards, outcomes = info.get("rewards"), info.get("outcomes")
            for other in ep.actors:  # a seat that never got to move still has an outcome
                if isinstance(other, int) and other not in ep.trackers:
                    ep.trackers[other] = EpisodeTracker(other)
            for other, tracker in ep.trackers.items():
                if other is None or other == seat:
                    continue
                if rewards is not None:
                    tracker.finish(float(rewards[other]), outcomes[other] if outcomes else None)
                    if other in ep.trajectories and ep.trajectories[other].turns:
                        ep.trajectories[other].turns[-1].reward += float(rewards[other])
                tracker.record.truncated, tracker.record.failed = result.truncated, result.failed
            self._finish_records(ep)
            if result.truncated:
                truncations["env"] += 1
                next_seat = info.get("player", seat)
                if next_seat in ep.streams:
                    self._observe(ep, next_seat, result.observation)
                self._truncate(ep, bootstrap_seat=next_seat, count_records=False)
            return info.get("env_error")
        next_seat = info.get("player", seat)
        ep.seat = next_seat
        self._observe(ep, next_seat, result.observation)
        if ep.steps >= self.max_turns:
            truncations["max_turns"] += 1
            self._truncate(ep, bootstrap_seat=next_seat)
        return None

    def _truncate(self, ep: _Episode, *, bootstrap_seat: int | None, count_records: bool = True) -> None:
        ep.done = True
        for seat, trajectory in ep.trajectories.items():
            trajectory.truncated = True
            if self.bootstrap and seat == bootstrap_seat:
                trajectory.bootstrap_ids = ep.streams[seat].prompt()
        if count_records:
            for tracker in ep.trackers.values():
                tracker.record.truncated = True
        self._finish_records(ep)

    @staticmethod
    def _finish_records(ep: _Episode) -> None:
        for seat, trajectory in ep.trajectories.items():
            trajectory.record = ep.trackers[seat].record


def _acting_seat(info: dict) -> int | None:
    """The seat to act: ``info["player"]``, else the learner's ``info["seat"]``, else None (one player)."""
    if "player" in info:
        return int(info["player"])
    if "seat" in info:
        return int(info["seat"])
    return None


def _seat_key(seat: int | None) -> int:
    return -1 if seat is None else seat
