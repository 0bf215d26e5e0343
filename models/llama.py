"""pdspec's own Llama-family model code (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2).

One file, top to bottom: the config, the modules (embedding, RMSNorm, RoPE, GQA attention,
SwiGLU MLP, tied or untied head), the KV-store interface, a contiguous CPU store and the
`CausalLM` wrapper that pdspec's nodes use.

The forward runs on a FLATTENED RAGGED batch: `tokens [N]`, `positions [N]` for all rows
concatenated. The model holds no cache. Each attention layer hands its new q/k/v to a KV
store (`kv.attend(layer, q, kv)`), which writes k/v into that row's slots and attends each
row's queries causally over that row's live KV only. The store knows the batch layout (which
rows, how many new tokens each); the model only knows tokens and positions. So a paged store
(block tables over a preallocated pool, slot mappings, CUDA graphs replaying fixed-shape
batches) is another `KvStore` implementation and needs no change here.

Numerics follow transformers exactly where parity depends on it: RMSNorm in float32, RoPE
cos/sin from float32 `position * inv_freq` (cast to the model dtype after), the same
inverse-frequency formulas for each rope type.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.transfer import device_tensor
from models.base import (
    ChunkedImport,
    GrowingKv,
    State,
    append_features,
    batch_positions,
    close_span,
    drop_features,
    end_import,
    live_rows,
)
from models.kv_import import KvWriter
from protos.kv_layout import layer_kv_layout, layout_order

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic")


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_positions: int = 8192  # llama3
    max_position_embeddings: int = 2048  # dynamic-NTK scales past this length
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: always; Llama: attention_bias
    o_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral v0.1: keys older than this many positions are hidden
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type: expected one of {SUPPORTED_ROPE_TYPES}, got {self.rope_type!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads={self.num_heads}, "
                f"got {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number (RoPE rotates pairs), got {self.head_dim}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlamaConfig:
        """From a transformers `config.json` dict (v4 `rope_scaling`/`rope_theta` or v5 `rope_parameters`)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: expected 'silu' (SwiGLU), got {act!r}")
        if config.get("use_sliding_window"):  # Qwen2's per-layer window (max_window_layers) is not implemented
            raise ValueError("use_sliding_window: expected false (Qwen2 sliding-window layers unsupported), got true")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if not isinstance(config.get(name), int):
                raise ValueError(f"{name}: expected an int in config.json, got {config.get(name)!r}")
        heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        max_positions = int(config.get("max_position_embeddings", 2048))
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor: expected 1.0 (full-width RoPE), got {partial}")
        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        bias = bool(config.get("attention_bias", False))
        window = config.get("sliding_window") if model_type == "mistral" else None
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=int(rope.get("original_max_position_embeddings", max_positions)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=bias if model_type == "llama" else False,
            mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=config.get("bos_token_id"),
        )


