"""A batch job's order and durable state, without a deployment: the prefix-tree schedule, the
store's leases (one holder; a stale one taken over once), and results a crash cut short."""

from __future__ import annotations

import os
import random
import time

import pytest

from duet.batch.prefix_order import minimum_prompt_tokens, prefix_tree_order
from duet.batch.runner import jsonl_lines
from duet.batch.store import BatchStore, NotFound, process_name


def test_prompts_sharing_a_prefix_run_together_after_the_one_that_computes_it():
    rng = random.Random(1)
    system = [1] * 8  # one 8-token block every prompt shares
    groups = [[rng.randrange(2, 100) for _ in range(16)] for _ in range(3)]  # two blocks each
    prompts = [system + groups[index % 3] + [rng.randrange(2, 100) for _ in range(5)] for index in range(12)]
    schedule = prefix_tree_order(prompts, block_tokens=8)
    assert sorted(item.index for item in schedule) == list(range(12))
    group_of = [groups.index(prompts[item.index][8:24]) for item in schedule]
    assert group_of == sorted(group_of), "each group's prompts run together"
    for position, item in enumerate(schedule):
        first_of_group = group_of.index(group_of[position])
        if position == 0:
            assert item.owner is None and item.shared_tokens == 0
        elif position == first_of_group:  # shares only the system block: waits for prompt 0
            assert (item.owner, item.shared_tokens) == (0, 8)
        else:  # shares its group's three blocks: waits for its group's first prompt
            assert (item.owner, item.shared_tokens) == (first_of_group, 24)
    # Each distinct block once, then every prompt's own 5 tokens.
    assert minimum_prompt_tokens(prompts, 8) == 8 + 3 * 16 + 12 * 5


def test_a_partial_block_is_not_shared_and_prompts_without_a_common_block_wait_for_none():
    prompts = [[5, 6, 7, 1], [5, 6, 7, 2], [9, 9, 9, 9]]
    schedule = prefix_tree_order(prompts, block_tokens=4)
    assert all(item.owner is None and item.shared_tokens == 0 for item in schedule)
    assert minimum_prompt_tokens(prompts, 4) == 12


def test_a_long_run_of_one_prefix_is_ordered_in_linear_time():
    prompts = [[3] * 64 + [index % 700, index // 700] for index in range(20_000)]
    started = time.monotonic()
    schedule = prefix_tree_order(prompts, block_tokens=16)
    assert time.monotonic() - started < 5
    assert all(item.owner == 0 for item in schedule[1:])


def test_one_front_door_holds_a_lease_and_a_stale_one_is_taken_over(tmp_path):
    store = BatchStore(tmp_path, lease_s=3)
    store.add_batch({"id": "batch_abc", "status": "validating", "created_at": 1})
    assert store.try_lease("batch_abc", "door-a")
    assert not store.try_lease("batch_abc", "door-b"), "a live lease is exclusive"
    assert store.renew_lease("batch_abc", "door-a") and not store.renew_lease("batch_abc", "door-b")
    lease = tmp_path / "batches" / "batch_abc" / "lease"
    os.utime(lease, (time.time() - 10, time.time() - 10))  # door-a stopped renewing
    assert store.try_lease("batch_abc", "door-b")
    assert not store.renew_lease("batch_abc", "door-a"), "the old holder learns it lost the job"
    store.release_lease("batch_abc", "door-a")  # not its lease: nothing happens
    assert lease.read_text() == "door-b"
    store.release_lease("batch_abc", "door-b")
    assert not lease.exists() and list(store.unfinished()) == ["batch_abc"]


def test_a_lease_of_a_process_of_this_host_that_exited_is_taken_at_once(tmp_path):
    import subprocess
    import sys

    store = BatchStore(tmp_path, lease_s=3600)
    store.add_batch({"id": "batch_abc", "status": "in_progress", "created_at": 1})
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, _, namespace = process_name().split(":")
    dead = f"{host}:{exited.stdout.strip()}:{namespace}:aa"
    assert store.try_lease("batch_abc", dead)
    assert store.try_lease("batch_abc", "door-b"), "the lease of an exited process is taken at once"
    store.release_lease("batch_abc", "door-b")
    alive = f"{process_name()}:bb"
    assert store.try_lease("batch_abc", alive)
    assert not store.try_lease("batch_abc", "door-c"), "a live process of this host keeps its lease"
    store.release_lease("batch_abc", alive)
    assert store.try_lease("batch_abc", f"elsewhere:{exited.stdout.strip()}:{namespace}:cc")
    assert not store.try_lease("batch_abc", "door-c"), "another host's holder is judged by the lease's age only"
    store.release_lease("batch_abc", f"elsewhere:{exited.stdout.strip()}:{namespace}:cc")
    assert store.try_lease("batch_abc", f"{host}:{exited.stdout.strip()}:1:dd")
    assert not store.try_lease("batch_abc", "door-c"), "another pid namespace's holder is judged by age only"


def test_a_result_cut_short_by_a_crash_is_dropped_and_duplicates_keep_the_first(tmp_path):
    store = BatchStore(tmp_path)
    store.add_batch({"id": "batch_abc", "status": "in_progress", "created_at": 1})
    store.append_result("batch_abc", {"line": 1, "output": {"first": True}})
    store.append_result("batch_abc", {"line": 1, "output": {"first": False}})
    with open(tmp_path / "batches" / "batch_abc" / "results.jsonl", "ab") as results:
        results.write(b'\x00\x00garbage\n{"no": "line"}\n{"line": 2, "outp')
    assert store.results("batch_abc") == [{"line": 1, "output": {"first": True}}]
    store.append_result("batch_abc", {"line": 2, "output": {}})
    assert [result["line"] for result in store.results("batch_abc")] == [1, 2]


@pytest.mark.parametrize("bad_id", ["../etc/passwd", "file-../../x", "file-", "batch_a/b", "file-" + "a" * 100, ""])
def test_ids_that_are_not_the_stores_own_are_not_found(tmp_path, bad_id):
    store = BatchStore(tmp_path)
    with pytest.raises(NotFound):
        store.file(bad_id)
    with pytest.raises(NotFound):
        store.batch(bad_id)


def test_jsonl_lines_split_at_newlines_only():
    """A JSON string may hold U+2028 or U+0085 raw; str.splitlines would cut the line there."""
    import json

    line = json.dumps({"custom_id": "a", "body": {"prompt": "one\u2028two\u0085three"}}, ensure_ascii=False)
    assert jsonl_lines(line + "\r\n" + line + "\n") == [line, line, ""]
