"""SIGINT and SIGTERM handlers installed for a block and put back after it.

Three places take over a stop signal for a while: a run's :class:`ppokit.persistence.resume.GracefulStop`,
``ppokit sft`` (SIGTERM ends its training as Ctrl-C does) and a cluster's start (``ray.init``
replaces SIGTERM's handler, :mod:`ppokit.cluster.ray_cluster`). Each goes through
:func:`handlers_restored`. Python runs signal handlers in the main thread only, and only the main
thread may install them: elsewhere the block runs with the handlers untouched.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

# the signals that stop a run: Ctrl-C, and the stop of ``kill``, ``timeout`` and schedulers
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, Any], Any]


@contextlib.contextmanager
def handlers_restored(
    signals: tuple[signal.Signals, ...] = STOP_SIGNALS, install: Handler | None = None
) -> Iterator[bool]:
    """In the block, ``install`` handles ``signals`` (None: the handlers stay as they are, and
    whatever the block installs is undone); after it the previous handlers are back. Yields
    whether the handlers are this block's to change (False outside the main thread: nothing is
    installed or restored). A previous handler set outside Python (``getsignal`` gives None)
    is left to its owner."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    try:
        if install is not None:
            for sig in signals:
                signal.signal(sig, install)
        yield True
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
