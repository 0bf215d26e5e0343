"""Run the CuPy kernel under compute-sanitizer (llm.c-style check script, GPU only).

    compute-sanitizer --tool memcheck python tests/sampling/sanitize_kernel.py
    (make sanitize-gpu)

Covers dense and point-mass rows, awkward vocab sizes, grid-stride over >65535 rows and
unchecked out-of-range draft ids; prints OK when the outputs equal the reference.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sampling import rejection_sample
from tests.sampling.gpu_inputs import gpu_inputs


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
    print("OK")


if __name__ == "__main__":
    main()
