"""Both nodes on a GPU with a tiny random Llama on paged KV pools (`make test-gpu`):
greedy K = 4 equals K = 0, a seeded request is the same alone and in a batch of 32, and
every KV block is back in the pool afterwards; the same for multi-draft trees."""

from __future__ import annotations

import contextlib
import warnings
from concurrent import futures

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from decode_node.engine import DecodeConfig
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig
from protos import pdspec_pb2
from sampling.proposal import DraftLaw
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer
from tests.nodes.conftest import cluster, wait_until

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("gpu-llama"), "llama", seed=11, layers=3)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    return load_pair(target_model=path, draft_layers=1, device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("law", list(DraftLaw))
def test_greedy_k4_equals_k0_and_seeded_runs_reproduce_in_a_batch(gpu_pair, law):
    with cluster(
        gpu_pair,
        DecodeConfig(spec=SpeculativeConfig(draft_law=law), device="cuda", max_batch=64),
        PrefillConfig(spec=SpeculativeConfig(draft_law=law), device="cuda"),
    ) as (client, _, decode):
        prompt = list(range(3, 20))
        for k in (1, 4):
            spec = client.generate(prompt_token_ids=prompt, greedy=True, max_new_tokens=24, num_speculative_tokens=k)
            plain = client.generate(prompt_token_ids=prompt, greedy=True, max_new_tokens=24, num_speculative_tokens=0)
            assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 24
        solo = [client.generate(prompt_token_ids=prompt, seed=s, max_new_tokens=20).token_ids for s in range(32)]
        with futures.ThreadPoolExecutor(32) as pool:
            batch = list(
                pool.map(
                    lambda s: client.generate(prompt_token_ids=prompt, seed=s, max_new_tokens=20).token_ids, range(32)
                )
            )
        assert batch == solo and len({tuple(t) for t in solo}) > 1
        wait_until(lambda: decode.engine.load == 0, what="engine idle")
        assert decode.engine.pair.target.pool.used_blocks == 0 and decode.engine.pair.draft.pool.used_blocks == 0
        assert decode.engine.pair.target.device.type == "cuda"


@pytest.mark.parametrize("method", ["prompt-lookup", "hybrid"])
def test_prompt_lookup_greedy_equals_k0_on_the_gpu(gpu_pair, method):
    """Prompt lookup and hybrid (adaptive K, partial proposals, mixed K in one batch) emit the
    K = 0 tokens, alone and eight at once, and free every KV block."""
    with cluster(
        gpu_pair,
        DecodeConfig(spec=SpeculativeConfig(method=method), device="cuda", max_batch=16),
        PrefillConfig(spec=SpeculativeConfig(method=method), device="cuda"),
    ) as (client, _, decode):
        prompts = [[*range(3, 12 + r), *range(3, 12 + r)] for r in range(8)]  # repeated: lookup may match
        plain = [
            client.generate(prompt_token_ids=p, greedy=True, max_new_tokens=32, num_speculative_tokens=0)
            for p in prompts
        ]
        with futures.ThreadPoolExecutor(8) as pool:
            spec = list(
                pool.map(
                    lambda p: client.generate(
                        prompt_token_ids=p, greedy=True, max_new_tokens=32, num_speculative_tokens=4
                    ),
                    prompts,
                )
            )
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
        assert all(s.stats.speculative_method == method and len(s.stats.chosen_k) == 5 for s in spec)
        wait_until(lambda: decode.engine.load == 0, what="engine idle")
        assert decode.engine.pair.target.pool.used_blocks == 0 and decode.engine.pair.draft.pool.used_blocks == 0


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "sampled"])
def test_steps_drafting_ahead_replay_moved_graphs_and_keep_every_token(gpu_pair, monkeypatch, seeded):
    """Prompt lookup replaced by a guesser that knows each row's K = 0 continuation (greedy, or
    drawn for its seed at T = 0.8) and gets a draft wrong with probability 0.1: the decode node
    queues each speculating step before the one in flight is read, its graph inputs (and a
    sampled row's positions, whose uniforms it draws with) moved back on the device by what
    that step rejected. Eight rows at once emit the K = 0 tokens and free every block."""
    import random

    from engine.prompt_lookup import ContextIndex

    with cluster(
        gpu_pair,
        DecodeConfig(spec=SpeculativeConfig(method="prompt-lookup"), device="cuda", max_batch=16, speculate_ahead="on"),
        PrefillConfig(spec=SpeculativeConfig(method="prompt-lookup"), device="cuda"),
    ) as (client, _, decode):
        assert decode.engine.pipelined and decode.engine.policy.drafting_ahead
        prompts = [[40 + r, *range(3, 12 + r)] for r in range(8)]  # none a prefix of another

        def generate(prompt, k):
            sampling = {"temperature": 0.8, "seed": prompt[0]} if seeded else {"greedy": True}
            return client.generate(prompt_token_ids=prompt, max_new_tokens=40, num_speculative_tokens=k, **sampling)

        truth = {tuple(p): [*p, *generate(p, 0).token_ids] for p in prompts}
        rng = random.Random(3)

        def guess(self, k, tail=()):
            context = [*self.tokens, *tail]
            whole = next(t for p, t in truth.items() if tuple(context[: len(p)]) == p)
            right = whole[: len(context)] == context
            cont = [t if right and rng.random() > 0.1 else rng.randrange(2, 90) for t in whole[len(context) :][:k]]
            return cont, 2 if cont else 0

        monkeypatch.setattr(ContextIndex, "match", guess)
        with futures.ThreadPoolExecutor(8) as pool:
            spec = list(pool.map(lambda p: generate(p, 4), prompts))
        assert [[*p, *s.token_ids] for p, s in zip(prompts, spec, strict=True)] == list(truth.values())
        accepted = sum(s.stats.accepted_tokens for s in spec)
        assert 0.2 * sum(s.stats.draft_tokens for s in spec) < accepted
        wait_until(lambda: decode.engine.load == 0, what="engine idle")
        assert decode.engine.pair.target.pool.used_blocks == 0


