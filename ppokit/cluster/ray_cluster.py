"""The Ray side of a run: start or join Ray, reserve resources, shut everything down.

:class:`Cluster` reserves one placement group for the run's actors and waits for it at
most ``cluster.placement_timeout`` seconds: a request the cluster cannot satisfy is a
:class:`~ppokit.errors.UserError` naming the missing resources, never a silent hang.

Bundles (RLinf's component placement in its simplest form):

- ``split``: one bundle ``{CPU: cpus_per_worker, GPU: gpus_per_worker}`` per rollout
  worker and one per learner rank: the rollout and the update never share a device.
- ``colocated``: ``max(W, L)`` such bundles; rollout worker i and learner rank i share
  bundle i, each asking for half of it (time-sharing one device).

With ``cluster.learners: 1`` the learner is the training process itself and takes no
bundle. :meth:`Cluster.close` kills the actors, removes the placement group and, when
this run started Ray (``cluster.address: null``), shuts Ray down: no Ray process of the
run outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

from ppokit.cluster import require_ray
from ppokit.errors import SetUpInterrupted, UserError
from ppokit.persistence.signals import handlers_restored

# Ray starts worker processes at niceness 15 (below the driver and Ray's own daemons). The
# run's actors do its main work: at 15 a CPU shared with anything at niceness 0 (the driver's
# update, another job) starves them (a rollout worker then generates 2-3x slower).
ACTOR_ENV = {"RAY_worker_niceness": "0"}
# The job (this process's connection to Ray) of the local Ray start_local_ray started with ACTOR_ENV:
# while connected to it every worker, Ray's idle pre-started ones included, runs at niceness 0 and
# actors need no runtime_env (one makes Ray start a fresh worker process per actor: about 1 s more).
_job_at_driver_priority: str | None = None


def start_local_ray(**kwargs: Any) -> None:
    """``ray.init(**kwargs)`` (no ``address``: a local Ray), its raylet started with :data:`ACTOR_ENV`
    so that every worker process runs at the driver's priority."""
    global _job_at_driver_priority
    ray = require_ray()
    saved = {key: os.environ.get(key) for key in ACTOR_ENV}
    os.environ.update(ACTOR_ENV)  # the raylet inherits the driver's environment
    try:
        ray.init(**kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if not os.environ.get("RAY_ADDRESS"):  # else ray.init joined the Ray there, started elsewhere
        _job_at_driver_priority = ray.get_runtime_context().get_job_id()


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """SIGINT's and SIGTERM's handlers as they were before the block: ``ray.init`` replaces SIGTERM's
    in the driver (with ``sys.exit(15)`` while it starts, and later a stack dump and an abort),
    where the run's (:class:`ppokit.persistence.resume.GracefulStop`) stops it with one line and closes the
    cluster. A SIGTERM during ``ray.init`` itself is one for the set-up too."""
    with handlers_restored() as ours:
        try:
            yield
        except SystemExit as exc:  # Ray's own handler, the only one that exits with the signal's number
            if not ours or exc.code != signal.SIGTERM:
                raise
            raise SetUpInterrupted(signal.SIGTERM) from None


# What Ray's processes show in /proc/PID/cmdline (its daemons, agents and workers)
_RAY_PROCESS_MARKS = ("raylet", "gcs_server", "ray::", "/ray/")


def _shut_down_a_start_cut_short(ray: Any) -> None:
    """After ``ray.init`` was cut short: the Ray processes this process started, killed, then
    ``ray.shutdown()``. Ray's own shutdown stops the raylet but not the dashboard and runtime-env
    agents a raylet early in its start is still starting, which then run on. So the processes are
    first stopped (SIGSTOP: none starts another) until no new one appears, then killed (Linux:
    found through /proc; elsewhere Ray's shutdown alone)."""
    stopped: set[int] = set()
    while new := {p for p in _descendants(os.getpid()) if p not in stopped and _is_ray(p)}:
        for pid in new:
            with contextlib.suppress(OSError):  # gone already
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    ray.shutdown()


def _is_ray(pid: int) -> bool:
    return any(mark in _cmdline(pid) for mark in _RAY_PROCESS_MARKS)


def _descendants(root: int) -> list[int]:
    """The PIDs of ``root``'s children, theirs, and so on (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def workers_at_driver_priority() -> bool:
    """Whether every worker of the Ray this process is connected to runs at niceness 0 (a Ray
    :func:`start_local_ray` started, still the same connection)."""
    ray = require_ray()
    return ray.is_initialized() and ray.get_runtime_context().get_job_id() == _job_at_driver_priority


class Cluster:
    """Ray for one run: the placement group and the actors created in it."""

    def __init__(self, cfg, *, rollout_workers: int, learners: int):
        ray = require_ray(cfg)
        c = cfg.cluster
        self.cfg = cfg
        self.owned = False
        self.actors: list[Any] = []
        self.pg = None
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
            try:
                with _signal_handlers_kept():
                    if c.address is None:
                        start_local_ray(**kwargs)
                    else:
                        ray.init(address=c.address, **kwargs)
            except ConnectionError as exc:
                raise UserError(
                    f"cluster.address={c.address}: cannot connect to Ray ({str(exc).splitlines()[0]}); "
                    "start the head node with 'ray start --head' or use cluster.address=null"
                ) from None
            except SetUpInterrupted:
                _shut_down_a_start_cut_short(ray)
                raise
            self.owned = True
        try:
            self.worker_bundles, self.learner_bundles, bundles = self._bundles(rollout_workers, learners)
            self.share = 0.5 if c.placement == "colocated" else 1.0
            if bundles:
                self._reserve(bundles, rollout_workers, learners)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ placement
    def _bundles(self, workers: int, learners: int) -> tuple[list[int], list[int], list[dict[str, float]]]:
        c = self.cfg.cluster
        bundle = {"CPU": float(c.cpus_per_worker)}
        if c.gpus_per_worker:
            bundle["GPU"] = float(c.gpus_per_worker)
        if c.placement == "colocated":
            n = max(workers, learners)
            return list(range(workers)), list(range(learners)), [dict(bundle) for _ in range(n)]
        return (
            list(range(workers)),
            list(range(workers, workers + learners)),
            [dict(bundle) for _ in range(workers + learners)],
        )

    def _reserve(self, bundles: list[dict[str, float]], workers: int, learners: int) -> None:
        ray = require_ray()
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group

        timeout = self.cfg.cluster.placement_timeout
        if self.owned and self._missing(bundles):  # a local Ray this run started: no node will join
            raise UserError(self._unplaceable(bundles, workers, learners, None))
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            self.pg = None
            raise UserError(self._unplaceable(bundles, workers, learners, timeout)) from None

    @staticmethod
    def _need(bundles: list[dict[str, float]]) -> dict[str, float]:
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        return need

    def _missing(self, bundles: list[dict[str, float]]) -> list[str]:
        """What the cluster lacks in total for ``bundles`` (``"GPU 1 more"``), free or not."""
        total = require_ray().cluster_resources()
        return [
            f"{k} {v - total.get(k, 0.0):g} more"
            for k, v in sorted(self._need(bundles).items())
            if v > total.get(k, 0.0)
        ]

    def _unplaceable(self, bundles: list[dict[str, float]], workers: int, learners: int, timeout: float | None) -> str:
        """The error text; ``timeout`` None: not waited for (a local Ray this run started)."""
        ray = require_ray()
        need = self._need(bundles)
        total, free = ray.cluster_resources(), ray.available_resources()
        missing = self._missing(bundles)
        who = [f"{workers} rollout worker(s)"] if workers else []
        who += [f"{learners} learner(s)"] if learners else []
        c = self.cfg.cluster
        have = ", ".join(f"{k} {total.get(k, 0.0):g} ({free.get(k, 0.0):g} free)" for k in sorted(need))
        why = (
            ("missing: " + ", ".join(missing)) if missing else "the resources exist but are taken or spread over nodes"
        )
        return (
            f"the Ray cluster cannot place {' and '.join(who)} with {c.cpus_per_worker:g} CPU and "
            f"{c.gpus_per_worker:g} GPU each ({c.placement}): they need "
            f"{', '.join(f'{k} {v:g}' for k, v in sorted(need.items()))}, the cluster has {have}; {why} "
            + (
                f"(waited {timeout:g} s, cluster.placement_timeout)"
                if timeout is not None
                else "(the local Ray this run started: no node will join)"
            )
            + "; lower cluster.cpus_per_worker, "
            "cluster.gpus_per_worker or the number of workers, or add nodes"
        )

    def actor_options(self, role: str, index: int) -> dict[str, Any]:
        """``.options(...)`` of actor ``index`` of ``role`` (``"rollout"`` or ``"learner"``)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.cfg.cluster
        bundle = (self.worker_bundles if role == "rollout" else self.learner_bundles)[index]
        options = {
            "num_cpus": c.cpus_per_worker * self.share,
            "num_gpus": c.gpus_per_worker * self.share,
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            ),
        }
        if not workers_at_driver_priority():
            options["runtime_env"] = {"env_vars": ACTOR_ENV}  # a Ray started elsewhere
        return options

    def start_actor(self, cls: type, role: str, index: int, *args: Any) -> Any:
        """An actor of ``cls`` (a plain class, made a Ray actor here) in its bundle."""
        ray = require_ray()
        actor = ray.remote(cls).options(**self.actor_options(role, index)).remote(*args)
        self.actors.append(actor)
        return actor

    def forget(self, actor: Any) -> None:
        """Kill ``actor`` (a dead or replaced one) and stop tracking it."""
        ray = require_ray()
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
        self.actors = [a for a in self.actors if a is not actor]

    def describe(self) -> str:
        c = self.cfg.cluster
        where = "local Ray" if c.address is None else f"Ray at {c.address}"
        sharding = c.sharding + (", CPU offload" if c.cpu_offload else "")
        return (
            f"cluster: {where}, {c.rollout_workers} rollout worker(s), {c.learners} learner(s) ({sharding}), "
            f"{c.placement} "
            f"placement, {c.cpus_per_worker:g} CPU / {c.gpus_per_worker:g} GPU each"
        )

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Kill the actors, release the placement group, shut Ray down if this run started it."""
        try:
            ray = require_ray()
        except UserError:
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if self.pg is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        if self.owned and ray.is_initialized():
            ray.shutdown()
            self.owned = False
