"""persistence.signals.handlers_restored: install for a block, put back after, nothing outside the main thread."""

from __future__ import annotations

import signal
import threading

import pytest

from ppokit.persistence.signals import STOP_SIGNALS, handlers_restored


def _mine(signum, frame):  # a handler to tell apart
    raise AssertionError("not to be called")


def test_the_handler_is_installed_in_the_block_and_the_previous_ones_come_back():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with handlers_restored(install=_mine) as ours:
        assert ours
        assert all(signal.getsignal(sig) is _mine for sig in STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_what_the_block_installs_is_undone_even_when_it_raises():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), handlers_restored():
        signal.signal(signal.SIGTERM, _mine)  # as ray.init replaces SIGTERM's handler
        raise RuntimeError
    assert signal.getsignal(signal.SIGTERM) == before


def test_only_the_signals_named_change():
    before = signal.getsignal(signal.SIGINT)
    with handlers_restored((signal.SIGTERM,), install=_mine):
        assert signal.getsignal(signal.SIGTERM) is _mine
        assert signal.getsignal(signal.SIGINT) == before


def test_outside_the_main_thread_nothing_is_installed():
    seen = {}

    def body():
        with handlers_restored(install=_mine) as ours:
            seen["ours"] = ours
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["ours"] is False
    assert seen["handler"] is not _mine