# ---------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, the formulas of transformers' ROPE_INIT_FUNCTIONS
    (dynamic-NTK's base value; its per-length rescaling is `dynamic_inv_freq`)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        old_context = config.rope_original_max_positions
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def dynamic_inv_freq(config: LlamaConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """[N, head_dim / 2] dynamic-NTK frequencies for rows of total length `seq_lens [N]`.

    transformers recomputes the base from the longest position of the forward, with float32
    tensor arithmetic; a row no longer than max_position_embeddings keeps the plain frequencies.
    Here the length is per row (not per batch) so a request's logits never depend on its batch."""
    dim, max_pos, factor = config.head_dim, config.max_position_embeddings, config.rope_factor
    seq = torch.maximum(seq_lens, torch.tensor(max_pos, dtype=seq_lens.dtype, device=seq_lens.device))
    base = config.rope_theta * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [N] float32
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
    scaled = 1.0 / (base[:, None] ** exponents[None, :])
    plain = rope_inv_freq(config).to(seq_lens.device)
    return torch.where((seq_lens > max_pos)[:, None], scaled, plain[None, :])


def rope_cos_sin(
    config: LlamaConfig, inv_freq: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] in `dtype`, computed in float32 like transformers."""
    if config.rope_type == "dynamic":
        if seq_lens is None:  # one row: its length is the last position + 1
            seq_lens = (positions.max() + 1).expand_as(positions)
        freqs = positions[:, None].float() * dynamic_inv_freq(config, seq_lens)
    else:
        freqs = positions[:, None].float() * inv_freq[None, :].float()  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, D]. The rotate-half convention of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# ---------------------------------------------------------------------------------------
# KV store interface
# ---------------------------------------------------------------------------------------


class KvStore(Protocol):
    """Where attention's keys and values live, for one forward over a ragged batch.

    Built by the caller for the batch (it knows which rows and how many new tokens each),
    it must: write k/v of the N new tokens into their rows' slots (at positions row_length..),
    then return, for every new token, attention of its query over its own row's keys up to
    and including itself (and nothing of other rows)."""

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], kv [2, N, Hkv, D] (new keys and values, RoPE applied) -> out [N, Hq, D]."""


# ---------------------------------------------------------------------------------------
# Elementwise ops: eager on the CPU, one fused kernel each when compiled (CUDA, ROCm)
# ---------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] -> [N, H]: transformers' RMSNorm (the variance in float32 even for bf16/fp16)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm: (rms_norm(x + residual), x + residual)."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def rope_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k/v [N, Hkv, D] (views into the fused projection) -> q rotated
    [N, Hq, D] and kv [2, N, Hkv, D] (k rotated, v): the layout the KV stores write."""
    return apply_rope(q, cos, sin), torch.stack((apply_rope(k, cos, sin), v))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate rows, then up rows) -> silu(gate) * up [N, I]: SwiGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Pointwise:
    """The elementwise parts of a forward, passed in by the caller (a model on the CPU runs
    them eagerly; the paged engine on a GPU passes `compiled_pointwise()`)."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]


EAGER = Pointwise(rms_norm, add_rms_norm, rope_qkv, silu_mul)


@functools.cache
def compiled_pointwise() -> Pointwise:
    """The same functions through torch.compile (inductor's Triton kernels, CUDA or ROCm),
    with dynamic sizes so one compile serves every batch. Eagerly an 8B-shape decode step
    ran 53 kernels per layer (RMSNorm alone 7, RoPE 10), and under a CUDA graph each kernel
    still costs its launch gap: these and the fused projections took an H200 step from 7.8
    to 5.5 ms (BENCHMARKS.md). Captured into the engine's CUDA graphs like any other kernel."""
    fuse = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    return Pointwise(fuse(rms_norm), fuse(add_rms_norm), fuse(rope_qkv), fuse(silu_mul))


# ---------------------------------------------------------------------------------------
# Modules (checkpoints and state dicts use transformers' parameter names)
# ---------------------------------------------------------------------------------------


def fuse_linears(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Let `module.<fused>` (one Linear) stand for transformers' separate projections
    `parts` (name -> output rows, in order): loading concatenates them, `state_dict()`
    splits them back. One matmul instead of three (q, k, v) or two (gate, up): at batch 1
    the fused q/k/v reads its weights at 3.6 TB/s against 2.0 TB/s for three (H200)."""
    names, sizes = list(parts), list(parts.values())

    def load(_module, state_dict, prefix, *_) -> None:
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            if all(key in state_dict for key in keys):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(key) for key in keys])

    def save(_module, state_dict, prefix, _metadata) -> None:
        for kind in ("weight", "bias"):
            key = f"{prefix}{fused}.{kind}"
            if key in state_dict:
                for name, part in zip(names, state_dict.pop(key).split(sizes), strict=True):
                    state_dict[f"{prefix}{name}.{kind}"] = part

    module.register_load_state_dict_pre_hook(load)
    module.register_state_dict_post_hook(save)


class Linear(nn.Linear):
    """nn.Linear, with a faster product for few rows on the CPU in FP32.

    MKL's SGEMM for y = x W^T with a skinny x (a decode step, a verify of K + 1 tokens)
    scales with the row count as if it read W once per row, and its one-row GEMV is slower
    still; the same product as (W x^T)^T, with one row padded to two, reads W once for any
    row count: 1.5-3.5x faster at 1-7 rows on an AVX2 EPYC (BENCHMARKS.md).
    It is what makes a verify of K + 1 tokens cost little more than a one-token step there,
    as it does on a GPU. Other devices and dtypes take F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] > CPU_SKINNY_ROWS:
            return F.linear(x, self.weight, self.bias)
        rows = x if x.shape[0] > 1 else x.repeat(2, 1)  # [max(M, 2), in]
        out = (self.weight @ rows.t()).t()[: x.shape[0]].contiguous()  # [M, out]
        return out if self.bias is None else out + self.bias


# Up to here: decode steps and verifies of K <= 6. From 8 rows on MKL's x W^T gives each row the
# bits it gives that row in any larger batch, so a chunked prompt's KV is the same batched or alone;
# below 8 neither product is batch-invariant (nor was x W^T).
CPU_SKINNY_ROWS = 7


class RMSNorm(nn.Module):
    """The norm's weight (`Pointwise.rms_norm` applies it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = Linear(config.hidden_size, (hq + 2 * hkv) * d, bias=config.qkv_bias)
        self.o_proj = Linear(hq * d, config.hidden_size, bias=config.o_bias)
        fuse_linears(self, "qkv_proj", {"q_proj": hq * d, "k_proj": hkv * d, "v_proj": hkv * d})
        self.hq, self.hkv, self.d = hq, hkv, d

    def forward(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KvStore, ops: Pointwise
    ) -> torch.Tensor:
        n, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)  # [N, (Hq + 2 Hkv) D]
        q, new_kv = ops.rope_qkv(q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d), cos, sin)
        out = kv.attend(layer, q, new_kv)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, hq * d))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = Linear(h, 2 * i, bias=b)
        self.down_proj = Linear(i, h, bias=b)
        fuse_linears(self, "gate_up_proj", {"gate_proj": i, "up_proj": i})

    def forward(self, x: torch.Tensor, ops: Pointwise) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, kv: KvStore, ops: Pointwise
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, residual: the stream it adds to (None before the
        first layer) -> the same pair after this layer. Carrying the add into the next norm
        (vLLM's fused add + RMSNorm) is transformers' `x = x + f(norm(x))`, regrouped."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = ops.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        x = self.self_attn(layer, h, cos, sin, kv, ops)
        h, residual = ops.add_rms_norm(x, residual, norm2.weight, norm2.eps)
        return self.mlp(h, ops), residual


class _Body(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Weights + the ragged forward. State-dict keys are transformers' (`model.layers.0.self_attn.q_proj.weight`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KvStore,
        *,
        logits_at: torch.Tensor | None = None,
        num_layers: int | None = None,
        seq_lens: torch.Tensor | None = None,
        ops: Pointwise = EAGER,
        after_layer: Callable[[int], None] | None = None,
        features_at: Sequence[int] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [N] int64 -> logits [len(logits_at) or N, V] in the model dtype.

        num_layers: run only the first N decoder layers, then the final norm and head (a
        layer-skip draft sharing these weights). seq_lens [N]: each token's row length after
        this forward; only dynamic-NTK RoPE reads it (None = one row). after_layer(i): called
        once layer i's keys and values are in `kv` (the prefill node ships them meanwhile).
        features_at: layers whose outputs (the residual stream after them) are returned too, as
        (logits, features [N, len(features_at) * hidden]) for every token: a hidden-state draft's
        input (models/eagle.py), from this same pass."""
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        x = self.model.embed_tokens(tokens)  # [N, hidden]
        cos, sin = rope_cos_sin(self.config, self.inv_freq, positions, seq_lens, x.dtype)
        residual = None
        captured = {}
        for index, layer in enumerate(layers):
            x, residual = layer(index, x, residual, cos, sin, kv, ops)
            if index in features_at:
                captured[index] = x + residual  # [N, hidden]
            if after_layer is not None:
                after_layer(index)
        if logits_at is not None:  # the head is the largest matmul: only where logits are needed
            x, residual = x[logits_at], residual[logits_at]
        norm = self.model.norm
        logits = self.lm_head(ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0])  # [M, V]
        return (logits, torch.cat([captured[i] for i in features_at], dim=-1)) if features_at else logits


# ---------------------------------------------------------------------------------------
# Contiguous KV store (CPU; one growing K/V tensor pair per layer per request)
# ---------------------------------------------------------------------------------------


@dataclass
class ContiguousKv:
    """One request's cache: keys[l], values[l] [Hkv, capacity, D]; `length` slots are live."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device) -> ContiguousKv:
        def make() -> torch.Tensor:
            return torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device)

        return cls([make() for _ in range(layers)], [make() for _ in range(layers)])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, needed: int) -> None:
        """Grow (doubling) so `needed` slots fit; amortized O(1) per appended token."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, 16)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                grown = old.new_zeros(old.shape[0], capacity, old.shape[2])
                grown[:, : self.length] = old[:, : self.length]
                tensors[i] = grown


# Rows of at most this many new tokens (drafting steps, a head's catch-up) attend in one batched
# SDPA on a GPU; a prompt's rows keep their own, whose padding to the longest would cost more.
BATCHED_MAX_NEW = 16


@dataclass
class ContiguousBatch:
    """A `KvStore` for one ragged forward over contiguous caches: row r owns new tokens
    [offsets[r], offsets[r+1]) of the flattened batch and appends them at caches[r].length.
    Attention is a per-row SDPA with a causal (and optional sliding-window) mask, or the
    row's tree mask (`tree_masks[r]`, models/base.TreeSpan); `commit()` advances the
    lengths once every layer has written.

    `batched` (default: on a GPU, for several rows of at most BATCHED_MAX_NEW new tokens each,
    no tree or window mask) runs one SDPA for the whole batch instead: the rows' caches as
    [M, Hkv, W, D] views of one width W (each grown to hold W), their new queries padded to the
    longest row, each row masked to its own live keys, causally. A drafting step of M rows is
    then a handful of launches, where the per-row loop's several launches a row (and SDPA's own
    host work per call) made the host, not the GPU, the step's cost."""

    caches: Sequence[ContiguousKv]
    new_lengths: Sequence[int]
    sliding_window: int | None = None
    tree_masks: Sequence[torch.Tensor | None] | None = None
    batched: bool | None = None
    _masks: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.offsets = [0]
        for n in self.new_lengths:
            self.offsets.append(self.offsets[-1] + n)
        for cache, n in zip(self.caches, self.new_lengths, strict=True):
            cache.reserve(cache.length + n)
        if self.batched is None:
            self.batched = (
                len(self.caches) > 1
                and self.caches[0].keys[0].device.type == "cuda"
                and self.sliding_window is None
                and not any(m is not None for m in self.tree_masks or ())
                and min(self.new_lengths) >= 1
                and max(self.new_lengths) <= BATCHED_MAX_NEW
            )
        if self.batched:
            self._plan_batched()
            return
        trees = self.tree_masks or [None] * len(self.caches)
        self._masks = [
            tree if tree is not None else self._mask(cache.length, n, cache.keys[0].device)
            for cache, n, tree in zip(self.caches, self.new_lengths, trees, strict=True)
        ]

    def _plan_batched(self) -> None:
        """What every layer's batched attention shares: the width, the mask, the query padding."""
        lengths, news = [c.length for c in self.caches], list(self.new_lengths)
        rows, self._longest = len(news), max(news)
        self._width = max(length + n for length, n in zip(lengths, news, strict=True))
        for cache in self.caches:
            cache.reserve(self._width)  # every row's view spans W slots; past its live ones: masked
        device = self.caches[0].keys[0].device
        # Padded query slot i of row r is flat query offsets[r] + min(i, n_r - 1) (a repeat,
        # discarded after); valid slot i < n_r is query offsets[r] + i.
        pad, valid = [], []
        for r, n in enumerate(news):
            pad += [self.offsets[r] + min(i, n - 1) for i in range(self._longest)]
            valid += [r * self._longest + i for i in range(n)]
        sent = device_tensor([*lengths, *pad, *valid], torch.int64, device)  # one copy
        past, self._pad, self._valid = sent[:rows], sent[rows : rows + len(pad)], sent[rows + len(pad) :]
        query = past[:, None, None] + torch.arange(self._longest, device=device)[None, :, None]  # [M, n, 1]
        key = torch.arange(self._width, device=device)[None, None, :]  # [1, 1, W]
        self._batch_mask = (key <= query)[:, None]  # [M, 1, n, W]: causal within the row's own slots

    def _mask(self, past: int, n: int, device) -> torch.Tensor | None:
        """[n, past + n] bool (True = may attend), or None where SDPA's own masking is exact:
        one new token sees its whole row; a fresh row is plain causal (`is_causal`, the same
        kernel path transformers takes for a prompt, which keeps logits parity tight)."""
        window = self.sliding_window
        if window is not None and past + n > window:
            query = past + torch.arange(n, device=device)[:, None]  # [n, 1] absolute positions
            key = torch.arange(past + n, device=device)[None, :]  # [1, L]
            return (key <= query) & (query - key < window)
        if n == 1 or past == 0:
            return None
        query = past + torch.arange(n, device=device)[:, None]
        return torch.arange(past + n, device=device)[None, :] <= query

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        k, v = kv  # [N, Hkv, D] each
        if self.batched:
            return self._attend_batched(layer, q, k, v)
        out = torch.empty_like(q)  # [N, Hq, D]
        for row, cache in enumerate(self.caches):
            start, end = self.offsets[row], self.offsets[row + 1]
            if start == end:
                continue
            live = cache.length + (end - start)
            keys, values = cache.keys[layer], cache.values[layer]
            keys[:, cache.length : live] = k[start:end].transpose(0, 1)  # [Hkv, n, D]
            values[:, cache.length : live] = v[start:end].transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),  # [Hq, n, D]
                keys[:, :live],  # [Hkv, L, D]
                values[:, :live],
                attn_mask=self._masks[row],
                is_causal=self._masks[row] is None and cache.length == 0 and end - start > 1,
                enable_gqa=True,
            )  # [Hq, n, D]
            out[start:end] = attended.transpose(0, 1)
        return out

    def _attend_batched(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        targets, sources = [], []
        for row, cache in enumerate(self.caches):
            start, end = self.offsets[row], self.offsets[row + 1]
            live = cache.length + (end - start)
            targets += [cache.keys[layer][:, cache.length : live], cache.values[layer][:, cache.length : live]]
            sources += [k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)]  # [Hkv, n, D]
        torch._foreach_copy_(targets, sources)
        keys = torch.stack([cache.keys[layer][:, : self._width] for cache in self.caches])  # [M, Hkv, W, D]
        values = torch.stack([cache.values[layer][:, : self._width] for cache in self.caches])
        rows, heads, dim = len(self.caches), q.shape[1], q.shape[2]
        padded = q[self._pad].view(rows, self._longest, heads, dim).transpose(1, 2)  # [M, Hq, n, D]
        attended = F.scaled_dot_product_attention(padded, keys, values, attn_mask=self._batch_mask, enable_gqa=True)
        return attended.transpose(1, 2).reshape(rows * self._longest, heads, dim)[self._valid]  # [N, Hq, D]

    def commit(self) -> None:
        for cache, n in zip(self.caches, self.new_lengths, strict=True):
            cache.length += n


