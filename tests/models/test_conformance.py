"""The model interface (models/base.CausalLM), checked once for every backend: the built-in n-gram
pair (target and draft), pdspec's own Llama (each family variant of hf_fixtures.FAMILY_CASES), the
transformers fallback (a draft over a d2t map or a vocabulary intersection) and the paged pool
(engine/paged_lm.py, against the contiguous store of the same checkpoint as its oracle).

* a prompt's logits, and the same tokens fed in steps with rejected drafts truncated away, equal
  one forward over the whole sequence;
* a ragged batch equals each request alone, and the states continue alike;
* an exported state imports without recomputing anything and continues identically;
* each tree token's logits equal its own path fed as a chain, and the accepted path continues
  as that chain would.
Float backends compare within tests/tolerance.py's bound; the n-gram tables exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from engine.paged_lm import PagedLlamaLM, bytes_per_token
from models.base import CausalLM
from models.checkpoint import load_hf_llama
from models.hf import load_hf_pair
from models.ngram import load_builtin_pair
from models.tokenizer import ByteTokenizer
from tests.models.hf_fixtures import FAMILY_CASES, make_family_checkpoint, make_pair_dirs
from tests.tolerance import assert_fp_close, model_roundings

NGRAM_TEXT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 20 + "naïve café ☕\n"
PAGED = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 12}}

NGRAM_BACKENDS = ["ngram-target", "ngram-draft"]
LLAMA_BACKENDS = [f"llama:{case}" for case in FAMILY_CASES]
HF_BACKENDS = [f"hf-{role}:{kind}" for kind in ("d2t", "intersection") for role in ("target", "draft")]
PAGED_BACKENDS = [f"paged:{family}" for family in PAGED]
BACKENDS = NGRAM_BACKENDS + LLAMA_BACKENDS + HF_BACKENDS + PAGED_BACKENDS
TREE_BACKENDS = NGRAM_BACKENDS + LLAMA_BACKENDS + PAGED_BACKENDS  # transformers verifies chains only


@dataclass
class Backend:
    model: CausalLM
    reference: CausalLM  # what its logits must equal: itself, or (the paged pool) the contiguous store
    ids: Callable[[int, int], list[int]]  # (length, seed) -> input ids
    kv_tensors: int  # the tensors of its KV layout
    exact: bool = False  # an n-gram table's lookups: no arithmetic to reorder, compared with atol=0
    exact_import: bool = False  # an imported state continues bit for bit
    # False for dynamic NTK, whose keys depend on the length at which they were computed: the same
    # tokens fed in other steps (or as a tree) give other logits
    stepwise: bool = True

    def close(self, got: torch.Tensor, want: torch.Tensor, exact: bool | None = None) -> None:
        if self.exact if exact is None else exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert_fp_close(got, want, model_roundings(self.reference))

    def fresh(self, model: CausalLM, prompt: list[int], room: int = 48):
        logits, state = model.prefill(prompt)
        model.reserve(state, len(prompt) + room)
        return logits, state

    def released(self) -> None:
        """Every state a check made was released: a pool has all its blocks back."""
        pool = getattr(self.model, "pool", None)
        assert pool is None or pool.used_blocks == 0


def random_ids(vocab: int) -> Callable[[int, int], list[int]]:
    return lambda n, seed: torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def text_ids(n: int, seed: int) -> list[int]:
    """Byte ids of the n-gram corpus from offset 7 * seed: contexts the tables have seen."""
    ids = ByteTokenizer().encode(NGRAM_TEXT)
    return ids[7 * seed : 7 * seed + n]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Backends by name, each built once for the module (a pair serves both of its models)."""
    cache: dict[str, Backend] = {}

    def build(name: str) -> Backend:
        if name in cache:
            return cache[name]
        kind, _, variant = name.partition(":")
        if kind.startswith("ngram"):
            corpus = tmp_path_factory.mktemp("corpus")
            (corpus / "a.py").write_text(NGRAM_TEXT)
            (corpus / "b.txt").write_text("hello world\n" * 50)
            pair = load_builtin_pair(corpus, cache_dir=tmp_path_factory.mktemp("cache"))
            for role, model in (("target", pair.target), ("draft", pair.draft)):
                cache[f"ngram-{role}"] = Backend(model, model, text_ids, 0, exact=True, exact_import=True)
        elif kind == "llama" or kind == "llama-bf16":
            model_type, overrides = FAMILY_CASES[variant] if kind == "llama" else ("llama", {})
            seed = 3 if kind == "llama" else 4
            path = make_family_checkpoint(
                tmp_path_factory.mktemp(name.replace(":", "-")), model_type, seed=seed, **overrides
            )
            model = load_hf_llama(path, dtype=torch.float32 if kind == "llama" else torch.bfloat16)
            cache[name] = Backend(
                model, model, random_ids(model.vocab_size), 4, exact_import=True, stepwise="dynamic" not in variant
            )
        elif kind.startswith("hf-"):
            target_dir, draft_dir = make_pair_dirs(tmp_path_factory.mktemp(f"hf-{variant}"), draft_kind=variant)
            pair = load_hf_pair(target_dir, draft_dir)
            ids = random_ids(pair.target.vocab_size)  # a draft reads target ids
            for role, model, layers in (("target", pair.target, 2), ("draft", pair.draft, 1)):
                cache[f"hf-{role}:{variant}"] = Backend(model, model, ids, 2 * layers)
        elif kind == "paged":
            path = make_family_checkpoint(
                tmp_path_factory.mktemp(f"paged-{variant}"), variant, seed=5, **PAGED[variant]
            )
            contiguous = load_hf_llama(path, dtype=torch.float32)
            paged = PagedLlamaLM.with_pool(load_hf_llama(path, dtype=torch.float32), 1024 * bytes_per_token(contiguous))
            cache[name] = Backend(paged, contiguous, random_ids(contiguous.vocab_size), 4)
        return cache[name]

    return build


