"""Tree-verification benchmark: the CuPy tree kernel vs the torch reference vs the chain kernel.

    python bench/tree_kernel.py            # a GPU with CuPy and triton: all three
    python bench/tree_kernel.py            # a CPU: the torch reference only (smoke run)
    python bench/tree_kernel.py --smoke    # the smallest case of each shape only

For V in {32000, 128256}, B in {1, 16, 64}, dense and point-mass drafts and N = 8 nodes
per row: trees of shapes (1,)*8 (the chain), (2,1,1,1), (4,1) and (8,). On a GPU each row
gives the tree kernel's CUDA-graph replay time (triton do_bench median, L2 flushed, as
bench/kernel.py) and eager per-call time, the torch reference's eager time, and the chain
kernel (`rejection_sample`, backend cupy) with K = N on the same chain inputs, the
baseline of the "vs chain" column. Inputs as in bench/kernel.py: q = softmax(3 randn), a
node's dense draft law a noisy copy of q at its parent, its id drawn from that law (dense)
or the parent's i-th most likely token for the i-th sibling (point mass); every row
samples. The kernel's output is checked against the reference first.
Writes bench/results/tree_kernel-*.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import eager_us, environment, graph_us, markdown_table, median_time, report
from sampling import rejection_sample, tree_rejection_sample
from sampling.rejection import cupy_available

VOCABS = (32000, 128256)
BATCHES = (1, 16, 64)
SHAPES = ((1,) * 8, (2, 1, 1, 1), (4, 1), (8,))  # N = 8 nodes each; the first is the chain


def tree_parents(branching: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Breadth-first parents (-1 = root) and each node's rank among its siblings."""
    parents, ranks, level = [], [], [-1]
    for k in branching:
        children = []
        for parent in level:
            for rank in range(k):
                children.append(len(parents))
                parents.append(parent)
                ranks.append(rank)
        level = children
    return parents, ranks


def tree_inputs(batch: int, branching: tuple[int, ...], vocab: int, dense: bool, device: str, seed: int = 0):
    parents_list, ranks_list = tree_parents(branching)
    n_nodes = len(parents_list)
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = 3 * torch.randn(batch, n_nodes + 1, vocab, generator=gen, device=device)
    target_probs = torch.softmax(logits, -1)  # [B, N+1, V]
    parents = torch.tensor(parents_list, device=device).expand(batch, -1).contiguous()  # [B, N]
    at_parent = logits[:, parents[0] + 1]  # [B, N, V] q's logits where each node was drafted
    draft_probs = torch.softmax(at_parent + torch.randn(at_parent.shape, generator=gen, device=device), -1)
    if dense:
        draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, n_nodes)
    else:
        ranks = torch.tensor(ranks_list, device=device)
        top = draft_probs.topk(max(branching), dim=-1).indices  # [B, N, k]
        draft_ids = top.gather(2, ranks.expand(batch, -1)[..., None]).squeeze(2)
    target_ids = torch.multinomial(target_probs.view(-1, vocab), 1, generator=gen).view(batch, n_nodes + 1)
    # Uniforms laid out as a chain's (accept_uniforms[:, i] = recover_uniforms[:, i-1]), so that
    # on the chain shape the chain kernel sees exactly the same decisions as the tree kernel.
    uniforms = torch.rand(batch, n_nodes + 2, generator=gen, device=device)
    return (
        draft_ids,
        parents,
        None,
        draft_probs if dense else None,
        target_probs,
        target_ids,
        uniforms[:, :n_nodes].contiguous(),  # contiguous: the timed calls copy nothing
        uniforms[:, 1:].contiguous(),
        torch.ones(batch, dtype=torch.bool, device=device),
    )


def chain_args(tree_args):
    """A chain tree's inputs as `rejection_sample` arguments (K = N)."""
    draft_ids, _, _, draft_probs, target_probs, target_ids, accept, recover, do_sample = tree_args
    uniforms = torch.cat(
        [accept[:, :1], recover[:, :-1]], 1
    )  # [B, K+1]: u[:, 0] = accept[:, 0], u[:, i+1] = recover[:, i]
    return draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample


def main() -> None:
    smoke = "--smoke" in sys.argv[1:]
    gpu = torch.cuda.is_available() and cupy_available()
    device = "cuda" if gpu else "cpu"
    env = environment()
    env["backends"] = "torch, cupy" if gpu else "torch (no GPU with CuPy: reference only)"
    rows, table = [], []
    for vocab in VOCABS[:1] if smoke else VOCABS:
        for batch in BATCHES[:1] if smoke else BATCHES:
            for dense in (True, False):
                mode = "dense" if dense else "point mass"
                chain_us = None
                for branching in SHAPES:
                    args = tree_inputs(batch, branching, vocab, dense, device)
                    reference = tree_rejection_sample(*args, backend="torch")
                    ref_us = 1e6 * median_time(
                        lambda a=args: tree_rejection_sample(*a, backend="torch", check_values=False), device=device
                    )
                    row = {
                        "batch": batch,
                        "vocab": vocab,
                        "nodes": len(args[1][0]),
                        "shape": list(branching),
                        "mode": mode,
                        "mean_emitted": float(reference.accepted_token_num.float().mean()),
                        "reference_us": ref_us,
                    }
                    cells = [f"({batch}, {vocab})", mode, str(branching), f"{row['mean_emitted']:.2f}", f"{ref_us:.0f}"]
                    if gpu:
                        got = tree_rejection_sample(*args, backend="cupy")
                        assert torch.equal(got.output_token_ids, reference.output_token_ids), "kernel != reference"

                        def kernel(a=args):
                            return tree_rejection_sample(*a, backend="cupy", check_values=False)

                        if chain_us is None:  # the first shape is the chain: time the chain kernel on it
                            chain = chain_args(args)
                            assert torch.equal(rejection_sample(*chain, backend="cupy")[0], got.output_token_ids)
                            chain_us = graph_us(
                                lambda c=chain: rejection_sample(*c, backend="cupy", check_values=False)
                            )
                        row["tree_graph_us"] = graph_us(kernel)
                        row["tree_eager_us"] = eager_us(kernel)
                        row["chain_graph_us"] = chain_us
                        cells += [
                            f"{row['tree_graph_us']:.1f}",
                            f"{row['tree_eager_us']:.1f}",
                            f"{chain_us:.1f}",
                            f"{row['tree_graph_us'] / chain_us:.2f}",
                            f"{ref_us / row['tree_graph_us']:.0f}x",
                        ]
                    rows.append(row)
                    table.append(cells)
    header = ["(B, V)", "draft", "shape (N = 8)", "mean emitted", "torch ref µs"]
    if gpu:
        header += ["tree graph µs", "tree eager µs", "chain kernel graph µs (K = 8)", "tree / chain", "ref / tree"]
    text = markdown_table(header, table)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    report("tree_kernel" + ("-smoke" if smoke else ""), env, rows, text)


if __name__ == "__main__":
    main()
