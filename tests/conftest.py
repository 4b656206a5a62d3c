"""Puts tests/ on sys.path (pytest's prepend import mode) for the shared ``resume_helpers``, and
gives the session its own cache (``PPOKIT_CACHE``: GGUF files converted and CPU kernels built
once per session, in a temporary directory removed at its end, never the user's ``~/.cache``),
which the processes the tests start and the pytest-xdist workers inherit; how xdist shares the
tests among its workers; the fixtures that several test folders use (``trained_batches``)."""

import os
import shutil
import tempfile

import pytest

# Under pytest-xdist (``make test``: ``-n TEST_WORKERS``) the workers share the cores: torch's
# default thread count (and that of the processes the tests start) is the cores a worker gets.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

_OWN_CACHE = None
if "PPOKIT_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["PPOKIT_CACHE"] = tempfile.mkdtemp(prefix="ppokit-test-cache-")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist every test is its own unit of work, but the scale-out tests
    (``tests/cluster``) are one unit, run by one worker: the session starts one local Ray
    (``ray.init(num_cpus=2)``), not one per worker on the same cores."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 - only under xdist

    class ScaleOutTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/cluster" if nodeid.startswith("tests/cluster/") else nodeid

    return ScaleOutTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """The test files with ``slow`` tests first, each file's tests together and in order (its
    module fixtures are set up once): under pytest-xdist the short ones then fill in at the end,
    rather than one worker finishing a minute-long test alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture
def trained_batches(monkeypatch) -> list:
    """Every batch a single-turn source (``LMSource.finish``) of this process hands to the loop."""
    from ppokit.lm.single_turn import source as source_mod

    seen = []
    real = source_mod.LMSource.finish

    def finish(self, iteration, part):
        batch = real(self, iteration, part)
        if batch is not None:
            seen.append(batch)
        return batch

    monkeypatch.setattr(source_mod.LMSource, "finish", finish)
    return seen
