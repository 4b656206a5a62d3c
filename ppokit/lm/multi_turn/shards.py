"""Multi-turn rollouts on Ray workers (``cluster.rollout_workers`` with ``textenv.env``).

The training process (the driver) keeps what an iteration decides and what it learns from; the
workers play the episodes::

    driver: MultiTurnSource.episodes(k)   seeds and seat plans (self-play opponents from the pool)
            MultiTurnShardPlan.requests   worker s: episodes [s*E/N, (s+1)*E/N), plans, pool snapshots
    worker: MultiTurnShard.collect_shard  EpisodePlayer.play: its own envs, policy copy, opponent slot
    driver: merge_results, finish         the parts in episode order; failures, role baselines, tensors

So failures, the pool and its RNG, the role baselines and the checkpoint are the in-process
source's (a checkpoint resumes in any layout), and one worker gives the in-process batch bit for
bit (the driver's RNG travels with the request); with N workers shard s runs under RNGs seeded from
(seed, iteration, s). ``rollout.dynamic_sampling``: the driver filters each merged draw with the
in-process code (:meth:`MultiTurnShardPlan.merge` returns None until the batch is full).
``rollout.off_policy_steps`` k: iteration i + k's requests go out before update i's weights; a worker
takes the behaviour log-probs right after its play. Details: docs/scale.md, "Multi-turn rollouts on
workers" and "k-step-off-policy pipelining".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from ppokit.components import Batch
from ppokit.lm.multi_turn.episodes import TRUNCATION_REASONS, PlayResult
from ppokit.lm.multi_turn.source import MultiTurnSource, seat_actors_of
from ppokit.lm.multi_turn.turn_batch import attach_behaviour_log_probs

__all__ = ["EpisodeRequest", "MultiTurnShard", "MultiTurnShardPlan", "merge_results"]


@dataclass
class EpisodeRequest:
    """One worker's share of an iteration: episodes ``first, first + 1, ...``."""

    first: int
    seeds: list[int]
    plans: list[dict]  # MultiTurnSource.episodes' seat plans
    snapshots: dict[str, Any] = field(default_factory=dict)  # the pool's snapshot ids -> object refs


class MultiTurnShardPlan:
    """The driver's side of N multi-turn rollout workers (a :class:`~ppokit.components.ShardPlan`)."""

    steps_per_iteration = None

    def __init__(self, source: MultiTurnSource, num_shards: int):
        self.source, self.num_shards = source, num_shards
        self.snapshot_refs: dict[str, Any] = {}  # put into the object store once per snapshot

    def requests(self, iteration: int) -> list[EpisodeRequest]:
        """The shards of the iteration's next draw of episodes: its first, or (``rollout.dynamic_sampling``,
        after :meth:`merge` returned None) the next one, with new seeds and seat plans."""
        seeds, plans = self.source.episodes(iteration, draw=self.source.draw)
        snapshots = self._snapshot_refs()
        k = len(seeds) // self.num_shards
        return [
            EpisodeRequest(s * k, seeds[s * k : (s + 1) * k], plans[s * k : (s + 1) * k], snapshots)
            for s in range(self.num_shards)
        ]

    def _snapshot_refs(self) -> dict[str, Any]:
        """Every snapshot of the pool as an object reference (new ones put now, dropped ones let go)."""
        pool = self.source.pool
        if pool is None:
            return {}
        import ray

        ids = pool.ids()
        self.snapshot_refs = {i: self.snapshot_refs.get(i) for i in ids}
        for i in ids:
            if self.snapshot_refs[i] is None:
                self.snapshot_refs[i] = ray.put(self.source.opponents.tensors[i])
        return dict(self.snapshot_refs)

    def merge(
        self, iteration: int, parts: list[tuple[PlayResult, float, float | None]], states: list[dict]
    ) -> Batch | None:
        """The batch of the parts in episode order; with the behaviour log-probs the workers took
        (``rollout.off_policy_steps``), its ``old_log_prob``. None (``rollout.dynamic_sampling``)
        while the groups whose returns vary do not fill the batch yet
        (:meth:`~ppokit.lm.multi_turn.source.MultiTurnSource.finish_draw`, the in-process filter):
        :class:`~ppokit.cluster.rollout_workers.RemoteSource` asks for the next draw's requests."""
        results = [part[0] for part in parts]
        if self.source.opponents is not None:  # the workers' time copying snapshots into their slots
            self.source.opponents.load_seconds += sum(part[1] for part in parts)
        k = self.source.cfg.train.batch_size // self.num_shards
        batch = self.source.finish_draw(iteration, merge_results(results, [s * k for s in range(self.num_shards)]))
        if batch is None:
            return None
        behaviour_times = [part[2] for part in parts if part[2] is not None]
        if behaviour_times:
            if "old_log_prob" not in batch.tensors:  # the scorer would take them from newer weights
                raise RuntimeError(f"iteration {iteration}: a worker's episodes came without behaviour log-probs")
            batch.metrics["time_behaviour_log_prob"] = max(behaviour_times)
        return batch

    def sync_weights(self, learner) -> None:
        """The driver's source counts the update (and takes the pool's snapshots from its replica)."""
        self.source.sync_weights(learner)

    def state_dict(self, shard_states: list[dict[str, Any]]) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> tuple[list[dict[str, Any] | None], list[str]]:
        return [None] * self.num_shards, self.source.load_state_dict(state)


