import numpy as np
import pytest
import torch

from models.ngram import ALPHABET, DRAFT_TO_TARGET, EOS, load_builtin_pair, train_tables
from models.tokenizer import ByteTokenizer, IncrementalDetokenizer

TEXT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 20 + "naïve café ☕\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "a.py").write_text(TEXT)
    (corpus / "b.txt").write_text("hello world\n" * 50)
    return load_builtin_pair(corpus, cache_dir=tmp_path_factory.mktemp("cache"))


def test_probabilities_are_exact_distributions(pair):
    history = ByteTokenizer().encode("def add(a, ")
    for model in (pair.target, pair.draft):
        p = model.next_token_probs(history)
        assert p.shape == (model.vocab_size,) and abs(p.sum() - 1) < 1e-12 and (p > 0).all()
    assert pair.target.vocab_size == ALPHABET and pair.draft.vocab_size == len(DRAFT_TO_TARGET)
    # The corpus says "b" follows "def add(a, " every time: the smoothed model agrees.
    assert pair.target.next_token_probs(history).argmax() == ord("b")


def test_logits_are_log_probabilities(pair):
    logits, _ = pair.target.prefill(ByteTokenizer().encode("return"))
    torch.testing.assert_close(
        torch.softmax(logits, -1).double(),
        torch.tensor(pair.target.next_token_probs(list(b"return"))),
        rtol=0,
        atol=1e-6,
    )


def test_d2t_is_valid_non_identity(pair):
    assert not pair.d2t.is_identity and pair.d2t.is_injective
    assert pair.d2t.map_tokens(torch.tensor([0, 3])).tolist() == [EOS, ord(" ")]


def test_training_is_deterministic():
    tokens = np.array([EOS, *b"abracadabra abracadabra", EOS], dtype=np.int64)
    identity = np.arange(ALPHABET)
    a, b = train_tables(tokens, 4, ALPHABET, identity), train_tables(tokens, 4, ALPHABET, identity)
    for name in ("ctx_codes", "ctx_total", "ctx_types", "pair_codes", "pair_counts"):
        assert all(np.array_equal(x, y) for x, y in zip(getattr(a, name), getattr(b, name), strict=True))


def test_cache_is_used_and_a_corrupt_cache_retrains(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    cache = tmp_path / "cache"
    first = load_builtin_pair(corpus, cache)
    files = list(cache.glob("ngram-*.npz"))
    assert len(files) == 1
    second = load_builtin_pair(corpus, cache)
    assert second.target.name == first.target.name
    files[0].write_bytes(b"garbage")
    third = load_builtin_pair(corpus, cache)
    np.testing.assert_array_equal(
        third.target.next_token_probs(list(b"def ")), first.target.next_token_probs(list(b"def "))
    )


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_bad_corpora(tmp_path, make):
    path = tmp_path / "corpus"
    if make == "empty":
        path.mkdir()
    with pytest.raises(ValueError, match="corpus: expected"):
        load_builtin_pair(path, tmp_path / "cache")


def test_prefill_needs_a_prompt_and_truncate_checks_length(pair):
    with pytest.raises(ValueError, match="ids: expected a non-empty prompt"):
        pair.target.prefill([])
    _, state = pair.target.prefill([1, 2, 3])
    with pytest.raises(ValueError, match=r"length: expected 0..3, got 4"):
        pair.target.truncate(state, 4)


def test_incremental_detokenizer_holds_back_split_characters():
    ids = ByteTokenizer().encode("café ☕")
    detok = IncrementalDetokenizer()
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "café ☕"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[3] == "" and pieces[4] == "é"  # 0xC3 held back until 0xA9 arrives
    assert detok.push([EOS]) == ""  # special ids are not text