def test_captured_graphs_equal_eager(gpu_pair):
    from engine.paged_lm import PagedLlamaLM, bytes_per_token

    model = gpu_pair.target
    budget = 4096 * bytes_per_token(model)
    graphed, eager = (PagedLlamaLM.with_pool(model, budget, eager=e) for e in (False, True))
    for rows in (1, 3, 8):
        for queries in (1, 5):
            prompts = [list(range(2, 10 + 3 * r)) for r in range(rows)]
            assert_same_logits(graphed, eager, prompts, [[list(range(4, 4 + queries))] * rows])
    assert len(graphed._graphs) == 6 and graphed.pool.used_blocks == 0


def test_ragged_batches_replay_padded_graphs_and_equal_eager(gpu_pair):
    """Rows bringing different numbers of tokens (a verify pass after adaptive or per-row K, a
    catch-up), and uniform ones whose own graph is not captured, replay a graph padded to
    their longest row, or to a wider graph already captured; their logits are the eager
    engine's."""
    from engine.paged_lm import PagedLlamaLM, bytes_per_token

    model = gpu_pair.target
    budget = 4096 * bytes_per_token(model)
    graphed, eager = (PagedLlamaLM.with_pool(model, budget, eager=e) for e in (False, True))
    prompts = [list(range(2, 10 + 3 * r)) for r in range(3)]
    feeds = [[[4, 5, 6, 7, 8], [4], [4, 5]], [[9], [5, 6, 7], [3]], [[2, 3], [8, 9], [4, 6]]]
    assert_same_logits(graphed, eager, prompts, feeds)
    # the first feed captured (4 rows, 5 queries); the second and the third (uniform, its own
    # key not captured) padded into it
    assert sorted(graphed._graphs) == [(4, 5, 256)] and graphed.pool.used_blocks == 0


