"""Per-request sampling parameters and their batched tensor form.

Proto3 defaults mean "disabled": top_k = 0 keeps every token, top_p of 0 or 1 keeps
every token. A row is greedy iff do_sample is false, temperature < FLOAT32_TINY (0 and
every float32 subnormal: logits / T would overflow to -inf everywhere and softmax to NaN)
or top_k == 1; greedy rows sample the argmax and their distribution is a point mass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.transfer import indexed, shared_tensor, to_device

FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32, ~1.18e-38


class InvalidParameter(ValueError):
    """A sampling parameter outside its domain; names the field, expected and actual value."""

    def __init__(self, field: str, expected: str, actual: object) -> None:
        super().__init__(f"{field}: expected {expected}, got {actual}")
        self.field, self.expected, self.actual = field, expected, str(actual)


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParameter("temperature", "a finite value >= 0", self.temperature)
        if self.top_k < 0:
            raise InvalidParameter("top_k", ">= 0 (0 disables)", self.top_k)
        if not 0.0 <= self.top_p <= 1.0:  # also rejects NaN
            raise InvalidParameter("top_p", "a value in [0, 1] (0 or 1 disables)", self.top_p)
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidParameter("seed", "an unsigned 64-bit integer", self.seed)

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.temperature < FLOAT32_TINY or self.top_k == 1

    @property
    def effective_top_p(self) -> float:
        return 1.0 if self.top_p == 0 else self.top_p


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters of a batch, ready for vectorized filtering.

    The flags are host-side summaries, so that no sampler reads a device tensor back to
    choose its path (a host wait per step). Each is exact when it says "nothing to do"
    (needs_filter False, any_greedy False, all_greedy True); a subset of rows (`select`)
    keeps its parent's flags, which is safe: the general path gives the same result."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float32, 1 on greedy rows (never divided by 0)
    top_k: torch.Tensor  # [B] int64, 0 = disabled
    top_p: torch.Tensor  # [B] float32, 1 = disabled
    needs_filter: bool = True  # some row has top-k or top-p
    any_greedy: bool = True
    all_greedy: bool = False

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        """The batch's tensors on `device`. A decode batch keeps its rows for many steps, so the
        tensors of the last few batches are kept: a step whose rows are those of an earlier one
        copies nothing to the device. Nothing writes them in place."""
        return _cached(tuple(params), indexed(device))

    @property
    def do_sample(self) -> torch.Tensor:  # [B] bool
        return ~self.greedy

    def _with(self, *tensors: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(*tensors, self.needs_filter, self.any_greedy, self.all_greedy)

    def select(self, rows: Sequence[int]) -> SamplingTensors:
        if list(rows) == list(range(self.greedy.shape[0])):
            return self  # every row in order (a chain step of the whole batch)
        index = shared_tensor(rows, torch.int64, self.greedy.device)
        return self._with(self.greedy[index], self.temperature[index], self.top_k[index], self.top_p[index])

    def repeat_rows(self, repeats: int) -> SamplingTensors:
        """Each row repeated `repeats` times, for [B, K+1, V] flattened to [B*(K+1), V]."""
        if repeats == 1:
            return self
        return self._with(
            *(t.repeat_interleave(repeats) for t in (self.greedy, self.temperature, self.top_k, self.top_p))
        )


@functools.lru_cache(maxsize=16)
def _cached(params: tuple[SamplingParams, ...], device: torch.device) -> SamplingTensors:
    """`SamplingTensors.from_params`, built with one host -> device copy: the four per-row values
    as float64 (top-k and the float32 values are exact there), split and cast on the device."""
    greedy = [p.is_greedy for p in params]
    top_k = [p.top_k for p in params]
    top_p = [p.effective_top_p for p in params]
    temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    packed = to_device(torch.tensor([greedy, temperature, top_k, top_p], dtype=torch.float64), device)  # [4, B]
    return SamplingTensors(
        greedy=packed[0] != 0,
        temperature=packed[1].to(torch.float32),
        top_k=packed[2].to(torch.int64),
        top_p=packed[3].to(torch.float32),
        needs_filter=any(k > 0 for k in top_k) or any(p < 1 for p in top_p),
        any_greedy=any(greedy),
        all_greedy=all(greedy),
    )
