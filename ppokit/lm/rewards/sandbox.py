"""The ``code`` reward: run the response's Python program against the record's tests, sandboxed.

:func:`code_reward` gives the fraction of tests passed: :func:`extract_program` takes the
program (the last fenced ``python`` block), :func:`parse_tests` the record's ``tests`` (assert
statements run after the program as module ``solution``, or ``{"input", "output"}`` pairs on
stdin/stdout, :func:`same_output`), and :func:`run_python` runs each test in a fresh process.
After a timeout the remaining tests count as failed (a hanging program costs one time limit, not
one per test); the reason returned is the most telling failure (:data:`FAILURE_ORDER`).

A run is contained by: a guard, a supervisor that forks the program and kills and reaps everything
it started (daemons included) when it ends or is stopped, and that watches a pipe whose write end
only the caller holds, so that a run never outlives its caller; a process count (as root a ``pids``
cgroup per run, else ``RLIMIT_NPROC``); rlimits on CPU, address space, file size and core files; a
wall-clock limit; no network (bubblewrap, else ``unshare``, else nothing: :func:`isolation`,
:func:`isolation_warning`); a fresh working directory. Run as root, the program runs as ``nobody``
where it can (:func:`describe_isolation`). The harness shares the program's interpreter: it stops
accidents and the usual reward hacks, not a program that inspects its frames or kills its guard.
Every level of isolation: docs/environments.md, "The code reward's sandbox".
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOBODY = 65534
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
# Failure kinds, most telling first: the reason reported for a sample with several failures.
FAILURE_ORDER = (
    "no_program",
    "syntax_error",
    "network",
    "processes",
    "memory",
    "timeout",
    "output_limit",
    "error",
    "wrong_answer",
)


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run: ``timeout`` wall seconds, ``cpu_seconds`` (default: the timeout,
    rounded up), ``memory_mb`` of address space, ``max_processes`` besides the program,
    ``file_size_mb`` for any file it writes (its output included)."""

    timeout: float = 5.0
    cpu_seconds: int | None = None
    memory_mb: int = 1024
    max_processes: int = 8
    file_size_mb: int = 16

    @property
    def cpu(self) -> int:
        return self.cpu_seconds if self.cpu_seconds is not None else max(1, math.ceil(self.timeout))


