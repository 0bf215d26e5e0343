"""Distilling a small draft from a Llama-family target (what `pdspec train-draft` runs).

* Data: the target's own T = 1 samples (`generate_samples`), Magpie style when the tokenizer
  has a chat template (the target writes the user turn after the template's user prefix, then
  the answer), else from BOS; plus optional user text. For every position the target's next-token
  distribution is computed once, teacher-forced, and stored as top-k ids + renormalised probs
  (`Targets`), so training never runs the target and a resumed run reads the very same data.
* Draft (`init_draft`): the target's config with fewer layers, initialised as a copy of the
  target's first layers, embeddings, final norm and head (tied when the target's are).
* Loss (`kl_loss`): KL(target || draft) at every position, the target's law truncated to its top k.
* Output (`save_hf_draft`): a transformers-style safetensors directory that models/loader.py and
  transformers' AutoModelForCausalLM both load.

Training forwards use models/llama.py's module on dense [B, T] batches through `DenseCausal`,
a KV store that attends causally within each row and keeps nothing; generation runs the same
module over all rows in lockstep through `LockstepKv` (a dense cache: one forward a step for the
whole batch, the host out of the loop but for the drawn tokens).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.llama import LlamaCausalLM, LlamaConfig, LlamaForCausalLM, rope_inv_freq
from models.tokenizer import TextTokenizer

MAGPIE_PLACEHOLDER = "\x00MAGPIE\x00"  # stands for the message text when cutting the chat template


# ---------------------------------------------------------------------------------------
# Dense training forward
# ---------------------------------------------------------------------------------------


class DenseCausal:
    """A `KvStore` for B rows of T tokens each (flattened row-major): causal attention within
    each row, differentiable, nothing cached. Right padding is harmless: a real token never
    attends to a later position."""

    def __init__(self, batch: int, length: int, sliding_window: int | None) -> None:
        self.batch, self.length = batch, length
        self.mask = None
        if sliding_window is not None and length > sliding_window:
            query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
            self.mask = (key <= query) & (query - key < sliding_window)  # [T, T]

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        b, t = self.batch, self.length
        k, v = kv  # [B*T, Hkv, D] each
        q4 = q.view(b, t, *q.shape[1:]).transpose(1, 2)  # [B, Hq, T, D]
        k4 = k.view(b, t, *k.shape[1:]).transpose(1, 2)  # [B, Hkv, T, D]
        v4 = v.view(b, t, *v.shape[1:]).transpose(1, 2)
        mask = None if self.mask is None else self.mask.to(q.device)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)  # [B*T, Hq, D]


def dense_logits(module: LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] int64 -> logits [B, T, V] (the module's dtype), every position."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).repeat(b)  # [B*T]
    seq_lens = torch.full_like(positions, t)  # only dynamic-NTK RoPE reads it
    kv = DenseCausal(b, t, module.config.sliding_window)
    return module(tokens.reshape(-1), positions, kv, seq_lens=seq_lens).view(b, t, -1)


def pad_batch(sequences: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, T] int64 and the mask of real tokens [B, T] bool."""
    length = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), length, dtype=torch.int64)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.int64)
        mask[row, : len(seq)] = True
    return tokens.to(device), mask.to(device)


# ---------------------------------------------------------------------------------------
# Data: the target's generations and its per-position distributions
# ---------------------------------------------------------------------------------------


def magpie_prefix_suffix(tokenizer: TextTokenizer) -> tuple[list[int], list[int]] | None:
    """(ids that open a user turn, ids that close it and open the assistant's), cut from the
    chat template around a placeholder message; None without a template."""
    if not tokenizer.chat_template:
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": MAGPIE_PLACEHOLDER}])
    prefix, found, suffix = text.partition(MAGPIE_PLACEHOLDER)
    if not found:
        return None
    return tokenizer.encode(prefix), tokenizer.encode(suffix)


