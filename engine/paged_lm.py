"""The Llama modules behind the `CausalLM` interface, on a paged KV pool.

`PagedLlamaLM` is what both nodes serve for Llama-family models on any device: the module
(models/llama.py) holds no cache; every request's KV lives in the model's `KvPool` (one
preallocated tensor) under a block table. The wire KV goes straight between the pool and
the `[kv_heads, seq, head_dim]` tensors of the contract (`export_state` gathers the live
slots, `import_state` scatters into freshly reserved blocks): no per-request cache object.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache import KvPool, PagedBatch, PagedSeq
from models.base import State
from models.llama import LlamaCausalLM
from models.pair import ModelPair

BLOCK_SIZE = 16  # tokens per block: vLLM's default; small enough that waste per request is tiny


class PagedLlamaLM:
    def __init__(self, model: LlamaCausalLM, pool: KvPool) -> None:
        self.model = model
        self.pool = pool
        self.module, self.config, self.num_layers = model.module, model.config, model.num_layers
        self.name, self.vocab_size = model.name, model.vocab_size
        self.eos_token_ids, self.kv_layout = model.eos_token_ids, model.kv_layout
        self.dtype, self.device = model.dtype, model.device

    @property
    def positions_computed(self) -> int:
        """Tokens run through the forward (kept on the wrapped model, so a pair counts once)."""
        return self.model.positions_computed

    @classmethod
    def with_pool(cls, model: LlamaCausalLM, kv_bytes: int, block_size: int = BLOCK_SIZE) -> PagedLlamaLM:
        c = model.config
        per_block = KvPool.bytes_per_block(model.num_layers, c.num_kv_heads, c.head_dim, block_size, model.dtype)
        num_blocks = kv_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes: expected at least one block ({per_block} bytes), got {kv_bytes}")
        pool = KvPool(
            layers=model.num_layers,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_blocks=int(num_blocks),
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
        )
        return cls(model, pool)

    # -- reservations ---------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def can_reserve(self, tokens: int) -> bool:
        return self.pool.blocks_for(tokens) <= self.pool.free_blocks

    def reserve(self, state: State, tokens: int) -> None:
        self.pool.reserve(state.kv, tokens)  # KvCacheFull (and nothing taken) when it does not fit

    def release(self, state: State) -> None:
        self.pool.release(state.kv)

    # -- the CausalLM interface -------------------------------------------------------------
    def _run(self, states: Sequence[State], ids: Sequence[Sequence[int]], *, last_only: bool = False):
        lengths = [len(row) for row in ids]
        past = [s.kv.length for s in states]
        device = self.device
        tokens = torch.tensor([t for row in ids for t in row], dtype=torch.int64).to(device)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(past, lengths, strict=True)]).to(device)
        seq_lens = torch.cat(
            [torch.full((n,), p + n, dtype=torch.int64) for p, n in zip(past, lengths, strict=True)]
        ).to(device)
        logits_at = (torch.tensor(lengths).cumsum(0) - 1).to(device) if last_only else None
        batch = PagedBatch(self.pool, [s.kv for s in states], lengths, self.config.sliding_window)
        with torch.inference_mode():
            logits = self.module(
                tokens, positions, batch, logits_at=logits_at, num_layers=self.num_layers, seq_lens=seq_lens
            ).float()
        batch.commit()
        self.model.positions_computed += len(tokens)
        for state, row in zip(states, ids, strict=True):
            state.tokens += [int(t) for t in row]
        return logits

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

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """All rows in ONE forward (flattened ragged tokens); rows with no new ids are left out."""
        if len(states) != len(ids):
            raise ValueError(f"ids: expected {len(states)} rows (one per state), got {len(ids)}")
        out = [torch.empty(0, self.vocab_size, device=self.device) for _ in states]
        live = [i for i, row in enumerate(ids) if len(row)]
        if not live:
            return out
        logits = self._run([states[i] for i in live], [list(ids[i]) for i in live])
        for i, part in zip(live, logits.split([len(ids[i]) for i in live]), strict=True):
            out[i] = part
        return out

    def truncate(self, state: State, length: int) -> None:
        if not 0 <= length <= len(state.tokens):
            raise ValueError(f"length: expected 0..{len(state.tokens)}, got {length}")
        state.kv.length = length  # rejected slots stay reserved and are overwritten next step
        del state.tokens[length:]

    def export_state(self, state: State) -> list[torch.Tensor]:
        return [t.cpu() for layer in range(self.num_layers) for t in self.pool.read(state.kv, layer)]

    def import_state(self, tensors: Sequence[torch.Tensor], tokens: Sequence[int]) -> State:
        if len(tensors) != len(self.kv_layout):
            raise ValueError(f"tensors: expected {len(self.kv_layout)} KV tensors, got {len(tensors)}")
        seq = len(tokens)
        for index, (tensor, spec) in enumerate(zip(tensors, self.kv_layout, strict=True)):
            if tuple(tensor.shape) != spec.shape_for(seq) or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"tensors[{index}]: expected {spec.dtype} {spec.shape_for(seq)}, "
                    f"got {tensor.dtype} {tuple(tensor.shape)}"
                )
        state = State(tokens=list(tokens), kv=PagedSeq())
        self.reserve(state, seq)
        for layer in range(self.num_layers):
            self.pool.write(state.kv, layer, tensors[2 * layer], tensors[2 * layer + 1])
        state.kv.length = seq
        return state


def paged_pair(pair: ModelPair, kv_cache_bytes: int) -> ModelPair:
    """The pair with its Llama models on paged pools sharing `kv_cache_bytes`: target and
    draft pools hold the same number of tokens (every request has KV in both), so the bytes
    split by their per-token sizes (a layer-skip draft of N of L layers takes N/(N+L)).
    Other backends (n-gram, transformers) are returned as they are."""
    if not isinstance(pair.target, LlamaCausalLM):
        return pair
    models = [pair.target] + ([pair.draft] if isinstance(pair.draft, LlamaCausalLM) else [])
    tokens = kv_cache_bytes // sum(bytes_per_token(m) for m in models)
    target = PagedLlamaLM.with_pool(pair.target, tokens * bytes_per_token(pair.target))
    draft = pair.draft
    if isinstance(draft, LlamaCausalLM):
        draft = PagedLlamaLM.with_pool(draft, tokens * bytes_per_token(draft))
    return ModelPair(target, draft, pair.d2t, pair.tokenizer)


def bytes_per_token(model: LlamaCausalLM) -> int:
    c = model.config
    return model.num_layers * 2 * c.num_kv_heads * c.head_dim * model.dtype.itemsize
