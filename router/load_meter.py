"""What the router saw of the load since the autoscaler last looked.

The serving path reports each admitted request three times: on arrival (its prompt length), at
its first token, and when it leaves (its usage). The autoscaler's live driver takes a
:meth:`LoadMeter.window` every interval: arrivals and prompt-length moments, the TTFTs of the
first tokens, the TPOTs and output lengths of the finished requests, and how many admitted
requests are still waiting for a first token past a given age. Plain counters and lists, reset
by each window, so the cost per request is a few appends.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from duet.router.lifecycle import Usage


@dataclass
class LoadWindow:
    arrivals: int = 0
    prompt_tokens: int = 0
    prompt_tokens_sq: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    # (TPOT, output tokens) of each request that finished.
    finished: list[tuple[float, int]] = field(default_factory=list)
    # E+P+D: seconds requests waited on the encode pool, summed (the mean number of encodes in
    # flight is this over the window's length), and images left to the prefill engines because
    # no encode worker could take them.
    encode_wait_s: float = 0.0
    image_fallbacks: int = 0

    def add(self, other: "LoadWindow") -> None:
        """Count ``other``'s requests too (another front door's window of the same interval)."""
        self.arrivals += other.arrivals
        self.prompt_tokens += other.prompt_tokens
        self.prompt_tokens_sq += other.prompt_tokens_sq
        self.ttfts_s.extend(other.ttfts_s)
        self.finished.extend(other.finished)
        self.encode_wait_s += other.encode_wait_s
        self.image_fallbacks += other.image_fallbacks


class LoadMeter:
    def __init__(self) -> None:
        self._current = LoadWindow()
        self._ids = itertools.count()
        # Admitted requests with no first token yet, by id: their arrival time.
        self._waiting_first: dict[int, float] = {}

    def arrived(self, prompt_tokens: int) -> int:
        """Count an admitted request; returns the handle its later reports use."""
        window = self._current
        window.arrivals += 1
        window.prompt_tokens += prompt_tokens
        window.prompt_tokens_sq += prompt_tokens * prompt_tokens
        handle = next(self._ids)
        self._waiting_first[handle] = time.monotonic()
        return handle

    def first_token(self, handle: int) -> None:
        start = self._waiting_first.pop(handle, None)
        if start is not None:
            self._current.ttfts_s.append(time.monotonic() - start)

    def left(self, handle: int, usage: Usage | None) -> None:
        """The request is gone: served (with ``usage``), failed or cancelled (without)."""
        self._waiting_first.pop(handle, None)
        if usage is not None and usage.completion_tokens:
            self._current.finished.append((usage.tpot_s, usage.completion_tokens))

    def encoded(self, wait_s: float, fallbacks: int) -> None:
        """A request's images went through the encode step: it waited ``wait_s`` on the encode
        pool, and ``fallbacks`` of its images were left to its prefill engine."""
        self._current.encode_wait_s += wait_s
        self._current.image_fallbacks += fallbacks

    def waiting_longer_than(self, seconds: float) -> int:
        """Admitted requests still without a first token after ``seconds``."""
        cutoff = time.monotonic() - seconds
        return sum(1 for start in self._waiting_first.values() if start < cutoff)

    def window(self) -> LoadWindow:
        """Everything since the previous call, and start a new window."""
        window, self._current = self._current, LoadWindow()
        return window

    async def sample(self, waiting_longer_than_s: float) -> tuple[LoadWindow, int]:
        """What the autoscaler takes each interval: the window, and how many requests wait
        for a first token longer than ``waiting_longer_than_s`` (cluster/autoscaler/live.py)."""
        return self.window(), self.waiting_longer_than(waiting_longer_than_s)
