"""The built-in model pair: byte-level n-gram target and a smaller-vocabulary draft.

* target: order-5 byte model over 257 ids (bytes 0..255, EOS = 256);
* draft: order-3 model over 98 ids (EOS, tab, newline, printable ASCII) that reads the
  same byte history; d2t maps each draft id to its byte (a non-identity map);
* both Witten-Bell smoothed down to a uniform distribution, so every id has p > 0,
  and both expose their exact next-token probabilities (`next_token_probs`);
* trained from a corpus in seconds with numpy (every file framed by EOS, which doubles
  as the start symbol), cached on disk keyed by the corpus hash.

The default corpus is the running Python's standard-library `.py` sources (sorted paths,
capped at CORPUS_CAP bytes); `--corpus PATH` (a file or a directory of text files)
overrides it. Their state is the token ids alone: no KV tensors travel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.cache import cache_dir as pdspec_cache_dir
from models.base import ChunkedImport, GrowingKv, State, close_span, extend_span
from models.pair import ModelPair
from models.tokenizer import ByteTokenizer
from protos.kv_layout import KvTensorSpec
from sampling import DraftToTargetMap

log = logging.getLogger(__name__)
EOS = 256
ALPHABET = 257  # input ids: bytes and EOS
TARGET_ORDER = 5
DRAFT_ORDER = 3
DRAFT_BYTES = (9, 10, *range(32, 127))  # tab, newline, printable ASCII
DRAFT_TO_TARGET = (EOS, *DRAFT_BYTES)  # draft id -> target id
CORPUS_CAP = 3 << 20
CACHE_VERSION = 1


@dataclass(frozen=True)
class NgramTables:
    """Counts for context lengths 0..order-1 (codes are base-ALPHABET integers)."""

    order: int
    vocab: int  # output ids
    ctx_codes: tuple[np.ndarray, ...]  # sorted context codes
    ctx_total: tuple[np.ndarray, ...]  # c(h)
    ctx_types: tuple[np.ndarray, ...]  # distinct successors N1+(h)
    pair_codes: tuple[np.ndarray, ...]  # sorted ctx_code * vocab + output id
    pair_counts: tuple[np.ndarray, ...]


def train_tables(tokens: np.ndarray, order: int, vocab: int, output_of: np.ndarray) -> NgramTables:
    """Count (context, next) pairs; `output_of[token]` is the output id (-1 = not predicted)."""
    outputs = output_of[tokens]
    tables = {name: [] for name in ("ctx_codes", "ctx_total", "ctx_types", "pair_codes", "pair_counts")}
    for n in range(order):
        codes = np.zeros(len(tokens) - n, dtype=np.int64)
        for j in range(n):  # code of tokens[i-n:i] for each position i >= n
            codes = codes * ALPHABET + tokens[j : len(tokens) - n + j]
        nxt = outputs[n:]
        keep = nxt >= 0
        pairs, counts = np.unique(codes[keep] * vocab + nxt[keep], return_counts=True)
        contexts, first, types = np.unique(pairs // vocab, return_index=True, return_counts=True)
        tables["ctx_codes"].append(contexts)
        tables["ctx_total"].append(np.add.reduceat(counts, first))
        tables["ctx_types"].append(types)
        tables["pair_codes"].append(pairs)
        tables["pair_counts"].append(counts)
    return NgramTables(order, vocab, **{k: tuple(v) for k, v in tables.items()})


class NgramModel(ChunkedImport, GrowingKv):
    """Witten-Bell interpolated n-gram over byte histories."""

    kv_layout: tuple[KvTensorSpec, ...] = ()
    eos_token_ids: tuple[int, ...]

    def __init__(self, name: str, tables: NgramTables, eos_id: int, cache_size: int = 1 << 13) -> None:
        self.name = name
        self.tables = tables
        self.vocab_size = tables.vocab
        self.eos_token_ids = (eos_id,)
        self._probs_for_suffix = functools.lru_cache(maxsize=cache_size)(self._probs_for_suffix)
        self._logits_for_suffix = functools.lru_cache(maxsize=cache_size)(self._log_probs)

    def next_token_probs(self, history: Sequence[int]) -> np.ndarray:
        """Exact p(next | history) over the output vocabulary, float64 [V], sums to 1.

        Only the last order-1 tokens matter, so results are cached by that suffix (a
        server sees the same contexts again and again); the array is read-only."""
        suffix = tuple(int(t) for t in history[max(0, len(history) - self.tables.order + 1) :])
        return self._probs_for_suffix(suffix)

    def _probs_for_suffix(self, history: tuple[int, ...]) -> np.ndarray:
        t = self.tables
        probs = np.full(t.vocab, 1.0 / t.vocab)
        for n in range(min(t.order, len(history) + 1)):
            ctx = _context_code(history, n)
            i = np.searchsorted(t.ctx_codes[n], ctx)
            if i == len(t.ctx_codes[n]) or t.ctx_codes[n][i] != ctx:
                continue  # unseen context: keep the lower-order estimate
            lo, hi = np.searchsorted(t.pair_codes[n], [ctx * t.vocab, (ctx + 1) * t.vocab])
            counts = np.zeros(t.vocab)
            counts[t.pair_codes[n][lo:hi] - ctx * t.vocab] = t.pair_counts[n][lo:hi]
            total, types = t.ctx_total[n][i], t.ctx_types[n][i]
            probs = (counts + types * probs) / (total + types)
        probs.flags.writeable = False
        return probs

    def _logits(self, history: Sequence[int]) -> torch.Tensor:
        suffix = tuple(int(t) for t in history[max(0, len(history) - self.tables.order + 1) :])
        return self._logits_for_suffix(suffix)

    def _log_probs(self, suffix: tuple[int, ...]) -> torch.Tensor:
        logits = torch.from_numpy(np.log(self._probs_for_suffix(suffix))).float()
        logits.requires_grad_(False)
        return logits

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, State]:
        if not ids:
            raise ValueError("ids: expected a non-empty prompt, got []")
        state = State(tokens=list(ids))
        return self._logits(state.tokens).clone(), state

    def extend(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        rows = []
        for token in ids:
            state.tokens.append(int(token))
            rows.append(self._logits(state.tokens))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return [self.extend(state, new) for state, new in zip(states, ids, strict=True)]

    def empty_state(self) -> State:
        return State(tokens=[])

    supports_trees = True

    def extend_tree(
        self, states: Sequence[State], ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Each tree token's logits from the history plus its own path (its ancestors)."""
        if not len(states) == len(ids) == len(parents):
            raise ValueError(f"ids/parents: expected {len(states)} rows each, got {len(ids)} and {len(parents)}")
        out = []
        for state, row, row_parents in zip(states, ids, parents, strict=True):
            start, _ = extend_span(state, row, row_parents)
            state.tokens += [int(t) for t in row]
            tree = state.tree
            history = state.tokens[: tree.base]
            logits = []
            for t in range(start, len(tree.parents)):
                path, node = [], t
                while node >= 0:
                    path.append(state.tokens[tree.base + node])
                    node = tree.parents[node]
                logits.append(self._logits(history + path[::-1]))
            out.append(torch.stack(logits) if logits else torch.empty(0, self.vocab_size))
        return out

    def accept_tree(self, state: State, keep: Sequence[int]) -> None:
        close_span(state, keep)

    def truncate(self, state: State, length: int) -> None:
        if not 0 <= length <= len(state.tokens):
            raise ValueError(f"length: expected 0..{len(state.tokens)}, got {length}")
        del state.tokens[length:]

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        return []  # the token ids are the whole state

    def begin_import(self, tokens: Sequence[int], reserve: int) -> State:
        return State(tokens=list(tokens))  # no KV tensors: nothing to reserve or write

    def finish_import(self, state: State) -> None:
        pass


