"""The order a batch job runs its requests in: depth first through their prompts' prefix tree.

BatchLLM's point: a large batch whose requests share prefixes (a system prompt, a document
asked several questions) computes each shared prefix once only if the requests that share it
run close together, while the prefix is still in an engine's KV cache; sent in the file's
order, or shuffled, each one may find it evicted and compute it again. Sorting the prompts'
token ids walks the prefix tree depth first (two prompts sharing a prefix sort next to each
other, and every prompt between them shares it too), so the longest prefix a prompt shares
with any earlier one is the one it shares with the prompt just before it.

A shared prefix is computed once only if its first prompt is prefilled before the others
start: started together, each would compute it (an engine caches a block once it is
computed). So each prompt that shares at least one KV block with the prompt before it names an
*owner*: the earliest prompt of the run that shares that much; it starts once its owner's
first token is out, and prefix affinity routing sends it to the worker that holds the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Scheduled:
    """One request's place in the job: ``index`` into the job's requests; ``owner``: the
    position (in the schedule) of the request whose prefill it waits for, or None."""

    index: int
    owner: int | None
    shared_tokens: int


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    length = min(len(first), len(second))
    for position in range(length):
        if first[position] != second[position]:
            return position
    return length


def prefix_tree_order(prompts: Sequence[Sequence[int]], block_tokens: int) -> list[Scheduled]:
    """The schedule of ``prompts`` (token ids): depth first through their prefix tree, each
    prompt that shares at least ``block_tokens`` (whole KV blocks) with an earlier one waiting
    for the earliest prompt that shares that many."""
    order = sorted(range(len(prompts)), key=lambda index: (tuple(prompts[index]), index))
    # shared[k]: tokens the k-th scheduled prompt shares with the one before it, whole blocks.
    shared = [0] * len(order)
    for position in range(1, len(order)):
        common = _common_prefix(prompts[order[position - 1]], prompts[order[position]])
        shared[position] = common - common % block_tokens
    # The owner is the last earlier position that shares less with its predecessor (every
    # prompt after it, up to this one, shares these blocks): a previous-smaller-element stack.
    schedule, smaller = [], []  # smaller: positions whose shared counts rise strictly
    for position, index in enumerate(order):
        while smaller and shared[smaller[-1]] >= shared[position]:
            smaller.pop()
        owner = smaller[-1] if smaller and shared[position] >= block_tokens else None
        smaller.append(position)
        schedule.append(Scheduled(index, owner, shared[position]))
    return schedule


def minimum_prompt_tokens(prompts: Sequence[Sequence[int]], block_tokens: int) -> int:
    """The fewest prompt tokens an engine that caches whole blocks must compute for ``prompts``:
    every prompt's tokens less the whole blocks it shares with an earlier one in the tree
    (what a job run in :func:`prefix_tree_order` with an unbounded cache computes)."""
    return sum(len(prompts[item.index]) - item.shared_tokens for item in prefix_tree_order(prompts, block_tokens))