class LockstepKv:
    """A `KvStore` for B rows decoded in lockstep: every forward adds the same count n of new
    tokens to every row, at slots `length..length+n` of a [B, Hkv, S, D] cache per layer.
    Prompts are left-padded, so a row's real tokens are contiguous and end at the same slot as
    every other row's; `valid [B, S]` marks the slots that hold real tokens. A padding query
    attends to itself only (its output is never read; it keeps every row finite)."""

    def __init__(self, module: LlamaForCausalLM, batch: int, slots: int) -> None:
        c = module.config
        weight = module.lm_head.weight
        shape = (c.num_layers, batch, c.num_kv_heads, slots, c.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=weight.device)
        self.window = c.sliding_window
        self.length = 0  # slots written by the forwards that have ended
        self.mask: torch.Tensor | None = None  # [B, 1, n, length + n] for the forward in flight

    def begin(self, valid: torch.Tensor) -> None:
        """valid [B, n] bool: which of the n tokens the next forward adds are real."""
        end = self.length + valid.shape[1]
        self.valid[:, self.length : end] = valid
        slot = torch.arange(end, device=valid.device)
        query = slot[self.length :, None]  # [n, 1]
        causal = (slot[None, :] <= query) & (self.window is None or (query - slot[None, :] < self.window))
        mask = causal[None] & self.valid[:, None, :end]  # [B, n, end]
        self.mask = (mask | (slot[None, None, :] == query[None])).unsqueeze(1)  # [B, 1, n, end]

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        b, n = self.valid.shape[0], self.mask.shape[2]
        start, end = self.length, self.length + n
        k, v = kv  # [B*n, Hkv, D] each
        self.keys[layer, :, :, start:end] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
        self.values[layer, :, :, start:end] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
        q4 = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # [B, Hq, n, D]
        keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]  # [B, Hkv, end, D]
        out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)  # [B*n, Hq, D]

    def forward(self, module: LlamaForCausalLM, tokens: torch.Tensor, positions: torch.Tensor, valid) -> torch.Tensor:
        """tokens, positions [B, n] int64, valid [B, n] bool -> the logits after each row's last
        token [B, V] (the module's dtype)."""
        b, n = tokens.shape
        self.begin(valid)
        ends = torch.arange(1, b + 1, device=tokens.device) * n - 1
        flat = positions.reshape(-1)
        logits = module(tokens.reshape(-1), flat, self, logits_at=ends, seq_lens=flat + 1)
        self.length += n
        return logits


def _continue(
    module: LlamaForCausalLM, prompts: list[list[int]], max_new: int, stop: set[int], generator: torch.Generator
) -> list[list[int]]:
    """Sample (T = 1) up to `max_new` tokens after each prompt: the left-padded prompts in one
    forward, then one forward of every row per step (rows that ended keep stepping, unread, so
    the batch keeps its shape); a row ends after a stop id (kept in its output). One host read a
    step: the drawn tokens."""
    device = module.lm_head.weight.device
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        valid[row, width - len(prompt) :] = True
    tokens, valid = tokens.to(device), valid.to(device)
    positions = (valid.cumsum(1) - 1).clamp_min(0)  # [B, width]
    cache = LockstepKv(module, len(prompts), width + max_new)
    outputs: list[list[int]] = [[] for _ in prompts]
    live = set(range(len(prompts)))
    with torch.inference_mode():
        logits = cache.forward(module, tokens, positions, valid)  # [B, V]
        position = positions[:, -1:] + 1  # [B, 1]
        for step in range(max_new):
            drawn = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator)  # [B, 1]
            for row, token in enumerate(drawn[:, 0].tolist()):
                if row in live:
                    outputs[row].append(token)
                    if token in stop:
                        live.discard(row)
            if not live or step == max_new - 1:
                break
            logits = cache.forward(module, drawn, position, torch.ones_like(drawn, dtype=torch.bool))
            position = position + 1
    return outputs


