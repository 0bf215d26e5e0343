"""The decode engine's settings (decode_node/engine.py), built from the node's flags
(decode_node/__main__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.adaptive import StepCosts
from engine.options import ASYNC_SCHEDULING, SPECULATE_AHEAD
from engine.spec_config import SpeculativeConfig


@dataclass(frozen=True)
class DecodeConfig:
    spec: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    max_batch: int = 32  # requests per engine step
    max_queue: int = 128  # requests waiting for a batch slot; beyond that: QueueFull
    default_max_new_tokens: int = 64
    sampler_backend: str = "auto"
    device: str = "cpu"
    async_scheduling: str = "auto"  # on | off | auto (on where the device is a GPU)
    # on: prompt-lookup rows speculate in queued steps too, wherever async scheduling
    # queues steps (decode_node/engine.py `_ahead`); off (the default): they speculate in
    # synchronous steps
    speculate_ahead: str = "off"
    step_costs: StepCosts | None = None  # adaptive K's cost table; None: measured at start-up (calibrate)
    # Fairness (decode_node/fairness.py): a running request that has held its slot this many steps
    # while others wait for one is preempted (0: never); a stream whose client has not read this
    # many events is paused (0: never). Pausing is the node's (--pause-backlog, 64 by default):
    # off here, since a caller that steps the engine itself may read its events when it likes.
    preempt_after_steps: int = 64
    pause_backlog: int = 0

    def __post_init__(self) -> None:
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise ValueError(f"async_scheduling: expected one of {ASYNC_SCHEDULING}, got {self.async_scheduling!r}")
        if self.speculate_ahead not in SPECULATE_AHEAD:
            raise ValueError(f"speculate_ahead: expected one of {SPECULATE_AHEAD}, got {self.speculate_ahead!r}")
        if self.preempt_after_steps < 0:
            raise ValueError(f"preempt_after_steps: expected >= 0, got {self.preempt_after_steps}")
        if self.pause_backlog < 0:
            raise ValueError(f"pause_backlog: expected >= 0, got {self.pause_backlog}")

    @property
    def pipelined(self) -> bool:
        """Whether K = 0 steps are queued before the step before them is read."""
        if self.async_scheduling == "auto":
            return torch.device(self.device).type == "cuda"
        return self.async_scheduling == "on"
