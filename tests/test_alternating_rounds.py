"""The round-by-round comparison ``duet bench migrate`` and ``duet bench rebalance`` share."""

from __future__ import annotations

from duet.benchmarks.alternating import alternating_rounds


def test_rounds_alternate_the_order_and_compare_the_streams(capsys):
    ran: list[str] = []
    tokens = {"a": [[1, 2]], "b": [[1, 2]]}

    def run(mode: str) -> dict:
        ran.append(mode)
        if len(ran) == 4:  # the second round's "b" streams differently
            return {"tokens": [[9]], "value": len(ran)}
        return {"tokens": tokens[mode], "value": len(ran)}

    results = alternating_rounds(2, ("a", "b"), run, lambda r: f"value {r['value']}", lambda p: f"{sorted(p)}", "same")
    assert ran == ["a", "b", "b", "a"]
    assert [(r["round"], r["same"], r["streams_differing"]) for r in results] == [
        (0, True, []), (0, True, []), (1, False, [0]), (1, False, [0])
    ]
    assert all("tokens" not in r for r in results)
    assert [r["tokens_differing"] for r in results] == [{}, {}, {0: [9]}, {0: [1, 2]}]  # round 1: b, then a
    out = capsys.readouterr().out
    assert "round 1 b     : value 3" in out and "round 1: ['a', 'b']; streams identical: False (streams [0] differ)" in out
