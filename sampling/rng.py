"""Per-request random streams.

Each request owns a CPU `torch.Generator`; a step draws its uniforms from it in a fixed
order, so a seeded request yields the same tokens alone or anywhere in a batch of any
size, on any device. Uniforms are drawn on the CPU (a handful per row per step) and
moved to the batch's device once.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from sampling.transfer import to_device


class RequestRng:
    """`stream` separates independent streams of one seed (the prefill and the decode node
    of a request must not replay each other's uniforms: that would correlate tokens)."""

    def __init__(self, seed: int | None = None, stream: str = "") -> None:
        self.seed = secrets.randbits(63) if seed is None else seed
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_derive(self.seed, stream) if stream else self.seed)

    def uniforms(self, n: int) -> torch.Tensor:
        """[n] float32 in [0, 1)."""
        return torch.rand(n, generator=self._generator, dtype=torch.float32)


def _derive(seed: int, stream: str) -> int:
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def batch_uniforms(
    rngs: Sequence[RequestRng], n: int, device: torch.device | str = "cpu", draws: Sequence[bool] | None = None
) -> torch.Tensor:
    """[B, n] float32: row b is the next n uniforms of rngs[b]. With `draws`, a row where it is
    False draws nothing and is zero: a greedy row, whose tokens are argmaxes that read no uniform."""
    if draws is not None and not any(draws):
        return torch.zeros(len(rngs), n, dtype=torch.float32, device=device)  # no draw, no copy
    if not rngs:
        return torch.empty(0, n, dtype=torch.float32, device=device)
    rows = [rng.uniforms(n) if draws is None or draws[b] else torch.zeros(n) for b, rng in enumerate(rngs)]
    return to_device(torch.stack(rows), device)
