"""The Triton paged-attention kernel against its torch reference, the engine's gather + SDPA:
the head layouts, dtypes, query counts, tree and sliding-window masks the engine runs, ragged
rows across the kernel's key splits, padded graph widths; a row's result is the same bits alone
and in any batch; bad inputs are refused before launch.

On a GPU (`make test-gpu`) every case runs on the device. Without one (CI) the same kernel runs
under Triton's interpreter on the CPU (numpy, float32, the smaller head layouts): slow, but the
kernel's indexing, masking, splits and merge are checked against the reference on every push."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # a torch without Triton and no dev extra: no kernel to test
    pytest.skip("Triton is not installed", allow_module_level=True)
GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at import

from engine.kv_cache import KvPool, PagedBatch, PagedSeq, batch_meta  # noqa: E402
from engine.triton_attention import SPLIT, paged_attention  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
# the interpreter computes 0/0 and log2(0) in the branch that tl.where then drops
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BLOCK = 16
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if GPU else [torch.float32]
HEADS = [(32, 8, 128), (9, 3, 64), (4, 4, 16), (8, 2, 8)] if GPU else [(9, 3, 64), (8, 2, 8)]
QUERIES = [1, 2, 5, 9] if GPU else [1, 5]
LLAMA3 = (32, 8, 128) if GPU else (8, 2, 16)  # the 8B layout, or a small one for the interpreter


def setup(heads, lengths, queries, dtype, *, seed=0, width=None, window=None, trees=None, rows=None):
    """A one-layer pool with rows of `lengths` past tokens, `queries` new ones each; the pool's
    blocks handed out in a shuffled order. Returns (pool, seqs, meta on the GPU, q, kv)."""
    hq, hkv, dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = 2 + sum(-(-(n + queries) // BLOCK) for n in lengths) + 4
    pool = KvPool(layers=1, kv_heads=hkv, head_dim=dim, num_blocks=blocks, block_size=BLOCK, dtype=dtype, device=DEVICE)
    random.Random(seed).shuffle(pool._free)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    seqs = []
    for n in lengths:
        seq = PagedSeq()
        pool.reserve(seq, n + queries)
        seq.length = n
        seqs.append(seq)
    meta = batch_meta(pool, seqs, [queries] * len(seqs), window, rows=rows, width=width, tree_masks=trees)
    count = (rows or len(seqs)) * queries
    q = torch.randn(count, hq, dim, generator=gen).to(DEVICE, dtype)  # [N, Hq, D]
    kv = torch.randn(2, count, hkv, dim, generator=gen).to(DEVICE, dtype)  # [2, N, Hkv, D]
    return pool, seqs, meta.to(DEVICE), q, kv


def both(pool, _seqs, meta, q, kv):
    want = PagedBatch(pool, meta, dense=True).attend(0, q, kv)
    got = PagedBatch(pool, meta, dense=True, kernel=paged_attention).attend(0, q, kv)
    return got, want


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("queries", QUERIES)
def test_the_kernel_equals_gather_and_sdpa(dtype, heads, queries):
    # a fresh row, rows ending inside the first split, on its edge, and in the second and third
    lengths = [0, 7, SPLIT - queries, SPLIT + 3, 2 * SPLIT + 100]
    got, want = both(*setup(heads, lengths, queries, dtype))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_graph_padding_tree_masks_and_a_sliding_window(dtype):
    tol = TOLERANCE[dtype]
    heads = LLAMA3
    # a graph bucket: 3 real rows padded to 4, keys padded to 1024 (the scratch slot beyond)
    got, want = both(*setup(heads, [40, 300, 5], 5, dtype, rows=4, width=1024))
    torch.testing.assert_close(got[:15], want[:15], atol=tol, rtol=tol)
    # tree masks: each node sees the context, itself and some earlier nodes
    gen = torch.Generator().manual_seed(3)
    trees = []
    for past in (20, 270):
        mask = torch.ones(6, past + 6, dtype=torch.bool)
        mask[:, past:] = torch.rand(6, 6, generator=gen) < 0.5
        mask[:, past:] &= torch.ones(6, 6, dtype=torch.bool).tril()
        mask[:, past:] |= torch.eye(6, dtype=torch.bool)
        trees.append(mask)
    torch.testing.assert_close(*both(*setup(heads, [20, 270], 6, dtype, trees=trees)), atol=tol, rtol=tol)
    # a sliding window shorter than the rows
    torch.testing.assert_close(*both(*setup(heads, [90, 600], 3, dtype, window=64)), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_a_ragged_batch_through_the_flattened_layout(dtype):
    """Rows bringing different numbers of tokens (a verify pass with mixed K, an eager catch-up):
    the queries are gathered into the padded [R, Q] layout and back, padding queries in between."""
    hq, hkv, dim = LLAMA3
    gen = torch.Generator().manual_seed(9)
    pool = KvPool(layers=1, kv_heads=hkv, head_dim=dim, num_blocks=80, block_size=BLOCK, dtype=dtype, device=DEVICE)
    random.Random(9).shuffle(pool._free)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    lengths, new = [12, 140, 0, 300], [1, 5, 3, 2]
    seqs = []
    for past, n in zip(lengths, new, strict=True):
        seq = PagedSeq()
        pool.reserve(seq, past + n)
        seq.length = past
        seqs.append(seq)
    meta = batch_meta(pool, seqs, new, None).to(DEVICE)
    q = torch.randn(sum(new), hq, dim, generator=gen).to(DEVICE, dtype)  # [N, Hq, D], flattened
    kv = torch.randn(2, sum(new), hkv, dim, generator=gen).to(DEVICE, dtype)
    want = PagedBatch(pool, meta).attend(0, q, kv)
    got = PagedBatch(pool, meta, kernel=paged_attention).attend(0, q, kv)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("queries", [1, 5])
def test_a_rows_result_is_the_same_bits_in_any_batch_and_width(queries):
    """Alone at its own width (one key split: no merge; or two), beside longer rows, padded to
    a wider bucket: identical."""
    heads, dtype = LLAMA3, torch.bfloat16 if GPU else torch.float32
    longest, width, wider = (900, 2048, 4096) if GPU else (300, 512, 1024)
    pool, seqs, meta, q, kv = setup(heads, [150, longest, 33], queries, dtype, seed=5, rows=4, width=width)
    together = PagedBatch(pool, meta, dense=True, kernel=paged_attention).attend(0, q, kv)
    for row in (0, 2):  # 150 keys: two splits alone; 33: one
        mine = slice(row * queries, (row + 1) * queries)
        alone = batch_meta(pool, seqs[row : row + 1], [queries], None).to(DEVICE)
        one = PagedBatch(pool, alone, dense=True, kernel=paged_attention).attend(0, q[mine], kv[:, mine])
        assert torch.equal(one, together[mine])
        wide = batch_meta(pool, seqs[row : row + 1], [queries], None, rows=2, width=wider).to(DEVICE)
        two = PagedBatch(pool, wide, dense=True, kernel=paged_attention).attend(
            0, q[mine].repeat(2, 1, 1), kv[:, mine].repeat(1, 2, 1, 1)
        )
        assert torch.equal(two[:queries], one)


def test_bad_inputs_are_refused_before_launch():
    pool, _, meta, q, _ = setup((32, 8, 128), [10, 20], 1, torch.bfloat16)
    cache = pool.kv[0]
    q_rows = q.view(2, 1, 32, 128)
    with pytest.raises(ValueError, match=r"mask: expected bool \[2, 1, 1, \d+\]"):
        paged_attention(q_rows, cache, meta.key_slots, meta.key_count, meta.mask.int())
    with pytest.raises(ValueError, match="key_slots: expected int64"):
        paged_attention(q_rows, cache, meta.key_slots.int(), meta.key_count, meta.mask)
    with pytest.raises(ValueError, match=r"key_count: expected int64 \[2\]"):
        paged_attention(q_rows, cache, meta.key_slots, meta.key_count[:1], meta.mask)
    with pytest.raises(ValueError, match="q_rows/cache: expected one float dtype"):
        paged_attention(q_rows.float(), cache, meta.key_slots, meta.key_count, meta.mask)
    with pytest.raises(ValueError, match="query heads a multiple"):
        paged_attention(q_rows[:, :, :30], cache, meta.key_slots, meta.key_count, meta.mask)
    if GPU:  # the interpreter takes CPU tensors
        with pytest.raises(ValueError, match="one CUDA"):
            paged_attention(q_rows, cache, meta.key_slots.cpu(), meta.key_count, meta.mask)
    with pytest.raises(ValueError, match=r"Q \* Hq / Hkv <= 128"):
        wide = q_rows.expand(2, 40, 32, 128)
        paged_attention(wide, cache, meta.key_slots, meta.key_count, meta.mask.expand(2, 1, 40, meta.mask.shape[-1]))


def compiled(kernel) -> int:
    """Variants of a Triton kernel compiled in this process for the current device."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.parametrize("heads", HEADS[1:2] + HEADS[-1:] if GPU else HEADS[-1:], ids=str)
