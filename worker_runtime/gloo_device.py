"""One gloo device for all of an engine process's single-rank process groups.

vLLM sets up its parallel groups (world, tensor, pipeline, data, expert, ... each once for the
device and once for the CPU) with ``torch.distributed``, and on a CPU host every one of them is
a gloo group: 13 in an engine with one rank. PyTorch gives each gloo group a transport device of
its own, and each device runs a loop thread that wakes every 10 ms whether or not anything is
sent (gloo's ``epoll_wait`` timeout). An idle engine therefore woke about 1,300 times a second
and spent 1.3 s of CPU a minute doing it (measured per thread, docs/benchmarks/serving.md): on a CPU host
that is taken from the engines' own cores, and duet runs one engine core per worker.

A group of one rank never talks to a peer, so its device only has to exist. This module makes
every single-rank gloo group of the process share one device: one loop thread instead of 13.
Groups with peers (tensor parallelism across ranks, duet's KV links) keep a device each, as
PyTorch makes them. duet's vLLM plugin installs it in duet's engine processes only
(``DUET_SHARED_GLOO_DEVICE``, set for CPU engines by ``cpu_engine_environment``).
"""

from __future__ import annotations

from typing import Any

# Set by duet for its CPU engines; read by duet's vLLM plugin in the engine's process.
ENV_SHARED_GLOO_DEVICE = "DUET_SHARED_GLOO_DEVICE"


def share_single_rank_device() -> None:
    """From now on, every single-rank gloo group of this process uses one shared device.

    ``torch.distributed`` builds gloo groups through its module-level ``ProcessGroupGloo``, so
    that name is replaced by a subclass whose single-rank constructor passes the shared device
    in the group's options. Subclassing keeps ``isinstance`` checks against PyTorch's class true.
    Idempotent: the plugin loads more than once in a process.
    """
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_duet_shared_device", False):
        return
    shared: list[Any] = []  # created on first use, when a group needs it

    class SharedDeviceProcessGroupGloo(base):  # type: ignore[misc,valid-type]
        _duet_shared_device = True

        def __init__(self, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> None:
            timeout = kwargs.get("timeout")
            if size != 1 or args or set(kwargs) - {"timeout"}:
                super().__init__(store, rank, size, *args, **kwargs)
                return
            if not shared:
                shared.append(base.create_default_device())
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            options._devices = shared
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceProcessGroupGloo
