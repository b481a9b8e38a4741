"""NIXL's progress thread in "wait" mode: a KV pull completes while the prefill side computes.

vLLM's NixlConnector advances UCX in the prefill engine only between engine steps. A decode
worker's READ lands its data one-sidedly (cross-memory attach on one host), but the transfer
completes only once the prefill side's UCX has progressed, so without a progress thread the
pull waits out the prefill engine's step in progress (0.5-0.7 s for a long prompt on CPU). Here
the target process plays the prefill engine mid-step: its main thread never touches NIXL.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

BUFFER_FLOATS = 1 << 20  # 4 MiB, about the KV of a 1,000-token prompt of the tiny model


def _target(outbox: Any, inbox: Any, mode: str) -> None:
    """Registers memory like a prefill engine, then stays out of NIXL until told to stop."""
    import torch

    os.environ["DUET_NIXL_PROGRESS_THREAD"] = mode
    from duet.kv_transfer import vllm_plugin

    vllm_plugin.register()
    from nixl._api import nixl_agent, nixl_agent_config

    # As vLLM builds it: the thread on; the plugin decides what it does.
    agent = nixl_agent("duet-test-prefill", nixl_agent_config())
    buf = torch.full((BUFFER_FLOATS,), 1.0)
    agent.register_memory(buf)
    descs = agent.get_xfer_descs([(buf.data_ptr(), BUFFER_FLOATS * 4, 0)], "DRAM")
    outbox.put((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
    cpu_before = time.process_time()
    inbox.get(timeout=60)
    outbox.put(time.process_time() - cpu_before)


def _pull_while_target_computes(mode: str, wait_s: float) -> tuple[str, float, float, float]:
    """(final transfer state, seconds it took, last float read, target's CPU seconds meanwhile)."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    from_target, to_target = ctx.Queue(), ctx.Queue()
    target = ctx.Process(target=_target, args=(from_target, to_target, mode), daemon=True)
    target.start()
    try:
        agent = nixl_agent(f"duet-test-decode-{mode}", nixl_agent_config(enable_prog_thread=False))
        buf = torch.zeros(BUFFER_FLOATS)
        agent.register_memory(buf)
        local = agent.get_xfer_descs([(buf.data_ptr(), BUFFER_FLOATS * 4, 0)], "DRAM")
        metadata, serialized = from_target.get(timeout=60)
        peer = agent.add_remote_agent(metadata)
        remote = agent.deserialize_descs(serialized)
        # With a notification, as NixlConnector reads (it tells prefill to free the blocks).
        handle = agent.initialize_xfer("READ", local, remote, peer, b"done")
        start = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC" and time.perf_counter() - start < wait_s:
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        took = time.perf_counter() - start
        time.sleep(max(0.0, 1.0 - took))  # the target idles at least a second
        to_target.put("stop")
        return state, took, float(buf[-1]), from_target.get(timeout=60)
    finally:
        target.join(30)
        if target.is_alive():
            target.kill()


def test_pull_completes_while_the_prefill_side_computes_and_the_thread_sleeps() -> None:
    state, took, last, target_cpu_s = _pull_while_target_computes("wait", wait_s=10.0)
    assert state == "DONE", f"the READ did not complete in {took:.1f} s"
    assert last == 1.0
    assert took < 2.0
    # NIXL's own setting ("poll") burns the whole second here; "wait" sleeps in poll().
    assert target_cpu_s < 0.3, f"the target used {target_cpu_s:.2f} s of CPU while idle"


def test_without_the_thread_the_pull_waits_for_the_prefill_side() -> None:
    """Why "wait" exists: the data has landed, yet the READ is not done while the target's
    engine thread is busy elsewhere."""
    state, took, last, _ = _pull_while_target_computes("off", wait_s=1.0)
    assert last == 1.0  # one-sided: the bytes arrived
    assert state == "PROC", f"completed in {took:.3f} s without the target progressing"
