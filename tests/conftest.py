"""Puts tests/ on sys.path (pytest's prepend import mode) for the shared ``resume_helpers``, and
gives the session its own model cache (``PPOKIT_CACHE``: GGUF files converted once per session,
in a temporary directory removed at its end, never the user's ``~/.cache``), which the processes
the tests start inherit."""

import os
import shutil
import tempfile

_OWN_CACHE = None
if "PPOKIT_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["PPOKIT_CACHE"] = tempfile.mkdtemp(prefix="ppokit-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
