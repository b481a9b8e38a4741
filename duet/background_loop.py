"""An asyncio event loop in a thread of its own, for synchronous code that drives duet's async
objects (a deployment, a control plane) and must keep them running meanwhile: tests, and
benchmarks that inject faults while the control plane's watch runs on that loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any, timeout: float | None = None) -> Any:
        """Run ``coroutine`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
