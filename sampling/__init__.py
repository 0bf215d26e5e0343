"""All of pdspec's sampling math (docs/design.md §2)."""

from sampling.batch import ChainInputs, TreeInputs, VerifyBatch
from sampling.d2t import DraftToTargetMap, map_draft_probs_to_target
from sampling.filtering import point_mass
from sampling.params import SamplingParams, SamplingTensors
from sampling.proposal import (
    NO_PROPOSAL,
    CandidateSample,
    Drafted,
    DraftLaw,
    DraftSample,
    Proposal,
    propose,
    propose_candidates,
    propose_point_mass,
    propose_stochastic,
)
from sampling.rejection import RejectionSampler, rejection_sample, resolve_backend
from sampling.rng import RequestRng, batch_uniforms, position_uniforms, splitmix64_uniforms, stream_uniforms
from sampling.target_sampler import TargetSample, sample_target
from sampling.tree import MAX_TREE_NODES, TreeResult, tree_rejection_sample
from sampling.verifier import StepStats, Verifier, VerifyResult

__all__ = [
    "MAX_TREE_NODES",
    "NO_PROPOSAL",
    "CandidateSample",
    "ChainInputs",
    "DraftLaw",
    "DraftSample",
    "DraftToTargetMap",
    "Drafted",
    "Proposal",
    "RejectionSampler",
    "RequestRng",
    "SamplingParams",
    "SamplingTensors",
    "StepStats",
    "TargetSample",
    "TreeInputs",
    "TreeResult",
    "Verifier",
    "VerifyBatch",
    "VerifyResult",
    "batch_uniforms",
    "map_draft_probs_to_target",
    "point_mass",
    "position_uniforms",
    "propose",
    "propose_candidates",
    "propose_point_mass",
    "propose_stochastic",
    "rejection_sample",
    "resolve_backend",
    "sample_target",
    "splitmix64_uniforms",
    "stream_uniforms",
    "tree_rejection_sample",
]
