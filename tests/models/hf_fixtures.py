"""Tiny random-weight Llama checkpoints and tokenizers, made locally (no hub access)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

WORDS = [
    *[
        "the",
        "cat",
        "sat",
        "on",
        "the",
        "mat",
        "while",
        "a",
        "dog",
        "ran",
        "past",
        "the",
        "old",
        "red",
        "door",
        "and",
        "the",
        "bird",
        "sang",
        "in",
        "the",
        "tree",
    ],
    *[
        "def",
        "return",
        "import",
        "class",
        "for",
        "while",
        "if",
        "else",
        "print",
        "value",
        "key",
        "self",
        "data",
        "list",
    ],
]

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# The Llama-family variants pdspec's own Llama code is checked on (tests/models/test_llama.py against
# transformers, tests/models/test_conformance.py as a model backend): name -> (model_type, overrides
# of make_family_checkpoint). Each rope type, Qwen2 with qkv bias, Mistral with a sliding window,
# tied and untied heads.
FAMILY_CASES = {
    "llama-untied": ("llama", {}),
    "llama-llama3-tied": (
        "llama",
        {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 32}, "tie_word_embeddings": True},
    ),
    "llama-linear-bias": (
        "llama",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True, "mlp_bias": True},
    ),
    # max_position_embeddings 32 < a 64-token sequence: the NTK base grows with the length
    "llama-dynamic": (
        "llama",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 32},
    ),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
}


def make_tokenizer(directory: Path, words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1}
    for word in words:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def make_pair_dirs(root: Path, *, draft_kind: str) -> tuple[Path, Path]:
    """A target with the full word vocabulary and a draft that either shares its input
    vocabulary with a reduced head + d2t.json ("d2t"), or has its own smaller tokenizer
    ("intersection")."""
    target_words = WORDS
    target = make_llama(root / "target", len(set(target_words)) + 2, seed=1, words=target_words)
    if draft_kind == "d2t":
        # A draft that reads target ids (EAGLE-style) with a d2t.json in offset form
        # (target id = draft id + d2t[draft id]); here a non-identity permutation.
        vocab = len(set(target_words)) + 2
        draft = make_llama(root / "draft", vocab, seed=2, layers=1)
        absolute = list(reversed(range(vocab)))
        (draft / "d2t.json").write_text(
            json.dumps({"format": "offset", "d2t": [t - d for d, t in enumerate(absolute)]})
        )
    else:
        draft_words = [*sorted(set(target_words))[::2], "zebra", "quokka"]  # a subset plus draft-only words
        draft = make_llama(root / "draft", len(set(draft_words)) + 2, seed=2, layers=1, words=draft_words)
    return target, draft


def make_family_checkpoint(
    directory: Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    layers: int = 2,
    vocab_size: int = 96,
    hidden: int = 64,
    max_shard_size: str | None = None,
    head_scale: float = 8.0,
    init: Callable[[torch.nn.Module], None] | None = None,
    words: list[str] | None = None,
    **overrides,
) -> Path:
    """The one builder of tiny random checkpoints (safetensors): a Llama / Qwen2 / Mistral with
    `overrides` on its transformers config (rope_scaling, tie_word_embeddings, attention_bias,
    sliding_window, eos_token_id...), seeded. Weights: transformers' init with the output head
    scaled by `head_scale` and zero-initialized biases drawn N(0, 0.1), or `init(model)` instead
    when given. `words`: a word-level tokenizer saved beside it (make_tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    directory.mkdir(parents=True, exist_ok=True)
    if words is not None:
        make_tokenizer(directory, words)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **{
            "max_position_embeddings": 256,
            "eos_token_id": 1,
            "bos_token_id": 0,
            "tie_word_embeddings": False,
            **overrides,
        },
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        if init is not None:
            init(model)
        else:  # sharper than the default init, so greedy continuations are not near-ties
            model.get_output_embeddings().weight.mul_(head_scale)
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)  # zero-initialized by default: make the bias path visible
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def make_llama(
    directory: Path, vocab_size: int, *, seed: int, layers: int = 2, hidden: int = 32, words: list[str] | None = None
) -> Path:
    """A tiny Llama with a sharper head (x20: sampling is not flat), for the pair tests."""
    return make_family_checkpoint(
        directory, seed=seed, layers=layers, vocab_size=vocab_size, hidden=hidden, head_scale=20, words=words
    )
