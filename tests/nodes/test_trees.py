"""Multi-draft trees through both nodes over real gRPC: a tiny random Llama (paged pool on the
CPU) with a 1-layer layer-skip draft, stochastic draft law (point-mass trees: the distribution
tests and the GPU tests). Greedy trees emit exactly the K = 0 tokens; a seeded
stochastic request gives the same tokens alone and in a batch; the stats and metrics count
accepted nodes by depth and by candidate rank; a decode node refuses trees it cannot verify."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig
from sampling.proposal import DraftLaw
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer
from tests.nodes.conftest import cluster

PROMPT = list(range(3, 19))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=7)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    pair = load_pair(target_model=str(path), draft_layers=1)
    law = DraftLaw.STOCHASTIC  # dense laws on the wire; greedy rows draft top-k with one-hot laws
    with cluster(
        pair,
        DecodeConfig(spec=SpeculativeConfig(draft_law=law, max_draft_candidates=4)),
        PrefillConfig(spec=SpeculativeConfig(draft_law=law, max_draft_candidates=4)),
    ) as running:
        yield running


@pytest.mark.parametrize(("k", "candidates"), [(3, 2), (2, 4), (4, 3)])
def test_greedy_trees_emit_the_k0_tokens(nodes, k, candidates):
    client, _, _ = nodes
    plain = client.generate(prompt_token_ids=PROMPT, max_new_tokens=24, greedy=True, num_speculative_tokens=0)
    tree = client.generate(
        prompt_token_ids=PROMPT, max_new_tokens=24, greedy=True, num_speculative_tokens=k, draft_candidates=candidates
    )
    assert tree.token_ids == plain.token_ids
    stats = tree.stats
    assert stats.verify_steps > 0 and stats.draft_tokens > k * stats.verify_steps  # trees, not chains
    assert sum(stats.accepted_per_position) == sum(stats.accepted_per_rank) == stats.accepted_tokens
    assert len(stats.accepted_per_rank) >= candidates


def test_seeded_trees_are_reproducible_alone_and_in_a_batch(nodes):
    client, _, _ = nodes

    def run(seed):
        return client.generate(
            prompt_token_ids=PROMPT,
            max_new_tokens=20,
            temperature=1.0,
            seed=seed,
            num_speculative_tokens=3,
            draft_candidates=2,
        ).token_ids

    alone = [run(seed) for seed in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        batched = list(pool.map(run, [*range(4), *range(100, 104)]))
    assert batched[:4] == alone
    assert len({tuple(t) for t in alone}) > 1  # seeds matter


def test_rank_metrics_and_info(nodes):
    client, _, decode = nodes
    info = client.info()
    assert info.max_draft_candidates == 4 and info.max_tree_nodes == 64
    client.generate(
        prompt_token_ids=PROMPT, max_new_tokens=16, greedy=True, num_speculative_tokens=2, draft_candidates=4
    )
    text = decode.metrics.registry  # the decode node's own registry
    samples = {
        (s.labels.get("do_sample"), s.labels.get("rank")): s.value
        for family in text.collect()
        if family.name == "pdspec_spec_accepted_tokens_per_rank"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert sum(v for (mode, _), v in samples.items() if mode == "false") > 0


def test_too_many_candidates_is_invalid_argument(nodes):
    client, _, _ = nodes
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt_token_ids=PROMPT, max_new_tokens=4, num_speculative_tokens=2, draft_candidates=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft_candidates: expected 1..4, got 5" in err.value.details()


def test_decode_validates_the_tree():
    """Structural checks at the decode boundary (protos/validation.check_tree)."""
    from protos.validation import Violation, check_tree

    def problems(parents, depth=3, candidates=2, max_nodes=64):
        found: list[Violation] = []
        check_tree(parents, len(parents), depth, candidates, max_nodes, found)
        return [str(v) for v in found]

    assert problems([-1, -1, 0, 0, 1, 1]) == []
    assert problems([-1, 0, -1]) == [
        "proposal.parents[2]: expected 0..1 (breadth-first, parents never decrease), got -1"
    ]
    assert problems([-1, -1, -1]) == [
        "proposal.parents[2]: expected at most 2 children per node (draft_candidates), got 3"
    ]
    assert problems([-1, 0, 1, 2]) == [
        "proposal.parents[3]: expected a node at depth <= 3 (num_speculative_tokens), got depth 4"
    ]
    assert problems([-1, 5]) == ["proposal.parents[1]: expected -1..0 (breadth-first, parents never decrease), got 5"]
    assert problems([-1] * 3, candidates=4, max_nodes=2) == [
        "proposal.token_ids: expected at most 2 tree nodes (--max-tree-nodes), got 3"
    ]
