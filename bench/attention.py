"""Attention over the paged KV pool, by backend (which one the engine should run).

    python bench/attention.py [--device cuda] [--batches 1,8,32,64] [--contexts 256,1024,4096]
                              [--queries 1,5] [--repeat 50] [--no-flex] [--name attention] [--smoke]

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head dim 128; bf16 on a GPU,
float32 on the CPU) on a `KvPool` of 16-token blocks handed out in a shuffled order, as after a
while of serving. Per (rows, context, queries per row), each backend writes the step's new keys
and values into their slots and attends every query to its row's live slots:
* `gather + SDPA` — `PagedBatch.attend` without a kernel (the torch reference): each row's live
  slots gathered through its block table into a padded copy, then SDPA (GQA-packed for several
  queries per row);
* `Triton` — `PagedBatch.attend` with engine/triton_attention.paged_attention: the same slots
  read in place, one program per (row, KV head, 256-key split), the splits merged (CUDA/ROCm);
* `FlexAttention` — `flex_attention` with the rows as the batch and the whole pool as every
  row's key sequence (a stride-0 view: nothing copied), a block mask built from the block tables
  (`mask_mod`: the slot's owner and position) telling each row which 128-slot key blocks to
  read; building the mask is per-step work and is timed apart. It is compiled once per shape,
  so dynamo's recompile limit is raised to cover every case (past it, dynamo falls back to the
  eager path, which materialises the scores over the whole pool);
* `SDPA, contiguous` — each row's KV already contiguous (no paging), SDPA only: what reading the
  blocks in place could reach at best.
Outputs are checked against `gather + SDPA` before timing. Medians of `--repeat` calls, each
a CUDA-graph replay on a GPU (the engine replays graphs; eager calls would time the launches).
Writes bench/results/<name>-*.json.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, median_time, report
from engine.kv_cache import KvPool, PagedBatch, PagedSeq, batch_meta

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def timed(fn, device: str, repeat: int) -> float:
    """Median seconds of fn(). On a GPU fn is captured in a CUDA graph first and each replay is
    timed with CUDA events, as the engine runs it: eager launches would time the host instead."""
    for _ in range(3):
        fn()
    if device != "cpu":
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as err:  # not capturable (a host sync inside): timed eagerly
            print(f"  (eager: {str(err)[:80]})", flush=True)
        else:
            fn = graph.replay
            fn()
    return median_time(fn, repeat, warmup=0, events=device != "cpu")


class Case:
    """One layer's pool with `rows` sequences of `context` live tokens, `queries` new ones each."""

    def __init__(self, rows: int, context: int, queries: int, device: str, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.context, self.queries = rows, context, queries
        blocks = 1 + rows * -(-(context + queries) // BLOCK) + 8
        self.pool = KvPool(
            layers=1, kv_heads=KV_HEADS, head_dim=DIM, num_blocks=blocks, block_size=BLOCK, dtype=dtype, device=device
        )
        random.Random(seed).shuffle(self.pool._free)  # blocks in a serving-like order, not consecutive
        self.pool.kv.copy_(torch.randn(self.pool.kv.shape, generator=gen).to(dtype))
        self.seqs = []
        for _ in range(rows):
            seq = PagedSeq()
            self.pool.reserve(seq, context + queries)
            seq.length = context
            self.seqs.append(seq)
        n = rows * queries
        self.q = torch.randn(n, HEADS, DIM, generator=gen).to(device, dtype)  # [N, Hq, D]
        self.kv = torch.randn(2, n, KV_HEADS, DIM, generator=gen).to(device, dtype)  # [2, N, Hkv, D]
        self.meta = batch_meta(self.pool, self.seqs, [queries] * rows, None).to(device)
        # Slot -> (owner row, position), for the block mask; -1: not a live slot of any row.
        slots = self.pool.kv.shape[2]
        self.owner = torch.full((slots,), -1, dtype=torch.int64)
        self.position = torch.zeros(slots, dtype=torch.int64)
        for r, seq in enumerate(self.seqs):
            live = self.pool.slots(seq, 0, context + queries)
            self.owner[live] = r
            self.position[live] = torch.arange(context + queries)
        self.owner, self.position = self.owner.to(device), self.position.to(device)

    def gather_sdpa(self) -> torch.Tensor:
        return PagedBatch(self.pool, self.meta, dense=True).attend(0, self.q, self.kv)  # [N, Hq, D]

    def triton(self) -> torch.Tensor:
        from engine.triton_attention import paged_attention

        return PagedBatch(self.pool, self.meta, dense=True, kernel=paged_attention).attend(0, self.q, self.kv)

    def contiguous_inputs(self):
        """Each row's keys and values as [R, Hkv, L, D] (made once, outside the timing)."""
        self.gather_sdpa()  # the new KV in its slots
        cache = self.pool.kv[0]
        slots = torch.stack([self.pool.slots(s, 0, self.context + self.queries) for s in self.seqs]).to(cache.device)
        keys, values = (cache[i][slots].transpose(1, 2).contiguous() for i in (0, 1))
        length = self.context + self.queries
        allowed = torch.arange(length)[None, :] <= self.context + torch.arange(self.queries)[:, None]  # [Q, L]
        return keys, values, allowed.to(cache.device)

    def contiguous_sdpa(self, keys, values, allowed) -> torch.Tensor:
        q = self.q.view(self.rows, self.queries, HEADS, DIM).transpose(1, 2)  # [R, Hq, Q, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, HEADS, DIM)

    def block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        owner, position, context = self.owner, self.position, self.context

        def mask_mod(b, h, q_idx, kv_idx):
            return (owner[kv_idx] == b) & (position[kv_idx] <= context + q_idx)

        slots = self.pool.kv.shape[2]
        return create_block_mask(mask_mod, self.rows, None, self.queries, slots, device=self.pool.kv.device)

    def flex(self, attend, mask) -> torch.Tensor:
        cache = self.pool.kv[0]  # [2, slots, Hkv, D]
        cache.index_copy_(1, self.meta.new_slots, self.kv)
        keys, values = (cache[i].permute(1, 0, 2)[None].expand(self.rows, -1, -1, -1) for i in (0, 1))
        q = self.q.view(self.rows, self.queries, HEADS, DIM).transpose(1, 2)  # [R, Hq, Q, D]
        out = attend(q, keys, values, block_mask=mask, enable_gqa=True)  # [R, Hq, Q, D]
        return out.transpose(1, 2).reshape(-1, HEADS, DIM)


def measure(case: Case, attend, device: str, repeat: int, tolerance: float) -> dict:
    """Every backend's time for one case, each checked against `gather + SDPA` first."""
    want = case.gather_sdpa()
    keys, values, allowed = case.contiguous_inputs()
    torch.testing.assert_close(case.contiguous_sdpa(keys, values, allowed), want, atol=tolerance, rtol=tolerance)
    row = {
        "rows": case.rows,
        "context": case.context,
        "queries": case.queries,
        "gather_sdpa_ms": timed(case.gather_sdpa, device, repeat) * 1e3,
        "contiguous_sdpa_ms": timed(lambda: case.contiguous_sdpa(keys, values, allowed), device, repeat) * 1e3,
        "triton_ms": None,
        "flex_ms": None,
        "flex_mask_ms": None,
    }
    if device != "cpu":
        torch.testing.assert_close(case.triton(), want, atol=tolerance, rtol=tolerance)
        row["triton_ms"] = timed(case.triton, device, repeat) * 1e3
    if attend is not None:
        mask = case.block_mask()
        torch.testing.assert_close(case.flex(attend, mask), want, atol=tolerance, rtol=tolerance)
        row["flex_ms"] = timed(lambda: case.flex(attend, mask), device, repeat) * 1e3
        row["flex_mask_ms"] = timed(case.block_mask, device, max(3, repeat // 5)) * 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--queries", default="1,5")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    parser.add_argument("--name", default="attention", help="results file prefix")
    parser.add_argument("--smoke", action="store_true", help="one small case (the CPU is fine)")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.contexts, args.queries, args.repeat = "2", "40", "1,3", 3
    device = args.device
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    attend = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        cases = len(args.queries.split(",")) * len(args.contexts.split(",")) * len(args.batches.split(","))
        torch._dynamo.config.recompile_limit = max(8, 2 * cases)
        attend = torch.compile(flex_attention, dynamic=False)
    rows, table = [], []
    for queries in (int(q) for q in args.queries.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                row = measure(Case(batch, context, queries, device, dtype), attend, device, args.repeat, tolerance)
                rows.append(row)
                flex = "" if row["flex_ms"] is None else f"{row['flex_ms']:.3f}"
                mask_ms = "" if row["flex_mask_ms"] is None else f"{row['flex_mask_ms']:.3f}"
                kernel = "" if row["triton_ms"] is None else f"{row['triton_ms']:.3f}"
                table.append(
                    [
                        batch,
                        context,
                        queries,
                        f"{row['gather_sdpa_ms']:.3f}",
                        kernel,
                        flex,
                        mask_ms,
                        f"{row['contiguous_sdpa_ms']:.3f}",
                    ]
                )
                print(table[-1], flush=True)
    header = [
        "rows",
        "context",
        "queries/row",
        "gather + SDPA ms",
        "Triton ms",
        "FlexAttention ms",
        "its mask ms",
        "SDPA contiguous ms",
    ]
    text = markdown_table(header, table)
    report(args.name, environment(), rows, text, keep=not args.smoke)


if __name__ == "__main__":
    main()
