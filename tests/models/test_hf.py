"""HF transformers backend on tiny random-weight Llama checkpoints built here."""

import json

import pytest
import torch

from engine.spec_config import SpeculativeConfig
from models.hf import HFCausalLM, load_d2t_file, load_hf_pair
from models.loader import load_pair
from tests.models.hf_fixtures import make_pair_dirs

# Needs the [hf] extra (installed by `make test` through the dev extra; optional for users).
pytest.importorskip("transformers", reason="the [hf] extra is not installed")


@pytest.fixture(scope="module", params=["d2t", "intersection"])
def hf_pair(request, tmp_path_factory):
    target, draft = make_pair_dirs(tmp_path_factory.mktemp(request.param), draft_kind=request.param)
    return load_hf_pair(target, draft)


def test_draft_vocabulary_maps(hf_pair):
    d2t = hf_pair.d2t
    assert not d2t.is_identity and d2t.draft_vocab_size == hf_pair.draft.vocab_size
    draft = hf_pair.draft
    if draft.output_mask is not None:  # intersection: draft-only words are never proposed
        logits, _ = draft.prefill(hf_pair.tokenizer.encode("the cat"))
        assert torch.isinf(logits[~draft.output_mask]).all() and torch.isfinite(logits[draft.output_mask]).all()
        from transformers import AutoTokenizer

        target_vocab = hf_pair.tokenizer.tokenizer.get_vocab()
        draft_vocab = AutoTokenizer.from_pretrained(draft.path).get_vocab()
        shared = set(target_vocab) & set(draft_vocab)
        assert shared and "zebra" not in target_vocab
        for word in shared:  # words of both vocabularies map to their target twins
            assert int(d2t.d2t[draft_vocab[word]]) == target_vocab[word]
        assert not draft.output_mask[draft_vocab["zebra"]]


def test_offset_d2t_file_is_converted_once(tmp_path):
    path = tmp_path / "d2t.json"
    path.write_text(json.dumps({"format": "offset", "d2t": [5, 5, 5]}))
    assert load_d2t_file(path, 3, 10).tolist() == [5, 6, 7]
    path.write_text(json.dumps({"format": "offset", "d2t": [5, 5, 8]}))
    with pytest.raises(ValueError, match=r"d2t: expected values in \[0, 10\), got 10"):
        load_d2t_file(path, 3, 10)
    path.write_text(json.dumps({"format": "relative", "d2t": [0]}))
    with pytest.raises(ValueError, match="d2t format"):
        load_d2t_file(path, 1, 10)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="expected a local checkpoint directory"):
        HFCausalLM(tmp_path / "missing")
    with pytest.raises(ValueError, match="both --target-model and --draft-model"):
        load_pair(target_model=tmp_path)


def test_hf_pair_through_both_nodes_ships_the_kv_cache(tmp_path):
    """Greedy K=4 through real gRPC equals greedy decoding with the target alone, and the
    decode node receives the target's KV cache instead of recomputing the prompt."""
    from decode_node.engine import DecodeConfig
    from tests.nodes.conftest import cluster

    target_dir, draft_dir = make_pair_dirs(tmp_path, draft_kind="intersection")
    pair = load_hf_pair(target_dir, draft_dir)
    prompt = "the cat sat on the"
    ids = pair.tokenizer.encode(prompt)
    reference, state = [], None
    logits, state = pair.target.prefill(ids)
    for _ in range(12):
        token = int(logits.argmax())
        reference.append(token)
        logits = pair.target.extend(state, [token])[-1]
    with cluster(pair, DecodeConfig(spec=SpeculativeConfig(max_speculative_tokens=4))) as (client, _, decode):
        for k in (0, 4):
            out = client.generate(prompt, greedy=True, max_new_tokens=12, num_speculative_tokens=k)
            assert out.token_ids[: len(reference)] == reference[: len(out.token_ids)]
        kv = decode.metrics.kv_bytes.labels("decode")._value.get()
        assert kv == 2 * sum(
            t.numel() * t.element_size() for t in pair.target.export_state(pair.target.prefill(ids)[1])
        )
