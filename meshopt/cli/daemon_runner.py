"""Running a daemon from the command line; kept light (the agent imports it on every node).

What systemd expects of a daemon lives here, shared by agent and controller: log lines
journald can take as they are, SIGTERM as a clean stop (``STOPPING=1``), SIGHUP as a
reload (``RELOADING=1`` ... ``READY=1``), and watchdog keep-alives sent from the event
loop itself, so a loop that is stuck stops them and systemd restarts the service.
Readiness (``READY=1``) is the daemon's to send: only it knows when it is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TextIO

import click

from meshopt import sdnotify
from meshopt.errors import MeshoptError

log = logging.getLogger("meshopt")

# syslog priorities (sd-daemon(3)): journald reads a leading "<N>" as the line's priority.
SYSLOG_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}
PLAIN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"

Reload = Callable[[], Awaitable[str | None]]


class JournalFormatter(logging.Formatter):
    """No timestamp (journald stamps every line) and the priority as ``<N>``."""

    def __init__(self) -> None:
        super().__init__(JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        level = max((lv for lv in SYSLOG_PRIORITY if lv <= record.levelno), default=logging.DEBUG)
        return f"<{SYSLOG_PRIORITY[level]}>{super().format(record)}"


def stream_is_journal(stream: TextIO, journal_stream: str | None) -> bool:
    """True when ``stream`` is the journald stream systemd named in ``$JOURNAL_STREAM``
    ("<st_dev>:<st_ino>"); stderr redirected elsewhere by the service keeps timestamps."""
    if not journal_stream:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return journal_stream == f"{st.st_dev}:{st.st_ino}"


def setup_logging(log_level: str, stream: TextIO | None = None) -> None:
    """Log to ``stream`` (stderr): plain journald lines under systemd, timestamps else."""
    out = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(out)
    if stream_is_journal(out, os.environ.get("JOURNAL_STREAM")):
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=getattr(logging, log_level.upper()), handlers=[handler], force=True)


def set_log_level(log_level: str) -> None:
    """Change the level at runtime (a reload that changed it)."""
    logging.getLogger().setLevel(getattr(logging, log_level.upper()))


async def _watchdog(interval: float) -> None:
    """Keep-alives from the daemon's own loop: if the loop stalls, so do they."""
    while True:
        sdnotify.watchdog()
        await asyncio.sleep(interval)


async def _reload(reload: Reload | None) -> None:
    """One reload: a bad new config is one error line and the running one stays."""
    sdnotify.reloading()
    status: str | None = None
    if reload is None:
        log.info("SIGHUP: nothing to reload")
    else:
        log.info("SIGHUP: reloading the configuration")
        try:
            status = await reload()
        except MeshoptError as exc:
            log.error("reload failed, the running configuration stays: %s", exc)
            status = "reload failed: running configuration kept"
        except Exception:  # a bug in a reload must not end a daemon that routes traffic
            log.exception("reload failed, the running configuration stays")
            status = "reload failed: running configuration kept"
    sdnotify.ready(status or "running")


def run_daemon(
    log_level: str,
    daemon: Callable[[], Awaitable[None]],
    *,
    reload: Reload | None = None,
) -> None:
    """Log to stderr and run ``daemon()`` until SIGTERM or Ctrl-C, then let it clean up.

    The signal cancels the daemon's task, so its ``finally`` (withdraw routes, publish an
    offline status, restore sysctls) runs before the process exits. SIGHUP runs
    ``reload()`` (one at a time, in the loop). An error the running daemon raises is one
    log line and exit status 1 (systemd restarts it); bad configuration is found before
    this is called and exits 2 (``RestartPreventExitStatus=2``).
    """
    setup_logging(log_level)

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        reloads: list[asyncio.Task[None]] = []

        def stop() -> None:
            sdnotify.stopping()
            task.cancel()

        def hup() -> None:
            previous = reloads[-1] if reloads else None

            async def after_previous() -> None:
                if previous is not None:
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await previous
                await _reload(reload)

            reloads[:] = [t for t in reloads if not t.done()]
            reloads.append(loop.create_task(after_previous(), name="reload"))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        loop.add_signal_handler(signal.SIGHUP, hup)
        interval = sdnotify.watchdog_interval()
        keepalive = None
        if interval is not None:
            keepalive = loop.create_task(_watchdog(interval), name="watchdog")
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await daemon()
        finally:
            others = [*reloads, *([keepalive] if keepalive is not None else [])]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    try:
        asyncio.run(main())
    except MeshoptError as exc:
        log.error("stopped: %s", exc)
        raise click.exceptions.Exit(1) from None
