"""Puts tests/ on sys.path (pytest's prepend import mode) for the shared ``resume_helpers``, and
gives the session its own model cache (``PPOKIT_CACHE``: GGUF files converted once per session,
in a temporary directory removed at its end, never the user's ``~/.cache``), which the processes
the tests start inherit; the fixtures that several test folders use (``trained_batches``)."""

import os
import shutil
import tempfile

import pytest

_OWN_CACHE = None
if "PPOKIT_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["PPOKIT_CACHE"] = tempfile.mkdtemp(prefix="ppokit-test-cache-")


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
