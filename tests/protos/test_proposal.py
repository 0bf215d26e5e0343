import pytest
import torch

from protos.proposal import ProposalEncoding, choose_encoding, encode_proposal, sparse_support
from protos.validation import DecodeInput, validate_decode_request
from sampling import DraftToTargetMap, map_draft_probs_to_target
from sampling.proposal import DraftLaw
from tests.protos.factory import D2T, RECEIVER, VD, VT, draft_law, valid_request


@pytest.mark.parametrize("encoding", [ProposalEncoding.DENSE, ProposalEncoding.SPARSE])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_dense_and_sparse_decode_to_the_mapped_distribution(encoding, k):
    result = validate_decode_request(valid_request(encoding, k=k, seed=k), RECEIVER)
    assert isinstance(result, DecodeInput), result
    _, probs = draft_law(k, k)
    expected = map_draft_probs_to_target(probs, torch.tensor(D2T), VT)
    assert result.proposal.probs.shape == (k, VT)
    torch.testing.assert_close(result.proposal.probs, expected, rtol=0, atol=1e-7)


def test_point_mass_decodes_to_none():
    result = validate_decode_request(valid_request(ProposalEncoding.POINT_MASS, k=3), RECEIVER)
    assert isinstance(result, DecodeInput) and result.proposal.probs is None
    draft_ids, _ = draft_law(3, 0, stochastic=False)
    assert result.proposal.token_ids == torch.tensor(D2T)[draft_ids].tolist()


def test_point_mass_law_shipped_dense_is_one_hot():
    draft_ids = torch.tensor([2, 0])
    proposal = encode_proposal(torch.tensor(D2T)[draft_ids], draft_ids, None, VD, ProposalEncoding.DENSE)
    assert list(proposal.probs.shape) == [2, VD]
    probs = torch.frombuffer(bytearray(proposal.probs.data), dtype=torch.float32).view(2, VD)
    assert probs.argmax(-1).tolist() == [2, 0] and probs.sum().item() == 2.0


def test_point_mass_encoding_refuses_a_dense_law():
    draft_ids, probs = draft_law(2, 0)
    with pytest.raises(ValueError, match="POINT_MASS is exact only for a point-mass law"):
        encode_proposal(torch.tensor(D2T)[draft_ids], draft_ids, probs, VD, ProposalEncoding.POINT_MASS)


def test_sparse_support_pads_with_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    ids, values = sparse_support(probs)
    assert ids.tolist() == [[1, 3], [2, 2]] and values.tolist() == [[0.5, 0.5], [1.0, 0.0]]
    assert ids.dtype == torch.int32 and values.dtype == torch.float32


def test_choose_encoding():
    assert choose_encoding(ProposalEncoding.DENSE, DraftLaw.POINT_MASS, compact=False) is ProposalEncoding.DENSE
    assert choose_encoding(ProposalEncoding.DENSE, DraftLaw.POINT_MASS, compact=True) is ProposalEncoding.POINT_MASS
    assert choose_encoding(ProposalEncoding.DENSE, DraftLaw.STOCHASTIC, compact=True) is ProposalEncoding.SPARSE


def test_identity_map_keeps_dense_probabilities():
    contract_map = DraftToTargetMap.identity(VD)
    assert contract_map.is_identity
