"""The code reward's sandbox: an infinite loop, a memory bomb, a fork bomb and a network call are
each contained and score 0 with a counted reason; tests in both formats; no process outlives its
run, its reward worker, or a daemon's escape from its session; runs are counted on their own, in
parallel too; every isolation kind that works on this machine."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ppokit.lm.rewards import sandbox
from ppokit.lm.rewards.pool import RewardPool
from ppokit.lm.rewards.sandbox import code_reward, extract_program, parse_tests, run_python, same_output

ADD = "def add(a, b):\n    return a + b\n"
BOMB = "import os\nwhile True:\n    os.fork()\n" + ADD
AMPLE = 30.0  # seconds: a time limit that only a hang reaches, on a machine as loaded as it gets
LIMITS = sandbox.SandboxLimits(timeout=AMPLE, memory_mb=512)


def _working_isolations():
    kinds = []
    for kind in ("bwrap", "unshare", "unshare-user"):
        prefix = sandbox._isolation_prefix(kind, "/tmp", None)
        if prefix is not None and subprocess.run(prefix + ["true"], capture_output=True).returncode == 0:
            kinds.append(kind)
    return kinds + ["none"]


@pytest.fixture(params=_working_isolations())
def isolation_kind(request, monkeypatch):
    monkeypatch.setenv("PPOKIT_SANDBOX_ISOLATION", request.param)
    sandbox.isolation.cache_clear()
    yield request.param
    sandbox.isolation.cache_clear()


@pytest.fixture()
def own_tmp(monkeypatch):
    """A folder of this test's own for the runs' working directories (the reward workers'
    too), traversable by ``nobody``: :func:`_sandbox_processes` finds this test's sandbox
    processes by it, whatever else runs on the machine (other tests in parallel included)."""
    folder = tempfile.mkdtemp(prefix="ppokit-test-sandbox-")
    os.chmod(folder, 0o711)
    monkeypatch.setenv("TMPDIR", folder)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _sandbox_processes(folder: str) -> list[int]:
    """Live processes of runs whose working directory is in ``folder`` (the sandbox sets
    ``TMPDIR`` to it for every process of a run: the isolation tool, the guard, the program)."""
    marker = f"TMPDIR={folder}/".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(var.startswith(marker) for var in environ.split(b"\0")):
            found.append(int(entry))
    return found


@pytest.fixture()
def listening_port():
    """A port on this machine's loopback that accepts connections: a program outside the
    sandbox can reach it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    yield server
    server.close()


def _connected(server) -> bool:
    try:
        conn, _ = server.accept()
        conn.close()
        return True
    except OSError:
        return False


def test_bombs_are_contained_and_score_zero_with_their_reason(isolation_kind, listening_port, own_tmp):
    port = listening_port.getsockname()[1]
    fields = {"tests": ["assert add(1, 2) == 3"], "timeout": AMPLE, "memory_mb": 512}
    assert code_reward("p", "while True:\n    pass\n" + ADD, **{**fields, "timeout": 2.0}) == (0.0, "timeout")
    cases = {"memory": "blob = bytearray(8 * 1024 ** 3)\n" + ADD, "processes": BOMB}
    if sandbox.process_limit() == "none":  # root without a pids cgroup: a real fork bomb; not here
        del cases["processes"]
    for reason, program in cases.items():
        assert code_reward("p", program, **fields) == (0.0, reason), reason
    network = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n" + ADD
    if isolation_kind == "none":
        assert code_reward("p", network, **fields) == (1.0, None)  # not contained: said at start instead
        assert _connected(listening_port) and sandbox.isolation_warning() is not None
    else:
        assert code_reward("p", network, **fields) == (0.0, "network")
        assert not _connected(listening_port) and sandbox.isolation_warning() is None
    assert code_reward("p", ADD, **fields) == (1.0, None)  # the sandbox still runs good code
    assert not _sandbox_processes(own_tmp)  # no sandbox process outlives its run


def test_assert_and_stdin_tests_score_the_fraction_passed():
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
    response = f"Here you go:\n```python\n{ADD}```\nDone."
    assert code_reward("p", response, tests=tests, timeout=AMPLE) == (0.75, "wrong_answer")
    io = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}, {"input": "2 2\n", "output": "5"}]
    program = "a, b = map(int, input().split())\nprint(a + b)   \n"
    assert code_reward("p", program, tests=io, timeout=AMPLE) == pytest.approx((2 / 3, "wrong_answer"))
    apps = '{"inputs": ["1 2\\n", "3 4\\n"], "outputs": ["3\\n", "7\\n"]}'
    assert code_reward("p", program, tests=apps, timeout=AMPLE) == (1.0, None)


