"""HF transformers causal LMs from local directories (optional extra `[hf]`).

The target's KV cache travels: `export_state` gives 2 x num_layers tensors [kv_heads, seq,
head_dim] in the model's dtype (batch dimension dropped); an import writes them into
fresh layer tensors and builds a DynamicCache of those, so the decode node never recomputes
the prompt. Truncation slices the cache (version-independent: it rebuilds the DynamicCache
rather than relying on the `crop` signature, which changed between transformers releases).

Draft vocabularies (`load_hf_pair`):
* a d2t file beside the draft (`d2t.json`: {"format": "absolute"|"offset", "d2t": [...]}):
  EAGLE-3-style reduced heads; an offset map (target = draft + d2t[draft]) is converted to
  absolute once. Such a draft reads target ids (it shares the target's input vocabulary).
* otherwise the two tokenizers' vocabularies are intersected by token string: a draft
  token with no target twin is masked (its logit is -inf, so it is never proposed, and it
  maps to target id 0 with no mass); the draft reads target ids translated to its own
  (a target token the draft lacks becomes the draft's unk/0 id: it only costs acceptance).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from models.base import ChunkedImport, GrowingKv, State, TreeSpan, close_span, end_import
from models.kv_import import KvWriter
from models.pair import ModelPair
from models.tokenizer import TextTokenizer
from protos.kv_layout import layer_kv_layout, layout_order
from sampling import DraftToTargetMap


class HFCausalLM(ChunkedImport, GrowingKv):
    def __init__(
        self,
        path: Path | str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        output_mask: torch.Tensor | None = None,
        input_map: torch.Tensor | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model: expected a local checkpoint directory with config.json, got {path}")
        self.path = path
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        eos = config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.name = f"hf:{path.name}:{_checkpoint_digest(path)}"
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_layout = layer_kv_layout(config.num_hidden_layers, heads, head_dim, dtype)
        self.output_mask = output_mask  # [V] bool: False = never proposed
        self.input_map = input_map  # [Vt] int64: target id -> this model's id
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )

    def _forward(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        tokens = torch.tensor([list(ids)], dtype=torch.int64, device=self.device)
        if self.input_map is not None:
            tokens = self.input_map.to(self.device)[tokens]
        with torch.no_grad():
            out = self.model(input_ids=tokens, use_cache=True, **{self._cache_kwarg: state.kv})
        state.kv = out.past_key_values
        state.tokens += [int(t) for t in ids]
        logits = out.logits[0].float()  # [len, V]
        if self.output_mask is not None:
            logits = logits.masked_fill(~self.output_mask.to(logits.device), float("-inf"))
        return logits

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, State]:
        if not ids:
            raise ValueError("ids: expected a non-empty prompt, got []")
        from transformers import DynamicCache

        state = State(tokens=[], kv=DynamicCache())
        return self._forward(state, ids)[-1], state

    def extend(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        if not ids:
            return torch.empty(0, self.vocab_size)
        return self._forward(state, ids)

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One forward for all requests: caches right-padded to the longest, new tokens
        right-padded too, an attention mask hiding both paddings and explicit positions;
        the result is split back into one unpadded cache per request."""
        out = [torch.empty(0, self.vocab_size) for _ in states]
        live = [i for i, new in enumerate(ids) if len(new)]
        if len(live) <= 1 or any(not states[i].tokens for i in live):  # a fresh cache has no layers to pad
            for i in live:
                out[i] = self.extend(states[i], ids[i])
            return out
        past = [len(states[i].tokens) for i in live]
        new = [list(ids[i]) for i in live]
        width_past, width_new = max(past), max(len(n) for n in new)
        tokens = torch.zeros(len(live), width_new, dtype=torch.int64)
        mask = torch.zeros(len(live), width_past + width_new, dtype=torch.int64)
        positions = torch.zeros(len(live), width_new, dtype=torch.int64)
        for row, (length, row_new) in enumerate(zip(past, new, strict=True)):
            tokens[row, : len(row_new)] = torch.tensor(row_new)
            mask[row, :length] = 1
            mask[row, width_past : width_past + len(row_new)] = 1
            positions[row] = length + torch.arange(width_new)
        if self.input_map is not None:
            tokens = self.input_map[tokens]
        layers = [
            tuple(
                torch.cat([torch.nn.functional.pad(t, (0, 0, 0, width_past - t.shape[2])) for t in column])
                for column in zip(*(pair_of_layer[n] for pair_of_layer in batch_layers), strict=True)
            )
            for n, batch_layers in [(n, [_layers(states[i].kv) for i in live]) for n in range(len(self.kv_layout) // 2)]
        ]
        with torch.no_grad():
            result = self.model(
                input_ids=tokens.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **{self._cache_kwarg: _cache_from(layers)},
            )
        logits = result.logits.float()  # [R, width_new, V]
        if self.output_mask is not None:
            logits = logits.masked_fill(~self.output_mask.to(logits.device), float("-inf"))
        batched = _layers(result.past_key_values)
        for row, i in enumerate(live):
            keep = torch.cat([torch.arange(past[row]), width_past + torch.arange(len(new[row]))]).to(self.device)
            states[i].kv = _cache_from([(k[row : row + 1, :, keep], v[row : row + 1, :, keep]) for k, v in batched])
            states[i].tokens += new[row]
            out[i] = logits[row, : len(new[row])]
        return out

    # transformers' caches hold one linear history per row: only chain-shaped "trees" (one
    # candidate per node) are verified here; the nodes draft chains for this backend.
    supports_trees = False

    def extend_tree(
        self, states: Sequence[State], ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        for state, row, row_parents in zip(states, ids, parents, strict=True):
            start = len(state.tree.parents) if state.tree is not None else 0
            if list(row_parents) != list(range(start - 1, start - 1 + len(row))):
                raise ValueError(f"parents: expected a chain (the transformers backend), got {list(row_parents)}")
            if state.tree is None:
                state.tree = TreeSpan(base=len(state.tokens))
            state.tree.add(row_parents)
        return self.extend_batch(states, ids)

    def accept_tree(self, state: State, keep: Sequence[int]) -> None:
        close_span(state, keep)  # a chain's path moves nothing
        length = len(state.tokens)
        state.kv = _cache_from([(k[:, :, :length], v[:, :, :length]) for k, v in _layers(state.kv)])

    def empty_state(self) -> State:
        from transformers import DynamicCache

        return State(tokens=[], kv=DynamicCache())

    def truncate(self, state: State, length: int) -> None:
        if not 0 <= length <= len(state.tokens):
            raise ValueError(f"length: expected 0..{len(state.tokens)}, got {length}")
        if length < len(state.tokens):
            state.kv = _cache_from([(k[:, :, :length], v[:, :, :length]) for k, v in _layers(state.kv)])
            del state.tokens[length:]

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        live = [t[0] for t in layout_order(_layers(state.kv))]  # [heads, seq, head_dim] each
        return live if out is None else [o.copy_(t) for o, t in zip(out, live, strict=True)]

    def begin_import(self, tokens: Sequence[int], reserve: int) -> State:
        seq = len(tokens)  # the cache grows by concatenation: nothing to reserve beyond the prompt
        tensors = [
            torch.empty(spec.shape_for(seq), dtype=spec.dtype, device=self.device)[None] for spec in self.kv_layout
        ]
        writer = KvWriter(self.kv_layout, seq, [t[0].transpose(0, 1) for t in tensors], torch.arange(seq))
        return State(tokens=list(tokens), kv=tensors, importing=writer)  # kv: the layer tensors until finished

    def finish_import(self, state: State) -> None:
        end_import(state)
        tensors = state.kv
        state.kv = _cache_from([(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)])


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _cache_from(layers):
    from transformers import DynamicCache

    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def _checkpoint_digest(path: Path) -> str:
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        digest.update(weights.name.encode())
        digest.update(str(weights.stat().st_size).encode())
    return digest.hexdigest()[:12]


def read_d2t_length(path: Path) -> int:
    """How many draft ids `d2t.json` maps (its list's length)."""
    spec = json.loads(path.read_text())
    if not isinstance(spec.get("d2t"), list):
        raise ValueError(f"d2t: expected a list under 'd2t' in {path}, got {type(spec.get('d2t')).__name__}")
    return len(spec["d2t"])


def load_d2t_file(path: Path, draft_vocab: int, target_vocab: int) -> torch.Tensor:
    """An absolute d2t map from `d2t.json`, converting an offset map once."""
    spec = json.loads(path.read_text())
    if spec.get("format") not in ("absolute", "offset"):
        raise ValueError(f"d2t format: expected 'absolute' or 'offset', got {spec.get('format')!r} in {path}")
    d2t = torch.tensor(spec["d2t"], dtype=torch.int64)
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"d2t: expected {draft_vocab} entries (draft vocab), got {list(d2t.shape)} in {path}")
    if spec["format"] == "offset":
        d2t = torch.arange(draft_vocab) + d2t
    DraftToTargetMap(d2t, target_vocab)  # raises ValueError naming the bad entry
    return d2t


def vocab_intersection(
    target_vocab: dict[str, int], draft_vocab: dict[str, int], target_size: int, draft_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d2t [Vd], draft output mask [Vd], target->draft input map [Vt]) by token string."""
    d2t = torch.zeros(draft_size, dtype=torch.int64)
    mask = torch.zeros(draft_size, dtype=torch.bool)
    t2d = torch.zeros(target_size, dtype=torch.int64)
    for token, draft_id in draft_vocab.items():
        target_id = target_vocab.get(token)
        if target_id is not None and draft_id < draft_size and target_id < target_size:
            d2t[draft_id], mask[draft_id], t2d[target_id] = target_id, True, draft_id
    if not mask.any():
        raise ValueError("vocabularies: expected the draft and target tokenizers to share tokens, got none")
    return d2t, mask, t2d


def load_hf_pair(
    target_dir: Path | str, draft_dir: Path | str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> ModelPair:
    from transformers import AutoTokenizer

    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    target = HFCausalLM(target_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    draft_config = (
        json.loads((draft_dir / "config.json").read_text()) if (draft_dir / "config.json").is_file() else None
    )
    if draft_config is None:
        raise ValueError(f"draft: expected a local checkpoint directory with config.json, got {draft_dir}")
    draft_vocab = int(draft_config["vocab_size"])
    if (draft_dir / "d2t.json").is_file():
        d2t = load_d2t_file(draft_dir / "d2t.json", draft_vocab, target.vocab_size)
        draft = HFCausalLM(draft_dir, dtype=dtype, device=device)
    else:
        draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir)
        d2t, mask, t2d = vocab_intersection(
            tokenizer.get_vocab(), draft_tokenizer.get_vocab(), target.vocab_size, draft_vocab
        )
        draft = HFCausalLM(draft_dir, dtype=dtype, device=device, output_mask=mask, input_map=t2d)
    return ModelPair(
        target, draft, DraftToTargetMap(d2t, target.vocab_size), TextTokenizer(tokenizer, target.eos_token_ids)
    )
