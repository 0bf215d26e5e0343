"""DecodeStream: the KV in chunks through real nodes (the same tokens as one Decode
message), and every broken upload refused with its status, nothing left reserved."""

from __future__ import annotations

import threading

import grpc
import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig
from protos import pdspec_pb2, wire
from protos.rpc import DecodeStub
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer
from tests.nodes.conftest import cluster, stream_status, wait_until

PROMPT = list(range(5, 45))  # 40 tokens: several 16-token blocks


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    return load_pair(target_model=path, draft_layers=1)


def _generate(client):
    return client.generate(prompt_token_ids=PROMPT, seed=3, max_new_tokens=12, temperature=0.8)


def test_streamed_kv_gives_the_tokens_of_the_single_message(llama_pair):
    outs, kv = {}, {}
    for streaming in (False, True):
        config = PrefillConfig(kv_streaming=streaming, kv_chunk_bytes=1000)
        with cluster(llama_pair, DecodeConfig(), config) as (client, _prefill, decode):
            outs[streaming] = _generate(client).token_ids
            kv[streaming] = decode.metrics.kv_bytes.labels("decode")._value.get()
            wait_until(lambda d=decode: d.engine.pair.target.pool.used_blocks == 0, what="blocks back in the pool")
    assert outs[True] == outs[False] and len(outs[True]) > 8  # decoded tokens (this seed samples the end at 11)
    assert kv[True] == kv[False] == llama_pair.contract().kv_bytes(len(PROMPT))


@pytest.fixture(scope="module")
def streaming_nodes(llama_pair):
    with cluster(llama_pair, DecodeConfig(), PrefillConfig(kv_streaming=True, kv_chunk_bytes=512)) as running:
        yield running


def _upload(prefill):
    request = pdspec_pb2.GenerateRequest(
        request_id="up",
        prompt_token_ids=PROMPT,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=1, max_new_tokens=8),
    )
    prefilled = prefill.engine.prefill(prefill.engine.check(request))
    assert not len(prefilled.wire.header.kv_cache)  # streamed: the KV is not in the header
    return prefilled.wire, prefilled.kv


def test_broken_uploads_are_refused_and_free_everything(streaming_nodes):
    _, prefill, decode = streaming_nodes
    stub = DecodeStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
    head, kv = _upload(prefill)
    chunks = list(wire.stream_chunks(head, kv, 512))
    size0 = kv[0].numel() * kv[0].element_size()
    wrong = [pdspec_pb2.TensorPB(data_type=pb.data_type, shape=pb.shape) for pb in chunks[0].manifest]
    wrong[0].shape[1] += 1
    inline = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest())
    inline.header.CopyFrom(head.header)
    inline.set_tensor("kv_cache[0]", kv[0])
    cases = {
        "missing last chunk": (chunks[:-1], "kv["),
        "a chunk twice (overlap)": ([*chunks[:3], chunks[2], *chunks[3:]], "].offset"),
        "out-of-order offset": ([chunks[0], chunks[2], chunks[1], *chunks[3:]], "].offset"),
        "tensor index out of range": ([*chunks, wire.KvChunkOut(len(kv), 0, b"x")], "kv.tensor_index"),
        "past the tensor's end": ([chunks[0], wire.KvChunkOut(0, 0, bytes(size0 + 1))], "kv[0].data"),
        "manifest against the contract": ([wire.HeaderChunkOut(head, wrong), *chunks[1:]], "kv_manifest[0].shape"),
        "no request first": (chunks[1:], "request"),
        "a second request": ([chunks[0], chunks[0]], "kv"),
        "KV inline as well": ([wire.HeaderChunkOut(inline, chunks[0].manifest), *chunks[1:]], "kv_cache"),
        "no chunks": ([], "request"),
    }
    for name, (sent, field) in cases.items():
        code, violations = stream_status(stub, sent)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert any(f.startswith(field) or field in f for f in violations), (name, violations)
        assert decode.engine.load == 0 and decode.engine.pair.target.pool.used_blocks == 0, name
    assert stream_status(stub, chunks)[0] == grpc.StatusCode.OK  # the intact upload still works
    wait_until(lambda: decode.engine.pair.target.pool.used_blocks == 0, what="blocks back in the pool")


def test_client_cancel_mid_upload_is_cancelled_and_frees_everything(streaming_nodes):
    _, prefill, decode = streaming_nodes
    stub = DecodeStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
    head, kv = _upload(prefill)
    chunks = list(wire.stream_chunks(head, kv, 512))
    sent, hold = threading.Event(), threading.Event()

    def slow():
        yield from chunks[:4]
        sent.set()
        hold.wait(10)  # the upload stalls half way
        yield from chunks[4:]

    cancelled = decode.metrics.requests.labels("decode", "CANCELLED")._value.get()
    call = stub.DecodeStream(slow(), timeout=30)
    assert sent.wait(60)
    # Cancelled mid-upload: once decode holds the first chunks' KV blocks.
    wait_until(lambda: decode.engine.pair.target.pool.used_blocks > 0, timeout=60, what="the upload's reservation")
    call.cancel()
    hold.set()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_until(
        lambda: decode.metrics.requests.labels("decode", "CANCELLED")._value.get() == cancelled + 1,
        what="the decode node counting the upload CANCELLED",
    )
    assert decode.engine.load == 0 and decode.engine.pair.target.pool.used_blocks == 0


def test_both_nodes_report_their_encodings(streaming_nodes):
    client, prefill, decode = streaming_nodes
    stub = DecodeStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
    assert client.info().proposal_encoding == "point-mass"  # the default for a point-mass law
    assert stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=5).proposal_encoding == "point-mass"
    _generate(client)
    assert decode.metrics.proposal_bytes.labels("decode", "point-mass")._value.get() > 0
    assert prefill.metrics.proposal_bytes.labels("prefill", "point-mass")._value.get() > 0
