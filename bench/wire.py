"""Wire benchmark: proposal bytes per request, and the DENSE round-trip throughput.

    python bench/wire.py

1. Proposal bytes (serialized `Proposal` message) for DENSE / POINT_MASS / SPARSE at
   V in {32000, 128256, 151936} and K in {1, 4, 8}. The SPARSE draft is top-p 0.9 over
   softmax(3 randn) logits (the ANCHORS.md distribution); its support size M is reported.
2. DENSE encode + serialize + parse + decode of a whole DecodeRequest, in GB/s of
   proposal payload, next to a plain memcpy (numpy copyto) of the same bytes in the same
   run.
Writes bench/results/wire-*.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, markdown_table, write_results
from protos import pdspec_pb2
from protos.codec import decode_tensor
from protos.proposal import ProposalEncoding, encode_proposal
from sampling import SamplingParams, SamplingTensors, propose_stochastic

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


def round_trip_once(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    request = pdspec_pb2.DecodeRequest(request_id="bench", num_speculative_tokens=int(ids.shape[0]))
    encode_proposal(ids, ids, probs, probs.shape[1], ProposalEncoding.DENSE, out=request.proposal)
    wire = request.SerializeToString()
    received = pdspec_pb2.DecodeRequest.FromString(wire)
    return decode_tensor(received.proposal.probs)


def median_seconds(fn, repeat: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def round_trip() -> tuple[list[dict], str]:
    rows, table = [], []
    for vocab in VOCABS:
        for k in (4, 8):
            ids, probs = draft(vocab, k, top_p=0.9)
            payload = probs.numel() * 4
            assert torch.equal(round_trip_once(probs, ids), probs)
            src = np.frombuffer(probs.numpy().tobytes(), np.uint8)
            dst = np.zeros_like(src)  # touched pages: no first-copy page faults in the baseline
            memcpy_s = median_seconds(lambda s=src, d=dst: np.copyto(d, s))
            trip_s = median_seconds(lambda p=probs, i=ids: round_trip_once(p, i))
            rows.append(
                {
                    "vocab": vocab,
                    "k": k,
                    "payload_bytes": payload,
                    "round_trip_gbps": payload / trip_s / 1e9,
                    "memcpy_gbps": payload / memcpy_s / 1e9,
                }
            )
            table.append(
                [
                    vocab,
                    k,
                    f"{payload / 1e6:.2f}",
                    f"{trip_s * 1e3:.2f}",
                    f"{payload / trip_s / 1e9:.2f}",
                    f"{payload / memcpy_s / 1e9:.2f}",
                    f"{memcpy_s / trip_s:.0%}",
                ]
            )
    header = ["V", "K", "payload MB", "round trip ms", "DENSE round trip GB/s", "memcpy GB/s", "round trip / memcpy"]
    return rows, markdown_table(header, table)


def main() -> None:
    env = environment()
    size_rows, size_table = proposal_bytes()
    trip_rows, trip_table = round_trip()
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    print(size_table)
    print()
    print(trip_table)
    print(
        "wrote",
        write_results(
            "wire", env, {"proposal_bytes": size_rows, "round_trip": trip_rows}, size_table + "\n\n" + trip_table
        ),
    )


if __name__ == "__main__":
    main()