def test_start_up_capture_takes_the_graphs_that_the_steps_replay(gpu_pair):
    """paged_pair with a GraphCapture captures every key of capture_keys before any request;
    decode steps (K = 0) and verify passes (K = 4) of batches within it then capture nothing
    on the target, and their tokens are those of a pair that captures on first use."""
    from decode_node.engine import DecodeEngine
    from engine.paged_lm import GraphCapture, capture_keys, paged_pair
    from prefill_node.engine import PrefillEngine
    from protos.validation import Receiver, validate_decode_request

    capture = GraphCapture(batch=4, context=512, target_queries=(1, 5), draft_queries=(1,))
    captured, lazy = paged_pair(gpu_pair, 64 << 20, capture=capture), paged_pair(gpu_pair, 64 << 20)
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # no per-shape cuDNN graph or JIT at a request
    capacity = captured.target.capacity_tokens()
    assert sorted(captured.target._graphs) == capture_keys(4, 512, (1, 5), capacity)  # 3 x 2 x 2
    assert sorted(captured.draft._graphs) == capture_keys(4, 512, (1,), capacity)
    assert len(captured.target._graphs) == 12 and not lazy.target._graphs and not lazy.draft._graphs
    before = set(captured.target._graphs)

    def run(pair, k: int) -> list[list[int]]:
        prefill = PrefillEngine(pair, PrefillConfig(device="cuda"))
        decode = DecodeEngine(
            pair, DecodeConfig(spec=SpeculativeConfig(max_speculative_tokens=4), device="cuda", max_batch=4)
        )
        receiver = Receiver.from_contract(pair.contract(), 4)
        requests = [
            pdspec_pb2.GenerateRequest(
                prompt_token_ids=list(range(3, 12 + 5 * i)),
                num_speculative_tokens=k,
                sampling=pdspec_pb2.SamplingParams(do_sample=False, max_new_tokens=40),
            )
            for i in range(3)
        ]
        handles = []
        for prefilled in prefill.prefill_many([prefill.check(r) for r in requests]):
            wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
            handles.append(decode.submit(validate_decode_request(wire, receiver)))
        while decode.load:
            decode.step()
        out = []
        for handle in handles:
            tokens = []
            while not handle.events.empty():
                tokens += handle.events.get().tokens
            out.append(tokens)
        assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0
        return out

    for k in (0, 4):
        assert run(captured, k) == run(lazy, k)
    assert set(captured.target._graphs) == before  # every target step replayed a start-up graph


def assert_same_logits(first, second, prompts, feeds) -> None:
    """Both engines prefill `prompts`, then extend every row by each feed in turn (a feed: one
    list of ids per row); the logits agree at every step and every block is released."""
    states = [[lm.prefill(p)[1] for p in prompts] for lm in (first, second)]
    extra = sum(len(feed[0]) for feed in feeds)
    for lm, rows in zip((first, second), states, strict=True):
        for state in rows:
            lm.reserve(state, len(state.tokens) + extra)
    for feed in feeds:
        got, want = first.extend_batch(states[0], feed), second.extend_batch(states[1], feed)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for lm, rows in zip((first, second), states, strict=True):
        for state in rows:
            lm.release(state)


def test_the_triton_attention_serves_by_default_and_matches_sdpa(gpu_pair):
    """auto = the Triton kernel on a GPU (SDPA under --enforce-eager); prompts (SDPA either way),
    decode and verify steps through graphs give the logits of the SDPA engine, rows reaching
    past the kernel's first key split included."""
    from engine.paged_lm import PagedLlamaLM, bytes_per_token

    model = gpu_pair.target
    budget = 8192 * bytes_per_token(model)
    kernel, sdpa = (PagedLlamaLM.with_pool(model, budget, attention=a) for a in ("auto", "sdpa"))
    assert (kernel.attention, sdpa.attention) == ("triton", "sdpa")
    assert PagedLlamaLM.with_pool(model, budget, eager=True).attention == "sdpa"
    for rows, queries in ((1, 1), (3, 5), (8, 1), (2, 9)):
        prompts = [[(7 * r + j) % 80 + 2 for j in range(10 + 150 * r)] for r in range(rows)]
        feeds = [[list(range(4 + step, 4 + step + queries))] * rows for step in range(2)]
        assert_same_logits(kernel, sdpa, prompts, feeds)
    assert kernel.pool.used_blocks == 0 and kernel._graphs


