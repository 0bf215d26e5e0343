"""The paged KV cache: blocks reserved at admission and all returned after, graph padding and
chunked imports against the contiguous store (the oracle). Its logits on ragged batches, after
truncation and after an import are checked with every other backend's, against the same oracle,
in tests/models/test_conformance.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from engine.kv_cache import KvCacheFull, KvPool, PagedSeq
from engine.paged_lm import PagedLlamaLM, bytes_per_token, paged_pair
from engine.spec_config import SpeculativeConfig
from models.checkpoint import load_hf_llama
from models.llama import EAGER, layer_skip_draft
from models.loader import load_pair
from tests.models.hf_fixtures import make_family_checkpoint, make_tokenizer
from tests.tolerance import assert_fp_close, model_roundings


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def models(request, tmp_path_factory):
    overrides = {"sliding_window": 12} if request.param == "mistral" else {}
    path = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5, **overrides)
    contiguous = load_hf_llama(path, dtype=torch.float32)
    paged = PagedLlamaLM.with_pool(load_hf_llama(path, dtype=torch.float32), 256 * bytes_per_token(contiguous))
    return contiguous, paged


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pool_reservations_are_all_or_nothing_and_freed():
    pool = KvPool(layers=2, kv_heads=1, head_dim=4, num_blocks=5, block_size=16, dtype=torch.float32, device="cpu")
    assert pool.usable_blocks == 4  # block 0 is scratch (graph padding writes there)
    a, b = PagedSeq(), PagedSeq()
    pool.reserve(a, 33)  # 3 blocks
    assert pool.free_blocks == 1
    with pytest.raises(KvCacheFull, match="need 2 more blocks, 1 free"):
        pool.reserve(b, 17)
    assert b.blocks == [] and pool.free_blocks == 1  # nothing taken
    pool.reserve(b, 16)
    assert pool.free_blocks == 0
    pool.release(a)
    pool.release(b)
    assert pool.free_blocks == 4 and a.blocks == [] and a.length == 0
    with pytest.raises(ValueError, match="num_blocks/block_size"):
        KvPool(layers=1, kv_heads=1, head_dim=4, num_blocks=1, block_size=16, dtype=torch.float32, device="cpu")


def test_paged_pair_splits_the_bytes_so_both_pools_hold_the_same_tokens(tmp_path):
    path = make_family_checkpoint(tmp_path, "llama", seed=1)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    pair = load_pair(target_model=path, draft_layers=1)
    budget = 100 * (bytes_per_token(pair.target) + bytes_per_token(pair.draft))
    paged = paged_pair(pair, budget)
    # 100 tokens = 6 blocks of 16, one of them scratch
    assert paged.target.capacity_tokens() == paged.draft.capacity_tokens() == 80
    assert paged.draft.module is paged.target.module  # the layer-skip draft still shares the weights
    assert paged.target.name == pair.target.name and paged.target.kv_layout == pair.target.kv_layout
    target = load_hf_llama(path, dtype=torch.float32)
    draft = layer_skip_draft(target, 1)
    logits, _ = paged.draft.prefill([3, 4, 5])
    assert_fp_close(logits, draft.prefill([3, 4, 5])[0], model_roundings(target))
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        PagedLlamaLM.with_pool(target, 10)
    assert not paged.target.graphs and paged.target.ops is EAGER  # the CPU: no graphs, no compile
    from pdspec.modelspec import backends

    assert paged.target.attention == "sdpa"
    assert backends(paged)["attention"] == "torch-sdpa over block-table gathers"


def test_enforce_eager_reaches_the_model_spec():
    from decode_node.__main__ import parse_args

    assert parse_args(["--enforce-eager"]).models.enforce_eager
    assert not parse_args([]).models.enforce_eager


def test_the_attention_backend_flag_and_its_choice():
    from decode_node.__main__ import parse_args
    from engine.paged_lm import attention_backend
    from pdspec.modelspec import ModelSpec

    assert parse_args(["--attention-backend", "sdpa"]).models.attention_backend == "sdpa"
    assert parse_args([]).models.attention_backend == "auto"
    with pytest.raises(
        ValueError, match=r"attention_backend: expected one of \('auto', 'triton', 'sdpa'\), got 'flash'"
    ):
        ModelSpec(attention_backend="flash")
    cpu = torch.device("cpu")
    assert attention_backend("auto", cpu, eager=False) == "sdpa"  # the CPU: always the reference
    assert attention_backend("sdpa", cpu, eager=False) == "sdpa"
    with pytest.raises(ValueError, match="'triton' needs a CUDA or ROCm device with Triton, got cpu"):
        attention_backend("triton", cpu, eager=False)
    with pytest.raises(ValueError, match=r"expected one of \('auto', 'triton', 'sdpa'\), got 'x'"):
        attention_backend("x", cpu, eager=False)


def test_the_graph_capture_flags_and_what_each_node_captures(monkeypatch):
    """--graph-capture-{batch,context,k} reach the ModelSpec; the decode node captures the
    target's decode steps and verify passes and the draft's depths (one token, two after a
    step that accepted every draft), the prefill node the draft's one-token depths only; K the
    node never runs are left out; bad values are refused naming the field."""
    from decode_node.__main__ import parse_args
    from engine.paged_lm import GraphCapture
    from pdspec.modelspec import ModelSpec

    spec = parse_args(["--graph-capture-batch", "8", "--graph-capture-context", "1024", "--graph-capture-k", "0,2"])
    models = spec.models
    assert (models.graph_capture_batch, models.graph_capture_context, models.graph_capture_k) == (8, 1024, (0, 2))
    assert models.graph_capture(max_k=8, decode=True, max_batch=4) == GraphCapture(4, 1024, (1, 3), (1, 2))
    assert models.graph_capture(max_k=8, decode=False) == GraphCapture(8, 1024, (), (1,))
    default = parse_args([]).models.graph_capture(max_k=8, decode=True, max_batch=32)
    assert default == GraphCapture(32, 2048, (1, 5), (1, 2))
    assert ModelSpec().graph_capture(max_k=2, decode=True).target_queries == (1,)  # K = 4 never runs there
    assert ModelSpec(graph_capture_k=(0,)).graph_capture(max_k=8, decode=False).draft_queries == (1,)  # it drafts
    assert ModelSpec().graph_capture(max_k=0, decode=True) == GraphCapture(32, 2048, (1,), ())  # no drafts
    with pytest.raises(ValueError, match=r"graph_capture_k: expected values in 0\.\.64, got 65"):
        ModelSpec(graph_capture_k=(4, 65))
    with pytest.raises(ValueError, match=r"graph_capture_batch: expected an integer in 0\.\.256, got 300"):
        ModelSpec(graph_capture_batch=300)
    with pytest.raises(ValueError, match=r"graph_capture_batch: expected an integer in 0\.\.256, got -1"):
        ModelSpec(graph_capture_batch=-1)
    with pytest.raises(ValueError, match=r"graph_capture_context: expected an integer >= 1 \(keys\), got 0"):
        ModelSpec(graph_capture_context=0)
    with pytest.raises(ValueError, match=r"graph_capture_context: expected an integer >= 1 \(keys\), got 2\.5"):
        GraphCapture(context=2.5)
    with pytest.raises(ValueError, match=r"graph queries per row: expected integers in 1\.\.65, got 66"):
        GraphCapture(target_queries=(66,))
    for argv in (["--graph-capture-k", "4,x"], ["--graph-capture-batch", "-2"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    monkeypatch.setenv("PDSPEC_DECODE_GRAPH_CAPTURE_K", "4,x")  # a bad environment value: the parser's error
    with pytest.raises(SystemExit):
        parse_args([])


def test_capture_keys_cover_every_row_and_width_bucket_up_to_the_limits():
    from engine.paged_lm import capture_keys

    assert capture_keys(3, 100, (1,), 10_000) == [(1, 1, 256), (2, 1, 256), (4, 1, 256)]
    keys = capture_keys(32, 2048, (5, 1, 5), 100_000)
    assert len(keys) == 6 * 2 * 4 and keys[0] == (1, 1, 256) and keys[-1] == (32, 5, 2048)
    assert {w for _, _, w in capture_keys(1, 5000, (1,), 600)} == {256, 512, 1024}  # a pool of 600 tokens
    assert capture_keys(0, 2048, (1,), 10_000) == []


def test_paged_pair_captures_nothing_where_there_are_no_graphs(tmp_path):
    from engine.paged_lm import GraphCapture, capture_keys

    path = make_family_checkpoint(tmp_path, "llama", seed=1)
    make_tokenizer(path, [f"w{i}" for i in range(90)])
    pair = load_pair(target_model=path, draft_layers=1)
    budget = 100 * (bytes_per_token(pair.target) + bytes_per_token(pair.draft))
    paged = paged_pair(pair, budget, capture=GraphCapture(4, 512, (1, 5), (1,)))  # the CPU: eager
    assert not paged.target._graphs and paged.target.capture_graphs(4, 512, (1,)) == 0
    # Which keys a GPU would capture (its capture recorded: the CPU has no graphs), each once.
    lm, recorded = paged.target, []
    lm.graphs, lm._capture = True, lambda *key: recorded.append(key) or key
    assert lm.capture_graphs(2, 300, (1, 5)) == 4 and recorded == capture_keys(2, 300, (1, 5), 80)
    assert recorded == [(1, 1, 256), (1, 5, 256), (2, 1, 256), (2, 5, 256)]  # a pool of 80 tokens: one width
    assert lm.capture_graphs(4, 300, (1,)) == 1 and recorded[4:] == [(4, 1, 256)]  # none twice


def test_graph_bucket_padding_changes_no_real_row(models):
    """The inputs a captured graph replays (rows padded to a bucket, keys to a width bucket,
    padding on the scratch block) give the real rows exactly the unpadded logits."""
    from engine.kv_cache import PagedBatch, batch_meta

    contiguous, paged = models
    vocab = contiguous.vocab_size
    pairs = [
        (contiguous.prefill(p)[1], paged.prefill(p)[1]) for p in (ids(9, 1, vocab), ids(20, 2, vocab), ids(3, 3, vocab))
    ]
    for _, sp in pairs:
        paged.reserve(sp, len(sp.tokens) + 2)
    feed = [[5, 6], [7, 8], [9, 10]]  # uniform: 2 tokens per row, like a K = 1 verify pass
    want = contiguous.extend_batch([c for c, _ in pairs], feed)
    seqs = [p.kv for _, p in pairs]
    scratch_before = paged.pool.kv[:, :, : paged.pool.block_size].clone()
    meta = batch_meta(paged.pool, seqs, [2, 2, 2], paged.config.sliding_window, rows=4, width=256)
    past = [s.length for s in seqs]
    tokens = torch.tensor([t for row in feed for t in row] + [0, 0])
    positions = torch.tensor([p + i for p in past for i in range(2)] + [0, 0])
    seq_lens = torch.tensor([p + 2 for p in past for _ in range(2)] + [1, 1])
    with (
        torch.inference_mode()
    ):  # dense=True: what a captured graph replays; the ragged reorderings are identities here
        got, ragged = (
            paged.module(
                tokens, positions, PagedBatch(paged.pool, meta, dense=d), num_layers=paged.num_layers, seq_lens=seq_lens
            )
            for d in (True, False)
        )
    assert torch.equal(got, ragged)
    for row in range(3):
        assert_fp_close(got[2 * row : 2 * row + 2].float(), want[row], model_roundings(contiguous))
    assert torch.isfinite(got).all()
    touched = paged.pool.kv[:, :, paged.pool.block_size :]
    assert touched.abs().sum() > 0 and not torch.equal(paged.pool.kv[:, :, : paged.pool.block_size], scratch_before)
    for _, sp in pairs:
        paged.release(sp)


def test_staged_fields_are_typed_aligned_views_sent_in_one_copy():
    """`Staging`: each field a view of one device buffer at a 16-byte boundary, with its dtype and
    shape; what the host writes into its mirror's fields reaches them only at `send`."""
    from common.transfer import Staging

    staging = Staging([("a", (3,), torch.int64), ("m", (2, 3), torch.bool), ("x", (5,), torch.float32)], "cpu")
    fields = staging.fields
    assert [(f.dtype, tuple(f.shape)) for f in fields.values()] == [
        (torch.int64, (3,)),
        (torch.bool, (2, 3)),
        (torch.float32, (5,)),
    ]
    base = fields["a"].untyped_storage().data_ptr()
    assert [f.data_ptr() - base for f in fields.values()] == [0, 32, 48] and staging.nbytes == 80
    host = staging.host()
    host["a"][:], host["m"][1, 2], host["x"][:] = [7, 8, 9], True, 0.5
    assert fields["a"].tolist() == [0, 0, 0] and not fields["m"].any()  # not sent yet
    staging.send()
    assert fields["a"].tolist() == [7, 8, 9] and fields["m"].tolist() == [[False] * 3, [False, False, True]]
    assert fields["x"].tolist() == [0.5] * 5


