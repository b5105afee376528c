"""What aiohttp and the event loop report, as one rate-limited line each."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp.http_exceptions import BadStatusLine, LineTooLong

from agent.edge.error_log import HttpErrorLog, loop_exception_handler
from agent.edge.rate_limit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _bad_line() -> BadStatusLine:
    """As aiohttp's C parser raises it for ``GET /a b HTTP/1.1``."""
    return BadStatusLine(
        error="Bad status line:\n  Expected HTTP/, RTSP/ or ICE/:\n\n  b'GET /a b HTTP/1.1'\n  ^"
    )


def test_the_limiter_lets_one_line_per_key_and_interval_through_and_counts_the_rest() -> None:
    clock = Clock()
    limiter = RateLimiter(60, clock=clock)
    assert limiter.allow("10.0.0.1") == 0
    assert [limiter.allow("10.0.0.1") for _ in range(5)] == [None] * 5
    assert limiter.allow("10.0.0.2") == 0
    clock.now += 60
    assert limiter.allow("10.0.0.1") == 5
    assert limiter.allow("10.0.0.1") is None


def test_the_limiter_bounds_keys_and_lines_of_all_keys() -> None:
    clock = Clock()
    limiter = RateLimiter(60, max_keys=100, max_lines=20, clock=clock)
    allowed = [limiter.allow(f"10.0.{n // 256}.{n % 256}") for n in range(5000)]
    assert sum(a is not None for a in allowed) == 20
    assert len(limiter._windows) <= 100


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "nvidia-docker-plugin.http"]


def test_malformed_requests_are_one_warning_per_source(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    log = HttpErrorLog("REST API", tracebacks=False)
    for _ in range(50):
        log.exception("Error handling request from %s", "127.0.0.1", exc_info=_bad_line())
    too_long = LineTooLong(b"x" * 9000, 8190)
    log.debug("Error handling request from %s", "127.0.0.2", exc_info=too_long)
    log.exception("Error handling request from %s", "::1", exc_info=BadStatusLine("GET /\x1b"))
    warnings = [r.getMessage() for r in _records(caplog) if r.levelno == logging.WARNING]
    # aiohttp's own words for a long line differ by release ("... bytes (Unknown) when
    # reading" in 3.10): the line is ours around them, without the request's bytes
    warnings[1] = warnings[1].replace(" (Unknown)", "")
    assert warnings == [
        "Malformed HTTP request from 127.0.0.1 on the REST API: Bad status line; answered 400",
        "Malformed HTTP request from 127.0.0.2 on the REST API: "
        "Got more than 8190 bytes when reading; answered 400",
        "Malformed HTTP request from ::1 on the REST API: Bad status line; answered 400",
    ]
    assert all(r.exc_info is None for r in _records(caplog))
    assert all("\n" not in r.getMessage() for r in _records(caplog))


def test_a_source_without_an_address_is_named_by_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    HttpErrorLog("plugin socket", anonymous="a unix socket client").exception(
        "Error handling request from %s", "", exc_info=_bad_line()
    )
    HttpErrorLog("REST API").exception("Error handling request", exc_info=_bad_line())
    assert [r.getMessage().split(": ")[0] for r in _records(caplog)] == [
        "Malformed HTTP request from a unix socket client on the plugin socket",
        "Malformed HTTP request from an unknown address on the REST API",
    ]


def test_a_handler_that_raised_is_one_error_line_without_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = HttpErrorLog("plugin socket", tracebacks=False)
    try:
        int("²")
    except ValueError as err:
        log.exception("Error handling request from %s", "", exc_info=err)
    (record,) = _records(caplog)
    assert record.levelno == logging.ERROR
    assert record.exc_info is None
    assert record.getMessage() == (
        "Error handling request from  on the plugin socket: "
        "ValueError: invalid literal for int() with base 10: '²'"
    )


def test_with_nv_debug_the_traceback_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    log = HttpErrorLog("REST API", tracebacks=True)
    log.exception("Error handling request from %s", "127.0.0.1", exc_info=_bad_line())
    (record,) = _records(caplog)
    assert record.exc_info is not None


def test_other_lines_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    HttpErrorLog("REST API", tracebacks=False).warning("Failed to create request handler")
    assert [r.getMessage() for r in _records(caplog)] == ["Failed to create request handler"]


async def test_the_event_loop_reports_one_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NV_DEBUG", raising=False)
    loop = asyncio.get_running_loop()
    for _ in range(3):
        loop_exception_handler(
            loop,
            {
                "message": "socket.accept() out of system resource",
                "exception": OSError(24, "Too many open files"),
            },
        )
    (record,) = _records(caplog)
    assert record.getMessage() == (
        "Event loop: socket.accept() out of system resource: OSError: [Errno 24] Too many "
        "open files (NV_DEBUG=1 shows the traceback)"
    )
