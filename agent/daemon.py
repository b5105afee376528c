"""``nvidia-docker-plugin``, the GPU node agent: the process's entry point.

``python -m agent.daemon`` and the console script both land here. The command line is in
``agent.cli``; the running agent (start-up steps, servers, signals) in ``agent.server``;
what one run serves in ``agent.config``. aiohttp is imported first, as a server needs it
(``agent.process.import_aiohttp_to_serve``). docs/agent.md is the operator's page.
"""

from __future__ import annotations

from agent.process import import_aiohttp_to_serve

import_aiohttp_to_serve()  # before anything imports aiohttp: see its docstring

from agent.cli import main  # noqa: E402 - after aiohttp's import without the client's CAs

__all__ = ["main"]

if __name__ == "__main__":
    main()
