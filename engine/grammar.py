"""Structured outputs: a request's constraint compiled by llguidance, and its matcher.

`Grammars` (one per node) holds the target's vocabulary as llguidance sees it (the byte strings
of the ids and the EOS id) and the compiled grammars, cached by their text: a request compiles
its constraint once (`Grammars.compile`, on the caller's thread, never the engine's) and gets a
`GrammarState`, a copy of the cached matcher. The state lives in the request's `Sequence`.

The law (docs/design.md §9 "Structured outputs"): at every position the target's logits outside
the tokens the grammar allows there are set to -inf before temperature / top-k / top-p, so the
target law is the filtered law of the allowed tokens, renormalised (greedy: the argmax over the
allowed tokens). The verifier reads one bitmask per context of a proposal (`masks`): the matcher
advances along each draft path and computes the mask after every node, so a draft the grammar
forbids has target probability 0 and is rejected by the ordinary rule; once the step is
verified the matcher rolls back to the accepted prefix and consumes the emitted tokens
(`settle`). Tokens the grammar forces (`forced`: fixed keys, punctuation) are proposed as a
point-mass chain (jump-forward): they cost no draft forward, and are verified like any draft,
which keeps them exact even where a tokenizer could spell the forced bytes another way.

llguidance bounds the work of each mask (its parser limits) and compiles lazily, so neither a
large schema nor a pathological one can stall the engine thread for the batch; compiling (the
grammar's construction, at most `COMPILE_TIMEOUT_S`) runs on the request's thread.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import torch

from protos.constraint import GRAMMAR_ENGINE, Constraint
from sampling.filtering import allowed_tokens
from sampling.proposal import Proposal

GRAMMAR = "grammar"  # the source of a jump-forward proposal (the grammar forced its tokens)
COMPILE_TIMEOUT_S = 2.0
CACHE_SIZE = 256
_COMPILERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")


class GrammarError(ValueError):
    """A constraint the grammar engine refuses (`field` structured_output.<kind>), or a first token
    it forbids (`field` first_token_id: a decode node's direct caller)."""

    def __init__(self, field: str, message: str, expected: str = "a constraint the grammar engine compiles") -> None:
        super().__init__(f"{field}: expected {expected}, got {message}")
        self.field = field
        self.message = message
        self.expected = expected


class _ByteVocabulary:
    """The byte-level tokenizer's vocabulary as llguidance's TokenizerWrapper reads it: id i < 256
    is byte i, the ids after them special (EOS)."""

    bos_token_id = None

    def __init__(self, vocab_size: int, eos: int) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        self.eos_token_id = eos
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class _DecodedVocabulary:
    """Any tokenizer's vocabulary as the bytes each id decodes to alone (special ids: none)."""

    bos_token_id = None

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        special = set(getattr(tokenizer, "all_special_ids", ()))
        size = min(vocab_size, len(tokenizer))
        self.tokens = [b"" if i in special else tokenizer.decode([i]).encode() for i in range(size)]
        self.tokens += [b""] * (vocab_size - size)
        self.eos_token_id = eos
        self.special_token_ids = sorted(special | {eos})
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace"), add_special_tokens=False)


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (its JSON / Lark form; nothing is checked here)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults={"whitespace_flexible": False}
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in json.loads(value))
        )
    if "::=" in value:  # GBNF (llama.cpp's), as vLLM takes it; Lark rules are `name: ...`
        value = llguidance.gbnf_to_lark(value)
    return llguidance.LLMatcher.grammar_from_lark(value)


