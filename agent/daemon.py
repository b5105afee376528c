"""``nvidia-docker-plugin``, the GPU node agent: the process's entry point.

``python -m agent.daemon`` and the console script both land here. The command line is in
``agent.cli``; the running agent (start-up steps, servers, signals) in ``agent.server``;
what one run serves in ``agent.config``. docs/agent.md is the operator's page.
"""

from __future__ import annotations

from agent.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