@pytest.fixture(params=BACKENDS)
def backend(request, built) -> Backend:
    return built(request.param)


def test_a_prompt_and_the_same_tokens_in_steps_equal_one_forward(backend):
    """The prompt path, and a prefix then steps with rejected drafts truncated away, give the
    logits of one forward over the whole sequence."""
    if not backend.stepwise:
        pytest.skip("dynamic-NTK: a key depends on the length at which it was computed")
    model, reference = backend.model, backend.reference
    ids = backend.ids(40, 0)
    first, whole = backend.fresh(reference, ids[:1])
    want = torch.cat([first[None], reference.extend(whole, ids[1:])])  # row i: after ids[i]
    last, prompt = backend.fresh(model, ids)
    backend.close(last, want[-1])
    logits, state = backend.fresh(model, ids[:12])
    backend.close(logits, want[11])
    a = model.extend(state, ids[12:15])
    model.extend(state, [5, 6, 7, 8])  # rejected drafts (into the paged pool's next block, and back)
    model.truncate(state, 15)
    b = model.extend(state, ids[15:])
    backend.close(torch.cat([a, b]), want[12:])
    assert state.tokens == ids
    with pytest.raises(ValueError, match=r"length: expected 0\.\.40, got 41"):
        model.truncate(state, 41)
    for model_, state_ in ((model, state), (model, prompt), (reference, whole)):
        model_.release(state_)
    backend.released()


def test_a_ragged_batch_equals_each_request_alone(backend):
    """Ragged prompts and ragged new tokens (one row empty) in one forward, every new position
    computed once; each row's logits and its state's continuation are those of the row alone."""
    if not backend.stepwise:
        pytest.skip("dynamic-NTK: a key depends on the length at which it was computed")
    model, reference = backend.model, backend.reference
    prompts = [backend.ids(n, seed) for seed, n in enumerate((5, 17, 1, 3))]
    news = [backend.ids(n, 10 + i) for i, n in enumerate((3, 1, 6, 0))]
    states = [backend.fresh(model, p)[1] for p in prompts]
    before = getattr(model, "positions_computed", None)
    batched = model.extend_batch(states, news)
    if before is not None:
        assert model.positions_computed - before == sum(map(len, news))  # one forward, each position once
    for prompt, new, got, state in zip(prompts, news, batched, states, strict=True):
        _, alone = backend.fresh(reference, prompt)
        backend.close(got, reference.extend(alone, new))
        assert state.tokens == alone.tokens
        backend.close(model.extend(state, [3]), reference.extend(alone, [3]))
        reference.release(alone)
        model.release(state)
    backend.released()


