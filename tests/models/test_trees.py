"""Candidate trees through every model backend: each tree token's logits equal those of
its own path extended as a chain, and the accepted path continues exactly as a chain would
(its KV moved into line). The contiguous Llama store, the paged pool and the n-gram pair."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from engine.paged_lm import PagedLlamaLM, bytes_per_token
from models.checkpoint import load_hf_llama
from models.ngram import load_builtin_pair
from tests.models.hf_fixtures import make_family_checkpoint
from tests.tolerance import assert_fp_close, model_roundings

# A tree in BFS order: two root children, the first with two children, one grandchild.
TREE = [5, 9, 7, 3, 4]
PARENTS = [-1, -1, 0, 0, 2]
PATHS = {0: [5], 1: [9], 2: [5, 7], 3: [5, 3], 4: [5, 7, 4]}


@pytest.fixture(scope="module", params=["llama", "mistral"])
def llama_models(request, tmp_path_factory):
    overrides = {"sliding_window": 6} if request.param == "mistral" else {}
    path = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3, **overrides)
    contiguous = load_hf_llama(path, dtype=torch.float32)
    paged = PagedLlamaLM.with_pool(load_hf_llama(path, dtype=torch.float32), 2048 * bytes_per_token(contiguous))
    return {"contiguous": contiguous, "paged": paged}


def fresh(model, prompt):
    _, state = model.prefill(prompt)
    model.reserve(state, len(prompt) + 32)
    return state


def check_tree(model, prompt, exact: bool = False):
    def close(got, want):  # exact: an n-gram table's lookups, no arithmetic to reorder
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert_fp_close(got, want, model_roundings(model))

    state = fresh(model, prompt)
    tree_logits = model.extend_tree([state], [TREE], [PARENTS])[0]
    for node, path in PATHS.items():
        chain = fresh(model, prompt)
        want = model.extend(chain, path)[-1]
        close(tree_logits[node], want)
        model.release(chain)
    # Keep the path 0 -> 2 -> 4 and go on: the same logits as the chain [5, 7, 4] then [8].
    model.accept_tree(state, [0, 2, 4])
    assert state.tokens == [*prompt, 5, 7, 4] and state.tree is None
    chain = fresh(model, prompt)
    model.extend(chain, [5, 7, 4])
    close(model.extend(state, [8]), model.extend(chain, [8]))
    # A second tree grown over two calls (a draft expanding depth by depth).
    first = model.extend_tree([state], [[1, 2]], [[-1, -1]])[0]
    second = model.extend_tree([state], [[6]], [[1]])[0]
    close(first[1], model.extend(fresh(model, [*prompt, 5, 7, 4, 8]), [2])[-1])
    close(second[0], model.extend(fresh(model, [*prompt, 5, 7, 4, 8]), [2, 6])[-1])
    model.accept_tree(state, [])  # nothing accepted: back to the history
    assert state.tokens == [*prompt, 5, 7, 4, 8]
    model.release(state)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_llama_tree_logits_equal_each_path_as_a_chain(llama_models, kind):
    prompt = list(range(2, 13))  # past the sliding window of the mistral fixture
    check_tree(llama_models[kind], prompt)


def test_ngram_tree_logits_equal_each_path_as_a_chain():
    pair = load_builtin_pair()
    for model in (pair.target, pair.draft):
        check_tree(model, [104, 101, 108, 108, 111, 32], exact=True)


def test_bad_trees_are_refused(llama_models):
    model = llama_models["contiguous"]
    state = fresh(model, [2, 3, 4])
    with pytest.raises(ValueError, match=r"parents\[1\]: expected -1..0"):
        model.extend_tree([state], [[5, 6]], [[-1, 3]])
    state = fresh(model, [2, 3, 4])
    model.extend_tree([state], [[5, 6]], [[-1, -1]])
    with pytest.raises(ValueError, match="a tree is open"):
        model.extend(state, [7])
    with pytest.raises(ValueError, match=r"keep\[1\]: expected a child of tree token 0, got 1"):
        model.accept_tree(state, [0, 1])
