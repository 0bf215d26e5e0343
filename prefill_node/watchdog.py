"""The relay's progress watchdog: a decode stream that sends nothing for `stall_s` seconds
while its request is live is cancelled (the client hears UNAVAILABLE) and `on_stall` runs
(the decode peer is suspected and re-checked).

Only time spent waiting on the decode stream counts: while the relay blocks handing a
message to a slow client (`hold()`), the decode node is not silent, the client is.

A frozen decode node (SIGSTOP, a hung host) keeps its TCP connection open, so without
this a stream would wait for keepalive to notice (seconds more) or forever when pings
pass. One thread watches every stream of the node; a stream costs a dict entry and a
timestamp per message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Watch:
    """One relayed stream: `touch()` on every message, `done()` at its end; `stalled` once
    the watchdog cancelled it."""

    __slots__ = ("_owner", "cancel", "last", "stalled")

    def __init__(self, owner: StallWatchdog | None, cancel: Callable[[], object]) -> None:
        self._owner, self.cancel = owner, cancel
        self.last = time.monotonic()
        self.stalled = False

    def touch(self) -> None:
        self.last = time.monotonic()

    def hold(self) -> None:
        """Not waiting on the decode node (the relay is handing a message to a client that may
        read slowly, under gRPC flow control): not a stall, however long; `touch()` resumes."""
        self.last = float("inf")

    def done(self) -> None:
        if self._owner is not None:
            self._owner._remove(self)


class StallWatchdog:
    def __init__(self, stall_s: float, on_stall: Callable[[], None] = lambda: None) -> None:
        self.stall_s = stall_s  # <= 0: off
        self.on_stall = on_stall
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], object]) -> Watch:
        if self.stall_s <= 0:
            return Watch(None, cancel)
        entry = Watch(self, cancel)
        with self._lock:
            self._watches.add(entry)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="relay-watchdog", daemon=True)
                self._thread.start()
        return entry

    def _remove(self, entry: Watch) -> None:
        with self._lock:
            self._watches.discard(entry)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(min(0.1, self.stall_s / 10)):
            now = time.monotonic()
            with self._lock:
                stalled = [w for w in self._watches if now - w.last > self.stall_s]
                self._watches.difference_update(stalled)
            for entry in stalled:
                entry.stalled = True
                entry.cancel()
            if stalled:
                log.warning("%d decode stream(s) sent nothing for %.1fs: cancelled", len(stalled), self.stall_s)
                self.on_stall()
