"""Concurrent greedy streams, each on a thread of its own: what each received, and when.

The stream benchmarks (``duet bench migrate``, its ``--link-gbit`` form, ``duet bench
rebalance``) start a set of these, wait until every one decodes, change something (a drain, a
rebalancer) and read each stream's pauses after it.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Iterable


class GreedyStreams:
    """One greedy stream per prompt through ``client`` (its resuming ``stream``), request ids
    ``s0``, ``s1``, ... in the prompts' order."""

    def __init__(self, client: Any, prompts: list[list[int]], tokens: int) -> None:
        self.client = client
        self.prompts = prompts
        self.max_tokens = tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]  # (when, tokens) per message
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(len(prompts))]

    def _stream(self, index: int) -> None:
        from duet.router.client import build_request

        try:
            request = build_request(
                prompt_token_ids=self.prompts[index], max_tokens=self.max_tokens, ignore_eos=True, request_id=f"s{index}"
            )
            for message in self.client.stream(request, timeout=900):
                self.tokens[index].extend(message.token_ids)
                self.arrivals[index].append((time.monotonic(), len(message.token_ids)))
        except BaseException as error:  # reported by join
            self.errors.append(error)

    def start(self, decoding_tokens: int, timeout_s: float = 600) -> None:
        """Start every stream; return once each has ``decoding_tokens`` tokens (or one failed)."""
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while not all(len(t) >= decoding_tokens for t in self.tokens) and not self.errors and time.monotonic() < deadline:
            time.sleep(0.05)

    def join(self, what: str, timeout_s: float = 900) -> None:
        """Wait for every stream to end; raises if any failed (``what`` names the run)."""
        for thread in self._threads:
            thread.join(timeout_s)
        if self.errors:
            raise RuntimeError(f"{what}: {len(self.errors)} streams failed: {self.errors[0]!r}")

    def longest_pauses_after(self, moment: float) -> list[float]:
        """Each stream's longest wait, counted from ``moment`` on, for its next message: the
        stall a drain at ``moment`` added to it. A pause that began before ``moment`` counts from
        ``moment`` only: it was not the drain's (a stream that did not move, waiting on its
        engine's busy step as the drain came, once read here as a 1.3-1.6 s move). In the
        prompts' order; 0 for a stream that had ended."""
        return [
            max((b - max(a, moment) for (a, _), (b, _) in zip(messages, messages[1:]) if b > moment), default=0.0)
            for messages in self.arrivals
        ]

    def time_per_token_in(self, start: float, end: float, streams: Iterable[int]) -> float | None:
        """The median over ``streams`` (indexes) of each one's time per token between ``start``
        and ``end``: its engine's step time then. None if none of them streamed twice in it."""
        per_token = []
        for index in streams:
            inside = [(when, count) for when, count in self.arrivals[index] if start < when <= end]
            tokens = sum(count for _, count in inside[1:])
            if tokens:
                per_token.append((inside[-1][0] - inside[0][0]) / tokens)
        return statistics.median(per_token) if per_token else None
