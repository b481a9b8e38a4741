"""duet's deployment configuration: one validated pydantic model, loaded from YAML.

Mistakes are rejected at load time with the dotted path of the bad field (``prefill.replicas:
must be >= 1``), because a wrong config that starts anyway fails much later as a hang or an
out-of-memory deep inside a Ray actor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from duet.yaml_config import field_errors, read_yaml, validate_mapping

BUILTIN_MODEL = "builtin"
# The built-in text models, by their model.path (worker_runtime/tiny_model.py makes them): the
# tiny default, and one of another shape for deployments that serve two.
BUILTIN_TEXT_MODELS = (BUILTIN_MODEL, "builtin-wide")
# The built-in vision-language model (worker_runtime/tiny_vision_model.py: a tiny Idefics3).
BUILTIN_VISION_MODEL = "builtin-vl"
# The built-in vision-language models (worker_runtime/tiny_vision_model.py): the default, and
# one with an encoder heavy enough to measure what encoding costs (`duet bench images`).
BUILTIN_VISION_MODELS = (BUILTIN_VISION_MODEL, "builtin-vl-large")
BUILTIN_MODELS = (*BUILTIN_TEXT_MODELS, *BUILTIN_VISION_MODELS)
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"
# The same deployment, colocated: the baseline disaggregation is measured against.
COLOCATED_CONFIG_PATH = DEFAULT_CONFIG_PATH.parent / "colocated.yaml"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and what to fix."""


class _Strict(BaseModel):
    # A field's docstring is its description: the configuration reference
    # (docs/reference/configuration.md) is generated from them.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# vLLM's possible ``max_lora_rank`` values (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# PEFT writes a few hundred bytes; anything far larger is not an adapter's config.
_ADAPTER_CONFIG_MAX_BYTES = 1 << 20
# An adapter's name is a model name clients send and a metric label: kept plain.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class LoraAdapterConfig(_Strict):
    """One LoRA adapter on the base model, served under a model name of its own."""

    name: str = Field(pattern=ADAPTER_NAME_PATTERN)
    """The model name clients send to get the base model with this adapter applied."""
    path: str
    """A local PEFT adapter directory (``adapter_config.json`` and its weights), at the same
    path on every host that runs a worker (as the model's)."""

    @field_validator("path")
    @classmethod
    def _peft_adapter(cls, value: str) -> str:
        adapter_rank(value)
        return value