def test_a_ragged_batch_padded_into_a_graph_bucket_changes_no_real_row(models):
    """Rows bringing 3, 1 and 2 tokens, padded the way a replay fills a (4 rows, 4 queries)
    graph's inputs (`_Graph.fill`: each row's tokens first in its places, padding queries and the
    padding row on the scratch slot, everything in one staged copy): the real tokens' logits are
    the unpadded ones, and the next tokens of every row find the KV this forward wrote. The
    inputs are filled twice, the first time with another batch: the second fill writes the other
    host mirror, and nothing of the first is left in the inputs."""
    from engine.kv_cache import PagedBatch, batch_meta
    from engine.paged_lm import _Graph, padded_places

    contiguous, paged = models
    vocab = contiguous.vocab_size
    pairs = [
        (contiguous.prefill(p)[1], paged.prefill(p)[1]) for p in (ids(9, 1, vocab), ids(20, 2, vocab), ids(3, 3, vocab))
    ]
    for _, sp in pairs:
        paged.reserve(sp, len(sp.tokens) + 4)
    feed, lengths = [[5, 6, 7], [8], [9, 10]], [3, 1, 2]
    want = contiguous.extend_batch([c for c, _ in pairs], feed)
    seqs = [p.kv for _, p in pairs]
    past = [s.length for s in seqs]
    graph = _Graph(4, 4, 256, paged.pool.block_size, "cpu")
    window = paged.config.sliding_window
    # two other batches first (rows of 4 tokens where this one pads): the last fill writes the
    # first one's mirror again, so what the first wrote must not be left there
    for batch in ([[3, 2, 1, 4], [1, 2, 3, 4], [7]], [[1], [2]], feed):
        sizes = [len(row) for row in batch]
        place = padded_places(sizes, 4)
        meta = batch_meta(paged.pool, seqs[: len(batch)], sizes, window, rows=4, width=256, queries=4, padded=True)
        graph.fill(
            torch.tensor([t for row in batch for t in row]),
            torch.tensor([p + i for p, n in zip(past[: len(sizes)], sizes, strict=True) for i in range(n)]),
            torch.tensor([p + n for p, n in zip(past[: len(sizes)], sizes, strict=True) for _ in range(n)]),
            meta,
            place.numpy(),
            place,
        )
    assert place.tolist() == [0, 1, 2, 4, 8, 9]
    tokens, positions, seq_lens = graph.tokens, graph.positions, graph.seq_lens
    assert tokens.tolist()[:6] == [5, 6, 7, 0, 8, 0] and seq_lens[3].item() == 1 and positions[3].item() == 0
    assert tokens[12:].tolist() == [0] * 4 and seq_lens[12:].tolist() == [1] * 4  # the padding row
    with torch.inference_mode():
        padded = paged.module(
            tokens,
            positions,
            PagedBatch(paged.pool, graph.meta, dense=True),
            num_layers=paged.num_layers,
            seq_lens=seq_lens,
        )
    for row, got in enumerate(padded[place].split(lengths)):
        assert_fp_close(got.float(), want[row], model_roundings(contiguous))
    for seq, n in zip(seqs, lengths, strict=True):
        seq.length += n
    for (c, sp), row in zip(pairs, feed, strict=True):
        sp.tokens += row
        next_want = contiguous.extend(c, [11])
        assert_fp_close(paged.extend(sp, [11]).float(), next_want, model_roundings(contiguous))
        paged.release(sp)


