"""The client's TLS options and token file: where they come from, what a bad one says."""

from __future__ import annotations

import subprocess
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


def test_encrypted_client_key_is_refused_without_a_prompt(tmp_path: Path) -> None:
    """OpenSSL would prompt 'Enter PEM pass phrase:' on the terminal (a fleet query or cron
    job has nobody to type it) and then fail with a bare 'Invalid argument'."""
    pki = make_pki(tmp_path / "pki")
    encrypted = tmp_path / "client-encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki.key("client")), "-out", str(encrypted),
         "-aes256", "-passout", "pass:secret"],
        check=True, capture_output=True,
    )  # fmt: skip
    options = TlsOptions(cert=str(pki.pem("client")), key=str(encrypted))
    with pytest.raises(ControllerError) as info:
        client_context(options)
    message = str(info.value)
    assert f"TLS client key {encrypted} (--cert/--key, NV_TLS_CERT/NV_TLS_KEY)" in message
    assert "is encrypted (passphrase-protected)" in message


def test_missing_client_certificate_names_its_setting(tmp_path: Path) -> None:
    missing = tmp_path / "op.pem"
    with pytest.raises(ControllerError) as info:
        client_context(TlsOptions(cert=str(missing)))
    assert (
        str(info.value) == f"TLS client certificate (--cert, NV_TLS_CERT) {missing} does not exist"
    )
