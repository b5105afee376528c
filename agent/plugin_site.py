"""Placeholder until the volume plugin lands (owned by the plugin work): the daemon's
two calls into the plugin. It serves no volumes yet."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

SOCKET_NAME = "nvidia-docker.sock"
log = logging.getLogger("nvidia-docker-plugin.plugin")


def prepare_volumes(
    volume_dir: Path,
    driver_version: str,
    *,
    ldcache: Path = Path("/etc/ld.so.cache"),
    search_path: str | None = None,
) -> object:
    log.warning("Driver volumes are not available in this build")
    return None


async def start_plugin_site(store: object, socket_dir: Path) -> web.AppRunner:
    await asyncio.to_thread(socket_dir.mkdir, parents=True, exist_ok=True)
    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    path = socket_dir / SOCKET_NAME
    path.unlink(missing_ok=True)
    await web.UnixSite(runner, str(path)).start()
    return runner
