"""Routing policies: which ready worker of a pool gets a request.

Each policy is a small named component chosen in the config's ``router:`` section and shown,
with its parameters, in ``duet status``:

- ``least_requests``: fewest requests in flight (the baseline);
- ``least_prompt_tokens`` (prefill): fewest outstanding prompt tokens: a 4,000-token prompt is
  forty times the work of a 100-token one, which request counts do not see;
- ``prefix_affinity`` (prefill): the worker that already holds the longest prefix of the prompt
  in its prefix cache, unless its outstanding work exceeds the pool mean by ``load_factor``;
  among workers holding equally long prefixes (or none), the one with fewest prompt tokens;
- ``least_kv_load`` (decode): the lowest KV-cache usage, then the fewest running sequences, as
  the workers last reported them (cluster/health.py polls them every second), each with the
  requests routed to the worker since whose KV has not arrived (``PoolMember.assigned``): a
  burst of requests is chosen for before any of its prompts is computed.

Ties are broken at random. One router's ties are rare (its own counts change with every
request it sends), but several front doors each count only their own requests: a first-listed
choice among equals would send every front door's light-load requests to the same worker.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from duet.router.pools import PoolMember


class RoutingPolicy(Protocol):
    name: str

    def choose(self, ready: "list[PoolMember]", prompt: list[int]) -> "PoolMember":
        """One of ``ready`` (never empty) for a request with ``prompt``."""
        ...

    def describe(self) -> str:
        """The policy and its parameters, for ``duet status``."""
        ...


class LeastRequests:
    name = "least_requests"

    def choose(self, ready: "list[PoolMember]", prompt: list[int]) -> "PoolMember":
        return min(ready, key=lambda member: (member.inflight + member.assigned, random.random()))

    def describe(self) -> str:
        return self.name


class LeastPromptTokens:
    name = "least_prompt_tokens"

    def choose(self, ready: "list[PoolMember]", prompt: list[int]) -> "PoolMember":
        return min(ready, key=lambda member: (member.outstanding_tokens, member.inflight, random.random()))

    def describe(self) -> str:
        return self.name


class LeastKvLoad:
    name = "least_kv_load"

    def choose(self, ready: "list[PoolMember]", prompt: list[int]) -> "PoolMember":
        return min(ready, key=lambda member: (
            round(member.kv_use_estimate(), 2), member.running + member.inflight + member.assigned, random.random()
        ))

    def describe(self) -> str:
        return self.name


class PrefixAffinity:
    """Prefer the worker whose prefix cache already holds the longest prefix of the prompt.

    The router hashes each prompt's full KV blocks as the engine does (block by block, each hash
    chained to the previous one, so a hash names the whole prefix up to that block) and
    remembers which workers were sent which block hashes, newest first, up to ``capacity``
    entries. That is an estimate of each engine's cache: it does not see evictions, which is why
    the load guard matters more than the estimate's precision.
    """

    name = "prefix_affinity"

    def __init__(
        self, block_size: int, load_factor: float = 1.5, slack_tokens: int = 2048, capacity: int = 200_000
    ) -> None:
        self.block_size = block_size
        self.load_factor = load_factor
        self.slack_tokens = slack_tokens
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def block_hashes(self, prompt: list[int]) -> list[bytes]:
        hashes, parent = [], b""
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            block = prompt[start : start + self.block_size]
            parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def cached_blocks(self, member_name: str, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` ``member_name`` is believed to hold."""
        count = 0
        for block_hash in hashes:
            if member_name not in self._holders.get(block_hash, ()):
                break
            count += 1
        return count

    def eligible(self, ready: "list[PoolMember]") -> "list[PoolMember]":
        """Members not overloaded: outstanding work at most ``load_factor`` times the mean, or
        within ``slack_tokens`` (about one engine step) of it, so light load never overrides
        affinity."""
        mean = sum(member.outstanding_tokens for member in ready) / len(ready)
        bound = max(self.load_factor * mean, mean + self.slack_tokens)
        return [member for member in ready if member.outstanding_tokens <= bound] or ready

    def choose(self, ready: "list[PoolMember]", prompt: list[int]) -> "PoolMember":
        hashes = self.block_hashes(prompt)
        candidates = self.eligible(ready)
        # Longest cached prefix; among equals (a system prompt every worker holds) the least loaded.
        best = max(
            candidates,
            key=lambda member: (
                self.cached_blocks(member.name, hashes), -member.outstanding_tokens, -member.inflight, random.random()
            ),
        )
        self._remember(best.name, hashes)
        return best

    def _remember(self, member_name: str, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            holders = self._holders.setdefault(block_hash, set())
            holders.add(member_name)
            self._holders.move_to_end(block_hash)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def describe(self) -> str:
        return f"{self.name}(block_size={self.block_size}, load_factor={self.load_factor:g})"