@pytest.mark.parametrize("law", list(DraftLaw))
def test_trees_on_the_gpu(gpu_pair, law):
    """Multi-draft trees on CUDA (tree attention on the paged pool, the CuPy tree kernel):
    greedy trees emit the K = 0 tokens, seeded trees reproduce in a batch, no block leaks."""
    with cluster(
        gpu_pair,
        DecodeConfig(spec=SpeculativeConfig(draft_law=law), device="cuda", max_batch=64),
        PrefillConfig(spec=SpeculativeConfig(draft_law=law), device="cuda"),
    ) as (client, _, decode):
        prompt = list(range(3, 20))
        plain = client.generate(prompt_token_ids=prompt, greedy=True, max_new_tokens=24, num_speculative_tokens=0)
        for k, candidates in ((3, 2), (2, 4), (4, 4)):
            tree = client.generate(
                prompt_token_ids=prompt,
                greedy=True,
                max_new_tokens=24,
                num_speculative_tokens=k,
                draft_candidates=candidates,
            )
            assert tree.token_ids == plain.token_ids
            assert tree.stats.draft_tokens > k * tree.stats.verify_steps

        def seeded(s):
            return client.generate(
                prompt_token_ids=prompt, seed=s, max_new_tokens=20, num_speculative_tokens=3, draft_candidates=2
            ).token_ids

        solo = [seeded(s) for s in range(16)]
        with futures.ThreadPoolExecutor(16) as pool:
            assert list(pool.map(seeded, range(16))) == solo
        wait_until(lambda: decode.engine.load == 0, what="engine idle")
        assert decode.engine.pair.target.pool.used_blocks == 0 and decode.engine.pair.draft.pool.used_blocks == 0


@contextlib.contextmanager
def host_waits():
    """Every call in the block that makes the host wait for the GPU (torch's sync debug mode),
    as 'file:line' of the Python line that made it."""
    found: list[str] = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        torch.cuda.set_sync_debug_mode("default")
    found += [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("law", list(DraftLaw))
@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("scheduling", ["off", "on"])
def test_a_decode_step_waits_for_the_gpu_once_per_read(gpu_pair, law, k, sampled, scheduling):
    """The host reads the emitted tokens once per step and, drafting K tokens, the drafted ids
    once after the K draft forwards (fed to each other on the device); nothing else in a step
    waits for the GPU, so the host queues the next work while a forward runs. With async
    scheduling a K = 0 step makes no synchronizing call at all: it reads the step before it by
    waiting on that step's copy event, after its own work is queued."""
    if law is DraftLaw.STOCHASTIC and scheduling == "on" and k:
        pytest.skip("a speculating step is not pipelined: the point-mass case checks that it waits as before")
    from decode_node.engine import DecodeEngine
    from engine.paged_lm import paged_pair
    from prefill_node.engine import PrefillEngine
    from protos.validation import Receiver, validate_decode_request

    pair = paged_pair(gpu_pair, 64 << 20)
    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(draft_law=law), device="cuda"))
    config = DecodeConfig(
        spec=SpeculativeConfig(draft_law=law, max_speculative_tokens=4),
        device="cuda",
        max_batch=4,
        async_scheduling=scheduling,
    )
    decode = DecodeEngine(pair, config)
    receiver = Receiver.from_contract(pair.contract(), 4)
    requests = [  # seeded: an unseeded row could end early at random, and a smaller batch captures a graph
        pdspec_pb2.GenerateRequest(
            prompt_token_ids=list(range(3, 12 + 5 * i)),
            num_speculative_tokens=k,
            sampling=pdspec_pb2.SamplingParams(do_sample=sampled, temperature=0.8, max_new_tokens=64, seed=i),
        )
        for i in range(3)
    ]
    for prefilled in prefill.prefill_many([prefill.check(r) for r in requests]):
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        decode.submit(validate_decode_request(wire, receiver))
    decode.step()  # admission and the prefill's proposal
    decode.step()  # graphs of the steady shapes captured
    for _ in range(3):
        with host_waits() as waits:
            decode.step()
        assert len(waits) == (2 if k else 0 if scheduling == "on" else 1), waits
    while decode.load:
        decode.step()
    assert pair.target.pool.used_blocks == 0 and pair.draft.pool.used_blocks == 0