class Grammars:
    """A node's grammar engine: the target vocabulary for llguidance and the compiled grammars,
    an LRU cache keyed by the constraint's text (a schema's compact JSON, key order kept)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """tokenizer: the pair's (models/tokenizer.py): byte-level, or a Hugging Face fast
        tokenizer wrapped in `TextTokenizer` (`.tokenizer`)."""
        installed = importlib.metadata.version("llguidance").split(".")[0]
        if f"llguidance/{installed}" != GRAMMAR_ENGINE:  # the contract names the engine's major version
            raise RuntimeError(f"grammar engine: expected {GRAMMAR_ENGINE}, got llguidance {installed}")
        self._source = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at the first constraint (~1 s for 50k ids)
        self.eos_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of a bitmask
        self.eos = self.eos_ids[0] if self.eos_ids else -1  # -1: a model without one takes no constraint
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # time spent building grammars (a cache hit adds nothing)

    @classmethod
    def for_pair(cls, pair) -> Grammars:
        """The grammar engine of a node's model pair (models/pair.py): the target's vocabulary."""
        return cls(pair.tokenizer, pair.target.vocab_size, pair.target.eos_token_ids)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The target vocabulary as llguidance reads it: the byte tokenizer's ids, a Hugging Face
        fast tokenizer's own description, or (a tokenizer llguidance cannot read) each id's
        decoded bytes."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._vocabulary()
            return self._tokenizer

    def _vocabulary(self) -> llguidance.LLTokenizer:
        hf = getattr(self._source, "tokenizer", None)
        if hf is None:
            vocabulary = _ByteVocabulary(self.vocab_size, self.eos)
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary))
        from llguidance.hf import from_tokenizer  # imports transformers: only for a Hugging Face tokenizer

        try:
            return from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        except ValueError:  # no decoder llguidance knows: the ids' decoded bytes, specials empty
            vocabulary = _DecodedVocabulary(hf, self.vocab_size, self.eos)
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary))

    def compile(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for the constraint (GrammarError with the engine's message when it does
        not compile, or not within COMPILE_TIMEOUT_S)."""
        if self.eos < 0:  # a grammar ends generation with EOS: llguidance needs the id
            raise GrammarError(f"structured_output.{constraint.kind}", "none", "a model with an end-of-sequence token")
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
        if cached is None:
            cached = self._build(constraint)
            with self._lock:
                self._cache[constraint] = cached
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarState(cached.deep_copy(), self)

    def _build(self, constraint: Constraint) -> llguidance.LLMatcher:
        field = f"structured_output.{constraint.kind}"
        started = time.perf_counter()
        try:
            text = grammar_text(constraint)
        except ValueError as err:
            raise GrammarError(field, str(err)) from None
        # llguidance drops the GIL while it builds a grammar; the wait is bounded here, and a
        # build that overruns finishes on the compile pool, which holds at most two at once.
        future = _COMPILERS.submit(llguidance.LLMatcher, self.tokenizer, text, log_level=0)
        try:
            matcher = future.result(timeout=COMPILE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise GrammarError(field, f"a grammar that compiles within {COMPILE_TIMEOUT_S:g} s") from None
        finally:
            self.compile_seconds += time.perf_counter() - started
        if matcher.is_error():
            raise GrammarError(field, matcher.get_error())
        return matcher


class GrammarState:
    """One request's matcher, at the end of its emitted tokens between steps."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: Grammars) -> None:
        self.matcher = matcher
        self.grammars = grammars
        self.ahead: list[int] = []  # tokens consumed past the emitted ones (the last draft path walked)
        self.rejected_drafts = 0  # drafts the grammar forbade (statistics)
        self.jump_forward_tokens = 0  # forced tokens proposed (statistics)
        self.mask_seconds: list[float] = []  # each step's time computing masks (metrics)
        self._drafting_seconds = 0.0  # masks drawn drafts under since the step's own (`draft_mask`)

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS): the request ends, "stop"."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def _fill(self, out: torch.Tensor, row: int) -> None:
        """out[row] = the matcher's mask (out: [N+1, W] int32, contiguous, on the host)."""
        if not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(out.data_ptr() + row * out.stride(0) * 4, out.shape[1] * 4)
        if self.matcher.is_error():  # nothing allowed (a matcher past its limits): EOS ends the request
            out[row] = 0
            out[row, self.grammars.eos // 32] = 1 << (self.grammars.eos % 32)

    def masks(self, token_ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """[N+1, W] int32 bitmasks (bit j of word w allows token 32w + j): the grammar's allowed
        tokens after the emitted tokens (row 0) and after each node's path (row n + 1), nodes
        breadth-first with their parents (-1 = the last emitted token). A node the grammar
        forbids after its parent's path leaves its subtree's rows all-allowed: the verifier
        rejects it (probability 0) before any of them is read. The matcher is left at the end
        of the last path walked; `settle` rolls it back to the accepted prefix."""
        started = time.perf_counter()
        self._rewind(0)
        words = self.grammars.words
        out = torch.full((len(token_ids) + 1, words), -1, dtype=torch.int32)
        self._fill(out, 0)
        paths: list[list[int] | None] = []  # each node's path from the root, None: unreachable
        for n, (token, parent) in enumerate(zip(token_ids, parents, strict=True)):
            above = [] if parent < 0 else paths[parent]
            context = 0 if parent < 0 else parent + 1
            allowed = above is not None and bool((int(out[context, token // 32]) >> (token % 32)) & 1)
            if above is not None and not allowed:
                self.rejected_drafts += 1
            path = [*above, token] if allowed and token != self.grammars.eos else None
            paths.append(path)  # None: forbidden, or EOS (the request ends there: what follows is dropped)
            if path is None:
                continue
            self._walk(path)
            self._fill(out, n + 1)
        self.mask_seconds.append(time.perf_counter() - started + self._drafting_seconds)
        self._drafting_seconds = 0.0
        return out

    def _rewind(self, keep: int) -> None:
        if len(self.ahead) > keep:
            if not self.matcher.rollback(len(self.ahead) - keep):
                raise RuntimeError(f"grammar matcher: rollback failed ({self.matcher.get_error()})")
            del self.ahead[keep:]

    def _walk(self, path: list[int]) -> None:
        """Move the matcher from the end of `ahead` to the end of `path` (every token of `path`
        allowed): back to their common prefix, then forward."""
        common = 0
        for a, b in zip(self.ahead, path, strict=False):
            if a != b:
                break
            common += 1
        self._rewind(common)
        for token in path[common:]:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"grammar matcher: an allowed token was refused ({self.matcher.get_error()})")
            self.ahead.append(token)

    def draft_mask(self, path: Sequence[int], d2t: torch.Tensor) -> torch.Tensor | None:
        """[Vd] bool: the draft ids whose target ids (d2t [Vd]) the grammar allows after the
        emitted tokens and `path` (target ids, every one allowed), for drafting under the
        grammar; None where that leaves no draft id (the draft proposes unmasked: its drafts
        are then rejected by the verifier, exactly)."""
        started = time.perf_counter()
        path = list(path)
        self._rewind(0)
        if self.grammars.eos in path or self.matcher.validate_tokens(path) != len(path):
            return None  # a path drafted unmasked: the verifier rejects it; nothing to mask after it
        self._walk(path)
        row = torch.empty(1, self.grammars.words, dtype=torch.int32)
        self._fill(row, 0)
        allowed = allowed_tokens(row[0], self.grammars.vocab_size)[d2t]  # [Vd]
        self._drafting_seconds += time.perf_counter() - started  # counted with the step's masks
        return allowed if bool(allowed.any()) else None

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (after the emitted tokens)."""
        self._rewind(0)
        return (token == self.grammars.eos and self.accepting) or self.matcher.validate_tokens([token]) == 1

    def settle(self, emitted: Sequence[int]) -> None:
        """The tokens a step kept (accepted drafts, then the correction or bonus): roll back to the
        accepted prefix of the last path walked and consume the rest. The masked law only emits
        allowed tokens; anything else is a bug (RuntimeError)."""
        self._walk(list(emitted))
        self.ahead.clear()  # emitted: the matcher's committed state

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (jump-forward), [] when it forces none."""
        if limit <= 0:
            return []
        self._rewind(0)
        return self.matcher.compute_ff_tokens()[:limit]

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (a chain after the emitted tokens) the grammar allows in a row."""
        self._rewind(0)
        return self.matcher.validate_tokens(list(token_ids))


def guide(state: GrammarState | None, proposal: Proposal) -> Proposal:
    """A constrained row's proposal before verification: a point-mass chain is cut before the
    first token the grammar forbids (fewer wasted drafts; a point mass stays the law it was drawn
    from, the cut being a function of the context alone). A stochastic law is left whole: its
    drafts were drawn from it, and cutting on a drawn value would change what is verified."""
    if state is None or proposal.probs is not None or not proposal.is_chain or not proposal.token_ids:
        return proposal
    keep = state.valid_prefix(proposal.token_ids)
    if keep == len(proposal.token_ids):
        return proposal
    state.rejected_drafts += len(proposal.token_ids) - keep
    return Proposal(proposal.token_ids[:keep], proposal.parents[:keep], None, proposal.source)


def jump_forward(state: GrammarState | None, limit: int) -> Proposal | None:
    """The grammar's forced tokens as a point-mass chain of at most `limit` (the row's K), or None."""
    if state is None:
        return None
    forced = state.forced(limit)
    if not forced:
        return None
    state.jump_forward_tokens += len(forced)
    return Proposal(forced, list(range(-1, len(forced) - 1)), None, GRAMMAR)
