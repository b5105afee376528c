"""The token file's bounds and the digest lookup (``agent.edge.tokens``): what is refused, with
which line, and that only digests are kept and looked up."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest

from agent.edge.tokens import (
    MAX_TOKEN_CHARS,
    MAX_TOKENS,
    TOKEN_FILE_LIMIT,
    TokenFileError,
    TokenStore,
    read_tokens,
    token_digests,
)
from agent.files import read_regular

GOOD = "g" * 32
NEXT = "n" * 32


def _tokens(count: int, width: int = 40) -> str:
    return "".join(f"{i:0{width}d}\n" for i in range(count))


def test_the_store_keeps_digests_and_looks_them_up(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{GOOD}\n{NEXT}\n{GOOD}\n")
    store = TokenStore(path)
    assert store.count == 2  # the same token twice is one token
    assert store._digests == {hashlib.sha256(t.encode()).digest() for t in (GOOD, NEXT)}
    assert GOOD.encode() not in store._digests
    assert store.accepts(GOOD.encode())
    assert store.accepts(NEXT.encode())
    for wrong in (b"", GOOD[:-1].encode(), (GOOD + "x").encode(), GOOD.upper().encode()):
        assert not store.accepts(wrong)
    # the digest itself is not a token
    assert not store.accepts(hashlib.sha256(GOOD.encode()).digest())
    assert not store.accepts(b"x" * (MAX_TOKEN_CHARS + 1))


def test_a_presented_token_is_hashed_once_whatever_the_number_of_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup's work does not grow with the file: one digest, one set lookup."""
    path = tmp_path / "tokens"
    path.write_text(_tokens(MAX_TOKENS))
    store = TokenStore(path)
    assert store.count == MAX_TOKENS
    hashed: list[bytes] = []
    real = hashlib.sha256

    def counting(data: bytes) -> hashlib._Hash:
        hashed.append(data)
        return real(data)

    monkeypatch.setattr(hashlib, "sha256", counting)
    assert not store.accepts(b"w" * 40)
    assert store.accepts(f"{MAX_TOKENS - 1:040d}".encode())
    assert hashed == [b"w" * 40, f"{MAX_TOKENS - 1:040d}".encode()]
    assert token_digests([b"a" * 16]) == {real(b"a" * 16).digest()}


def test_the_bounds_are_accepted_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(_tokens(MAX_TOKENS - 1) + "t" * MAX_TOKEN_CHARS + "\n")
    assert len(read_tokens(path)) == MAX_TOKENS
    assert path.stat().st_size <= TOKEN_FILE_LIMIT


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_tokens(MAX_TOKENS + 1), f"line {MAX_TOKENS + 1}: more than {MAX_TOKENS} tokens"),
        (
            f"{GOOD}\n" + "x" * (MAX_TOKEN_CHARS + 1) + "\n",
            f"line 2: the token is {MAX_TOKEN_CHARS + 1} characters, more than the "
            f"{MAX_TOKEN_CHARS} a token may be",
        ),
        ("#" * (TOKEN_FILE_LIMIT + 1) + "\n", "is 1.0 MiB, more than the 1.0 MiB it may be"),
    ],
)
def test_a_file_beyond_the_bounds_is_refused_with_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(TokenFileError) as refused:
        read_tokens(path)
    assert f"--token-file {path}" in str(refused.value)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    os.mkfifo(path)  # no writer: an open that blocked would hang the test
    with pytest.raises(TokenFileError, match="is a FIFO, not a regular file") as refused:
        read_tokens(path)
    assert "at most" not in str(refused.value)  # its size is not what is wrong


def test_an_unreadable_file_is_not_said_to_hold_too_many_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tokens"
    path.write_text("a" * 32 + "\n")
    real_open = os.open

    def refused_open(name: object, flags: int, *args: object, **kwargs: object) -> int:
        if name == path:
            raise PermissionError(13, "Permission denied")
        return real_open(name, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refused_open)
    with pytest.raises(TokenFileError) as refused:
        read_tokens(path)
    assert str(refused.value) == (
        f"--token-file {path}: Permission denied: give a readable file of tokens, one per line"
    )


async def test_reload_reads_in_a_thread_and_keeps_the_tokens_when_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{GOOD}\n")
    path.chmod(0o600)
    store = TokenStore(path)
    threads: list[int] = []
    real = read_regular

    def recording(path: Path, *, limit: int, what: str, follow: bool = True) -> bytes:
        threads.append(threading.get_ident())
        return real(path, limit=limit, what=what, follow=follow)

    monkeypatch.setattr("agent.edge.tokens.read_regular", recording)
    path.write_text(f"{GOOD}\n{NEXT}\n")
    with caplog.at_level(logging.INFO):
        await store.reload()
    assert store.accepts(NEXT.encode())
    assert threads
    assert threading.get_ident() not in threads
    assert f"Reload: 2 token(s) read again from {path}" in caplog.text

    path.write_text(_tokens(MAX_TOKENS + 1))
    with pytest.raises(TokenFileError, match="more than 4096 tokens"):
        await store.reload()
    assert store.accepts(GOOD.encode())
    assert store.accepts(NEXT.encode())
    assert store.count == 2