def test_the_layer_by_layer_export_makes_the_forward_wait_for_no_copy(gpu_pair):
    """--kv-layerwise on a GPU: each layer's K and V are gathered on the compute stream and
    copied into pinned host memory on a side stream, so the prefill's forward waits for none
    of them (the thread sending them waits); what ships equals the export after the prefill."""
    import queue

    from engine.paged_lm import paged_pair
    from prefill_node.engine import PrefillEngine
    from protos import wire

    pair = paged_pair(gpu_pair, 64 << 20)
    engine = PrefillEngine(pair, PrefillConfig(device="cuda", kv_streaming=True, kv_layerwise=True))
    sampling = pdspec_pb2.SamplingParams(do_sample=True, seed=5, max_new_tokens=8)
    checked = engine.check(pdspec_pb2.GenerateRequest(prompt_token_ids=list(range(3, 80)), sampling=sampling))
    assert engine.layerwise(checked)
    engine.prefill(checked, queue.Queue())  # kernels chosen, pinned buffers cached
    sink: queue.Queue = queue.Queue()
    with host_waits() as waits:
        engine.prefill(checked, sink)
    in_forward = [w for w in waits if any(f in w for f in ("paged_lm.py", "llama.py", "transfer.py"))]
    assert not in_forward, waits
    items = []
    while not isinstance(item := sink.get(timeout=5), wire.WireDecodeRequest):
        assert item is not None, "the request ended at its first token: nothing to compare"
        items.append(item)
    solo = engine.prefill(checked)  # exported after the prefill, synchronously
    assert [index for index, _ in items] == list(range(len(solo.kv)))
    for (_, copy), want in zip(items, solo.kv, strict=True):
        got = copy.wait()
        assert got.is_pinned() and torch.equal(got, want)
    assert item.header.first_token_id == solo.first_token
    assert item.to_message().proposal == solo.decode_request.proposal
    assert pair.target.pool.used_blocks == 0


def test_layer_by_layer_nodes_on_the_gpu_give_the_tokens_of_the_one_message_path(gpu_pair):
    prompt = list(range(3, 60))
    outs = {}
    for layerwise in (False, True):
        config = PrefillConfig(device="cuda", kv_streaming=layerwise, kv_layerwise=layerwise, kv_chunk_bytes=1000)
        with cluster(gpu_pair, DecodeConfig(device="cuda"), config) as (client, prefill, decode):
            checked = prefill.engine.check(pdspec_pb2.GenerateRequest(prompt_token_ids=prompt))
            assert prefill.engine.layerwise(checked) is layerwise
            outs[layerwise] = [
                client.generate(prompt_token_ids=prompt, seed=3, max_new_tokens=12, temperature=0.8).token_ids,
                client.generate(prompt_token_ids=prompt, greedy=True, max_new_tokens=12).token_ids,
            ]
            wait_until(lambda d=decode: d.engine.load == 0, what="engine idle")
            assert decode.engine.pair.target.pool.used_blocks == 0
    assert outs[True] == outs[False] and len(outs[True][0]) == 12


