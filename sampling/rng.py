"""Per-request random streams, counter-based, computed on the batch's device.

Every uniform a request reads is SplitMix64 (Steele, Lea and Flood, 2014) evaluated at a
counter under a 64-bit key derived from the seed: output number c + 1 of the generator
started at the key, its top 24 bits over 2**24 (a float32 in [0, 1), exactly). Being a pure
function of (key, counter), a whole batch's uniforms are one vectorised computation on the
batch's device (`splitmix64_uniforms` in torch; one kernel on a GPU with CuPy,
sampling/draw_kernel.cu, whose values are the same bits): a step sends each row's key and counter to the
device (a few int64 per row, in the kernel's parameters where they fit), never its uniforms, and
draws nothing on the host. The values
are bit for bit the same on any device (int64 arithmetic wraps mod 2**64 everywhere).

A request has two keys per stream name:
* the stream (`RequestRng.uniforms`, `stream_uniforms`): a host-side counter of the uniforms
  drawn so far; a step takes the next n and moves it by n. A seeded request yields the same
  tokens alone or anywhere in a batch of any size, on any device, since a row's values
  depend on its key and counter alone.
* the positions (`RequestRng.at`, `position_uniforms`): one uniform per sequence position,
  the counter being the position. A token drawn with its position's uniform does not depend on
  how many uniforms earlier steps consumed, which is what makes a point-mass proposal's
  verification independent of K (sampling/verifier.py).
The keys are sha256 of "<seed>:<stream>" and "<seed>:<stream>/position". Two keys' sequences
are one SplitMix64 sequence at offsets a random 64-bit distance apart (its increment is odd),
so they share no value a request could reach.
"""

from __future__ import annotations

import array
import functools
import hashlib
import secrets
from collections.abc import Sequence

import torch

from common.transfer import cupy_available, indexed, shared_tensor, to_device
from sampling.cupy_draw import splitmix64_cupy

_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment, the golden ratio in 64 bits
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # its finaliser's multipliers
_MASK = (1 << 64) - 1


class RequestRng:
    """`stream` separates independent streams of one seed (the prefill and the decode node
    of a request must not replay each other's uniforms: that would correlate tokens)."""

    def __init__(self, seed: int | None = None, stream: str = "") -> None:
        self.seed = secrets.randbits(63) if seed is None else seed
        self.key = _derive(self.seed, stream)  # unsigned 64-bit
        self.position_key = _derive(self.seed, f"{stream}/position")
        self.drawn = 0  # the stream's counter: uniforms taken so far

    def uniforms(self, n: int) -> torch.Tensor:
        """[n] float32 in [0, 1) on the host: the stream's next n uniforms."""
        return stream_uniforms([self], [n])[0]

    def at(self, start: int, n: int) -> list[float]:
        """The n uniforms (float32 values in [0, 1)) of positions start..start+n-1; they do not
        depend on anything drawn before, from the stream or at other positions."""
        return position_uniforms([self], torch.arange(start, start + n)[None])[0].tolist()


def splitmix64_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output number positions[b, j] + 1 from state keys[b], as its top 24 bits
    over 2**24: [B, n] float32 in [0, 1), each exactly k / 2**24.

    keys [B] int64: unsigned 64-bit keys stored in two's complement; positions [B, n] int64,
    counters in [0, 2**63); both on the device that computes. torch's int64 multiply and
    add wrap mod 2**64 on the CPU and on CUDA, which is SplitMix64's arithmetic."""
    return _output(keys[:, None] + (positions + 1) * _signed(_GAMMA))


