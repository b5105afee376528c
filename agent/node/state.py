"""The node as the agent serves it now, and who must hear when it changes.

The daemon builds one ``NodeState`` at start. Whatever follows the node's life (a driver
change, a GPU's health) builds new ``NodeFacts`` and calls ``replace``; the REST handlers
read ``state.facts`` at every request, so an answer is always rendered from one consistent
snapshot. Listeners (the CDI spec writer, the lease table) are called in the event loop, in
the order they subscribed, after the swap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.node.facts import NodeFacts

log = logging.getLogger("nvidia-docker-plugin.node")

Listener = Callable[[NodeFacts], None]


class NodeState:
    def __init__(self, facts: NodeFacts) -> None:
        self._facts = facts
        self._listeners: list[Listener] = []

    @property
    def facts(self) -> NodeFacts:
        return self._facts

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(facts)`` after every ``replace``."""
        self._listeners.append(listener)

    def replace(self, facts: NodeFacts) -> None:
        """Serve ``facts`` from now on and tell every listener; a failing listener is logged
        and does not stop the others."""
        self._facts = facts
        for listener in self._listeners:
            try:
                listener(facts)
            except Exception:
                log.exception("A listener of node changes failed")
