"""duet's log lines: one format in every process, duet's own events at INFO.

Other libraries log at WARNING and above, as before. duet's own loggers (``duet.*``) also log
at INFO: the few events an operator reads a log for besides warnings and errors (the
autoscaler's scaling, a rebalancer's move, a worker channel or a front end that reconnected).
Called by the CLI and in each process duet starts where nothing else configures logging (the
control plane, front doors and workers as Ray actors, and vLLM's engine core through duet's
plugin): without it, a Ray actor's INFO lines went nowhere (Python's last-resort handler takes
warnings only), so an autoscaler running apart from ``duet serve`` scaled silently.
"""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """Idempotent: a process whose logging is already set up keeps its handlers."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=FORMAT)
    logging.getLogger("duet").setLevel(logging.INFO)
