from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "allowed_token_ids", "bad_words", "min_tokens", "stop_token_ids", "logit_bias", "structured", "logprob_token_ids", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    structured: bool
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured: _Optional[bool] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens", "sampling", "group_block_ids", "output_token_ids", "lora_id", "pooling", "classify")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    CLASSIFY_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sampling: SamplingParams
    group_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_id: int
    pooling: str
    classify: bool
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., group_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., lora_id: _Optional[int] = ..., pooling: _Optional[str] = ..., classify: _Optional[bool] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("req_id", "resumed", "block_ids", "group_block_ids", "num_computed_tokens", "new_token_ids", "all_token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    resumed: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_computed_tokens: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    all_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., resumed: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., group_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., all_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("req_id", "num_tokens", "draft_token_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_tokens: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("version", "step_id", "new_requests", "cached_requests", "scheduled", "finished_req_ids", "block_copies", "grammar_req_ids", "grammar_bitmask", "stage_keeps_tokens", "grammar_rows_per_request")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    STAGE_KEEPS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ROWS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    grammar_req_ids: _containers.RepeatedScalarFieldContainer[str]
    grammar_bitmask: bytes
    stage_keeps_tokens: bool
    grammar_rows_per_request: int
    def __init__(self, version: _Optional[int] = ..., step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., grammar_req_ids: _Optional[_Iterable[str]] = ..., grammar_bitmask: _Optional[bytes] = ..., stage_keeps_tokens: _Optional[bool] = ..., grammar_rows_per_request: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("req_id", "token_id", "logprob", "rank", "top")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_id: int
    logprob: float
    rank: int
    top: TopLogprobs
    def __init__(self, req_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start", "width", "token_ids", "logprobs", "ranks", "complete")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start: int
    width: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    def __init__(self, req_id: _Optional[str] = ..., start: _Optional[int] = ..., width: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ...) -> None: ...

class PoolingOutput(_message.Message):
    __slots__ = ("req_id", "data")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    data: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, req_id: _Optional[str] = ..., data: _Optional[_Iterable[float]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled", "prompt_logprobs", "pooled", "spec_drafts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    pooled: _containers.RepeatedCompositeFieldContainer[PoolingOutput]
    spec_drafts: _containers.RepeatedCompositeFieldContainer[SpecDraftTokens]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PoolingOutput, _Mapping]]] = ..., spec_drafts: _Optional[_Iterable[_Union[SpecDraftTokens, _Mapping]]] = ...) -> None: ...

