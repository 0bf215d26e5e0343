from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorPB(_message.Message):
    __slots__ = ("data_type", "shape", "data")
    class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DATA_TYPE_UNSPECIFIED: _ClassVar[TensorPB.DataType]
        FP32: _ClassVar[TensorPB.DataType]
        FP16: _ClassVar[TensorPB.DataType]
        BF16: _ClassVar[TensorPB.DataType]
        INT32: _ClassVar[TensorPB.DataType]
        INT64: _ClassVar[TensorPB.DataType]
    DATA_TYPE_UNSPECIFIED: TensorPB.DataType
    FP32: TensorPB.DataType
    FP16: TensorPB.DataType
    BF16: TensorPB.DataType
    INT32: TensorPB.DataType
    INT64: TensorPB.DataType
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    data_type: TensorPB.DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, data_type: _Optional[_Union[TensorPB.DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop_token_ids", "logprobs")
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("encoding", "token_ids", "probs", "sparse_ids", "sparse_probs", "parents", "partial")
    class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ENCODING_UNSPECIFIED: _ClassVar[Proposal.Encoding]
        DENSE: _ClassVar[Proposal.Encoding]
        POINT_MASS: _ClassVar[Proposal.Encoding]
        SPARSE: _ClassVar[Proposal.Encoding]
    ENCODING_UNSPECIFIED: Proposal.Encoding
    DENSE: Proposal.Encoding
    POINT_MASS: Proposal.Encoding
    SPARSE: Proposal.Encoding
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_IDS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_PROBS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    encoding: Proposal.Encoding
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: TensorPB
    sparse_ids: TensorPB
    sparse_probs: TensorPB
    parents: _containers.RepeatedScalarFieldContainer[int]
    partial: bool
    def __init__(self, encoding: _Optional[_Union[Proposal.Encoding, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[TensorPB, _Mapping]] = ..., sparse_ids: _Optional[_Union[TensorPB, _Mapping]] = ..., sparse_probs: _Optional[_Union[TensorPB, _Mapping]] = ..., parents: _Optional[_Iterable[int]] = ..., partial: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "num_speculative_tokens", "stop", "draft_candidates", "structured_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_speculative_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    draft_candidates: int
    structured_output: StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., draft_candidates: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "stats", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    stats: RequestStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("verify_steps", "draft_tokens", "accepted_tokens", "accepted_per_position", "accepted_per_rank", "chosen_k", "speculative_method", "prompt_lookup_tokens", "jump_forward_tokens", "grammar_rejected_drafts")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_K_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JUMP_FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REJECTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_rank: _containers.RepeatedScalarFieldContainer[int]
    chosen_k: _containers.RepeatedScalarFieldContainer[int]
    speculative_method: str
    prompt_lookup_tokens: int
    jump_forward_tokens: int
    grammar_rejected_drafts: int
    def __init__(self, verify_steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., accepted_per_rank: _Optional[_Iterable[int]] = ..., chosen_k: _Optional[_Iterable[int]] = ..., speculative_method: _Optional[str] = ..., prompt_lookup_tokens: _Optional[int] = ..., jump_forward_tokens: _Optional[int] = ..., grammar_rejected_drafts: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "protocol_version", "contract_fingerprint", "prompt_token_ids", "first_token_id", "sampling", "num_speculative_tokens", "proposal", "kv_cache", "draft_candidates", "structured_output", "kv_shm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KV_SHM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    protocol_version: int
    contract_fingerprint: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: SamplingParams
    num_speculative_tokens: int
    proposal: Proposal
    kv_cache: _containers.RepeatedCompositeFieldContainer[TensorPB]
    draft_candidates: int
    structured_output: StructuredOutput
    kv_shm: SharedKv
    def __init__(self, request_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., contract_fingerprint: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., kv_cache: _Optional[_Iterable[_Union[TensorPB, _Mapping]]] = ..., draft_candidates: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., kv_shm: _Optional[_Union[SharedKv, _Mapping]] = ...) -> None: ...

class SharedKv(_message.Message):
    __slots__ = ("name", "size", "manifest", "offsets", "lengths")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorPB]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorPB, _Mapping]]] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("request", "kv_manifest", "kv", "proposal_follows")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    kv_manifest: _containers.RepeatedCompositeFieldContainer[TensorPB]
    kv: KvChunk
    proposal_follows: bool
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., kv_manifest: _Optional[_Iterable[_Union[TensorPB, _Mapping]]] = ..., kv: _Optional[_Union[KvChunk, _Mapping]] = ..., proposal_follows: _Optional[bool] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("tensor_index", "offset", "data")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("role", "protocol_version", "contract_fingerprint", "target_vocab_size", "draft_vocab_size", "draft_to_target", "max_speculative_tokens", "sampler_backend", "device", "target_model", "draft_model", "draft_law", "proposal_encoding", "version", "max_new_tokens_limit", "max_prompt_tokens", "dtype", "backends", "max_draft_candidates", "max_tree_nodes", "accepts_shm_kv", "speculative_method", "prompt_lookup_min", "prompt_lookup_max", "adaptive_k", "kv_pool_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TO_TARGET_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LAW_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ENCODING_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_SHM_KV_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    protocol_version: int
    contract_fingerprint: str
    target_vocab_size: int
    draft_vocab_size: int
    draft_to_target: _containers.RepeatedScalarFieldContainer[int]
    max_speculative_tokens: int
    sampler_backend: str
    device: str
    target_model: str
    draft_model: str
    draft_law: str
    proposal_encoding: str
    version: str
    max_new_tokens_limit: int
    max_prompt_tokens: int
    dtype: str
    backends: str
    max_draft_candidates: int
    max_tree_nodes: int
    accepts_shm_kv: bool
    speculative_method: str
    prompt_lookup_min: int
    prompt_lookup_max: int
    adaptive_k: bool
    kv_pool_bytes: int
    def __init__(self, role: _Optional[str] = ..., protocol_version: _Optional[int] = ..., contract_fingerprint: _Optional[str] = ..., target_vocab_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., draft_to_target: _Optional[_Iterable[int]] = ..., max_speculative_tokens: _Optional[int] = ..., sampler_backend: _Optional[str] = ..., device: _Optional[str] = ..., target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., draft_law: _Optional[str] = ..., proposal_encoding: _Optional[str] = ..., version: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., backends: _Optional[str] = ..., max_draft_candidates: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., accepts_shm_kv: _Optional[bool] = ..., speculative_method: _Optional[str] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., adaptive_k: _Optional[bool] = ..., kv_pool_bytes: _Optional[int] = ...) -> None: ...