@dataclass
class RunResult:
    """One sandboxed run: ``status`` is ``ok`` (exit 0) or a failure kind of
    :data:`FAILURE_ORDER`; ``stdout`` / ``stderr`` as text (cut at the file-size limit)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str


# --------------------------------------------------------------------------- isolation
@functools.cache
def isolation() -> str:
    """The network isolation in use: ``bwrap``, ``unshare``, ``unshare-user`` or ``none``
    (probed once per process: the first that runs a program here wins)."""
    forced = os.environ.get("PPOKIT_SANDBOX_ISOLATION")
    if forced:
        return forced
    for kind in ("bwrap", "unshare", "unshare-user"):
        with tempfile.TemporaryDirectory(prefix="ppokit-probe-") as workdir:  # as a program's own directory
            prefix = _isolation_prefix(kind, workdir, None)
            if prefix is None:
                continue
            try:
                done = subprocess.run(
                    prefix + [sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30, cwd=workdir
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
        if done.returncode == 0:
            return kind
    return "none"


@functools.cache
def _drop_to_nobody() -> bool:
    """Run as root: whether the program can run as ``nobody`` (the interpreter readable by it)."""
    if os.geteuid() != 0:
        return False
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", "pass"],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            capture_output=True,
            timeout=30,
            cwd="/",
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _runs_as_nobody() -> bool:
    """Run as root: whether programs run as ``nobody``: the interpreter usable by it, and the
    user present where the program runs (``unshare-user``'s namespace maps root alone)."""
    return isolation() != "unshare-user" and _drop_to_nobody()


def process_limit() -> str:
    """How the process count is limited: ``cgroup`` (root: a pids cgroup per run), ``rlimit``
    (``RLIMIT_NPROC``) or ``none``."""
    if os.geteuid() != 0:
        return "rlimit"
    if _pids_cgroup_parent() is not None:
        return "cgroup"
    return "rlimit" if _runs_as_nobody() else "none"


def describe_isolation() -> str:
    """One line for the run's log: what contains the programs the ``code`` reward runs."""
    network = {
        "bwrap": "no network (bubblewrap)",
        "unshare": "no network (unshare --net)",
        "unshare-user": "no network (unshare --user --net)",
        "none": "NETWORK NOT ISOLATED (install bubblewrap, or allow unshare)",
    }[isolation()]
    processes = {
        "rlimit": "process limit (RLIMIT_NPROC)",
        "cgroup": "process limit (pids cgroup)",
        "none": "NO PROCESS LIMIT (running as root without a pids cgroup)",
    }[process_limit()]
    user = "as nobody" if _runs_as_nobody() else ("as root" if os.geteuid() == 0 else "as this user")
    files = "read-only file system" if isolation() == "bwrap" else "file system writable " + user
    return f"code sandbox: {network}, {processes}, CPU/memory/file-size limits, {files}"


def isolation_warning() -> str | None:
    """A warning to print once at start when programs run without network isolation, else None."""
    if isolation() != "none":
        return None
    return (
        "the code reward runs programs WITHOUT network isolation: neither bubblewrap (bwrap) nor unshare "
        "works here; install bubblewrap (apt-get install bubblewrap) to cut programs off the network"
    )


def _interpreter_paths_under(directory: str) -> list[str]:
    """The interpreter's directories (the virtual environment, the base installation, the
    executable's) that lie inside ``directory``, outermost first, without nested repeats."""
    root = os.path.realpath(directory) + os.sep
    candidates = {
        os.path.realpath(p)
        for p in (
            sys.prefix,
            sys.base_prefix,
            os.path.dirname(sys.executable),
            os.path.dirname(os.path.realpath(sys.executable)),
        )
    }
    inside = sorted(p for p in candidates if (p + os.sep).startswith(root))
    return [p for i, p in enumerate(inside) if not any((p + os.sep).startswith(q + os.sep) for q in inside[:i])]


def _isolation_prefix(kind: str, workdir: str, cgroup: str | None) -> list[str] | None:
    """The command that runs a program under isolation ``kind``, or None where its tool is
    missing. A run outlives neither its guard nor its caller in any of them (module docstring):
    bwrap's ``--die-with-parent`` and unshare's ``--kill-child`` are second locks."""
    if kind == "bwrap":
        if shutil.which("bwrap") is None:
            return None
        prefix = [
            "bwrap",
            "--unshare-net",
            "--unshare-pid",
            "--as-pid-1",  # the launcher is the namespace's init
            "--unshare-ipc",
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--tmpfs",
            "/tmp",
        ]
        for path in _interpreter_paths_under("/tmp"):  # a venv in /tmp stays visible under the fresh /tmp
            prefix += ["--ro-bind", path, path]
        prefix += ["--bind", workdir, workdir, "--chdir", workdir]
        if cgroup is not None:
            prefix += ["--bind", cgroup, cgroup]
        return prefix + ["--"]
    if kind in ("unshare", "unshare-user"):
        if shutil.which("unshare") is None:
            return None
        user = ["--user", "--map-root-user"] if kind == "unshare-user" else []
        return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--"]
    if kind == "none":
        return []
    raise ValueError(
        f"unknown sandbox isolation {kind!r} (PPOKIT_SANDBOX_ISOLATION): bwrap, unshare, unshare-user or none"
    )


def _tasks_of(uid: int) -> int:
    """The tasks (threads included, as ``RLIMIT_NPROC`` counts them) of user ``uid`` in this /proc."""
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return n


# ------------------------------------------------------------------------ pids cgroup
_RUN_NUMBERS = itertools.count()


@functools.cache
def _pids_cgroup_parent() -> str | None:
    """The writable cgroup-v1 ``pids`` folder of this process (root only), or None. The
    folders of runs whose process is gone (a reward worker killed mid-run) are removed."""
    if os.geteuid() != 0:
        return None
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    root = next(
        (
            line.split()[1]
            for line in mounts
            if line.split()[2:3] == ["cgroup"] and "pids" in line.split()[3].split(",")
        ),
        None,
    )
    own = next((line.split(":", 2)[2] for line in groups if line.split(":")[1:2] == ["pids"]), None)
    if root is None or own is None:
        return None
    parent = os.path.join(root, own.lstrip("/"))
    probe = os.path.join(parent, f"ppokit-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        ok = os.path.exists(os.path.join(probe, "pids.max"))
        os.rmdir(probe)
    except OSError:
        return None
    if not ok:
        return None
    for stale in Path(parent).glob("ppokit-sandbox-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _end_run_cgroup(str(stale))
    return parent


def _new_run_cgroup(max_processes: int) -> str | None:
    """A fresh pids cgroup for one run: room for the guard, the program and ``max_processes``
    more. Fresh, so that nothing of an earlier run (a zombie its parent has not reaped yet:
    ``pids.current`` counts those) is counted against this one."""
    parent = _pids_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"ppokit-sandbox-{os.getpid()}-r{next(_RUN_NUMBERS)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        Path(path, "pids.max").write_text(str(max_processes + 2))
    except OSError:
        _end_run_cgroup(path)
        return None
    return path


def _end_run_cgroup(path: str, patience: float = 10.0) -> None:
    """Kill what is left in a run's cgroup (nothing, unless its guard was killed) and remove it."""
    try:
        Path(path, "pids.max").write_text("0")  # no new processes while the last ones are killed
        deadline = time.monotonic() + patience
        while pids := Path(path, "cgroup.procs").read_text().split():
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() > deadline:
                return  # left for a later process's sweep
            time.sleep(0.01)  # the kernel takes the killed processes out
        os.rmdir(path)
    except OSError:
        pass


# ------------------------------------------------------------------------------ running
# The launcher is the run's guard: it forks the program and, once the program has ended or
# the caller has closed the lifeline, kills every process left, then exits with the program's
# status (128 + signal when killed). It is the init of the run's process namespace (bwrap's or
# unshare's: its exit kills every process in it), or else a child subreaper, to which the
# program's orphans are reparented, so that killing its children until none is left kills them all.
LAUNCHER = r"""
import json, os, resource, select, signal, sys
cfg = json.loads(sys.argv[1])
if cfg["cgroup"]:
    with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
        f.write("0")
guard, lifeline = os.getpid(), cfg["lifeline"]
prctl = None
if guard != 1:                 # not a namespace's init (whose exit kills every process in it)
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the program's orphans are reparented here
    except (ImportError, OSError, AttributeError):
        prctl = None
wake_r, wake_w = os.pipe()     # SIGCHLD wakes the guard's select
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
program = os.fork()
if program:
    code = 128 + signal.SIGKILL
    while True:
        pid, status = os.waitpid(program, os.WNOHANG)
        if pid:
            code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            break
        if lifeline in select.select([lifeline, wake_r], [], [])[0]:
            break              # the caller closed its end (time limit) or is gone
        os.read(wake_r, 4096)
    if guard != 1:
        me = str(guard).encode()
        while True:            # kill all children; reap one (its orphans become children); again
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break          # no child left: the usual case, without a scan
            for entry in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open("/proc/" + entry + "/stat", "rb") as f:
                        if f.read().rsplit(b")", 1)[1].split()[1] == me:  # its parent
                            os.kill(int(entry), signal.SIGKILL)
                except (OSError, IndexError):
                    pass
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    os._exit(code)
signal.set_wakeup_fd(-1)
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
for fd in (wake_r, wake_w, lifeline):
    os.close(fd)
if prctl is not None:
    prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the program dies with its guard
    if os.getppid() != guard:
        os._exit(128 + signal.SIGKILL)
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
def tasks_of(uid):
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat("/proc/" + entry).st_uid == uid:
                    n += len(os.listdir("/proc/" + entry + "/task"))
            except OSError:
                pass
    return n
limits = [(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1), (resource.RLIMIT_AS, cfg["memory"], cfg["memory"]),
          (resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]), (resource.RLIMIT_CORE, 0, 0)]
if cfg["nproc"] is not None:   # counted by the caller (root) or here (this user's, as this /proc shows them)
    n = (cfg["nproc_base"] + 1 if cfg["nproc_base"] is not None else tasks_of(os.getuid())) + cfg["nproc"]
    limits.append((resource.RLIMIT_NPROC, n, n))
for which, soft, hard in limits:
    resource.setrlimit(which, (soft, hard))
def run(mode):                # locals, not module globals: the program cannot read the nonce from __main__
    source = open("solution.py", encoding="utf-8").read()
    if mode == "assert":
        nonce = sys.stdin.readline().strip()
        sys.stdin.close()
        sys.stdin = open(os.devnull)
        namespace = {"__name__": "solution", "__builtins__": __builtins__}
        exec(compile(source, "solution.py", "exec"), namespace)
        exec(compile(open("test.py", encoding="utf-8").read(), "test.py", "exec"), namespace)
        sys.stdout.flush()
        os.write(1, ("\n" + nonce + "\n").encode())
    else:
        exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
mode = cfg["mode"]
del cfg, limits, json, prctl
run(mode)
"""

_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")
GUARD_GRACE = 10.0  # seconds for a guard to end its run once told to (it takes milliseconds)


def run_python(
    program: str, *, stdin: str = "", test: str | None = None, limits: SandboxLimits = SandboxLimits()
) -> RunResult:
    """Run ``program`` in the sandbox (module docstring): as ``__main__`` with ``stdin``, or,
    with ``test``, as module ``solution`` followed by the test statements (``ok`` only when
    the test ran to its end)."""
    workdir = tempfile.mkdtemp(prefix="ppokit-sandbox-")
    try:
        return _run_in(workdir, program, stdin, test, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _write_files(workdir: str, program: str, stdin: str, test: str | None, as_nobody: bool) -> tuple[str, str, str]:
    """The program (and its test), its input and empty output files in ``workdir`` (owned by
    nobody when the run drops to it): the input, stdout and stderr paths."""
    Path(workdir, "solution.py").write_text(program, encoding="utf-8")
    if test is not None:
        Path(workdir, "test.py").write_text(test, encoding="utf-8")
    out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
    # stdin: the program's input from a file (a pipe could block on a program that never reads),
    # or for a test the nonce through a pipe, which the launcher reads before the program runs
    in_path = os.path.join(workdir, ".stdin")
    Path(in_path).write_bytes(stdin.encode("utf-8") if test is None else b"")
    Path(out_path).touch()
    Path(err_path).touch()
    if as_nobody:
        for path in (workdir, *(os.path.join(workdir, f) for f in os.listdir(workdir))):
            os.chown(path, NOBODY, NOBODY)
    return in_path, out_path, err_path


def _program_env(workdir: str) -> dict[str, str]:
    """The program's environment: a few of ours (_ENV_KEEP), its home and temp in ``workdir``, one thread."""
    env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
    env.update(
        HOME=workdir,
        TMPDIR=workdir,
        PYTHONHASHSEED="0",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONIOENCODING="utf-8",
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    return env


def _run_in(workdir: str, program: str, stdin: str, test: str | None, limits: SandboxLimits) -> RunResult:
    as_nobody = _runs_as_nobody()
    in_path, out_path, err_path = _write_files(workdir, program, stdin, test, as_nobody)
    limit = process_limit()
    cgroup = _new_run_cgroup(limits.max_processes) if limit == "cgroup" else None
    cfg = {
        "cpu": limits.cpu,
        "memory": limits.memory_mb << 20,
        "fsize": limits.file_size_mb << 20,
        "nproc": limits.max_processes if limit == "rlimit" else None,
        "nproc_base": _tasks_of(NOBODY) if limit == "rlimit" and as_nobody else None,
        "mode": "assert" if test is not None else "main",
        "uid": NOBODY if as_nobody else None,
        "cgroup": cgroup,
    }
    prefix = _isolation_prefix(isolation(), workdir, cgroup) or []
    env = _program_env(workdir)
    nonce = secrets.token_hex(16)
    proc = None
    cfg["lifeline"], keep_alive = os.pipe()  # the guard ends the run when keep_alive closes (module docstring)
    try:
        start = time.monotonic()
        with open(in_path, "rb") as given, open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    prefix + [sys.executable, "-I", "-c", LAUNCHER, json.dumps(cfg)],
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.PIPE if test is not None else given,
                    stdout=out,
                    stderr=err,
                    pass_fds=(cfg["lifeline"],),
                    start_new_session=True,
                )
            finally:
                os.close(cfg["lifeline"])
        if test is not None:
            try:
                proc.stdin.write((nonce + "\n").encode())
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        try:
            proc.wait(timeout=limits.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
    finally:
        os.close(keep_alive)  # the run ends: its guard kills whatever the program left, and exits
        if proc is not None:
            _end(proc)
        if cgroup is not None:
            _end_run_cgroup(cgroup)
    elapsed = time.monotonic() - start
    stdout = _read_capped(out_path, limits.file_size_mb << 20)
    stderr = _read_capped(err_path, 64 << 10)
    return _result(proc.returncode, stdout, stderr, timed_out, elapsed, nonce if test is not None else None, limits)


def _result(
    code: int | None, stdout: str, stderr: str, timed_out: bool, elapsed: float, nonce: str | None, limits
) -> RunResult:
    """The run's status from its exit code and output; a test run (``nonce``) passed only when its
    last line is the nonce (the launcher prints it after the test)."""
    signum = -code if code is not None and code < 0 else code - 128 if code is not None and code > 128 else None
    if nonce is not None and code == 0:
        lines = stdout.rstrip("\n").split("\n")
        code = 0 if lines and lines[-1] == nonce else 1  # exited early (sys.exit before the test)
        stdout = "\n".join(lines[:-1]) if code == 0 else stdout
        if code:
            stderr += "\nthe program exited before the test finished"
    status = "ok" if code == 0 and not timed_out else _classify(timed_out, signum, stderr, elapsed, limits)
    return RunResult(status, code, stdout, stderr)


def _end(proc: subprocess.Popen) -> None:
    """Wait for a run whose lifeline is closed: its guard kills what is left and exits. A guard
    that does not (the machine stalls), or that died of a signal itself, is killed with its
    process group, the program's (unreaped, its pid still names that group)."""
    try:
        proc.wait(timeout=GUARD_GRACE)
    except subprocess.TimeoutExpired:
        pass
    if proc.returncode is None or proc.returncode < 0:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=GUARD_GRACE)
        except subprocess.TimeoutExpired:
            pass


def _read_capped(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _classify(timed_out: bool, signum: int | None, stderr: str, elapsed: float, limits: SandboxLimits) -> str:
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out or signum in (signal.SIGXCPU, signal.SIGKILL) and elapsed >= min(limits.cpu, limits.timeout) * 0.5:
        return "timeout"
    if signum == signal.SIGXFSZ or last.startswith("OSError: [Errno 27]"):
        return "output_limit"
    if "MemoryError" in last or "Cannot allocate memory" in stderr:
        return "memory"
    if "BlockingIOError" in last or "Resource temporarily unavailable" in last:
        return "processes"
    if any(
        marker in last
        for marker in (
            "ConnectionRefusedError",
            "Network is unreachable",
            "gaierror",
            "Temporary failure in name resolution",
            "Name or service not known",
            "Errno 101",
            "Errno 99",
        )
    ):
        return "network"
    if last.startswith("AssertionError"):
        return "wrong_answer"
    if "SyntaxError" in last and 'File "solution.py"' in stderr or last.startswith("IndentationError"):
        return "syntax_error"
    return "error"


# ------------------------------------------------------------------------ the reward
def extract_program(response: str) -> str:
    """The program in a response: the last ```python (or ```py) block, else the last fenced
    block, else the whole response."""
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return response


def parse_tests(tests: Any) -> list[dict[str, str] | str]:
    """The ``tests`` field as a list of tests (module docstring): a list, a JSON string of one, or
    APPS-style ``{"inputs": [...], "outputs": [...]}``; a ValueError for any other shape."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            raise ValueError(
                "code: the tests field is text but not JSON; give a list of assert statements or "
                'of {"input": ..., "output": ...}'
            ) from None
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("code: tests has different numbers of inputs and outputs")
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"code: tests must be a non-empty list (got {type(tests).__name__})")
    parsed: list[dict[str, str] | str] = []
    for i, test in enumerate(tests):
        if isinstance(test, str):
            parsed.append(test)
        elif isinstance(test, dict) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            parsed.append({"input": test["input"], "output": test["output"]})
        else:
            raise ValueError(
                f"code: test {i} must be a string of Python statements or "
                f'{{"input": str, "output": str}} (got {test!r:.60})'
            )
    return parsed


def same_output(got: str, expected: str) -> bool:
    """Equal line by line, trailing whitespace and trailing blank lines ignored."""

    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def code_reward(
    prompt: str, response: str, *, tests: Any, timeout: float = 5.0, memory_mb: int = 1024, **_: Any
) -> tuple[float, str | None]:
    """``(fraction of tests passed, reason or None)`` for the response's program (module
    docstring). ``timeout`` (wall seconds per test) and ``memory_mb`` may also come as
    fields of the record."""
    cases = parse_tests(tests)
    program = extract_program(response)
    if not program.strip():
        return 0.0, "no_program"
    limits = SandboxLimits(timeout=float(timeout), memory_mb=int(memory_mb))
    passed, failures = 0, []
    for case in cases:
        if "timeout" in failures:
            failures.append("timeout")
            continue
        if isinstance(case, str):
            result = run_python(program, test=case, limits=limits)
            ok = result.status == "ok"
        else:
            result = run_python(program, stdin=case["input"], limits=limits)
            ok = result.status == "ok" and same_output(result.stdout, case["output"])
        if ok:
            passed += 1
        else:
            failures.append("wrong_answer" if result.status == "ok" else result.status)
    reason = min(failures, key=FAILURE_ORDER.index) if failures else None
    return passed / len(cases), reason


def warm_up() -> None:
    """Probe the isolation once (a reward worker does it before its first sample)."""
    isolation()
    process_limit()