def test_early_exit_syntax_errors_and_timeouts():
    cheat = "import sys\nsys.exit(0)\n" + ADD
    assert code_reward("p", cheat, tests=["assert add(1, 2) == 3"], timeout=AMPLE) == (0.0, "error")
    assert code_reward("p", "def add(a, b:\n", tests=["assert add(1, 2) == 3"], timeout=AMPLE) == (0.0, "syntax_error")
    assert code_reward("p", "   ", tests=["assert True"]) == (0.0, "no_program")
    hang = "import time\ntime.sleep(60)\n" + ADD
    # after the first timeout the other tests are not run: one time limit, not three
    assert code_reward("p", hang, tests=["assert add(1, 2) == 3"] * 3, timeout=1) == (0.0, "timeout")


def test_output_limit_and_a_clean_working_directory():
    flood = run_python(
        "while True:\n    print('x' * 10000)\n", limits=sandbox.SandboxLimits(timeout=AMPLE, file_size_mb=1)
    )
    assert flood.status == "output_limit" and len(flood.stdout) <= 1 << 20
    first = run_python("import os\nprint(os.getcwd())\nopen('left.txt', 'w').write('x')\n", limits=LIMITS)
    assert first.status == "ok"
    workdir = first.stdout.strip()
    assert not os.path.exists(workdir)  # removed afterwards
    second = run_python("import os\nprint(sorted(os.listdir('.')))\n", limits=LIMITS)
    assert "left.txt" not in second.stdout


def test_extract_program_and_test_formats():
    assert extract_program("a\n```python\nx = 1\n```\nb\n```py\nx = 2\n```\n") == "x = 2\n"
    assert extract_program("```\nx = 3\n```") == "x = 3\n"
    assert extract_program("print(4)") == "print(4)"
    assert parse_tests('["assert True"]') == ["assert True"]
    assert parse_tests([{"input": "1", "output": "2", "extra": 0}]) == [{"input": "1", "output": "2"}]
    for bad in ([], "not json", [{"input": 1, "output": "2"}], {"inputs": ["1"], "outputs": []}, 5):
        with pytest.raises(ValueError, match="code: "):
            parse_tests(bad)
    assert same_output("3  \n\n", "3") and not same_output("3\n4", "3")


def test_code_through_the_reward_pool_counts_reasons():
    responses = [ADD, "while True:\n    pass\n", "blob = bytearray(8 * 1024 ** 3)\n", "def add(a, b):\n    return 0\n"]
    fields = {"tests": ["assert add(1, 2) == 3"], "timeout": AMPLE, "memory_mb": 512}
    fields_list = [fields, {**fields, "timeout": 2.0}, fields, fields]  # the loop's own limit, short
    with RewardPool("code", num_workers=2, timeout=2 * AMPLE) as pool:
        results = pool.score(["p"] * 4, responses, fields_list)
    assert results.scores == [1.0, 0.0, 0.0, 0.0] and results.num_errors == 0
    assert results.note_counts() == {"timeout": 1, "memory": 1, "wrong_answer": 1}
    assert results.metrics()["reward_notes/timeout"] == 1.0


