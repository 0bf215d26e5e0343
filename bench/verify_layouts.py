"""A step's verification in its two layouts: point-mass chains of different lengths (prompt
lookup under adaptive K) padded onto the chain kernel, against the same proposals as trees.

    python bench/verify_layouts.py [--device cuda] [--batches 1,16,64] [--vocabs 1000,49152]
                                   [--temperature 0.7] [--smoke]

Per (batch, vocabulary): `Verifier.verify` of B rows whose drafts number 1..4 (row b: 1 + b % 4),
every row seeded and sampled at `--temperature` and coupled at its position (what
`VerifyBatch.build` makes of prompt lookup's proposals), the median wall time of a call with the
host's work in it (synchronized on a GPU), as padded chains and as trees, and whether the two
emit the same tokens. Writes bench/results/verify_layouts-*.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, median_time, report
from sampling import Proposal, RequestRng, SamplingParams, Verifier, VerifyBatch


def layouts(batch: int, vocab: int, device: str) -> tuple[VerifyBatch, VerifyBatch, list[torch.Tensor]]:
    """The padded-chain batch, the same proposals as trees, and each row's logits [N_b+1, V]."""
    gen = torch.Generator().manual_seed(batch * 7919 + vocab)
    sizes = [1 + b % 4 for b in range(batch)]
    proposals = [
        Proposal(torch.randint(0, vocab, (n,), generator=gen).tolist(), list(range(-1, n - 1)), None) for n in sizes
    ]
    positions = [100 + b for b in range(batch)]
    chain = VerifyBatch.build(proposals, positions, vocab, device)
    widest = max(sizes)
    parents = torch.tensor([[*range(-1, n - 1), *[-1] * (widest - n)] for n in sizes])
    tree = VerifyBatch(chain.draft_token_ids, None, parents, sizes, positions)
    logits = [torch.randn(n + 1, vocab, generator=gen).to(device) for n in sizes]
    return chain, tree, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--vocabs", default="1000,49152")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--smoke", action="store_true", help="one small case, nothing kept")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.vocabs = "4", "64"
    device = args.device
    verifier = Verifier(device=device)
    rows, table = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        params = [SamplingParams(do_sample=True, temperature=args.temperature, seed=b) for b in range(batch)]
        for vocab in (int(v) for v in args.vocabs.split(",")):
            chain, tree, logits = layouts(batch, vocab, device)
            assert chain.chain and not tree.chain  # ragged from 2 rows on

            def run(layout: VerifyBatch, logits=logits, params=params, batch=batch) -> list[list[int]]:
                return verifier.verify(layout, logits, params, [RequestRng(b) for b in range(batch)]).host()[0]

            same = run(chain) == run(tree)
            repeat = 5 if args.smoke else 50
            chain_ms, tree_ms = (1e3 * median_time(lambda b=b: run(b), repeat, device=device) for b in (chain, tree))
            rows.append(
                {
                    "batch": batch,
                    "vocab": vocab,
                    "chain_ms": chain_ms,
                    "tree_ms": tree_ms,
                    "tree_over_chain": tree_ms / chain_ms,
                    "same_tokens": same,
                }
            )
            table.append(
                [
                    batch,
                    vocab,
                    f"{chain_ms:.3f}",
                    f"{tree_ms:.3f}",
                    f"{tree_ms / chain_ms:.2f}x",
                    "yes" if same else "NO",
                ]
            )
            print(table[-1], flush=True)
    header = ["batch", "vocab", "padded chains ms", "trees ms", "trees / chains", "same tokens"]
    report("verify_layouts", environment(), rows, markdown_table(header, table), keep=not args.smoke)


if __name__ == "__main__":
    main()
