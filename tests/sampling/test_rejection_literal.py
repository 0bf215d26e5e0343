"""Hand-computed cases of docs/design.md §2."""

import pytest
import torch

from sampling import rejection_sample
from sampling.filtering import point_mass

T = torch.tensor


def run(draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample):
    return rejection_sample(
        draft_ids if isinstance(draft_ids, torch.Tensor) else T(draft_ids),
        None if draft_probs is None else T(draft_probs, dtype=torch.float32),
        T(target_probs, dtype=torch.float32),
        T(target_ids),
        T(uniforms, dtype=torch.float32),
        T(do_sample),
        backend="torch",
    )


Q0 = [0.2, 0.5, 0.3]
P0 = [0.1, 0.8, 0.1]
Q1 = [0.3, 0.3, 0.4]


def test_equal_ids_do_not_bypass_ratio_test():
    # The target sampler drew 1, the draft is 1, but u*p = 0.72 >= q = 0.5: rejected.
    # Residual relu(q - p) = [0.1, 0, 0.2], S = 0.3, t = 0.5 * S = 0.15 -> id 2.
    out, n = run([[1]], [[P0]], [[Q0, Q1]], [[1, 0]], [[0.9, 0.5]], [True])
    assert out.tolist() == [[2, -1]]
    assert n.tolist() == [1]
    assert out.dtype == torch.int32 and n.dtype == torch.int32


def test_residual_uses_the_next_uniform():
    # Same rejection; the next uniform 0.2 gives t = 0.06 < c[0] = 0.1 -> id 0.
    out, _ = run([[1]], [[P0]], [[Q0, Q1]], [[1, 0]], [[0.9, 0.2]], [True])
    assert out.tolist() == [[0, -1]]
    # Changing the rejected position's own uniform (still rejecting) changes nothing.
    out2, _ = run([[1]], [[P0]], [[Q0, Q1]], [[1, 0]], [[0.95, 0.2]], [True])
    assert out2.tolist() == [[0, -1]]


def test_accept_then_bonus_from_target_ids():
    # u*p = 0 < q: both drafts accepted, the bonus is target_token_ids[:, K].
    out, n = run([[1, 2]], [[P0, [0.2, 0.2, 0.6]]], [[Q0, Q1, Q0]], [[0, 0, 2]], [[0.0, 0.5, 0.99]], [True])
    assert out.tolist() == [[1, 2, 2]]
    assert n.tolist() == [3]


def test_greedy_row_emits_target_token_then_padding():
    out, n = run([[1, 2, 0]], None, [[Q0, Q1, Q0, Q1]], [[1, 2, 1, 0]], [[0.0] * 4], [False])
    assert out.tolist() == [[1, 2, 1, -1]]
    assert n.tolist() == [3]


def test_greedy_ignores_probabilities_and_uniforms():
    # q[d] = 0 would reject a stochastic row; greedy accepts equal ids whatever the numbers.
    out, n = run([[2]], [[[1.0, 0.0, 0.0]]], [[[1.0, 0.0, 0.0], Q1]], [[2, 1]], [[0.99, 0.99]], [False])
    assert out.tolist() == [[2, 1]]
    assert n.tolist() == [2]


def test_k0_emits_target_token():
    out, n = run(torch.zeros(2, 0, dtype=torch.int64), None, [[Q0], [Q1]], [[2], [0]], [[0.3], [0.7]], [True, False])
    assert out.tolist() == [[2], [0]]
    assert n.tolist() == [1, 1]


def test_k0_with_empty_tensors():
    out, n = rejection_sample(
        torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 3), T([[Q0]]), T([[1]]), T([[0.5]]), T([True])
    )
    assert out.tolist() == [[1]] and n.tolist() == [1]