@pytest.mark.parametrize("name", [*BACKENDS, "llama-bf16"])
def test_an_exported_state_imports_without_recomputing_and_continues_identically(built, name):
    """export_state gives the KV layout's tensors (the oracle's values, for the paged pool);
    import_state rebuilds the state without a forward, and it continues as the original does."""
    backend = built(name)
    model, reference = backend.model, backend.reference
    ids = backend.ids(33, 4)
    _, state = backend.fresh(model, ids)
    tensors = model.export_state(state)
    assert len(tensors) == len(model.kv_layout) == backend.kv_tensors
    for tensor, spec in zip(tensors, model.kv_layout, strict=True):
        assert tuple(tensor.shape) == spec.shape_for(len(ids)) and tensor.dtype == spec.dtype
    original = state
    if reference is not model:
        _, original = backend.fresh(reference, ids)
        for got, want in zip(tensors, reference.export_state(original), strict=True):
            backend.close(got, want)
    before = getattr(model, "positions_computed", None)
    clone = model.import_state([t.clone() for t in tensors], ids)
    if before is not None:
        assert model.positions_computed == before  # the prompt was not recomputed
    assert clone.tokens == ids
    model.reserve(clone, len(ids) + 8)
    new = backend.ids(2, 5)
    want = reference.extend(original, new)
    backend.close(model.extend(clone, new), want, exact=backend.exact_import if reference is model else None)
    if reference is not model:
        backend.close(model.extend(state, new), want)
    if tensors:
        with pytest.raises(ValueError, match=r"tensors\[0\]: expected"):
            model.import_state([t[:, :-1] for t in tensors], ids)
    model.release(clone)
    model.release(state)
    if reference is not model:
        reference.release(original)
    backend.released()


# A tree in BFS order: two root children, the first with two children, one grandchild.
TREE = [5, 9, 7, 3, 4]
PARENTS = [-1, -1, 0, 0, 2]
PATHS = {0: [5], 1: [9], 2: [5, 7], 3: [5, 3], 4: [5, 7, 4]}


@pytest.mark.parametrize("name", TREE_BACKENDS)
def test_tree_tokens_equal_each_path_as_a_chain(built, name):
    """Each tree token's logits are its own path's as a chain; the accepted path continues as the
    chain does (its KV moved into line); a tree grown over two calls (a draft expanding depth by
    depth) and a tree accepting nothing. The prompt is past every sliding window of the cases."""
    backend = built(name)
    if not backend.stepwise:
        pytest.skip("dynamic-NTK: a key depends on the length at which it was computed")
    model, reference = backend.model, backend.reference

    def chain(tokens: list[int], path: list[int]) -> torch.Tensor:
        _, state = backend.fresh(reference, tokens)
        logits = reference.extend(state, path)
        reference.release(state)
        return logits

    prompt = backend.ids(30, 7)
    _, state = backend.fresh(model, prompt)
    tree_logits = model.extend_tree([state], [TREE], [PARENTS])[0]
    for node, path in PATHS.items():
        backend.close(tree_logits[node], chain(prompt, path)[-1])
    # Keep the path 0 -> 2 -> 4 and go on: the same logits as the chain [5, 7, 4] then [8].
    model.accept_tree(state, [0, 2, 4])
    assert state.tokens == [*prompt, 5, 7, 4] and state.tree is None
    backend.close(model.extend(state, [8]), chain(prompt, [5, 7, 4, 8])[-1:])
    first = model.extend_tree([state], [[1, 2]], [[-1, -1]])[0]
    second = model.extend_tree([state], [[6]], [[1]])[0]
    backend.close(first[1], chain([*prompt, 5, 7, 4, 8], [2])[-1])
    backend.close(second[0], chain([*prompt, 5, 7, 4, 8], [2, 6])[-1])
    model.accept_tree(state, [])  # nothing accepted: back to the history
    assert state.tokens == [*prompt, 5, 7, 4, 8]
    model.release(state)
    backend.released()


@pytest.mark.parametrize("name", LLAMA_BACKENDS + PAGED_BACKENDS)
def test_bad_trees_are_refused(built, name):
    backend = built(name)
    model = backend.model
    _, state = backend.fresh(model, [2, 3, 4])
    with pytest.raises(ValueError, match=r"parents\[1\]: expected -1..0"):
        model.extend_tree([state], [[5, 6]], [[-1, 3]])
    model.release(state)
    _, state = backend.fresh(model, [2, 3, 4])
    model.extend_tree([state], [[5, 6]], [[-1, -1]])
    with pytest.raises(ValueError, match="a tree is open"):
        model.extend(state, [7])
    with pytest.raises(ValueError, match=r"keep\[1\]: expected a child of tree token 0, got 1"):
        model.accept_tree(state, [0, 1])
    model.release(state)
    backend.released()
