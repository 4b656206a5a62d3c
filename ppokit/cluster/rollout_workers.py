"""Rollout workers: N Ray actors each holding a shard of the rollout, behind one RolloutSource.

:class:`RemoteSource` is the run loop's source when ``cluster.rollout_workers`` >= 1. Each iteration it
asks the workload's :class:`~ppokit.components.ShardPlan` for one request per shard (lm: a contiguous
slice of the prompts; control: nothing, each worker steps its own envs), sends them to the
:class:`RolloutWorker` actors and merges the parts in shard order.

- RNG: one synchronous worker gets the driver's RNG state with each request and returns it, so the
  batch is the in-process one bit for bit. Otherwise shard s of iteration i runs under RNGs seeded
  from (seed, i, s) (:func:`ppokit.persistence.resume.rollout_rngs`); a further round of the same iteration (a
  plan whose ``merge`` returns None: dynamic sampling) is seeded as shard ``s + d * DRAW_STREAM``.
- Weights: :meth:`RemoteSource.sync_weights` puts ``learner.rollout_weights()`` into the object store
  once, in buckets (:mod:`ppokit.cluster.weights`); every worker loads them one at a time.
- Pipelining (``rollout.off_policy_steps`` = k): :meth:`RemoteSource.prefetch` keeps k rollouts in
  flight. Ray runs an actor's calls in order, so batch j is sampled by weights j - min(j, k), and its
  behaviour log-probs are taken on the worker with those weights.
- Failures: a dead worker is replaced from its shard's last state and sent the same request with the
  same RNG; more than :data:`MAX_RESTARTS` deaths in a row stop the run. Details: docs/scale.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppokit.cluster import ray_get, require_ray
from ppokit.cluster.weights import MIB, buckets, nbytes
from ppokit.components import Batch, RolloutQueue
from ppokit.errors import UserError
from ppokit.persistence.resume import DRAW_STREAM, capture_rng, restore_rng, rollout_rngs

# a part whose worker dies this many times in a row is not tried again: the run stops
MAX_RESTARTS = 3


def _first_line(exc: BaseException) -> str:
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return lines[0] if lines else type(exc).__name__


class RolloutWorker:
    """The actor: a workload's shard source, its policy copy and the version of its weights."""

    def __init__(self, workload, shard: int, num_shards: int):
        self.shard = shard
        self.source = workload.rollout_shard(shard, num_shards)
        self.version: int | None = None
        self.load_time = 0.0

    def set_weights(self, buckets: list[Any], version: int) -> float:
        """Load the learner's rollout weights (version ``version``), one bucket (a dictionary, or the
        object reference of one) at a time; seconds it took."""
        import ray

        start = time.perf_counter()
        for bucket in buckets:
            self.source.load_rollout_weights(ray.get(bucket) if isinstance(bucket, ray.ObjectRef) else bucket)
        self.version = version
        self.load_time = time.perf_counter() - start
        return self.load_time

    def collect(
        self, iteration: int, request: Any, rng: dict[str, Any]
    ) -> tuple[Any, dict, dict | None, float, int | None]:
        """(this shard's part, the shard's state after it, the RNG state after it or None,
        seconds the last weight load took, the version of the weights that sampled it)."""
        if "state" in rng:  # the driver's stream (one synchronous worker)
            restore_rng(rng["state"])
            part = self.source.collect_shard(iteration, request)
            rng_after = capture_rng()
        else:
            with rollout_rngs(*rng["seed"]):
                part = self.source.collect_shard(iteration, request)
            rng_after = None
        return part, self.source.state_dict(), rng_after, self.load_time, self.version

    def load_state(self, state: dict[str, Any]) -> list[str]:
        return list(self.source.load_state_dict(state) or [])

    def shard_state(self) -> dict[str, Any]:
        return self.source.state_dict()

    def pid(self) -> int:
        return os.getpid()


@dataclass
class _Request:
    """A rollout sent to the workers and not collected yet."""

    iteration: int
    requests: list[Any]
    rngs: list[dict[str, Any]]
    version: int | None  # the weights it was sent after
    futures: list[Any]


