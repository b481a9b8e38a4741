"""Single-rank gloo groups share one device, and so one loop thread (worker_runtime/gloo_device.py).

Each rank runs in a process of its own with duet's vLLM plugin loaded as vLLM loads it in a
CPU engine (``DUET_SHARED_GLOO_DEVICE=1``), and builds groups the way vLLM's parallel state
does: several single-rank groups beside groups with a peer. The groups with a peer must still
reduce across both ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

SINGLE_RANK_GROUPS = 4


def _loop_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            names.append(comm.read().strip())
    return names.count("gloo_tcp_loop")


def _rank(rank: int, port: int, shared: bool, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    if shared:
        os.environ["DUET_SHARED_GLOO_DEVICE"] = "1"
        from duet.kv_transfer import vllm_plugin

        vllm_plugin.register()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pair = dist.new_group([0, 1], backend="gloo")
    # Every rank takes part in creating every group, as torch.distributed requires.
    singles = [dist.new_group([r], backend="gloo") for r in (0, 1) for _ in range(SINGLE_RANK_GROUPS)]
    mine = [group for group in singles if group != dist.GroupMember.NON_GROUP_MEMBER]
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=pair)
    alone = torch.tensor([float(rank + 1)])
    for group in mine:
        dist.all_reduce(alone, group=group)
    results.put((rank, _loop_threads(), total.item(), alone.item(), len(mine)))
    dist.destroy_process_group()


def _run(shared: bool) -> dict[int, tuple[int, float, float, int]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(rank, port, shared, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    answers = {}
    for _ in ranks:
        rank, *rest = results.get(timeout=120)
        answers[rank] = tuple(rest)
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    return answers


def test_single_rank_groups_share_one_loop_thread_and_pairs_still_reduce() -> None:
    plain, shared = _run(shared=False), _run(shared=True)
    for rank in (0, 1):
        threads, total, alone, groups = shared[rank]
        assert groups == SINGLE_RANK_GROUPS
        assert total == 3.0  # 1 + 2 across the pair
        assert alone == rank + 1.0  # a single-rank reduce keeps the value
        # Without sharing: the world and the pair have a device each, as does every single
        # group; with it, the single groups add one device between them.
        assert plain[rank][0] == 2 + SINGLE_RANK_GROUPS
        assert threads == 2 + 1
