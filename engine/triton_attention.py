"""Paged attention in Triton: every row's queries against its live slots of the KV pool, read in place.

    paged_attention(q_rows, cache, key_slots, key_count, mask) -> out [R, Q, Hq, D]

The torch reference is `PagedBatch`'s gather + SDPA (engine/kv_cache.py): it copies each row's
keys and values into a padded `[R, Hkv, W, D]` tensor and then attends; this kernel reads the
same slots where they lie. `bench/attention.py` checks the two against each other and times
them; `tests/engine/test_triton_attention.py` (GPU) checks them on every shape the engine runs.

One program per (row, KV head, split of SPLIT keys). It loads the G·Q queries that share the
KV head (G = Hq / Hkv query heads x the row's Q queries: flash-decoding's GQA packing, so one
tile of keys serves all of them), walks its split's live keys (up to `key_count[row]`) in tiles
of BLOCK_N slots through `key_slots`, and keeps a running max and sum (online softmax) in
float32. The splits are a fixed number of key positions, not a function of the batch: a row's
result is the same bits whether it runs alone, beside longer rows, or padded to a wider graph
bucket (a split past its live keys runs no tile and adds exact zeros). With more than one split
a second kernel merges them by their log-sum-exp, in split order.

Imports triton: load it where `torch.cuda` runs (CUDA or ROCm), or on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, set before the import: the CPU tests run the kernel so).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

SPLIT = 128  # keys per program: at one row of 256 tokens 8 KV heads x 3 splits run side by side
BLOCK_N = 64  # keys per tile
MAX_PACKED_QUERIES = 128  # G * Q rows of one program; a longer chunk (a prompt) takes SDPA
LOG2E = 1.4426950408889634


# Every int that changes with the batch (rows, key width, queries per row, the strides they
# make) is a plain runtime value: Triton would otherwise compile a new variant for each value of
# a constexpr and for each int that is 1 or a multiple of 16, so the first prompt of each new
# length would wait for a compile (about a second). What is left (BLOCK_M's buckets x DIRECT) is
# compiled at start-up by `warm_up`.
@triton.jit(
    do_not_specialize=["stride_qr", "stride_qq", "stride_sr", "stride_mr", "stride_mq", "rows", "width", "queries"]
)
def _split_kernel(
    q_ptr,
    kv_ptr,
    slots_ptr,
    count_ptr,
    mask_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    stride_qr,
    stride_qq,
    stride_qh,
    stride_plane,
    stride_slot,
    stride_head,
    stride_sr,
    stride_mr,
    stride_mq,
    rows,
    width,
    queries,
    scale_log2,
    G: tl.constexpr,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)  # the KV head
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)  # packed query m = (query m // G, head head * G + m % G)
    query = m // G
    qhead = head * G + m % G
    m_ok = m < queries * G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = row * stride_qr + query[:, None] * stride_qq + qhead[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]

    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = split * SPLIT
    # this split's live keys, and never a column past W whatever key_count says: no load out of bounds
    hi = tl.minimum(tl.minimum(lo + SPLIT, tl.load(count_ptr + row)), width)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slot = tl.load(slots_ptr + row * stride_sr + n, mask=n_ok, other=0)  # int64
        kv_off = slot[:, None] * stride_slot + head * stride_head + d[None, :]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + kv_off, mask=kv_ok, other=0.0)  # [BN, BD]
        v = tl.load(kv_ptr + stride_plane + kv_off, mask=kv_ok, other=0.0)
        # float32 models: no TF32 rounding (SDPA computes them in full float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
        scores = scores * scale_log2  # [BM, BN], log2 units
        allowed = tl.load(
            mask_ptr + row * stride_mr + query[:, None] * stride_mq + n[None, :],
            mask=m_ok[:, None] & n_ok[None, :],
            other=0,
        )
        scores = tl.where(allowed != 0, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # a query with nothing seen yet
        p = tl.exp2(scores - safe[:, None])
        alpha = tl.exp2(run_max - safe)
        run_sum = run_sum * alpha + tl.sum(p, 1)
        pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)  # [BM, BD]
        acc = acc * alpha[:, None] + pv
        run_max = new_max

    out = tl.where(run_sum[:, None] > 0, acc / run_sum[:, None], 0.0)  # [BM, BD]
    o_ok = m_ok[:, None] & d_ok[None, :]
    flat = (row * queries + query) * HQ + qhead  # [BM]: (row, query, head) of the contiguous output
    if DIRECT:
        tl.store(out_ptr + flat[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=o_ok)
    else:
        part = split * rows * queries * HQ + flat
        tl.store(part_ptr + part[:, None] * D + d[None, :], out, mask=o_ok)
        lse = tl.where(run_sum > 0, run_max + tl.log2(run_sum), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=m_ok)


@triton.jit(do_not_specialize=["total", "splits"])
def _merge_kernel(part_ptr, lse_ptr, out_ptr, total, splits, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (row, query, head): the splits' outputs weighted by their softmax mass."""
    i = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    top = float("-inf")
    for s in range(splits):
        top = tl.maximum(top, tl.load(lse_ptr + s * total + i))
    num = tl.zeros([BLOCK_D], tl.float32)
    den = 0.0
    for s in range(splits):
        weight = tl.exp2(tl.load(lse_ptr + s * total + i) - top)  # 0 for a split with no live key
        num += weight * tl.load(part_ptr + (s * total + i) * D + d, mask=d_ok, other=0.0)
        den += weight
    tl.store(out_ptr + i * D + d, (num / den).to(out_ptr.dtype.element_ty), mask=d_ok)


def block_m(queries: int, group: int) -> int:
    """The packed-query tile of a forward with `queries` per row and `group` query heads per KV
    head: a power of two in [16, MAX_PACKED_QUERIES], one compiled variant each."""
    return max(16, triton.next_power_of_2(queries * group))


def fits(queries: int, q_heads: int, kv_heads: int) -> bool:
    """Whether a forward with `queries` per row packs into one program's tile."""
    return queries * (q_heads // kv_heads) <= MAX_PACKED_QUERIES


def paged_attention(
    q_rows: torch.Tensor, cache: torch.Tensor, key_slots: torch.Tensor, key_count: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention of each row's queries over its key slots, read from the pool in place.

    q_rows    [R, Q, Hq, D]  float32 / float16 / bfloat16 (any strides, last dim contiguous)
    cache     [2, S, Hkv, D] the same dtype: one layer of the pool (keys, values), contiguous
    key_slots [R, W]         int64: row r's key j lives in slot key_slots[r, j] (in [0, S):
                             the pool's block tables guarantee it; padding keys name the scratch slot)
    key_count [R]            int64 in [1, W]: row r's keys are key_slots[r, :key_count[r]]; the
                             kernel reads no slot past them
    mask      [R, 1, Q, W]   bool: True where query i of row r may attend to key j; every query
                             must allow at least one key (padding queries allow all)
    returns   [R, Q, Hq, D]  contiguous, q's dtype: softmax(q k^T / sqrt(D)) v per query head,
                             query head h reading KV head h // (Hq / Hkv)
    """
    if q_rows.dim() != 4 or cache.dim() != 4 or key_slots.dim() != 2 or mask.dim() != 4:
        raise ValueError(
            "q_rows/cache/key_slots/mask: expected 4/4/2/4 dims, got "
            f"{q_rows.dim()}/{cache.dim()}/{key_slots.dim()}/{mask.dim()}"
        )
    rows, queries, hq, dim = q_rows.shape
    hkv = cache.shape[2]
    width = key_slots.shape[1]
    if cache.shape[0] != 2 or cache.shape[3] != dim or not cache.is_contiguous():
        raise ValueError(f"cache: expected a contiguous [2, S, Hkv, {dim}], got {tuple(cache.shape)}")
    if hq % hkv:
        raise ValueError(f"q_rows: expected query heads a multiple of the {hkv} KV heads, got {hq}")
    if cache.dtype != q_rows.dtype or q_rows.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q_rows/cache: expected one float dtype, got {q_rows.dtype}/{cache.dtype}")
    if q_rows.stride(3) != 1:
        raise ValueError(f"q_rows: expected a contiguous last dim, got strides {q_rows.stride()}")
    if key_slots.dtype != torch.int64 or key_slots.shape[0] != rows or key_slots.stride(1) != 1:
        got = f"{key_slots.dtype} {tuple(key_slots.shape)} strides {key_slots.stride()}"
        raise ValueError(f"key_slots: expected int64 [{rows}, W] with contiguous rows, got {got}")
    if key_count.dtype != torch.int64 or tuple(key_count.shape) != (rows,):
        raise ValueError(f"key_count: expected int64 [{rows}], got {key_count.dtype} {tuple(key_count.shape)}")
    if mask.dtype != torch.bool or tuple(mask.shape) != (rows, 1, queries, width) or mask.stride(3) != 1:
        raise ValueError(f"mask: expected bool [{rows}, 1, {queries}, {width}], got {mask.dtype} {tuple(mask.shape)}")
    if not fits(queries, hq, hkv):
        raise ValueError(f"q_rows: expected Q * Hq / Hkv <= {MAX_PACKED_QUERIES}, got {queries} x {hq // hkv}")
    devices = {t.device for t in (q_rows, cache, key_slots, key_count, mask)}
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # numpy on the CPU
    if len(devices) != 1 or (next(iter(devices)).type != "cuda" and not interpreted):
        got = sorted(map(str, devices))
        raise ValueError(f"q_rows/cache/key_slots/key_count/mask: expected one CUDA (or ROCm) device, got {got}")

    group = hq // hkv
    splits = max(1, -(-width // SPLIT))
    out = torch.empty(rows, queries, hq, dim, dtype=q_rows.dtype, device=q_rows.device)
    direct = splits == 1
    total = rows * queries * hq
    part = out if direct else torch.empty(splits * total, dim, dtype=torch.float32, device=out.device)
    lse = out if direct else torch.empty(splits * total, dtype=torch.float32, device=out.device)
    block_d = max(16, triton.next_power_of_2(dim))
    mask8 = mask.view(torch.uint8)
    _split_kernel[(rows, hkv, splits)](
        q_rows,
        cache,
        key_slots,
        key_count,
        mask8,
        out,
        part,
        lse,
        q_rows.stride(0),
        q_rows.stride(1),
        q_rows.stride(2),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        key_slots.stride(0),
        mask8.stride(0),
        mask8.stride(2),
        rows,
        width,
        queries,
        LOG2E / math.sqrt(dim),
        G=group,
        HQ=hq,
        D=dim,
        BLOCK_M=block_m(queries, group),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        SPLIT=SPLIT,
        DIRECT=direct,
        IEEE=q_rows.dtype == torch.float32,
    )
    if not direct:
        _merge_kernel[(total,)](part, lse, out, total, splits, D=dim, BLOCK_D=block_d)
    return out


def warm_up(q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Compile every variant of the kernels that a model of this shape can launch (each packed
    query tile, with and without split merging) on a scratch pool, so that no request waits for
    a compile; how many launches that took."""
    group = q_heads // kv_heads
    tiles = {block_m(q, group): q for q in range(1, MAX_PACKED_QUERIES // group + 1)}  # tile -> queries
    cache = torch.zeros(2, 2, kv_heads, dim, dtype=dtype, device=device)
    launches = 0
    for queries in tiles.values():
        for width in (1, SPLIT + 1):  # one split (direct) and two (merged)
            q_rows = torch.zeros(1, queries, q_heads, dim, dtype=dtype, device=device)
            slots = torch.zeros(1, width, dtype=torch.int64, device=device)
            count = torch.full((1,), width, dtype=torch.int64, device=device)
            mask = torch.ones(1, 1, queries, width, dtype=torch.bool, device=device)
            paged_attention(q_rows, cache, slots, count, mask)
            launches += 1
    return launches