@pytest.mark.parametrize("layout", ["eager", "graph bucket"])
def test_a_shifted_chain_forward_is_the_forward_at_the_rows_true_lengths(models, layout):
    """Each row verified [x, d1, d2, d3] and kept x and its first a drafts (a = 3, 0, 1), which
    the host has not read: the next forward is built at the lengths that assume every draft
    kept and moved back on the device (`Shift`). Its logits are those of a model that only ever
    saw the kept tokens, eagerly and in a graph bucket's padded layout (rows padded to 4, 4
    queries a row); once the host drops the rejected drafts, the next token finds the right KV."""
    from engine.kv_cache import PagedBatch, Shift, batch_meta
    from engine.paged_lm import _Graph, padded_places

    contiguous, paged = models
    vocab = contiguous.vocab_size
    prompts, kept = (ids(9, 1, vocab), ids(20, 2, vocab), ids(3, 3, vocab)), (3, 0, 1)
    verified = [ids(4, 10 + r, vocab) for r in range(3)]
    feed, lengths = [[5, 6, 7], [8], [9, 10]], [3, 1, 2]
    want, pairs = [], []
    for prompt, tokens, a, row in zip(prompts, verified, kept, feed, strict=True):
        c, sp = contiguous.prefill(prompt)[1], paged.prefill(prompt)[1]
        paged.reserve(sp, len(prompt) + 4 + 3)
        paged.extend(sp, tokens)  # every draft's KV written, as the verify pass did
        contiguous.extend(c, tokens[: 1 + a])
        want.append(contiguous.extend(c, row))
        pairs.append((c, sp))
    states = [sp for _, sp in pairs]
    by = torch.tensor([a - 3 for a in kept])
    if layout == "eager":
        got = paged.extend_batch(states, feed, shift=by)
    else:  # as a replay fills a graph's inputs: the shift's tables staged in the same copy
        seqs = [sp.kv for sp in states]
        place = padded_places(lengths, 4)
        window = paged.config.sliding_window
        meta = batch_meta(paged.pool, seqs, lengths, window, rows=4, width=256, queries=4, padded=True)
        past = [s.length for s in seqs]
        graph = _Graph(4, 4, 256, paged.pool.block_size, "cpu")
        shift = Shift.layout(seqs, lengths, graph.blocks)
        graph.fill(
            torch.tensor([t for row in feed for t in row]),
            torch.tensor([p + i for p, n in zip(past, lengths, strict=True) for i in range(n)]),
            torch.tensor([p + n for p, n in zip(past, lengths, strict=True) for _ in range(n)]),
            meta,
            place.numpy(),
            place,
            shift,
        )
        positions, seq_lens = graph.positions, graph.seq_lens
        graph.shifted(by, shift).apply(positions, seq_lens, graph.meta, paged.pool.block_size, window)
        assert positions[place].tolist()[:3] == [len(prompts[0]) + 4 + i for i in range(3)]
        assert positions[4].item() == len(prompts[1]) + 1  # row 1 kept x alone
        with torch.inference_mode():
            out = paged.module(
                graph.tokens,
                positions,
                PagedBatch(paged.pool, graph.meta, dense=True),
                num_layers=paged.num_layers,
                seq_lens=seq_lens,
            )
        got = out[place].split(lengths)
        for sp, row in zip(states, feed, strict=True):
            sp.kv.length += len(row)
            sp.tokens += row
    for r, (c, sp) in enumerate(pairs):
        assert_fp_close(got[r].float(), want[r], model_roundings(contiguous))
        start = len(prompts[r]) + 1 + kept[r]  # the host drops the rejected drafts once it reads them
        del sp.tokens[start : len(prompts[r]) + 4]
        sp.kv.length -= 3 - kept[r]
        assert_fp_close(paged.extend(sp, [11]).float(), contiguous.extend(c, [11]), model_roundings(contiguous))
        paged.release(sp)


