"""A hidden-state head on a GPU (`make test-gpu`): the target's features kept by CUDA-graph
replays equal an eager forward's, and through both nodes greedy and seeded point-mass requests
give the tokens of K = 0, alone and in a batch, with every KV block back in the pool."""

from __future__ import annotations

from concurrent import futures

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig
from engine.paged_lm import GraphCapture, paged_pair
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig
from tests.models.eagle_fixtures import make_head_dir, make_target
from tests.nodes.conftest import cluster, wait_until
from tests.tolerance import assert_fp_close, model_roundings

pytestmark = pytest.mark.gpu
PROMPT = list(range(3, 20))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-eagle")
    target = make_target(root / "target", layers=3)
    return target, make_head_dir(target, root / "head")


def test_graph_replays_keep_the_eager_features(dirs):
    pair = load_pair(target_model=dirs[0], draft_model=dirs[1], device="cuda", dtype=torch.float32)
    paged = paged_pair(pair, 1 << 24, capture=GraphCapture(batch=4, context=64, target_queries=(1, 4)))
    eager_pair = load_pair(target_model=dirs[0], draft_model=dirs[1], device="cuda", dtype=torch.float32)
    eager = paged_pair(eager_pair, 1 << 24, eager=True)
    features = []
    for target in (paged.target, eager.target):
        state = target.empty_state()
        target.reserve(state, 40)
        target.extend_last([state], [PROMPT])
        target.extend_tree([state], [[5, 6, 7, 8]], [[-1, 0, 1, 2]])  # 4 queries: a replay where captured
        target.accept_tree(state, [0, 1, 2, 3])
        features.append(state.features)
        target.release(state)
    assert features[0].shape == (len(PROMPT) + 4, 3 * 32)
    assert_fp_close(features[0], features[1], model_roundings(pair.target))


def test_chain_replays_are_the_eager_chain(dirs):
    """The head's drafting depths captured at start-up (one graph per row bucket up to the
    capture's batch, one width) replay what an eager chain computes, for rows of different
    lengths padded into a larger row bucket, and leave the rows' own KV as it was."""
    pair = load_pair(target_model=dirs[0], draft_model=dirs[1], device="cuda", dtype=torch.float32)
    paged = paged_pair(pair, 1 << 24, capture=GraphCapture(batch=4, context=64, target_queries=(1,)))
    head, eager = paged.draft, pair.draft
    assert eager.chain_graphs is None and sorted(head.chain_graphs.graphs) == [(1, 256), (2, 256), (4, 256)]
    width = len(head.feature_layers) * head.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    vocab = pair.target.vocab_size
    starts = [
        (torch.randint(0, vocab, (n,), generator=generator).tolist(), torch.randn(n, width, generator=generator))
        for n in (5, 20, 9)
    ]
    outputs = []
    for model in (head, eager):
        states = [model.empty_state() for _ in starts]
        for state, (ids, features) in zip(states, starts, strict=True):
            model.extend([state], [ids], [features.cuda()], fused=False)
        before = [state.kv.keys[0][:, : state.kv.length].clone() for state in states]
        chain = model.chain(states, 3)
        hidden, steps = torch.stack([state.last[1] for state in states]), []
        for depth in range(3):
            logits, hidden = chain.step(torch.tensor([7 + depth, 3, 11], device="cuda"), hidden)
            steps.append((logits.clone(), hidden.clone()))
        assert all(torch.equal(s.kv.keys[0][:, : s.kv.length], b) for s, b in zip(states, before, strict=True))
        outputs.append(steps)
    assert head.chain_graphs.graphs.keys() == {(1, 256), (2, 256), (4, 256)}  # replayed, none captured on use
    for (got_logits, got_hidden), (want_logits, want_hidden) in zip(*outputs, strict=True):
        assert_fp_close(got_logits, want_logits, model_roundings(pair.target))
        assert_fp_close(got_hidden, want_hidden, model_roundings(pair.target))


@pytest.mark.parametrize("method", ["eagle", "hybrid"])
def test_greedy_and_seeded_requests_are_those_of_k0(dirs, method):
    pair = load_pair(target_model=dirs[0], draft_model=dirs[1], device="cuda", dtype=torch.float32)
    spec = SpeculativeConfig(method=method)
    with cluster(
        pair, DecodeConfig(spec=spec, device="cuda", max_batch=32), PrefillConfig(spec=spec, device="cuda")
    ) as (client, _, decode):
        for k in (1, 4):
            drafted = client.generate(prompt_token_ids=PROMPT, greedy=True, max_new_tokens=24, num_speculative_tokens=k)
            plain = client.generate(prompt_token_ids=PROMPT, greedy=True, max_new_tokens=24, num_speculative_tokens=0)
            assert drafted.token_ids == plain.token_ids and drafted.stats.draft_tokens > 0
        kwargs = dict(prompt_token_ids=PROMPT, max_new_tokens=20, temperature=1.0)
        solo = [client.generate(seed=s, num_speculative_tokens=0, **kwargs).token_ids for s in range(16)]
        with futures.ThreadPoolExecutor(16) as pool:
            batch = list(
                pool.map(lambda s: client.generate(seed=s, num_speculative_tokens=3, **kwargs).token_ids, range(16))
            )
        assert batch == solo
        wait_until(lambda: decode.engine.load == 0, what="engine idle")
        assert decode.engine.pair.target.pool.used_blocks == 0
