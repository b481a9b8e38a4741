"""The latency model: one performance model per phase, shared by everything that predicts latency.

DistServe's model form (OSDI'24, ``simdistserve/estimators/time_estimator.py``):

* prefill batch: ``ms = a + b*sum(len) + c*sum(len^2)`` (linear layers + quadratic attention);
* decode step: ``ms = a + b*sum(context) + c*batch`` (weights read once per step, KV read per
  context token, per-sequence compute), with separate coefficients below and above a batch-size
  threshold.

Pipeline parallelism with ``pp`` stages runs each stage in ``1/pp`` of that time, so an engine
takes a new batch every stage time while one batch still needs the full time (DistServe's
``/pp`` rule). The coefficients come from three sources that all produce the same
:class:`LatencyModel`: a fit of measurements (``duet profile``), DistServe's published A100 fits,
or a roofline from GPU specs for hardware the profiler cannot reach. The simulator, the optimizer
and a later simulated engine only ever call :meth:`LatencyModel.engine`.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import yaml

from duet.cluster.placement.models import ModelSpec

Coeffs = tuple[float, float, float]


class LatencyModelError(ValueError):
    """A latency model that cannot answer: unknown model, unsupported parallelism, bad file."""


@dataclass(frozen=True)
class PrefillPerf:
    """Prefill batch latency of a whole (unpipelined) engine: ``a + b*sum(len) + c*sum(len^2)``."""

    coeffs: Coeffs

    def batch_ms(self, sum_len: float, sum_sq_len: float) -> float:
        a, b, c = self.coeffs
        return a + b * sum_len + c * sum_sq_len


@dataclass(frozen=True)
class DecodePerf:
    """Decode step latency: ``a + b*sum(context) + c*batch``, small/large-batch coefficients."""

    small: Coeffs
    large: Coeffs
    threshold: int

    def step_ms(self, batch: int, sum_context: float) -> float:
        a, b, c = self.small if batch < self.threshold else self.large
        return a + b * sum_context + c * batch


@dataclass(frozen=True)
class EncoderPerf:
    """A vision-language model's image encoder: a batch of images costs ``a + b*images`` ms,
    and each image adds ``tokens_per_image`` tokens to the prompt the language model computes.

    The encoder runs in whichever engine is given the image: a prefill or colocated engine's step
    (EP+D, colocated) or an encode worker's (E+P+D), where a prefill engine then reads its output
    instead. ``duet profile`` measures it on a vision model's engine."""

    coeffs: tuple[float, float]
    tokens_per_image: int

    def batch_ms(self, images: int) -> float:
        if images <= 0:
            return 0.0
        a, b = self.coeffs
        return a + b * images

    def to_dict(self) -> dict:
        return {"coeffs": list(self.coeffs), "tokens_per_image": self.tokens_per_image}

    @classmethod
    def from_dict(cls, data: dict) -> EncoderPerf:
        a, b = (float(x) for x in data["coeffs"])
        return cls((a, b), int(data["tokens_per_image"]))


@dataclass(frozen=True)
class EnginePerf:
    """What a predictor needs about one engine replica: its parallelism, phase models, KV room,
    and the image encoder it runs itself (None: a text model, or an engine whose images an
    encode pool encodes)."""

    tp: int
    pp: int
    prefill: PrefillPerf
    decode: DecodePerf
    kv_capacity_tokens: int
    encoder: EncoderPerf | None = None

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def prefill_latency_s(self, sum_len: float, sum_sq_len: float) -> float:
        """Time from batch start to first token (all pipeline stages)."""
        return self.prefill.batch_ms(sum_len, sum_sq_len) / 1000.0

    def prefill_stage_s(self, sum_len: float, sum_sq_len: float) -> float:
        """Time until the first stage is free for the next batch."""
        return self.prefill_latency_s(sum_len, sum_sq_len) / self.pp

    def decode_step_s(self, batch: int, sum_context: float) -> float:
        """Time of one token step for a micro-batch (one pipeline lane)."""
        return self.decode.step_ms(batch, sum_context) / 1000.0

    def encode_s(self, images: int) -> float:
        """Time this engine's encoder spends on ``images`` in one step (0 without an encoder)."""
        return self.encoder.batch_ms(images) / 1000.0 if self.encoder else 0.0

    def without_encoder(self) -> EnginePerf:
        """This engine with its images encoded elsewhere (a prefill engine behind an encode pool)."""
        return replace(self, encoder=None)