def test_b0_returns_empty_outputs():
    out, n = rejection_sample(
        torch.zeros(0, 2, dtype=torch.int64),
        None,
        torch.zeros(0, 3, 5),
        torch.zeros(0, 3, dtype=torch.int64),
        torch.zeros(0, 3),
        torch.zeros(0, dtype=torch.bool),
    )
    assert out.shape == (0, 3) and n.shape == (0,)
    assert out.dtype == torch.int32 and n.dtype == torch.int32


def test_k1_accept_and_reject():
    # Point mass at 1: accept iff u < q[1] = 0.5.
    out, n = run([[1], [1]], None, [[Q0, Q1], [Q0, Q1]], [[0, 2], [0, 2]], [[0.49, 0.9], [0.51, 0.9]], [True, True])
    # Row 0 accepted + bonus 2. Row 1 rejected: residual is q with id 1 zeroed = [0.2, 0, 0.3],
    # t = 0.9 * 0.5 = 0.45 -> c = [0.2, 0.2, 0.5] -> id 2.
    assert out.tolist() == [[1, 2], [2, -1]]
    assert n.tolist() == [2, 1]


def test_mixed_greedy_and_stochastic_batch():
    out, n = run(
        [[1, 1], [1, 1], [0, 2]],
        None,
        [[Q0, Q1, Q0]] * 3,
        [[0, 1, 2], [1, 1, 0], [0, 2, 1]],
        [[0.9, 0.0, 0.5], [0.1, 0.0, 0.5], [0.99, 0.99, 0.99]],
        [True, True, False],
    )
    # Row 0 stochastic: u*1 = 0.9 >= q[1] = 0.5 reject; residual [0.2, 0, 0.3], t = 0 -> id 0.
    # Row 1 stochastic: 0.1 < 0.5 accept; pos 1: 0 < 0.3 accept; bonus 0.
    # Row 2 greedy: 0 == 0 accept, 2 == 2 accept, bonus 1.
    assert out.tolist() == [[0, -1, -1], [1, 1, 0], [0, 2, 1]]
    assert n.tolist() == [1, 3, 3]


def test_zero_residual_mass_falls_back_to_target_token():
    # q == p except that the draft id has p = q = 0: rejected (0 < 0 is false), residual all 0.
    probs = [0.5, 0.5, 0.0]
    out, n = run([[2]], [[probs]], [[probs, Q1]], [[1, 0]], [[0.3, 0.3]], [True])
    assert out.tolist() == [[1, -1]]
    assert n.tolist() == [1]


@pytest.mark.parametrize("vocab", [3, 5, 8, 4097])
def test_residual_mass_only_at_the_last_id(vocab):
    q = torch.zeros(vocab)
    q[0], q[-1] = 0.75, 0.25
    p = torch.zeros(vocab)
    p[0] = 1.0
    out, n = rejection_sample(
        T([[0]]), p.view(1, 1, -1), torch.stack([q, q]).view(1, 2, -1), T([[0, 0]]), T([[0.8, 0.0]]), T([True])
    )
    # u*p = 0.8 >= 0.75 rejects; relu(q - p) is 0.25 at V-1 only, whatever the uniform.
    assert out.tolist() == [[vocab - 1, -1]]
    assert n.tolist() == [1]


@pytest.mark.parametrize("vocab", [3, 5, 8, 4097])
def test_explicit_one_hot_equals_point_mass(vocab):
    from tests.sampling.helpers import random_inputs

    draft_ids, _, target_probs, target_ids, uniforms, do_sample = random_inputs(64, 3, vocab, seed=vocab, dense=False)
    one_hot = point_mass(draft_ids.reshape(-1), vocab).view(64, 3, vocab)
    a = rejection_sample(draft_ids, None, target_probs, target_ids, uniforms, do_sample)
    b = rejection_sample(draft_ids, one_hot, target_probs, target_ids, uniforms, do_sample)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_int32_and_int64_ids_give_the_same_result():
    from tests.sampling.helpers import random_inputs

    args = random_inputs(32, 4, 17, seed=3)
    a = rejection_sample(*args)
    b = rejection_sample(args[0].int(), args[1], args[2], args[3].int(), args[4], args[5])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