def test_a_worker_killed_mid_run_leaves_no_sandbox_behind(isolation_kind, own_tmp):
    """The pool's time limit (1 s) is shorter than the sandbox's (30 s): the worker is killed
    while its sandboxed program sleeps, and the program dies with it."""
    sleeper = "import time\ntime.sleep(120)\n" + ADD
    fields = {"tests": ["assert add(1, 2) == 3"], "timeout": 30.0}
    with RewardPool("code", num_workers=1, timeout=1.0, max_reward_errors=None) as pool:
        results = pool.score(["p"], [sleeper], [fields])
    assert results.errors[0] is not None and results.errors[0][0] == "timeout", (results.scores, results.notes)
    deadline = time.monotonic() + 60  # the guard sees the dead worker's end of the lifeline close
    while (leftover := _sandbox_processes(own_tmp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover


DAEMON = """import os, time
if os.fork() == 0:           # a daemon: its own session, its parent gone
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
os.wait()
"""


def test_processes_a_program_leaves_behind_die_with_its_run(isolation_kind, own_tmp):
    assert code_reward("p", DAEMON + ADD, tests=["assert add(1, 2) == 3"], timeout=AMPLE) == (1.0, None)
    assert not _sandbox_processes(own_tmp)  # the daemon too, at once: the guard reaped it before it exited
    hang = DAEMON + "time.sleep(60)\n" + ADD
    assert code_reward("p", hang, tests=["assert add(1, 2) == 3"], timeout=1) == (0.0, "timeout")
    assert not _sandbox_processes(own_tmp)


FORKS_FOUR = "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n    os.wait()\n" + ADD
FOUR_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def test_each_run_is_counted_on_its_own_after_a_fork_bomb(isolation_kind, own_tmp):
    """A fork bomb's processes do not count against the runs after it (a zombie not yet reaped
    by the machine's init used to), nor do runs in parallel count against each other."""
    if sandbox.process_limit() == "none":
        pytest.skip("root without a pids cgroup or the nobody user: no process limit to count")
    one = ["assert add(1, 2) == 3"]
    assert code_reward("p", BOMB, tests=one, timeout=AMPLE) == (0.0, "processes")
    assert code_reward("p", FORKS_FOUR, tests=one, timeout=AMPLE) == (1.0, None)
    assert code_reward("p", ADD, tests=FOUR_TESTS, timeout=AMPLE) == (0.75, "wrong_answer")
    # RLIMIT_NPROC counts a user's processes together unless the run has a user namespace of its
    # own: there a program that forks may find a parallel fork bomb's processes counted against it
    shared = sandbox.process_limit() == "rlimit" and (isolation_kind == "none" or os.geteuid() == 0)
    forking = [] if shared else [(DAEMON + ADD, one)]
    jobs = [(BOMB, one), (ADD, FOUR_TESTS), (ADD, FOUR_TESTS), *forking]
    with ThreadPoolExecutor(len(jobs)) as threads:
        scores = list(threads.map(lambda job: code_reward("p", job[0], tests=job[1], timeout=AMPLE), jobs))
    assert scores == [(0.0, "processes"), (0.75, "wrong_answer"), (0.75, "wrong_answer")] + [(1.0, None)] * len(forking)
    assert not _sandbox_processes(own_tmp)


def test_as_root_programs_run_as_nobody_where_the_namespace_has_that_user(isolation_kind, monkeypatch):
    """``unshare --user --map-root-user`` maps root alone: dropping to ``nobody`` inside failed
    every program (EPERM); there the program stays the namespace's root."""
    if os.geteuid() != 0:
        pytest.skip("runs as root only")
    monkeypatch.setattr(sandbox, "_drop_to_nobody", lambda: True)  # as where the interpreter is readable by nobody
    result = run_python("import os\nprint(os.getuid())\n", limits=LIMITS)
    assert result.status == "ok", result
    assert result.stdout.strip() == ("0" if isolation_kind == "unshare-user" else str(sandbox.NOBODY))


def test_an_interpreter_under_tmp_is_bound_back_into_the_sandboxs_fresh_tmp(monkeypatch, tmp_path):
    """bwrap gives programs an empty /tmp; a virtual environment that lives there (a fresh
    clone in a mktemp directory) must be bound back, or the sandbox cannot start Python."""
    from ppokit.lm.rewards import sandbox

    venv = tmp_path / "clone" / ".venv"
    (venv / "bin").mkdir(parents=True)
    monkeypatch.setattr(sandbox.sys, "prefix", str(venv))
    monkeypatch.setattr(sandbox.sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sandbox.sys, "base_prefix", "/usr")
    assert sandbox._interpreter_paths_under(str(tmp_path)) == [os.path.realpath(venv)]  # bin/ is inside it
    assert sandbox._interpreter_paths_under(str(tmp_path / "elsewhere")) == []
    prefix = sandbox._isolation_prefix("bwrap", str(tmp_path / "work"), None)
    if prefix is not None and str(tmp_path).startswith("/tmp/"):
        i = prefix.index("--tmpfs")
        assert prefix[i + 2 : i + 5] == ["--ro-bind", os.path.realpath(venv), os.path.realpath(venv)]