def generate_samples(
    target: LlamaCausalLM,
    tokenizer: TextTokenizer,
    *,
    tokens: int,
    max_new_tokens: int,
    batch: int,
    seed: int,
    min_samples: int = 2,
) -> list[list[int]]:
    """Target generations (T = 1, seeded) until `tokens` generated tokens and `min_samples`
    sequences. With a chat template: the template's user-turn prefix, a sampled user turn (at
    most `max_new_tokens`), the template's turn switch, a sampled answer (at most
    `max_new_tokens`). Without one: `max_new_tokens` sampled after BOS (or after one uniformly
    drawn token when the model has no BOS). `target`: a Llama-family model of models/llama.py,
    its module run in lockstep over `batch` rows (`LockstepKv`); the draws run on its device."""
    device = torch.device(target.device)
    generator = torch.Generator(device=device).manual_seed(seed)
    stop = set(tokenizer.eos_token_ids) | set(target.eos_token_ids)
    template = magpie_prefix_suffix(tokenizer)
    bos = target.config.bos_token_id
    samples: list[list[int]] = []
    generated = 0
    while generated < tokens or len(samples) < min_samples:
        if template is not None:
            prefix, suffix = template
            users = _continue(target.module, [list(prefix) for _ in range(batch)], max_new_tokens, stop, generator)
            prompts = [[*prefix, *[t for t in user if t not in stop], *suffix] for user in users]
            answers = _continue(target.module, prompts, max_new_tokens, stop, generator)
            rows = [[*prompt, *answer] for prompt, answer in zip(prompts, answers, strict=True)]
            generated += sum(len(u) + len(a) for u, a in zip(users, answers, strict=True))
        else:
            starts = [
                [bos]
                if bos is not None
                else [int(torch.randint(target.vocab_size, (1,), generator=generator, device=device))]
                for _ in range(batch)
            ]
            continuations = _continue(target.module, starts, max_new_tokens, stop, generator)
            rows = [[*start, *cont] for start, cont in zip(starts, continuations, strict=True)]
            generated += sum(len(c) for c in continuations)
        samples += rows
    return samples


def text_samples(tokenizer: TextTokenizer, text: str, *, max_length: int, bos: int | None) -> list[list[int]]:
    """User text as training sequences: one document per non-empty line, each cut into pieces
    of at most `max_length` tokens (BOS first when the model has one)."""
    pieces = []
    step = max_length - (bos is not None)
    for line in text.splitlines():
        ids = tokenizer.encode(line.strip())
        for start in range(0, len(ids), step):
            pieces.append(([bos] if bos is not None else []) + ids[start : start + step])
    return [p for p in pieces if len(p) > 1]


@dataclass
class Targets:
    """One sequence and the target's next-token law at each of its positions: `ids [T, k]`
    and `probs [T, k]` (top k, renormalised; k = V and ids = arange(V) for the full law)."""

    tokens: list[int]
    ids: torch.Tensor
    probs: torch.Tensor


def target_distributions(
    module: LlamaForCausalLM, sequences: Sequence[list[int]], *, top_k: int, batch: int
) -> list[Targets]:
    """The target's T = 1 next-token distribution at every position of every sequence,
    teacher-forced, batch rows at a time; stored on the CPU in float32."""
    device = module.lm_head.weight.device
    out = []
    for start in range(0, len(sequences), batch):
        chunk = sequences[start : start + batch]
        tokens, _ = pad_batch(chunk, device)
        with torch.inference_mode():
            probs = torch.softmax(dense_logits(module, tokens).float(), dim=-1)  # [B, T, V]
            if top_k and top_k < probs.shape[-1]:  # on the device: the full law never crosses to the host
                probs, ids = probs.topk(top_k, dim=-1)  # [B, T, k], sorted: column 0 is the argmax
                probs = probs / probs.sum(-1, keepdim=True)
            else:
                ids = torch.arange(probs.shape[-1], device=device).expand_as(probs)
            probs, ids = probs.cpu(), ids.to(torch.int32).cpu()  # one copy a batch
        for row, seq in enumerate(chunk):
            out.append(Targets(list(seq), ids[row, : len(seq)].contiguous(), probs[row, : len(seq)].contiguous()))
    return out


