"""Byte-level tokenizer (ids 0..255 are bytes, then special ids) and incremental detokenizing."""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import Sequence

NO_CHAT_TEMPLATE = "chat_template: expected a chat template with the tokenizer, got none"


class ByteTokenizer:
    chat_template: str | None = None  # byte-level models have no chat format

    def __init__(self, special_ids: Sequence[int] = ()) -> None:
        self.special_ids = frozenset(special_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def incremental(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer()

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        raise ValueError(NO_CHAT_TEMPLATE)


class IncrementalDetokenizer:
    """Text of a token stream, piece by piece: a multi-byte UTF-8 character split across
    tokens is held back until its last byte arrives, never emitted as a replacement.
    (Bytes that can never form a character still decode to U+FFFD.)"""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if i < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class IncrementalTextDecoder:
    """The same contract for any tokenizer with `decode`: decode the stream, emit what is new,
    and hold back a trailing U+FFFD (an incomplete character) until it resolves.

    Each push decodes a window, not the whole stream (which made a response's detokenising
    quadratic in its length: 0.9 s of host time for 2,048 SmolLM2 tokens): the tokens since the
    text was last whole, plus CONTEXT tokens before them. Once the window's text is emitted whole,
    it slides to its last CONTEXT tokens. What a token decodes to may depend on the tokens just
    before it (a SentencePiece tokenizer drops a leading space at the start of a decode; merged
    byte sequences); the CONTEXT tokens carry that, as vLLM's detokenizer does with its prefix
    offset, so the pieces join into the stream's whole decode."""

    CONTEXT = 4

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window: ids[start:]
        self.emitted = 0  # characters of the window's text already emitted

    def push(self, ids: Sequence[int]) -> str:
        self.ids += list(ids)
        text = self.tokenizer.decode(self.ids[self.start :])
        ready = len(text.rstrip("\ufffd"))
        piece = text[self.emitted : ready] if ready > self.emitted else ""
        self.emitted = max(self.emitted, ready)
        if ready == len(text) and len(self.ids) - self.start > self.CONTEXT:  # whole: slide
            self.start = len(self.ids) - self.CONTEXT
            self.emitted = len(self.tokenizer.decode(self.ids[self.start :]))
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids[self.start :])
        piece, self.emitted = text[self.emitted :], len(text)
        return piece


class TextTokenizer:
    """A transformers (fast) tokenizer behind the `Tokenizer` protocol, with what a chat
    front end needs from it: the chat template and the end-of-turn ids."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None)
        own = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(dict.fromkeys([*eos_token_ids, *([] if own is None else [own])]))
        if self.chat_template:
            # The template is compiled on its first render (~6 ms: jinja2's import and parse, then
            # cached by transformers): at load, not in a client's first chat request. A template
            # that rejects this chat is compiled all the same; requests meet its error.
            with contextlib.suppress(Exception):
                self.apply_chat_template([{"role": "user", "content": "."}])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def incremental(self) -> IncrementalTextDecoder:
        return IncrementalTextDecoder(self)

    def apply_chat_template(self, messages: Sequence[dict]) -> str:
        """The prompt text of a chat (`messages` as the OpenAI API sends them) through the
        model's chat template, ending with the assistant's turn opened (add_generation_prompt).
        The template writes any special tokens (BOS...) itself: encode the text without adding them."""
        if not self.chat_template:
            raise ValueError(NO_CHAT_TEMPLATE)
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
