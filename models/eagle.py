"""A hidden-state draft head (EAGLE-3 style) for a Llama-family target.

The head is ONE decoder layer. At position i it reads the target's hidden states after a low,
a middle and a high layer (`feature_layers`, captured by the target's own forward:
models/llama.py `features_at`, kept on the target's State as `features`), fused to one hidden
vector by a linear map (`fc`), together with the embedding of token i + 1 (the target's
embedding, shared, not copied); its output predicts token i + 2 over a REDUCED vocabulary
(`lm_head` has Vd rows; `d2t` names their target ids). Drafting past the last position the
target has computed, the head's own output stands in for the fused features.

So the head lags the target by one token: after a prompt of n tokens and the first token, it
has consumed n positions, as many as the target's KV; its KV (one layer, `kv_layout`) ships
with the target's across the prefill/decode boundary (models/pair.py `ModelPair.kv_layout`).

`EagleDraft` is the head as a pair's draft (name, vocabulary, KV export/import like any
model), with `extend` taking hidden vectors next to the tokens. `load_eagle` / `save_eagle`:
a directory with `eagle.json` (config, the d2t map, the fingerprint of the target it was
trained for) and `model.safetensors`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.graphs import bucket, capture_graph
from common.transfer import device_tensor
from models.base import ChunkedImport, GrowingKv, State, end_import
from models.kv_import import KvWriter
from models.llama import (
    EAGER,
    MLP,
    ContiguousBatch,
    ContiguousKv,
    Linear,
    LlamaCausalLM,
    LlamaConfig,
    RMSNorm,
    digest_of,
    rope_cos_sin,
    rope_inv_freq,
)
from protos.kv_layout import layer_kv_layout, layout_order

EAGLE_CONFIG = "eagle.json"
EAGLE_WEIGHTS = "model.safetensors"
MIN_CHAIN_WIDTH = 256  # the smallest key-width bucket of a chain graph (as the paged models' graphs)


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (transformers' hidden_states[2], [L // 2], [L - 3]
    are the outputs of layers 1, L // 2 - 1 and L - 4), clamped into a shallow target."""
    last = num_layers - 1
    return tuple(sorted(min(max(layer, 0), last) for layer in (1, num_layers // 2 - 1, num_layers - 4)))


def target_fingerprint(target: LlamaCausalLM) -> str:
    """What binds a head to its target: the target's file digest, its shape, and the values of
    its first embedding rows rounded to bfloat16 (the file digest reads headers only; bfloat16:
    a head trained in float32 serves a bfloat16 target of the same weights)."""
    c = target.config
    rows = target.module.model.embed_tokens.weight[:16].detach().to(torch.bfloat16).view(torch.int16).cpu()
    dims = (c.model_type, str(c.vocab_size), str(c.hidden_size), str(c.num_layers))
    return digest_of(target.source_digest, *dims, rows.numpy().tobytes())


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab_size: int
    feature_layers: tuple[int, ...]
    target_fingerprint: str
    d2t: tuple[int, ...]  # draft id j proposes target id d2t[j]

    def __post_init__(self) -> None:
        if len(self.d2t) < 1 or len(set(self.d2t)) != len(self.d2t):
            raise ValueError(f"d2t: expected distinct target ids, got {len(self.d2t)} ids")
        if min(self.d2t) < 0 or max(self.d2t) >= self.target_vocab_size:
            got = f"{min(self.d2t)}..{max(self.d2t)}"
            raise ValueError(f"d2t: expected ids in 0..{self.target_vocab_size - 1}, got {got}")
        if not self.feature_layers:
            raise ValueError("feature_layers: expected at least one target layer, got none")

    @classmethod
    def for_target(cls, target: LlamaCausalLM, d2t: Sequence[int], feature_layers: Sequence[int] | None = None):
        c = target.config
        layers = tuple(feature_layers) if feature_layers is not None else default_feature_layers(c.num_layers)
        if any(not 0 <= layer < c.num_layers for layer in layers):
            raise ValueError(f"feature_layers: expected layers in 0..{c.num_layers - 1}, got {layers}")
        return cls(
            hidden_size=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            target_vocab_size=c.vocab_size,
            feature_layers=layers,
            target_fingerprint=target_fingerprint(target),
            d2t=tuple(int(i) for i in d2t),
        )

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    def layer_config(self) -> LlamaConfig:
        """The decoder layer's LlamaConfig (its MLP, norms and plain RoPE)."""
        return LlamaConfig(
            model_type="llama",
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )


class EagleHead(nn.Module):
    """The weights and the ragged forward. The token embedding is the target's (passed in)."""

    def __init__(self, config: EagleConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        h, hq, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.config, self.layer = config, config.layer_config()
        self.embed_tokens = [embed_tokens]  # a list: not a submodule, never saved or trained here
        self.fc = Linear(len(config.feature_layers) * h, h, bias=False)
        self.input_norm = RMSNorm(h, config.rms_norm_eps)  # the token's embedding
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)  # the fused features (or the head's output)
        self.qkv_proj = Linear(2 * h, (hq + 2 * hkv) * d, bias=False)
        self.o_proj = Linear(hq * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(self.layer)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(self.layer), persistent=False)

    def forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [N] (the token after each position), hidden [N, H] (fused features or the
        head's own output), positions [N] -> logits [N, Vd], output hidden [N, H]."""
        n, c = tokens.shape[0], self.config
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        embed = self.embed_tokens[0](tokens).to(hidden.dtype)  # [N, H]
        x = torch.cat(
            [
                EAGER.rms_norm(embed, self.input_norm.weight, self.input_norm.eps),
                EAGER.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps),
            ],
            dim=-1,
        )  # [N, 2H]
        cos, sin = rope_cos_sin(self.layer, self.inv_freq, positions, None, hidden.dtype)
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, new_kv = EAGER.rope_qkv(q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d), cos, sin)
        residual = hidden + self.o_proj(kv.attend(0, q, new_kv).reshape(n, hq * d))  # [N, H]
        norm2 = self.post_attention_layernorm
        out = residual + self.mlp(EAGER.rms_norm(residual, norm2.weight, norm2.eps), EAGER)
        logits = self.lm_head(EAGER.rms_norm(out, self.norm.weight, self.norm.eps))  # [N, Vd]
        return logits, out

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [N, F] -> the head's hidden input [N, H]."""
        return self.fc(features.to(self.fc.weight.dtype))


@dataclass
class HeadState(State):
    """A head's request state: its KV, and the outputs at its last position (the logits [Vd]
    of the token after the next, the hidden [H] the next drafted position reads)."""

    last: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)


@dataclass
class StackedKv:
    """A `KvStore` for the drafting depths of a chain: M rows' committed keys and values copied
    once into [M, Hkv, W, D] (`load`); each depth writes row m's new key and value at
    positions[m] and attends to its keys 0..positions[m]. Every index is a device tensor, so a
    depth is one capturable forward (`EagleDraft.depth`); the rows' own caches are never written
    (a chain's drafted positions are not kept: the next catch-up writes them from the target's
    features)."""

    keys: torch.Tensor  # [M, Hkv, W, D]
    values: torch.Tensor  # [M, Hkv, W, D]
    positions: torch.Tensor  # [M] int64: each row's next position
    rows: torch.Tensor  # [M] int64: 0..M-1
    key_index: torch.Tensor  # [W] int64: 0..W-1

    @classmethod
    def empty(cls, rows: int, width: int, kv_heads: int, head_dim: int, dtype, device) -> StackedKv:
        def cache() -> torch.Tensor:
            return torch.zeros(rows, kv_heads, width, head_dim, dtype=dtype, device=device)

        def index(n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.int64, device=device)

        return cls(cache(), cache(), torch.zeros(rows, dtype=torch.int64, device=device), index(rows), index(width))

    def view(self, rows: int, width: int) -> StackedKv:
        """The first `rows` rows and `width` positions (views: a graph's inputs within a larger cache)."""
        return StackedKv(
            self.keys[:rows, :, :width],
            self.values[:rows, :, :width],
            self.positions[:rows],
            self.rows[:rows],
            self.key_index[:width],
        )

    def load(self, caches: Sequence[ContiguousKv]) -> None:
        """Rows 0..len(caches)-1 <- those caches' live keys and values (one multi-tensor copy);
        every row's position <- its cache's length (rows past them: 0)."""
        live = [(m, cache) for m, cache in enumerate(caches) if cache.length]
        if live:
            targets = [t[m, :, : cache.length] for t in (self.keys, self.values) for m, cache in live]
            sources = [cache.keys[0][:, : cache.length] for _, cache in live]
            sources += [cache.values[0][:, : cache.length] for _, cache in live]
            torch._foreach_copy_(targets, sources)
        lengths = [c.length for c in caches] + [0] * (len(self.positions) - len(caches))
        self.positions.copy_(device_tensor(lengths, torch.int64, self.positions.device))

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        k, v = kv  # [M, Hkv, D] each
        self.keys[self.rows, :, self.positions] = k
        self.values[self.rows, :, self.positions] = v
        mask = (self.key_index[None, :] <= self.positions[:, None])[:, None, None, :]  # [M, 1, 1, W]
        out = F.scaled_dot_product_attention(q[:, :, None], self.keys, self.values, attn_mask=mask, enable_gqa=True)
        return out[:, :, 0]  # [M, Hq, D]


@dataclass
class _DepthGraph:
    """One captured drafting depth: its rows' logits [R, Vd] and output hidden [R, H], rewritten
    by every replay."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    out: torch.Tensor


class ChainGraphs:
    """The head's drafting depth as CUDA graphs, one per (row bucket, key-width bucket), over one
    stacked cache of `rows` x `width` positions and static token / hidden inputs that every graph
    views (a node runs one chain at a time). A chain whose rows or width pass these runs eagerly."""

    def __init__(self, draft: EagleDraft, rows: int, width: int) -> None:
        c, device = draft.config, draft.device
        self.draft = draft
        self.rows, self.width = bucket(rows), bucket(width, MIN_CHAIN_WIDTH)
        self.stacked = StackedKv.empty(self.rows, self.width, c.num_kv_heads, c.head_dim, draft.dtype, device)
        self.tokens = torch.zeros(self.rows, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(self.rows, c.hidden_size, dtype=draft.dtype, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _DepthGraph] = {}

    def key(self, rows: int, width: int) -> tuple[int, int] | None:
        key = bucket(rows), bucket(width, MIN_CHAIN_WIDTH)
        return key if key[0] <= self.rows and key[1] <= self.width else None

    def all_keys(self) -> list[tuple[int, int]]:
        """Every key these buffers hold: row buckets 1..rows x widths MIN_CHAIN_WIDTH..width."""
        rows = [1 << i for i in range(self.rows.bit_length())]
        widths = [MIN_CHAIN_WIDTH << i for i in range((self.width // MIN_CHAIN_WIDTH).bit_length())]
        return [(r, w) for r in rows for w in widths]

    def graph(self, key: tuple[int, int]) -> _DepthGraph:
        """The graph of `key`, captured now if it is not yet."""
        if key not in self.graphs:
            rows, width = key
            stacked = self.stacked.view(rows, width)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.draft.device), torch.inference_mode():
                logits, out = capture_graph(
                    graph,
                    self.pool,
                    self.draft.device,
                    lambda: self.draft.depth(stacked, self.tokens[:rows], self.hidden[:rows]),
                )
            self.graphs[key] = _DepthGraph(graph, logits, out)
        return self.graphs[key]


class HeadChain:
    """One drafting chain of M rows: their committed KV stacked once, then `step` per depth
    after the first (a graph replay where `ChainGraphs` holds the shape, else an eager forward)."""

    def __init__(self, draft: EagleDraft, states: Sequence[State], steps: int) -> None:
        c, caches = draft.config, [state.kv for state in states]
        self.draft, self.rows = draft, len(caches)
        width = max(cache.length for cache in caches) + steps
        graphs = draft.chain_graphs
        key = None if graphs is None else graphs.key(self.rows, width)
        self.graph = None if key is None else graphs.graph(key)
        self.inputs = None if key is None else (graphs.tokens, graphs.hidden)
        if key is None:
            self.stacked = StackedKv.empty(self.rows, width, c.num_kv_heads, c.head_dim, draft.dtype, draft.device)
        else:
            self.stacked = graphs.stacked.view(*key)
        with torch.inference_mode():
            self.stacked.load(caches)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [M] int64 target ids, hidden [M, H] (the last depth's outputs), on the device ->
        float32 logits [M, Vd] (a copy) and the output hidden [M, H] (valid until the next step)."""
        m = self.rows
        self.draft.positions_computed += m
        with torch.inference_mode():
            if self.graph is None:
                logits, out = self.draft.depth(self.stacked, tokens, hidden.to(self.draft.dtype))
                return logits.float(), out
            tokens_in, hidden_in = self.inputs
            tokens_in[:m].copy_(tokens)
            hidden_in[:m].copy_(hidden)
            self.graph.graph.replay()
            return self.graph.logits[:m].to(torch.float32, copy=True), self.graph.out[:m]


class EagleDraft(ChunkedImport, GrowingKv):
    """A head as a pair's draft: draft-vocabulary logits, its own KV per request (one layer,
    contiguous), exported and imported in `kv_layout` like a target's."""

    supports_trees = False  # chains: the head drafts one token per depth
    ships_state = True  # its KV goes with the target's (models/pair.py): rebuilding it needs the prompt's features

    def __init__(self, head: EagleHead, eos_token_ids: Sequence[int], weights_digest: str) -> None:
        c = head.config
        self.head = head.eval()
        self.config = c
        weight = head.lm_head.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.vocab_size = c.draft_vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.feature_layers = c.feature_layers
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.name = f"eagle:{c.target_fingerprint}:{weights_digest}:{dtype_name}"
        self.kv_layout = layer_kv_layout(1, c.num_kv_heads, c.head_dim, self.dtype)
        self.positions_computed = 0
        self.chain_graphs: ChainGraphs | None = None  # `with_graphs`: a GPU node's

    def _new_cache(self, capacity: int) -> ContiguousKv:
        c = self.config
        return ContiguousKv.empty(1, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def empty_state(self) -> HeadState:
        return HeadState(tokens=[], kv=self._new_cache(16))

    def extend(
        self, states: Sequence[State], ids: Sequence[Sequence[int]], hidden: Sequence[torch.Tensor], fused: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row r consumes ids[r] (the token after each new position) with hidden[r] [n_r, ...]:
        the target's features (fused=False: the head fuses them) or the head's own outputs.
        Returns per row the float32 logits [n_r, Vd] and the output hidden [n_r, H]."""
        lengths = [len(row) for row in ids]
        tokens = device_tensor([t for row in ids for t in row], torch.int64, self.device)
        with torch.inference_mode():
            x = torch.cat([h.to(self.device) for h in hidden])
            x = self.head.fuse(x) if not fused else x.to(self.dtype)
            logits, out = self._forward(states, lengths, tokens, x)
        logits, out = list(logits.float().split(lengths)), list(out.split(lengths))
        for state, row, row_logits, row_out in zip(states, ids, logits, out, strict=True):
            state.tokens += [int(t) for t in row]
            state.last = (row_logits[-1], row_out[-1])
        return logits, out

    def chain(self, states: Sequence[State], steps: int) -> HeadChain:
        """A drafting chain of these rows past their committed positions, `steps` depths after
        the first (which draws from `last`): see `HeadChain`. The states are not changed."""
        return HeadChain(self, states, steps)

    def depth(
        self, stacked: StackedKv, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted position of every row of `stacked`, at its position, which then moves on
        by one: tokens [M] int64 target ids, hidden [M, H] (the head's previous outputs) ->
        logits [M, Vd], output hidden [M, H]. Device tensors in, device work only: capturable."""
        logits, out = self.head(tokens, hidden, stacked.positions, stacked)
        stacked.positions.add_(1)
        return logits, out

    def with_graphs(self, rows: int, width: int) -> EagleDraft:
        """This head (the same weights) replaying the drafting depths of chains of up to `rows`
        rows and `width` positions from CUDA graphs (`ChainGraphs`; captured on first use, or by
        `capture_chains`). A copy: each node runs one chain at a time over the graphs' static
        buffers, and the two nodes of one process must not share them."""
        draft = copy.copy(self)
        draft.chain_graphs = ChainGraphs(draft, rows, width)
        return draft

    def capture_chains(self) -> int:
        """Capture every graph `with_graphs` allows now (start-up: no request waits for one);
        how many were captured."""
        graphs = self.chain_graphs
        if graphs is None:
            return 0
        keys = [key for key in graphs.all_keys() if key not in graphs.graphs]
        for key in keys:
            graphs.graph(key)
        return len(keys)

    def _forward(
        self, states: Sequence[State], lengths: Sequence[int], tokens: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over `lengths[r]` new positions of row r, after its KV's live ones."""
        starts = [state.kv.length for state in states]
        positions = device_tensor(
            [p for start, n in zip(starts, lengths, strict=True) for p in range(start, start + n)],
            torch.int64,
            self.device,
        )
        batch = ContiguousBatch([s.kv for s in states], lengths)
        logits, out = self.head(tokens, x, positions, batch)
        batch.commit()
        self.positions_computed += len(tokens)
        return logits, out

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The head over tokens alone, zero hidden inputs (adaptive K's calibration fills a state
        with it before it times a chain's depth, engine/adaptive.py), never a draft."""
        zeros = [torch.zeros(len(row), self.config.hidden_size, dtype=self.dtype) for row in ids]
        return self.extend(states, ids, zeros, fused=True)[0]

    def truncate(self, state: State, length: int) -> None:
        if not 0 <= length <= len(state.tokens):
            raise ValueError(f"length: expected 0..{len(state.tokens)}, got {length}")
        state.kv.length = length
        del state.tokens[length:]

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        cache, n = state.kv, state.kv.length
        live = [t[:, :n] for t in layout_order(zip(cache.keys, cache.values, strict=True))]
        if out is None:
            return [t.contiguous().cpu() for t in live]
        return [o.copy_(t) for o, t in zip(out, live, strict=True)]

    def begin_import(self, tokens: Sequence[int], reserve: int) -> HeadState:
        seq = len(tokens)
        cache = self._new_cache(max(reserve, seq + 16))
        storages = [t.transpose(0, 1) for t in layout_order(zip(cache.keys, cache.values, strict=True))]
        writer = KvWriter(self.kv_layout, seq, storages, torch.arange(seq))  # [capacity, Hkv, D] views
        return HeadState(tokens=list(tokens), kv=cache, importing=writer)

    def finish_import(self, state: State) -> None:
        end_import(state)
        state.kv.length = len(state.tokens)


def head_weights(head: EagleHead) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().cpu().contiguous() for name, t in head.state_dict().items()}


def save_eagle(head: EagleHead, out: Path) -> None:
    """eagle.json + model.safetensors: what `load_eagle` reads. The weights are stored in
    bfloat16, the dtype GPU targets serve them in (half the bytes of float32: a head for a
    small target fits the repository); a float32 target upcasts them."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.to(torch.bfloat16) for name, t in head_weights(head).items()}, out / EAGLE_WEIGHTS)
    (out / EAGLE_CONFIG).write_text(json.dumps(asdict(head.config), indent=1) + "\n")


def is_eagle_dir(path: Path | str) -> bool:
    return Path(path).is_dir() and (Path(path) / EAGLE_CONFIG).is_file()


def read_eagle_config(path: Path) -> EagleConfig:
    raw = json.loads((path / EAGLE_CONFIG).read_text())
    try:
        raw["feature_layers"] = tuple(raw["feature_layers"])
        raw["d2t"] = tuple(raw["d2t"])
        return EagleConfig(**raw)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{EAGLE_CONFIG}: expected a head's config fields, got {sorted(raw)} ({error})") from None


def load_eagle(path: Path | str, target: LlamaCausalLM) -> EagleDraft:
    """The head in `path`, bound to `target` (its fingerprint must match: ValueError otherwise),
    in the target's dtype and device, reading the target's embedding."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_eagle_config(path)
    expected = target_fingerprint(target)
    if config.target_fingerprint != expected:
        raise ValueError(
            f"draft_model: expected a head trained for this target (fingerprint {expected}), "
            f"got one for {config.target_fingerprint} ({path})"
        )
    if config.hidden_size != target.config.hidden_size or config.target_vocab_size != target.vocab_size:
        raise ValueError(f"draft_model: expected hidden size {target.config.hidden_size}, got {config.hidden_size}")
    head = EagleHead(config, target.module.model.embed_tokens)
    weights = load_file(path / EAGLE_WEIGHTS)
    expected_shapes = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    got_shapes = {name: tuple(t.shape) for name, t in weights.items()}
    if got_shapes != expected_shapes:
        raise ValueError(f"{EAGLE_WEIGHTS}: expected tensors {expected_shapes}, got {got_shapes}")
    head.load_state_dict(weights)
    head.to(device=target.device, dtype=target.dtype).requires_grad_(False)
    digest = digest_of((path / EAGLE_WEIGHTS).read_bytes())
    return EagleDraft(head, target.eos_token_ids, digest)


def eagle_draft(head: EagleHead, target: LlamaCausalLM) -> EagleDraft:
    """A head held in memory (training, tests) as a pair's draft, named by its weights."""
    weights = head_weights(head)
    digest = digest_of(*(name.encode() + weights[name].numpy().tobytes() for name in sorted(weights)))
    return EagleDraft(head, target.eos_token_ids, digest)