@dataclass(frozen=True)
class ServingPathCost:
    """CPU the serving path (router, the engines' front ends, Ray) spends on a CPU deployment's
    own cores, in the parts its mechanism has: each output message an engine sends is received,
    decoded and recorded (``ms_per_step``, one message per engine step when the deployment sends
    every step); each streamed token is detokenized and sent (``ms_per_token``); each request is
    admitted, routed, handed over and closed (``ms_per_request``, with the prefill engine's steps
    while its KV waits to be pulled); and Ray's daemons and the health pings take ``idle_cores``
    whatever the load. One more way a CPU host is shared: engines on cores of their own still
    slow each other through the caches and memory bandwidth they share, by ``corun_slowdown`` (a
    fraction) while two or more are busy. All 0 where the engines have devices of their own
    (GPUs). See duet.cluster.placement.simulator for how the simulator charges it,
    benchmarks/host_overhead.py for how the serving path is measured, and ``duet profile`` for
    ``corun_slowdown``.

    ``output_interval_ms`` is not a cost but how the deployment measured sends its messages
    (``PoolConfig.output_interval_ms``): an engine core holds a step's outputs until that long
    after its last message and merges them, except first tokens, which go at once. A decode
    engine whose steps are shorter than the interval therefore pays ``ms_per_step`` once per
    interval, not once per step.
    """

    ms_per_token: float = 0.0
    ms_per_step: float = 0.0
    ms_per_request: float = 0.0
    idle_cores: float = 0.0
    corun_slowdown: float = 0.0
    output_interval_ms: float = 0.0

    @property
    def free(self) -> bool:
        return not any(getattr(self, f) for f in _SERVING_PATH_COSTS)

    def step_cores(self, tokens: int, requests: int, step_s: float) -> float:
        """Cores the serving path needs while an engine runs steps of ``step_s`` that stream
        ``tokens`` and start ``requests`` each. A step that starts requests sends their first
        tokens at once; other steps' messages wait out the output interval, merged."""
        message_s = step_s if requests else max(step_s, self.output_interval_ms / 1000.0)
        per_message = self.ms_per_step * step_s / message_s
        ms = per_message + tokens * self.ms_per_token + requests * self.ms_per_request
        return ms / 1000.0 / step_s

    @staticmethod
    def heaviest(costs: Sequence[ServingPathCost]) -> ServingPathCost:
        """Each cost at its largest over ``costs``, and the shortest output interval (one router
        serves pools of several types)."""
        costs = list(costs)
        largest = {f: max((getattr(c, f) for c in costs), default=0.0) for f in _SERVING_PATH_COSTS}
        interval = min((c.output_interval_ms for c in costs), default=0.0)
        return ServingPathCost(**largest, output_interval_ms=interval)

    @classmethod
    def from_dict(cls, data: dict) -> ServingPathCost:
        return cls(**{key: float(data.get(key, 0.0)) for key in _SERVING_PATH_FIELDS})


_SERVING_PATH_FIELDS = tuple(f.name for f in fields(ServingPathCost))
_SERVING_PATH_COSTS = tuple(f for f in _SERVING_PATH_FIELDS if f != "output_interval_ms")


@dataclass(frozen=True)
class TpFit:
    """Coefficients for one tensor-parallel degree."""

    prefill: Coeffs
    decode_small: Coeffs
    decode_large: Coeffs
    decode_threshold: int


