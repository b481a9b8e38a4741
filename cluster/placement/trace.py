"""Request traces: the Azure and Mooncake files in ../shared/traces, and synthetic arrivals.

A trace is arrival times plus input and output lengths, and for a vision-language model the
images each request carries (:meth:`Trace.with_images`); nothing else drives the simulator. The
optimizer's rate bisection replays one trace at many rates: :meth:`Trace.at_rate` rescales the
arrival times, which keeps a real trace's burstiness (and a synthetic one's random draws) fixed
while the load changes, so two probes differ only in the rate.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace that cannot drive a simulation: unreadable, malformed or empty."""


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival; times in seconds from the first arrival."""

    name: str
    arrival_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    # Images per request (None: text only); ``input_len`` then counts their tokens too.
    images: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.arrival_s) == 0:
            raise TraceError(f"trace {self.name!r} has no requests: nothing to simulate or plan for")
        columns = (self.arrival_s, self.input_len, self.output_len, *(() if self.images is None else (self.images,)))
        if len({len(column) for column in columns}) != 1:
            raise TraceError(f"trace {self.name!r}: column lengths differ")
        if np.any(self.input_len < 1) or np.any(self.output_len < 1):
            raise TraceError(f"trace {self.name!r}: every request needs >= 1 input and output token")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0])

    @property
    def mean_rate(self) -> float:
        """(n-1)/duration, as the traces README defines it; inf for a single burst."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else math.inf

    def at_rate(self, rate: float) -> Trace:
        """The same requests with arrival times scaled to a mean rate of ``rate`` req/s."""
        if rate <= 0:
            raise TraceError(f"rate must be > 0, got {rate}")
        if not math.isfinite(self.mean_rate):
            return self
        return self._replace(arrival_s=(self.arrival_s - self.arrival_s[0]) * (self.mean_rate / rate))

    def head(self, n: int) -> Trace:
        return self.window(0, n)

    def window(self, start: int, n: int) -> Trace:
        """Requests ``start`` to ``start + n`` (a slice of the trace, with its own arrival times)."""
        end = start + n
        return self._replace(
            arrival_s=self.arrival_s[start:end], input_len=self.input_len[start:end], output_len=self.output_len[start:end],
            images=None if self.images is None else self.images[start:end],
        )

    @property
    def has_images(self) -> bool:
        return self.images is not None and bool(self.images.any())

    def with_images(self, counts: np.ndarray, tokens_per_image: int) -> Trace:
        """The same requests, request ``i`` carrying ``counts[i]`` images, each of
        ``tokens_per_image`` prompt tokens for the language model (the trace's lengths are its
        text's)."""
        counts = np.asarray(counts, dtype=np.int64)
        if len(counts) != len(self) or np.any(counts < 0):
            raise TraceError(f"trace {self.name!r}: need one image count >= 0 per request ({len(self)})")
        return self._replace(input_len=self.input_len + counts * tokens_per_image, images=counts)

    def capped(self, max_input: int | None = None, max_output: int | None = None) -> Trace:
        """Lengths clipped, for a model whose context is shorter than the trace's prompts."""
        return self._replace(
            input_len=np.minimum(self.input_len, max_input or np.iinfo(np.int64).max),
            output_len=np.minimum(self.output_len, max_output or np.iinfo(np.int64).max),
        )

    def _replace(self, **changes: np.ndarray) -> Trace:
        fields = {
            "name": self.name,
            "arrival_s": self.arrival_s,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "images": self.images,
        }
        return Trace(**(fields | changes))


def _make(name: str, arrivals: Sequence[float], inputs: Sequence[int], outputs: Sequence[int]) -> Trace:
    arr = np.asarray(arrivals, dtype=float)
    if not np.isfinite(arr).all():
        raise TraceError(f"{name}: request {int(np.argmin(np.isfinite(arr)))} has no finite arrival time")
    for what, values in (("input", inputs), ("output", outputs)):
        if any(not 0 <= value < MAX_LENGTH for value in values):
            raise TraceError(f"{name}: a request's {what} length is outside 0..{MAX_LENGTH - 1}")
    order = np.argsort(arr, kind="stable")
    start = arr[order][0] if len(arr) else 0.0
    return Trace(
        name=name,
        arrival_s=arr[order] - start,
        input_len=np.asarray(inputs, dtype=np.int64)[order],
        output_len=np.asarray(outputs, dtype=np.int64)[order],
    )


