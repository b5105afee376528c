"""Real X.509 certificates for TLS tests, made by the ``openssl`` command line.

``make_pki(directory, server_names=SERVER_NAMES)`` writes, as PEM files:

- ``ca.pem``/``ca.key``: the CA the agent's operators run;
- ``server.pem``/``server.key``: the agent's certificate, signed by that CA, for the names
  ``127.0.0.1`` and ``localhost`` (subjectAltName, as clients check), or ``server_names``
  (``IP:::1,...``);
- ``client.pem``/``client.key``: a client certificate (extendedKeyUsage clientAuth) from the
  same CA, for mutual TLS;
- ``node.pem``/``node.key``: like the server's, for the same names, but usable as a client
  certificate too (extendedKeyUsage serverAuth and clientAuth): the Ansible role's requests
  present the agent's own certificate when the agent asks for client certificates;
- ``other-ca.pem`` and ``other-client.pem``/``other-client.key``: a second, unrelated CA and
  a client certificate it signed (a certificate the agent must not trust), and
  ``other-server.pem``/``other-server.key``: a server certificate from it (one clients must
  not trust).

``reissue_server(pki, name)`` signs another server certificate (same names) with the CA: a
rotation. ``dated_server(pki, name, not_before, not_after)`` signs one valid between two
given moments (``openssl ca``: ``openssl x509`` takes a number of days from now only), for
certificates that have expired or expire soon. ``encrypt_key(key, out, passphrase)``
writes ``key`` protected by a passphrase. Keys are EC P-256 (fast to make); validity
``VALIDITY_DAYS``, beyond the agent's expiry warning, so that only tests that ask for one
see it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

SERVER_NAMES = "IP:127.0.0.1,DNS:localhost"
VALIDITY_DAYS = "365"
_CA_CONFIG = """\
[ ca ]
default_ca = dated
[ dated ]
database = dated-index.txt
new_certs_dir = dated-certs
serial = dated-serial
default_md = sha256
policy = anything
unique_subject = no
[ anything ]
commonName = supplied
"""


@dataclass(frozen=True)
class Pki:
    root: Path

    def pem(self, name: str) -> Path:
        return self.root / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.root / f"{name}.key"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(root: Path, name: str, subject: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-days", VALIDITY_DAYS, "-subj", f"/CN={subject}",
        "-keyout", f"{name}.key", "-out", f"{name}.pem",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=root,
    )  # fmt: skip


def _leaf(root: Path, name: str, ca: str, subject: str, extensions: str) -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-subj", f"/CN={subject}", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        cwd=root,
    )  # fmt: skip
    (root / f"{name}.ext").write_text(extensions + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", VALIDITY_DAYS, "-extfile", f"{name}.ext", "-out", f"{name}.pem",
        cwd=root,
    )  # fmt: skip
    (root / f"{name}.key").chmod(0o600)


def _server_extensions(names: str = SERVER_NAMES) -> str:
    return f"subjectAltName={names}\nextendedKeyUsage=serverAuth"


def make_pki(root: Path, server_names: str = SERVER_NAMES) -> Pki:
    root.mkdir(parents=True, exist_ok=True)
    _ca(root, "ca", "nvd test CA")
    _ca(root, "other-ca", "unrelated test CA")
    _leaf(root, "server", "ca", "nvd agent", _server_extensions(server_names))
    _leaf(root, "client", "ca", "nvd operator", "extendedKeyUsage=clientAuth")
    _leaf(
        root,
        "node",
        "ca",
        "nvd node",
        f"subjectAltName={SERVER_NAMES}\nextendedKeyUsage=serverAuth,clientAuth",
    )
    _leaf(root, "other-client", "other-ca", "stranger", "extendedKeyUsage=clientAuth")
    _leaf(root, "other-server", "other-ca", "impostor", _server_extensions())
    return Pki(root)


def reissue_server(pki: Pki, name: str) -> tuple[Path, Path]:
    """Another server certificate for the same names from the same CA: ``name.pem/.key``."""
    _leaf(pki.root, name, "ca", f"nvd agent {name}", _server_extensions())
    return pki.root / f"{name}.pem", pki.root / f"{name}.key"


def _asn1_time(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y%m%d%H%M%SZ")


def dated_server(
    pki: Pki, name: str, not_before: datetime, not_after: datetime
) -> tuple[Path, Path]:
    """A server certificate for the same names from the CA, valid from ``not_before`` to
    ``not_after`` (to the second): ``name.pem/.key``."""
    root = pki.root
    (root / "dated-ca.cnf").write_text(_CA_CONFIG)
    (root / "dated-certs").mkdir(exist_ok=True)
    if not (root / "dated-serial").exists():
        (root / "dated-index.txt").write_text("")
        (root / "dated-serial").write_text("1000\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-subj", f"/CN=nvd agent {name}", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        cwd=root,
    )  # fmt: skip
    (root / f"{name}.ext").write_text(_server_extensions() + "\n")
    _openssl(
        "ca", "-batch", "-notext", "-config", "dated-ca.cnf", "-cert", "ca.pem",
        "-keyfile", "ca.key", "-in", f"{name}.csr", "-out", f"{name}.pem",
        "-startdate", _asn1_time(not_before), "-enddate", _asn1_time(not_after),
        "-extfile", f"{name}.ext",
        cwd=root,
    )  # fmt: skip
    (root / f"{name}.key").chmod(0o600)
    return root / f"{name}.pem", root / f"{name}.key"


def encrypt_key(key: Path, out: Path, passphrase: str) -> Path:
    """``key`` encrypted with ``passphrase`` (AES-256, PKCS#8 PEM), written to ``out``."""
    _openssl(
        "pkey", "-in", str(key), "-aes256", "-passout", f"pass:{passphrase}", "-out", str(out),
        cwd=out.parent,
    )  # fmt: skip
    out.chmod(0o600)
    return out


def not_after(cert: Path) -> datetime:
    """The certificate's notAfter, as openssl prints it (to check the agent's reading)."""
    done = subprocess.run(
        ["openssl", "x509", "-noout", "-enddate", "-in", str(cert)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    text = done.stdout.strip().split("=", 1)[1]  # Jan  2 00:00:00 2060 GMT
    return datetime.strptime(text, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=UTC)


def fingerprint(cert: Path) -> str:
    """The SHA-256 fingerprint openssl prints (to tell two certificates apart)."""
    done = subprocess.run(
        ["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(cert)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.strip().split("=", 1)[1]
