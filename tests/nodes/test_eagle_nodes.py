"""A hidden-state head served across the prefill/decode split, on real gRPC over loopback:
each node loads the saved head directory itself; the head's KV leaves the prefill node in
every transport (one message, DecodeStream, layer by layer, shared memory) and arrives byte for
byte; greedy and seeded point-mass requests give the tokens of K = 0; a head that is not the
decode node's is refused with FAILED_PRECONDITION and counted."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig
from decode_node.server import DecodeNodeConfig
from decode_node.server import run_server as run_decode
from engine.adaptive import StepCosts
from engine.eagle import EagleProposer
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from models.pair import ModelPair
from pdspec.client import Client
from prefill_node.engine import KvTransport, PrefillConfig, PrefillEngine
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from protos import pdspec_pb2
from protos.rpc import DecodeStub
from protos.status import field_violations
from tests.models.eagle_fixtures import make_head_dir, make_target, one_thread  # noqa: F401 (autouse)
from tests.nodes.conftest import wait_until

PROMPT = [3, 7, 11, 2, 5, 8, 13, 4, 20, 6, 3, 7, 11, 2, 15, 16, 10, 12, 19, 21]
K = 3
# hybrid prices its drafts (adaptive K): with costs given, not timed at start-up, what it drafts
# does not depend on how loaded the machine running the tests is
COSTS = StepCosts((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8), depth=0.05)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_target(root / "target", layers=3)
    return target, make_head_dir(target, root / "head"), make_head_dir(target, root / "other", seed=1)


def spec(method: str) -> SpeculativeConfig:
    return SpeculativeConfig(method=method)


@contextlib.contextmanager
def decode_node(pair: ModelPair, method: str = "eagle"):
    config = DecodeNodeConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=None,
        engine=DecodeConfig(spec=spec(method), step_costs=COSTS),
        accept_shm_kv=True,
    )
    with run_decode(config, lambda: pair) as node:
        yield node


@contextlib.contextmanager
def prefill_client(pair: ModelPair, decode, engine: PrefillConfig):
    config = PrefillNodeConfig(
        decode_addr=f"127.0.0.1:{decode.port}",
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        engine=engine,
        peer_check_s=0.2,
    )
    with run_prefill(config, lambda: pair) as prefill, Client(f"127.0.0.1:{prefill.port}") as client:
        wait_until(lambda: prefill.peer.compatible, what="decode peer")
        yield client


def loaded(dirs, head: int = 1) -> ModelPair:
    """The pair a node loads from the directories (each node its own)."""
    return load_pair(target_model=dirs[0], draft_model=dirs[head])


def test_head_kv_crosses_every_transport_intact(dirs, monkeypatch, tmp_path):
    """The head's KV as the prefill node exports it is the head state the decode node starts
    from, in every transport; 1000-byte chunks split float32 elements and rows."""
    shipped, started = [], []
    draft_tensors, start = ModelPair.draft_tensors, EagleProposer.start

    def spy_export(self, state, out=None):  # the prefill node's export of the head's KV
        tensors = draft_tensors(self, state, out)
        shipped.append([t.clone() for t in tensors])
        return tensors

    def spy_start(self, rows, kv_needs):  # the decode node's proposer starts from the imported state
        imported = [row.target_state.rides for row in rows]
        start(self, rows, kv_needs)
        started.extend(self.draft.export_state(state) for state in imported if state is not None)

    monkeypatch.setattr(ModelPair, "draft_tensors", spy_export)
    monkeypatch.setattr(EagleProposer, "start", spy_start)
    transports = {
        "one message": PrefillConfig(spec=spec("eagle")),
        "DecodeStream": PrefillConfig(spec=spec("eagle"), kv_streaming=True, kv_chunk_bytes=1000),
        "layer by layer": PrefillConfig(spec=spec("eagle"), kv_streaming=True, kv_layerwise=True, kv_chunk_bytes=1000),
        "shm": PrefillConfig(spec=spec("eagle"), kv_transport=KvTransport.SHM),
    }
    outs = {}
    with decode_node(loaded(dirs)) as decode:
        for name, config in transports.items():
            shipped.clear()
            started.clear()
            with prefill_client(loaded(dirs), decode, config) as client:
                out = client.generate(prompt_token_ids=PROMPT, greedy=True, max_new_tokens=16, num_speculative_tokens=K)
                plain = client.generate(
                    prompt_token_ids=PROMPT, greedy=True, max_new_tokens=16, num_speculative_tokens=0
                )
            outs[name] = out.token_ids
            assert out.token_ids == plain.token_ids and len(out.token_ids) == 16, name
            assert out.stats.draft_tokens > K, name  # the decode node drafted with the head too
            assert len(shipped) == 2 and len(started) == 1, name  # K = 0 ships the head's KV, never starts it
            assert [t.shape[1] for t in shipped[0]] == [len(PROMPT)] * 2
            for sent, arrived in zip(shipped[0], started[0], strict=True):
                assert torch.equal(sent, arrived), name
            wait_until(lambda: decode.engine.load == 0, what="the decode node idle")
    assert len(set(map(tuple, outs.values()))) == 1


@pytest.mark.parametrize("method", ["eagle", "hybrid"])
def test_seeded_point_mass_requests_are_those_of_k0(dirs, method):
    """Point-mass drafts are verified by coupling: a seeded sampled request draws the tokens of K = 0."""
    pair = loaded(dirs)
    with decode_node(pair, method) as decode, prefill_client(pair, decode, PrefillConfig(spec=spec(method))) as client:
        kwargs = dict(prompt_token_ids=PROMPT, max_new_tokens=20, temperature=1.0)
        for seed in range(4):
            drafted = client.generate(seed=seed, num_speculative_tokens=K, **kwargs)
            assert drafted.token_ids == client.generate(seed=seed, num_speculative_tokens=0, **kwargs).token_ids
            assert drafted.stats.draft_tokens > 0
        info = client.info()
        assert info.speculative_method == method and info.draft_model.startswith("eagle:")


def test_a_head_that_is_not_the_decode_nodes_is_refused_and_counted(dirs):
    """The other head's DecodeRequest (its contract names that head) -> FAILED_PRECONDITION."""
    other = loaded(dirs, head=2)
    engine = PrefillEngine(other, PrefillConfig(spec=spec("eagle")))
    checked = engine.check(
        pdspec_pb2.GenerateRequest(
            prompt_token_ids=PROMPT,
            num_speculative_tokens=K,
            sampling=pdspec_pb2.SamplingParams(max_new_tokens=4),
        )
    )
    request = engine.prefill(checked).decode_request
    with decode_node(loaded(dirs)) as decode:
        assert decode.engine.pair.contract().fingerprint() != other.contract().fingerprint()
        counter = decode.metrics.validation_rejections.labels("decode", "contract_fingerprint")
        before = counter._value.get()
        with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel, pytest.raises(grpc.RpcError) as error:
            list(DecodeStub(channel).Decode(request, timeout=10))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert counter._value.get() == before + 1
        assert decode.engine.load == 0


