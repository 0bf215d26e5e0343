"""The KV sent layer by layer while the prefill runs (--kv-layerwise: DecodeStream with the
proposal last): the tokens of the one-message path, the KV imported not recomputed, and every
broken proposal-last upload refused with nothing left reserved."""

from __future__ import annotations

import queue

import grpc
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig
from protos import pdspec_pb2, wire
from protos.rpc import DecodeStub
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer
from tests.nodes.conftest import cluster, drain, stream_status, wait_until

PROMPT = list(range(5, 45))  # 40 tokens: several 16-token blocks
LONG = 4096  # the default --max-new-tokens-limit: a leaked request holds its decode slot for seconds


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5, layers=3)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    return load_pair(target_model=path, draft_layers=1)


def test_layer_by_layer_gives_the_tokens_of_the_one_message_path(llama_pair, monkeypatch):
    from engine.paged_lm import PagedLlamaLM

    events = []  # the target's KV exports (tensor index) and the ends of its prefill forwards ("end")
    live, extend_last = PagedLlamaLM._live, PagedLlamaLM.extend_last

    def spy_export(self, slots, index):  # the gather both exports (after, and during the forward) make
        events.append(index)
        return live(self, slots, index)

    def spy_forward(self, *args, **kwargs):
        logits = extend_last(self, *args, **kwargs)
        events.append("end")
        return logits

    monkeypatch.setattr(PagedLlamaLM, "_live", spy_export)
    monkeypatch.setattr(PagedLlamaLM, "extend_last", spy_forward)
    outs, kv, computed = {}, {}, {}
    for layerwise in (False, True):
        config = PrefillConfig(kv_streaming=layerwise, kv_layerwise=layerwise, kv_chunk_bytes=1000)
        with cluster(llama_pair, DecodeConfig(), config) as (client, prefill, decode):
            assert (
                prefill.engine.layerwise(prefill.engine.check(pdspec_pb2.GenerateRequest(prompt_token_ids=PROMPT)))
                is layerwise
            )
            target = decode.engine.pair.target
            before = target.positions_computed
            outs[layerwise] = [
                client.generate(prompt_token_ids=PROMPT, seed=3, max_new_tokens=12, temperature=0.8).token_ids,
                client.generate(prompt_token_ids=PROMPT, greedy=True, max_new_tokens=12).token_ids,
                client.generate(
                    prompt_token_ids=PROMPT, greedy=True, max_new_tokens=12, num_speculative_tokens=0
                ).token_ids,
            ]
            computed[layerwise] = target.positions_computed - before
            kv[layerwise] = decode.metrics.kv_bytes.labels("decode")._value.get()
            wait_until(lambda d=decode: d.engine.pair.target.pool.used_blocks == 0, what="blocks back in the pool")
    assert outs[True] == outs[False] and len(outs[True][0]) > 8  # decoded tokens (this seed samples the end at 11)
    # A request's prefill: the target's forward, then the draft's (none at K = 0); both are
    # extend_last. Layer by layer, the 3 layers' K and V go out during the target's forward;
    # else after both forwards. Then the decode node (same process) admits it: its draft's
    # forward over the prompt (extend_last too; none at K = 0).
    tensors = [*range(6)]
    after = ["end", "end", *tensors, "end"] * 2 + ["end", *tensors]
    during = [*tensors, "end", "end", "end"] * 2 + [*tensors, "end"]
    assert events == after + during, events
    assert kv[True] == kv[False] == 3 * llama_pair.contract().kv_bytes(len(PROMPT))
    assert computed[True] == computed[False]  # the decode node imported the prompts KV, recomputed none


def test_a_request_ending_at_its_first_token_frees_the_decode_reservation(llama_pair):
    config = PrefillConfig(kv_streaming=True, kv_layerwise=True)
    with cluster(llama_pair, DecodeConfig(), config) as (client, _prefill, decode):
        # Greedy: an unseeded draw may be EOS, which ends the request for another reason.
        out = client.generate(prompt_token_ids=PROMPT, max_new_tokens=1, greedy=True)
        assert len(out.token_ids) == 1 and out.finish_reason == "length", out
        wait_until(lambda: decode.engine.load == 0, what="the decode stream cancelled")
        assert decode.engine.pair.target.pool.used_blocks == 0


def _parts(prefill):
    """The three parts of a proposal-last upload, made by the real prefill engine."""
    checked = prefill.engine.check(
        pdspec_pb2.GenerateRequest(
            request_id="lw",
            prompt_token_ids=PROMPT,
            sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=1, max_new_tokens=8),
        )
    )
    sink: queue.Queue = queue.Queue()
    header, manifest = prefill.engine.stream_header(checked)
    prefill.engine.prefill(checked, sink)
    items = []
    while (item := sink.get_nowait()) is not None:
        items.append(item)
        if isinstance(item, wire.WireDecodeRequest):
            break
    *kv, tail = items
    head = wire.HeaderChunkOut(header, manifest, proposal_follows=True)
    slices = [wire.KvChunkOut(index, 0, wire.host_bytes(copy.wait())) for index, copy in kv]
    return head, slices, wire.HeaderChunkOut(tail, [])


