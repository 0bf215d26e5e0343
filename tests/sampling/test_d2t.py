import pytest
import torch

from sampling import DraftToTargetMap, map_draft_probs_to_target


def probs(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=gen), -1)


def test_many_to_one_keeps_mass():
    d2t = torch.tensor([4, 0, 4, 2, 4, 0])  # three draft ids on target 4, two on 0
    p = probs(3, 2, 6)
    out = map_draft_probs_to_target(p, d2t, 7)
    assert out.shape == (3, 2, 7)
    torch.testing.assert_close(out.sum(-1), p.sum(-1))
    torch.testing.assert_close(out[..., 4], p[..., 0] + p[..., 2] + p[..., 4])
    torch.testing.assert_close(out[..., 0], p[..., 1] + p[..., 5])
    torch.testing.assert_close(out[..., 2], p[..., 3])
    assert (out[..., [1, 3, 5, 6]] == 0).all()


def test_many_to_one_is_deterministic_and_ordered():
    d2t = torch.tensor([1] * 50 + [0] * 3)
    p = probs(8, 53, seed=1)
    a = map_draft_probs_to_target(p, d2t, 2)
    b = map_draft_probs_to_target(p, d2t, 2)
    assert torch.equal(a, b)
    expected = torch.zeros(8)
    for j in range(50):  # level order = draft id order within a target
        expected += p[:, j]
    assert torch.equal(a[:, 1], expected)


def test_non_identity_narrow_draft_vocab():
    d2t = torch.tensor([9, 3, 0, 7])
    mapping = DraftToTargetMap(d2t, 10)
    assert mapping.is_injective and not mapping.is_identity
    p = probs(5, 4)
    out = mapping.map_probs(p)
    assert torch.equal(out[:, [9, 3, 0, 7]], p)
    assert out.sum() == pytest.approx(p.sum().item())
    assert mapping.map_tokens(torch.tensor([[0, 3], [2, 1]])).tolist() == [[9, 7], [0, 3]]


def test_identity_fast_path_returns_input():
    mapping = DraftToTargetMap.identity(6)
    p = probs(2, 6)
    assert mapping.is_identity and mapping.map_probs(p) is p


def test_permutation_of_same_size_is_not_identity():
    mapping = DraftToTargetMap(torch.tensor([1, 0, 2]), 3)
    assert not mapping.is_identity and mapping.is_injective
    assert mapping.map_probs(torch.tensor([[0.2, 0.3, 0.5]])).tolist() == [
        [pytest.approx(0.3), pytest.approx(0.2), pytest.approx(0.5)]
    ]


@pytest.mark.parametrize(
    ("d2t", "vt", "message"),
    [
        (torch.tensor([0, 5]), 5, r"d2t: expected values in \[0, 5\), got 5"),
        (torch.tensor([0, -1]), 5, r"d2t: expected values in \[0, 5\), got -1"),
        (torch.tensor([[0, 1]]), 5, "d2t: expected a 1-D tensor"),
        (torch.tensor([0.0, 1.0]), 5, "d2t: expected dtype int64"),
        (torch.tensor([], dtype=torch.int64), 5, "d2t: expected at least one draft id"),
        ([0, 1], 5, "d2t: expected a torch.Tensor"),
        (torch.tensor([0, 1]), 0, "target_vocab_size: expected an int >= 1"),
    ],
)
def test_invalid_maps_raise(d2t, vt, message):
    with pytest.raises(ValueError, match=message):
        DraftToTargetMap(d2t, vt)
    with pytest.raises(ValueError, match=message):
        map_draft_probs_to_target(torch.zeros(1, 2), d2t, vt)


def test_wrong_draft_vocab_in_probs():
    mapping = DraftToTargetMap(torch.tensor([0, 1, 2]), 4)
    with pytest.raises(ValueError, match=r"draft_probs: expected last dim 3 \(draft vocab size\)"):
        mapping.map_probs(torch.zeros(2, 4))


def test_prevalidated_map_object_is_accepted():
    mapping = DraftToTargetMap(torch.tensor([2, 0]), 3)
    out = map_draft_probs_to_target(torch.tensor([[0.25, 0.75]]), mapping, 3)
    assert out.tolist() == [[0.75, 0.0, 0.25]]
    with pytest.raises(ValueError, match="target_vocab_size: expected 3"):
        map_draft_probs_to_target(torch.tensor([[0.25, 0.75]]), mapping, 4)


def test_a_draw_becomes_a_target_space_proposal_whatever_its_law():
    """Dense, sparse and point-mass laws through the one mapping site: the same target-space rows
    (a sparse law is the dense one with its zeros left out), the ids and parents as given."""
    from sampling import Drafted
    from sampling.proposal import PREFILL

    mapping = DraftToTargetMap(torch.tensor([4, 0, 4, 2, 4, 0]), 7)
    dense = torch.tensor([[0.5, 0.0, 0.25, 0.0, 0.25, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0, 0.0]])
    ids, parents = [4, 0], [-1, 0]
    drafted = Drafted([0, 1], ids, parents, dense)
    got = mapping.proposal(ids, parents, dense, drafted=drafted)
    assert (got.token_ids, got.parents, got.source, got.drafted) == (ids, parents, "draft", drafted)
    assert torch.equal(got.probs, mapping.map_probs(dense))
    assert got.probs.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]]
    sparse = mapping.proposal(
        ids,
        parents,
        torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.5, 0.0]]),
        torch.tensor([[0, 2, 4], [1, 3, 1]]),
        source=PREFILL,
    )
    assert sparse.source == PREFILL and torch.equal(sparse.probs, got.probs)
    point = mapping.proposal(ids, parents, source=PREFILL)
    assert point.probs is None and point.token_ids == ids and point.drafted is None
    with pytest.raises(ValueError, match="probs: expected the"):
        mapping.proposal(ids, parents, None, torch.tensor([[0], [1]]))


def test_a_steps_rows_map_at_once_as_each_row_alone():
    """`proposals` (one mapping for a step's rows) gives each row what `proposal` gives it alone:
    ragged chains, a point mass among dense laws, a many-to-one map."""
    from sampling import Drafted

    mapping = DraftToTargetMap(torch.tensor([4, 0, 4, 2, 4, 0]), 7)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for size, dense in ((3, True), (1, False), (2, True), (4, True)):
        probs = torch.rand(size, 6, generator=gen).softmax(-1) if dense else None
        ids = torch.randint(0, 6, (size,), generator=gen).tolist()
        rows.append(Drafted(ids, mapping.map_tokens(torch.tensor(ids)).tolist(), list(range(-1, size - 1)), probs))
    got = mapping.proposals(rows)
    for proposal, drafted in zip(got, rows, strict=True):
        alone = mapping.proposal(drafted.target_ids, drafted.parents, drafted.probs, drafted=drafted)
        assert (proposal.token_ids, proposal.parents, proposal.source) == (alone.token_ids, alone.parents, "draft")
        assert proposal.drafted is drafted
        assert (proposal.probs is None) == (alone.probs is None)
        if alone.probs is not None:
            assert torch.equal(proposal.probs, alone.probs)
    assert mapping.proposals([]) == []
