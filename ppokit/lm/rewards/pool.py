"""Reward functions that fail safely: worker processes, a time limit per sample, counted errors.

:class:`RewardPool` runs a user's reward function (or ``math``, or ``code``) in worker processes
kept for the whole run; :meth:`RewardPool.score` returns a batch's scores in input order
(:class:`RewardResults`). A sample whose function raises, returns no finite number, kills its
worker or runs past ``timeout`` seconds gets ``reward_on_error`` and is marked with the reason. A
late worker is killed with SIGKILL (SymPy or a ``while True`` ignores anything gentler) and
replaced. More than ``max_reward_errors`` errors stop the run (:func:`check_error_limit`); the
reason of a ``(score, reason)`` return is counted as a note, not an error.

Each worker is a fresh interpreter (``python -c`` running :func:`_worker_entry`) on a socket pair.
Forking the trainer can deadlock (torch loaded, a lock held by another thread), and
multiprocessing's ``spawn`` and ``forkserver`` re-import ``__main__``: a training script without a
``__main__`` guard would run again in every worker. A worker loads the function by its spec
(:func:`_portable_spec`), calls its ``warm_up()`` before it reports ready (so heavy imports never
count against a sample's time limit), runs in its own session and exits when the trainer goes.
:func:`make_reward_scorer` scores the cheap built-ins in the calling process instead
(:class:`InProcessScorer`: they cannot hang; docs/performance.md, "Reward workers").
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.lm.rewards.functions import (
    BUILTIN_REWARDS,
    IN_PROCESS_REWARDS,
    RewardFunction,
    load_reward_fn,
    reward_fields,
)

ERROR_KINDS = ("error", "bad_value", "timeout", "worker_died")
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_ERRORS = 0.1
START_TIMEOUT = 120.0  # seconds for a worker to import the reward function
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding ppokit/


# ----------------------------------------------------------------------------- results
@dataclass
class RewardResults:
    """The scores of one batch, in input order, and what went wrong.

    ``errors[i]`` is None for a sample scored normally, else ``(kind, reason)`` with kind
    one of :data:`ERROR_KINDS`; its score is then ``reward_on_error``. ``notes[i]`` is the
    reason a function returned with its score (``(score, reason)`` returns), else None.
    """

    scores: list[float]
    errors: list[tuple[str, str] | None]
    notes: list[str | None] = field(default_factory=list)

    @property
    def num_errors(self) -> int:
        return sum(e is not None for e in self.errors)

    def error_counts(self) -> dict[str, int]:
        """Errors by kind."""
        return dict(Counter(e[0] for e in self.errors if e is not None))

    def note_counts(self) -> dict[str, int]:
        """Notes by text (e.g. the code reward's ``timeout``, ``memory``)."""
        return dict(Counter(n for n in self.notes if n))

    def metrics(self) -> dict[str, float]:
        """Flat metrics for the tracker: ``reward_errors`` (count), ``reward_error_frac``, and
        ``reward_errors/<kind>`` for each kind that occurred."""
        n = max(len(self.scores), 1)
        out = {"reward_errors": float(self.num_errors), "reward_error_frac": self.num_errors / n}
        out.update({f"reward_errors/{kind}": float(c) for kind, c in sorted(self.error_counts().items())})
        out.update({f"reward_notes/{note}": float(c) for note, c in sorted(self.note_counts().items())})
        return out


def error_limit(max_reward_errors: float | None, batch_size: int) -> int | None:
    """The number of errors a batch of ``batch_size`` may have: ``max_reward_errors`` itself
    when it is 1 or more, else that fraction of the batch (rounded down); None = no limit."""
    if max_reward_errors is None:
        return None
    if max_reward_errors < 1:
        return int(math.floor(max_reward_errors * batch_size))
    return int(max_reward_errors)


def check_error_limit(results: RewardResults, max_reward_errors: float | None, name: str) -> None:
    """Raise a one-line :class:`UserError` when ``results`` has more errors than allowed."""
    limit = error_limit(max_reward_errors, len(results.scores))
    if limit is None or results.num_errors <= limit:
        return
    reasons = Counter(e[1] for e in results.errors if e is not None)
    reason, count = reasons.most_common(1)[0]
    first = next(i for i, e in enumerate(results.errors) if e is not None and e[1] == reason)
    allowed = f"{max_reward_errors:g} of the batch" if max_reward_errors < 1 else f"{limit}"
    raise UserError(
        f"reward function '{name}' failed on {results.num_errors} of {len(results.scores)} samples "
        f"(more than data.max_reward_errors={allowed}); most often ({count}x, first on sample {first}): "
        f"{reason}; fix the function, or raise data.max_reward_errors"
    )


def _check_options(timeout: float | None, reward_on_error: float, max_reward_errors: float | None) -> None:
    if timeout is not None and not (
        isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf
    ):
        raise UserError(f"the reward time limit must be a positive number of seconds (got {timeout!r})")
    if not (isinstance(reward_on_error, (int, float)) and math.isfinite(reward_on_error)):
        raise UserError(f"reward_on_error must be a finite number (got {reward_on_error!r})")
    if max_reward_errors is not None and not (
        isinstance(max_reward_errors, (int, float)) and max_reward_errors >= 0 and math.isfinite(max_reward_errors)
    ):
        raise UserError(
            "max_reward_errors must be a count (>= 1), a fraction of the batch (< 1), or null "
            f"(got {max_reward_errors!r})"
        )


# ------------------------------------------------------------------------- in-process
class InProcessScorer:
    """Scores in the calling process: errors caught per sample, no time limit. For the
    built-ins that cannot hang (:data:`ppokit.lm.rewards.functions.IN_PROCESS_REWARDS`)."""

    def __init__(
        self, spec: Any, *, reward_on_error: float = 0.0, max_reward_errors: float | None = DEFAULT_MAX_ERRORS
    ) -> None:
        _check_options(None, reward_on_error, max_reward_errors)
        self.reward = load_reward_fn(spec)
        self.name = self.reward.name
        self.reward_on_error = float(reward_on_error)
        self.max_reward_errors = max_reward_errors

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], fields_list: Sequence[dict[str, Any]] | None = None
    ) -> RewardResults:
        tasks = _tasks(prompts, responses, fields_list)
        outcomes = self.reward.outcomes(tasks)
        results = RewardResults([self.reward_on_error] * len(tasks), [None] * len(tasks), [None] * len(tasks))
        for index, (status, value, note) in enumerate(outcomes):
            _record(results, index, status, value, note, self.reward_on_error)
        check_error_limit(results, self.max_reward_errors, self.name)
        return results

    def close(self) -> None:
        pass

    def __enter__(self) -> InProcessScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------- pool
