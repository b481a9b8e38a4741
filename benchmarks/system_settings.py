"""The knobs a user of each compared system could set on this machine, as named settings.

A comparison is only fair when every system runs with the settings that serve it best on the
same hardware (issue 53), so ``duet bench serve`` takes a system as ``NAME@SETTING``
(``vllm-pd@own-core``) and ``duet bench serve --tune`` measures every setting of each system
here, interleaved, to pick its best. A setting is what that system's users could set: engine
arguments and environment variables of vLLM (core binding, OpenMP threads, the executor,
``--stream-interval``), the flags of the peers' launcher (benchmarks/peer_systems.py), or,
for duet, config fields. Without ``@`` a system runs on its ``default``: as its documentation
sets it up (duet: the embedded default).

The engines' shared terms (model, dtype, seed, step token budget, sequence limit, KV capacity)
are not settings: every system gets duet's (benchmarks/serving_systems.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duet.benchmarks.serve_report import (
    COLOCATED, COLOCATED_HTTP, DISAGG, DISAGG_FRONT_DOORS, DISAGG_HTTP, DYNAMO_AGG, DYNAMO_DISAGG, VLLM, VLLM_PD,
)
from duet.config import load_config

DEFAULT = "default"


@dataclass(frozen=True)
class Setting:
    """One way to run a system: what it changes, said in the words its users would use."""

    description: str
    env: dict[str, str] = field(default_factory=dict)  # environment of the system's processes
    args: tuple[str, ...] = ()  # more command-line arguments (vLLM's server, the peers' launcher)
    config: dict[str, dict[str, Any]] = field(default_factory=dict)  # duet: config sections' fields
    # Measured by ``--tune``. A setting that takes the machine from every system beside it
    # cannot be measured side by side, and one that changes what is served (a deployment shape,
    # not a knob) is a system of its own: each is run by name.
    swept: bool = True


_AS_DOCUMENTED = Setting("as its documentation sets it up")
_ONE_OMP_THREAD = {"OMP_NUM_THREADS": "1"}
_ALL_POOLS = ("prefill", "decode", "colocated")


def _every_pool(**fields: Any) -> dict[str, dict[str, Any]]:
    return {pool: dict(fields) for pool in _ALL_POOLS}


_DUET = {
    DEFAULT: Setting(
        "the benchmark's config (--config; the embedded default configs/local.yaml, with --images configs/vision.yaml "
        "on builtin-vl-large)"
    ),
    "no-guard": Setting(
        "local prefill without the TPOT guard (router.local_prefill_tpot_s: null)", config={"router": {"local_prefill_tpot_s": None}}
    ),
    "no-local-prefill": Setting(
        "conditional disaggregation off (router.local_prefill_queue_tokens: 0)", config={"router": {"local_prefill_queue_tokens": 0}}
    ),
    "tpot-100": Setting(
        "the guard at the loose SLO's TPOT (router.local_prefill_tpot_s: 0.1, as `duet plan` sets it for 100 ms)",
        config={"router": {"local_prefill_tpot_s": 0.1}},
    ),
    "kv-pool": Setting("the host KV pool on (kv_pool.enabled: true)", config={"kv_pool": {"enabled": True}}),
    "interval-10": Setting("engine outputs merged every 10 ms (output_interval_ms: 10)", config=_every_pool(output_interval_ms=10)),
    "interval-0": Setting("every engine step's outputs sent at once (output_interval_ms: 0)", config=_every_pool(output_interval_ms=0)),
    # A vision-language model's images encoded by the prefill engines instead of an encode pool
    # (a no-op on a text model's config, which has no encode pool).
    "epd": Setting("EP+D: no encode pool, each prefill engine encodes its prompts' images (encode.replicas: 0)",
                   config={"encode": {"replicas": 0}}, swept=False),
}
_DUET_COLOCATED = {key: _DUET[key] for key in (DEFAULT, "kv-pool", "interval-10", "interval-0")}

_VLLM = {
    DEFAULT: Setting("vLLM's own core binding (it keeps a core for its front end)"),
    "bind-0-1": Setting("the engine's OpenMP threads on both cores (VLLM_CPU_OMP_THREADS_BIND=0-1)", env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"}),
    "one-process": Setting(
        "the model in the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    ),
    "stream-4": Setting("outputs streamed every 4 steps (--stream-interval 4)", args=("--stream-interval", "4")),
}

_OWN_CORE = Setting(
    "each engine on its own core, one OpenMP thread, one-process executor, NIXL waiting "
    "(--own-core --one-process-executor, OMP_NUM_THREADS=1, --nixl-progress wait)",
    env=_ONE_OMP_THREAD, args=("--own-core", "--one-process-executor", "--nixl-progress", "wait"),
)
_DISAGG_PEER = {
    # As documented, NIXL's progress thread busy-polls: each engine's worker process keeps a core
    # at 100% while idle (80% of it in the kernel), which starves whatever runs beside it; the
    # sweep cannot measure it beside other settings (one beside it took over 10 minutes to start).
    DEFAULT: Setting(_AS_DOCUMENTED.description + " (NIXL's progress thread busy-polling)", swept=False),
    "nixl-wait": Setting("NIXL's progress thread waiting instead of polling (duet's setting; --nixl-progress wait)",
                         args=("--nixl-progress", "wait")),
    "own-core": _OWN_CORE,
    "own-core-stream-4": Setting(
        _OWN_CORE.description + ", outputs every 4 steps (--stream-interval 4)",
        env=_ONE_OMP_THREAD, args=(*_OWN_CORE.args, "--stream-interval", "4"),
    ),
}
# duet's router.local_prefill_queue_tokens in the embedded default (configs/local.yaml).
_DUET_QUEUE_TOKENS = load_config().router.local_prefill_queue_tokens
_BEST_DISAGG = _DISAGG_PEER["own-core-stream-4"]
_DYNAMO_DISAGG = {
    **_DISAGG_PEER,
    "conditional": Setting(
        f"{_BEST_DISAGG.description}, and Dynamo's conditional disaggregation: its decode worker prefills while "
        f"the prefill worker has over {_DUET_QUEUE_TOKENS} prompt tokens in progress, duet's threshold "
        f"(--conditional-disagg {_DUET_QUEUE_TOKENS}: KV router, policy prefill_load)",
        env=_ONE_OMP_THREAD, args=(*_BEST_DISAGG.args, "--conditional-disagg", str(_DUET_QUEUE_TOKENS)),
    ),
}
_AGG_PEER = {
    DEFAULT: _AS_DOCUMENTED,
    "bind-0-1": Setting("the engine's OpenMP threads on both cores (--bind 0-1)", args=("--bind", "0-1")),
    "one-process": Setting("one-process executor (--one-process-executor)", args=("--one-process-executor",)),
}

SETTINGS: dict[str, dict[str, Setting]] = {
    DISAGG: _DUET, DISAGG_HTTP: _DUET, DISAGG_FRONT_DOORS: _DUET,
    COLOCATED: _DUET_COLOCATED, COLOCATED_HTTP: _DUET_COLOCATED,
    VLLM: _VLLM, VLLM_PD: _DISAGG_PEER, DYNAMO_DISAGG: _DYNAMO_DISAGG, DYNAMO_AGG: _AGG_PEER,
}


def split(system: str) -> tuple[str, str]:
    """``NAME@SETTING`` as (NAME, SETTING); a bare NAME runs its default."""
    name, _, setting = system.partition("@")
    return name, setting or DEFAULT


def setting_of(system: str) -> Setting:
    """The setting ``NAME@SETTING`` names; ValueError naming the choices otherwise."""
    name, key = split(system)
    choices = SETTINGS.get(name, {DEFAULT: _AS_DOCUMENTED})
    if key not in choices:
        raise ValueError(f"{system}: {name} has no setting {key!r} (choose from {', '.join(choices)})")
    return choices[key]


def describe(system: str) -> str:
    """What ``system`` runs with, for the report and the tables."""
    return setting_of(system).description