def test_pinned_exports_are_bounded_and_released():
    """Beyond `limit` unread pinned bytes an export is a synchronous copy; a dropped export
    gives its bytes back."""
    import gc

    from common import transfer

    x = torch.randn(1024, device="cuda")  # 4 KiB
    limit = transfer._pinned[0] + 2 * 4096
    copies = [transfer.to_host_async(x, limit) for _ in range(3)]
    assert [c.done is not None for c in copies] == [True, True, False]
    assert all(torch.equal(c.wait(), x.cpu()) for c in copies) and copies[0].wait().is_pinned()
    del copies
    gc.collect()
    assert transfer.to_host_async(x, limit).done is not None


@pytest.mark.parametrize("mirrors", [2, 16])
def test_staged_inputs_arrive_whole_while_the_device_is_behind(mirrors):
    """`Staging`: with the stream busy (a long kernel queued), a mirror is written again only
    once the copy queued from it has run, so every copy delivers what was written for it: the
    ring grows instead of waiting (up to MIRRORS), and waits beyond that. The fields arrive
    with their dtypes and shapes, and the mirrors are pinned."""
    from common.transfer import Staging

    staging = Staging([("ints", (3,), torch.int64), ("mask", (2, 5), torch.bool), ("x", (4,), torch.float32)], "cuda")
    staging.MIRRORS = mirrors
    snapshots = []
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every copy below queues behind it
    for value in range(1, 6):
        host = staging.host()
        host["ints"][:] = value
        host["mask"][:] = value % 2 == 1
        host["x"][:] = value / 2
        staging.send()
        snapshots.append({name: field.clone() for name, field in staging.fields.items()})
    grown = len(staging._mirrors)
    torch.cuda.synchronize()
    for value, snap in enumerate(snapshots, start=1):
        assert snap["ints"].tolist() == [value] * 3 and snap["ints"].dtype == torch.int64
        assert snap["mask"].shape == (2, 5) and bool(snap["mask"].all()) == (value % 2 == 1)
        assert snap["x"].tolist() == [value / 2] * 4
    assert grown == min(mirrors, 5) and all(mirror.is_pinned() for mirror in staging._mirrors)
    staging.host()  # every copy has run: the ring is reused, not grown
    assert len(staging._mirrors) == grown


def test_an_import_into_freed_slots_follows_the_work_queued_on_them():
    """Slots freed while the compute stream still has work queued on them (an async step in
    flight, the KV move of a request that just left) may go to an import at once: the import's
    writes, on its own stream, land after that work, not under it."""
    from models.kv_import import KvWriter
    from protos.kv_layout import SEQ, KvTensorSpec

    seq, heads, dim = 64, 2, 64
    storage = torch.zeros(seq, heads, dim, device="cuda")  # [slots, Hkv, D]
    big = torch.randn(4096, 4096, device="cuda") / 64
    torch.cuda.synchronize()
    for _ in range(20):  # tens of ms of queued work before the last write to the slots
        big = torch.tanh(big @ big)
    storage.fill_(1.0)
    writer = KvWriter([KvTensorSpec(torch.float32, (heads, SEQ, dim))], seq, [storage], torch.arange(seq))
    writer.write(0, 0, torch.full((heads, seq, dim), 2.0).numpy().tobytes())
    writer.wait()
    torch.cuda.synchronize()
    assert bool((storage == 2.0).all())


def test_a_gpu_pair_starts_with_every_sampling_kernel_loaded(gpu_pair):
    """`paged_pair` compiles and loads every CuPy kernel of sampling/ while a node starts: a
    node's first sampled request (the draws, their uniforms) or first tree does not wait for a
    compile, which on a fresh machine (no CuPy cache) is NVRTC's."""
    from engine.paged_lm import paged_pair
    from sampling.cupy_kernels import MODULES

    for module in MODULES:
        module._kernels.cache_clear()
    paged_pair(gpu_pair, 8 << 20)
    assert all(module._kernels.cache_info().currsize == 1 for module in MODULES)
