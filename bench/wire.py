"""Wire benchmark: proposal bytes per request, the DENSE round trip, the KV handoff.

    python bench/wire.py [--kv-tokens 1024,4096,16384] [--repeat 3]

1. Proposal bytes (serialized `Proposal` message) for DENSE / POINT_MASS / SPARSE at
   V in {32000, 128256, 151936} and K in {1, 4, 8}. The SPARSE draft is top-p 0.9 over
   softmax(3 randn) logits (the reference figures' distribution, docs/design.md §7); its support size M is reported.
2. DENSE encode + serialize + parse + decode of a whole DecodeRequest, in GB/s of
   proposal payload, next to a plain memcpy (numpy copyto) of the same bytes in the same
   run; the zero-copy codec (protos/wire.py) next to the protobuf path it replaced, and
   torch `copy_` of the same bytes.
3. KV handoff of a Llama-3-8B-shaped KV (32 layers x K,V [8, seq, 128] bf16, 128 KiB a
   token; random tensors) through real gRPC on loopback into the decode node's paged pool
   (bench/wire_kv.py, also runnable alone): one Decode message, DecodeStream in
   --kv-chunk-bytes slices and the shared-memory handoff, next to a raw TCP socket sending
   the same bytes. Peak extra memory (RSS and heap in use) on each side, beyond the KV itself.
Writes bench/results/wire-*.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, median_time, write_results
from bench.wire_kv import kv_handoff
from protos import pdspec_pb2, wire
from protos.codec import decode_tensor
from protos.proposal import ProposalEncoding, choose_encoding, encode_proposal
from sampling import SamplingParams, SamplingTensors, propose_stochastic
from sampling.proposal import DraftLaw

VOCABS = [32000, 128256, 151936]
KS = [1, 4, 8]


def draft(vocab: int, k: int, top_p: float | None, seed: int = 0):
    """K draft-space tokens and their law: top-p 0.9 stochastic, or point mass (None)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(k, vocab, generator=gen)
    if top_p is None:
        return logits.argmax(-1), None
    params = SamplingTensors.from_params([SamplingParams(do_sample=True, top_p=top_p)] * k)
    sample = propose_stochastic(logits, params, torch.rand(k, generator=gen))
    return sample.token_ids, sample.probs


def proposal_bytes() -> tuple[list[dict], str]:
    rows, table = [], []
    for vocab in VOCABS:
        for k in KS:
            ids, probs = draft(vocab, k, top_p=0.9)
            point_ids, _ = draft(vocab, k, top_p=None)
            dense = encode_proposal(ids, ids, probs, vocab, ProposalEncoding.DENSE).ByteSize()
            sparse_pb = encode_proposal(ids, ids, probs, vocab, ProposalEncoding.SPARSE)
            point = encode_proposal(point_ids, point_ids, None, vocab, ProposalEncoding.POINT_MASS).ByteSize()
            support = int(sparse_pb.sparse_ids.shape[1])
            rows.append(
                {
                    "vocab": vocab,
                    "k": k,
                    "dense": dense,
                    "sparse": sparse_pb.ByteSize(),
                    "sparse_m": support,
                    "point_mass": point,
                }
            )
            table.append(
                [
                    vocab,
                    k,
                    dense,
                    sparse_pb.ByteSize(),
                    support,
                    point,
                    f"{dense / point:,.0f}x",
                    f"{dense / sparse_pb.ByteSize():.1f}x",
                ]
            )
    header = [
        "V",
        "K",
        "DENSE bytes",
        "SPARSE bytes (top-p 0.9)",
        "SPARSE M",
        "POINT_MASS bytes",
        "DENSE / POINT_MASS",
        "DENSE / SPARSE",
    ]
    return rows, markdown_table(header, table)


def defaults() -> tuple[list[dict], str]:
    """Bytes per request of the default encodings by law, at real vocabularies, K = 4."""
    rows, table = [], []
    for vocab in VOCABS:
        for law, compact in ((DraftLaw.POINT_MASS, False), (DraftLaw.STOCHASTIC, False), (DraftLaw.STOCHASTIC, True)):
            encoding = choose_encoding(None, law, compact)
            ids, probs = draft(vocab, 4, top_p=None if law is DraftLaw.POINT_MASS else 0.9)
            size = encode_proposal(ids, ids, probs, vocab, encoding).ByteSize()
            rows.append({"vocab": vocab, "k": 4, "law": law.value, "compact": compact, "encoding": encoding.value})
            rows[-1]["bytes"] = size
            table.append([vocab, law.value, "yes" if compact else "no", encoding.value, size])
    return rows, markdown_table(["V", "law", "--compact-encodings", "default encoding", "bytes (K=4)"], table)


