"""Joining Ray, or starting a local one that spends as little of the host's CPU as it can.

On a CPU host the engines, the router and Ray's daemons share the same few cores, so every
wakeup Ray makes while duet serves is taken from a forward pass or a streamed token. A local
Ray (``ray.address: local``) is started for one job, duet's, and is trimmed to what that job
uses: the periodic work below is slowed, and the daemons duet never talks to are stopped once
Ray is up. A Ray that duet joins (a cluster, KubeRay) is left as its operator configured it.
"""

from __future__ import annotations

import ray

from duet.config import DuetConfig

RAY_NAMESPACE = "duet"

# Periodic work of the raylet, the GCS and every Ray process that duet's job never needs at
# Ray's default pace (docs/benchmarks/serving.md measures each step):
# - the raylet's memory monitor (every 250 ms), idle task workers to kill (200 ms; duet runs no
#   tasks) and object-store GC (100 ms; duet keeps nothing in it);
# - the object manager's timer (100 ms; duet moves no objects between nodes) and the raylet's
#   resource report (100 ms; duet's pools are fixed-size actors placed once, so a second's delay
#   in what the scheduler knows of a node costs nothing);
# - task events sent to the GCS every second by every process (they feed Ray's state API and
#   dashboard, which a local duet does not run), and Ray's own metrics collection (duet exports
#   its own and its engines' on the router's Prometheus endpoint).
# - the raylet's check of the object store's disk (every 100 ms; duet stores nothing there), the
#   backlog reports and resource loads that only feed Ray's autoscaler (every second; duet stops
#   it and sizes its pools itself), the debug-state dump to a file (10 s), and the timing of
#   every event-loop handler in every Ray process with its probes (Ray's event stats, read only
#   by its debug dump and metrics).
# Together with the stopped daemons below, an idle local Ray's daemons fell from about 0.95 to
# 0.6 s of CPU a minute, and the second group took a whole idle deployment from 1.29 to 1.03
# (2026-11-28). The memory monitor still runs, once a second.
_QUIET_HOUSEKEEPING = {
    "memory_monitor_refresh_ms": 1000,
    "kill_idle_workers_interval_ms": 5000,
    "raylet_check_gc_period_milliseconds": 5000,
    "object_manager_timer_freq_ms": 1000,
    "raylet_report_resources_period_milliseconds": 1000,
    "task_events_report_interval_ms": 5000,
    "enable_metrics_collection": False,
    "local_fs_monitor_interval_ms": 5000,
    "report_worker_backlog_interval_ms": 10000,
    "gcs_pull_resource_loads_period_milliseconds": 10000,
    "debug_dump_period_milliseconds": 0,
    "event_stats": False,
    "emit_main_service_metrics": False,
    "io_context_monitor_probe_interval_ms": 10000,
}


def _stop_unused_daemons(keep_log_monitor: bool) -> None:
    """Stop the local head's daemons that duet's job never uses (``ray.init`` has no switch for
    them; the node object that started them does):

    - the autoscaler monitor (about 0.13 s of CPU a minute, idle): a local Ray has no nodes to
      add, and duet sizes its pools itself (cluster/autoscaler/);
    - the dashboard head, which ``include_dashboard=False`` still starts in a minimal form for
      Ray's job and state APIs (0.10 s a minute);
    - the log monitor, when worker logs do not go to the driver: it only forwards them, and polls
      every log file ten times a second to do it (0.5-0.7 s a minute).
    """
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return
    node.kill_monitor(check_alive=False)
    node.kill_dashboard(check_alive=False)
    if not keep_log_monitor:
        node.kill_log_monitor(check_alive=False)


def start_ray(config: DuetConfig) -> None:
    """Join or start Ray as configured (a no-op if this process is already connected)."""
    if ray.is_initialized():
        return
    common = {"namespace": RAY_NAMESPACE, "log_to_driver": config.ray.worker_logs_to_driver}
    if config.ray.address != "local":
        ray.init(address=config.ray.address, **common)
        return
    # Ray starts worker processes at nice 15, and vLLM's engine processes inherit it from the
    # actor that spawns them: under load the router and Ray's own daemons (nice 0) then preempt
    # the engines' forward passes, which is TPOT and TTFT. Engines and serving path share the
    # cores as equals, as in a plain vLLM server.
    ray.init(
        num_cpus=config.ray.num_cpus,
        include_dashboard=False,
        _system_config={"worker_niceness": 0, **_QUIET_HOUSEKEEPING},
        **common,
    )
    _stop_unused_daemons(keep_log_monitor=config.ray.worker_logs_to_driver)
