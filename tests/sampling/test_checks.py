"""Bad inputs raise ValueError naming the argument, expected and actual value."""

import pytest
import torch

from sampling import rejection_sample
from tests.sampling.helpers import CHAIN_NAMES as NAMES
from tests.sampling.helpers import good_chain_args as good
from tests.sampling.helpers import with_arg


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("draft_token_ids", torch.zeros(4, 3), "dtype"),
        ("draft_token_ids", torch.zeros(4, 3, 1, dtype=torch.int64), "rank 2"),
        ("draft_token_ids", torch.zeros(4, 2, dtype=torch.int64), "shape [4, 3]"),
        ("draft_token_ids", [[0, 1, 2]] * 4, "torch.Tensor"),
        ("draft_probs", torch.zeros(4, 3, 11, dtype=torch.float64), "dtype torch.float32"),
        ("draft_probs", torch.zeros(4, 3, 12), "shape [4, 3, 11]"),
        ("target_probs", torch.zeros(4, 4, 11, dtype=torch.float16), "dtype torch.float32"),
        ("target_probs", torch.zeros(4, 44), "rank 3"),
        ("target_token_ids", torch.zeros(4, 3, dtype=torch.int64), "shape [4, 4]"),
        ("target_token_ids", torch.zeros(4, 4, dtype=torch.int16), "dtype"),
        ("uniform_samples", torch.zeros(4, 4, dtype=torch.float64), "dtype torch.float32"),
        ("uniform_samples", torch.zeros(3, 4), "shape [4, 4]"),
        ("do_sample", torch.ones(4, dtype=torch.int32), "dtype torch.bool"),
        ("do_sample", torch.ones(5, dtype=torch.bool), "shape [4]"),
    ],
)
def test_structural_errors_name_the_argument(name, value, expected):
    with pytest.raises(ValueError, match=name) as err:
        rejection_sample(*with_arg(good(), NAMES, name, value))
    assert expected in str(err.value)


def test_target_probs_with_empty_vocab():
    with pytest.raises(ValueError, match="target_probs: expected vocab size"):
        rejection_sample(
            torch.zeros(1, 0, dtype=torch.int64),
            None,
            torch.zeros(1, 1, 0),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.zeros(1, 1),
            torch.ones(1, dtype=torch.bool),
        )


@pytest.mark.parametrize(
    ("name", "bad_value", "message"),
    [
        ("draft_token_ids", 11, "draft_token_ids: expected ids in [0, 11), got 11"),
        ("draft_token_ids", -1, "draft_token_ids: expected ids in [0, 11), got -1"),
        ("target_token_ids", 99, "target_token_ids: expected ids in [0, 11), got 99"),
        ("uniform_samples", 1.0, "uniform_samples: expected values in [0, 1), got 1.0"),
        ("uniform_samples", float("nan"), "uniform_samples: expected values in [0, 1), got nan"),
    ],
)
def test_value_errors(name, bad_value, message):
    with pytest.raises(ValueError) as err:
        rejection_sample(*with_arg(good(), NAMES, name, bad_value, index=(1, 1)))
    assert str(err.value) == message


def test_value_checks_can_be_skipped_but_structure_cannot():
    args = good()
    args[0] = args[0].clone()
    args[0][0, 0] = 5  # still in range: output just differs, no error
    rejection_sample(*args, check_values=False)
    with pytest.raises(ValueError, match="do_sample"):
        rejection_sample(*with_arg(good(), NAMES, "do_sample", torch.ones(4)), check_values=False)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend: expected 'torch', 'cupy' or 'auto', got 'triton'"):
        rejection_sample(*good(), backend="triton")


def test_cupy_backend_needs_a_gpu():
    with pytest.raises(ValueError, match="backend: 'cupy' expects inputs on a GPU"):
        rejection_sample(*good(), backend="cupy")


def test_inputs_are_not_modified():
    args = good()
    copies = [a.clone() if a is not None else None for a in args]
    rejection_sample(*args)
    for a, c in zip(args, copies, strict=False):
        assert (a is None and c is None) or torch.equal(a, c)


def test_device_mismatch():
    args = good()
    args[2] = args[2].to("meta")  # target_probs fixes the device; the others are on the CPU
    with pytest.raises(ValueError, match=r"draft_token_ids: expected device meta \(that of target_probs\), got cpu"):
        rejection_sample(*args, backend="torch")
