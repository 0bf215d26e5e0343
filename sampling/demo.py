"""Sampling demo: measured vs theoretical acceptance for dense and point-mass drafts.

    python -m sampling.demo [--rows N] [--vocab V] [--k K] [--seed S]

The draft distribution p is a noisy copy of the target q; dense drafts sample from p
and should accept at sum(min(p, q)) per position, point-mass drafts (argmax of p) at
q[argmax p]. Both keep the emitted tokens distributed exactly as q.
"""

from __future__ import annotations

import argparse

import torch

from sampling import rejection_sample


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    logits = 3 * torch.randn(args.k + 1, args.vocab, generator=gen)
    q = torch.softmax(logits, -1)  # [K+1, V]
    p = torch.softmax(logits[: args.k] + torch.randn(args.k, args.vocab, generator=gen), -1)  # [K, V]
    n = args.rows
    target_probs = q.expand(n, -1, -1)
    target_ids = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()  # [N, K+1]
    uniforms = torch.rand(n, args.k + 1, generator=gen)
    do_sample = torch.ones(n, dtype=torch.bool)
    print(f"rows={n} V={args.vocab} K={args.k}  (theory: dense sum(min(p,q)), point mass q[argmax p])")
    print(f"{'draft':<11} {'pos':>3} {'measured':>9} {'theory':>8} {'TV(emitted, q)':>15}")
    for name, draft_ids, draft_probs, theory in (
        (
            "dense",
            torch.multinomial(p, n, replacement=True, generator=gen).T.contiguous(),
            p.expand(n, -1, -1),
            torch.minimum(p, q[: args.k]).sum(-1),
        ),
        (
            "point-mass",
            p.argmax(-1).expand(n, -1).contiguous(),
            None,
            q[: args.k].gather(1, p.argmax(-1, keepdim=True)).squeeze(1),
        ),
    ):
        out, emitted = rejection_sample(draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample)
        for i in range(args.k):
            reached = emitted > i  # rows that emitted a token at position i
            accepted = (emitted > i + 1).sum() / (emitted > i).sum()
            freq = torch.bincount(out[reached, i].long(), minlength=args.vocab).double() / reached.sum()
            tv = 0.5 * (freq - q[i].double()).abs().sum()
            print(f"{name:<11} {i:>3} {accepted:>9.4f} {theory[i]:>8.4f} {tv:>15.4f}")
        print(f"{name:<11} mean emitted tokens per step: {emitted.double().mean():.3f}")


if __name__ == "__main__":
    main()