def merge_results(results: list[PlayResult], firsts: list[int]) -> PlayResult:
    """One :class:`PlayResult` from the workers' parts in episode order: trajectories, records and
    actors concatenated (each part's episode numbers shifted by its first episode), counts summed,
    the first error kept, the slowest part's times, the largest generation peak."""
    if len(results) == 1 and firsts == [0]:
        return results[0]
    trajectories = [replace(t, episode=t.episode + first) for r, first in zip(results, firsts) for t in r.trajectories]
    return PlayResult(
        trajectories=trajectories,
        records=[record for r in results for record in r.records],
        actors=[actors for r in results for actors in r.actors],
        truncations={k: sum(r.truncations[k] for r in results) for k in TRUNCATION_REASONS},
        failures=sum(r.failures for r in results),
        first_error=next((r.first_error for r in results if r.first_error), None),
        time_generate=max(r.time_generate for r in results),
        peak_gb_generate=max(r.peak_gb_generate for r in results),  # each worker's own process
        time_env=max(r.time_env for r in results),
        generated_tokens=sum(r.generated_tokens for r in results),
        actions=sum(r.actions for r in results),
        cut_replies=sum(r.cut_replies for r in results),
    )


class MultiTurnShard:
    """A worker's source (a :class:`~ppokit.components.ShardSource`): envs for its share of the
    episodes, the actor (lora: with the opponent slot) and the player. With
    ``rollout.off_policy_steps`` (and not ``algo.rollout_correction_bypass``) it also takes each
    turn's behaviour log-probs (:func:`~ppokit.lm.multi_turn.turn_batch.attach_behaviour_log_probs`)
    right after the play, with the weights that played it, in rows of ``mode`` padded with ``pad_id``
    on ``device``."""

    def __init__(self, player, policy, opponents=None, *, cfg=None, mode: str = "state", pad_id: int = 0, device="cpu"):
        self.player, self.policy, self.opponents = player, policy, opponents
        self.mode, self.pad_id, self.device = mode, pad_id, device
        ahead = cfg is not None and cfg.rollout.off_policy_steps and not cfg.algo.rollout_correction_bypass
        self.behaviour_chunk = cfg.infer_micro_batch_size if ahead else 0  # 0: the driver's scorer computes them

    def collect_shard(self, iteration: int, request: EpisodeRequest) -> tuple[PlayResult, float, float | None]:
        """(the played episodes, seconds spent copying snapshots into the opponent slot, seconds
        spent on the behaviour log-probs or None)."""
        if self.opponents is not None:
            self._fetch_snapshots(request.snapshots)
            self.opponents.load_seconds = 0.0
        result = self.player.play(request.seeds, seat_actors=seat_actors_of(request.plans))
        behaviour_time = None
        if self.behaviour_chunk:  # before the next weights arrive (Ray runs this actor's calls in order)
            start = time.perf_counter()
            attach_behaviour_log_probs(
                result.trajectories,
                self.policy,
                mode=self.mode,
                pad_id=self.pad_id,
                chunk=self.behaviour_chunk,
                device=self.device,
            )
            behaviour_time = time.perf_counter() - start
        for trajectory in result.trajectories:  # the stream's tokenizer stays here (the driver has its own)
            trajectory.stream.codec = None
        return result, self.opponents.load_seconds if self.opponents is not None else 0.0, behaviour_time

    def _fetch_snapshots(self, refs: dict[str, Any]) -> None:
        import ray

        for snapshot_id in [i for i in self.opponents.tensors if i not in refs]:
            self.opponents.drop(snapshot_id)
        for snapshot_id, ref in refs.items():
            if snapshot_id not in self.opponents.tensors:
                self.opponents.tensors[snapshot_id] = ray.get(ref)

    def load_rollout_weights(self, weights) -> None:
        self.policy.load_actor_weights(weights)

    def state_dict(self) -> dict[str, Any]:
        return {}  # the driver keeps the pool, the seeds and the baselines

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        return []
