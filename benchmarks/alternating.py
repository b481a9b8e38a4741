"""Two modes of one benchmark measured round by round, the order alternating.

This machine switches between two speeds about 1.4x apart within minutes, so two modes are
compared only inside one round, and each round runs them in the other order (A, B; then B, A):
a speed change falls on both alike over the rounds. Used by ``duet bench migrate`` (KV against
replay) and ``duet bench rebalance`` (on against off), whose streams are greedy and so must come
out identical under both modes.
"""

from __future__ import annotations

from typing import Any, Callable

Result = dict[str, Any]


def alternating_rounds(
    rounds: int,
    modes: tuple[str, str],
    run: Callable[[str], Result],
    describe: Callable[[Result], str],
    compare: Callable[[dict[str, Result]], str],
    identical_key: str,
) -> list[Result]:
    """``run(mode)`` for both ``modes`` in each of ``rounds`` rounds; every result gets its
    ``round`` and, under ``identical_key``, whether its round's two runs streamed the same
    tokens, and ``streams_differing`` (the indices of those that did not); its ``tokens`` are
    dropped but for those streams' (``tokens_differing``, by index), to check against a
    colocated engine. Prints ``describe(result)`` per run and
    ``compare({mode: result})`` per round, as they come."""
    results: list[Result] = []
    for round_index in range(rounds):
        pair: dict[str, Result] = {}
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            result = run(mode)
            result["round"] = round_index
            pair[mode] = result
            print(f"round {round_index} {mode:6s}: {describe(result)}", flush=True)
        first, second = pair[modes[0]]["tokens"], pair[modes[1]]["tokens"]
        differing = [index for index, (a, b) in enumerate(zip(first, second)) if a != b]
        same = first == second
        print(f"  round {round_index}: {compare(pair)}; streams identical: {same}"
              + (f" (streams {differing} differ)" if differing else ""), flush=True)
        for mode in modes:
            result = pair[mode]
            result[identical_key] = same
            result["streams_differing"] = differing
            tokens = result.pop("tokens")
            result["tokens_differing"] = {index: tokens[index] for index in differing}
            results.append(result)
    return results
