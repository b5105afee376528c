"""A GPU worker that answers JSON frames that are not its protocol's: the client says so in
one line (``WorkerGone`` or ``GpuBackendError``), fails its callers and lets go of the pipe,
instead of raising a stray ``AttributeError`` or ``TypeError`` out of the start."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from agent.gpu import nodefile
from agent.gpu import worker_protocol as wp
from agent.gpu.backend import GpuBackendError
from agent.gpu.worker_client import WorkerClient, WorkerGone


def _hello() -> dict[str, Any]:
    node = nodefile.load("h200").info
    return {"hello": {"name": "simulated (test)", "node": wp.encode_node(node)}}


async def test_a_hello_that_is_not_an_object_fails_the_start_in_one_line() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(wp.frame({"hello": ["not", "an", "object"]}))
        with pytest.raises(GpuBackendError) as caught:
            await WorkerClient.attach(ours, start_timeout_s=5)
    assert "the GPU worker's node facts cannot be read" in str(caught.value)
    assert "\n" not in str(caught.value)


async def test_a_failed_frame_that_is_not_an_object_fails_the_start_in_one_line() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(wp.frame({"failed": "no driver"}))
        with pytest.raises(WorkerGone, match="sent garbage") as caught:
            await WorkerClient.attach(ours, start_timeout_s=5)
    assert "\n" not in str(caught.value)


async def test_an_answer_with_an_id_that_is_no_id_fails_the_call_as_garbage() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(wp.frame(_hello()))
        client = await WorkerClient.attach(ours, start_timeout_s=5, call_deadline_s=5)
        call = asyncio.ensure_future(client.ping())
        request = await asyncio.to_thread(wp.read_frame, theirs)
        assert request is not None
        assert request["op"] == wp.PING
        theirs.sendall(wp.frame({"id": [request["id"]], "ok": True}))
        with pytest.raises(WorkerGone, match=r"the GPU worker sent garbage \(\{\"id\": \[1\]"):
            await asyncio.wait_for(call, 2)  # at once, not at the 5 s deadline
        assert client.closed.is_set()
        with pytest.raises(WorkerGone, match="sent garbage"):
            await client.read_statuses()
        await client.stop(timeout_s=1)
