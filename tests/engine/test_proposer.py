"""Drafting with the drawn ids kept on the device (a paged draft takes its tree tokens as a
device tensor) gives the trees, laws and draft states of drafting read back depth by depth."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from engine.draft_model import draft_tokens
from engine.paged_lm import bytes_per_token, paged_pair
from engine.proposer import shape_nodes
from models.loader import load_pair
from sampling import SamplingParams, SamplingTensors
from sampling.proposal import DraftLaw
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer


class HostFed:
    """The same draft without device-fed tree tokens: the host reads every depth's ids."""

    device_tokens = False

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("proposer"), "llama", seed=3, layers=2)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    raw = load_pair(target_model=path, draft_layers=1, dtype=torch.float32)
    return paged_pair(raw, 4096 * (bytes_per_token(raw.target) + bytes_per_token(raw.draft)))


SHAPES = {
    "chains": [(1, 1, 1, 1), (1, 1), (1, 1, 1, 1)],
    "trees": [(2, 2, 1), (4, 1), (1, 1, 1)],
}


@pytest.mark.parametrize("law", list(DraftLaw))
@pytest.mark.parametrize("kind", list(SHAPES))
def test_device_fed_drafting_equals_host_fed(pair, law, kind):
    shapes = SHAPES[kind]
    params = [
        SamplingParams(do_sample=True, temperature=1.3),
        SamplingParams(),
        SamplingParams(do_sample=True, top_k=7),
    ]
    prompts = [list(range(5, 14 + 4 * r)) for r in range(len(shapes))]
    gen = torch.Generator().manual_seed(len(kind))
    uniforms = torch.rand(len(shapes), max(shape_nodes(s) for s in shapes), generator=gen)
    results = []
    for draft in (pair.draft, HostFed(pair.draft)):
        states = []
        for prompt in prompts:
            state = pair.draft.prefill(prompt[:-1])[1]
            pair.draft.reserve(state, len(prompt) + 40)
            states.append(state)
        drafted = draft_tokens(
            draft,
            pair.d2t,
            law,
            states,
            [p[-1:] for p in prompts],
            shapes,
            SamplingTensors.from_params(params),
            uniforms,
        )
        results.append((drafted, [list(s.tokens) for s in states]))
        for state in states:
            pair.draft.release(state)
    (fed, fed_tokens), (read, read_tokens) = results
    assert fed_tokens == read_tokens and min(min(t) for t in fed_tokens) >= 0  # no placeholder left
    for a, b, shape in zip(fed, read, shapes, strict=True):
        assert (a.draft_ids, a.target_ids, a.parents) == (b.draft_ids, b.target_ids, b.parents)
        assert len(a.draft_ids) == shape_nodes(shape) or law is DraftLaw.STOCHASTIC
        assert (a.probs is None) == (b.probs is None) == (law is DraftLaw.POINT_MASS)
        if a.probs is not None:
            assert torch.equal(a.probs, b.probs)
    assert pair.draft.pool.used_blocks == 0


class NanDraft(HostFed):
    """The paged draft with non-finite logits: no draw of a stochastic law finds mass."""

    device_tokens = True

    def extend_batch(self, states, ids):
        return [row * float("nan") for row in self._model.extend_batch(states, ids)]

    def extend_tree(self, states, ids, parents, device_tokens=None):
        return [row * float("nan") for row in self._model.extend_tree(states, ids, parents, device_tokens)]


def test_a_draw_without_mass_fed_unread_proposes_a_point_mass(pair):
    state = pair.draft.prefill(list(range(5, 14)))[1]
    pair.draft.reserve(state, 40)
    try:
        (drafted,) = draft_tokens(
            NanDraft(pair.draft),
            pair.d2t,
            DraftLaw.STOCHASTIC,
            [state],
            [[14]],
            [(1, 1, 1)],
            SamplingTensors.from_params([SamplingParams(do_sample=True)]),
            torch.rand(1, 3, generator=torch.Generator().manual_seed(0)),
        )
    finally:
        pair.draft.release(state)
    assert drafted.parents == [-1, 0, 1] and len(drafted.draft_ids) == 3
    one_hot = torch.zeros(3, pair.draft.vocab_size)
    one_hot[torch.arange(3), torch.tensor(drafted.draft_ids)] = 1.0
    assert torch.equal(drafted.probs, one_hot)