@dataclass(frozen=True)
class LatencyModel:
    """Per-TP fits for one model on one hardware type, plus KV capacity per (tp, pp)."""

    model: str
    hardware: str
    source: str
    kv_bytes_per_token: int
    fits: dict[int, TpFit]
    kv_capacity: dict[tuple[int, int], int] = field(default_factory=dict)
    # Used when kv_capacity has no entry: capacity = (tp*pp*gpu_memory - weights) / kv bytes.
    gpu_memory_bytes: float | None = None
    weight_bytes: float | None = None
    max_pp: int = 8
    note: str = ""
    # CPU the serving path spends on the engines' own processors (CPU deployments only).
    serving_path: ServingPathCost = ServingPathCost()
    # A vision-language model's image encoder (tensor_parallel=1), as measured; None: text only.
    encoder: EncoderPerf | None = None

    def kv_capacity_tokens(self, tp: int, pp: int) -> int:
        if (tp, pp) in self.kv_capacity:
            return self.kv_capacity[(tp, pp)]
        if self.gpu_memory_bytes is None or self.weight_bytes is None:
            return 0
        free = tp * pp * self.gpu_memory_bytes * 0.9 - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    def parallelisms(self, max_gpus: int | None = None) -> list[tuple[int, int]]:
        """Every (tp, pp) this model can run: fitted TP, pp a power of two up to max_pp, KV room."""
        pps = [p for p in (1, 2, 4, 8, 16) if p <= self.max_pp]
        return [
            (tp, pp)
            for tp, pp in itertools.product(sorted(self.fits), pps)
            if (max_gpus is None or tp * pp <= max_gpus) and self.kv_capacity_tokens(tp, pp) > 0
        ]

    def scaled(self, prefill: float, decode: float) -> LatencyModel:
        """This model with every prefill batch ``prefill`` times and every decode step ``decode``
        times as long: the same engine on a machine that now runs slower (or faster) than when it
        was profiled. ``benchmarks/speed_probe.py`` measures the factors on a running deployment;
        on a shared CPU host they drift by a quarter within minutes."""
        if prefill <= 0 or decode <= 0:
            raise LatencyModelError(f"speed factors must be > 0, got prefill={prefill}, decode={decode}")

        def times(coeffs: Coeffs, factor: float) -> Coeffs:
            a, b, c = coeffs
            return (a * factor, b * factor, c * factor)

        fits = {
            tp: replace(
                fit,
                prefill=times(fit.prefill, prefill),
                decode_small=times(fit.decode_small, decode),
                decode_large=times(fit.decode_large, decode),
            )
            for tp, fit in self.fits.items()
        }
        encoder = self.encoder and replace(self.encoder, coeffs=times((*self.encoder.coeffs, 0.0), prefill)[:2])
        return replace(self, fits=fits, encoder=encoder)

    def with_serving_path(self, cost: ServingPathCost) -> LatencyModel:
        """This model with a measured serving path; the profile's ``corun_slowdown`` is kept
        (the serving-path measurement cannot see it)."""
        return replace(self, serving_path=replace(cost, corun_slowdown=self.serving_path.corun_slowdown))

    def engine(self, tp: int, pp: int) -> EnginePerf:
        if tp not in self.fits:
            raise LatencyModelError(
                f"{self.model} on {self.hardware}: no latency fit for tensor_parallel={tp} "
                f"(fitted: {sorted(self.fits)})"
            )
        if pp > self.max_pp:
            raise LatencyModelError(
                f"{self.model} on {self.hardware}: pipeline_parallel={pp} exceeds {self.max_pp}"
            )
        capacity = self.kv_capacity_tokens(tp, pp)
        if capacity <= 0:
            raise LatencyModelError(
                f"{self.model} does not fit on {tp * pp} x {self.hardware} (tp={tp}, pp={pp})"
            )
        fit = self.fits[tp]
        return EnginePerf(
            tp=tp,
            pp=pp,
            prefill=PrefillPerf(fit.prefill),
            decode=DecodePerf(fit.decode_small, fit.decode_large, fit.decode_threshold),
            kv_capacity_tokens=capacity,
            encoder=self.encoder,
        )

    # ---- profile.yaml (the output of ``duet profile``) ----

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "source": self.source,
            "note": self.note,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_pp": self.max_pp,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "weight_bytes": self.weight_bytes,
            "serving_path": asdict(self.serving_path),
            **({"encoder": self.encoder.to_dict()} if self.encoder else {}),
            "fits": {
                tp: {
                    "prefill": list(f.prefill),
                    "decoding_smallbs": list(f.decode_small),
                    "decoding_largebs": list(f.decode_large),
                    "decoding_large_small_bs_threshold": f.decode_threshold,
                }
                for tp, f in sorted(self.fits.items())
            },
            "kv_capacity": [
                {"tp": tp, "pp": pp, "tokens": n} for (tp, pp), n in sorted(self.kv_capacity.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: dict, origin: str = "profile") -> LatencyModel:
        try:
            return cls(
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                source=str(data.get("source", origin)),
                note=str(data.get("note", "")),
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                max_pp=int(data.get("max_pp", 8)),
                gpu_memory_bytes=data.get("gpu_memory_bytes"),
                weight_bytes=data.get("weight_bytes"),
                # Profiles written before the serving path's cost had parts held one number.
                serving_path=ServingPathCost.from_dict(
                    data.get("serving_path") or {"ms_per_token": data.get("host_ms_per_token", 0.0)}
                ),
                encoder=EncoderPerf.from_dict(data["encoder"]) if data.get("encoder") else None,
                fits={int(tp): _tp_fit(f) for tp, f in data["fits"].items()},
                kv_capacity={
                    (int(e["tp"]), int(e["pp"])): int(e["tokens"])
                    for e in data.get("kv_capacity", [])
                },
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LatencyModelError(f"{origin}: not a duet latency profile ({exc!r})") from exc

    def save(self, path: Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: Path) -> LatencyModel:
        path = Path(path)
        if not path.exists():
            raise LatencyModelError(f"latency profile {path} does not exist")
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, origin=str(path))


def _tp_fit(entry: dict) -> TpFit:
    """One TP entry in DistServe's JSON layout (duet's profile.yaml uses the same keys)."""
    return TpFit(
        prefill=tuple(float(x) for x in entry["prefill"]),
        decode_small=tuple(float(x) for x in entry["decoding_smallbs"]),
        decode_large=tuple(float(x) for x in entry["decoding_largebs"]),
        decode_threshold=int(entry.get("decoding_large_small_bs_threshold", 95)),
    )


# ---- DistServe's published fits ----


def load_distserve_profile(
    json_path: Path, model: ModelSpec, max_num_tokens_csv: Path | None = None
) -> LatencyModel:
    """DistServe's A100-80G fits for ``model``; KV capacity from its ``max_num_tokens.csv``."""
    json_path = Path(json_path)
    try:
        data = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LatencyModelError(f"cannot read DistServe profile {json_path}: {exc}") from exc
    entry = next((v for k, v in data.items() if k.lower() == model.name.lower()), None)
    if entry is None:
        raise LatencyModelError(
            f"model {model.name!r} is not in {json_path.name} (it has: {', '.join(sorted(data))})"
        )
    capacity: dict[tuple[int, int], int] = {}
    if max_num_tokens_csv is not None and Path(max_num_tokens_csv).exists():
        with open(max_num_tokens_csv, newline="") as f:
            for row in csv.DictReader(f):
                if row["model"].lower() == model.name.lower():
                    capacity[(int(row["tp"]), int(row["pp"]))] = int(row["max_num_tokens"])
    engine = json_path.name.split(".")[-2]  # profiler-a100-80g.<engine>.json
    return LatencyModel(
        model=model.name,
        hardware="a100-80g",
        source=f"DistServe published fit ({engine} engine, {json_path.name})",
        kv_bytes_per_token=model.kv_bytes_per_token,
        fits={int(tp): _tp_fit(f) for tp, f in entry.items()},
        kv_capacity=capacity,
        gpu_memory_bytes=80 * 2**30,
        weight_bytes=model.weight_bytes,
    )


# ---- roofline for hardware that is not here ----


@dataclass(frozen=True)
class GpuPerfSpec:
    """The numbers a roofline needs: peak FLOP/s, memory bandwidth and size, TP link bandwidth."""

    name: str
    flops: float  # dense FLOP/s at the serving dtype
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    tp_link_bandwidth: float  # bytes/s per GPU for all-reduce (NVLink)
    compute_efficiency: float = 0.5  # achievable fraction of peak FLOP/s
    memory_efficiency: float = 0.8  # achievable fraction of peak bandwidth
    step_overhead_ms: float = 2.0  # kernel launch, scheduling: what a tiny batch still costs


def roofline_model(
    model: ModelSpec, gpu: GpuPerfSpec, tps: Sequence[int] = (1, 2, 4, 8)
) -> LatencyModel:
    """DistServe-form coefficients derived from FLOPs and bytes instead of measurements.

    Prefill is compute bound: ``b`` is the 2*params FLOPs per token plus the all-reduce of two
    activations per layer, ``c`` the causal attention FLOPs, ``a`` one read of the weights.
    Decode is memory bound: ``a`` reads the weights, ``b`` reads one token's KV, ``c`` is the
    per-sequence compute and all-reduce. Fitting a measured profile of the same GPU replaces this.
    """
    flops = gpu.flops * gpu.compute_efficiency
    bandwidth = gpu.memory_bandwidth * gpu.memory_efficiency
    fits = {}
    for tp in tps:
        allreduce_ms = (
            0.0
            if tp == 1
            else 1000 * 2 * model.layers * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp
            / gpu.tp_link_bandwidth
        )
        weights_ms = 1000 * model.weight_bytes / (tp * bandwidth)
        token_ms = 1000 * 2 * model.params / (tp * flops)
        attention_ms = 1000 * 2 * model.layers * model.hidden / (tp * flops)
        kv_read_ms = 1000 * model.kv_bytes_per_token / (tp * bandwidth)
        decode = (gpu.step_overhead_ms + weights_ms, kv_read_ms, token_ms + allreduce_ms)
        fits[tp] = TpFit(
            prefill=(gpu.step_overhead_ms + weights_ms, token_ms + allreduce_ms, attention_ms),
            decode_small=decode,
            decode_large=decode,
            decode_threshold=1 << 30,
        )
    return LatencyModel(
        model=model.name,
        hardware=gpu.name,
        source=f"roofline ({gpu.flops / 1e12:.0f} TFLOP/s, {gpu.memory_bandwidth / 1e9:.0f} GB/s)",
        kv_bytes_per_token=model.kv_bytes_per_token,
        fits=fits,
        gpu_memory_bytes=gpu.memory_bytes,
        weight_bytes=model.weight_bytes,
    )


# ---- fitting measurements ----


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with all coefficients >= 0, exact for the few columns used here.

    Latency cannot fall as load grows, so negative coefficients (which noise can produce) would
    make the simulator reward larger batches for nothing. With three columns, trying every subset
    of active columns is exact and cheap, and keeps scipy out of the dependencies.
    """
    n = x.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((x[:, cols] @ sol - y) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(n)
                best[list(cols)] = sol
    return best


def fit_relative(features: np.ndarray, latencies_ms: np.ndarray) -> Coeffs:
    """Fit ``latency = features @ coeffs`` minimising relative error, as DistServe does."""
    features = np.asarray(features, dtype=float)
    y = np.asarray(latencies_ms, dtype=float)
    if len(y) < features.shape[1]:
        raise LatencyModelError(f"need at least {features.shape[1]} samples to fit, got {len(y)}")
    weights = 1.0 / y
    coeffs = nonnegative_lstsq(features * weights[:, None], y * weights)
    return tuple(float(v) for v in coeffs)


def fit_prefill(samples: Sequence[tuple[Sequence[int], float]]) -> Coeffs:
    """Samples are (prompt lengths of one batch, batch latency ms)."""
    feats = np.array([[1.0, sum(lens), sum(n * n for n in lens)] for lens, _ in samples])
    return fit_relative(feats, np.array([ms for _, ms in samples]))


def fit_decode(
    samples: Sequence[tuple[int, float, float]],
) -> tuple[Coeffs, Coeffs, int]:
    """Samples are (batch, sum of context tokens, step ms); returns (small, large, threshold).

    The threshold is chosen among the measured batch sizes to minimise the total relative error
    of the two fits; with too few batch sizes for two fits, one fit serves both sides.
    """
    samples = list(samples)

    def fit(rows: list[tuple[int, float, float]]) -> tuple[Coeffs, float]:
        feats = np.array([[1.0, ctx, b] for b, ctx, _ in rows])
        y = np.array([ms for *_, ms in rows])
        coeffs = fit_relative(feats, y)
        return coeffs, float(np.sum(((feats @ np.array(coeffs)) - y) ** 2 / y**2))

    single, best_err = fit(samples)
    best = (single, single, 1 << 30)
    for threshold in sorted({b for b, _, _ in samples})[1:]:
        small = [s for s in samples if s[0] < threshold]
        large = [s for s in samples if s[0] >= threshold]
        if len({b for b, *_ in small}) < 2 or len({b for b, *_ in large}) < 2:
            continue
        (cs, es), (cl, el) = fit(small), fit(large)
        if es + el < best_err * 0.9:  # a split must earn its extra parameters
            best_err, best = es + el, (cs, cl, threshold)
    return best


def relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute relative error, for reporting a fit's quality."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(np.mean(np.abs(p - m) / m)) if len(m) else math.nan
