"""Partial proposals at the decode boundary: `Proposal.partial` lets a chain hold fewer than
num_speculative_tokens ids (prompt lookup with a short or no match, adaptive K), never more;
without it a chain must hold exactly K."""

import pytest
import torch

from protos import pdspec_pb2
from protos.proposal import ProposalEncoding, encode_proposal
from protos.validation import DecodeInput, Receiver, validate_decode_request
from tests.protos.factory import CONTRACT, K_MAX, RECEIVER, VD, VT, valid_request


def with_k(request: pdspec_pb2.DecodeRequest, k: int, partial: bool) -> pdspec_pb2.DecodeRequest:
    """The same proposal under another num_speculative_tokens, through the wire bytes."""
    request.num_speculative_tokens = k
    request.proposal.partial = partial
    return pdspec_pb2.DecodeRequest.FromString(request.SerializeToString())


def violations(request, receiver: Receiver = RECEIVER) -> dict:
    result = validate_decode_request(request, receiver)
    assert not isinstance(result, DecodeInput), "expected violations"
    return {v.field: v for v in result}


@pytest.mark.parametrize("nodes", range(K_MAX + 1))
def test_a_partial_point_mass_chain_of_at_most_k_ids_is_accepted(nodes):
    request = with_k(valid_request(ProposalEncoding.POINT_MASS, k=nodes, seed=nodes), K_MAX, partial=True)
    assert request.proposal.partial and len(request.proposal.token_ids) == nodes
    result = validate_decode_request(request, RECEIVER)
    assert isinstance(result, DecodeInput), result
    assert result.num_speculative_tokens == K_MAX  # K stays the request's cap
    assert result.proposal.token_ids == list(request.proposal.token_ids)
    assert result.proposal.probs is None and result.proposal.parents == list(range(-1, nodes - 1))  # a chain


@pytest.mark.parametrize("encoding", [ProposalEncoding.DENSE, ProposalEncoding.SPARSE])
def test_a_partial_chain_with_a_law_carries_one_row_per_id(encoding):
    request = with_k(valid_request(encoding, k=2, seed=3), K_MAX, partial=True)
    result = validate_decode_request(request, RECEIVER)
    assert isinstance(result, DecodeInput), result
    assert result.num_speculative_tokens == K_MAX and len(result.proposal.token_ids) == 2
    assert tuple(result.proposal.probs.shape) == (2, VT)  # [ids, Vt]


def test_a_partial_chain_of_more_than_k_ids_is_rejected():
    request = with_k(valid_request(ProposalEncoding.POINT_MASS, k=K_MAX), 2, partial=True)
    found = violations(request)
    assert set(found) == {"proposal.token_ids"}, found
    v = found["proposal.token_ids"]
    assert "at most 2" in v.expected and v.actual == f"{K_MAX} ids"


@pytest.mark.parametrize("nodes", [0, 1, K_MAX - 1])
def test_fewer_than_k_ids_without_partial_are_still_rejected(nodes):
    request = with_k(valid_request(ProposalEncoding.POINT_MASS, k=nodes), K_MAX, partial=False)
    found = violations(request)
    assert "proposal.token_ids" in found, found
    v = found["proposal.token_ids"]
    assert v.expected == f"{K_MAX} ids (num_speculative_tokens)" and v.actual == f"{nodes} ids"


def test_more_than_k_ids_without_partial_are_rejected():
    request = with_k(valid_request(ProposalEncoding.POINT_MASS, k=K_MAX), 3, partial=False)
    assert violations(request)["proposal.token_ids"].actual == f"{K_MAX} ids"


def test_a_partial_proposal_with_no_ids_at_k_zero_is_accepted():
    request = with_k(valid_request(ProposalEncoding.POINT_MASS, k=0), 0, partial=True)
    result = validate_decode_request(request, RECEIVER)
    assert isinstance(result, DecodeInput) and result.num_speculative_tokens == 0


def test_partial_ids_are_still_checked_against_the_vocabulary():
    request = valid_request(ProposalEncoding.POINT_MASS, k=2)
    request.proposal.token_ids[1] = VT  # out of range
    found = violations(with_k(request, K_MAX, partial=True))
    assert "proposal.token_ids" in found and "ids in [0," in found["proposal.token_ids"].expected


def test_a_partial_tree_is_checked_as_a_tree():
    """With parents the node count is the tree's (depth <= K, candidates per node), partial or not."""
    receiver = Receiver.from_contract(CONTRACT, K_MAX, max_draft_candidates=2)
    request = valid_request(ProposalEncoding.POINT_MASS, k=K_MAX)
    request.draft_candidates = 2
    draft_ids = torch.tensor([2, 4, 5])  # target 3, 5, 7 (factory.D2T)
    tree = encode_proposal(
        torch.tensor([3, 5, 7]), draft_ids, None, VD, ProposalEncoding.POINT_MASS, parents=[-1, -1, 0]
    )
    request.proposal.CopyFrom(tree)
    request.proposal.partial = True
    result = validate_decode_request(request, receiver)
    assert isinstance(result, DecodeInput), result
    assert result.proposal.parents == [-1, -1, 0] and result.num_speculative_tokens == K_MAX
    request.num_speculative_tokens = 1  # node 2 is at depth 2 > K
    assert "proposal.parents[2]" in violations(request, receiver)


def test_partial_round_trips_the_wire():
    request = valid_request(ProposalEncoding.POINT_MASS, k=1)
    assert not request.proposal.partial  # the default: a full proposal
    request.proposal.partial = True
    assert pdspec_pb2.DecodeRequest.FromString(request.SerializeToString()).proposal.partial