class RemoteSource:
    """A :class:`~ppokit.components.RolloutSource` whose shards run in Ray actors.

    A weight sync logs ``sync_bytes``, ``sync_bucket_peak`` (the largest bucket) and ``sync_time``
    (the put, plus the workers' load when the run is synchronous); a plan with a
    ``sync_weights(learner)`` of its own (multi-turn self-play: the opponent pool's snapshots) is
    told of every sync too. A checkpoint waits for every rollout in flight and stores their batches
    in order (``pending``) with the shards' states after the last, so a resume continues exactly;
    the weight buckets of every version an in-flight request was sent after stay in the object
    store, for a restarted worker."""

    def __init__(
        self,
        cfg,
        plan,
        start_worker: Callable[[int], Any],
        num_shards: int,
        forget_worker: Callable[[Any], None] = lambda actor: None,
    ):
        self.cfg, self.plan, self.num_shards = cfg, plan, num_shards
        self.bucket_bytes = cfg.cluster.sync_bucket_mb * MIB
        self.steps_per_iteration = plan.steps_per_iteration
        self._start_worker, self._forget_worker = start_worker, forget_worker
        self.workers = [start_worker(s) for s in range(num_shards)]
        self.shard_states: list[dict[str, Any] | None] = [None] * num_shards
        self.in_flight: dict[int, _Request] = {}  # iteration -> its request, oldest first
        self.queue = RolloutQueue()  # gathered ahead of their update (a checkpoint's)
        self.version: int | None = None
        # the weight buckets of the current version and of every in-flight request's
        self.weight_refs: dict[int, list[Any]] = {}
        self.restarts = 0

    # ------------------------------------------------------------------ rollouts
    def collect(self, iteration: int) -> Batch:
        batch = self.queue.pop(iteration)
        if batch is not None:
            return batch
        if iteration not in self.in_flight:
            self.in_flight[iteration] = self._submit(iteration)
        batch, draw = self._gather(self.in_flight.pop(iteration)), 1
        while batch is None:  # the plan asks for another generation batch (lm: rollout.dynamic_sampling)
            batch, draw = self._gather(self._submit(iteration, draw)), draw + 1
        return batch

    def prefetch(self, iteration: int) -> None:
        """Submit ``iteration`` unless it is in flight or gathered already."""
        if iteration not in self.in_flight and iteration not in self.queue:
            self.in_flight[iteration] = self._submit(iteration)

    def _rngs(self, iteration: int, draw: int = 0) -> list[dict[str, Any]]:
        if self.num_shards == 1 and not self.cfg.rollout.off_policy_steps:
            return [{"state": capture_rng()}]
        return [{"seed": (self.cfg.seed, iteration, s + draw * DRAW_STREAM)} for s in range(self.num_shards)]

    def _submit(self, iteration: int, draw: int = 0) -> _Request:
        """Send ``iteration``'s requests; ``draw`` > 0: a further generation batch of it."""
        requests, rngs = self.plan.requests(iteration), self._rngs(iteration, draw)
        futures = [w.collect.remote(iteration, r, g) for w, r, g in zip(self.workers, requests, rngs)]
        return _Request(iteration, requests, rngs, self.version, futures)

    def _gather(self, request: _Request) -> Batch | None:
        """The merged batch of ``request``; None when the plan wants another generation batch."""
        from ray.exceptions import RayActorError

        start = time.perf_counter()
        results = []
        for s, future in enumerate(request.futures):
            deaths = 0
            while True:
                try:
                    results.append(ray_get(future))
                    break
                except RayActorError as exc:  # the worker died: a new one does the same work
                    deaths += 1
                    if deaths > MAX_RESTARTS:
                        raise UserError(
                            f"rollout worker {s} died {deaths} times in a row on iteration "
                            f"{request.iteration} ({_first_line(exc)}); check the worker's memory and "
                            "the Ray logs (/tmp/ray/session_latest/logs), then resume from the last "
                            "checkpoint with ppokit train --resume RUN_DIR"
                        ) from None
                    future = self._restart(s, request)
        parts, states, rng_after, load_times, versions = zip(*results)
        self.shard_states = list(states)
        if rng_after[0] is not None:
            restore_rng(rng_after[0])
        batch = self.plan.merge(request.iteration, list(parts), list(states))
        if batch is None:
            return None
        batch.policy_version = versions[0]
        batch.metrics["time_rollout_wait"] = time.perf_counter() - start
        batch.metrics["time_load_weights"] = max(load_times)
        if self.restarts:
            batch.metrics["worker_restarts"] = float(self.restarts)
        return batch

    def _restart(self, s: int, request: _Request) -> Any:
        """Replace dead worker ``s``: its last state, then what the dead one was sent after
        it in the same order: the request's weights and the request, and each later
        request in flight with its weights (their futures replaced); the current weights
        last, as the others have. Returns the request's new future."""
        self._forget_worker(self.workers[s])
        worker = self._start_worker(s)
        self.workers[s] = worker
        self.restarts += 1
        if self.shard_states[s] is not None:
            worker.load_state.remote(self.shard_states[s])
        held = None
        future = None
        for later in [request, *self.in_flight.values()]:  # the request, then the later ones in order
            if later.version is not None and later.version != held:
                worker.set_weights.remote(self.weight_refs[later.version], later.version)
                held = later.version
            resent = worker.collect.remote(later.iteration, later.requests[s], later.rngs[s])
            if later is request:
                future = resent
            else:
                later.futures[s] = resent
        if self.version is not None and self.version != held:
            worker.set_weights.remote(self.weight_refs[self.version], self.version)  # as the others have
        return future

    # ------------------------------------------------------------------ weights
    def sync_weights(self, learner) -> dict[str, float]:
        ray = require_ray()
        from ray.exceptions import RayActorError

        start = time.perf_counter()
        refs, total, peak = [], 0, 0
        for bucket in buckets(learner.rollout_weights().items(), self.bucket_bytes):  # layer order
            size = sum(nbytes(t) for t in bucket.values())
            refs.append(ray.put(bucket))
            total, peak = total + size, max(peak, size)
        self.version = int(learner.policy_version)
        self.weight_refs[self.version] = refs
        needed = {self.version} | {r.version for r in self.in_flight.values()}
        for old in [v for v in self.weight_refs if v not in needed]:
            del self.weight_refs[old]
        acks = [w.set_weights.remote(refs, self.version) for w in self.workers]
        if not self.in_flight:  # synchronous: the sync ends when the workers hold them
            for ack in acks:
                try:
                    ray.get(ack)
                except RayActorError:  # replaced when its next rollout is collected
                    pass
        self.plan.sync_weights(learner)
        return {"sync_bytes": float(total), "sync_bucket_peak": float(peak), "sync_time": time.perf_counter() - start}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        while self.in_flight:  # the rollouts ahead of the update belong to the checkpoint, in order
            iteration = min(self.in_flight)
            self.queue.put(iteration, self._gather(self.in_flight.pop(iteration)))
        if any(s is None for s in self.shard_states):  # nothing collected yet in this process
            self.shard_states = self._fetch_states()
        state = self.plan.state_dict(self.shard_states)
        queued = self.queue.state_dict()
        if queued is not None:
            state["pending"] = queued
        return state

    def _fetch_states(self) -> list[dict[str, Any]]:
        return ray_get([w.shard_state.remote() for w in self.workers])

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        state = dict(state)
        self.queue.load_state_dict(state.pop("pending", None))
        shard_states, notes = self.plan.load_state_dict(state)
        calls = [
            (s, w.load_state.remote(st)) for s, (w, st) in enumerate(zip(self.workers, shard_states)) if st is not None
        ]
        for s, call in calls:
            notes = list(notes) + ray_get(call)
            self.shard_states[s] = shard_states[s]
        return notes