# ---------------------------------------------------------------------------------------
# CausalLM (models/base.py) on top of the module and the contiguous store
# ---------------------------------------------------------------------------------------


class LlamaCausalLM(ChunkedImport, GrowingKv):
    """A target (all layers) or a layer-skip draft (first `num_layers`, shared weights)."""

    def __init__(
        self,
        module: LlamaForCausalLM,
        *,
        source_digest: str,
        num_layers: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        config = module.config
        self.module = module.eval()
        self.config = config
        self.num_layers = config.num_layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= config.num_layers:
            raise ValueError(f"num_layers: expected 1..{config.num_layers}, got {self.num_layers}")
        weight = module.lm_head.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.vocab_size = config.vocab_size
        self.eos_token_ids = tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        dtype_name = str(self.dtype).removeprefix("torch.")
        skip = f":layers={self.num_layers}" if self.num_layers < config.num_layers else ""
        self.source_digest = source_digest
        self.name = f"llama:{config.model_type}:{source_digest}:{dtype_name}{skip}"
        self.kv_layout = layer_kv_layout(self.num_layers, config.num_kv_heads, config.head_dim, self.dtype)
        self.positions_computed = 0  # tokens run through the forward; KV import must not add to it
        # Layers whose outputs every forward keeps on its states (State.features): set when the
        # pair's draft reads the target's hidden states (models/eagle.py).
        self.feature_layers: tuple[int, ...] = ()

    def _new_cache(self, capacity: int) -> ContiguousKv:
        c = self.config
        return ContiguousKv.empty(self.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def _run(
        self,
        states: Sequence[State],
        ids: Sequence[Sequence[int]],
        *,
        last_only: bool = False,
        parents: Sequence[Sequence[int]] | None = None,
    ):
        lengths = [len(row) for row in ids]
        window = self.config.sliding_window
        meta = batch_positions(states, ids, parents, window)
        tokens = torch.tensor([t for row in ids for t in row], dtype=torch.int64, device=self.device)
        positions, seq_lens = meta.positions.to(self.device), meta.seq_lens.to(self.device)
        logits_at = None
        if last_only:
            ends = torch.tensor(lengths).cumsum(0) - 1
            logits_at = ends.to(self.device)
        masks = None if meta.masks is None else [None if m is None else m.to(self.device) for m in meta.masks]
        batch = ContiguousBatch([s.kv for s in states], lengths, window, masks)
        with torch.inference_mode():
            out = self.module(
                tokens,
                positions,
                batch,
                logits_at=logits_at,
                num_layers=self.num_layers,
                seq_lens=seq_lens,
                features_at=self.feature_layers,
            )
        logits = keep_row_features(states, lengths, out).float()
        batch.commit()
        self.positions_computed += len(tokens)
        for state, row in zip(states, ids, strict=True):
            state.tokens += [int(t) for t in row]
        return logits

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, State]:
        if not ids:
            raise ValueError("ids: expected a non-empty prompt, got []")
        state = State(tokens=[], kv=self._new_cache(len(ids) + 16))
        return self._run([state], [list(ids)], last_only=True)[0], state

    def extend(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        if not ids:
            return torch.empty(0, self.vocab_size)
        return self._run([state], [list(ids)])

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """All rows in ONE forward (flattened ragged tokens); split the logits back per row."""
        if len(states) != len(ids):
            raise ValueError(f"ids: expected {len(states)} rows (one per state), got {len(ids)}")
        rows = [list(row) for row in ids]
        if not any(rows):
            return [torch.empty(0, self.vocab_size) for _ in rows]
        logits = self._run(states, rows)
        return list(logits.split([len(row) for row in rows]))

    def empty_state(self) -> State:
        return State(tokens=[], kv=self._new_cache(16))

    def extend_last(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._run(states, [list(row) for row in ids], last_only=True)

    def truncate(self, state: State, length: int) -> None:
        if not 0 <= length <= len(state.tokens):
            raise ValueError(f"length: expected 0..{len(state.tokens)}, got {length}")
        state.kv.length = length  # the slots past it are overwritten by the next extend
        drop_features(state, length)
        del state.tokens[length:]

    supports_trees = True

    def extend_tree(
        self, states: Sequence[State], ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        return live_rows(
            lambda s, rows, p: self._run(s, rows, parents=p), states, ids, parents, torch.empty(0, self.vocab_size)
        )

    def accept_tree(self, state: State, keep: Sequence[int]) -> None:
        src, dst = close_span(state, keep)
        cache = state.kv
        if src:  # gather first: a destination may be a later source
            src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            for tensor in (*cache.keys, *cache.values):
                tensor[:, dst_t] = tensor[:, src_t]
        cache.length = len(state.tokens)

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        cache, n = state.kv, state.kv.length
        live = [t[:, :n] for t in layout_order(zip(cache.keys, cache.values, strict=True))]
        if out is None:
            return [t.clone() for t in live]
        return [o.copy_(t) for o, t in zip(out, live, strict=True)]

    def begin_import(self, tokens: Sequence[int], reserve: int) -> State:
        seq = len(tokens)
        cache = self._new_cache(max(reserve, seq + 16))
        storages = [t.transpose(0, 1) for t in layout_order(zip(cache.keys, cache.values, strict=True))]
        writer = KvWriter(self.kv_layout, seq, storages, torch.arange(seq))  # [capacity, Hkv, D] views
        return State(tokens=list(tokens), kv=cache, importing=writer)

    def finish_import(self, state: State) -> None:
        end_import(state)
        state.kv.length = len(state.tokens)


def keep_row_features(
    states: Sequence[State], lengths: Sequence[int], out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """A forward's logits; where it captured hidden states (`features_at`), each row's [n_r, F]
    appended to its state first (the rows' tokens in `lengths`, flattened in order)."""
    if isinstance(out, torch.Tensor):
        return out
    logits, features = out
    for state, part in zip(states, features.split(list(lengths)), strict=True):
        append_features(state, part)
    return logits


def layer_skip_draft(target: LlamaCausalLM, draft_layers: int) -> LlamaCausalLM:
    """A draft running the target's first `draft_layers` layers (then its norm and head):
    the same weights (no copy), its own KV cache, the target's vocabulary (identity d2t)."""
    total = target.config.num_layers
    if isinstance(draft_layers, bool) or not isinstance(draft_layers, int) or not 1 <= draft_layers < total:
        raise ValueError(
            f"draft_layers: expected an int in 1..{total - 1} (the target has {total}), got {draft_layers!r}"
        )
    return LlamaCausalLM(
        target.module, source_digest=target.source_digest, num_layers=draft_layers, eos_token_ids=target.eos_token_ids
    )


def restrict_head(model: LlamaCausalLM, head_ids: torch.Tensor) -> None:
    """An EAGLE-3-style reduced draft vocabulary, in place: the head keeps only the rows
    `head_ids` [Vd] (distinct ids of the model's vocabulary; the draft's d2t map), so the model's
    outputs are the logits of those Vd tokens, in that order. The embeddings stay whole: the
    model still reads every id of the full vocabulary. On SmolLM2 the tied 49k-row head is 28M
    of a 2-layer draft's 35M weights; 8k rows make a draft token ~3x cheaper on a CPU."""
    vocab = model.config.vocab_size
    ids = head_ids.to(torch.int64).cpu()
    valid = ids.ndim == 1 and len(ids) > 0 and int(ids.min()) >= 0 and int(ids.max()) < vocab
    if not valid or len(set(ids.tolist())) != len(ids):
        raise ValueError(f"head_ids: expected distinct ids in 0..{vocab - 1}, got {ids.tolist()[:8]}... ({len(ids)})")
    module = model.module
    head = Linear(model.config.hidden_size, len(ids), bias=False, device=model.device, dtype=model.dtype)
    with torch.no_grad():
        head.weight.copy_(module.lm_head.weight[ids.to(model.device)])  # a copy: a tied head stays the embedding's
    head.requires_grad_(False)
    module.lm_head = head
    model.vocab_size = len(ids)
    digest = hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()[:12]
    model.name += f":head={digest}"


def build_model(
    config: LlamaConfig, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str | torch.device
) -> LlamaForCausalLM:
    """A LlamaForCausalLM with exactly these weights (every parameter must be present),
    named as transformers names them."""
    with torch.device("meta"):
        module = LlamaForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    missing = sorted(set(shapes) - set(state_dict))
    if missing:
        raise ValueError(f"weights: expected tensors {missing[:4]}{'...' if len(missing) > 4 else ''}, got none")
    unexpected = sorted(set(state_dict) - set(shapes))
    if unexpected:
        raise ValueError(f"weights: unexpected tensors {unexpected[:4]} for {config.model_type}")
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(state_dict[name].shape)}")
    module.load_state_dict(
        {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}, strict=False, assign=True
    )
    if config.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    module.inv_freq = rope_inv_freq(config).to(device)
    return module.eval()


def digest_of(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
    return digest.hexdigest()[:12]


__all__ = [
    "ContiguousBatch",
    "ContiguousKv",
    "KvStore",
    "LlamaCausalLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "build_model",
    "layer_skip_draft",
]