def collate(items: Sequence[Targets], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T], mask [B, T], target ids [B, T, k] int64, target probs [B, T, k] (0 on padding)."""
    tokens, mask = pad_batch([item.tokens for item in items], device)
    b, t = tokens.shape
    k = items[0].ids.shape[-1]
    ids = torch.zeros(b, t, k, dtype=torch.int64)
    probs = torch.zeros(b, t, k)
    for row, item in enumerate(items):
        ids[row, : len(item.tokens)] = item.ids
        probs[row, : len(item.tokens)] = item.probs
    return tokens, mask, ids.to(device), probs.to(device)


# ---------------------------------------------------------------------------------------
# The draft, its loss and its output directory
# ---------------------------------------------------------------------------------------


def init_draft(target: LlamaForCausalLM, layers: int, *, train_embeddings: bool = False) -> LlamaForCausalLM:
    """A float32 draft: the target's config with its first `layers` decoder layers, embeddings,
    final norm and head, copied. It starts as the layer-skip draft of `--draft-layers N`: on
    SmolLM2-135M with 2 layers (a few hundred generated tokens) that start had a KL of 16 nats
    and 5% top-1 agreement, the evenly spaced layers 0 and 29 had 58 nats and 0% (the last
    layer's output does not fit the first's input).

    Unless `train_embeddings`, the embeddings and the head stay the target's (frozen, as
    EAGLE and Medusa keep them): the draft learns to reach the target's last hidden state in
    its few layers. On a small model the vocabulary matrices are most of the weights (28 of
    35M on SmolLM2 with 2 layers); training them on a few hundred thousand tokens mostly
    overfits, and with a tied head it would move the inputs too."""
    from dataclasses import replace

    if not 1 <= layers <= target.config.num_layers:
        raise ValueError(f"layers: expected 1..{target.config.num_layers} (the target's layer count), got {layers}")
    config = replace(target.config, num_layers=layers)
    draft = LlamaForCausalLM(config)
    kept = {
        name: tensor.detach().float().clone()
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    draft.load_state_dict(kept)
    draft.inv_freq = rope_inv_freq(config)
    if not train_embeddings:
        draft.model.embed_tokens.weight.requires_grad_(False)
        draft.lm_head.weight.requires_grad_(False)
    return draft.to(target.lm_head.weight.device)


def kl_loss(logits: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over real positions of KL(p || q): p the target's (truncated, renormalised) law
    [B, T, k] over `ids`, q the draft's softmax of logits [B, T, V] over the whole vocabulary."""
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)  # [B, T, k]
    log_p = torch.where(probs > 0, probs, torch.ones_like(probs)).log()  # 0 log 0 = 0
    per_position = (probs * (log_p - log_q)).sum(-1)  # [B, T]
    return per_position[mask].mean()


def mixed_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a GPU (float32 master weights, the loss in float32), nothing on the CPU."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def top1_agreement(module: LlamaForCausalLM, items: Sequence[Targets], batch: int) -> float:
    """Fraction of positions where the draft's argmax is the target's."""
    device = module.lm_head.weight.device
    hits = total = 0
    for start in range(0, len(items), batch):
        tokens, mask, ids, probs = collate(items[start : start + batch], device)
        with torch.inference_mode(), mixed_precision(device):
            logits = dense_logits(module, tokens)  # [B, T, V]
        target_top = ids.gather(-1, probs.argmax(-1, keepdim=True))[..., 0]  # [B, T]
        hits += int(((logits.argmax(-1) == target_top) & mask).sum())
        total += int(mask.sum())
    return hits / max(total, 1)


