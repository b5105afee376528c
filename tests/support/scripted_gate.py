"""A start gate (``plugin.authz.Gate``) for tests of the plugin socket: it records what it is
asked and refuses with ``refusal`` (None: allows)."""

from __future__ import annotations

from plugin.authz import Ask


class ScriptedGate:
    def __init__(self) -> None:
        self.asked: list[Ask] = []
        self.refusal: str | None = None

    async def __call__(self, ask: Ask) -> str | None:
        self.asked.append(ask)
        return self.refusal
