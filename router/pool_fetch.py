"""Whether a prefill worker fetches a prefix from another host's KV pool or computes it, from the
router's own timings of both.

The router plans a fetch where another host's pool holds more of a prompt than the chosen worker
reaches (router/policies.py: PrefixAffinity). Whether the fetch is faster than computing those
blocks depends on what the router cannot know in advance: the link, the model's KV per token,
the engine's speed, and how busy the source engine is (it answers a fetch only between its own
steps). With the built-in model on CPU, computing a 2,048-token prompt took 228 ms where fetching
it took 329 ms at 1 Gbit/s and 1,722 ms at 100 Mbit/s (benchmarks/results/kv_pool_hosts.json); a
large model on GPUs over RDMA is the other way round. So the router measures both as it serves:

- computing: :class:`~duet.router.prompt_cost.PromptCost`, fitted to the prefills it times on
  workers with nothing else queued (fetched ones left out);
- fetching, per source host: each fetched prefill's time (nothing else queued on its worker)
  beyond what PromptCost predicts for the tokens it computed, per token fetched, smoothed.

With ``kv_pool.fetch_when: faster`` a planned fetch is made where its blocks are predicted to
arrive in at most :data:`_MARGIN` of the time computing them takes, and where either side is not
measured yet (fetches from a host are made until one is timed: one whose worker had nothing else
queued). While fetches from a host are declined, one in :data:`PROBE_EVERY` is made anyway, so
a link or a source that became faster is followed.
``always`` makes every planned fetch (to measure fetching itself: ``duet bench kv-pool-hosts``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from duet.kv_transfer.config import TransferEndpoint
    from duet.router.prompt_cost import PromptCost

logger = logging.getLogger(__name__)

FetchWhen = Literal["faster", "always"]

# A fetch must be predicted to take at most this share of computing its blocks: a fetch that
# saves less is not worth its risk (a source busier than when measured, a lookup with no timeout).
_MARGIN = 0.9
_SMOOTHING = 0.5
PROBE_EVERY = 16


@dataclass(frozen=True)
class PlannedFetch:
    """A prefix to fetch for one request: from the engine at ``source`` on ``source_host``, the
    ``tokens`` (whole blocks) after the ``reached_tokens`` the worker finds on its own host."""

    source: TransferEndpoint
    source_host: str
    reached_tokens: int
    tokens: int


class FetchChoice:
    """Per planned fetch, fetch or compute (see the module's docstring)."""

    def __init__(self, when: FetchWhen, prompt_cost: PromptCost) -> None:
        self.when = when
        self.prompt_cost = prompt_cost
        # Seconds per token fetched, by source host (smoothed over the fetches timed).
        self.token_s: dict[str, float] = {}
        # Fetches declined in a row, by source host (for the probes).
        self._declined: dict[str, int] = {}

    def take(self, plan: PlannedFetch, prompt_tokens: int) -> bool:
        """Whether the worker fetches ``plan``'s blocks for a prompt of ``prompt_tokens``."""
        if self.when == "always":
            return True
        fetch_s, compute_s = self.predicted_s(plan, prompt_tokens)
        if fetch_s is None or compute_s is None or fetch_s <= _MARGIN * compute_s:
            if self._declined.pop(plan.source_host, 0):
                logger.info("fetching prefixes from %s's KV pool again: faster than computing them", plan.source_host)
            return True
        declined = self._declined.get(plan.source_host, 0) + 1
        self._declined[plan.source_host] = declined
        if declined == 1:
            logger.info(
                "computing prefixes that %s's KV pool holds: fetching %d tokens takes about %.0f ms, computing them %.0f ms",
                plan.source_host, plan.tokens, fetch_s * 1000, compute_s * 1000,
            )
        return declined % PROBE_EVERY == 0  # a probe: is fetching still slower?

    def predicted_s(self, plan: PlannedFetch, prompt_tokens: int) -> tuple[float | None, float | None]:
        """Seconds to fetch ``plan``'s tokens and to compute them instead (None: not measured yet)."""
        per_token = self.token_s.get(plan.source_host)
        fetch_s = None if per_token is None else per_token * plan.tokens
        if not self.prompt_cost.known:
            return fetch_s, None
        computed = _computed_tokens(plan, prompt_tokens)
        return fetch_s, self.prompt_cost.prefill_s(computed + plan.tokens) - self.prompt_cost.prefill_s(computed)

    def timed(self, plan: PlannedFetch, fetched_tokens: int, computed_tokens: int, seconds: float) -> None:
        """A worker with nothing else queued fetched ``fetched_tokens`` of ``plan`` (what its
        engine loaded beyond its own host's reach) and computed ``computed_tokens`` in
        ``seconds`` to its first token. A fetch that loaded nothing (the source had lost the
        blocks, or did not answer) counts its time beyond computing against the tokens planned:
        a source that costs time and gives nothing is not asked again soon."""
        if not self.prompt_cost.known:
            return
        beyond = max(0.0, seconds - self.prompt_cost.prefill_s(max(1, computed_tokens)))
        sample = beyond / (fetched_tokens if fetched_tokens > 0 else plan.tokens)
        previous = self.token_s.get(plan.source_host)
        self.token_s[plan.source_host] = sample if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * sample


def _computed_tokens(plan: PlannedFetch, prompt_tokens: int) -> int:
    """The prompt's tokens the worker computes when it fetches ``plan`` (vLLM computes at least
    the last one)."""
    return max(1, prompt_tokens - plan.reached_tokens - plan.tokens)
