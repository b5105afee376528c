"""Benchmark: what one TLS connection of a fleet query costs each side, by TLS parameters.

::

    python -m tests.benchmarks.bench_fleet_tls [--handshakes 1500] [--rounds 3]

A fleet query over ``https://`` makes one TLS connection per node and asks it one to four
small GETs: its CPU cost is the handshake. This measures it without sockets: a client
``SSLObject`` (the fleet client's context: ``controller.transport.tls.client_context``, the
CA checked, the name checked) and a server ``SSLObject`` talk through memory buffers in one
thread, and each side's CPU time (``time.thread_time``) is summed over ``--handshakes``
connections of: the handshake, one request, a 1.6 KiB answer (the size of an 8-GPU node's
``/leases/json``), and the session tickets the server sends after the handshake.

Parameter sets (certificates made by ``openssl`` here; the server context is the agent's
own defaults, ``ssl.create_default_context(Purpose.CLIENT_AUTH)``):

- ``TLS 1.3, X25519, EC P-256 CA and key``: the test CA of ``tests.support.certs``, and what
  the benchmarks and tests serve;
- the same with ``num_tickets = 0`` on the server (no session tickets: what resumption costs
  a client that never resumes, as a fleet query does not: each node is asked once);
- key exchange on P-256 instead of X25519;
- an Ed25519 server key, an RSA-2048 server key (EC CA), an RSA-2048 CA and server key (what
  many operators' CAs issue);
- TLS 1.2 (ECDHE-ECDSA, and ECDHE-RSA with the RSA chain).

The rounds are interleaved (every set once, then again), and each set's median of the rounds
is printed, per side, in microseconds per connection, with the load average.
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from controller.transport.tls import TlsOptions, client_context
from tests.support.certs import SERVER_NAMES, make_pki

ANSWER = b"H" * 1600
REQUEST = b"GET /leases/json HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def _openssl(root: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True, timeout=60)


def _leaf(root: Path, name: str, ca: str, newkey: list[str]) -> None:
    """A server certificate ``name.pem/.key`` for the test names, signed by ``ca``."""
    _openssl(root, "req", *newkey, "-nodes", "-subj", f"/CN={name}", "-keyout",
             f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
    (root / f"{name}.ext").write_text(
        f"subjectAltName={SERVER_NAMES}\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(root, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey",
             f"{ca}.key", "-CAcreateserial", "-days", "30", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem")  # fmt: skip


def make_certificates(root: Path) -> None:
    """The test PKI (EC P-256), plus Ed25519 and RSA-2048 server keys from its CA, and an
    RSA-2048 CA with an RSA-2048 server key."""
    make_pki(root)
    _leaf(root, "ed25519", "ca", ["-newkey", "ed25519"])
    _leaf(root, "rsa", "ca", ["-newkey", "rsa:2048"])
    _openssl(root, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj",
             "/CN=rsa test CA", "-keyout", "rsa-ca.key", "-out", "rsa-ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    _leaf(root, "rsa-chain", "rsa-ca", ["-newkey", "rsa:2048"])


@dataclass(frozen=True)
class Setting:
    label: str
    ca: str  # the CA file's name (without .pem)
    server: str  # the server certificate's name
    tickets: int = 2  # Python's (and so the agent's) default
    tls12: bool = False
    group: str | None = None  # the client's key exchange group; None: OpenSSL's (X25519)


SETTINGS = (
    Setting("TLS 1.3, X25519, EC P-256 CA and key (the test CA)", "ca", "server"),
    Setting("  the same, the server sends no session ticket", "ca", "server", tickets=0),
    Setting("  key exchange on P-256, not X25519", "ca", "server", group="prime256v1"),
    Setting("TLS 1.3, Ed25519 server key (EC CA)", "ca", "ed25519"),
    Setting("TLS 1.3, RSA-2048 server key (EC CA)", "ca", "rsa"),
    Setting("TLS 1.3, RSA-2048 CA and server key", "rsa-ca", "rsa-chain"),
    Setting("TLS 1.2, ECDHE-ECDSA (EC P-256)", "ca", "server", tls12=True),
    Setting("TLS 1.2, ECDHE-RSA (RSA-2048 CA and key)", "rsa-ca", "rsa-chain", tls12=True),
)


def contexts(root: Path, setting: Setting) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    # a fresh client context per set (client_context caches by file: copy the CA per set)
    ca = root / f"{setting.ca}-{id(setting)}.pem"
    ca.write_bytes((root / f"{setting.ca}.pem").read_bytes())
    client = client_context(TlsOptions(ca=str(ca)))
    if setting.group:
        client.set_ecdh_curve(setting.group)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(root / f"{setting.server}.pem", root / f"{setting.server}.key")
    server.num_tickets = setting.tickets
    if setting.tls12:
        server.maximum_version = ssl.TLSVersion.TLSv1_2
    return client, server


def _client_step(tls: ssl.SSLObject, asked: bool, got: bytearray) -> bool:
    """Handshake, then the request once, then whatever answer came; True once asked."""
    try:
        if not asked:
            tls.do_handshake()  # raises "want read" until the server's flight came
            tls.write(REQUEST)
            asked = True
        while True:
            got.extend(tls.read(65536))
    except ssl.SSLWantReadError:
        return asked


def _server_step(tls: ssl.SSLObject, answered: bool) -> bool:
    """Handshake, then the answer to the request once it came; True once answered."""
    try:
        tls.do_handshake()
        if not answered and tls.read(65536):
            tls.write(ANSWER)
            answered = True
    except ssl.SSLWantReadError:
        pass
    return answered


def connection(client: ssl.SSLContext, server: ssl.SSLContext) -> tuple[float, float]:
    """One connection, both sides in memory: (client CPU s, server CPU s)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    started = time.thread_time()
    ours = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    client_s = time.thread_time() - started
    theirs = server.wrap_bio(s_in, s_out, server_side=True)
    server_s = 0.0
    got = bytearray()
    asked = answered = False
    for _ in range(20):
        started = time.thread_time()
        asked = _client_step(ours, asked, got)
        client_s += time.thread_time() - started
        if len(got) >= len(ANSWER):
            return client_s, server_s
        s_in.write(c_out.read())
        started = time.thread_time()
        answered = _server_step(theirs, answered)
        server_s += time.thread_time() - started
        c_in.write(s_out.read())
    raise RuntimeError("the connection did not complete")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handshakes", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"bench_fleet_tls: {ssl.OPENSSL_VERSION}, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="nvd-bench-tls-") as directory:
        root = Path(directory)
        make_certificates(root)
        pairs = {setting: contexts(root, setting) for setting in SETTINGS}
        costs: dict[Setting, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        for _ in range(args.rounds):
            for setting, (client, server) in pairs.items():
                for _ in range(50):  # warm up
                    connection(client, server)
                total_client = total_server = 0.0
                for _ in range(args.handshakes):
                    spent_client, spent_server = connection(client, server)
                    total_client += spent_client
                    total_server += spent_server
                costs[setting].append(
                    (total_client / args.handshakes, total_server / args.handshakes)
                )
    print(f"{'parameters':<54} {'client':>9} {'server':>9}  (CPU per connection, median)")
    for setting, rounds in costs.items():
        client_us = statistics.median(c for c, _ in rounds) * 1e6
        server_us = statistics.median(s for _, s in rounds) * 1e6
        print(f"{setting.label:<54} {client_us:6.0f} us {server_us:6.0f} us")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
