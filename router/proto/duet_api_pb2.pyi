from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class AddModelRequest(_message.Message):
    __slots__ = ("model_config",)
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model_config: str
    def __init__(self, model_config: _Optional[str] = ...) -> None: ...

class RemoveModelRequest(_message.Message):
    __slots__ = ("model", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "model")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    model: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ScalePoolRequest(_message.Message):
    __slots__ = ("role", "replicas", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    model: str
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker", "timeout_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker: str
    timeout_s: float
    def __init__(self, worker: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AdminReply(_message.Message):
    __slots__ = ("changes",)
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, changes: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "bad_words", "allowed_token_ids", "structured_output", "skip_special_tokens", "spaces_between_special_tokens")
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
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_output: StructuredOutput
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: Choices
    grammar: str
    json_object: bool
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output")
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    def __init__(self, stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "request_id", "resume_after", "n", "logprobs", "prompt_logprobs", "images")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParams
    stop: StopConditions
    request_id: str
    resume_after: TokenIds
    n: int
    logprobs: int
    prompt_logprobs: int
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., request_id: _Optional[str] = ..., resume_after: _Optional[_Union[TokenIds, _Mapping]] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_s", "tpot_s", "e2e_s", "prefill_worker", "decode_worker")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_worker: str
    decode_worker: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "index", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("name", "role", "state", "kv_endpoint", "requests_served", "requests_inflight", "kv_cache_usage", "prompt_tokens_transferred", "prompt_tokens_computed", "error", "restarts", "kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds", "kv_transfer_failures", "outstanding_prompt_tokens", "cpu_core", "migrations_out_kv", "migrations_out_replay", "migrations_in_kv", "migrations_in_replay", "lora_adapter_reads", "lora_adapter_activations", "kv_pool_host", "kv_pool_hits", "kv_pool_misses")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPU_CORE_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_KV_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_REPLAY_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_KV_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_REPLAY_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_READS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_MISSES_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    state: str
    kv_endpoint: str
    requests_served: int
    requests_inflight: int
    kv_cache_usage: float
    prompt_tokens_transferred: int
    prompt_tokens_computed: int
    error: str
    restarts: int
    kv_transfers: int
    kv_transfer_bytes: float
    kv_transfer_seconds: float
    kv_transfer_failures: int
    outstanding_prompt_tokens: int
    cpu_core: int
    migrations_out_kv: int
    migrations_out_replay: int
    migrations_in_kv: int
    migrations_in_replay: int
    lora_adapter_reads: int
    lora_adapter_activations: int
    kv_pool_host: str
    kv_pool_hits: int
    kv_pool_misses: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., requests_served: _Optional[int] = ..., requests_inflight: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prompt_tokens_transferred: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., error: _Optional[str] = ..., restarts: _Optional[int] = ..., kv_transfers: _Optional[int] = ..., kv_transfer_bytes: _Optional[float] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_transfer_failures: _Optional[int] = ..., outstanding_prompt_tokens: _Optional[int] = ..., cpu_core: _Optional[int] = ..., migrations_out_kv: _Optional[int] = ..., migrations_out_replay: _Optional[int] = ..., migrations_in_kv: _Optional[int] = ..., migrations_in_replay: _Optional[int] = ..., lora_adapter_reads: _Optional[int] = ..., lora_adapter_activations: _Optional[int] = ..., kv_pool_host: _Optional[str] = ..., kv_pool_hits: _Optional[int] = ..., kv_pool_misses: _Optional[int] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("role", "workers", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    model: str
    def __init__(self, role: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("model", "pools", "requests_served", "requests_inflight", "requests_failed", "kv_transport", "metrics_endpoint", "routing", "front_ends", "control_plane_pid", "deployment_id", "lora_adapters", "models", "served_models", "encoder_caches", "kv_pools")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    FRONT_ENDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PLANE_PID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODELS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHES_FIELD_NUMBER: _ClassVar[int]
    KV_POOLS_FIELD_NUMBER: _ClassVar[int]
    model: str
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    requests_served: int
    requests_inflight: int
    requests_failed: int
    kv_transport: str
    metrics_endpoint: str
    routing: _containers.RepeatedScalarFieldContainer[str]
    front_ends: _containers.RepeatedCompositeFieldContainer[FrontEnd]
    control_plane_pid: int
    deployment_id: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedCompositeFieldContainer[ModelRequests]
    served_models: _containers.RepeatedScalarFieldContainer[str]
    encoder_caches: _containers.RepeatedCompositeFieldContainer[EncoderCache]
    kv_pools: _containers.RepeatedCompositeFieldContainer[KVPool]
    def __init__(self, model: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., requests_served: _Optional[int] = ..., requests_inflight: _Optional[int] = ..., requests_failed: _Optional[int] = ..., kv_transport: _Optional[str] = ..., metrics_endpoint: _Optional[str] = ..., routing: _Optional[_Iterable[str]] = ..., front_ends: _Optional[_Iterable[_Union[FrontEnd, _Mapping]]] = ..., control_plane_pid: _Optional[int] = ..., deployment_id: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[_Union[ModelRequests, _Mapping]]] = ..., served_models: _Optional[_Iterable[str]] = ..., encoder_caches: _Optional[_Iterable[_Union[EncoderCache, _Mapping]]] = ..., kv_pools: _Optional[_Iterable[_Union[KVPool, _Mapping]]] = ...) -> None: ...

class KVPool(_message.Message):
    __slots__ = ("host", "blocks", "bytes", "capacity_bytes", "hits", "misses", "evictions", "fetched")
    HOST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    host: str
    blocks: int
    bytes: float
    capacity_bytes: float
    hits: int
    misses: int
    evictions: int
    fetched: int
    def __init__(self, host: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[float] = ..., capacity_bytes: _Optional[float] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., fetched: _Optional[int] = ...) -> None: ...

class ModelRequests(_message.Message):
    __slots__ = ("model", "requests_served", "requests_inflight", "requests_failed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    model: str
    requests_served: int
    requests_inflight: int
    requests_failed: int
    def __init__(self, model: _Optional[str] = ..., requests_served: _Optional[int] = ..., requests_inflight: _Optional[int] = ..., requests_failed: _Optional[int] = ...) -> None: ...

class FrontEnd(_message.Message):
    __slots__ = ("index", "pid", "host", "state", "restarts", "requests_served", "requests_inflight", "requests_failed", "error", "migrations", "models", "encoder_caches")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHES_FIELD_NUMBER: _ClassVar[int]
    index: int
    pid: int
    host: str
    state: str
    restarts: int
    requests_served: int
    requests_inflight: int
    requests_failed: int
    error: str
    migrations: _containers.RepeatedCompositeFieldContainer[WorkerMigrations]
    models: _containers.RepeatedCompositeFieldContainer[ModelRequests]
    encoder_caches: _containers.RepeatedCompositeFieldContainer[EncoderCache]
    def __init__(self, index: _Optional[int] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., state: _Optional[str] = ..., restarts: _Optional[int] = ..., requests_served: _Optional[int] = ..., requests_inflight: _Optional[int] = ..., requests_failed: _Optional[int] = ..., error: _Optional[str] = ..., migrations: _Optional[_Iterable[_Union[WorkerMigrations, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelRequests, _Mapping]]] = ..., encoder_caches: _Optional[_Iterable[_Union[EncoderCache, _Mapping]]] = ...) -> None: ...

class EncoderCache(_message.Message):
    __slots__ = ("model", "images_encoded", "cache_hits", "fallbacks", "images_held", "bytes_held", "capacity_bytes", "evictions", "encode_seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    images_encoded: int
    cache_hits: int
    fallbacks: int
    images_held: int
    bytes_held: int
    capacity_bytes: int
    evictions: int
    encode_seconds: float
    def __init__(self, model: _Optional[str] = ..., images_encoded: _Optional[int] = ..., cache_hits: _Optional[int] = ..., fallbacks: _Optional[int] = ..., images_held: _Optional[int] = ..., bytes_held: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., encode_seconds: _Optional[float] = ...) -> None: ...

class WorkerMigrations(_message.Message):
    __slots__ = ("worker", "out_kv", "out_replay", "in_kv", "in_replay")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    OUT_KV_FIELD_NUMBER: _ClassVar[int]
    OUT_REPLAY_FIELD_NUMBER: _ClassVar[int]
    IN_KV_FIELD_NUMBER: _ClassVar[int]
    IN_REPLAY_FIELD_NUMBER: _ClassVar[int]
    worker: str
    out_kv: int
    out_replay: int
    in_kv: int
    in_replay: int
    def __init__(self, worker: _Optional[str] = ..., out_kv: _Optional[int] = ..., out_replay: _Optional[int] = ..., in_kv: _Optional[int] = ..., in_replay: _Optional[int] = ...) -> None: ...