# Tokens in one request's prompt or output: far above any model's context, inside int64.
MAX_LENGTH = 2**31


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A file that is not text, or not CSV, is a bad trace, not a traceback."""
    try:
        yield
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"{path}: cannot read it as a trace ({exc})") from None


def load_azure_csv(path: Path) -> Trace:
    """Azure LLM inference trace: ``TIMESTAMP,ContextTokens,GeneratedTokens``."""
    arrivals, inputs, outputs = [], [], []
    with _reading(path), open(path, newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), start=2):
            try:
                # Seven fractional digits: datetime takes six.
                stamp = row["TIMESTAMP"][:26]
                arrivals.append(datetime.fromisoformat(stamp).timestamp())
                inputs.append(int(row["ContextTokens"]))
                outputs.append(int(row["GeneratedTokens"]))
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise TraceError(f"{path}:{lineno}: not an Azure trace row ({exc})") from exc
    return _make(Path(path).name, arrivals, inputs, outputs)


def load_mooncake_jsonl(path: Path) -> Trace:
    """Mooncake FAST'25 trace: ``timestamp`` (ms), ``input_length``, ``output_length``."""
    arrivals, inputs, outputs = [], [], []
    with _reading(path), open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                arrivals.append(float(row["timestamp"]) / 1000.0)
                inputs.append(int(row["input_length"]))
                outputs.append(int(row["output_length"]))
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                raise TraceError(f"{path}:{lineno}: not a Mooncake trace row ({exc})") from exc
    return _make(Path(path).name, arrivals, inputs, outputs)


# ---- synthetic workloads ----


def sharegpt_like_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Chatbot lengths shaped like DistServe's ShareGPT preprocessing (see docs/concepts/placement.md).

    Long-tailed (lognormal) prompts around a mean of ~750 tokens and outputs around ~200, with
    DistServe's filters applied: prompt + output < 2048 and at least 4 tokens each. The means
    approximate DistServe's reported ShareGPT statistics; the lognormal shape is an assumption,
    since the preprocessed dataset is not published.
    """
    inputs, outputs = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    while len(inputs) < n:
        i = rng.lognormal(mean=math.log(750) - 0.5, sigma=1.0, size=2 * n).astype(np.int64)
        o = rng.lognormal(mean=math.log(200) - 0.5, sigma=1.0, size=2 * n).astype(np.int64)
        keep = (i >= 4) & (o >= 4) & (i + o < 2048)
        inputs, outputs = np.concatenate([inputs, i[keep]]), np.concatenate([outputs, o[keep]])
    return inputs[:n], outputs[:n]


def arrivals(n: int, rate: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Gamma inter-arrival times with coefficient of variation ``cv`` (cv=1 is Poisson)."""
    if not (0 < rate < math.inf and 0.01 <= cv <= 100):
        raise TraceError(f"synthetic arrivals need a finite rate > 0 and 0.01 <= cv <= 100 (got rate={rate}, cv={cv})")
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def synthetic(
    n: int,
    rate: float,
    lengths: str = "sharegpt",
    cv: float = 1.0,
    seed: int = 0,
) -> Trace:
    """``lengths`` is ``sharegpt``, ``fixed:IN:OUT`` or ``uniform:IN_MAX:OUT_MAX``."""
    if n < 1:
        raise TraceError("a synthetic trace needs n >= 1 requests")
    rng = np.random.default_rng(seed)
    kind, *args = lengths.split(":")
    try:
        if kind == "sharegpt" and not args:
            inputs, outputs = sharegpt_like_lengths(n, rng)
        elif kind == "fixed" and len(args) == 2:
            inputs, outputs = np.full(n, int(args[0])), np.full(n, int(args[1]))
        elif kind == "uniform" and len(args) == 2:
            inputs = rng.integers(1, int(args[0]) + 1, size=n)
            outputs = rng.integers(1, int(args[1]) + 1, size=n)
        else:
            raise ValueError(lengths)
        if min(inputs.min(), outputs.min()) < 1:
            raise ValueError(lengths)
    except ValueError:
        raise TraceError(
            f"bad length distribution {lengths!r}: use sharegpt, fixed:IN:OUT or uniform:IN:OUT (lengths >= 1)"
        ) from None
    arrival_kind = "poisson" if cv == 1.0 else f"gamma-cv{cv:g}"
    return _make(f"synthetic-{kind}-{arrival_kind}", arrivals(n, rate, rng, cv), inputs, outputs)


