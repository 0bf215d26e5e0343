"""What a node loads, from its flags: the pair, its device and dtype, and the KV pool size.

Both nodes load through `ModelSpec.load()`: the pair (models/loader.py) placed on one
device; `run_server` then puts its Llama models on paged KV pools (engine/paged_lm.py) sized by
`--kv-cache-bytes`, or on a GPU by `--gpu-memory-utilization`: this process's share of the
device (weights + KV pool, as in vLLM), so that two nodes on one GPU each take their own share;
on the CPU CPU_KV_BYTES. A share that does not fit in the memory free at start-up is refused
before anything loads (`MemoryShareError`, a one-line error naming the flag).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models.pair import ModelPair

if TYPE_CHECKING:
    from engine.paged_lm import GraphCapture

log = logging.getLogger(__name__)
CPU_KV_BYTES = 512 << 20
GIB = 1 << 30


class MemoryShareError(ValueError):
    """The device memory a node was given does not fit: the node stops with this one line."""


def share_error(fraction: float, device: torch.device, total: int, wanted: int, available: int, what: str) -> str:
    return (
        f"--gpu-memory-utilization {fraction}: {wanted / GIB:.1f} GiB of {device}'s {total / GIB:.1f} GiB, "
        f"but {what} {available / GIB:.1f} GiB; pass a smaller --gpu-memory-utilization or --kv-cache-bytes"
    )


@dataclass(frozen=True)
class ModelSpec:
    corpus: Path | None = None
    target_model: str | Path | None = None  # None: the built-in n-gram pair
    draft_model: str | Path | None = None
    draft_layers: int | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on the CPU, bfloat16 on a GPU
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs, no compiled kernels
    attention_backend: str = "auto"  # engine/paged_lm.attention_backend
    # The CUDA graphs captured at start-up (engine/paged_lm.GraphCapture): row buckets up to
    # this many rows (0: none, every graph on first use), key widths up to this many keys (a
    # row's context plus the tokens it brings), and the verify passes of these K.
    graph_capture_batch: int = 32
    graph_capture_context: int = 2048
    graph_capture_k: tuple[int, ...] = (4,)

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a value in (0, 1], got {self.gpu_memory_utilization}")
        torch.device(self.device)  # raises on a malformed device string
        from engine.options import ATTENTION_BACKENDS, MAX_GRAPH_QUERIES

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for k in self.graph_capture_k:
            if not 0 <= k < MAX_GRAPH_QUERIES:
                raise ValueError(f"graph_capture_k: expected values in 0..{MAX_GRAPH_QUERIES - 1}, got {k}")
        self.graph_capture(max_k=max(self.graph_capture_k, default=0), decode=True)  # a bad batch or context

    def graph_capture(self, *, max_k: int, decode: bool, max_batch: int | None = None) -> GraphCapture:
        """What a node whose requests draft at most `max_k` tokens captures at start-up (K of
        --graph-capture-k above it are left out: no request runs them). The decode node: the
        target's decode steps (1 token per row) and verify passes (K+1), and when it drafts the
        draft's depths: one token, and two on the first depth after a step that accepted every
        draft (the last draft + the bonus token); the prefill node: the draft's one-token depths
        only (its target runs prompts, eagerly). Rows: at most `max_batch` (the engine's)."""
        from engine.paged_lm import GraphCapture

        ks = [k for k in self.graph_capture_k if 0 < k <= max_k]
        draft_queries = ((1, 2) if decode else (1,)) if max_k > 0 else ()
        return GraphCapture(
            batch=self.graph_capture_batch if max_batch is None else min(self.graph_capture_batch, max_batch),
            context=self.graph_capture_context,
            target_queries=(1, *(k + 1 for k in ks)) if decode else (),
            draft_queries=draft_queries,
        )

    def load(self) -> ModelPair:
        """The pair as loaded (the node's run_server puts it on its KV pools)."""
        from models.loader import load_pair

        what = self.target_model or "the built-in n-gram pair"
        log.info("loading %s (draft: %s) on %s", what, self.draft_model or self.draft_layers or "built-in", self.device)
        pair = load_pair(
            self.corpus,
            self.target_model,
            self.draft_model,
            draft_layers=self.draft_layers,
            dtype=self.dtype,
            device=self.device,
        )
        return pair

    def check_memory(self) -> None:
        """Before loading: this process's share must fit in the device memory free now (other
        processes, e.g. the other node on the same GPU, hold the rest)."""
        device = torch.device(self.device)
        if self.kv_cache_bytes is not None or device.type != "cuda":
            return
        free, total = torch.cuda.mem_get_info(device)
        wanted = int(self.gpu_memory_utilization * total)
        if wanted > free:
            raise MemoryShareError(
                share_error(self.gpu_memory_utilization, device, total, wanted, free, "only this much is free:")
            )

    def reserved(self) -> int:
        """What this process holds on the device now (0 off a GPU): taken before loading, so
        that `kv_budget` counts only what the node itself loaded."""
        device = torch.device(self.device)
        return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0

    def kv_budget(self, reserved_before: int = 0) -> int:
        """The KV pool's bytes: --kv-cache-bytes, else on a GPU the share less what this node
        holds already (its weights: what this process holds beyond `reserved_before`, the
        other node's when both run in one process); the CUDA context and the captured graphs
        come on top, in what the shares of the processes on the device leave."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        device = torch.device(self.device)
        if device.type != "cuda":
            return CPU_KV_BYTES
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device) - reserved_before
        wanted = int(self.gpu_memory_utilization * total)
        budget = wanted - held
        if budget <= 0:
            what = "this node's weights alone take"
            raise MemoryShareError(share_error(self.gpu_memory_utilization, device, total, wanted, held, what))
        if budget > free:
            what = f"beside its {held / GIB:.1f} GiB only this much is free:"
            raise MemoryShareError(share_error(self.gpu_memory_utilization, device, total, wanted, free, what))
        return budget


ATTENTION_NAMES = {
    "triton": "triton paged attention, the pool read in place (prompt chunks: torch-sdpa over block-table gathers)",
    "sdpa": "torch-sdpa over block-table gathers",
}


def backends(pair: ModelPair, sampler: str = "") -> dict[str, str]:
    """The backend of each part, as GetInfo and the node-info metric report it."""
    from engine.paged_lm import PagedLlamaLM

    def kind(model) -> str:
        return {
            "PagedLlamaLM": "pdspec-llama",
            "LlamaCausalLM": "pdspec-llama",
            "HFCausalLM": "transformers",
            "NgramModel": "builtin-ngram",
        }.get(type(model).__name__, type(model).__name__)

    paged = isinstance(pair.target, PagedLlamaLM)
    out = {
        "target": kind(pair.target),
        "draft": kind(pair.draft),
        "kv_cache": f"paged ({pair.target.pool.num_blocks} blocks of {pair.target.pool.block_size})"
        if paged
        else "none",
        "attention": ATTENTION_NAMES[pair.target.attention] if paged else "",
    }
    if sampler:
        out["sampler"] = sampler
    return out


def model_dtype(pair: ModelPair) -> str:
    dtype = getattr(pair.target, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else ""