def test_a_broken_head_kv_is_refused_naming_the_field(dirs):
    """The head's tensors are the last two of kv_cache, checked against the contract's layout:
    one position short, another dtype, or missing -> INVALID_ARGUMENT naming the field."""
    pair = loaded(dirs)
    engine = PrefillEngine(pair, PrefillConfig(spec=spec("eagle")))
    checked = engine.check(
        pdspec_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, num_speculative_tokens=K, sampling=pdspec_pb2.SamplingParams(max_new_tokens=4)
        )
    )
    valid = engine.prefill(checked).decode_request
    last = len(valid.kv_cache) - 1
    assert last == len(pair.target.kv_layout) + 1  # the target's tensors, then the head's keys and values
    with decode_node(pair) as decode, grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        for fault in ("shape", "dtype", "missing"):
            request = pdspec_pb2.DecodeRequest()
            request.CopyFrom(valid)
            head = request.kv_cache[last]
            if fault == "shape":
                head.shape[1] -= 1
                head.data = head.data[: len(head.data) * head.shape[1] // (head.shape[1] + 1)]
            elif fault == "dtype":
                head.data_type = pdspec_pb2.TensorPB.FP16
                head.data = head.data[: len(head.data) // 2]
            else:
                del request.kv_cache[last]
            with pytest.raises(grpc.RpcError) as error:
                list(DecodeStub(channel).Decode(request, timeout=10))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fault
            fields = dict(field_violations(error.value))
            named = "kv_cache" if fault == "missing" else f"kv_cache[{last}]"
            assert any(field.split(".")[0] == named for field in fields), (fault, fields)
        assert decode.engine.load == 0
        assert [t.token_ids for t in DecodeStub(channel).Decode(valid, timeout=10)]  # the node still serves
