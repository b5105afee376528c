"""``controller.errors.Failure``: an enum's members without ``enum`` (the wrapper's pass-through
imports this module: docs/nvidia-docker.md, "Speed")."""

from __future__ import annotations

import copy
import pickle

from controller.errors import Failure, NodeError

# The kinds and the words a fleet table shows, as they were when Failure was an enum.Enum.
WORDS = {
    "REFUSED": "connection refused",
    "UNKNOWN_HOST": "unknown host",
    "CANNOT_CONNECT": "cannot connect",
    "TIMEOUT": "timeout",
    "DISCONNECTED": "disconnected",
    "HTTP_STATUS": "HTTP status",
    "NOT_AN_AGENT": "not an agent",
    "SSH_REFUSED": "SSH refused",
    "SSH_HOST_KEY_UNKNOWN": "SSH host key unknown",
    "SSH_HOST_KEY_CHANGED": "SSH host key CHANGED",
    "SSH_LOGIN_FAILED": "SSH login failed",
    "SSH_NO_AGENT": "no agent behind SSH",
    "SSH_ERROR": "SSH error",
    "TLS_UNTRUSTED": "certificate not trusted",
    "TLS_NAME_MISMATCH": "certificate name mismatch",
    "TLS_CLIENT_CERT_REFUSED": "client certificate refused",
    "TLS_ERROR": "TLS error",
    "TOKEN_REFUSED": "token refused",
    "ERROR": "error",
}


def test_members_are_the_enum_s() -> None:
    members = {name: getattr(Failure, name) for name in WORDS}
    assert {name: m.value for name, m in members.items()} == WORDS
    assert all(m.name == name and isinstance(m, Failure) for name, m in members.items())
    assert len({id(m) for m in members.values()}) == len(WORDS)
    assert repr(Failure.TIMEOUT) == "<Failure.TIMEOUT: 'timeout'>"


def test_members_are_compared_and_kept_by_identity() -> None:
    member = Failure.TLS_UNTRUSTED
    assert member == Failure.TLS_UNTRUSTED
    assert member != Failure.TLS_ERROR
    assert {member: 1}[Failure.TLS_UNTRUSTED] == 1
    assert copy.copy(member) is member
    assert copy.deepcopy(member) is member
    assert pickle.loads(pickle.dumps(member)) is member
    assert NodeError("n1", "x").label == "error"
