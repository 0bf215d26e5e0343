"""Weights for models/llama.py: a local HF directory (safetensors) or a single .gguf file.

* HF directory: `config.json` + `model.safetensors`, or shards listed by
  `model.safetensors.index.json`; tensors keep transformers' names, cast to the target dtype.
* GGUF (`gguf.GGUFReader`): metadata -> LlamaConfig (`llama` and `qwen2` architectures),
  tensors dequantized with `gguf.quants.dequantize` (any type it knows: F32, F16, Q8_0, Q4_0,
  Q4_1, K-quants...) and renamed to transformers' names. llama.cpp's converter permutes the
  rows of attn_q/attn_k for the `llama` architecture (its RoPE pairs adjacent dims, HF's pairs
  the two halves); that permutation is undone here so the rotate-half RoPE applies.
  The tokenizer comes from transformers' own GGUF conversion (a fast tokenizer).

The digest that enters the model name (and so the contract fingerprint) is read from the
files cheaply: config.json bytes plus each weight file's name, size and safetensors header;
for GGUF, its size and the first and last 8 MiB (metadata and the tail tensors), so loading a
multi-GB file does not mean hashing all of it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import torch

from common.cache import cache_dir, publish_dir
from models.llama import LlamaCausalLM, LlamaConfig, build_model, digest_of
from models.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2")
_DIGEST_WINDOW = 8 << 20


# --------------------------------------------------------------------------- HF directory


def hf_config(path: Path) -> dict:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model: expected a local checkpoint directory with config.json, got {path}")
    return json.loads(config_path.read_text())


def is_llama_family(config: dict) -> bool:
    """True when models/llama.py implements this checkpoint (else the transformers fallback)."""
    try:
        LlamaConfig.from_hf(config)
    except ValueError:
        return False
    return True


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"weight_map: expected a non-empty mapping in {index}, got {weight_map!r}")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights: expected model.safetensors or model.safetensors.index.json in {path}, got none")
    for file in files:
        if not file.is_file():
            raise ValueError(f"weights: expected shard {file.name} (listed in the index) in {path}, got none")
    return files


def _safetensors_header(file: Path) -> bytes:
    with file.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return handle.read(min(size, 1 << 24))


def load_hf_llama(path: Path | str, *, dtype: torch.dtype, device: str = "cpu") -> LlamaCausalLM:
    from safetensors.torch import load_file

    path = Path(path)
    raw = hf_config(path)
    config = LlamaConfig.from_hf(raw)
    files = safetensors_files(path)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(file))
    parts: list[bytes | str] = [(path / "config.json").read_bytes()]
    for file in files:
        parts += [file.name, str(file.stat().st_size), _safetensors_header(file)]
    module = build_model(config, state_dict, dtype=dtype, device=device)
    return LlamaCausalLM(module, source_digest=digest_of(*parts))


# --------------------------------------------------------------------------- GGUF


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"general.architecture: expected one of {GGUF_ARCHITECTURES}, got {arch!r}")

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{arch}.{key}: expected in the GGUF metadata, got none")
        return value

    tensors = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensors:  # Llama 3.1 llama.cpp files carry precomputed frequency factors
        raise ValueError("rope_freqs.weight: expected no RoPE frequency-factor tensor (unsupported), got one")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(need("vocab_size"))
    rope_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type: expected 'none' or 'linear', got {rope_type!r}")
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        model_type=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim or hidden // heads),
        intermediate_size=int(need("feed_forward_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_type="linear" if rope_type == "linear" else "default",
        rope_factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    match = _BLOCK_NAME.fullmatch(name)
    if match is None or match.group(2) not in _GGUF_BLOCK:
        raise ValueError(f"tensor name: expected token_embd/output/output_norm or blk.N.<known>, got {name!r}")
    return f"model.layers.{match.group(1)}.{_GGUF_BLOCK[match.group(2)]}.{match.group(3)}"


def unpermute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` (reshape(heads, 2, d/2, ...).swapaxes(1, 2)) on the
    output rows of attn_q (heads = attention heads) or attn_k (heads = kv heads)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_state_dict(reader, config: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state_dict = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)  # float32, numpy order (rows, cols)
        weights = weights.reshape([int(d) for d in reversed(tensor.shape)])
        if config.model_type == "llama" and ".attn_q." in tensor.name:
            weights = unpermute_qk(weights, config.num_heads)
        elif config.model_type == "llama" and ".attn_k." in tensor.name:
            weights = unpermute_qk(weights, config.num_kv_heads)
        if not weights.flags.writeable:  # F32/F16 tensors are views of the read-only memory map
            weights = weights.copy()
        state_dict[gguf_to_hf_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)
    return state_dict


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(_DIGEST_WINDOW)
        handle.seek(max(0, size - _DIGEST_WINDOW))
        tail = handle.read(_DIGEST_WINDOW)
    return digest_of(str(size), head, tail)


def load_gguf_llama(path: Path | str, *, dtype: torch.dtype, device: str = "cpu") -> LlamaCausalLM:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file() or path.suffix != ".gguf":
        raise ValueError(f"model: expected a .gguf file, got {path}")
    reader = GGUFReader(path)
    config = gguf_config(reader)
    module = build_model(config, gguf_state_dict(reader, config, dtype), dtype=dtype, device=device)
    return LlamaCausalLM(module, source_digest=_file_digest(path))


def load_gguf_tokenizer(path: Path | str, eos_token_ids=(), cache: Path | None = None) -> TextTokenizer:
    """transformers' conversion of the GGUF vocabulary (tokenizer.ggml.*) to a fast tokenizer;
    the chat template comes along from `tokenizer.chat_template`. The conversion parses the
    whole vocabulary out of the file (about 10 s for SmolLM2's 49k tokens on one core, at every
    node start), so its result is saved in the cache (`cache`, else common/cache.cache_dir()),
    keyed by the file's digest, and loaded from there afterwards (a fraction of a second)."""
    from transformers import AutoTokenizer

    path = Path(path)
    cached = (cache or cache_dir()) / f"tokenizer-{_file_digest(path)[:20]}"
    if (cached / "tokenizer.json").is_file():
        return TextTokenizer(AutoTokenizer.from_pretrained(cached), eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        tokenizer.save_pretrained(tmp)
        publish_dir(tmp, cached)
    except OSError as err:  # a read-only cache costs the next start the conversion, nothing else
        log.warning("tokenizer cache %s not written: %s", cached, err)
    return TextTokenizer(tokenizer, eos_token_ids)
