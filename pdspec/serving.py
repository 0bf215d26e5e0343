"""Run a node's `run_server` context until SIGINT or SIGTERM (then drain and exit)."""

from __future__ import annotations

import contextlib
import signal
import threading


def serve_until_signal(server_context: contextlib.AbstractContextManager) -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server_context:
        stop.wait()
