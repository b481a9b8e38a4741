"""Discrete-event simulation of disaggregated, conditional and colocated deployments.

Disaggregated: a request queues at the prefill replica with the least queued work, is prefilled
in an FCFS batch (token budget), produces its first token (TTFT), reserves KV room at the
decode replica with the least reserved KV, has its KV pulled over that replica's link (FIFO,
``bytes / bandwidth``), then joins continuous batching; each step costs one decode-model step.
Pipeline parallelism: a prefill replica takes a new batch every stage time; a decode replica runs
``pp`` micro-batch lanes. TPOT is ``(finish - first token) / (output - 1)``, so transfer time
counts against TPOT, as in DistServe.

Colocated: vLLM without chunked prefill, as DistServe's baseline: waiting prefills run first,
and every decode in the engine stalls while they do. That stall is the interference that
disaggregation removes.

Conditional: prompts shorter than a threshold are prefilled by the decode replica itself, as
colocated; longer ones go through the prefill pool and their KV is pulled, as disaggregated.

Images (a trace :meth:`~duet.cluster.placement.trace.Trace.with_images`): an engine with an
encoder (:class:`~duet.cluster.placement.latency_model.EncoderPerf`) encodes the images of the
prompts it starts in the same step, before their prefill (EP+D and colocated: the encoder stalls
that engine's other work). With an encode pool (E+P+D), a request with images first queues at the
encode worker with the fewest images queued, which encodes every queued request's images in one
step (up to its token budget); its prefill engine then starts with the images' outputs and does
no encoder work. Prompts a decode replica prefills itself are encoded there, as duet's router
sends only the prefill pool's prompts through the encode step.

All latencies come from :class:`~duet.cluster.placement.latency_model.EnginePerf`. With an SLO
given, a run stops as soon as more requests have missed it than the attainment target allows:
the optimizer only needs to know that a rate is too high, not by how much.

Serving-path CPU (:class:`ServingPathCost`, CPU deployments only): the router, the engines'
front ends and Ray run on the engines' own processors, unpinned, so the operating system gives
them whatever cores the engines leave idle and shares the rest fairly. Engine work (prefill
batches, decode steps) is therefore scheduled in *engine time*, which runs at a speed ``s`` of
wall time: with ``b`` engines busy, ``P`` processors and the serving path needing ``x`` cores
for the engines' work at full speed (per output message, token and request of the batches
running; a decode engine sends one message per step or per output interval, whichever is
longer) plus its load-independent ``idle_cores``, ``s = min(1, (P - idle) / (b + x))``: an
idle engine's core absorbs the serving path, and only when every core is wanted do the engines
slow. While two or more engines are busy, each also runs ``1 + corun_slowdown`` times slower:
they share the host's caches and memory bandwidth (measured by ``duet profile``). (Not modelled: a
serving path that needs more than the one core its event loop can use; with its cost per step
shared by the whole batch, that takes far more tokens per second than these engines produce.)
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from duet.cluster.placement.latency_model import EnginePerf, ServingPathCost
from duet.cluster.placement.trace import Trace


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO targets must be > 0 (ttft={self.ttft_s}, tpot={self.tpot_s})")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")

    def only_ttft(self) -> Slo:
        return Slo(self.ttft_s, math.inf, self.attainment)

    def only_tpot(self) -> Slo:
        return Slo(math.inf, self.tpot_s, self.attainment)


@dataclass(frozen=True)
class SimConfig:
    """Engine scheduler limits (vLLM's ``max_num_batched_tokens`` and ``max_num_seqs``), and
    whether a prefill engine chunks prompts (vLLM's v1 scheduler does, always): each step then
    fills its token budget in arrival order, the last prompt possibly only in part, and the rest
    of that prompt runs first in the next step. Without it, a step takes whole prompts while the
    next one fits (DistServe's batching)."""

    prefill_max_batch_tokens: int = 16384
    max_num_seqs: int = 256
    chunked_prefill: bool = False


@dataclass(frozen=True)
class SimResult:
    """Per-request TTFT and TPOT in seconds; inf where a request did not finish."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    stopped_early: bool
    # Seconds from arrival until an encode pool had encoded the request's images (0 where no
    # pool encoded any; inf where it never did).
    encode_wait_s: np.ndarray | None = None

    def attainment(self, slo: Slo) -> float:
        """Fraction of requests meeting both targets (a lower bound if the run stopped early)."""
        return float(np.mean((self.ttft_s <= slo.ttft_s) & (self.tpot_s <= slo.tpot_s)))

    def meets(self, slo: Slo) -> bool:
        return not self.stopped_early and self.attainment(slo) >= slo.attainment

    def summary(self, slo: Slo) -> dict[str, float]:
        def pct(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if len(values) else math.nan

        return {
            "requests": len(self.ttft_s),
            "attainment": self.attainment(slo),
            "ttft_attainment": float(np.mean(self.ttft_s <= slo.ttft_s)),
            "tpot_attainment": float(np.mean(self.tpot_s <= slo.tpot_s)),
            **{f"ttft_p{q}_s": pct(self.ttft_s, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_s": pct(self.tpot_s, q) for q in (50, 90, 99)},
        }


class _Run:
    """Event loop plus per-request outcomes; raises nothing, stops when the SLO is lost."""

    def __init__(
        self, trace: Trace, slo: Slo | None, serving_path: ServingPathCost = ServingPathCost(), processors: int = 1
    ) -> None:
        self.arrival = trace.arrival_s.tolist()
        self.inp = trace.input_len.tolist()
        self.out = trace.output_len.tolist()
        n = len(self.arrival)
        self.images = trace.images.tolist() if trace.images is not None else [0] * n
        self.encoded = list(self.arrival)  # when an encode pool finished the request's images
        self.first_token = [math.inf] * n
        self.finish = [math.inf] * n
        self.slo = slo
        self.missed = [False] * n
        self.misses = 0
        self.allowed_misses = math.floor((1 - slo.attainment) * n + 1e-9) if slo else n
        self.stopped = False
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        # Engine time (see the module docstring): engine events wait in their own heap, keyed
        # by engine time; the clock is anchored at the last change of speed.
        self._engine_heap: list[tuple[float, int, Callable, tuple]] = []
        self.serving_path = serving_path
        self._processors = max(processors, 1)
        self._busy: dict[object, float] = {}  # engine -> serving-path cores its work needs
        self._speed = 1.0
        self._anchor_wall = self._anchor_engine = 0.0

    def at(self, time: float, fn: Callable, *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, fn, args))

    def after_work(self, seconds: float, fn: Callable, *args: object) -> None:
        """Call ``fn`` once an engine has done ``seconds`` of work from now (engine time)."""
        self.at_engine(self.engine_now() + seconds, fn, *args)

    def at_engine(self, engine_time: float, fn: Callable, *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._engine_heap, (engine_time, self._seq, fn, args))

    def engine_now(self) -> float:
        return self._anchor_engine + (self.now - self._anchor_wall) * self._speed

    def _wall(self, engine_time: float) -> float:
        return self._anchor_wall + (engine_time - self._anchor_engine) / self._speed

    def engine_busy(self, engine: object, serving_path_cores: float) -> None:
        """``engine`` is now running work that needs this many serving-path cores at full speed."""
        self._set_load(engine, serving_path_cores)

    def engine_idle(self, engine: object) -> None:
        self._set_load(engine, None)

    def _set_load(self, engine: object, cores: float | None) -> None:
        if self.serving_path.free or self._busy.get(engine) == cores:
            return
        self._anchor_engine, self._anchor_wall = self.engine_now(), self.now
        if cores is None:
            self._busy.pop(engine, None)
        else:
            self._busy[engine] = cores
        self._speed = self._speed_now()

    def _speed_now(self) -> float:
        """See the module docstring: idle engines' cores first, a fair share of the rest."""
        if not self._busy:
            return 1.0
        demand = sum(self._busy.values())
        spare = max(self._processors - self.serving_path.idle_cores, 1e-3)
        speed = min(1.0, spare / (len(self._busy) + demand))
        if len(self._busy) > 1:  # engines side by side share caches and memory bandwidth
            speed /= 1.0 + self.serving_path.corun_slowdown
        return speed

    def run(self) -> SimResult:
        heap, engine_heap = self._heap, self._engine_heap
        while not self.stopped:
            if engine_heap and (
                not heap or (self._wall(engine_heap[0][0]), engine_heap[0][1]) < heap[0][:2]
            ):
                engine_time, _, fn, args = heapq.heappop(engine_heap)
                self.now = max(self.now, self._wall(engine_time))  # never back, despite rounding
            elif heap:
                self.now, _, fn, args = heapq.heappop(heap)
            else:
                break
            fn(*args)
        first = np.array(self.first_token)
        finish = np.array(self.finish)
        out = np.array(self.out)
        with np.errstate(invalid="ignore"):
            tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
        tpot = np.where(np.isfinite(finish), tpot, math.inf)
        arrival = np.array(self.arrival)
        ttft = first - arrival
        return SimResult(ttft_s=ttft, tpot_s=tpot, stopped_early=self.stopped, encode_wait_s=np.array(self.encoded) - arrival)

    def _miss(self, i: int) -> None:
        if not self.missed[i]:
            self.missed[i] = True
            self.misses += 1
            if self.misses > self.allowed_misses:
                self.stopped = True

    def first_token_at(self, i: int) -> None:
        self.first_token[i] = self.now
        if self.slo and self.now - self.arrival[i] > self.slo.ttft_s:
            self._miss(i)
        if self.out[i] <= 1:
            self.finish[i] = self.now

    def finished(self, i: int) -> None:
        self.finish[i] = self.now
        if self.slo and (self.now - self.first_token[i]) / (self.out[i] - 1) > self.slo.tpot_s:
            self._miss(i)

    def never(self, i: int) -> None:
        """A request that can never run (needs more KV than the engine has)."""
        self._miss(i)


class _DecodeLoop:
    """Continuous batching of one decode loop, advanced in closed form between finishes.

    With a fixed batch, step ``k`` costs ``A + k*B`` (context grows by one token per sequence
    per step), so a run of steps up to the next finish is one event. A request that wants to
    join mid-run interrupts the run at the next step boundary, exactly where a step-by-step
    loop would have admitted it. Steps are timed in engine time (see :meth:`_Run.engine_busy`).
    """

    def __init__(self, run: _Run, perf: EnginePerf, on_boundary: Callable[[list[int]], None]):
        self.run, self.perf, self.on_boundary = run, perf, on_boundary
        self.size = 0
        self.sum_context = 0
        self.step_no = 0
        self._finishing: dict[int, list[int]] = {}
        self._finish_steps: list[int] = []
        self.running = False
        self._epoch = 0
        self._t0 = self._a = self._b = 0.0
        self._planned = 0

    def add(self, i: int) -> None:
        """Join with the first token already produced; ``out - 1`` steps to go."""
        run = self.run
        step = self.step_no + run.out[i] - 1
        if step not in self._finishing:
            self._finishing[step] = []
            heapq.heappush(self._finish_steps, step)
        self._finishing[step].append(i)
        self.size += 1
        self.sum_context += run.inp[i] + 1

    def start(self) -> None:
        """Run steps until the next finish (the batch must not be empty)."""
        n, ctx = self.size, self.sum_context
        self._a = self.perf.decode_step_s(n, ctx)
        self._b = self.perf.decode_step_s(n, ctx + n) - self._a
        self._t0 = self.run.engine_now()
        self._planned = self._finish_steps[0] - self.step_no
        # The serving path follows the run's first step: a run lasts only until the next join
        # or finish, and the context growth over it changes the step time little.
        self.run.engine_busy(self, self.run.serving_path.step_cores(n, 0, self._a))
        self._schedule(self._planned)

    def interrupt(self) -> None:
        """End the current run at the next step boundary (someone is waiting to join)."""
        if not self.running:
            return
        done = self._steps_done_by(self.run.engine_now())
        if done + 1 < self._planned:
            self._schedule(done + 1)

    def _end(self, k: int) -> float:
        return self._t0 + k * self._a + self._b * k * (k - 1) / 2

    def _steps_done_by(self, t: float) -> int:
        elapsed, a, b = t - self._t0, self._a, self._b
        if b > 0:
            k = int((-(a - b / 2) + math.sqrt((a - b / 2) ** 2 + 2 * b * elapsed)) / b)
        else:
            k = int(elapsed / a)
        while k > 0 and self._end(k) > t:
            k -= 1
        while self._end(k + 1) <= t:
            k += 1
        return k

    def _schedule(self, k: int) -> None:
        self.running = True
        self._epoch += 1
        self.run.at_engine(self._end(k), self._fire, self._epoch, k)

    def _fire(self, epoch: int, k: int) -> None:
        if epoch != self._epoch:
            return
        self.running = False
        self.run.engine_idle(self)
        self.step_no += k
        self.sum_context += self.size * k
        done: list[int] = []
        if self._finish_steps and self._finish_steps[0] == self.step_no:
            heapq.heappop(self._finish_steps)
            done = self._finishing.pop(self.step_no)
            for i in done:
                self.size -= 1
                self.sum_context -= self.run.inp[i] + self.run.out[i]
                self.run.finished(i)
        self.on_boundary(done)


def _kv_need(run: _Run, i: int) -> int:
    return run.inp[i] + run.out[i]


class _PrefillServer:
    def __init__(self, run: _Run, perf: EnginePerf, cfg: SimConfig, done: Callable[[int], None]):
        self.run, self.perf, self.done = run, perf, done
        self.max_tokens = min(cfg.prefill_max_batch_tokens, perf.kv_capacity_tokens)
        self.chunked = cfg.chunked_prefill
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.busy = False
        # Prompt tokens already computed of the prompt at the head of the queue (chunked only).
        self._head_done = 0

    def submit(self, i: int) -> None:
        self.queue.append(i)
        self.queued_tokens += self.run.inp[i]
        if not self.busy:
            self._start()

    def _next_step(self) -> list[tuple[int, int, int]]:
        """The next step's chunks, ``(request, offset, tokens)``, in arrival order."""
        run, budget, chunks = self.run, self.max_tokens, []
        for i in self.queue:
            offset = self._head_done if not chunks else 0
            left = run.inp[i] - offset
            if chunks and not self.chunked and left > budget:
                break
            tokens = min(left, budget) if self.chunked else left
            chunks.append((i, offset, tokens))
            budget -= tokens
            if budget <= 0:
                break
        return chunks

    def _start(self) -> None:
        run = self.run
        chunks = self._next_step()
        if not chunks:
            self.busy = False
            run.engine_idle(self)
            return
        self.busy = True
        # A chunk of t tokens after o computed ones attends to o + t: its share of a whole
        # prompt's quadratic term is 2*o*t + t*t (the chunks of one prompt sum to its len^2).
        total = sum(t for _, _, t in chunks)
        sq = sum(2 * o * t + t * t for _, o, t in chunks)
        # A prompt's images are encoded in the step that starts it (none where a pool encoded them).
        images = sum(run.images[i] for i, o, _ in chunks if o == 0)
        latency = self.perf.prefill_latency_s(total, sq) + self.perf.encode_s(images)
        finishing = sum(1 for i, o, t in chunks if o + t == run.inp[i])
        # One step's message, a first token and a request's admission and hand-over per prompt.
        run.engine_busy(self, run.serving_path.step_cores(finishing, finishing, latency))
        if self.chunked:  # the next step may continue this one's last prompt: no overlap
            run.after_work(latency, self._finish, chunks, total)
        else:
            for _ in chunks:
                self.queue.popleft()
            run.after_work(latency / self.perf.pp, self._start)
            run.after_work(latency, self._finish, chunks, total)

    def _finish(self, chunks: list[tuple[int, int, int]], total: int) -> None:
        self.queued_tokens -= total
        for i, offset, tokens in chunks:
            if self.chunked:
                if offset + tokens < self.run.inp[i]:
                    self._head_done = offset + tokens
                    continue
                self.queue.popleft()
                self._head_done = 0
            self.run.first_token_at(i)
            if self.run.out[i] > 1:
                self.done(i)
        if self.chunked:
            self._start()


class _EncodeServer:
    """An encode worker (E+P+D): each step encodes the images of the requests queued, in arrival
    order up to the token budget (at least one request), and hands each request on to prefill."""

    def __init__(self, run: _Run, perf: EnginePerf, cfg: SimConfig, done: Callable[[int], None]):
        assert perf.encoder is not None, "an encode worker needs the model's encoder"
        self.run, self.perf, self.done = run, perf, done
        self.max_images = max(1, cfg.prefill_max_batch_tokens // max(perf.encoder.tokens_per_image, 1))
        self.queue: deque[int] = deque()
        self.queued_images = 0
        self.busy = False

    def submit(self, i: int) -> None:
        self.run.encoded[i] = math.inf
        self.queue.append(i)
        self.queued_images += self.run.images[i]
        if not self.busy:
            self._start()

    def _start(self) -> None:
        run = self.run
        if not self.queue:
            self.busy = False
            run.engine_idle(self)
            return
        self.busy = True
        batch = [self.queue.popleft()]
        images = run.images[batch[0]]
        while self.queue and images + run.images[self.queue[0]] <= self.max_images:
            batch.append(self.queue.popleft())
            images += run.images[batch[-1]]
        latency = self.perf.encode_s(images)
        run.engine_busy(self, run.serving_path.step_cores(0, 0, latency))
        run.after_work(latency, self._finish, batch, images)

    def _finish(self, batch: list[int], images: int) -> None:
        self.queued_images -= images
        for i in batch:
            self.run.encoded[i] = self.run.now
            self.done(i)
        self._start()


def _to_prefill(run: _Run, prefillers: Sequence[_PrefillServer], to_decode: Callable[[int], None]) -> Callable[[int], None]:
    """A request's way to the prefill replica with the least queued tokens; with no prefill pool
    simulated (a phase sized alone), its prefill is instant."""

    def to_prefill(i: int) -> None:
        if prefillers:
            min(prefillers, key=lambda p: p.queued_tokens).submit(i)
        else:
            run.first_token_at(i)
            if run.out[i] > 1:
                to_decode(i)

    return to_prefill


def _through_encoders(run: _Run, encode: Sequence[EnginePerf], cfg: SimConfig, then: Callable[[int], None]) -> Callable[[int], None]:
    """``then``, preceded for a request with images by an encode pool's step (if there is a pool)."""
    encoders = [_EncodeServer(run, e, cfg, then) for e in encode]

    def arrive(i: int) -> None:
        if encoders and run.images[i]:
            min(encoders, key=lambda e: e.queued_images).submit(i)
        else:
            then(i)

    return arrive


class _KvPuller:
    """KV admission for requests prefilled elsewhere: reserve ``input+output`` tokens in FIFO
    order, then pull the prompt's KV over this replica's link (FIFO, ``bytes / bandwidth``;
    vLLM allocates before pulling). Subclasses say where a pulled request goes (``_arrived``)."""

    def __init__(self, run: _Run, capacity: int, bytes_per_s: float, kv_bytes: int) -> None:
        self.run, self.capacity = run, capacity
        self.reserved = 0
        self.pulls: deque[int] = deque()
        self.pull_tokens = 0
        self.link_free_at = 0.0
        self.seconds_per_token = kv_bytes / bytes_per_s if bytes_per_s > 0 else math.inf

    def pull(self, i: int) -> None:
        self.pulls.append(i)
        self.pull_tokens += _kv_need(self.run, i)
        self.admit_pulls()

    def admit_pulls(self) -> None:
        run = self.run
        while self.pulls:
            i = self.pulls[0]
            need = _kv_need(run, i)
            if self.reserved + need > self.capacity and need <= self.capacity:
                return
            self.pulls.popleft()
            self.pull_tokens -= need
            if need > self.capacity:
                run.never(i)
                continue
            self.reserved += need
            if self.seconds_per_token == 0:
                self._arrived(i)
                continue
            start = max(run.now, self.link_free_at)
            self.link_free_at = start + run.inp[i] * self.seconds_per_token
            run.at(self.link_free_at, self._arrived, i)

    def _arrived(self, i: int) -> None:
        raise NotImplementedError

    def release(self, done: list[int]) -> None:
        """Free the KV of finished requests, and admit the pulls that were waiting for it."""
        self.reserved -= sum(_kv_need(self.run, i) for i in done)
        if done and self.pulls:
            self.admit_pulls()


class _DecodeServer(_KvPuller):
    def __init__(self, run: _Run, perf: EnginePerf, cfg: SimConfig, bytes_per_s: float, kv_bytes: int):
        super().__init__(run, perf.kv_capacity_tokens, bytes_per_s, kv_bytes)
        self.perf = perf
        self.max_seqs = max(1, cfg.max_num_seqs // perf.pp)
        self.lanes = [_Lane(run, self) for _ in range(perf.pp)]

    @property
    def load(self) -> float:
        return (self.reserved + self.pull_tokens) / self.capacity

    def _arrived(self, i: int) -> None:
        min(self.lanes, key=_Lane.load).enqueue(i)


class _Lane:
    """One decode micro-batch loop (a decode replica with pipeline depth pp has pp lanes)."""

    def __init__(self, run: _Run, server: _DecodeServer):
        self.server = server
        self.loop = _DecodeLoop(run, server.perf, self._boundary)
        self.pending: deque[int] = deque()

    def load(self) -> int:
        return self.loop.size + len(self.pending)

    def enqueue(self, i: int) -> None:
        self.pending.append(i)
        if self.loop.running:
            self.loop.interrupt()
        else:
            self._boundary([])

    def _boundary(self, done: list[int]) -> None:
        if done:
            self.server.release(done)
        loop, pending = self.loop, self.pending
        while pending and loop.size < self.server.max_seqs:
            loop.add(pending.popleft())
        if loop.size:
            loop.start()


def simulate_disaggregated(
    trace: Trace,
    prefill: Sequence[EnginePerf],
    decode: Sequence[EnginePerf],
    kv_bytes_per_token: int,
    transfer_bytes_per_s: float = math.inf,
    slo: Slo | None = None,
    cfg: SimConfig = SimConfig(),
    serving_path: ServingPathCost = ServingPathCost(),
    encode: Sequence[EnginePerf] = (),
) -> SimResult:
    """Simulate prefill and decode pools, and an encode pool ahead of prefill (E+P+D); either of
    prefill and decode may be empty to study one phase alone.

    With no prefill replicas, requests reach decode at arrival, or once encoded (TTFT 0 or the
    encode pool's time); with no decode replicas, requests end at their first token (TPOT 0).
    The optimizer sizes each phase this way (DistServe's algorithm 1), then checks the whole
    plan with every pool. The serving path's CPU (``serving_path``) shares the processors of the
    engines simulated, and only the work simulated loads it.
    """
    processors = sum(e.gpus for e in (*prefill, *decode, *encode))
    run = _Run(trace, slo, serving_path, processors)
    decoders = [_DecodeServer(run, p, cfg, transfer_bytes_per_s, kv_bytes_per_token) for p in decode]

    def to_decode(i: int) -> None:
        if decoders:
            min(decoders, key=lambda d: d.load).pull(i)
        else:
            run.finished(i)

    prefillers = [_PrefillServer(run, p, cfg, to_decode) for p in prefill]

    arrive = _through_encoders(run, encode, cfg, _to_prefill(run, prefillers, to_decode))
    for i, t in enumerate(run.arrival):
        run.at(t, arrive, i)
    return run.run()


class _ColocatedServer(_KvPuller):
    """One vLLM-style engine serving both phases, prefill first, no chunking.

    As a decode replica under conditional disaggregation it also pulls the KV of prompts the
    prefill pool computed; those join its decode batch at the next scheduling point, while the
    prompts it prefills itself stall its decodes exactly as in a colocated engine.
    """

    def __init__(
        self, run: _Run, perf: EnginePerf, cfg: SimConfig, bytes_per_s: float = math.inf, kv_bytes: int = 0
    ) -> None:
        super().__init__(run, perf.kv_capacity_tokens, bytes_per_s, kv_bytes)
        self.perf, self.cfg = perf, cfg
        self.loop = _DecodeLoop(run, perf, self._decode_boundary)
        self.waiting: deque[int] = deque()
        self.waiting_tokens = 0
        self.joining: deque[int] = deque()
        self.prefilling = False

    @property
    def load(self) -> float:
        return self.reserved + self.waiting_tokens + self.pull_tokens

    def submit(self, i: int) -> None:
        """A request this engine prefills itself."""
        self.waiting.append(i)
        self.waiting_tokens += _kv_need(self.run, i)
        self._wake()

    def _wake(self) -> None:
        if self.loop.running:
            self.loop.interrupt()
        elif not self.prefilling:
            self._iterate()

    def _arrived(self, i: int) -> None:
        # As an event of its own: the pull may complete inside this engine's own step boundary
        # (zero transfer time), which must not start a second iteration.
        self.run.at(self.run.now, self._join, i)

    def _join(self, i: int) -> None:
        self.joining.append(i)
        self._wake()

    def _iterate(self) -> None:
        run, waiting, loop = self.run, self.waiting, self.loop
        while self.joining and loop.size < self.cfg.max_num_seqs:
            loop.add(self.joining.popleft())
        prefill, total, sq = [], 0, 0
        while waiting:
            i = waiting[0]
            need = _kv_need(run, i)
            if need > self.capacity:
                waiting.popleft()
                self.waiting_tokens -= need
                run.never(i)
                continue
            if (
                self.reserved + need > self.capacity
                or (prefill and total + run.inp[i] > self.cfg.prefill_max_batch_tokens)
                or loop.size + len(prefill) >= self.cfg.max_num_seqs
            ):
                break
            prefill.append(waiting.popleft())
            self.waiting_tokens -= need
            self.reserved += need
            total += run.inp[i]
            sq += run.inp[i] ** 2
        if prefill:
            self.prefilling = True
            latency = self.perf.prefill_latency_s(total, sq) + self.perf.encode_s(sum(run.images[i] for i in prefill))
            run.engine_busy(self, run.serving_path.step_cores(len(prefill), len(prefill), latency))
            run.after_work(latency, self._prefill_done, prefill)
            return
        run.engine_idle(self)  # its decode loop, if any, is the engine's load from here
        if loop.size:
            loop.start()

    def _prefill_done(self, prefill: list[int]) -> None:
        self.prefilling = False
        for i in prefill:
            self.run.first_token_at(i)
            if self.run.out[i] > 1:
                self.loop.add(i)
        self.release([i for i in prefill if self.run.out[i] <= 1])
        self._iterate()

    def _decode_boundary(self, done: list[int]) -> None:
        self.release(done)
        self._iterate()


def simulate_conditional(
    trace: Trace,
    prefill: Sequence[EnginePerf],
    decode: Sequence[EnginePerf],
    kv_bytes_per_token: int,
    local_prefill_max_tokens: float,
    transfer_bytes_per_s: float = math.inf,
    slo: Slo | None = None,
    cfg: SimConfig = SimConfig(),
    serving_path: ServingPathCost = ServingPathCost(),
    encode: Sequence[EnginePerf] = (),
) -> SimResult:
    """Conditional disaggregation, as duet's router does it: a prompt shorter than
    ``local_prefill_max_tokens`` is prefilled by the decode replica that serves it, with no KV
    transfer, stalling that replica's decodes (the colocated model, so decode replicas are
    pp=1 engines); a longer one goes through the prefill pool and its KV is pulled.

    Either pool may be empty to size one phase alone; as in :func:`simulate_disaggregated`, the
    missing pool's work is then instant. A prefill pool alone gives the short prompts TTFT and
    TPOT 0 (they are the decode side's), so its attainment counts against the whole trace, as a
    disaggregated prefill pool's does; a decode pool alone receives the long prompts at arrival
    with their first token (TTFT 0). An encode pool (``encode``) encodes the images of the
    prompts the prefill pool computes.
    """
    if any(e.pp != 1 for e in decode):
        raise ValueError("engines that prefill and decode are modelled with tensor parallelism only (pp=1)")
    run = _Run(trace, slo, serving_path, sum(e.gpus for e in (*prefill, *decode, *encode)))
    servers = [_ColocatedServer(run, e, cfg, transfer_bytes_per_s, kv_bytes_per_token) for e in decode]

    def least_loaded() -> _ColocatedServer:
        return min(servers, key=lambda s: s.load)

    def to_decode(i: int) -> None:
        if servers:
            least_loaded().pull(i)
        else:
            run.finished(i)

    prefillers = [_PrefillServer(run, p, cfg, to_decode) for p in prefill]

    remote = _through_encoders(run, encode, cfg, _to_prefill(run, prefillers, to_decode))

    def arrive(i: int) -> None:
        local = run.inp[i] < local_prefill_max_tokens
        if local and servers:
            least_loaded().submit(i)
        elif not local:
            remote(i)
        else:  # the work of a pool not simulated: instant
            run.first_token_at(i)
            if run.out[i] > 1:
                to_decode(i)

    for i, t in enumerate(run.arrival):
        run.at(t, arrive, i)
    return run.run()


def simulate_colocated(
    trace: Trace,
    engines: Sequence[EnginePerf],
    slo: Slo | None = None,
    cfg: SimConfig = SimConfig(),
    serving_path: ServingPathCost = ServingPathCost(),
) -> SimResult:
    """Simulate colocated replicas (pp=1): conditional disaggregation where every prompt is
    short enough; requests go to the replica with the least KV load."""
    return simulate_conditional(
        trace, (), engines, 0, math.inf, slo=slo, cfg=cfg, serving_path=serving_path
    )