def zero_copy_once(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """encode (a view) + serialize (the one join) + parse (walk, views) + decode (a view)."""
    out = wire.WireDecodeRequest(pdspec_pb2.DecodeRequest(request_id="bench", num_speculative_tokens=int(ids.shape[0])))
    encode_proposal(
        ids,
        ids,
        probs,
        probs.shape[1],
        ProposalEncoding.DENSE,
        out=out.header.proposal,
        set_tensor=lambda name, t: out.set_tensor(f"proposal.{name}", t),
    )
    received = wire.parse_decode_request(out.SerializeToString())
    return decode_tensor(received.header.proposal.probs, data=received.payloads["proposal.probs"])


def round_trip_once(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    request = pdspec_pb2.DecodeRequest(request_id="bench", num_speculative_tokens=int(ids.shape[0]))
    encode_proposal(ids, ids, probs, probs.shape[1], ProposalEncoding.DENSE, out=request.proposal)
    wire = request.SerializeToString()
    received = pdspec_pb2.DecodeRequest.FromString(wire)
    return decode_tensor(received.proposal.probs)


def page_aligned(size: int) -> np.ndarray:
    """A [size] uint8 buffer starting on a page. The memcpy baseline copies page-aligned
    to page-aligned: two buffers a few bytes apart modulo 4 KiB (what two arbitrary
    allocations may be) alias in the CPU's store buffer, and this VM then copies 0.5 MB at
    2.8 instead of 27 GB/s (the 0.5 MB baselines recorded before were hit by this)."""
    raw = np.empty(size + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + size]


def round_trip() -> tuple[list[dict], str]:
    rows, table = [], []
    for vocab in VOCABS:
        for k in (4, 8):
            ids, probs = draft(vocab, k, top_p=0.9)
            payload = probs.numel() * 4
            assert torch.equal(round_trip_once(probs, ids), probs)
            assert torch.equal(zero_copy_once(probs, ids), probs)
            src, dst = page_aligned(payload), page_aligned(payload)
            src[:] = probs.numpy().reshape(-1).view(np.uint8)
            dst[:] = 0  # touched pages: no first-copy page faults in the baseline
            memcpy_s = median_time(lambda s=src, d=dst: np.copyto(d, s), 100)
            tsrc, tdst = torch.from_numpy(src.copy()), torch.zeros(len(src), dtype=torch.uint8)
            torch_s = median_time(lambda s=tsrc, d=tdst: d.copy_(s), 100)
            trip_s = median_time(lambda p=probs, i=ids: round_trip_once(p, i), 30)
            zero_s = median_time(lambda p=probs, i=ids: zero_copy_once(p, i), 100)
            rows.append(
                {
                    "vocab": vocab,
                    "k": k,
                    "payload_bytes": payload,
                    "zero_copy_gbps": payload / zero_s / 1e9,
                    "protobuf_gbps": payload / trip_s / 1e9,
                    "memcpy_gbps": payload / memcpy_s / 1e9,
                    "torch_copy_gbps": payload / torch_s / 1e9,
                }
            )
            table.append(
                [
                    vocab,
                    k,
                    f"{payload / 1e6:.2f}",
                    f"{zero_s * 1e3:.3f}",
                    f"{payload / zero_s / 1e9:.2f}",
                    f"{payload / trip_s / 1e9:.2f}",
                    f"{payload / memcpy_s / 1e9:.2f}",
                    f"{payload / torch_s / 1e9:.2f}",
                    f"{memcpy_s / zero_s:.0%}",
                    f"{memcpy_s / trip_s:.0%}",
                ]
            )
    header = [
        "V",
        "K",
        "payload MB",
        "zero-copy ms",
        "zero-copy GB/s",
        "protobuf GB/s",
        "numpy memcpy GB/s",
        "torch copy_ GB/s",
        "zero-copy / memcpy",
        "protobuf / memcpy",
    ]
    return rows, markdown_table(header, table)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-tokens", default="1024,4096,16384", help='"" skips the KV handoff')
    parser.add_argument("--kv-chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    env = environment()
    size_rows, size_table = proposal_bytes()
    default_rows, default_table = defaults()
    trip_rows, trip_table = round_trip()
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    print(size_table, default_table, trip_table, sep="\n\n", flush=True)
    tokens = [int(t) for t in args.kv_tokens.split(",") if t]
    kv_rows, kv_table = kv_handoff(tokens, args.kv_chunk_bytes, args.repeat) if tokens else ([], "")
    print(kv_table)
    rows = {"proposal_bytes": size_rows, "defaults": default_rows, "round_trip": trip_rows, "kv_handoff": kv_rows}
    tables = "\n\n".join([size_table, default_table, trip_table, kv_table])
    print("wrote", write_results("wire", env, rows, tables))


if __name__ == "__main__":
    main()
