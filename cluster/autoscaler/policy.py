"""Autoscaling policies and SLO profiles: what the operator states, validated on load.

An SLO profile (``configs/slo/*.yaml``) is the latency a workload must keep: time to first token,
time per output token, and the share of requests that must meet both. An autoscaling policy
(``configs/autoscale/*.yaml``) names a profile (or states one inline), each pool's minimum and
maximum, the total budget, and how fast to react. Mistakes (an SLO of 0, a minimum above the
maximum, a budget below the minimums) are rejected at load with the field named, because an
autoscaler that starts with an impossible policy fails later as flapping or an idle cluster.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from duet.yaml_config import read_yaml, validate_mapping

CONFIGS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
SLO_DIR = CONFIGS_DIR / "slo"
POLICY_DIR = CONFIGS_DIR / "autoscale"
ROLES = ("prefill", "decode")


class PolicyError(ValueError):
    """A policy or SLO profile that cannot be used; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SloProfile(_Strict):
    ttft_s: float = Field(gt=0, description="time to first token target, seconds")
    tpot_s: float = Field(gt=0, description="time per output token target, seconds")
    attainment: float = Field(default=0.9, gt=0, le=1, description="share of requests meeting both")


class _Bounds(_Strict):
    """A pool's ``min`` and ``max`` workers (each subclass declares them), checked in order."""

    min: int
    max: int

    @model_validator(mode="after")
    def _min_below_max(self) -> _Bounds:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class PoolLimits(_Bounds):
    """Bounds on one pool, and the size of one worker in budget units (GPUs, or cores on CPU)."""

    min: int = Field(default=1, ge=1)
    """Fewest workers the autoscaler keeps in the pool."""
    max: int = Field(default=8, ge=1)
    """Most workers the autoscaler grows the pool to."""
    tensor_parallel: int = Field(default=1, ge=1)
    """Tensor-parallel size of each worker (a worker holds tensor_parallel x pipeline_parallel
    units)."""
    pipeline_parallel: int = Field(default=1, ge=1)
    """Pipeline-parallel size of each worker."""

    @property
    def units(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


class EncodeLimits(_Bounds):
    """Bounds on the encode pool (E+P+D, a vision-language model's image encoders), sized by
    how many encodes are in flight rather than by the SLO's latency model
    (cluster/autoscaler/encode_pool.py)."""

    min: int = Field(default=0, ge=0)
    """Fewest encode workers (0: the prefill engines encode while images are rare)."""
    max: int = Field(default=4, ge=0)
    """Most encode workers."""
    in_flight_per_worker: float = Field(default=1.0, gt=0)
    """Encode requests in flight (on average over an interval) that one encode worker is sized for."""


class ScaleDown(_Strict):
    """Scale-down is slow on purpose: a worker removed in a lull must be restarted (minutes on
    a GPU) when the next burst comes, and every removal drains first."""

    delay_s: float = Field(default=300.0, ge=0)
    """How far back the pools' reserve looks (the load must stay low this long before the pool
    comes down) and how long sizes that observed misses asked for are kept."""
    step: int = Field(default=1, ge=1)
    """Workers removed from a pool per decision."""


class AutoscalePolicy(_Strict):
    slo: str | SloProfile = Field(default="chat", description="a profile under configs/slo, or the targets")
    interval_s: float = Field(default=10.0, gt=0, description="seconds between decisions")
    latency_model: str | None = "distserve:opt-13b"
    """Predictive sizing from a latency model: "distserve:MODEL" (DistServe's A100 profiles) or the
    path of a `duet profile` output. None: reactive correction only."""
    prefill: PoolLimits = PoolLimits()
    """Bounds on the prefill pool."""
    decode: PoolLimits = PoolLimits()
    """Bounds on the decode pool."""
    encode: EncodeLimits = EncodeLimits()
    """Bounds on the encode pool, for a model that has one (E+P+D)."""
    budget: int | None = Field(default=None, ge=1)
    """Total units (GPUs, or cores on CPU) both pools may hold, starting workers included."""
    headroom: float = Field(default=0.8, gt=0, le=1)
    """Capacity is planned at this share of what the latency model says a worker sustains."""
    startup_s: float = Field(default=60.0, ge=0)
    """How long a new worker takes to serve; the forecast looks this far ahead."""
    settle_s: float = Field(default=30.0, ge=0)
    """After a pool gains a worker, its SLO shortfall is given this long to clear before the
    reactive correction asks for another."""
    error_budget_window_s: float = Field(default=3600.0, ge=0)
    """Attainment is judged per period of this length; each interval is planned for the misses the
    rest of the period still allows (cluster/autoscaler/error_budget.py). 0 plans every interval
    for the target itself."""
    stale_after_s: float = Field(default=30.0, gt=0)
    """Metrics older than this (or missing) freeze every pool at its current size."""
    forecast_window_s: float = Field(default=60.0, gt=0)
    """The forecast never falls below the mean arrival rate of this long a window."""
    scale_down: ScaleDown = ScaleDown()
    """How fast pools come down."""

    @model_validator(mode="after")
    def _budget_covers_minimums(self) -> AutoscalePolicy:
        if self.budget is not None:
            floor = sum(self.limits(role).min * self.limits(role).units for role in ROLES) + self.encode.min
            if self.budget < floor:
                raise ValueError(f"budget ({self.budget}) is below what the pools' minimums hold ({floor})")
        return self

    def limits(self, role: str) -> PoolLimits:
        return self.prefill if role == "prefill" else self.decode

    def slo_profile(self) -> SloProfile:
        return self.slo if isinstance(self.slo, SloProfile) else load_slo(self.slo)


def load_slo(name_or_path: str) -> SloProfile:
    """An SLO profile by name (``chat``, ``code``, ``summarization``) or YAML path."""
    path = _resolve(name_or_path, SLO_DIR, "SLO profile")
    return validate_mapping(SloProfile, read_yaml(path, "SLO profile", PolicyError), str(path), PolicyError)


def load_policy(name_or_path: str) -> AutoscalePolicy:
    """An autoscaling policy by name (a file under configs/autoscale) or YAML path, with its SLO
    profile resolved, so a misspelt profile fails here too."""
    path = _resolve(name_or_path, POLICY_DIR, "autoscaling policy")
    policy = validate_mapping(AutoscalePolicy, read_yaml(path, "autoscaling policy", PolicyError), str(path), PolicyError)
    try:
        policy.slo_profile()
    except PolicyError as error:
        raise PolicyError(f"{path} is invalid:\n  slo: {error}") from None
    return policy


def _resolve(name_or_path: str, directory: Path, what: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml"):
        return path
    named = directory / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
    raise PolicyError(f"no {what} named {name_or_path!r} (known: {known}; or give a .yaml path)")
