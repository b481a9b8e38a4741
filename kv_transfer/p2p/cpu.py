"""Where the connector's threads run on a CPU host.

vLLM's CPU worker binds its forward pass to the engine's core(s), and every thread started from
that thread inherits the binding. A sender or receiver thread bound there time-slices with the
forward pass (on the 2-core machine, layer-wise sends ran at about a quarter of gloo's speed),
while the raw transport it is measured against has a core to itself. Transport threads therefore
drop the binding and let the kernel put them on any core the process may use; on GPU hosts this
only moves host-side bookkeeping off the core that launches the kernels.
"""

from __future__ import annotations

import os


def unbind_current_thread() -> None:
    """Allow the calling thread on every CPU (the kernel intersects this with the cgroup's)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no affinity API on this platform, or nothing to widen
        pass
