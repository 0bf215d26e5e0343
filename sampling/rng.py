"""Per-request random streams.

Each request owns a CPU `torch.Generator`; a step draws its uniforms from it in a fixed
order, so a seeded request yields the same tokens alone or anywhere in a batch of any
size, on any device. Uniforms are drawn on the CPU (a handful per row per step) and
moved to the batch's device once.

Besides the stream, a request has one uniform per sequence position (`RequestRng.at`):
SplitMix64 (Steele, Lea and Flood, 2014) evaluated at the position, keyed by the seed. A
token drawn with its position's uniform does not depend on how many uniforms earlier
steps consumed, which is what makes a point-mass proposal's verification independent of
K (sampling/verifier.py).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from common.transfer import to_device

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment, the golden ratio in 64 bits
_MASK = (1 << 64) - 1


class RequestRng:
    """`stream` separates independent streams of one seed (the prefill and the decode node
    of a request must not replay each other's uniforms: that would correlate tokens)."""

    def __init__(self, seed: int | None = None, stream: str = "") -> None:
        self.seed = secrets.randbits(63) if seed is None else seed
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(_derive(self.seed, stream) if stream else self.seed)
        self._key = _derive(self.seed, f"{stream}/position")

    def uniforms(self, n: int) -> torch.Tensor:
        """[n] float32 in [0, 1)."""
        return torch.rand(n, generator=self._generator, dtype=torch.float32)

    def at(self, start: int, n: int) -> list[float]:
        """The n uniforms (float32 values in [0, 1)) of positions start..start+n-1; they do not
        depend on anything drawn before, from the stream or at other positions."""
        return [_splitmix64(self._key, p) for p in range(start, start + n)]


def _splitmix64(key: int, position: int) -> float:
    """SplitMix64's output number `position` + 1 from state `key`, as its top 24 bits over
    2**24: a float32 in [0, 1), exactly."""
    z = (key + (position + 1) * _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 40) / (1 << 24)


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