def hf_config_dict(config: LlamaConfig) -> dict:
    """A transformers config.json for this config (the inverse of LlamaConfig.from_hf)."""
    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    out = {
        "architectures": [architectures[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        "torch_dtype": "float32",
    }
    if config.rope_type != "default":
        out["rope_scaling"] = {"rope_type": config.rope_type, "factor": config.rope_factor}
        if config.rope_type == "llama3":
            out["rope_scaling"] |= {
                "low_freq_factor": config.rope_low_freq_factor,
                "high_freq_factor": config.rope_high_freq_factor,
                "original_max_position_embeddings": config.rope_original_max_positions,
            }
    if config.model_type == "llama":
        out |= {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
    if config.model_type == "mistral":
        out["sliding_window"] = config.sliding_window
    return out


def save_hf_draft(module: LlamaForCausalLM, tokenizer: TextTokenizer, out: Path) -> None:
    """config.json, model.safetensors (float32, transformers' names) and the target's tokenizer."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = module.state_dict()
    if module.config.tie_word_embeddings:  # one tensor stored once; loaders tie the head to it
        state.pop("lm_head.weight", None)
    save_file({name: t.detach().float().cpu().contiguous() for name, t in state.items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf_config_dict(module.config), indent=2) + "\n")
    tokenizer.tokenizer.save_pretrained(out)


def draft_vocabulary(sequences: Sequence[list[int]], size: int, vocab_size: int, always: Sequence[int]) -> torch.Tensor:
    """The `size` ids a reduced draft head keeps (EAGLE-3's draft vocabulary): `always` (the
    stop ids) and the most frequent ids of the target's generations (ties by id), ascending."""
    tokens = torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64)
    counts = torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    chosen = list(dict.fromkeys(always))[:size]
    taken = set(chosen)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    chosen += [i for i in order if i not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def save_d2t(head_ids: torch.Tensor, out: Path) -> None:
    """`d2t.json` beside the weights: draft id i proposes target id head_ids[i]. The loaders
    then keep only those rows of the head (models/llama.restrict_head); transformers ignores it."""
    import json

    (out / "d2t.json").write_text(json.dumps({"format": "absolute", "d2t": head_ids.tolist()}) + "\n")


# ---------------------------------------------------------------------------------------
# Acceptance estimates on held-out target generations
# ---------------------------------------------------------------------------------------


def acceptance(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    sequences: Sequence[list[int]],
    *,
    k: int = 4,
    temperature: float = 0.7,
    batch: int = 8,
    head_ids: torch.Tensor | None = None,
) -> dict:
    """Teacher-forced acceptance estimates along held-out sequences, for a step starting at
    every position s with K = k drafts. Greedy: draft i is accepted iff the draft's argmax
    equals the target's at positions s..s+i (the top-1 agreement chain). Stochastic at
    `temperature`: draft i is accepted with probability prod_{j<=i} sum_v min(p, q) at s+j, p and
    q the draft's and target's tempered laws. Rates are averaged over the starts that have
    k positions ahead; `per_position[i]` is the rate of accepting draft i. `head_ids`: the
    draft as served with a reduced head (`draft_vocabulary`), its law over those ids only."""
    device = target.lm_head.weight.device
    greedy_sum = torch.zeros(k, dtype=torch.float64)
    stochastic_sum = torch.zeros(k, dtype=torch.float64)
    starts = 0
    for begin in range(0, len(sequences), batch):
        chunk = sequences[begin : begin + batch]
        tokens, _ = pad_batch(chunk, device)
        with torch.inference_mode():
            q_logits = dense_logits(target, tokens).float()  # [B, T, V]
            p_logits = dense_logits(draft, tokens).float()
            if head_ids is not None:  # the served draft proposes these ids only
                outside = torch.ones(p_logits.shape[-1], dtype=torch.bool, device=device)
                outside[head_ids.to(device)] = False
                p_logits = p_logits.masked_fill(outside, float("-inf"))
        agree = (q_logits.argmax(-1) == p_logits.argmax(-1)).double()  # [B, T]
        overlap = (
            torch.minimum(torch.softmax(q_logits / temperature, -1), torch.softmax(p_logits / temperature, -1))
            .sum(-1)
            .double()
        )  # [B, T]
        for row, seq in enumerate(chunk):
            n = len(seq) - k + 1  # starts with k positions ahead
            if n <= 0:
                continue
            greedy_chain = torch.stack([agree[row, i : i + n] for i in range(k)]).cumprod(0)  # [k, n]
            stochastic_chain = torch.stack([overlap[row, i : i + n] for i in range(k)]).cumprod(0)
            greedy_sum += greedy_chain.sum(1).cpu()
            stochastic_sum += stochastic_chain.sum(1).cpu()
            starts += n
    if starts == 0:
        raise ValueError(f"sequences: expected at least one held-out sequence of {k} tokens, got none")
    greedy = (greedy_sum / starts).tolist()
    stochastic = (stochastic_sum / starts).tolist()
    return {
        "k": k,
        "temperature": temperature,
        "starts": starts,
        "greedy": {"per_position": greedy, "expected_accepted": math.fsum(greedy)},
        "stochastic": {"per_position": stochastic, "expected_accepted": math.fsum(stochastic)},
    }


# ---------------------------------------------------------------------------------------
# Training with checkpoints
# ---------------------------------------------------------------------------------------


PROGRESS_HELD_OUT = 64  # held-out sequences behind each progress line's agreement


class CheckpointMismatch(ValueError):
    """A checkpoint to resume from was made with other training settings."""


@dataclass(frozen=True)
class TrainSettings:
    """What fixes a run's trajectory; a resumed run must have the same."""

    steps: int
    batch: int
    lr: float
    seed: int
    layers: int
    train_embeddings: bool = False


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to a tenth: a function of
    the step alone, so a resumed run needs no scheduler state."""
    warmup = max(1, settings.steps // 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def batch_indices(step: int, batch: int, count: int, seed: int) -> list[int]:
    """The items of a step: the data order is one seeded permutation per epoch, concatenated,
    a function of (seed, step) alone so a resumed run sees the same batches."""
    indices = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(position, count)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        indices.append(int(order[offset]))
    return indices


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / "checkpoints" / f"step-{step:08d}.pt"


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted((directory / "checkpoints").glob("step-*.pt"))
    return found[-1] if found else None


KEEP_CHECKPOINTS = 2  # the newest two: a later look can still go one save back


def save_checkpoint(directory: Path, step: int, draft, optimizer, settings: TrainSettings, losses) -> None:
    path = checkpoint_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")  # renamed when complete: a killed save leaves no checkpoint behind
    state = {
        "step": step,
        "model": draft.state_dict(),
        "optimizer": optimizer.state_dict(),
        "settings": settings.__dict__,
        "losses": list(losses),
    }
    torch.save(state, partial)
    partial.replace(path)
    for old in sorted(path.parent.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
        old.unlink()


def make_optimizer(draft: LlamaForCausalLM, settings: TrainSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=settings.lr, weight_decay=0.01)


def train(
    draft: LlamaForCausalLM,
    train_items: Sequence[Targets],
    held_out: Sequence[Targets],
    settings: TrainSettings,
    directory: Path,
    *,
    resume: Path | None = None,
    save_every: int = 100,
    log_every: int = 10,
    log=print,
) -> list[float]:
    """AdamW on `kl_loss` for `settings.steps` steps; a checkpoint (weights, optimizer state,
    losses) every `save_every` steps and at the end; from `resume` (a checkpoint) on when given.
    `log` gets a line every `log_every` steps: step, mean loss since the last line, learning
    rate, held-out top-1 agreement. Returns the loss of every step from 0."""
    device = draft.lm_head.weight.device
    optimizer = make_optimizer(draft, settings)
    step, losses = 0, []
    if resume is not None:
        state = torch.load(resume, map_location=device, weights_only=True)
        if state["settings"] != settings.__dict__:
            raise CheckpointMismatch(
                f"resume: expected a checkpoint of {settings.__dict__}, got {state['settings']} ({resume})"
            )
        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], list(state["losses"])
    probe = held_out[:PROGRESS_HELD_OUT]  # the progress lines' agreement: a fixed, bounded sample
    draft.train()
    started, first_step, tokens_seen = time.perf_counter(), step, 0
    while step < settings.steps:
        items = [train_items[i] for i in batch_indices(step, settings.batch, len(train_items), settings.seed)]
        tokens, mask, ids, probs = collate(items, device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        with mixed_precision(device):
            logits = dense_logits(draft, tokens)  # [B, T, V]
        loss = kl_loss(logits, mask, ids, probs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        tokens_seen += int(mask.sum())
        step += 1
        if step % log_every == 0 or step == settings.steps:
            recent = losses[-log_every:]
            agreement = top1_agreement(draft, probe, settings.batch)
            elapsed = time.perf_counter() - started
            eta = elapsed / (step - first_step) * (settings.steps - step)
            log(
                f"step {step}/{settings.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"lr {lr_at(step - 1, settings):.2e}  held-out top-1 agreement {agreement:.3f}  "
                f"{tokens_seen / elapsed:,.0f} tokens/s  eta {eta:.0f} s"
            )
        if step % save_every == 0 or step == settings.steps:
            save_checkpoint(directory, step, draft, optimizer, settings, losses)
    draft.eval()
    return losses
