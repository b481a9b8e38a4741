"""One front door's serving path, assembled from the deployment's config.

Every front door builds the same thing over its own view of the pools: the control plane's
process for its own front door (cluster/deployment.py) and each extra front door's process
(router/front_door.py). Built in one place, so the front doors cannot drift apart.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from duet.config import DuetConfig
from duet.worker_runtime.engine import resolve_model_path
from duet.kv_transfer.config import TRANSPORTS
from duet.kv_transfer.encoder_cache import SHARED_IN_USE_S, EncoderCacheFolder
from duet.router.auth import Gatekeeper
from duet.router.encoding import EncodeStep
from duet.router.lifecycle import RequestLifecycle, RetryPolicy
from duet.router.lora_adapters import served_adapters
from duet.kv_transfer.config import fetches_across_hosts, pool_peer_endpoint, pool_serves
from duet.router.policies import LeastKvLoad, LeastPromptTokens, LeastRequests, PrefixAffinity
from duet.router.pools import WorkerPool
from duet.router.rebalancer import Rebalancer
from duet.router.serving import RequestService
from duet.router.status import ClusterView
from duet.router.tool_calls import tool_parser_class
from duet.router.validation import ModelLimits


def set_policies(config: DuetConfig, prefill: WorkerPool, decode: WorkerPool, engine_block_size: int) -> None:
    """Give each pool the routing policy the ``router:`` section names."""
    router = config.router
    prefill_policies = {
        "least_requests": LeastRequests,
        "least_prompt_tokens": LeastPromptTokens,
        "prefix_affinity": lambda: PrefixAffinity(
            router.prefix_block_size or engine_block_size, router.load_factor, adapters_held=_adapters_held(config),
            shared_pool=prefill.role == "prefill" and pool_serves(config, "prefill"),
            peer_endpoint=partial(pool_peer_endpoint, config, "prefill") if fetches_across_hosts(config) else None,
        ),
    }
    prefill.policy = prefill_policies[router.prefill_policy]()
    decode_policies = {"least_requests": LeastRequests, "least_kv_load": lambda: LeastKvLoad(_adapters_held(config))}
    decode.policy = decode_policies[router.decode_policy]()


def _adapters_held(config: DuetConfig) -> int:
    """LoRA adapters each engine keeps loaded (vLLM's max_cpu_loras, which defaults to max_loras)."""
    lora = config.model.lora
    if lora is None:
        return 1
    return lora.max_cpu_loras or lora.max_loras


def request_service(
    config: DuetConfig,
    prefill: WorkerPool | None,
    decode: WorkerPool,
    engine_limits: tuple[int, int, int],
    cluster: ClusterView,
    gatekeeper: Gatekeeper,
    encode: WorkerPool | None = None,
) -> RequestService:
    """The serving path over ``prefill`` (None: colocated), ``decode`` and, for E+P+D,
    ``encode``, routing with the configured policies; ``engine_limits`` is the engine's
    (max_model_len, vocab_size, block_size)."""
    from transformers import AutoTokenizer

    max_model_len, vocab_size, block_size = engine_limits
    set_policies(config, prefill or WorkerPool("prefill"), decode, block_size)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(config.model)))
    transfer = config.kv_transfer
    lifecycle = RequestLifecycle(
        prefill,
        decode,
        RetryPolicy(
            worker_wait_s=config.server.worker_start_timeout_s,
            transfer_timeout_s=transfer.handoff_timeout_s,
            max_engine_crashes=config.router.max_engine_crashes,
        ),
        prefill_pushes_kv=TRANSPORTS[transfer.transport].pushes_to_decode,
        local_prefill_max_tokens=config.router.local_prefill_max_tokens,
        local_prefill_queue_tokens=config.router.local_prefill_queue_tokens,
        local_prefill_tpot_s=config.router.local_prefill_tpot_s,
        fetch_when=config.kv_pool.fetch_when,
    )
    lifecycle.on_move = cluster.moved
    if encode is not None:
        lifecycle.encoder = EncodeStep(encode, encoder_cache_folder(config), cluster.metrics)
        cluster.encoders[config.model.name] = lifecycle.encoder
    if prefill is not None and config.router.drain_moves_kv:
        # A draining decode worker hands its requests on with their KV, as prefill hands its
        # own (pulled with nixl, pushed with nccl); colocated workers finish them in place.
        decode.on_draining.append(lifecycle.migrate)
    api = config.api
    limits = ModelLimits(
        config.model.name, max_model_len, vocab_size,
        max_n=api.max_n, max_logprobs=api.max_logprobs,
        max_structured_output_bytes=api.max_structured_output_bytes, max_batch_prompts=api.max_batch_prompts,
        structured_output_timeout_s=api.structured_output_timeout_s,
        adapters=served_adapters(config.model), block_size=block_size,
    )
    service = RequestService(lifecycle, limits, tokenizer, cluster, gatekeeper, config.server.max_inflight_requests)
    if lifecycle.encoder is not None:
        lifecycle.encoder.load = service.load
    service.tool_parser = tool_parser_class(api.tool_call_parser, tokenizer)
    service.chat_template = chat_template(config)
    service.image_limits = api.images
    if config.router.rebalance_kv_gap is not None:
        service.rebalancer = Rebalancer(lifecycle, config.router.rebalance_kv_gap, config.router.rebalance_interval_s)
    return service


def encoder_cache_folder(config: DuetConfig) -> EncoderCacheFolder:
    """This front door's index of the model's encoder cache: its share of the capacity, with
    files the other front doors use left alone (kv_transfer/encoder_cache.py)."""
    encode, server = config.encode, config.server
    assert encode.cache_path is not None
    front_doors = server.front_ends if server.front_doors_apart else 1
    return EncoderCacheFolder(
        encode.cache_path, int(encode.cache_gib * (1 << 30) / front_doors), SHARED_IN_USE_S if front_doors > 1 else 0.0
    )


def chat_template(config: DuetConfig) -> str | None:
    """The configured chat template's text (None: the tokenizer's own)."""
    path = config.model.chat_template
    return Path(path).expanduser().read_text() if path else None


def router_host(config: DuetConfig) -> str:
    """The address workers reach a front door at (engine cores its front ends, SIMULATED
    engines their channels): loopback on a private local Ray, else this node's."""
    if config.ray.address == "local":
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()
