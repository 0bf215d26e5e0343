"""What the decode servicer holds of a request in the engine (decode_node/engine.py): its
handle, the events it streams, and the engine's refusal when full."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from engine.sequence import Sequence, Stats
from protos.validation import DecodeInput
from sampling.logprobs import TokenLogprob


class QueueFull(Exception):
    """The engine holds max_batch + max_queue requests already."""


@dataclass(frozen=True)
class Event:
    tokens: list[int]
    finished: bool = False
    finish_reason: str = ""
    stats: Stats | None = None
    error: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for


@dataclass(eq=False)
class Request:
    """One in-flight request: the servicer's handle (it reads `events` and may call
    engine.cancel) on the engine's sequence."""

    input: DecodeInput
    seq: Sequence
    kv_need: int  # KV positions it may ever occupy, reserved at admission: it never waits mid-stream
    # one put per request per step, by the engine thread: SimpleQueue's is C, with no Condition to notify
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    # Streamed: the KV is not in `input`; the servicer writes it into seq.target_state once
    # `reserved` is set (DecodeEngine.import_chunk), then calls DecodeEngine.imported.
    streamed: bool = False
    reserved: threading.Event = field(default_factory=threading.Event)
    imported: bool = False
    since: int = 0  # the engine step it was last admitted at (decode_node/fairness.py)
    preemptions: int = 0  # times it gave its slot up; once preempted, admission recomputes its KV