class _Worker:
    """One worker: a fresh interpreter running :func:`_worker_entry`, talking over a socket pair."""

    def __init__(self, payload: tuple) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from ppokit.lm.rewards.pool import _worker_entry; _worker_entry()",
                    str(child_sock.fileno()),
                ],
                pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )  # Ctrl-C in a terminal is the trainer's to handle
        finally:
            child_sock.close()  # the worker's end: EOF here when the worker dies
        self.conn = Connection(parent_sock.detach())
        self.conn.send(payload)
        self.ready = False
        self.spawned = time.monotonic()
        self.chunk: deque[int] = deque()  # sample indices sent and not answered yet
        self.started = 0.0  # when chunk[0] began (as seen from here)

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_description(self) -> str:
        try:
            code = self.process.wait(1)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


class RewardPool:
    """Worker processes that score samples with a per-sample time limit (module docstring).

    ``spec``: a reward spec (built-in name, ``module:fn``, ``file.py:fn``) or an importable
    callable. ``num_workers``: processes (default: the CPU count, at most 8). ``timeout``:
    seconds per sample. ``start_timeout``: seconds for a worker to load the function. Use
    as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        spec: Any,
        *,
        num_workers: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        reward_on_error: float = 0.0,
        max_reward_errors: float | None = DEFAULT_MAX_ERRORS,
        start_timeout: float = START_TIMEOUT,
    ) -> None:
        _check_options(timeout, reward_on_error, max_reward_errors)
        if num_workers is None:
            num_workers = max(1, min(8, os.cpu_count() or 1))
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise UserError(f"reward workers must be a positive integer (got {num_workers!r})")
        if timeout is None:
            raise UserError("the reward pool needs a time limit per sample (timeout, in seconds)")
        reward = load_reward_fn(spec)  # a bad spec fails here, in one line, before any worker starts
        self.name = reward.name
        self.timeout = float(timeout)
        self.reward_on_error = float(reward_on_error)
        self.max_reward_errors = max_reward_errors
        self.start_timeout = float(start_timeout)
        self._payload = (_portable_spec(spec, reward), list(sys.path), os.getcwd())
        self.total_errors = 0
        self.workers_replaced = 0
        self._closed = False
        self._workers = [_Worker(self._payload) for _ in range(num_workers)]
        while not all(w.ready for w in self._workers):
            self._wait_and_handle([], RewardResults([], [], []), deque())

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            try:
                worker.process.wait(2)
            except subprocess.TimeoutExpired:
                pass
            worker.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _fail(self, message: str) -> None:
        self.close()
        raise UserError(message)

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and start another in its place (ready once it has loaded the function)."""
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._payload)
        self.workers_replaced += 1

    # ------------------------------------------------------------------- scoring
    def score(
        self, prompts: Sequence[str], responses: Sequence[str], fields_list: Sequence[dict[str, Any]] | None = None
    ) -> RewardResults:
        """Scores of a batch in input order (:class:`RewardResults`); raises :class:`UserError`
        when the batch has more than ``max_reward_errors`` errors."""
        if self._closed:
            raise RuntimeError("RewardPool.score after close()")
        tasks = _tasks(prompts, responses, fields_list)
        results = RewardResults([self.reward_on_error] * len(tasks), [None] * len(tasks), [None] * len(tasks))
        pending = deque(range(len(tasks)))
        chunk_size = max(1, min(32, -(-len(tasks) // (4 * len(self._workers)))))
        busy: list[_Worker] = []
        while pending or busy:
            for worker in self._workers:  # hand out work to idle, ready workers
                if worker.ready and pending and worker not in busy:
                    indices = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
                    worker.chunk = deque(indices)
                    worker.started = time.monotonic()
                    worker.conn.send([tasks[i] for i in indices])
                    busy.append(worker)
            self._wait_and_handle(busy, results, pending)
        self.total_errors += results.num_errors
        check_error_limit(results, self.max_reward_errors, self.name)
        return results

    def _wait_and_handle(self, busy: list[_Worker], results: RewardResults, pending: deque) -> None:
        """Wait for the next message or deadline; record results; replace dead or late workers."""
        starting = [w for w in self._workers if not w.ready]
        deadlines = [w.started + self.timeout for w in busy] + [w.spawned + self.start_timeout for w in starting]
        left = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for conn in wait([w.conn for w in busy + starting], timeout=left):
            worker = next(w for w in busy + starting if w.conn is conn)
            if not worker.ready:
                self._on_start_message(worker)
                continue
            try:
                while worker.chunk:  # drain what this worker has sent
                    index, status, value, note = conn.recv()
                    worker.chunk.popleft()
                    worker.started = time.monotonic()
                    _record(results, index, status, value, note, self.reward_on_error)
                    if not conn.poll():
                        break
            except (EOFError, OSError):  # the worker died (os._exit, a signal, OOM)
                self._give_up_on(
                    worker,
                    "worker_died",
                    f"the worker process died ({worker.exit_description()})",
                    busy,
                    results,
                    pending,
                )
                continue
            if not worker.chunk:
                busy.remove(worker)
        now = time.monotonic()
        for worker in [w for w in busy if now - w.started > self.timeout and not w.conn.poll()]:
            self._give_up_on(worker, "timeout", f"timed out after {self.timeout:g} s", busy, results, pending)
        if any(not w.ready and now - w.spawned > self.start_timeout for w in self._workers):
            self._fail(
                f"reward function '{self.name}': a reward worker did not load it within "
                f"{self.start_timeout:g} s (does importing it hang?)"
            )

    def _on_start_message(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._fail(
                f"reward function '{self.name}': a reward worker exited while loading it ({worker.exit_description()})"
            )
        if message[0] == "load_error":
            self._fail(message[1])
        worker.ready = True

    def _give_up_on(
        self, worker: _Worker, kind: str, reason: str, busy: list[_Worker], results: RewardResults, pending: deque
    ) -> None:
        """The sample ``worker`` is on fails with ``reason``; its other samples go back in the queue."""
        _record(results, worker.chunk.popleft(), kind, reason, None, self.reward_on_error)
        pending.extendleft(reversed(worker.chunk))
        busy.remove(worker)
        self._replace(worker)


def make_reward_scorer(
    spec: Any,
    *,
    num_workers: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    reward_on_error: float = 0.0,
    max_reward_errors: float | None = DEFAULT_MAX_ERRORS,
    in_process: bool | None = None,
):
    """The scorer for ``spec``: :class:`InProcessScorer` for the cheap built-ins
    (``exact_match``, ``numeric_match``) unless ``in_process=False``, else a
    :class:`RewardPool`. Both have ``score(prompts, responses, fields_list)`` and ``close()``."""
    if in_process is None:
        in_process = isinstance(spec, str) and spec.strip() in IN_PROCESS_REWARDS
    if in_process:
        return InProcessScorer(spec, reward_on_error=reward_on_error, max_reward_errors=max_reward_errors)
    return RewardPool(
        spec,
        num_workers=num_workers,
        timeout=timeout,
        reward_on_error=reward_on_error,
        max_reward_errors=max_reward_errors,
    )


# ------------------------------------------------------------------------ helpers
def _tasks(
    prompts: Sequence[str], responses: Sequence[str], fields_list: Sequence[dict[str, Any]] | None
) -> list[tuple[int, str, str, dict[str, Any]]]:
    if fields_list is None:
        fields_list = [{}] * len(prompts)
    if not len(prompts) == len(responses) == len(fields_list):
        raise ValueError(
            f"reward scoring: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(fields_list)} field dicts must have the same length"
        )
    return [(i, p, r, reward_fields(f)) for i, (p, r, f) in enumerate(zip(prompts, responses, fields_list))]


def _record(
    results: RewardResults, index: int, status: str, value: Any, note: str | None, reward_on_error: float
) -> None:
    if status == "ok":
        results.scores[index] = value
        results.notes[index] = note
    else:
        results.scores[index] = reward_on_error
        results.errors[index] = (status, value)


def _portable_spec(spec: Any, reward) -> Any:
    """What a worker needs to load the reward: a spec string (file paths made absolute), or
    the pickled callable."""
    text = None
    if isinstance(spec, str):
        text = spec.strip()
    elif isinstance(spec, RewardFunction) and (BUILTIN_REWARDS.get(spec.spec) is spec.fn or ":" in spec.spec):
        text = spec.spec  # loaded from a spec: the worker loads it the same way
    if text is not None:
        target, sep, attr = text.rpartition(":")
        if sep and (target.endswith(".py") or "/" in target or "\\" in target):
            text = f"{Path(target).expanduser().resolve()}:{attr}"
        return ("spec", text)
    try:
        return ("pickled", pickle.dumps(reward.fn))
    except Exception:  # noqa: BLE001 - lambdas, closures, functions of a file loaded by path
        raise UserError(
            f"reward function '{reward.name}' cannot be sent to the reward workers (it is not "
            "importable); give it as 'module:function' or 'path/to/file.py:function'"
        ) from None


def _worker_entry() -> None:
    """A worker process's main: the socket's file descriptor is ``sys.argv[1]``."""
    conn = Connection(int(sys.argv[1]))
    try:
        payload = conn.recv()
    except (EOFError, OSError):
        return
    parent = os.getppid()

    def watch_parent() -> None:  # the trainer was killed: do not linger in a hung function
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True, name="ppokit-reward-watchdog").start()
    _worker_main(conn, payload)


def _worker_main(conn, payload: tuple) -> None:
    """A worker: take the trainer's ``sys.path`` and working directory, load the reward function,
    then score chunks until told to stop."""
    (kind, value), path, cwd = payload
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:
        pass

    try:
        reward = load_reward_fn(value if kind == "spec" else pickle.loads(value))
    except UserError as exc:
        conn.send(("load_error", str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - unpickling a callable whose module is gone
        conn.send(("load_error", f"a reward worker could not load the reward function: {exc}"))
        return
    warm_up = getattr(reward.fn, "warm_up", None)
    if callable(warm_up):  # heavy imports now, not inside the first sample's time limit
        try:
            warm_up()
        except Exception as exc:  # noqa: BLE001
            conn.send(("load_error", f"reward function '{reward.name}': preparing it failed: {exc}"))
            return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for task in chunk:
            status, result, note = reward.outcome(*task)
            conn.send((task[0], status, result, note))
