"""Real X.509 certificates for TLS tests, made by the ``openssl`` command line.

``make_pki(directory)`` writes, as PEM files:

- ``ca.pem``/``ca.key``: the CA the agent's operators run;
- ``server.pem``/``server.key``: the agent's certificate, signed by that CA, for the names
  ``127.0.0.1`` and ``localhost`` (subjectAltName, as clients check);
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
rotation. Keys are EC P-256 (fast to make); validity two days.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAMES = "IP:127.0.0.1,DNS:localhost"


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
        "-days", "2", "-subj", f"/CN={subject}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
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
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
        cwd=root,
    )  # fmt: skip
    (root / f"{name}.key").chmod(0o600)


def _server_extensions() -> str:
    return f"subjectAltName={SERVER_NAMES}\nextendedKeyUsage=serverAuth"


def make_pki(root: Path) -> Pki:
    root.mkdir(parents=True, exist_ok=True)
    _ca(root, "ca", "nvd test CA")
    _ca(root, "other-ca", "unrelated test CA")
    _leaf(root, "server", "ca", "nvd agent", _server_extensions())
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
