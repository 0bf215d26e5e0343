"""The Llama modules behind the `CausalLM` interface, on a paged KV pool.

`PagedLlamaLM` is what both nodes serve for Llama-family models on any device: the module
(models/llama.py) holds no cache; every request's KV lives in the model's `KvPool` (one
preallocated tensor) under a block table. The wire KV goes straight between the pool and
the `[kv_heads, seq, head_dim]` tensors of the contract, converted by models/kv_import.py
(`export_state` gathers the live slots; an import writes the wire bytes, whole tensors or
streamed chunks, into blocks reserved when it begins): no per-request cache object.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.graphs import bucket, capture_graph
from common.transfer import HostCopy, Staging, cupy_available, shared_tensor, to_device, to_host_async
from engine.device import on_device, serve_attention_without_cudnn
from engine.kv_cache import BatchMeta, KvPool, PagedBatch, PagedSeq, Shift, batch_meta
from engine.options import ATTENTION_BACKENDS, MAX_GRAPH_QUERIES
from models.base import (
    CausalLM,
    ChunkedImport,
    State,
    batch_positions,
    close_span,
    drop_features,
    end_import,
    live_rows,
)
from models.eagle import EagleDraft
from models.kv_import import KvWriter, gather
from models.llama import EAGER, LlamaCausalLM, compiled_pointwise, keep_row_features
from models.pair import ModelPair
from protos.kv_layout import kv_bytes, layout_order
from sampling.cupy_kernels import load_kernels

log = logging.getLogger(__name__)
BLOCK_SIZE = 16  # tokens per block: vLLM's default; small enough that waste per request is tiny
# Forwards where every row brings the same small number of tokens (a decode step: 1; a
# verify pass: K+1, or a tree's nodes + 1; a draft expanding trees: its frontier) replay a
# CUDA graph captured for (row bucket, tokens per row, key-width bucket); ragged batches
# (rows bringing different numbers of tokens) replay one padded to their longest row;
# prompts run eagerly.
MAX_GRAPH_ROWS = 256
MIN_GRAPH_WIDTH = 256
# A ragged batch pads into a graph while that runs at most PAD_FACTOR x its tokens, or
# PAD_TOKENS in all (below ~300 tokens a forward's GEMMs are bound by the weight reads on
# an H100/H200: padding there costs next to nothing).
PAD_FACTOR = 4
PAD_TOKENS = 256


@dataclass(frozen=True)
class GraphCapture:
    """The CUDA graphs a node captures at start-up, once its KV pools are allocated: every row
    bucket up to `batch` x every key-width bucket up to `context` keys (a row's context plus
    the tokens it brings) x each query count its steps run on the target (`target_queries`: 1
    for a decode step, K+1 for a verify pass) and on the draft (`draft_queries`). The first step
    of those shapes then replays instead of capturing; any other shape is captured on first
    use. batch 0: none at start-up."""

    batch: int = 32
    context: int = 2048
    target_queries: tuple[int, ...] = ()
    draft_queries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.batch, int) or not 0 <= self.batch <= MAX_GRAPH_ROWS:
            raise ValueError(f"graph_capture_batch: expected an integer in 0..{MAX_GRAPH_ROWS}, got {self.batch!r}")
        if not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"graph_capture_context: expected an integer >= 1 (keys), got {self.context!r}")
        for q in (*self.target_queries, *self.draft_queries):
            if not isinstance(q, int) or not 1 <= q <= MAX_GRAPH_QUERIES:
                raise ValueError(f"graph queries per row: expected integers in 1..{MAX_GRAPH_QUERIES}, got {q!r}")


def capture_keys(batch: int, context: int, queries: Sequence[int], capacity: int) -> list[tuple[int, int, int]]:
    """The graph keys (row bucket, queries per row, key-width bucket) that a start-up capture of
    `batch` rows, `context` keys and these query counts takes, on a pool of `capacity` tokens
    (widths stop at the bucket of the pool's capacity: no row reaches past it)."""
    if batch == 0:
        return []
    rows = [1 << i for i in range(bucket(batch).bit_length())]  # 1, 2, 4, ..., bucket(batch)
    top = bucket(min(context, capacity), MIN_GRAPH_WIDTH)
    widths = [MIN_GRAPH_WIDTH << i for i in range((top // MIN_GRAPH_WIDTH).bit_length())]
    return list(itertools.product(rows, sorted(set(queries)), widths))


def padded_places(lengths: Sequence[int], queries: int) -> torch.Tensor:
    """[sum(lengths)] int64 host: where each token of a ragged batch sits in a graph bucket's
    padded [rows, queries] row-major layout (row r's tokens first in its `queries` places)."""
    valid = np.arange(queries)[None, :] < np.asarray(lengths)[:, None]  # [real, Q]
    return torch.from_numpy(np.flatnonzero(valid))


class _Graph:
    """One captured forward and its static inputs/outputs. The inputs that change per replay
    are fields of ONE `Staging` buffer, so that they arrive in one host -> device copy (each
    copy costs the host more than its data does), together with the tables of a shift
    (engine/kv_cache.Shift) where the batch drafted ahead; the query order is fixed per graph
    (padded row-major: flat = query_index = arange)."""

    def __init__(self, rows: int, queries: int, width: int, block_size: int, device) -> None:
        n = rows * queries
        i64 = torch.int64
        self.blocks = -(-width // block_size)  # the block-table columns the keys of a bucket span
        self.staging = Staging(
            [
                ("positions", (n,), i64),
                ("seq_lens", (n,), i64),
                ("new_slots", (n,), i64),
                ("key_slots", (rows, width), i64),
                ("key_count", (rows,), i64),
                ("tokens", (n,), i64),
                ("mask", (rows, 1, queries, width), torch.bool),
                ("shift_rows", (n,), i64),  # a shift's [N] arrays and [R, B] block tables, B <= blocks
                ("shift_queries", (n,), i64),
                ("shift_at", (n,), i64),
                ("shift_tables", (rows * self.blocks,), i64),
            ],
            device,
        )
        fields = self.staging.fields
        self.positions, self.seq_lens, self.tokens = fields["positions"], fields["seq_lens"], fields["tokens"]
        # capture with scratch-only inputs: positions 0, new and key slots the scratch slot (0),
        # rows of length 1 attending to every (scratch) key
        self.seq_lens.fill_(1)
        fields["key_count"].fill_(width)
        fields["mask"].fill_(True)
        order = torch.arange(n, device=device)  # made on the device: no host wait at a capture
        self.meta = BatchMeta(
            new_slots=fields["new_slots"],
            key_slots=fields["key_slots"],
            key_count=fields["key_count"],
            mask=fields["mask"],
            query_index=order.view(rows, queries),
            flat=order,
        )
        self.graph: torch.cuda.CUDAGraph | None = None  # captured by PagedLlamaLM._capture
        self.logits: torch.Tensor | None = None
        self.features: torch.Tensor | None = None  # [rows * queries, F]: a target feeding a hidden-state draft

    def fill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        meta: BatchMeta,
        place: np.ndarray,
        at: torch.Tensor,
        shift: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """A replay's inputs in one copy (queued: the host does not wait): the real tokens'
        `positions`, `seq_lens` and, on the host, `tokens` [N] at their padded places `place` [N]
        (padding: position 0, length 1, token 0), the padded `meta`, and a shift's host arrays
        (`Shift.layout`). Tokens already on the graph's device (drafting) go to their places
        `at` (the same, there) after the copy."""
        host = self.staging.host()
        host["positions"].fill(0)
        host["positions"][place] = positions.numpy()
        host["seq_lens"].fill(1)
        host["seq_lens"][place] = seq_lens.numpy()
        host["new_slots"][:] = meta.new_slots.numpy()
        host["key_slots"][:] = meta.key_slots.numpy()
        host["key_count"][:] = meta.key_count.numpy()
        host["mask"][:] = meta.mask.numpy()
        host["tokens"].fill(0)
        on_host = tokens.device != self.tokens.device
        if on_host:
            host["tokens"][place] = tokens.numpy()
        if shift is not None:
            rows, queries, tables = shift
            n = len(rows)
            host["shift_rows"][:n], host["shift_queries"][:n], host["shift_at"][:n] = rows, queries, place
            host["shift_tables"][: tables.size] = tables.reshape(-1)
        self.staging.send()
        if not on_host:
            self.tokens.index_copy_(0, at, tokens)  # after the copy: on the same stream

    def shifted(self, by: torch.Tensor, layout: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Shift:
        """The `Shift` by `by` [R] (device) whose host arrays `layout` the last `fill` sent."""
        rows, _, tables = layout
        n, fields = len(rows), self.staging.fields
        return Shift(
            by,
            fields["shift_tables"][: tables.size].view(tables.shape),
            fields["shift_rows"][:n],
            fields["shift_queries"][:n],
            fields["shift_at"][:n],
        )


def attention_backend(choice: str, device: torch.device, eager: bool) -> str:
    """`--attention-backend`: "triton" (the pool read in place, engine/triton_attention.py) or
    "sdpa" (block-table gathers + torch SDPA, the reference). auto: triton on a GPU with Triton
    unless --enforce-eager (no compiled kernels); the CPU always runs SDPA."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {choice!r}")
    available = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if choice == "triton" and not available:
        raise ValueError(f"attention_backend: 'triton' needs a CUDA or ROCm device with Triton, got {device}")
    if choice == "auto":
        return "triton" if available and not eager else "sdpa"
    return choice


class PagedLlamaLM(ChunkedImport):
    def __init__(self, model: LlamaCausalLM, pool: KvPool, *, eager: bool = False, attention: str = "auto") -> None:
        self.model = model
        self.pool = pool
        self.graphs = not eager and pool.kv.device.type == "cuda"  # hipGraphs on ROCm: same API
        # Triton kernels for the elementwise ops on a GPU; the CPU, --enforce-eager and a torch
        # without Triton run them eagerly
        compiled = self.graphs and importlib.util.find_spec("triton") is not None
        self.ops = compiled_pointwise() if compiled else EAGER
        self.attention = attention_backend(attention, pool.kv.device, eager)
        self._kernel = None
        if self.attention == "triton":
            from engine import triton_attention

            self._kernel = triton_attention
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.module, self.config, self.num_layers = model.module, model.config, model.num_layers
        self.name, self.vocab_size = model.name, model.vocab_size
        self.eos_token_ids, self.kv_layout = model.eos_token_ids, model.kv_layout
        self.dtype, self.device = model.dtype, model.device
        self._storages = layout_order(pool.kv)  # [slots, Hkv, D] views of the pool, in layout order

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The layers whose outputs each forward keeps on its states (the wrapped model's)."""
        return self.model.feature_layers

    @property
    def positions_computed(self) -> int:
        """Tokens run through the forward (kept on the wrapped model, so a pair counts once)."""
        return self.model.positions_computed

    def _store(self, meta: BatchMeta, dense: bool) -> PagedBatch:
        """The KvStore of one forward: the Triton kernel where its tile holds a row's queries
        (decode, verify, draft steps), SDPA for prompt chunks."""
        kernel = self._kernel
        c = self.config
        if kernel is not None and kernel.fits(meta.query_index.shape[1], c.num_heads, c.num_kv_heads):
            return PagedBatch(self.pool, meta, dense=dense, kernel=kernel.paged_attention)
        return PagedBatch(self.pool, meta, dense=dense)

    @classmethod
    def with_pool(
        cls,
        model: LlamaCausalLM,
        kv_bytes: int,
        block_size: int = BLOCK_SIZE,
        *,
        eager: bool = False,
        attention: str = "auto",
    ) -> PagedLlamaLM:
        c = model.config
        per_block = block_size * bytes_per_token(model)  # a slot holds one position of every layout tensor
        num_blocks = kv_bytes // per_block
        if num_blocks < 2:  # one block is the scratch block
            raise ValueError(f"kv_cache_bytes: expected at least two blocks ({2 * per_block} bytes), got {kv_bytes}")
        pool = KvPool(
            layers=model.num_layers,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_blocks=int(num_blocks),
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
        )
        return cls(model, pool, eager=eager, attention=attention)

    # -- reservations ---------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.pool.usable_blocks * self.pool.block_size

    def can_reserve(self, tokens: int) -> bool:
        return self.pool.blocks_for(tokens) <= self.pool.free_blocks

    def reserve(self, state: State, tokens: int) -> None:
        self.pool.reserve(state.kv, tokens)  # KvCacheFull (and nothing taken) when it does not fit

    def release(self, state: State) -> None:
        end_import(state)  # an import's copies finish before its blocks can be handed out again
        self.pool.release(state.kv)

    # -- the CausalLM interface -------------------------------------------------------------
    def _run(
        self,
        states: Sequence[State],
        ids: Sequence[Sequence[int]],
        *,
        last_only: bool = False,
        parents: Sequence[Sequence[int]] | None = None,
        device_tokens: torch.Tensor | None = None,
        after_layer=None,
        shift: torch.Tensor | None = None,
    ):
        """device_tokens [sum of lengths] int64: the tokens' values, already on the device (ids
        then only give the lengths, and their values are what the states record). after_layer(i):
        called when layer i's KV is in the pool (an eager forward). shift [R] int64 on the device
        (chains only): each row's tokens sit shift[r] <= 0 positions before where its state's
        length puts them (engine/kv_cache.Shift)."""
        lengths = [len(row) for row in ids]
        seqs = [s.kv for s in states]
        for seq, n in zip(seqs, lengths, strict=True):
            self.pool.reserve(seq, seq.length + n)  # within the admission reservation: takes nothing new
        window = self.config.sliding_window
        meta = batch_positions(states, ids, parents, window)
        tokens = (
            torch.tensor([t for row in ids for t in row], dtype=torch.int64) if device_tokens is None else device_tokens
        )
        positions, seq_lens, masks = meta.positions, meta.seq_lens, meta.masks
        if shift is not None and (masks is not None and any(m is not None for m in masks)):
            raise ValueError("shift: expected chains, got tree masks")
        dense = len(set(lengths)) == 1  # every row brings as many tokens
        graphed = self.graphs and not last_only and after_layer is None
        key = self._graph_key(seqs, lengths) if graphed else None
        with torch.inference_mode():
            if key is not None:
                replayed = self._replay(key, seqs, lengths, tokens, positions, seq_lens, masks, shift)
                logits = keep_row_features(states, lengths, replayed)
            else:
                meta = batch_meta(self.pool, seqs, lengths, window, tree_masks=masks).to(self.device)
                logits_at = to_device(torch.tensor(lengths).cumsum(0) - 1, self.device) if last_only else None
                positions, seq_lens = to_device(positions, self.device), to_device(seq_lens, self.device)
                if shift is not None:
                    moved = Shift.build(shift, seqs, lengths, None)
                    moved.apply(positions, seq_lens, meta, self.pool.block_size, window)
                out = self.module(
                    to_device(tokens, self.device),
                    positions,
                    self._store(meta, dense),
                    logits_at=logits_at,
                    num_layers=self.num_layers,
                    seq_lens=seq_lens,
                    ops=self.ops,
                    after_layer=after_layer,
                    features_at=self.feature_layers,
                )
                logits = keep_row_features(states, lengths, out).float()
        for seq, n in zip(seqs, lengths, strict=True):
            seq.length += n
        self.model.positions_computed += len(tokens)
        for state, row in zip(states, ids, strict=True):
            state.tokens += [int(t) for t in row]
        return logits

    def _graph_key(self, seqs: Sequence[PagedSeq], lengths: Sequence[int]) -> tuple[int, int, int] | None:
        """The graph (row bucket, queries per row, key-width bucket) a forward replays, None
        for an eager one. Its own key where that is captured (every row bringing as many
        tokens); otherwise every row padded to the fewest queries per row among the graphs
        captured for its rows and width that hold its longest row, while that runs at most
        `PAD_FACTOR` times its tokens or `PAD_TOKENS` in all: an eager forward costs the host
        ~10x a replay, a capture ~10-20x a step (a stall of the whole batch), a padded token
        only its GPU work. So a verify pass of a K below the captured one (adaptive K), or one
        whose rows bring different numbers of drafts, replays a start-up graph. Where none
        fits, a uniform batch captures its own key now, a ragged one its longest row's, within
        the same bound (else it runs eagerly)."""
        longest = max(lengths)
        if len(seqs) > MAX_GRAPH_ROWS or longest > MAX_GRAPH_QUERIES:
            return None
        rows = bucket(len(seqs))
        width = bucket(max(s.length + n for s, n in zip(seqs, lengths, strict=True)), MIN_GRAPH_WIDTH)
        uniform = min(lengths) == longest
        if uniform and (rows, longest, width) in self._graphs:
            return rows, longest, width
        held = (q for r, q, w in self._graphs if r == rows and w == width and q >= longest)
        queries = min(held, default=longest)
        if rows * queries <= max(PAD_TOKENS, PAD_FACTOR * sum(lengths)):
            return rows, queries, width
        if uniform:
            return rows, longest, width
        return None

    def _replay(self, key, seqs, lengths, tokens, positions, seq_lens, masks, shift=None) -> torch.Tensor:
        """The forward of a batch through the graph `key` (captured on first use), its rows
        padded to the key's shape (`_Graph.fill`), moved by `shift` on the device once its
        inputs are filled; the outputs of the real tokens, flattened."""
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(*key)
        rows, queries, width = key
        meta = batch_meta(
            self.pool,
            seqs,
            lengths,
            self.config.sliding_window,
            rows=rows,
            width=width,
            tree_masks=masks,
            queries=queries,
            padded=True,
        )
        place = padded_places(lengths, queries)  # [N]
        at = shared_tensor(place.tolist(), torch.int64, self.device)  # a batch's steps repeat it: no copy
        layout = None if shift is None else Shift.layout(seqs, lengths, graph.blocks)
        graph.fill(tokens, positions, seq_lens, meta, place.numpy(), at, layout)
        if shift is not None:
            graph.shifted(shift, layout).apply(
                graph.positions, graph.seq_lens, graph.meta, self.pool.block_size, self.config.sliding_window
            )
        graph.graph.replay()
        logits = graph.logits.index_select(0, at).float()  # a copy: the next replay reuses the buffer
        if graph.features is None:
            return logits
        return logits, graph.features.index_select(0, at)

    def _capture(self, rows: int, queries: int, width: int) -> _Graph:
        """Capture with scratch-only inputs (padding everywhere): capture and its warm-up
        write nothing but the scratch block."""
        graph = _Graph(rows, queries, width, self.pool.block_size, self.device)

        def forward() -> torch.Tensor:
            return self.module(
                graph.tokens,
                graph.positions,
                self._store(graph.meta, True),
                num_layers=self.num_layers,
                seq_lens=graph.seq_lens,
                ops=self.ops,
                features_at=self.feature_layers,
            )

        graph.graph = torch.cuda.CUDAGraph()
        out = capture_graph(graph.graph, self._graph_pool, self.device, forward)
        graph.logits, graph.features = out if isinstance(out, tuple) else (out, None)
        return graph

    def capture_graphs(self, batch: int, context: int, queries: Sequence[int]) -> int:
        """Capture now every graph of `capture_keys` not captured yet (nothing without graphs);
        how many were captured."""
        if not self.graphs:
            return 0
        keys = [k for k in capture_keys(batch, context, queries, self.capacity_tokens()) if k not in self._graphs]
        with on_device(self.device), torch.inference_mode():
            for key in keys:
                self._graphs[key] = self._capture(*key)
        return len(keys)

    def warm_up(self) -> None:
        """Compile the elementwise kernels (a one-token and a two-token forward: dynamic
        sizes specialise 1) before the node serves, so that no request waits for inductor
        and no compile runs while another thread captures a graph. The blocks it writes
        are released at once. The Triton attention kernel's variants are compiled too
        (`triton_attention.warm_up`): otherwise the first prompt of each tile size would wait."""
        if self._kernel is not None:
            c = self.config
            with on_device(self.device):
                self._kernel.warm_up(c.num_heads, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        if self.ops is EAGER:
            return
        state, computed = self.empty_state(), self.model.positions_computed
        self.reserve(state, 3)
        try:
            with on_device(self.device):
                self._run([state], [[0, 0]], last_only=True)  # eager path: N = 2
                self._run([state], [[0]], last_only=True)  # N = 1
        finally:
            self.release(state)
            self.model.positions_computed = computed  # no request's work

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, State]:
        if not ids:
            raise ValueError("ids: expected a non-empty prompt, got []")
        state = State(tokens=[], kv=PagedSeq())
        self.reserve(state, len(ids))
        try:
            return self._run([state], [list(ids)], last_only=True)[0], state
        except BaseException:
            self.release(state)
            raise

    def extend(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        if not ids:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self._run([state], [list(ids)])

    def extend_batch(
        self,
        states: Sequence[State],
        ids: Sequence[Sequence[int]],
        device_tokens: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """All rows in ONE forward (flattened ragged tokens); rows with no new ids are left out.
        device_tokens: as in extend_tree (the decode engine's async steps). shift [R] int64 on
        the device: row r's tokens sit shift[r] <= 0 positions before its state's length (every
        row brings ids; engine/kv_cache.Shift)."""
        if shift is not None and not all(ids):
            raise ValueError("ids: a shifted batch expects ids in every row")
        return live_rows(
            lambda s, rows, _: self._run(s, rows, device_tokens=device_tokens, shift=shift),
            states,
            ids,
            None,
            self._empty(),
        )

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.vocab_size, device=self.device)

    def empty_state(self) -> State:
        return State(tokens=[], kv=PagedSeq())

    def extend_last(self, states: Sequence[State], ids: Sequence[Sequence[int]], after_layer=None) -> torch.Tensor:
        """[R, V]: the last position's logits of each row (prefill chunks: no other logits).
        after_layer(i): called once layer i's KV of these tokens is in the pool."""
        return self._run(states, [list(row) for row in ids], last_only=True, after_layer=after_layer)

    layer_export = True  # extend_last(after_layer=), kv_slots and export_async: the KV shipped layer by layer

    def truncate(self, state: State, length: int) -> None:
        if not 0 <= length <= len(state.tokens):
            raise ValueError(f"length: expected 0..{len(state.tokens)}, got {length}")
        state.kv.length = length  # rejected slots stay reserved and are overwritten next step
        drop_features(state, length)
        del state.tokens[length:]

    supports_trees = True
    device_tokens = True  # extend_tree / extend_batch take the tokens' values as a device tensor

    def extend_tree(
        self,
        states: Sequence[State],
        ids: Sequence[Sequence[int]],
        parents: Sequence[Sequence[int]],
        device_tokens: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """device_tokens: the values of the flattened ids of the rows that bring any, on the
        device (the ids' own values are then what the states record until the caller sets them)."""
        return live_rows(
            lambda s, rows, p: self._run(s, rows, parents=p, device_tokens=device_tokens),
            states,
            ids,
            parents,
            self._empty(),
        )

    def accept_tree(self, state: State, keep: Sequence[int]) -> None:
        src, dst = close_span(state, keep)
        if src:
            self.pool.move(state.kv, src, dst)
        state.kv.length = len(state.tokens)

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The live slots of each layer gathered into the wire layout, on the host."""
        slots = self.kv_slots(state, state.kv.length)
        return [self.export_tensor(slots, i, None if out is None else out[i]) for i in range(len(self.kv_layout))]

    def kv_slots(self, state: State, length: int) -> torch.Tensor:
        """[length] int64 on the device: the pool slots of the state's positions 0..length-1."""
        return to_device(self.pool.slots(state.kv, 0, length), self.device)

    def export_tensor(self, slots: torch.Tensor, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Wire KV tensor `index` (layer index // 2, keys or values) of the positions in `slots`
        ([n] int64 on the device): [Hkv, n, D] on the host, or copied into `out`."""
        live = self._live(slots, index)
        return live.contiguous().cpu() if out is None else out.copy_(live)

    def export_async(self, slots: torch.Tensor, index: int) -> HostCopy:
        """`export_tensor` without a host wait: the gather is queued on the current stream and
        the copy to the host on a side stream (from a GPU), so a forward calling this between
        its layers goes on queuing the next ones."""
        return to_host_async(self._live(slots, index).contiguous())

    def _live(self, slots: torch.Tensor, index: int) -> torch.Tensor:
        return gather(self._storages[index], slots)  # the one gather of both exports

    def begin_import(self, tokens: Sequence[int], reserve: int) -> State:
        """Blocks for `reserve` positions, taken at once (KvCacheFull and nothing taken if the pool
        lacks them): no forward reads them until the request they belong to is admitted."""
        seq = len(tokens)
        state = State(tokens=list(tokens), kv=PagedSeq())
        self.reserve(state, max(reserve, seq))
        state.importing = KvWriter(self.kv_layout, seq, self._storages, self.pool.slots(state.kv, 0, seq))
        return state

    def finish_import(self, state: State) -> None:
        end_import(state)
        state.kv.length = len(state.tokens)


def paged_pair(
    pair: ModelPair,
    kv_cache_bytes: int,
    *,
    eager: bool = False,
    attention: str = "auto",
    capture: GraphCapture | None = None,
) -> ModelPair:
    """The pair with its Llama models on paged pools sharing `kv_cache_bytes`: target and
    draft pools hold the same number of tokens (every request has KV in both), so the bytes
    split by their per-token sizes (a layer-skip draft of N of L layers takes N/(N+L)).
    On a GPU, SDPA is kept off cuDNN (`serve_attention_without_cudnn`), the elementwise kernels
    are compiled here (`warm_up`), and the sampling kernels (sampling/cupy_kernels.py), then the
    graphs of `capture` are captured. Other backends
    (n-gram, transformers) are returned as they are."""
    if not isinstance(pair.target, LlamaCausalLM):
        return pair
    models = [pair.target] + ([pair.draft] if isinstance(pair.draft, LlamaCausalLM) else [])
    serve_attention_without_cudnn(pair.target.device)  # before any capture: graphs keep the backend chosen
    tokens = kv_cache_bytes // sum(bytes_per_token(m) for m in models)
    target = PagedLlamaLM.with_pool(
        pair.target, tokens * bytes_per_token(pair.target), eager=eager, attention=attention
    )
    draft = pair.draft
    if isinstance(draft, LlamaCausalLM):
        draft = PagedLlamaLM.with_pool(draft, tokens * bytes_per_token(draft), eager=eager, attention=attention)
        draft.warm_up()
    elif isinstance(draft, EagleDraft) and target.graphs:  # a head's drafting depths replay graphs as well
        shape = capture if capture is not None and capture.batch else GraphCapture()
        draft = draft.with_graphs(shape.batch, shape.context)
    target.warm_up()
    if target.device.type == "cuda" and cupy_available():  # else the first request to launch one compiles it
        load_kernels(target.device)
    log.info(
        "KV pools: %s",
        ", ".join(
            f"{role} {m.pool.num_blocks} blocks of {m.pool.block_size} tokens ({m.pool.kv.nbytes / 2**20:.0f} MiB)"
            for role, m in (("target", target), ("draft", draft))
            if isinstance(m, PagedLlamaLM)
        ),
    )
    if capture is not None and target.graphs:
        started = time.monotonic()
        captured = target.capture_graphs(capture.batch, capture.context, capture.target_queries)
        if isinstance(draft, PagedLlamaLM):
            captured += draft.capture_graphs(capture.batch, capture.context, capture.draft_queries)
        elif isinstance(draft, EagleDraft):
            captured += draft.capture_chains()
        log.info("captured %d CUDA graphs in %.1f s (%s)", captured, time.monotonic() - started, capture)
    return ModelPair(target, draft, pair.d2t, pair.tokenizer)


def kv_pool_bytes(pair: ModelPair) -> int:
    """The bytes of the pair's KV pools (GetInfo's kv_pool_bytes; 0 for models without one)."""
    return sum(m.pool.kv.nbytes for m in (pair.target, pair.draft) if isinstance(m, PagedLlamaLM))


def bytes_per_token(model: CausalLM) -> int:
    """KV bytes of one position of the model: what its pool spends per token."""
    return kv_bytes(model.kv_layout, 1)


def pool_bytes_for(model: CausalLM, rows: int, tokens: int) -> int:
    """The pool size (`with_pool`'s kv_bytes) that holds `rows` reservations of `tokens`
    positions each at once: whole blocks per row, and the scratch block."""
    blocks = rows * -(-tokens // BLOCK_SIZE) + 1
    return blocks * BLOCK_SIZE * bytes_per_token(model)
