"""The Triton paged-attention kernel against its torch reference, the engine's gather + SDPA
(`make test-gpu`): every head layout, dtype, query count, tree and sliding-window mask the
engine runs, ragged rows across the kernel's key splits, padded graph widths; a row's result
is the same bits alone and in any batch; bad inputs are refused before launch."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from engine.kv_cache import KvPool, PagedBatch, PagedSeq, batch_meta
from engine.triton_attention import SPLIT, paged_attention

pytestmark = pytest.mark.gpu

BLOCK = 16


def setup(heads, lengths, queries, dtype, *, seed=0, width=None, window=None, trees=None, rows=None):
    """A one-layer pool with rows of `lengths` past tokens, `queries` new ones each; the pool's
    blocks handed out in a shuffled order. Returns (pool, seqs, meta on the GPU, q, kv)."""
    hq, hkv, dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = 2 + sum(-(-(n + queries) // BLOCK) for n in lengths) + 4
    pool = KvPool(layers=1, kv_heads=hkv, head_dim=dim, num_blocks=blocks, block_size=BLOCK, dtype=dtype, device="cuda")
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
    q = torch.randn(count, hq, dim, generator=gen).to("cuda", dtype)  # [N, Hq, D]
    kv = torch.randn(2, count, hkv, dim, generator=gen).to("cuda", dtype)  # [2, N, Hkv, D]
    return pool, seqs, meta.to("cuda"), q, kv


def both(pool, _seqs, meta, q, kv):
    want = PagedBatch(pool, meta, dense=True).attend(0, q, kv)
    got = PagedBatch(pool, meta, dense=True, kernel=paged_attention).attend(0, q, kv)
    return got, want


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64), (4, 4, 16), (8, 2, 8)], ids=str)
@pytest.mark.parametrize("queries", [1, 2, 5, 9])
def test_the_kernel_equals_gather_and_sdpa(dtype, heads, queries):
    # a fresh row, rows ending inside the first split, on its edge, and in the second and third
    lengths = [0, 7, SPLIT - queries, SPLIT + 3, 2 * SPLIT + 100]
    got, want = both(*setup(heads, lengths, queries, dtype))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graph_padding_tree_masks_and_a_sliding_window(dtype):
    tol = TOLERANCE[dtype]
    heads = (32, 8, 128)
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


@pytest.mark.parametrize("queries", [1, 5])
def test_a_rows_result_is_the_same_bits_in_any_batch_and_width(queries):
    """Alone at its own width (one key split: no merge; or two), beside longer rows, padded to
    a wider bucket: identical."""
    heads, dtype = (32, 8, 128), torch.bfloat16
    pool, seqs, meta, q, kv = setup(heads, [150, 900, 33], queries, dtype, seed=5, rows=4, width=2048)
    together = PagedBatch(pool, meta, dense=True, kernel=paged_attention).attend(0, q, kv)
    for row in (0, 2):  # 150 keys: two splits alone; 33: one
        mine = slice(row * queries, (row + 1) * queries)
        alone = batch_meta(pool, seqs[row : row + 1], [queries], None).to("cuda")
        one = PagedBatch(pool, alone, dense=True, kernel=paged_attention).attend(0, q[mine], kv[:, mine])
        assert torch.equal(one, together[mine])
        wide = batch_meta(pool, seqs[row : row + 1], [queries], None, rows=2, width=4096).to("cuda")
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
    with pytest.raises(ValueError, match="one CUDA"):
        paged_attention(q_rows, cache, meta.key_slots.cpu(), meta.key_count, meta.mask)
    with pytest.raises(ValueError, match=r"Q \* Hq / Hkv <= 128"):
        wide = q_rows.expand(2, 40, 32, 128)
        paged_attention(wide, cache, meta.key_slots, meta.key_count, meta.mask.expand(2, 1, 40, meta.mask.shape[-1]))
