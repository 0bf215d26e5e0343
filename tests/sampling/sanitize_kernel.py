"""Run the CuPy kernels under compute-sanitizer (llm.c-style check script, GPU only).

    compute-sanitizer --tool memcheck python tests/sampling/sanitize_kernel.py
    (make sanitize-gpu)

Covers the chain and the tree kernel: dense and point-mass rows, awkward vocab sizes,
ragged trees with poisoned padding, grid-stride over >65535 rows and unchecked
out-of-range ids, parents and counts; prints OK when the outputs equal the reference.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sampling import rejection_sample, tree_rejection_sample
from tests.sampling.helpers import gpu_inputs
from tests.sampling.tree_inputs import random_tree_inputs


def main() -> None:
    for batch, k, vocab in ((1, 4, 4097), (7, 3, 111), (99, 8, 32000), (3, 2, 151936), (70000, 1, 5)):
        for dense in (True, False):
            args = gpu_inputs(batch, k, vocab, seed=batch + k, dense=dense)
            got = rejection_sample(*args, backend="cupy")
            ref = rejection_sample(*args, backend="torch")
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (batch, k, vocab, dense)
    args = list(gpu_inputs(16, 4, 1000, seed=1, dense=True, greedy_fraction=0.0))
    args[0] = args[0].clone()
    args[0][:, 0] = torch.tensor([-7, 2**40], device="cuda").repeat(8)
    rejection_sample(*args, backend="cupy", check_values=False)
    torch.cuda.synchronize()
    check_tree_kernel()
    print("OK")


def check_tree_kernel() -> None:
    for batch, n_nodes, vocab in ((1, 8, 4097), (7, 64, 111), (33, 16, 32000), (3, 5, 151936), (70000, 2, 5)):
        for dense in (True, False):
            args = random_tree_inputs(batch, n_nodes, vocab, seed=batch + n_nodes, dense=dense, device="cuda")
            got = tree_rejection_sample(*args, backend="cupy")
            ref = tree_rejection_sample(*args, backend="torch")
            for name in ("output_token_ids", "accepted_token_num", "accepted_nodes"):
                assert torch.equal(getattr(got, name), getattr(ref, name)), (batch, n_nodes, vocab, dense, name)
    args = list(random_tree_inputs(16, 8, 1000, seed=1, device="cuda", greedy_fraction=0.0, ragged=False))
    args[0][:, 0] = torch.tensor([-7, 2**40], device="cuda").repeat(8)
    args[1][:, 2] = torch.tensor([2**40, -9], device="cuda").repeat(8)
    args[2] = torch.tensor([-1, 10**6], device="cuda").repeat(8)
    tree_rejection_sample(*args, backend="cupy", check_values=False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