def test_chunked_import_at_any_byte_boundaries_equals_the_export(models):
    """A KV streamed in slices that start and end anywhere (inside an element, a row, a head)
    lands in the pool and the contiguous cache exactly as exported; release mid-import frees it."""
    contiguous, paged = models
    prompt = ids(37, 4, contiguous.vocab_size)  # 3 blocks, the last one partial
    exported = contiguous.export_state(contiguous.prefill(prompt)[1])
    sizes = [t.numel() * t.element_size() for t in exported]
    cuts = torch.Generator().manual_seed(7)
    for model in (paged, contiguous):
        state = model.begin_import(prompt, len(prompt) + 9)
        for index, tensor in enumerate(exported):
            data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
            offset = 0
            while offset < sizes[index]:  # 1..150 bytes: float32 elements and 64-byte rows split
                step = int(torch.randint(1, 151, (), generator=cuts))
                model.import_chunk(state, index, offset, data[offset : offset + step])
                offset += len(data[offset : offset + step])
        with pytest.raises(ValueError, match=r"data: expected at most 0 bytes at offset \d+ of KV tensor 0"):
            model.import_chunk(state, 0, sizes[0], b"x")  # the import checks its ranges itself
        with pytest.raises(ValueError, match=r"index: expected a KV tensor in 0\.\.3, got 4"):
            model.import_chunk(state, 4, 0, b"x")
        model.finish_import(state)
        for got, want in zip(model.export_state(state), exported, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        into = [torch.empty_like(t) for t in exported]  # an export into given memory (a shm segment's)
        assert all(a is b for a, b in zip(model.export_state(state, into), into, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(into, exported, strict=True))
        torch.testing.assert_close(
            model.extend(state, [3]), contiguous.extend(contiguous.import_state(exported, prompt), [3])
        )
        model.release(state)
    assert paged.pool.used_blocks == 0
    half = paged.begin_import(prompt, len(prompt))  # a stream cut off half way
    paged.import_chunk(half, 0, 0, exported[0])
    assert paged.pool.used_blocks == paged.pool.blocks_for(len(prompt))
    paged.release(half)
    assert paged.pool.used_blocks == 0


def test_each_node_hands_its_start_up_capture_to_paged_pair(pair, monkeypatch):
    """Both run_servers (real gRPC servers on loopback) pass paged_pair the capture of their
    role: the decode node its engine's batch and K limits, the prefill node its draft's depths."""
    import decode_node.server
    import prefill_node.server
    from decode_node.engine import DecodeConfig
    from engine.paged_lm import GraphCapture
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import PrefillConfig
    from tests.nodes.conftest import cluster

    seen: dict[str, GraphCapture] = {}
    for module in (decode_node.server, prefill_node.server):
        real = module.paged_pair

        def spy(*args, _real=real, _role=module.__name__, capture=None, **kwargs):
            seen[_role] = capture
            return _real(*args, capture=capture, **kwargs)

        monkeypatch.setattr(module, "paged_pair", spy)
    models = ModelSpec(graph_capture_batch=16, graph_capture_context=512, graph_capture_k=(2, 4))
    with cluster(
        pair,
        DecodeConfig(spec=SpeculativeConfig(max_speculative_tokens=2), max_batch=4),
        PrefillConfig(spec=SpeculativeConfig(max_speculative_tokens=2, num_speculative_tokens=2)),
        decode_node={"models": models},
        models=models,
    ) as (client, _, _):
        assert len(client.generate("def ", max_new_tokens=4, seed=1, timeout=10).token_ids) == 4
    assert seen["decode_node.server"] == GraphCapture(4, 512, (1, 3), (1, 2))  # K = 4 > the node's 2: left out
    assert seen["prefill_node.server"] == GraphCapture(16, 512, (), (1,))


def test_graph_keys_replay_captured_graphs_before_capturing_new_ones(models):
    """The graph a forward replays: its own key where captured; else the fewest captured
    queries per row for its rows and width that hold its longest row (a verify pass of a K
    below the captured one, a ragged one), within the padding bound; else a new key (uniform,
    or ragged within the bound) or eager (ragged beyond it)."""
    from engine.paged_lm import MAX_GRAPH_QUERIES, PAD_TOKENS

    _, paged = models
    assert not paged._graphs  # the CPU captures none: the keys below stand for captured graphs
    try:
        seqs = [SimpleNamespace(length=100) for _ in range(3)]  # rows bucket 4, width bucket 256
        paged._graphs = dict.fromkeys([(4, 1, 256), (4, 5, 256), (4, 9, 256), (1, 3, 256)])
        key = paged._graph_key
        assert key(seqs, [1, 1, 1]) == (4, 1, 256)  # a decode step: its own, captured
        assert key(seqs, [2, 2, 2]) == (4, 5, 256)  # K = 1 while K = 4 is captured: padded, no capture
        assert key(seqs, [5, 5, 5]) == (4, 5, 256)
        assert key(seqs, [6, 1, 2]) == (4, 9, 256)  # ragged: the fewest that hold the longest row
        assert key(seqs, [10, 10, 10]) == (4, 10, 256)  # none holds it: its own, captured on first use
        assert key(seqs, [10, 1, 10]) == (4, 10, 256)  # ragged, none holds it: its longest row's
        assert key(seqs[:1], [2]) == (1, 3, 256)
        assert key(seqs[:1], [1]) == (1, 3, 256)  # padded too: a replay, not a capture
        assert key([SimpleNamespace(length=300)] * 3, [2, 2, 2]) == (4, 2, 512)  # another width: its own
        assert key(seqs, [MAX_GRAPH_QUERIES + 1, 1, 1]) is None
        # Beyond the bound: a uniform batch captures its own key, a ragged one runs eagerly.
        rows = PAD_TOKENS // 8  # a row bucket whose only graph has 16 queries: padding 1 -> 16 runs > 256 tokens
        many = [SimpleNamespace(length=100)] * rows
        paged._graphs = {(rows, 16, 256): None}
        assert key(many, [1] * rows) == (rows, 1, 256)
        assert key(many, [2] + [1] * (rows - 1)) is None
        assert key(many, [16] * rows) == (rows, 16, 256)
    finally:
        paged._graphs = {}