def _context_code(history: Sequence[int], n: int) -> int:
    code = 0
    for token in history[len(history) - n :] if n else ():
        code = code * ALPHABET + int(token)
    return code


def default_corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts), key=lambda p: p.as_posix())


def corpus_files(corpus: Path | None) -> list[Path]:
    if corpus is None:
        return default_corpus_files()
    if corpus.is_file():
        return [corpus]
    if corpus.is_dir():
        files = sorted((p for p in corpus.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
        if files:
            return files
        raise ValueError(f"corpus: expected a directory with files, got an empty directory {corpus}")
    raise ValueError(f"corpus: expected an existing file or directory, got {corpus}")


def load_builtin_pair(corpus: Path | None = None, cache_dir: Path | None = None) -> ModelPair:
    """Train (or load from the cache) the built-in pair on `corpus`."""
    files = corpus_files(corpus)
    tokens = _token_array(files)
    digest = hashlib.sha256(tokens.tobytes() + f"v{CACHE_VERSION}".encode()).hexdigest()
    path = (cache_dir or pdspec_cache_dir()) / f"ngram-{digest[:20]}.npz"
    target_tables, draft_tables = _load_tables(path) if path.exists() else (None, None)
    if target_tables is None:
        log.info(
            "training the built-in n-gram pair on %d bytes of %d files (first start only; cached at %s)",
            len(tokens),
            len(files),
            path,
        )
        identity = np.arange(ALPHABET, dtype=np.int64)
        to_draft = np.full(ALPHABET, -1, dtype=np.int64)
        to_draft[list(DRAFT_TO_TARGET)] = np.arange(len(DRAFT_TO_TARGET))
        target_tables = train_tables(tokens, TARGET_ORDER, ALPHABET, identity)
        draft_tables = train_tables(tokens, DRAFT_ORDER, len(DRAFT_TO_TARGET), to_draft)
        _save_tables(path, target_tables, draft_tables)
    tag = digest[:12]
    return ModelPair(
        target=NgramModel(f"pdspec-ngram-target:order{TARGET_ORDER}:corpus-{tag}", target_tables, EOS),
        draft=NgramModel(f"pdspec-ngram-draft:order{DRAFT_ORDER}:corpus-{tag}", draft_tables, 0),
        d2t=DraftToTargetMap(torch.tensor(DRAFT_TO_TARGET), ALPHABET),
        tokenizer=ByteTokenizer(special_ids=(EOS,)),
    )


def _token_array(files: Sequence[Path], cap: int = CORPUS_CAP) -> np.ndarray:
    """int64 ids: EOS, file 1, EOS, file 2, ..., EOS; at most `cap` bytes of text."""
    parts, size = [np.array([EOS])], 0
    for path in files:
        try:
            data = path.read_bytes()[: cap - size]
        except OSError:
            continue
        parts += [np.frombuffer(data, dtype=np.uint8).astype(np.int64), np.array([EOS])]
        size += len(data)
        if size >= cap:
            break
    if not size:
        raise ValueError(f"corpus: expected some text, got {len(files)} files with none readable")
    return np.concatenate(parts)


_FIELDS = ("ctx_codes", "ctx_total", "ctx_types", "pair_codes", "pair_counts")


def _save_tables(path: Path, *tables: NgramTables) -> None:
    arrays = {}
    for which, t in zip(("target", "draft"), tables, strict=True):
        arrays[f"{which}_meta"] = np.array([t.order, t.vocab])
        for name in _FIELDS:
            for n, array in enumerate(getattr(t, name)):
                arrays[f"{which}_{name}_{n}"] = array
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)  # atomic: concurrent first starts never read a half-written cache


def _load_tables(path: Path) -> tuple[NgramTables | None, NgramTables | None]:
    try:
        with np.load(path) as data:
            out = []
            for which in ("target", "draft"):
                order, vocab = (int(x) for x in data[f"{which}_meta"])
                fields = {name: tuple(data[f"{which}_{name}_{n}"] for n in range(order)) for name in _FIELDS}
                out.append(NgramTables(order, vocab, **fields))
            return out[0], out[1]
    except (OSError, KeyError, ValueError):
        return None, None  # unreadable cache: retrain