def _output(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function of its states z (int64, any shape; consumed) as float32:
    the top 24 bits of the mixed state over 2**24. The mix's last xorshift, z ^ (z >>> 31),
    changes bits 0..32 only, so the top 24 bits are read before it. A step's cost is torch's
    per-op dispatch (the tensors are tiny), hence in-place ops, each a single launch."""
    for shift, multiplier in zip((30, 27), _MIX, strict=True):
        z ^= _shr(z, shift)
        z *= _signed(multiplier)
    return _shr(z, 40).to(torch.float32).mul_(1 / (1 << 24))  # below 2**24, over a power of two: exact


def stream_uniforms(
    rngs: Sequence[RequestRng],
    counts: Sequence[int],
    device: torch.device | str = "cpu",
    width: int | None = None,
    at: Sequence[int | None] | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, width] float32 on `device` (width: max(counts) unless given): row b is the next
    counts[b] uniforms of rngs[b]'s stream, then zeros; each stream moves by its count (a
    request listed twice draws twice, in row order). With `at`, a row whose at[b] is a position
    reads instead the uniforms of positions at[b] .. at[b] + counts[b] - 1 (`RequestRng.at`), and
    its stream does not move. `shift` [B] int64 on `device`: a row given a position reads from
    at[b] + shift[b] instead, a position only the device knows (a step queued before the step in
    flight is read, moved back by what that step rejected: engine/kv_cache.Shift); rows without
    a position ignore it. Two int64 a row reach the device: on a GPU, in the kernel launch's
    parameters for a batch of up to 64 rows without a shift, else one copy."""
    width = max(counts, default=0) if width is None else width
    if len(counts) != len(rngs) or any(not 0 <= count <= width for count in counts):
        raise ValueError(f"counts: expected {len(rngs)} values in [0, {width}], got {list(counts)}")
    if at is not None and len(at) != len(rngs):
        raise ValueError(f"at: expected {len(rngs)} positions or None, got {len(at)}")
    if shift is not None and (at is None or shift.dtype != torch.int64 or tuple(shift.shape) != (len(rngs),)):
        got = f"{shift.dtype} {list(shift.shape)}" + ("" if at is not None else " without `at`")
        raise ValueError(f"shift: expected int64 of shape [{len(rngs)}] with `at`, got {got}")
    if not any(counts):
        return torch.zeros(len(rngs), width, dtype=torch.float32, device=device)  # no draw, no copy
    rows = array.array("Q")  # unsigned 64-bit, read as int64 with the same bits
    for b, (rng, count) in enumerate(zip(rngs, counts, strict=True)):
        # The state before the row's first value: what splitmix64_uniforms adds up on the device,
        # added here in python integers, so that a step adds one cached tensor to it. A run of
        # positions is the position key's values from that state on.
        start = None if at is None else at[b]
        if start is None:
            rows.append((rng.key + (rng.drawn + 1) * _GAMMA) & _MASK)
            rng.drawn += count
        else:
            rows.append((rng.position_key + (start + 1) * _GAMMA) & _MASK)
        rows.append(count)
    sent = _int64(rows).view(-1, 2)  # [B, 2]: state, count
    if shift is not None:  # a run of positions from at + shift starts shift * GAMMA further on
        positioned = shared_tensor([start is not None for start in at], torch.bool, shift.device)
        sent = to_device(sent, shift.device)
        sent[:, 0] += torch.where(positioned, shift, 0) * _signed(_GAMMA)
    if _on_kernel(device):
        return splitmix64_cupy(sent, width, True, indexed(device))
    sent = to_device(sent, device)
    column, steps = _columns(width, indexed(device))
    values = _output(sent[:, :1] + steps)
    if all(count == width for count in counts):
        return values
    return torch.where(column < sent[:, 1:], values, 0.0)


@functools.cache
def _columns(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[width] int64 on `device`: 0..width-1, and j * GAMMA (wrapped), the state's advance
    over j values. Cached: a step's shapes repeat, and building them is two more launches."""
    column = torch.arange(width, device=device)
    return column, column * _signed(_GAMMA)


def batch_uniforms(
    rngs: Sequence[RequestRng], n: int, device: torch.device | str = "cpu", draws: Sequence[bool] | None = None
) -> torch.Tensor:
    """[B, n] float32: row b is the next n uniforms of rngs[b]. With `draws`, a row where it is
    False draws nothing and is zero: a greedy row, whose tokens are argmaxes that read no uniform."""
    counts = [n if draws is None or draws[b] else 0 for b in range(len(rngs))]
    return stream_uniforms(rngs, counts, device, n)


def position_uniforms(
    rngs: Sequence[RequestRng], positions: torch.Tensor, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[B, n] float32 on `device`: row b holds rngs[b]'s uniforms at the sequence positions
    positions[b] ([B, n] int64 >= 0, on the host; one copy with the keys)."""
    if not rngs:
        return torch.empty(positions.shape, dtype=torch.float32, device=device)
    keys = _int64(array.array("Q", [rng.position_key for rng in rngs]))[:, None]
    both = torch.cat([keys, positions.to(torch.int64)], dim=1)  # [B, 1 + n]: one copy with the keys
    if _on_kernel(device):
        return splitmix64_cupy(both, positions.shape[1], False, indexed(device))
    both = to_device(both, device)
    return splitmix64_uniforms(both[:, 0], both[:, 1:])


def _on_kernel(device: torch.device | str) -> bool:
    """Whether a step's uniforms are one CuPy kernel (sampling/draw_kernel.cu), bit for bit the
    torch ops' values: on a GPU, where those ops' dispatch is most of their cost."""
    return torch.device(device).type == "cuda" and cupy_available()


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int64 `z`'s 64 bits (`>>` on int64 is arithmetic: the mask
    clears the copies of the sign bit)."""
    shifted = z >> bits
    shifted &= (1 << (64 - bits)) - 1
    return shifted


def _int64(values: array.array) -> torch.Tensor:
    """Host int64 tensor of unsigned 64-bit values' bits (an array is built per row several
    times faster than `torch.tensor` reads a list of python ints)."""
    return torch.frombuffer(values, dtype=torch.int64)


def _signed(value: int) -> int:
    """The int64 with the bits of unsigned 64-bit `value`."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _derive(seed: int, stream: str) -> int:
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