# Images per request, as (count, share of requests): ``vqa`` is a visual-question-answering mix
# (a third of a chat's turns carry no image, most carry one, some two), an assumption stated in
# docs/concepts/images.md rather than a measured public mix.
IMAGE_MIXES: dict[str, tuple[tuple[int, float], ...]] = {"vqa": ((0, 0.3), (1, 0.5), (2, 0.2))}


def image_mix(spec: str) -> tuple[tuple[int, float], ...]:
    """``vqa``, ``N`` (every request N images) or ``COUNT:SHARE,...`` (shares summing to 1)."""
    spec = spec.strip()
    if spec in IMAGE_MIXES:
        return IMAGE_MIXES[spec]
    try:
        items = [item.partition(":") for item in spec.split(",")] if ":" in spec else [(spec, ":", "1")]
        mix = tuple((int(count), float(share)) for count, _, share in items)
    except ValueError:
        mix = ()
    if not mix or any(count < 0 or share < 0 for count, share in mix) or abs(sum(s for _, s in mix) - 1) > 1e-6:
        raise TraceError(f"--images {spec!r}: use {', '.join(IMAGE_MIXES)}, a count N, or COUNT:SHARE,... with shares summing to 1")
    return mix


def image_counts(spec: str, n: int, seed: int = 0) -> np.ndarray:
    """Images for each of ``n`` requests drawn from the mix ``spec`` (:func:`image_mix`), seeded."""
    mix = image_mix(spec)
    if len(mix) == 1:
        return np.full(n, mix[0][0], dtype=np.int64)
    counts, shares = zip(*mix)
    p = np.array(shares) / sum(shares)  # within 1e-6 of 1 (image_mix): numpy asks for closer
    return np.random.default_rng(seed).choice(np.array(counts, dtype=np.int64), size=n, p=p)


def load_trace(spec: str) -> Trace:
    """A trace from a command-line spec.

    ``path.csv`` (Azure), ``path.jsonl`` (Mooncake), or
    ``synthetic:n=500,rate=4,lengths=sharegpt,cv=1,seed=0`` (Poisson when cv=1, else Gamma).
    """
    if spec.startswith("synthetic"):
        params: dict[str, str] = {}
        body = spec.partition(":")[2]
        for item in filter(None, body.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise TraceError(f"synthetic trace parameter {item!r} is not key=value")
            params[key.strip()] = value.strip()
        unknown = set(params) - {"n", "rate", "lengths", "cv", "seed", "arrival"}
        if unknown:
            raise TraceError(f"unknown synthetic trace parameters: {', '.join(sorted(unknown))}")
        try:
            cv = float(params.get("cv", 1.0))
            if params.get("arrival", "poisson" if cv == 1.0 else "gamma") == "poisson":
                cv = 1.0
            return synthetic(
                n=int(params.get("n", 500)),
                rate=float(params.get("rate", 1.0)),
                lengths=params.get("lengths", "sharegpt"),
                cv=cv,
                seed=int(params.get("seed", 0)),
            )
        except ValueError as exc:
            raise TraceError(f"bad synthetic trace spec {spec!r}: {exc}") from exc
    path = Path(spec)
    if not path.exists():
        raise TraceError(f"trace file {path} does not exist")
    if path.suffix == ".csv":
        return load_azure_csv(path)
    if path.suffix == ".jsonl":
        return load_mooncake_jsonl(path)
    raise TraceError(f"trace {path}: unknown format (expected .csv Azure or .jsonl Mooncake)")
