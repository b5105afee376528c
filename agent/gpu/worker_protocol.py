"""The pipe between the daemon and its GPU worker: length-prefixed JSON frames.

A frame is a 4-byte big-endian length, then that many bytes of one UTF-8 JSON object.
Model values travel as ``codec`` writes them (the compiled ``encoder``/``decoder`` on the
hot path). The conversation (docs/gpu-backends.md, "The GPU worker"):

- the worker's first frame is ``{"hello": {"name", "node"}}`` (its backend's name and the
  node's static facts), or ``{"failed": {"message", "nvml_code"}}`` and it exits;
- the daemon asks ``{"id": N, "op": OP, ...}``; the worker answers ``{"id": N, "ok": VALUE}``
  or ``{"id": N, "error": MESSAGE}``, in any order (slow PCIe samples do not hold up
  status). ``OP`` is ``status_all``, ``pcie_all``, ``ping`` or ``stop``;
- the worker pushes, unasked, ``{"push": "event", "event": ...}`` (an NVML event),
  ``{"push": "checks", "checks": [...]}`` (a health sweep that found something new) and
  ``{"push": "driver_error", "code": N}`` (NVML says the driver went away).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from agent.gpu import codec
from agent.gpu.health import DeviceCheck, HealthEvent
from agent.gpu.model import DeviceInfo, DeviceStatus, NodeInfo, PcieThroughput

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024

STATUS_ALL = "status_all"  # every device's status, in index order: one round trip a sweep
PCIE_ALL = "pcie_all"  # every device's PCIe throughput (the slow sample, ~40 ms a GPU)
PING = "ping"  # is the worker's reader alive
STOP = "stop"  # shut NVML down and exit (answered just before)

PUSH_EVENT = "event"
PUSH_CHECKS = "checks"
PUSH_DRIVER_ERROR = "driver_error"

encode_status = codec.encoder(DeviceStatus)
decode_status = codec.decoder(DeviceStatus)
encode_throughput = codec.encoder(PcieThroughput)
decode_throughput = codec.decoder(PcieThroughput)
encode_check = codec.encoder(DeviceCheck)
decode_check = codec.decoder(DeviceCheck)
encode_event = codec.encoder(HealthEvent)
decode_event = codec.decoder(HealthEvent)


class ProtocolError(Exception):
    """A frame that is not ours (too long, not JSON): the pipe cannot be trusted any more."""


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Frames out of a byte stream fed in pieces (the daemon's asyncio side)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages: list[dict[str, Any]] = []
        while len(self._buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"a frame of {length} bytes")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(_parse(bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return messages


def read_frame(sock: socket.socket) -> dict[str, Any] | None:
    """One frame from a blocking socket (the worker's side); None at the end of the stream."""
    header = _read_exactly(sock, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {length} bytes")
    body = _read_exactly(sock, length)
    if body is None:
        return None
    return _parse(body)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def _parse(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except ValueError as err:
        raise ProtocolError(f"not JSON: {err}") from None
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    return message


def encode_node(node: NodeInfo) -> dict[str, Any]:
    return codec.to_json(node)  # type: ignore[no-any-return]


def decode_node(data: Any) -> NodeInfo:
    """The node's static facts; a device's index is its position (not in JSON)."""
    devices = tuple(
        codec.from_json(DeviceInfo, entry, f"devices[{i}]", given={"index": i})
        for i, entry in enumerate(data.get("devices") or ())
    )
    return codec.from_json(NodeInfo, data, given={"devices": devices})