def test_broken_proposal_last_uploads_are_refused_and_free_everything(llama_pair):
    config = PrefillConfig(kv_streaming=True, kv_layerwise=True)
    with cluster(llama_pair, DecodeConfig(), config) as (_client, prefill, decode):
        stub = DecodeStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        head, slices, tail = _parts(prefill)
        assert len(slices) == 2 * 3 and tail.request.header.first_token_id >= 0
        bad = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest())
        bad.header.CopyFrom(tail.request.header)
        del bad.header.proposal.token_ids[-1]  # K - 1 ids
        early = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest())
        early.header.CopyFrom(head.request.header)
        early.header.first_token_id = 7  # a header that says the proposal follows but carries a token
        cases = {
            "no proposal at the end": ([head, *slices], "request"),
            "the proposal before the KV": ([head, slices[0], tail, *slices[1:]], "request"),
            "a proposal of K - 1 ids": ([head, *slices, wire.HeaderChunkOut(bad, [])], "proposal.token_ids"),
            "a first token in the header": (
                [wire.HeaderChunkOut(early, head.manifest, True), *slices, tail],
                "proposal",
            ),
        }
        for name, (sent, field) in cases.items():
            code, violations = stream_status(stub, sent)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code)
            assert any(f.startswith(field) for f in violations), (name, violations)
            assert decode.engine.load == 0 and decode.engine.pair.target.pool.used_blocks == 0, name
        assert stream_status(stub, [head, *slices, tail])[0] == grpc.StatusCode.OK  # the intact upload works
        wait_until(lambda: decode.engine.pair.target.pool.used_blocks == 0, what="blocks back in the pool")


def test_a_standard_parser_reads_the_proposal_follows_flag():
    header = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest(request_id="x"))
    chunk = pdspec_pb2.DecodeChunk.FromString(wire.HeaderChunkOut(header, [], True).SerializeToString())
    assert chunk.proposal_follows and chunk.request.request_id == "x"
    assert wire.parse_decode_chunk(chunk.SerializeToString()).proposal_follows
    assert not wire.parse_decode_chunk(wire.HeaderChunkOut(header, []).SerializeToString()).proposal_follows


def test_a_chunked_prompt_in_a_batch_ships_the_export_of_its_solo_run(llama_pair):
    """40 prompt tokens in 16-token prefill chunks, batched with a request that ships its KV
    after the prefill: the layers shipped during the last chunk's forward are the whole
    prompt's KV, equal to the solo export, and the proposal is the solo run's."""
    from engine.paged_lm import bytes_per_token, paged_pair
    from prefill_node.engine import PrefillEngine

    pair = paged_pair(llama_pair, 512 * (bytes_per_token(llama_pair.target) + bytes_per_token(llama_pair.draft)))
    engine = PrefillEngine(pair, PrefillConfig(kv_streaming=True, kv_layerwise=True, max_prefill_tokens=16))
    sampling = pdspec_pb2.SamplingParams(do_sample=True, seed=11, max_new_tokens=8)
    a, b = (
        engine.check(pdspec_pb2.GenerateRequest(request_id=r, prompt_token_ids=p, sampling=sampling))
        for r, p in (("a", PROMPT), ("b", PROMPT[:23]))
    )
    assert engine.layerwise(a)
    sink: queue.Queue = queue.Queue()
    shipped, other = engine.prefill_many([a, b], [sink, None])
    items = []
    while (item := sink.get_nowait()) is not None and not isinstance(item, wire.WireDecodeRequest):
        items.append(item)
    solo = engine.prefill(a)
    assert [index for index, _ in items] == list(range(len(solo.kv)))
    for (_, copy), want in zip(items, solo.kv, strict=True):
        assert torch.equal(copy.wait(), want)
    assert item is shipped.wire and item.header.first_token_id == solo.first_token
    assert item.to_message().proposal == solo.decode_request.proposal
    assert other.kv and not shipped.kv and shipped.kv_bytes == solo.kv_bytes
    assert pair.target.pool.used_blocks == 0


@pytest.mark.parametrize(
    "config",
    [PrefillConfig(kv_streaming=True, kv_layerwise=True, kv_chunk_bytes=512), PrefillConfig()],
    ids=["layer-by-layer", "one-message"],
)
def test_cancels_and_deadlines_mid_layer_stream_free_both_nodes(llama_pair, config):
    """Clients that leave while their KV is going out layer by layer (1-50 ms deadlines, or a
    cancel after the first token), or, in one message, while the prefill node still drafts and
    exports after the first token: every call ends CANCELLED or DEADLINE_EXCEEDED, both nodes
    hold nothing afterwards, and they still serve."""
    import random
    from concurrent import futures

    with cluster(llama_pair, DecodeConfig(max_batch=4, max_queue=64), config) as (client, prefill, decode):
        rng = random.Random(2)
        deadlines = [rng.uniform(0.001, 0.05) for _ in range(20)]

        def one(i: int) -> grpc.StatusCode:
            if i < len(deadlines):
                return drain(client.stream(prompt_token_ids=PROMPT, max_new_tokens=LONG, seed=i, timeout=deadlines[i]))
            stream = client.stream(prompt_token_ids=PROMPT, max_new_tokens=LONG, seed=i, timeout=30)
            next(stream)  # the prefill's first token: the decode stream is open
            stream.cancel()
            return drain(stream)

        with futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(2 * len(deadlines))))
        assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
        # A leaked decode stream would run its 4,096 tokens: seconds at max_batch 4.
        wait_until(lambda: decode.engine.load == 0, timeout=2, what="decode engine idle")
        wait_until(lambda: decode.engine.pair.target.pool.used_blocks == 0, timeout=2, what="decode blocks back")
        # A call's thread may still be ending its request (dropping it, or finishing the step
        # that drafts it) when the client has heard CANCELLED.
        wait_until(lambda: prefill.service.in_flight == 0, timeout=5, what="prefill calls ended")
        assert prefill.engine.pair.target.pool.used_blocks == 0 and not prefill.engine._jobs
        assert len(client.generate(prompt_token_ids=PROMPT, greedy=True, max_new_tokens=6).token_ids) == 6