def expanded_path(path: str) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded; ValueError for a user this machine
    does not know (pathlib raises RuntimeError, which would escape the config's validation)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ValueError(f"{path!r} names a home directory this machine does not have") from None


def adapter_rank(path: str) -> int:
    """The rank of the PEFT LoRA adapter at ``path``; ValueError saying what is wrong with it."""
    directory = expanded_path(path)
    config_file = directory / "adapter_config.json"
    try:
        is_file = config_file.is_file()
        size = config_file.stat().st_size if is_file else 0
        text = config_file.read_bytes() if is_file and size <= _ADAPTER_CONFIG_MAX_BYTES else b""
        has_weights = any((directory / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin"))
    except OSError as error:
        raise ValueError(f"{path!r} cannot be read here ({error.strerror or error})") from None
    except ValueError as error:  # a path with a NUL byte, which no file has
        raise ValueError(f"{path!r} is not a path ({error})") from None
    if not is_file:
        raise ValueError(f"{path!r} is not a LoRA adapter directory (no adapter_config.json)")
    if size > _ADAPTER_CONFIG_MAX_BYTES:
        raise ValueError(f"{config_file}: larger than {_ADAPTER_CONFIG_MAX_BYTES // 1024} KiB, not a PEFT adapter config")
    try:
        adapter = json.loads(text.decode())
    except UnicodeDecodeError:
        raise ValueError(f"{config_file}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file}: not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{config_file}: nested too deeply to be a PEFT adapter config") from None
    if not isinstance(adapter, dict) or adapter.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file}: not a LoRA adapter (peft_type must be LORA)")
    rank = adapter.get("r")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{config_file}: r (the adapter's rank) must be a positive integer, got {rank!r}")
    if not has_weights:
        raise ValueError(f"{path!r} has no adapter weights (adapter_model.safetensors or adapter_model.bin)")
    return rank


class LoraConfig(_Strict):
    """LoRA adapters served on the base model: every engine can apply any of them."""

    adapters: list[LoraAdapterConfig] = []
    """The adapters served from the start, each under its own model name."""
    max_loras: int = Field(default=4, ge=1)
    """Adapters one engine step may apply at once (vLLM's ``max_loras``); requests for more wait."""
    max_lora_rank: int = 16
    """The largest adapter rank served (vLLM's ``max_lora_rank``: one of 1, 8, 16, 32, 64, 128,
    256, 320, 512); an adapter of a higher rank is refused at start."""
    max_cpu_loras: int | None = None
    """Adapters each engine keeps loaded in host memory (vLLM's ``max_cpu_loras``; null: max_loras)."""

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"must be one of {', '.join(map(str, LORA_RANKS))}, got {value}")
        return value

    @model_validator(mode="after")
    def _adapters_fit(self) -> "LoraConfig":
        names = [adapter.name for adapter in self.adapters]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"adapters: each name once; repeated: {', '.join(repeated)}")
        for adapter in self.adapters:
            rank = adapter_rank(adapter.path)
            if rank > self.max_lora_rank:
                raise ValueError(f"adapters: {adapter.name!r} has rank {rank}, above max_lora_rank ({self.max_lora_rank})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self


class ModelConfig(_Strict):
    """Which model every worker serves, and the engine settings that must match across roles."""

    name: str = Field(default="duet-tiny-llama", min_length=1)
    """The name clients use for this model (the OpenAI API's `model`); checked against each
    request's."""
    path: str = Field(default=BUILTIN_MODEL, description="'builtin', 'builtin-wide', 'builtin-vl' (a tiny Idefics3 vision-language model), 'builtin-vl-large' (the same with a heavier image encoder) or a local HF model directory")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights' and activations' type. float32 makes disaggregated generation equal colocated
    generation token for token."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Longest context (prompt plus output) in tokens; null takes the model's own."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / torch.compile): faster engine starts, the only mode
    tested on CPU."""
    seed: int = 0
    """Sampling seed of every engine, so seeded requests repeat."""
    chat_template: str | None = None
    """Jinja chat template file for /v1/chat/completions, for models whose tokenizer has none."""
    lora: LoraConfig | None = None
    """LoRA adapters on this model (null: none, and the engines start without LoRA support)."""

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str) -> str:
        if value not in BUILTIN_MODELS and not (expanded_path(value) / "config.json").is_file():
            raise ValueError(f"{value!r} is not a Hugging Face model directory (no config.json)")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, value: str | None) -> str | None:
        if value is not None and not expanded_path(value).is_file():
            raise ValueError(f"{value!r} is not a readable file (a Jinja chat template)")
        return value

    def adapter_names(self) -> tuple[str, ...]:
        """The model names of its LoRA adapters, in the config's order."""
        return tuple(adapter.name for adapter in self.lora.adapters) if self.lora is not None else ()

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> "ModelConfig":
        if self.lora is not None and any(adapter.name == self.name for adapter in self.lora.adapters):
            raise ValueError(f"lora.adapters: {self.name!r} is the base model's name; give the adapter another")
        return self


class PoolConfig(_Strict):
    """One pool of identical workers (prefill or decode)."""

    replicas: int = Field(default=1, ge=1)
    """Workers in the pool."""
    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs each worker's model is split over, layer by layer (vLLM's tensor parallelism)."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline stages each worker's model is split into (vLLM's pipeline parallelism)."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """KV cache each worker's engine reserves, in GiB (vLLM's kv_cache_memory_bytes)."""
    num_cpus: float = Field(default=1.0, ge=0)
    """CPUs Ray reserves for each worker actor."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves for each worker actor (0 on CPU machines)."""
    cpu_cores: list[int] | None = None
    """CPU only: the core each worker's forward pass is pinned to (replica i gets cpu_cores[i]).
    vLLM would otherwise pin every engine to the machine's last core."""
    nodes: list[int] | None = None
    """Cluster node (index into the Ray cluster's nodes, sorted by address) for each replica, as a
    placement plan assigns them; None lets Ray choose."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources each worker requests, e.g. {prefill: 1}: on a cluster whose node groups
    advertise them (Kubernetes, docs/guides/kubernetes.md) they put each worker on its own group's nodes,
    and Ray's autoscaler knows which group to grow for a pending worker."""
    max_num_seqs: int = Field(default=64, ge=1)
    """Requests one engine runs at once (vLLM's max_num_seqs); more wait in its queue."""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Tokens one engine step may compute (vLLM's chunked-prefill budget), set explicitly so that
    the engines and the planner's simulator (SimConfig.prefill_max_batch_tokens) agree."""
    engine: Literal["vllm", "simulated"] = "vllm"
    """vllm: a real engine. simulated: SIMULATED timing from a latency model, no model computed
    (control-plane scale tests and what-if runs only; worker_runtime/simulated_engine.py)."""
    simulated_profile: str = "distserve:opt-13b"
    """simulated: "distserve:MODEL" (DistServe's A100 profiles in ../shared/traces) or the path of
    a `duet profile` output."""
    output_interval_ms: float = Field(default=40.0, ge=0)
    """The shortest time between two output messages of a worker's engine to the router, in ms;
    outputs produced meanwhile travel together (worker_runtime/engine_output.py). The default is
    the tight TPOT target of `duet bench serve`, so a token waits at most what that target
    allows for one token. Each message costs the router about 2 ms of CPU on a small host
    whatever it carries, so a decode engine stepping every 10 ms cost it about 1.6 ms per token
    alone. A request's first and last tokens never wait; the others arrive in twos or threes. 0:
    every step."""

    @model_validator(mode="after")
    def _one_entry_per_replica(self) -> "PoolConfig":
        for name in ("cpu_cores", "nodes"):
            listed = getattr(self, name)
            if listed is not None and len(listed) < self.replicas:
                raise ValueError(
                    f"{name} lists {len(listed)} entries for {self.replicas} replicas; "
                    "give one per replica or leave it out"
                )
        return self


class EncodePoolConfig(PoolConfig):
    """The encode pool of a vision-language model (E+P+D): workers whose vLLM engines run only
    the image encoder and write each image's output to the encoder cache, from which prefill
    engines read it instead of encoding the image themselves (docs/concepts/images.md). With
    no encode workers the prefill engines encode (EP+D)."""

    replicas: int = Field(default=0, ge=0)
    """Encode workers (0: none; each prefill engine encodes its own prompts' images)."""
    kv_cache_gib: float = Field(default=0.25, gt=0)
    """Unused by an encoder-only engine, which keeps no KV cache."""
    cache_gib: float = Field(default=1.0, gt=0)
    """Encoder outputs the encoder cache keeps, in GiB; the least recently used go when it is full."""
    cache_path: str | None = None
    """The encoder cache's folder, which every encode and prefill worker must reach (one host's
    disk; on a cluster a path shared by every node). null: a folder of this deployment's under
    the system's temporary directory, removed when it stops."""


class KVTransferConfig(_Strict):
    """How KV moves from prefill to decode workers."""

    transport: Literal["nixl", "nccl"] = "nixl"
    """nixl: vLLM's NixlConnector (UCX; pull). nccl: duet's P2pConnector (torch.distributed
    send/recv, NCCL on GPUs and gloo on CPUs; pushes each layer during prefill)."""
    buffer_device: Literal["cpu", "cuda"] = "cpu"
    """Where the KV staging buffer lives: cpu (host memory; the only choice on CPU machines) or
    cuda."""
    side_channel_host: str = "127.0.0.1"
    """The address workers' KV channels listen on; "auto" is each worker's own node address (multi-
    node clusters, where no single address fits every worker)."""
    side_channel_base_port: int = Field(default=5600, ge=1024, le=65000)
    """First port of the workers' KV side channels (NIXL handshakes); each worker takes its own
    from here."""
    p2p_base_port: int = Field(default=18600, ge=1024, le=65000)
    """nccl: first port a decode worker tries for its receiver (one port per rank)."""
    handoff_timeout_s: float = Field(default=30.0, gt=0)
    """Bound on a KV hand-off (from launching decode to its first tokens); past it the decode
    worker recomputes the prompt itself."""
    nixl_progress_thread: Literal["wait", "poll", "off"] = "wait"
    """NIXL's UCX progress thread in each engine: "wait" sleeps until UCX has work (a KV pull
    completes while the prefill engine computes its next prompt); "poll" is NIXL's default,
    which busy-polls a whole core per engine; "off" progresses UCX only between engine steps, so
    a pull waits out the prefill step in progress (docs/concepts/kv-transfer.md)."""
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """What a decode worker does when a KV pull fails: recompute the prompt itself, or fail the
    request."""
    kv_lease_s: int = Field(default=30, ge=6)
    """Seconds a prefill worker keeps KV for a decode worker that never pulls it (the decode side
    extends the lease by heartbeats while it is still waiting to pull)."""
    layerwise: bool = True
    """nccl: stream each layer's KV while prefill computes the next (False: send it all after the
    prefill, the baseline `duet bench transfer` compares against)."""
    codec: Literal["auto", "on", "off"] = "auto"
    """nccl: send KV compressed (8-bit groups, then zstd: about 4x smaller than float32 at 0.5%
    relative error). auto: per transfer, where the link's measured rate makes it pay (slow
    links between hosts; never within a host); on: always; off: never. NIXL transfers are not
    encoded (the decode side reads the prefill engine's blocks in place)."""

    @field_validator("nixl_progress_thread", "codec", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML reads an unquoted ``off`` as false and ``on`` as true."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value


class KVPoolConfig(_Strict):
    """The host KV pool (docs/concepts/kv-pool.md): the prefix KV blocks prefill and colocated
    engines compute, kept in host memory that every such engine on the host reads, beyond any
    one engine's cache and lifetime. A prompt whose prefix is in the pool loads it instead of
    computing it."""

    enabled: bool = False
    """Give prefill and colocated engines the pool (vLLM's OffloadingConnector; decode engines
    get their prompts' KV from prefill workers). Prefill engines get it with the nixl transport
    only. Off by default: every block computed is stored, which on the serving benchmark's
    conversation slice (no prefix reuse) cost 1.18x CPU per token and 12 points of attainment at
    26 req/s (benchmarks/results/serve_kv_pool_cost/); turn it on where prefixes come back."""
    directory: str = "/dev/shm/duet-kv-pool"
    """Where each host's pool keeps its blocks: a file per block, named by model, KV layout and
    the block's prefix hash. On /dev/shm (tmpfs) the pool is host memory; a path on a local disk
    makes it a disk tier. Every engine of the same model on the host shares it, across
    deployments and restarts."""
    capacity_gib: float = Field(default=2.0, gt=0)
    """The most each host's pool holds; past it the least recently used blocks are evicted
    (an engine sweeps after writing 5% of it). The pool takes host memory (tmpfs) or disk."""
    engine_buffer_mib: int = Field(default=128, ge=8)
    """Each engine's own host-memory tier, through which blocks pass to and from the pool (vLLM's
    primary tier): at least the blocks of the longest prompts loaded at once."""
    fetch_across_hosts: bool = False
    """A prefill worker fetches a prefix that another host's pool holds, and its own host's does
    not, from an engine on that host over NIXL (vLLM's p2p tier) instead of computing it. Needs
    router.prefill_policy prefix_affinity, which knows which host holds a prefix and names the
    source (with another policy this does nothing). Each prefill engine listens for such fetches
    on the port after its KV side channel's. Prefill workers only (nixl transport):
    colocated workers have no KV channel to address. Off by default: with the built-in model a
    fetch took longer than computing the prompt, 1.44x at 1 Gbit/s and 7.9x at 100 Mbit/s
    (benchmarks/results/kv_pool_hosts.json); it pays where a block crosses the link faster than
    the engine computes it (large models, fast links). Whether each planned fetch is made is
    ``fetch_when``'s."""
    fetch_when: Literal["faster", "always"] = "faster"
    """With fetch_across_hosts, which planned fetches are made. ``faster``: those the router
    predicts to be faster than computing the same tokens, from its own timings of both (prefills
    it computed, and fetches from each host, on workers with nothing else queued); fetches from
    a host are made until one is timed, and while fetches from a host are declined one in 16 is
    made to measure again. ``always``: every one (to measure fetching itself)."""


class RayConfig(_Strict):
    address: str = Field(
        default="local",
        description="'local' starts a private instance; 'auto' joins the cluster of this node ($RAY_ADDRESS)",
    )
    num_cpus: int | None = Field(default=None, ge=1)
    """CPUs a private Ray instance (address: local) offers; null: all of the machine's."""
    worker_logs_to_driver: bool = False
    """vLLM logs a lot from every worker; errors reach the user through duet's own messages."""
    autoscaling: bool = False
    """The cluster adds nodes for workers that wait for resources (KubeRay's autoscaler): growing a
    pool is then not refused for lack of free resources, the new workers wait for their nodes
    (up to server.worker_start_timeout_s)."""


class TlsConfig(_Strict):
    """TLS for both front ends (gRPC and HTTP): the server's certificate, and optionally a CA
    whose client certificates are required (mutual TLS)."""

    cert_file: str = Field(description="PEM certificate chain the server presents")
    key_file: str = Field(description="PEM private key of that certificate")
    client_ca_file: str | None = Field(default=None, description="mutual TLS: clients must present a certificate this CA signed")

    @field_validator("cert_file", "key_file", "client_ca_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None and not expanded_path(value).is_file():
            raise ValueError(f"{value!r} is not a readable file")
        return value


class AuthConfig(_Strict):
    """Who may call: API keys (sent as ``Authorization: Bearer KEY`` on both APIs) and the quotas
    each key gets. With no key configured, duet serves without authentication (loopback only,
    unless ``server.allow_unauthenticated``)."""

    api_keys_file: str | None = None
    """YAML list of {name, key, requests_per_minute?, max_concurrent_requests?, admin?, models?, model_quotas?}; see
    docs/guides/security.md."""
    api_keys_env: str = "DUET_API_KEYS"
    """Environment variable holding comma-separated keys (optionally NAME:KEY), default quotas."""
    requests_per_minute: float | None = Field(default=None, gt=0)
    """Per-key quotas (a key's own entry in the keys file overrides them); null is unlimited."""
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    """Per-key limit on requests in flight at once; null is unlimited."""


class BatchesConfig(_Strict):
    """Batch jobs (OpenAI's Files and Batch APIs, ``duet batch``): where they are kept and how
    much of the deployment they may use beside online traffic."""

    directory: str = "~/.local/share/duet/batches"
    """Where files, jobs and their results are kept, in a folder per deployment (by its gRPC
    port). Jobs survive a restart of any front door or the control plane; on a cluster with
    front doors on several hosts, a path every one of them shares (NFS, a mounted volume)."""
    max_file_bytes: int = Field(default=200 * 2**20, ge=1024)
    """Largest file one upload may carry (413 beyond it); OpenAI's limit is 200 MB."""
    max_requests: int = Field(default=50_000, ge=1)
    """Most requests (lines) in one batch input file, as OpenAI's."""
    max_inflight: int = Field(default=8, ge=1)
    """Most requests a job keeps in flight at one front door, one fewer for each online
    request that front door has in flight: a job fills the capacity online traffic leaves."""
    lease_s: float = Field(default=30.0, ge=3)
    """A front door renews its hold on the job it runs every third of this; a job whose hold is
    older (its front door died) is taken over by another front door, or by the same one
    restarted, and resumes from its last recorded result."""


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    """Address both APIs listen on. A non-loopback address needs API keys or allow_unauthenticated."""
    port: int = Field(default=50051, ge=0, le=65535)
    """gRPC port; 0 picks a free port."""
    http_port: int | None = Field(default=8000, ge=0, le=65535)
    """OpenAI-compatible HTTP API on the same host; 0 picks a free port; null disables it."""
    http_max_body_bytes: int = Field(default=4 * 2**20, ge=1024)
    """Largest HTTP request body accepted (413 beyond it)."""
    tls: TlsConfig | None = None
    """Serve both APIs over TLS (null: plaintext)."""
    auth: AuthConfig = AuthConfig()
    """API keys and per-key quotas."""
    batches: BatchesConfig = BatchesConfig()
    """Batch jobs over the HTTP API (``/v1/files``, ``/v1/batches``)."""
    allow_unauthenticated: bool = False
    """Serving a non-loopback address without API keys must be asked for explicitly."""
    max_inflight_requests: int = Field(default=128, ge=1)
    """Admission limit: requests beyond it get RESOURCE_EXHAUSTED instead of queueing unbounded."""
    metrics_port: int | None = Field(default=9400, ge=0, le=65535)
    """Prometheus endpoint (/metrics): request metrics and every worker's vLLM metrics. 0 picks a
    free port; null disables it."""
    worker_start_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a worker may take to start (load weights, warm up) before the start counts as
    failed."""
    front_ends: int = Field(default=1, ge=1, le=64)
    """Front doors: processes that serve both APIs. With 1, the control plane's process serves.
    With more, each is a Ray actor of its own on the control plane's host, all on the same ports
    (SO_REUSEPORT: the kernel spreads connections among them), each with its own front end to
    every engine core; one that dies loses only its own requests and is replaced without
    restarting any engine (router/front_door.py). More use more cores for the APIs."""
    front_end_placement: Literal["local", "nodes"] = "local"
    """Where the front doors run. "local": on the control plane's host, sharing its ports. "nodes":
    each on a Ray node of its own that advertises the duet_front_end resource (a host joined
    with `duet front-end --cluster ADDRESS`, or a pod of the Kubernetes front-door group),
    serving on that host's ports; a front door whose host is lost is replaced on another such
    host, and a host beyond front_ends waits as a standby. With "nodes" the front doors run
    apart from the control plane even with front_ends: 1."""

    @property
    def front_doors_apart(self) -> bool:
        """Whether the front doors are processes of their own (router/front_door.py)."""
        return self.front_ends > 1 or self.front_end_placement == "nodes"


class RouterConfig(_Strict):
    """How the router picks workers, watches them, and removes them (router/policies.py)."""

    prefill_policy: Literal["least_requests", "least_prompt_tokens", "prefix_affinity"] = "least_prompt_tokens"
    """How a prefill worker is picked: fewest requests, fewest outstanding prompt tokens, or the
    one holding the prompt's cached prefix where that does not put more queued work ahead of it
    than the prefix saves (with a load guard)."""
    decode_policy: Literal["least_requests", "least_kv_load"] = "least_kv_load"
    """How a decode worker is picked: fewest requests, or the lowest KV-cache load (preferring,
    for a request with a LoRA adapter, a worker that recently decoded it, within 5 points of
    KV usage and one sequence of the least loaded)."""
    prefix_block_size: int | None = Field(default=None, ge=1)
    """prefix_affinity: tokens per hashed block (null: the engines' KV block size), and the load
    guard: a worker whose outstanding prompt tokens exceed load_factor x the pool mean (and the
    mean by more than one engine step) is skipped."""
    load_factor: float = Field(default=1.5, ge=1.0)
    """prefix_affinity's load guard (see prefix_block_size): how far above the pool's mean load a
    worker may be and still be picked for its cached prefix."""
    local_prefill_max_tokens: int = Field(default=0, ge=0)
    """Conditional disaggregation: a prompt shorter than this is prefilled by the decode worker
    itself (no KV transfer); 0 disaggregates every request."""
    local_prefill_queue_tokens: int = Field(default=0, ge=0)
    """... and, whatever its length, when every ready prefill worker already has more than this
    many prompt tokens queued or running while the decode worker's own queue of prompts is
    shorter (Dynamo's "prefill queue" condition): the decode engine's spare capacity then serves
    the TTFT the prefill pool cannot. 0 never does."""
    local_prefill_tpot_s: float | None = Field(default=0.04, gt=0)
    """... and then only while the decode worker's streams, with the prompt's stall added, stay
    inside this time per output token (seconds; router/local_prefill.py): a decode worker that
    prefills stalls every stream it decodes. Set it to the deployment's TPOT SLO (`duet plan`
    writes its own); null: the queue threshold alone decides."""
    health_interval_s: float = Field(default=1.0, gt=0)
    """Health watching: every worker is pinged (a round trip to its engine) this often; one that is
    dead is replaced at once, one that misses health_failures pings in a row (each not answered
    within the timeout: a hung engine) too. One miss is not enough: on a host whose cores are
    oversubscribed, a healthy engine's answer can take seconds (cluster/health.py)."""
    health_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds a health ping may take before it counts as missed."""
    health_failures: int = Field(default=3, ge=1)
    """Missed pings in a row after which a worker counts as hung and is replaced. A ping missed
    while the engine's threads were waiting for a CPU (its host oversubscribed, as the kernel's
    scheduler statistics show) is not counted."""
    health_starved_limit_s: float = Field(default=60.0, gt=0)
    """... but a worker that has answered no ping for this long is replaced, starved or not: an
    engine that hangs on an oversubscribed host is found this late."""
    max_engine_crashes: int = Field(default=2, ge=0)
    """A request held by this many engines as they crashed (the engine raised, or died of a
    fault signal such as SIGSEGV; a kill from outside does not count) is failed with INTERNAL
    (HTTP 500, ``x-should-retry: false``) instead of being resumed on yet another engine: most
    likely it is what crashes them, and every retry would take down another engine and delay
    the requests it held. 0 never gives up on a request for this (it still gives up after three
    failed attempts, with UNAVAILABLE)."""
    drain_timeout_s: float = Field(default=60.0, ge=0)
    """Removing a worker waits this long for its requests to finish; the rest resume elsewhere."""
    drain_moves_kv: bool = True
    """A draining decode worker hands its running requests to the other decode workers with
    their KV (disaggregated serving; ``nixl`` has the targets pull it, ``nccl`` sends it to them);
    false: they finish in place, or resume by recomputing at the drain timeout."""
    rebalance_kv_gap: float | None = Field(default=None, gt=0, le=1)
    """Rebalancing the decode pool (off by default: null). A decode worker whose KV cache use is
    this much above the pool's mean (0.25: 25 points) hands its longest running requests to the
    other decode workers with their KV, as a drain does, until it is back near the mean: a
    worker that got the long requests does not keep them (router/rebalancer.py). Each front door
    moves the requests it serves. Needs disaggregated serving."""
    rebalance_interval_s: float = Field(default=2.0, gt=0)
    """How often rebalancing compares the decode workers' KV cache use (each front door asks
    every decode engine); also the least time between two moves off one worker. A request that
    arrived by a move stays five of these intervals before rebalancing may move it again."""


class ImagesConfig(_Strict):
    """Bounds on a request's images (vision-language models; a text model refuses images): a
    request past one is refused with INVALID_ARGUMENT / HTTP 400 naming the image, before any
    worker sees it."""

    max_per_request: int = Field(default=8, ge=1)
    """Most images in one request (its messages together)."""
    max_bytes: int = Field(default=10 * 2**20, ge=1)
    """Largest image file, as sent (a ``data:`` URL decoded, a fetched URL's body). The whole
    request is bounded as well: by ``server.http_max_body_bytes`` over HTTP (base64 makes an
    image a third larger) and by gRPC's 4 MiB message limit."""
    max_pixels: int = Field(default=4096 * 4096, ge=1)
    """Most pixels (width times height) in one image, read from its header before it is
    decoded: a small file that decompresses to a huge image is refused."""
    fetch_domains: list[str] = []
    """Hosts whose ``http(s)`` image URLs a front door fetches (an exact host name, or
    ``*.example.com`` for its subdomains). Empty, the default: no URL is fetched, images come
    as ``data:`` URLs (OpenAI API) or bytes (gRPC), so a request cannot make a front door reach
    into its network."""
    fetch_timeout_s: float = Field(default=5.0, gt=0)
    """How long a front door waits for one image URL's whole body."""


class ApiConfig(_Strict):
    """Bounds on what one request may ask of the deployment, beyond what vLLM itself refuses,
    so that a single call cannot occupy it: both APIs refuse a request past them with
    INVALID_ARGUMENT / HTTP 400 naming the field."""

    max_n: int = Field(default=16, ge=1, le=1024)
    """Most sequences one request may ask for (``n``); each counts against admission and quotas."""
    max_logprobs: int = Field(default=20, ge=0)
    """Most alternatives per position (``logprobs``, ``top_logprobs``, ``prompt_logprobs``), and
    never more than the model's own maximum (vLLM's max_logprobs, 20 unless the model says)."""
    max_batch_prompts: int = Field(default=64, ge=1)
    """Most prompts in one completions request (a batch)."""
    max_structured_output_bytes: int = Field(default=64 * 1024, ge=16)
    """Largest structured-output constraint (a JSON schema, regex, grammar or choice list, as
    text); vLLM's own bounds on nesting depth and regex compile time apply too."""
    structured_output_timeout_s: float = Field(default=5.0, gt=0)
    """How long a front door may take to compile a request's structured-output constraint (in a
    thread, so its other streams go on) before the request is refused as too complex."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser for the model's output (``hermes``, ``llama3_json``, ...): needed
    for ``tool_choice: auto`` as in vLLM's ``--tool-call-parser``; named and required tool
    choices need none (they constrain the output to the tools' JSON schema)."""
    images: ImagesConfig = ImagesConfig()
    """A request's images (vision-language models)."""


# The sections that describe one served model; ``models:`` lists them once per model.
MODEL_SECTIONS = ("model", "mode", "prefill", "decode", "encode", "colocated", "autoscale")


class ServedModelConfig(_Strict):
    """One of several models a deployment serves: the model, its pools and its SLO's autoscaling
    policy, as the top-level sections of the same names describe a one-model deployment."""

    model: ModelConfig
    """The model, served under its ``name`` (and its LoRA adapters' names)."""
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """This model's pools: prefill and decode, or one colocated pool."""
    prefill: PoolConfig = PoolConfig(cpu_cores=[0])
    """Its prefill pool (mode: disaggregated)."""
    decode: PoolConfig = PoolConfig(cpu_cores=[1])
    """Its decode pool (mode: disaggregated)."""
    encode: EncodePoolConfig = EncodePoolConfig()
    """Its encode pool (a vision-language model in mode disaggregated; none by default)."""
    colocated: PoolConfig = PoolConfig(replicas=2, cpu_cores=[0, 1])
    """Its pool of whole-request workers (mode: colocated)."""
    autoscale: str | None = None
    """An autoscaling policy sizing this model's pools to its SLO (null: the sizes above)."""
    router: RouterConfig | None = None
    """This model's routing (policies, local prefill, rebalancing, draining); null: the
    deployment's ``router``. Health watching is the deployment's: the top-level router's
    ``health_*`` settings apply to every model."""


class DuetConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: prefill and decode pools with KV transfer between them. colocated: one pool
    of workers that each run whole requests (the ``colocated`` section), behind the same router:
    the baseline disaggregation is measured against on the same hardware."""
    model: ModelConfig = ModelConfig()
    """The model every worker serves."""
    prefill: PoolConfig = PoolConfig(cpu_cores=[0])
    """The prefill pool (mode: disaggregated)."""
    decode: PoolConfig = PoolConfig(cpu_cores=[1])
    """The decode pool (mode: disaggregated)."""
    encode: EncodePoolConfig = EncodePoolConfig()
    """The encode pool of a vision-language model (mode: disaggregated): image encoders of their
    own (E+P+D). None by default: the prefill engines encode (EP+D)."""
    colocated: PoolConfig = PoolConfig(replicas=2, cpu_cores=[0, 1])
    """The one pool of whole-request workers (mode: colocated)."""
    kv_transfer: KVTransferConfig = KVTransferConfig()
    """How KV moves from prefill to decode workers."""
    kv_pool: KVPoolConfig = KVPoolConfig()
    """The host KV pool: prefixes kept in host memory every prefill and colocated engine on a
    host reads."""
    router: RouterConfig = RouterConfig()
    """Routing policies, health watching and draining."""
    ray: RayConfig = RayConfig()
    """Which Ray cluster duet runs on."""
    server: ServerConfig = ServerConfig()
    """The front doors: APIs, ports, TLS, keys, admission."""
    api: ApiConfig = ApiConfig()
    """Bounds on what one request may ask (n, logprobs, batches, structured outputs) and tool calls."""
    autoscale: str | None = None
    """An autoscaling policy (a name under configs/autoscale, or a YAML path) that sizes the
    prefill and decode pools to its SLO while serving; None keeps the sizes above."""
    autoscale_budget: int | None = Field(default=None, ge=1)
    """Units (GPUs, or cores on CPU) the pools of every served model may hold together while
    autoscaling: each model's autoscaler grows its pools only into what the other models leave,
    arbitrated by SLO shortfall (docs/concepts/autoscaling.md; null: each model is bounded by its
    own policy alone)."""
    models: list[ServedModelConfig] = []
    """Several models served by one deployment, each with its own pools, engine settings and
    autoscaling policy, behind the same front door: a request goes to the pools of the model it
    names. When set, the top-level model, mode, prefill, decode, colocated and autoscale
    sections are not used and must be left out; the first model listed is the default (a
    request that names none)."""

    @field_validator("autoscale")
    @classmethod
    def _policy_loads(cls, value: str | None) -> str | None:
        if value is not None:
            from duet.cluster.autoscaler.policy import PolicyError, load_policy

            try:
                load_policy(value)
            except PolicyError as error:
                raise ValueError(str(error)) from None
        return value

    @model_validator(mode="after")
    def _autoscale_disaggregated(self) -> "DuetConfig":
        if self.autoscale is not None and self.mode == "colocated":
            raise ValueError("autoscale: the autoscaler sizes prefill and decode pools; a colocated deployment has neither")
        return self

    @model_validator(mode="after")
    def _encode_pool_feeds_prefill(self) -> "DuetConfig":
        if not self.encode.replicas:
            return self
        if self.mode == "colocated":
            raise ValueError("encode.replicas: an encode pool feeds prefill workers; a colocated deployment has none (set it to 0)")
        if self.model.path in BUILTIN_TEXT_MODELS:
            raise ValueError(f"encode.replicas: model {self.model.path!r} takes no images; encode workers serve a vision-language model")
        if self.encode.engine == "simulated" or self.prefill.engine == "simulated":
            raise ValueError("encode.engine: encode workers run vLLM's encoder; SIMULATED engines have no images (set encode.replicas to 0)")
        if self.encode.tensor_parallel * self.encode.pipeline_parallel > 1:
            raise ValueError("encode.tensor_parallel: an encode worker runs on one device (its ranks would write the same files)")
        several_hosts = (
            self.ray.address != "local" or self.server.front_end_placement == "nodes"
            or len({node for pool in (self.prefill, self.encode) for node in pool.nodes or ()}) > 1
        )
        if self.encode.cache_path is None and several_hosts:
            raise ValueError(
                "encode.cache_path: on a Ray cluster name a folder every node mounts (the default is a temporary "
                "folder of one host, which the workers on other hosts would not see)"
            )
        return self

    @model_validator(mode="after")
    def _front_door_hosts_can_join(self) -> "DuetConfig":
        server = self.server
        if server.front_end_placement != "nodes":
            return self
        if self.ray.address == "local":
            raise ValueError(
                "server.front_end_placement: front doors on hosts of their own join a Ray cluster; "
                "set ray.address (e.g. auto, with `ray start --head` on this host) or use local"
            )
        if server.port == 0 or server.http_port == 0:
            raise ValueError("server.port/http_port: front doors on several hosts serve on the same, fixed ports; 0 is not allowed")
        if any(pool.engine == "simulated" for pool in (self.prefill, self.decode, self.colocated)):
            raise ValueError(
                "server.front_end_placement: SIMULATED workers reach their front doors at fixed addresses; "
                "use nodes with vLLM workers only"
            )
        return self

    @model_validator(mode="after")
    def _rebalance_moves_kv(self) -> "DuetConfig":
        if self.router.rebalance_kv_gap is not None and self.mode == "colocated":
            raise ValueError(
                "router.rebalance_kv_gap: rebalancing moves requests with their KV between decode workers; "
                "it needs mode: disaggregated (or set it to null)"
            )
        return self

    @model_validator(mode="after")
    def _simulated_engines_pull(self) -> "DuetConfig":
        simulated = any(pool.engine == "simulated" for pool in (self.prefill, self.decode, self.colocated))
        if simulated and self.kv_transfer.transport != "nixl":
            raise ValueError("kv_transfer.transport: simulated engines model the nixl (pull) hand-off; use nixl")
        return self


    @model_validator(mode="after")
    def _models_apart(self) -> "DuetConfig":
        if not self.models:
            return self
        doubled = [name for name in MODEL_SECTIONS if getattr(self, name) != type(self).model_fields[name].default]
        if doubled:
            raise ValueError(f"models: lists each model's own {', '.join(doubled)}; leave the top-level one(s) out")
        folders = [served.encode.cache_path for served in self.models if served.encode.replicas and served.encode.cache_path]
        if len(folders) != len(set(folders)):
            raise ValueError("models: each model's encode.cache_path apart (each removes the least recently used of its own)")
        names = [name for served in self.models for name in (served.model.name, *served.model.adapter_names())]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"models: each model and adapter name once; repeated: {', '.join(repeated)}")
        for index, served in enumerate(self.models):
            try:
                one_model(self, served)
            except ValidationError as error:
                problems = "; ".join(field_errors(error))
                raise ValueError(f"models.{index} ({served.model.name}): {problems}") from None
        return self

    def served(self) -> list["DuetConfig"]:
        """One config per served model: the deployment's shared sections (router, server, ...)
        with that model's own; the default model first."""
        if not self.models:
            return [self]
        return [one_model(self, served) for served in self.models]


def one_model(config: DuetConfig, served: ServedModelConfig) -> DuetConfig:
    """``config``'s shared sections with ``served``'s model sections, validated as a one-model
    config (so every rule that ties a model's pools to the shared sections holds per model)."""
    shared = config.model_dump(exclude={"models", *MODEL_SECTIONS}, exclude_unset=True)
    own = served.model_dump(exclude_unset=True)
    if own.get("router", "unset") is None:
        del own["router"]  # null: the deployment's router
    return DuetConfig.model_validate({**shared, **own})


def parse_config(data: object, source: str = "config") -> DuetConfig:
    """Validate an already-parsed mapping; raise ConfigError naming every bad field."""
    return validate_mapping(DuetConfig, data, source, ConfigError)


def load_config(path: str | Path | None = None) -> DuetConfig:
    """Load and validate a YAML config; the embedded default when ``path`` is None."""
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    return parse_config(read_yaml(path, "config", ConfigError), source=str(path))
