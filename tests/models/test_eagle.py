"""The hidden-state head (models/eagle.py, models/eagle_train.py, pdspec train-draft --kind eagle)
on a tiny random Llama target: the target's features come from its own forward, the training
forward is what the served head computes, the loss falls, the saved directory loads bound to
its target, and training resumes to the same weights."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from engine.paged_lm import PagedLlamaLM
from models import distill, eagle_train
from models.eagle import load_eagle, target_fingerprint
from models.loader import load_model, load_pair
from pdspec import cli
from tests.models.eagle_fixtures import head_ids, make_head_dir, make_target, one_thread  # noqa: F401 (autouse)
from tests.tolerance import assert_fp_close, model_roundings

pytest.importorskip("transformers")

SMALL = ["--tokens", "200", "--max-new-tokens", "16", "--batch", "4", "--top-k", "8", "--lr", "3e-3", "--seed", "3"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target"), layers=4)


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return make_head_dir(target_dir, tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def pair(target_dir, head_dir):
    return load_pair(target_model=target_dir, draft_model=head_dir)


def test_pair_binds_the_head_and_ships_its_kv(pair):
    assert pair.target.feature_layers == (0, 1, 1)  # EAGLE-3's (1, L/2 - 1, L - 4) clamped into 4 layers
    assert pair.draft_ships and pair.d2t.d2t.tolist() == head_ids()
    assert pair.kv_layout == pair.target.kv_layout + pair.draft.kv_layout and len(pair.draft.kv_layout) == 2
    assert pair.contract().draft_model == pair.draft.name


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_features_come_from_the_forward_and_follow_the_kept_path(pair, paged):
    """Chunked prompt + a verify tree whose kept path is not its first nodes: the state's features
    are those of one dense forward over the resulting tokens."""
    target = PagedLlamaLM.with_pool(pair.target, 1 << 20) if paged else pair.target
    tokens = [3, 7, 11, 2, 5, 8, 13, 4]
    state = target.empty_state()
    target.reserve(state, 32)
    target.extend_last([state], [tokens[:5]])
    target.extend_last([state], [tokens[5:]])
    assert state.features.shape == (8, 3 * 32)
    # tree after the history: 0 -> {1, 2}, 2 -> {3}; keep the path 0, 2, 3
    target.extend_tree([state], [[6, 9, 10, 12]], [[-1, 0, 0, 2]])
    target.accept_tree(state, [0, 2, 3])
    assert state.tokens == [*tokens, 6, 10, 12] and state.features.shape == (11, 96)
    module = pair.target.module
    _, dense = eagle_train.dense_forward(module, torch.tensor([state.tokens]), pair.target.feature_layers)
    assert_fp_close(state.features, dense[0], model_roundings(module))
    target.truncate(state, 9)
    assert_fp_close(state.features, dense[0, :9], model_roundings(module))
    plain = target.empty_state()  # a request that never drafts keeps none
    plain.keeps_features = False
    target.reserve(plain, 16)
    target.extend_last([plain, state], [tokens, [1]])
    assert plain.features is None and state.features.shape == (10, 96)
    target.release(plain)
    target.release(state)


def test_training_chain_is_what_the_served_head_drafts(pair):
    """Pass j of the training-time test at position i = the served head after catching up to
    position i - j with the target's features, then fed j tokens with its own outputs."""
    head, module = pair.draft, pair.target.module
    tokens = torch.tensor([[3, 7, 11, 2, 5, 8, 13, 4, 20, 6]])
    _, features = eagle_train.dense_forward(module, tokens, pair.target.feature_layers)
    with torch.inference_mode():
        chains = eagle_train.ttt_forward(head.head, tokens, features, 3)
    ids = tokens[0].tolist()
    for base in (0, 4):
        state = head.empty_state()
        logits, _ = head.extend([state], [ids[1 : base + 2]], [features[0, : base + 1]], fused=False)
        assert_fp_close(logits[0][-1], chains[0][0][0, base].float(), 200)
        for j in (1, 2):
            logits, _ = head.extend([state], [[ids[base + j + 1]]], [state.last[1][None]], fused=True)
            assert_fp_close(logits[0][-1], chains[j][0][0, base + j].float(), 200)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_chain_steps_as_the_head_extended_one_position_at_a_time(pair, steps):
    """`EagleDraft.chain` (every drafting depth over one stacked copy of the rows' KV; a graph
    replay on a GPU): each step gives every row, whatever its length, the logits and hidden of
    the head extended by that one position on its own, and the rows' states stay as they were."""
    head, vocab = pair.draft, pair.target.vocab_size
    width = len(head.feature_layers) * head.config.hidden_size

    def started(length: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        state = head.empty_state()
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        head.extend([state], [ids], [torch.randn(length, width, generator=generator)], fused=False)
        return state

    lengths = [3, 12, 7]
    states = [started(n, seed) for seed, n in enumerate(lengths)]
    alone = [started(n, seed) for seed, n in enumerate(lengths)]  # the reference: one row, one position at a time
    committed = [(list(s.tokens), s.kv.keys[0][:, : s.kv.length].clone()) for s in states]
    tokens = torch.randint(0, vocab, (steps, len(lengths)), generator=torch.Generator().manual_seed(9))
    chain = head.chain(states, steps)
    hidden = torch.stack([s.last[1] for s in states])  # [R, H]: depth 1's drafts read the catch-up's outputs
    previous = [s.last[1] for s in alone]
    for depth in range(steps):
        logits, hidden = chain.step(tokens[depth], hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(lengths), head.vocab_size)
        for r, state in enumerate(alone):
            want, out = head.extend([state], [[int(tokens[depth, r])]], [previous[r][None]], fused=True)
            assert_fp_close(logits[r], want[0][0], 200)
            assert_fp_close(hidden[r], out[0][0], 200)
            previous[r] = out[0][0]
    for state, (tokens_before, keys_before) in zip(states, committed, strict=True):
        assert state.tokens == tokens_before and state.kv.length == len(tokens_before)
        assert torch.equal(state.kv.keys[0][:, : state.kv.length], keys_before)


def test_loss_falls(target_dir, tmp_path):
    model, tokenizer = load_model(target_dir, dtype=torch.float32)
    samples = distill.generate_samples(model, tokenizer, tokens=300, max_new_tokens=24, batch=8, seed=3)
    items = distill.target_distributions(model.module, samples, top_k=8, batch=8)
    config = eagle_train.EagleConfig.for_target(model, head_ids())
    features = eagle_train.target_features(model.module, samples, config.feature_layers, batch=8)
    torch.manual_seed(0)
    head = eagle_train.init_head(config, model.module.requires_grad_(False))
    settings = eagle_train.HeadSettings(steps=40, batch=8, lr=3e-3, seed=3)
    losses = eagle_train.train_head(head, items, features, settings, tmp_path, log=lambda _: None)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def _train(target, out, *extra: str) -> int:
    argv = ["train-draft", "--kind", "eagle", "--target-model", str(target), "--out", str(out)]
    return cli.main([*argv, *SMALL, *extra])


def test_cli_trains_evaluates_and_resumes_to_the_same_head(target_dir, tmp_path, capsys):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert _train(target_dir, whole, "--steps", "6", "--save-every", "3", "--log-every", "3", "--eval") == 0
    printed = capsys.readouterr().out
    assert "step 6/6" in printed and "[####" in printed and "mean accepted drafts at K = 1..6" in printed
    report = json.loads((whole / "eval.json").read_text())
    for law in ("T=0", "T=0.7"):
        rates = report[law]["per_position"]
        assert len(rates) == 6 and all(0 <= b <= a <= 1 for a, b in itertools.pairwise(rates))
        assert report[law]["mean_accepted"][-1] == pytest.approx(sum(rates))
    shutil.copytree(whole, resumed)
    distill.checkpoint_path(resumed, 6).unlink()  # as if stopped after step 3
    for name in ("model.safetensors", "eagle.json", "eval.json"):
        (resumed / name).unlink()
    assert _train(target_dir, resumed, "--steps", "6", "--save-every", "3", "--resume") == 0
    first = load_pair(target_model=target_dir, draft_model=whole).draft.head.state_dict()
    second = load_pair(target_model=target_dir, draft_model=resumed).draft.head.state_dict()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_resuming_with_another_feature_weight_is_refused(target_dir, tmp_path, capsys):
    """--feature-weight reaches the training settings: a checkpoint trained with one is not
    continued with another."""
    out = tmp_path / "head"
    assert _train(target_dir, out, "--steps", "2", "--save-every", "2") == 0
    distill.checkpoint_path(out, 2).rename(distill.checkpoint_path(out, 1))  # as if stopped early
    with pytest.raises(SystemExit) as exit_info:
        _train(target_dir, out, "--steps", "2", "--resume", "--feature-weight", "0")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--resume" in err and "'feature_weight': 0.0" in err, err


def test_head_of_another_target_is_refused(target_dir, head_dir, tmp_path):
    other_dir = make_target(tmp_path / "other", seed=6, layers=4)
    other, _ = load_model(other_dir, dtype=torch.float32)
    assert target_fingerprint(other) != json.loads((head_dir / "eagle.json").read_text())["target_fingerprint"]
    with pytest.raises(ValueError, match="draft_model: expected a head trained for this target"):
        load_eagle(head_dir, other)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--kind", "medusa"], "--kind"),
        (["--kind", "eagle", "--passes", "0"], "--passes"),
        (["--kind", "eagle", "--feature-weight", "-0.1"], "--feature-weight"),
        (["--kind", "eagle", "--feature-weight", "nan"], "--feature-weight"),
    ],
)
def test_bad_training_flags_name_the_flag(target_dir, tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train-draft", "--target-model", str(target_dir), "--out", str(tmp_path / "o"), *argv])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("method", "with_head", "message"),
    [("eagle", False, "'eagle' expects --draft-model"), ("draft", True, "expected 'eagle' or 'hybrid'")],
)
def test_bad_node_flags_are_the_parsers_error(head_dir, target_dir, capsys, method, with_head, message):
    from decode_node.__main__ import main as decode_main
    from prefill_node.__main__ import main as prefill_main

    draft = ["--target-model", str(target_dir), "--draft-model", str(head_dir)] if with_head else []
    for main, extra in ((decode_main, []), (prefill_main, ["--decode-addr", "127.0.0.1:1"])):
        with pytest.raises(SystemExit) as exit_info:
            main(["--speculative-method", method, *draft, *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
