"""Running a daemon from the command line; kept light (the agent imports it on every node)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable


def run_daemon(log_level: str, daemon: Callable[[], Awaitable[None]]) -> None:
    """Log to stderr and run ``daemon()`` until SIGTERM or Ctrl-C, then let it clean up.

    The signal cancels the daemon's task, so its ``finally`` (withdraw routes, publish an
    offline status) runs before the process exits.
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await daemon()

    asyncio.run(main())