class SpecDraftTokens(_message.Message):
    __slots__ = ("req_id", "token_ids", "after")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    after: int
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., after: _Optional[int] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("version", "model", "layer_start", "layer_end", "block_size", "max_num_batched_tokens", "memory_utilization", "model_store", "manifest_sha256", "activation_bytes_known", "spec_draft_model", "spec_num_draft_tokens", "spec_mtp")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_STORE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_KNOWN_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_MTP_FIELD_NUMBER: _ClassVar[int]
    version: int
    model: str
    layer_start: int
    layer_end: int
    block_size: int
    max_num_batched_tokens: int
    memory_utilization: float
    model_store: str
    manifest_sha256: str
    activation_bytes_known: int
    spec_draft_model: str
    spec_num_draft_tokens: int
    spec_mtp: bool
    def __init__(self, version: _Optional[int] = ..., model: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_size: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., memory_utilization: _Optional[float] = ..., model_store: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., activation_bytes_known: _Optional[int] = ..., spec_draft_model: _Optional[str] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_mtp: _Optional[bool] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("weights_bytes", "activation_bytes", "bytes_per_block", "kv_budget_bytes", "num_layers", "host_memory_bytes", "dtype", "load_seconds", "warm_up_seconds", "spec_draft_bytes_per_block", "spec_draft_weights_bytes")
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARM_UP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    weights_bytes: int
    activation_bytes: int
    bytes_per_block: int
    kv_budget_bytes: int
    num_layers: int
    host_memory_bytes: int
    dtype: str
    load_seconds: float
    warm_up_seconds: float
    spec_draft_bytes_per_block: int
    spec_draft_weights_bytes: int
    def __init__(self, weights_bytes: _Optional[int] = ..., activation_bytes: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., host_memory_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., load_seconds: _Optional[float] = ..., warm_up_seconds: _Optional[float] = ..., spec_draft_bytes_per_block: _Optional[int] = ..., spec_draft_weights_bytes: _Optional[int] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("version", "num_blocks", "rank", "world_size", "ring_hostfile", "ring_timeout_s", "wire_dtype", "kv_groups")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RING_HOSTFILE_FIELD_NUMBER: _ClassVar[int]
    RING_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_blocks: int
    rank: int
    world_size: int
    ring_hostfile: str
    ring_timeout_s: float
    wire_dtype: str
    kv_groups: _containers.RepeatedCompositeFieldContainer[BlockIds]
    def __init__(self, version: _Optional[int] = ..., num_blocks: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., ring_hostfile: _Optional[str] = ..., ring_timeout_s: _Optional[float] = ..., wire_dtype: _Optional[str] = ..., kv_groups: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("kv_allocate_seconds",)
    KV_ALLOCATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kv_allocate_seconds: float
    def __init__(self, kv_allocate_seconds: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("version", "heartbeat")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    version: int
    heartbeat: bool
    def __init__(self, version: _Optional[int] = ..., heartbeat: _Optional[bool] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("version", "state", "node_id", "layer_start", "layer_end", "num_blocks", "num_requests", "resident_bytes", "steps", "ring_port", "host_id", "kv_blocks_used", "host_memory_bytes", "host_memory_available_bytes", "device", "step_seconds", "ring_bytes_sent", "coordinator_silent_s", "kv_dtype", "fetch_bytes_total", "fetch_bytes_done", "fetch_bytes_received", "phase", "step_phases", "step_marks")
    class StepPhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class StepMarksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_SILENT_S_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_PHASES_FIELD_NUMBER: _ClassVar[int]
    STEP_MARKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: str
    node_id: str
    layer_start: int
    layer_end: int
    num_blocks: int
    num_requests: int
    resident_bytes: int
    steps: int
    ring_port: int
    host_id: str
    kv_blocks_used: int
    host_memory_bytes: int
    host_memory_available_bytes: int
    device: str
    step_seconds: float
    ring_bytes_sent: int
    coordinator_silent_s: float
    kv_dtype: str
    fetch_bytes_total: int
    fetch_bytes_done: int
    fetch_bytes_received: int
    phase: str
    step_phases: _containers.ScalarMap[str, float]
    step_marks: _containers.ScalarMap[str, float]
    def __init__(self, version: _Optional[int] = ..., state: _Optional[str] = ..., node_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., ring_port: _Optional[int] = ..., host_id: _Optional[str] = ..., kv_blocks_used: _Optional[int] = ..., host_memory_bytes: _Optional[int] = ..., host_memory_available_bytes: _Optional[int] = ..., device: _Optional[str] = ..., step_seconds: _Optional[float] = ..., ring_bytes_sent: _Optional[int] = ..., coordinator_silent_s: _Optional[float] = ..., kv_dtype: _Optional[str] = ..., fetch_bytes_total: _Optional[int] = ..., fetch_bytes_done: _Optional[int] = ..., fetch_bytes_received: _Optional[int] = ..., phase: _Optional[str] = ..., step_phases: _Optional[_Mapping[str, float]] = ..., step_marks: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorRange(_message.Message):
    __slots__ = ("name", "offset", "length", "dtype", "shape", "ggml_type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GGML_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    ggml_type: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., ggml_type: _Optional[int] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("offset", "length", "blake3")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    blake3: str
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., blake3: _Optional[str] = ...) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("path", "size", "sha256", "format", "tensors", "pieces")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    format: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorRange]
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., format: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorRange, _Mapping]]] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ManifestResponse(_message.Message):
    __slots__ = ("version", "sha256", "name", "files", "bulk_port")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    version: int
    sha256: str
    name: str
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    bulk_port: int
    def __init__(self, version: _Optional[int] = ..., sha256: _Optional[str] = ..., name: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("version", "manifest_sha256", "path", "pieces")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest_sha256: str
    path: str
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    def __init__(self, version: _Optional[int] = ..., manifest_sha256: _Optional[str] = ..., path: _Optional[str] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    def __init__(self, ticket: _Optional[bytes] = ...) -> None: ...

class ReadChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightsRoomRequest(_message.Message):
    __slots__ = ("version", "model_store", "manifest_sha256", "layer_start", "layer_end", "spec_mtp")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_STORE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SPEC_MTP_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_store: str
    manifest_sha256: str
    layer_start: int
    layer_end: int
    spec_mtp: bool
    def __init__(self, version: _Optional[int] = ..., model_store: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., spec_mtp: _Optional[bool] = ...) -> None: ...

class WeightsRoomResponse(_message.Message):
    __slots__ = ("need_bytes", "refusal")
    NEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    need_bytes: int
    refusal: str
    def __init__(self, need_bytes: _Optional[int] = ..., refusal: _Optional[str] = ...) -> None: ...

class LoRATensor(_message.Message):
    __slots__ = ("layer", "module", "rank", "input_dims", "output_dims", "a", "b")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIMS_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    layer: int
    module: str
    rank: int
    input_dims: int
    output_dims: int
    a: bytes
    b: bytes
    def __init__(self, layer: _Optional[int] = ..., module: _Optional[str] = ..., rank: _Optional[int] = ..., input_dims: _Optional[int] = ..., output_dims: _Optional[int] = ..., a: _Optional[bytes] = ..., b: _Optional[bytes] = ...) -> None: ...

class LoRAAddRequest(_message.Message):
    __slots__ = ("version", "lora_id", "name", "max_loras", "max_rank", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    lora_id: int
    name: str
    max_loras: int
    max_rank: int
    tensors: _containers.RepeatedCompositeFieldContainer[LoRATensor]
    def __init__(self, version: _Optional[int] = ..., lora_id: _Optional[int] = ..., name: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_rank: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[LoRATensor, _Mapping]]] = ...) -> None: ...

class LoRAAddResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoRARemoveRequest(_message.Message):
    __slots__ = ("version", "lora_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    lora_id: int
    def __init__(self, version: _Optional[int] = ..., lora_id: _Optional[int] = ...) -> None: ...

class LoRARemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...
