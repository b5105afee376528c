"""The client's TLS options and token file: where they come from, what a bad one says."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.errors import ControllerError
from controller.options import Options
from controller.transport.tls import TlsOptions, bearer_token, client_context
from tests.support.certs import make_pki


def test_environment_and_per_node_settings() -> None:
    env = {"NV_TLS_CA": "/ca.pem", "NV_TLS_CERT": "/c.pem", "NV_TOKEN_FILE": "/t", "NV_TLS_KEY": ""}
    base = TlsOptions.from_options(Options.build(env))
    assert base == TlsOptions(ca="/ca.pem", cert="/c.pem", key=None, token_file="/t")
    node = TlsOptions(ca="/node-ca.pem")
    assert node.over(base) == TlsOptions("/node-ca.pem", "/c.pem", None, "/t")


def test_the_first_token_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("# new one first\n\n  first-token-0123456789  \nsecond-token-0123456789\n")
    assert bearer_token(TlsOptions(token_file=str(path))) == "first-token-0123456789"
    assert bearer_token(TlsOptions()) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, "cannot read it: No such file or directory"), ("# none\n", "holds no token"),
     ("two words\n", "one word of printable ASCII")],
)  # fmt: skip
def test_bad_token_files(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / f"token-{len(text or '')}"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ControllerError, match=message):
        bearer_token(TlsOptions(token_file=str(path)))


def test_one_context_per_ca_and_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    options = TlsOptions(ca=str(pki.pem("ca")), cert=str(pki.pem("client")),
                         key=str(pki.key("client")))  # fmt: skip
    assert client_context(options) is client_context(TlsOptions(
        ca=str(pki.pem("ca")), cert=str(pki.pem("client")), key=str(pki.key("client")),
        token_file="/another/token",
    ))  # fmt: skip
    with pytest.raises(ControllerError, match="cannot be used: key values mismatch"):
        client_context(TlsOptions(cert=str(pki.pem("client")), key=str(pki.key("server"))))
    with pytest.raises(ControllerError, match="needs its certificate too"):
        client_context(TlsOptions(key=str(pki.key("client"))))
    (tmp_path / "junk.pem").write_text("junk\n")
    with pytest.raises(ControllerError, match=r"TLS CA file .*junk.pem \(--ca, NV_TLS_CA\)"):
        client_context(TlsOptions(ca=str(tmp_path / "junk.pem")))
