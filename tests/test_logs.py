"""Log lines in a process duet configures (duet/logs.py): duet's own events at INFO, other
libraries' at WARNING, one format."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
from duet.logs import configure_logging
configure_logging()
configure_logging()  # twice, as a CLI that starts an actor in its own process may
logging.getLogger("duet.cluster.autoscaler.live").info("autoscaler: decode 1 -> 2")
logging.getLogger("duet.router.pools").debug("not shown")
logging.getLogger("urllib3").info("not shown either")
logging.getLogger("urllib3").warning("a library's warning")
"""


def test_duets_info_lines_show_and_other_libraries_stay_at_warning():
    """In a fresh process, as a Ray actor's is: before, nothing configured logging there and
    the autoscaler's scaling (INFO) was never printed."""
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert result.stderr.splitlines() == [
        "INFO duet.cluster.autoscaler.live: autoscaler: decode 1 -> 2",
        "WARNING urllib3: a library's warning",
    ]
