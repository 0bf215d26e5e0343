"""`pdspec train-draft` (models/distill.py, pdspec/train_draft.py) on a tiny random target."""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest
import torch

from models import distill
from models.loader import load_model, load_pair
from models.tokenizer import TextTokenizer
from pdspec import cli
from tests.models.hf_fixtures import WORDS, make_family_checkpoint
from tests.tolerance import assert_fp_close, model_roundings

pytest.importorskip("transformers")

SMALL = ["--tokens", "300", "--max-new-tokens", "24", "--batch", "4", "--top-k", "16", "--lr", "3e-3", "--seed", "3"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """4 layers, vocabulary of 40 (the word tokenizer's 38 ids and two more), untied head."""
    directory = tmp_path_factory.mktemp("target")
    return make_family_checkpoint(directory, seed=5, layers=4, vocab_size=40, hidden=32, words=WORDS)


def _train(target, out, *extra: str) -> int:
    return cli.main(["train-draft", "--target-model", str(target), "--out", str(out), *SMALL, *extra])


def _weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


@pytest.mark.parametrize(("train_embeddings", "factor"), [(False, 0.75), (True, 0.6)])
def test_loss_falls(target, tmp_path, train_embeddings, factor):
    model, tokenizer = load_model(target, dtype=torch.float32)
    samples = distill.generate_samples(model, tokenizer, tokens=300, max_new_tokens=24, batch=4, seed=3)
    items = distill.target_distributions(model.module, samples, top_k=16, batch=4)
    draft = distill.init_draft(model.module, 2, train_embeddings=train_embeddings)
    head = draft.lm_head.weight.detach().clone()
    settings = distill.TrainSettings(steps=40, batch=4, lr=3e-3, seed=3, layers=2, train_embeddings=train_embeddings)
    losses = distill.train(draft, items[2:], items[:2], settings, tmp_path, log=lambda _: None)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < factor * first, (first, last)
    # frozen by default: the head (and the embeddings) stay the target's
    assert torch.equal(draft.lm_head.weight.detach(), head) is not train_embeddings


def test_draft_starts_as_the_layer_skip_draft(target):
    model, _ = load_model(target, dtype=torch.float32)
    draft = distill.init_draft(model.module, 2)
    source, copied = model.module.state_dict(), draft.state_dict()
    assert sorted(copied) == sorted(
        name for name in source if not name.startswith(("model.layers.2", "model.layers.3"))
    )
    assert torch.equal(copied["model.layers.1.mlp.down_proj.weight"], source["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(
        copied["model.layers.0.self_attn.q_proj.weight"], source["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(copied["lm_head.weight"], source["lm_head.weight"])


def test_saved_draft_loads_and_matches(target, tmp_path, capsys):
    out = tmp_path / "draft"
    assert _train(target, out, "--steps", "6", "--log-every", "3", "--eval") == 0
    printed = capsys.readouterr().out
    assert "step 6/6" in printed and "held-out top-1 agreement" in printed and "E[acc]" in printed
    report = json.loads((out / "eval.json").read_text())
    for draft, kind in itertools.product(("trained", "layer_skip"), ("greedy", "stochastic")):
        rates = report[draft][kind]["per_position"]  # a chain: each position's rate at most the one before
        assert len(rates) == 4 and all(0 <= b <= a <= 1 for a, b in itertools.pairwise(rates))

    # the module trained, rebuilt from its last checkpoint
    model, _ = load_model(target, dtype=torch.float32)
    trained = distill.init_draft(model.module, 2)
    trained.load_state_dict(torch.load(distill.latest_checkpoint(out), weights_only=True)["model"])
    tokens = torch.tensor([[0, 5, 9, 3, 17, 2, 30, 11]])
    with torch.no_grad():
        expected = distill.dense_logits(trained, tokens)[0]  # [T, V]

    pair = load_pair(target_model=target, draft_model=out)
    assert pair.draft.vocab_size == pair.target.vocab_size and pair.draft.num_layers == 2
    logits, state = pair.draft.prefill(tokens[0, :4].tolist())
    rest = pair.draft.extend(state, tokens[0, 4:].tolist())
    assert_fp_close(torch.cat([logits[None], rest]), expected[3:], model_roundings(pair.draft))

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert_fp_close(hf(tokens).logits[0], expected, model_roundings(pair.draft))


def test_resume_gives_the_same_weights(target, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert _train(target, whole, "--steps", "8", "--save-every", "4") == 0
    shutil.copytree(whole, resumed)
    distill.checkpoint_path(resumed, 8).unlink()  # as if stopped after step 4
    (resumed / "model.safetensors").unlink()
    assert distill.latest_checkpoint(resumed) == distill.checkpoint_path(resumed, 4)
    assert _train(target, resumed, "--steps", "8", "--save-every", "4", "--resume") == 0
    first, second = _weights(whole), _weights(resumed)
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
    at_4 = torch.load(distill.checkpoint_path(resumed, 4), weights_only=True)["model"]
    name = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(at_4[name], first[name])  # steps 5..8 did train


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--steps", "-1"], "--steps"),
        (["--layers", "0"], "--layers"),
        (["--layers", "5"], "--layers"),
        (["--top-k", "-2"], "--top-k"),
        (["--draft-vocab", "41"], "--draft-vocab"),
    ],
)
def test_bad_flags_name_the_flag(target, tmp_path, capsys, extra, flag):
    with pytest.raises(SystemExit) as exit_info:
        _train(target, tmp_path / "out", *extra)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_missing_out_names_the_flag(target, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-draft", "--target-model", str(target)])
    assert exit_info.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_resume_needs_a_checkpoint_and_a_fresh_run_an_empty_out(target, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _train(target, tmp_path / "none", "--resume")
    assert exit_info.value.code == 2 and "--resume" in capsys.readouterr().err
    out = tmp_path / "out"
    assert _train(target, out, "--steps", "2") == 0
    with pytest.raises(SystemExit) as exit_info:
        _train(target, out, "--steps", "2")
    assert exit_info.value.code == 2 and "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a checkpoint of other training flags
        _train(target, out, "--steps", "3", "--resume")
    assert exit_info.value.code == 2 and "--resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # data made with other data flags
        _train(target, out, "--steps", "2", "--resume", "--max-new-tokens", "25")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--out" in err and "other data flags" in err


def test_kl_loss_is_the_kl_divergence():
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]]])  # [B=1, T=1, V=4]
    q = torch.softmax(logits, -1)[0, 0]
    ids, probs = torch.tensor([[[3, 0]]]), torch.tensor([[[0.75, 0.25]]])  # a top-2 law, renormalised
    mask = torch.ones(1, 1, dtype=torch.bool)
    expected = 0.75 * math.log(0.75 / q[3]) + 0.25 * math.log(0.25 / q[0])
    assert float(distill.kl_loss(logits, mask, ids, probs)) == pytest.approx(expected, rel=1e-6)
    matched = torch.log(torch.tensor([[[0.25, 1e-9, 1e-9, 0.75]]]))  # the draft's law is the target's
    assert float(distill.kl_loss(matched, mask, ids, probs)) == pytest.approx(0.0, abs=1e-6)


def test_magpie_samples_follow_the_chat_template(target):
    """The target writes the user turn after the template's user prefix, then the answer."""
    model, tokenizer = load_model(target, dtype=torch.float32)
    tokenizer.tokenizer.chat_template = (
        "{% for m in messages %}the cat {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}dog{% endif %}"
    )
    chat = TextTokenizer(tokenizer.tokenizer, model.eos_token_ids)
    prefix, suffix = distill.magpie_prefix_suffix(chat)
    assert (prefix, suffix) == (chat.encode("the cat"), chat.encode("</s> dog"))
    samples = distill.generate_samples(model, chat, tokens=60, max_new_tokens=6, batch=2, seed=1)
    for sample in samples:
        assert sample[:2] == prefix
        switch = next(i for i in range(2, len(sample)) if sample[i : i + 2] == suffix)
        assert 2 <= switch <= 2 + 6 and 1 not in sample[2:switch]  # a user turn without its end token
        assert 1 <= len(sample) - switch - 2 <= 6


def test_data_file_adds_training_sequences(target, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat\n\nthe dog ran past the old red door\n")
    plain, extra = tmp_path / "plain", tmp_path / "extra"
    assert _train(target, plain, "--steps", "1") == 0
    assert _train(target, extra, "--steps", "1", "--data", str(text)) == 0
    before = torch.load(plain / "data.pt", weights_only=True)["train"]
    after = torch.load(extra / "data.pt", weights_only=True)["train"]
    assert len(after) == len(before) + 2
    tokenizer = load_model(target, dtype=torch.float32)[1]
    assert after[-1][0] == [0, *tokenizer.encode("the dog ran past the old red door")]  # BOS, then the line


@pytest.mark.parametrize("draft_vocab", [0, 20])
def test_a_trained_draft_serves_through_both_nodes(target, tmp_path, draft_vocab):
    """The saved directory as --draft-model on both nodes (real gRPC on loopback): greedy K = 4
    emits the K = 0 tokens with drafts verified and some accepted; the output law stays the
    verifier's, which no draft can change (tests/nodes distribution tests). With --draft-vocab
    the directory carries d2t.json and the served draft proposes those ids only."""
    from tests.nodes.conftest import cluster

    out = tmp_path / "draft"
    assert _train(target, out, "--steps", "30", "--layers", "2", "--draft-vocab", str(draft_vocab)) == 0
    pair = load_pair(target_model=target, draft_model=out, dtype=torch.float32)
    if draft_vocab:
        d2t = json.loads((out / "d2t.json").read_text())["d2t"]
        assert len(d2t) == len(set(d2t)) == draft_vocab and pair.draft.vocab_size == draft_vocab
        assert set(pair.draft.eos_token_ids) <= set(d2t)  # the stop ids are always kept
        assert pair.d2t.d2t.tolist() == d2t
    else:
        assert not (out / "d2t.json").exists() and pair.draft.vocab_size == pair.target.vocab_size
    prompt = " ".join(WORDS[:6])
    with cluster(pair) as (client, _, _):
        spec = client.generate(prompt, greedy=True, num_speculative_tokens=4, max_new_tokens=24)
        plain = client.generate(prompt, greedy=True, num_speculative_tokens=0, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) >= 8
    assert spec.stats.verify_steps > 0 and spec.stats.draft_tokens == 4 * spec.stats.verify_steps
    assert spec.stats.accepted_tokens > 0


def test_a_restricted_head_gives_those_rows_logits(target):
    """restrict_head keeps the head rows of the given ids, in their order, and reads every id."""
    from models.llama import restrict_head

    full, _ = load_model(target, dtype=torch.float32)
    reduced, _ = load_model(target, dtype=torch.float32)
    ids = torch.tensor([39, 0, 7, 12, 30])
    restrict_head(reduced, ids)
    assert reduced.vocab_size == 5 and reduced.name != full.name
    tokens = [3, 38, 17, 2, 9]  # 38 has no head row: the embeddings stay whole
    expected = full.prefill(tokens)[0]  # [V]
    assert_fp_close(reduced.prefill(tokens)[0], expected[ids], model_roundings(reduced))
    for bad in (torch.tensor([1, 1]), torch.tensor([40]), torch.tensor([], dtype=torch.int64)):
        with pytest.raises(ValueError, match="head_ids"):
            restrict_head(full, bad)


def test_draft_vocabulary_keeps_stop_ids_then_the_most_frequent():
    ids = distill.draft_vocabulary([[5, 5, 5, 2, 2, 9], [2, 7]], 3, 12, always=[11])
    assert ids.tolist() == [2, 5, 11]  # 11 always; then 2 (3 times) and 5 (3 times, tie by id)


def test_lockstep_generation_has_the_teacher_forced_logits(target):
    """The generation cache (`LockstepKv`): left-padded prompts of different lengths, then steps
    of every row at once; after each forward, each row's logits are those of its own sequence
    run alone through the dense forward (a padding slot, or another row, leaking into a row's
    attention moves them by O(1))."""
    model, _ = load_model(target, dtype=torch.float32)
    module = model.module
    prompts = [[0, 5, 9, 11, 3], [0, 7], [0, 2, 2, 8]]
    tokens = torch.zeros(3, 5, dtype=torch.int64)
    valid = torch.zeros(3, 5, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, 5 - len(prompt) :] = torch.tensor(prompt)
        valid[row, 5 - len(prompt) :] = True
    cache = distill.LockstepKv(module, 3, 5 + 4)
    with torch.inference_mode():
        logits = cache.forward(module, tokens, (valid.cumsum(1) - 1).clamp_min(0), valid)
        rows = [list(p) for p in prompts]
        for step in range(4):
            for row, seq in enumerate(rows):
                want = distill.dense_logits(module, torch.tensor([seq]))[0, -1]
                assert_fp_close(logits[row], want, model_roundings(module))
            drawn = torch.tensor([[13 + step], [21], [30]])  # [B, 1]
            for row, seq in enumerate(rows):
                seq.append(int(drawn[row, 0]))
            positions = torch.tensor([[len(seq) - 1] for seq in rows])
            logits = cache.forward(module, drawn, positions, torch.ones(3, 1, dtype=torch.bool))


def test_generation_is_seeded_and_keeps_stop_ids(target):
    """The same seed gives the same samples; a row ends at its first stop id, which it keeps."""
    model, tokenizer = load_model(target, dtype=torch.float32)
    first = distill.generate_samples(model, tokenizer, tokens=80, max_new_tokens=12, batch=4, seed=7)
    again = distill.generate_samples(model, tokenizer, tokens=80, max_new_tokens=12, batch=4, seed=7)
    assert first == again
    stops = set(tokenizer.eos_token_ids) | set(model.eos_token_ids)
    for sample in first:
        ends = [i for i, t in enumerate(sample[1:], 1) if t in stops]
        assert not ends or ends == [len(sample) - 1]
        assert 2 <= len(sample) <= 1 + 12
