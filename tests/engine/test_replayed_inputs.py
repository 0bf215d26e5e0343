"""The host side of CUDA-graph replays, on the CPU: PagedLlamaLM's graph path (the bucket keys, a
replay's inputs staged in one copy and padded to the bucket, a shift applied to them where the
batch drafted ahead, tokens already on the device placed after the copy), with each graph's
forward run eagerly from its static inputs at every replay, where a GPU replays the captured
kernels (tests/engine/test_gpu_nodes.py runs the real graphs). The decode engine's tokens are the
synchronous eager engine's: greedy and seeded rows of a draft model (one graph replayed at every
depth of a step), and prompt-lookup rows speculating ahead of the step in flight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from engine import paged_lm
from engine.paged_lm import paged_pair
from models.loader import load_pair
from tests.engine.test_async_scheduling import looping, request, run
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer


class EagerGraph:
    """A captured graph's stand-in: `replay` runs the captured forward again, from the static
    inputs as they are now, into the outputs the capture returned."""

    forward = None
    outputs: tuple[torch.Tensor, ...] = ()
    replays = 0

    def replay(self) -> None:
        out = self.forward()
        for kept, new in zip(self.outputs, out if isinstance(out, tuple) else (out,), strict=True):
            kept.copy_(new)
        EagerGraph.replays += 1


def capture_eagerly(graph: EagerGraph, pool, device, forward):
    out = forward()
    graph.forward, graph.outputs = forward, out if isinstance(out, tuple) else (out,)
    return out


def checkpoint(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("replayed-llama"), "llama", seed=3, layers=2)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(eager, replayed): the same checkpoint, the second taking the graph path."""
    path = checkpoint(tmp_path_factory)

    def load():
        return paged_pair(load_pair(target_model=path, draft_layers=1, dtype=torch.float32), 8 << 20)

    eager = load()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "CUDAGraph", EagerGraph)
        patch.setattr(paged_lm, "capture_graph", capture_eagerly)
        replayed = load()
        for model in (replayed.target, replayed.draft):
            model.graphs = True
        yield eager, replayed


def replays(pair, requests, scheduling: str, **options):
    before = EagerGraph.replays
    out = run(pair, requests, scheduling, **options)
    return out, EagerGraph.replays - before


def test_draft_model_rows_through_replays_give_the_eager_engines_tokens(pairs):
    eager, replayed = pairs
    requests = [request(5 + 3 * i, k=4 * (i % 2), seed=None if i % 3 else i, max_new=10 + 3 * i) for i in range(6)]
    want = run(eager, requests, "off")
    for scheduling in ("off", "on"):
        got, count = replays(replayed, requests, scheduling)
        assert got == want and count > 50, scheduling


def test_rows_drafting_ahead_through_replays_give_the_eager_engines_tokens(pairs):
    """Moved inputs on every replay after a step that drafted: each row's tokens shift back by
    what the step in flight rejected, in the replay's staged inputs."""
    eager, replayed = pairs
    requests = [
        looping(2),
        looping(3, k=2, seed=2, max_new=40),
        request(5, k=4, max_new=30),
        looping(2, seed=1),
        request(6, seed=6, max_new=12),  # K = 0
        looping(3, max_new=3),  # its budget ends inside a step's drafts
    ]
    want = run(eager, requests, "off", method="prompt-lookup")
    got, count = replays(replayed, requests, "on", method="prompt-lookup")
    assert got == want and run.ahead > 0 and count > 20
    stats = [s for s in run.stats if s is not None]
    assert sum(s.draft_tokens - s.accepted_tokens for s in stats) > 0  # some drafts rejected: moved replays
