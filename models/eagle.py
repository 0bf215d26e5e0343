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

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

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

    def draft_step(
        self, states: Sequence[State], tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted position per row, its inputs already on the device (no host read between
        depths): tokens [M] int64 target ids, hidden [M, H] the head's previous outputs ->
        float32 logits [M, Vd], output hidden [M, H]. The positions go into the KV only (the
        states' tokens and `last` stay the committed ones): `truncate` to the committed length
        drops them."""
        with torch.inference_mode():
            logits, out = self._forward(states, [1] * len(states), tokens, hidden.to(self.dtype))
        return logits.float(), out

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
        """The head over tokens alone, zero hidden inputs: what a depth costs (adaptive K's
        calibration, engine/adaptive.py), never a draft."""
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