def test_warm_up_compiles_every_variant_a_request_can_launch(heads):
    """After `warm_up`, no batch size, key width or query count compiles anything new: the first
    prompt of each length would otherwise wait for a compile. Under the interpreter (CPU) only
    the launches run: every tile size, with and without merging splits."""
    from engine import triton_attention

    hq, hkv, dim = heads
    group = hq // hkv
    launches = triton_attention.warm_up(hq, hkv, dim, torch.float32, torch.device(DEVICE))
    tiles = {triton_attention.block_m(q, group) for q in range(1, triton_attention.MAX_PACKED_QUERIES // group + 1)}
    assert launches == 2 * len(tiles)
    if not GPU:
        return
    before = compiled(triton_attention._split_kernel), compiled(triton_attention._merge_kernel)
    rng = random.Random(0)
    for _ in range(24):
        queries = rng.randint(1, triton_attention.MAX_PACKED_QUERIES // group)
        lengths = [rng.randint(1, 3 * SPLIT) for _ in range(rng.randint(1, 5))]
        got, want = both(*setup(heads, lengths, queries, torch.float32, seed=rng.randint(0, 99)))
        torch.testing.assert_close(got, want, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    assert (compiled(triton_attention._split_kernel), compiled(triton_attention._merge_kernel)) == before
