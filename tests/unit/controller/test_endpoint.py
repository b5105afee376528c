"""The NV_HOST grammar and the environment rules of docs/nvidia-docker.md (``NV_HOST``)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from controller.errors import EndpointError
from controller.options import Options
from controller.transport import endpoint as endpoint_module
from controller.transport.endpoint import LOCAL, Endpoint, parse_endpoint, resolve


def parse(value: str, *, user: str = "alice", **how: Any) -> Endpoint:
    """``parse_endpoint`` with the edge's default SSH user (``Options.user``)."""
    return parse_endpoint(value, user=user, **how)


def env(values: dict[str, str]) -> Options:
    """The options an edge would build from this environment (a HOME with no docker config)."""
    return Options.build({"HOME": "/nonexistent", **values})


def http(host: str, port: int = 3476, source: str = "argument") -> Endpoint:
    return Endpoint(transport="http", host=host, http_port=port, source=source)


def ssh(host: str, user: str, ssh_port: int = 22, http_port: int = 3476) -> Endpoint:
    return Endpoint(transport="ssh", host=host, ssh_port=ssh_port, http_port=http_port, user=user)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # no scheme: tcp, which is HTTP to the agent; trailing colon and bare host
        ("10.0.0.1:", http("10.0.0.1")),
        ("10.0.0.1", http("10.0.0.1")),
        ("node-1.example.com:", http("node-1.example.com")),
        ("gpu_node", http("gpu_node")),
        ("tcp://10.0.0.1:", http("10.0.0.1")),
        ("TCP://10.0.0.1:", http("10.0.0.1")),
        # a lone port after an http/tcp host is the HTTP port, with or without the colon
        ("http://127.0.0.1:8080", http("127.0.0.1", 8080)),
        ("http://127.0.0.1:8080:", http("127.0.0.1", 8080)),
        # the old two-port form: the SSH port means nothing for http and is skipped
        ("tcp://node1:22:80", http("node1", 80)),
        ("http://node1::80", http("node1", 80)),
        (":", http("localhost")),
        (":22:80", http("localhost", 80)),
        ("[::1]:", http("::1")),
        ("http://[fd00::5]:9000", http("fd00::5", 9000)),
        # ssh: port 1 is SSH, port 2 the agent on the node's localhost
        ("ssh://10.0.0.1:", ssh("10.0.0.1", "alice")),
        ("ssh://10.0.0.1", ssh("10.0.0.1", "alice")),
        ("ssh://user@10.0.0.1:22:80", ssh("10.0.0.1", "user", 22, 80)),
        ("ssh://admin@node2:2222", ssh("node2", "admin", 2222)),
        ("ssh://admin@node2:2222:", ssh("node2", "admin", 2222)),
        ("ssh://node2::80", ssh("node2", "alice", 22, 80)),
        ("ssh://", ssh("localhost", "alice")),
        ("ssh://admin@[fd00::5]:22:80", ssh("fd00::5", "admin", 22, 80)),
        ("SSH://svc.deploy$@n:", ssh("n", "svc.deploy$")),
        ("unix:///var/run/docker.sock", LOCAL),
        ("unix://", LOCAL),
    ],
)
def test_grammar(value: str, expected: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER", "alice")
    got = parse(value)
    assert (got.transport, got.host, got.http_port, got.user) == (
        expected.transport,
        expected.host,
        expected.http_port,
        expected.user,
    )
    if expected.transport == "ssh":
        assert got.ssh_port == expected.ssh_port


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("ftp://10.0.0.1:", "unknown scheme ftp://"),
        ("https://admin@10.0.0.1:", "a user name only makes sense with ssh://"),
        ("npipe:////./pipe/docker_engine", "unknown scheme npipe://"),
        ("10.0.0.1:22:80:90", "at most two ports"),
        ("10.0.0.1:0", "bad port '0'"),
        ("10.0.0.1:65536", "bad port '65536'"),
        ("10.0.0.1:ssh", "bad port 'ssh'"),
        ("10.0.0.1:-1", "bad port '-1'"),
        ("bad host:", "bad host 'bad host'"),
        ("ho$t:", "bad host"),
        ("::1", "write an IPv6 address in brackets"),
        ("fd00::1:", "write an IPv6 address in brackets"),
        ("[fd00::1", "missing ]"),
        ("[node1]:", "not an IPv6 address"),
        ("[::1]x", "expected : after the ]"),
        ("http://admin@10.0.0.1:", "a user name only makes sense with ssh://"),
        ("ssh://bad user@h:", "bad user name"),
        ("ssh://@h:", "bad user name"),
        ("tcp://10.0.0.1:2375/v1", "a path is not allowed"),
    ],
)
def test_invalid_values_say_what_to_do(value: str, why: str) -> None:
    with pytest.raises(EndpointError) as info:
        parse(value, source="NV_HOST")
    message = str(info.value)
    assert message.startswith(f"invalid remote host URI {value!r} (NV_HOST): ")
    assert why in message
    assert "e.g. ssh://admin@10.0.0.1:" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "value",
    [
        "http://node1:3476",
        "https://node1:3476",
        "http://10.0.0.5:3476",
        "http://node1",
        "tcp://10.0.0.1:2375",
        "http://[fd00::5]:9000",
        "ssh://admin@node2:2222:80",
        "ssh://node2",
        "node1:",
        "[::1]:",
    ],
)
def test_a_trailing_slash_names_the_same_node(value: str) -> None:
    """A URL pasted with its root path: 1.0 ignored the path; the node is the same."""
    assert parse(value + "/") == parse(value)
    assert parse(value + "/", docker_address=True) == parse(value, docker_address=True)


@pytest.mark.parametrize(
    "value",
    [
        "http://node1:3476//",
        "http://node1:3476/gpu",
        "http://node1:3476/gpu/",
        "https://node1/?x=1",
        "ssh://admin@node2:22/home",
        "http://node1/:3476",
        "http:///",
        "/",
    ],
)
def test_any_other_path_is_refused(value: str) -> None:
    with pytest.raises(EndpointError, match="a path is not allowed after the host"):
        parse(value)


@pytest.mark.parametrize(
    ("value", "host", "node", "uri"),
    [
        # as ip, ssh and ping write a zone, and as RFC 6874 writes it in a URL
        ("http://[fe80::1%eth0]:3476", "fe80::1%eth0", "[fe80::1%eth0]:3476",
         "http://[fe80::1%25eth0]:3476"),
        ("http://[fe80::1%25eth0]:3476", "fe80::1%eth0", "[fe80::1%eth0]:3476",
         "http://[fe80::1%25eth0]:3476"),
        ("https://[FE80::1%25enp3s0]/", "FE80::1%enp3s0", "[FE80::1%enp3s0]:3476",
         "https://[FE80::1%25enp3s0]:3476"),
        ("[fe80::1%br-1a.2]:", "fe80::1%br-1a.2", "[fe80::1%br-1a.2]:3476",
         "http://[fe80::1%25br-1a.2]:3476"),
        ("ssh://admin@[fe80::1%25eth0]:2222:80", "fe80::1%eth0",
         "admin@[fe80::1%eth0]:2222", "ssh://admin@[fe80::1%25eth0]:2222:80"),
        # numeric zones (interface indexes); 25 alone is the zone 25, %2525 its URL form
        ("http://[fe80::1%2]:", "fe80::1%2", "[fe80::1%2]:3476", "http://[fe80::1%252]:3476"),
        ("http://[fe80::1%25]:", "fe80::1%25", "[fe80::1%25]:3476",
         "http://[fe80::1%2525]:3476"),
        ("http://[fe80::1%25251]:", "fe80::1%251", "[fe80::1%251]:3476",
         "http://[fe80::1%25251]:3476"),
    ],
)  # fmt: skip
def test_ipv6_zones(value: str, host: str, node: str, uri: str) -> None:
    """The host keeps the zone as sockets and SSH take it; the Host header and the name in
    the agent's certificate never carry it; uri() reads back to the same endpoint."""
    got = parse(value)
    assert (got.host, got.node, got.uri()) == (host, node, uri)
    assert got.server_name == host.partition("%")[0]
    assert got.host_header == f"[{got.server_name}]:{got.http_port}"
    assert parse(got.uri()) == got


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("http://[fe80::1%]:", "bad zone '' after the % of fe80::1"),
        ("http://[fe80::1%eth 0]:", "bad zone 'eth 0'"),
        ("http://[fe80::1%eth0%1]:", "bad zone 'eth0%1'"),
        ("http://[fe80::1%25%65th0]:", "bad zone '%65th0'"),
        ("http://[fe80::1%eth/0]:", "a path is not allowed"),
        ("fe80::1%eth0", "write an IPv6 address in brackets"),
        ("http://[node1%eth0]:", "'node1%eth0' is not an IPv6 address"),
    ],
)
def test_bad_zones_are_refused_in_one_line(value: str, why: str) -> None:
    with pytest.raises(EndpointError) as info:
        parse(value)
    assert why in str(info.value)
    assert "\n" not in str(info.value)


def test_a_host_without_zone_is_its_own_server_name() -> None:
    assert parse("http://[fd00::5]:9000").host_header == "[fd00::5]:9000"
    assert parse("https://node1").server_name == "node1"
    assert parse("10.0.0.1:").host_header == "10.0.0.1:3476"


@pytest.mark.parametrize(
    ("value", "port", "uri"),
    [
        ("https://10.0.0.1:", 3476, "https://10.0.0.1:3476"),
        ("https://node1:8443", 8443, "https://node1:8443"),
        ("HTTPS://[fd00::5]:22:9443", 9443, "https://[fd00::5]:9443"),
    ],
)
def test_https_is_http_with_tls(value: str, port: int, uri: str) -> None:
    got = parse(value)
    assert (got.transport, got.tls, got.http_port) == ("http", True, port)
    assert got.agent_url == uri
    assert got.uri() == uri
    assert parse(got.uri()) == got
    assert "route      HTTPS to " + uri in got.describe()
    assert parse(value.lower().replace("https", "http")).tls is False


def test_ssh_defaults_name_what_was_not_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ~/.ssh/config may fill in: the user and the SSH port, when not written."""
    monkeypatch.setenv("USER", "alice")
    assert parse("ssh://gpu1").ssh_defaults == {"user", "ssh_port"}
    assert parse("ssh://bob@gpu1").ssh_defaults == {"ssh_port"}
    assert parse("ssh://gpu1:2222:80").ssh_defaults == {"user"}
    assert parse("ssh://bob@gpu1::80").ssh_defaults == {"ssh_port"}
    assert parse("gpu1:").ssh_defaults == frozenset()


def test_docker_address_always_uses_the_agent_port() -> None:
    # DOCKER_HOST's port is docker's, not the agent's
    got = parse("tcp://10.0.0.1:2375", docker_address=True)
    assert (got.transport, got.host, got.http_port) == ("http", "10.0.0.1", 3476)
    got = parse("ssh://root@10.0.0.1:2222", docker_address=True)
    assert (got.transport, got.ssh_port, got.http_port, got.user) == ("ssh", 2222, 3476, "root")


def test_uri_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER", "alice")
    for value in ("ssh://bob@[fd00::5]:2222:80", "http://10.0.0.1:9", "10.0.0.1:", "ssh://n:"):
        once = parse(value)
        assert parse(once.uri()) == once


def test_endpoint_is_a_frozen_value() -> None:
    endpoint = parse("10.0.0.1:")
    with pytest.raises(AttributeError):
        endpoint.host = "other"  # type: ignore[misc]
    assert endpoint == parse("10.0.0.1")
    assert hash(endpoint) == hash(parse("10.0.0.1"))


def test_urls_and_names() -> None:
    remote = parse("http://[fd00::5]:9000")
    assert remote.agent_url == "http://[fd00::5]:9000"
    assert remote.node == "[fd00::5]:9000"
    tunnel = parse("ssh://admin@node2:2222:80")
    assert tunnel.agent_url == "http://localhost:80"  # as the node itself sees it
    assert tunnel.node == "admin@node2:2222"
    assert "SSH to node2:2222 as admin, then http://localhost:80 on that node" in (
        tunnel.describe()
    )
    assert LOCAL.agent_url == "http://localhost:3476"
    assert tunnel.as_dict()["ssh_port"] == 2222


# --- resolve(): the environment rules -------------------------------------------------------


def test_neither_set_means_local() -> None:
    assert resolve(env({})) == (LOCAL, None)
    assert resolve(env({"NV_HOST": "", "DOCKER_HOST": ""})) == (LOCAL, None)


def test_nv_host_wins_over_docker_host() -> None:
    values = {"USER": "alice", "DOCKER_HOST": "10.0.0.1:", "NV_HOST": "ssh://user@10.0.0.1:22:80"}
    endpoint, warning = resolve(env(values))
    assert (endpoint.transport, endpoint.user, endpoint.ssh_port, endpoint.http_port) == (
        "ssh",
        "user",
        22,
        80,
    )
    assert endpoint.source == "NV_HOST"
    assert warning is None


def test_docker_host_alone_goes_to_port_3476() -> None:
    endpoint, warning = resolve(env({"DOCKER_HOST": "tcp://10.0.0.1:2375"}))
    assert endpoint == http("10.0.0.1", 3476, source="DOCKER_HOST")
    assert warning is None
    # docs/nvidia-docker.md's example: DOCKER_HOST='10.0.0.1:' nvidia-docker run cuda
    assert resolve(env({"DOCKER_HOST": "10.0.0.1:"}))[0].agent_url == "http://10.0.0.1:3476"


def test_docker_host_unix_socket_is_local() -> None:
    endpoint, _ = resolve(env({"DOCKER_HOST": "unix:///var/run/docker.sock"}))
    assert endpoint.is_local


def test_nv_host_without_docker_host_warns() -> None:
    endpoint, warning = resolve(env({"USER": "u", "NV_HOST": "ssh://10.0.0.1:"}))
    assert endpoint.transport == "ssh"
    assert warning is not None
    assert "NV_HOST is set but DOCKER_HOST is not" in warning


def test_docker_host_option_counts_as_docker_address() -> None:
    # docs/nvidia-docker.md's example: NV_HOST='ssh://10.0.0.1:' nvidia-docker -H 10.0.0.1: run cuda
    endpoint, warning = resolve(
        env({"USER": "u", "NV_HOST": "ssh://10.0.0.1:"}), docker_host_option="10.0.0.1:"
    )
    assert (endpoint.transport, endpoint.ssh_port, warning) == ("ssh", 22, None)
    # -H without NV_HOST selects the node like DOCKER_HOST, and wins over it (as in docker)
    endpoint, _ = resolve(
        env({"DOCKER_HOST": "10.9.9.9:"}), docker_host_option="tcp://10.0.0.2:2375"
    )
    assert (endpoint.host, endpoint.http_port, endpoint.source) == ("10.0.0.2", 3476, "-H")
    endpoint, _ = resolve(env({}), docker_host_option="unix:///run/docker.sock")
    assert endpoint.is_local


def test_bad_docker_host_names_its_source() -> None:
    with pytest.raises(EndpointError, match=r"\(DOCKER_HOST\)"):
        resolve(env({"DOCKER_HOST": "fd://"}))


def test_default_user_is_user_variable() -> None:
    endpoint, _ = resolve(env({"NV_HOST": "ssh://n:", "USER": "carol", "DOCKER_HOST": "n:"}))
    assert endpoint.user == "carol"
    endpoint, _ = resolve(env({"NV_HOST": "ssh://n:", "DOCKER_HOST": "n:"}))
    assert endpoint.user  # falls back to the name of the current uid


def test_an_engine_that_ignores_docker_host_gets_no_warning() -> None:
    """Podman takes its engine from its own settings: no warning about DOCKER_HOST."""
    options = env({"USER": "u", "NV_HOST": "http://10.0.0.1:3476"})
    assert resolve(options)[1] is not None
    endpoint, warning = resolve(options, docker_reads_docker_host=False)
    assert (endpoint.host, warning) == ("10.0.0.1", None)


def test_an_engine_that_ignores_docker_host_gets_the_local_gpus_without_nv_host() -> None:
    """Podman runs the container on its own engine whatever DOCKER_HOST or docker's context
    says: its GPUs are the local node's unless NV_HOST names another."""
    options = env({"USER": "u", "DOCKER_HOST": "tcp://10.0.0.1:2376", "DOCKER_CONTEXT": "gpu7"})
    assert resolve(options)[0].host == "10.0.0.1"  # docker: the node docker would use
    assert resolve(options, docker_host_option="tcp://10.0.0.2:2376")[0].host == "10.0.0.2"
    podman = resolve(
        options, docker_host_option="tcp://10.0.0.2:2376", docker_reads_docker_host=False
    )
    assert podman == (LOCAL, None)


def test_the_character_checks_are_the_grammar_s_regular_expressions() -> None:
    """parse_endpoint checks characters without re (docs/nvidia-docker.md, "Speed"): each
    check accepts exactly what its regular expression accepted (up to re's $, which also
    matched before a final newline: that newline is refused now)."""
    import re  # noqa: PLC0415

    checks = [
        (endpoint_module._is_scheme, r"[A-Za-z][A-Za-z0-9+.-]*"),
        (endpoint_module._is_user, r"[A-Za-z0-9._][A-Za-z0-9._-]*\$?"),
        (endpoint_module._is_name, r"[A-Za-z0-9_.-]+"),
        (endpoint_module._is_port, r"[0-9]{1,5}"),
    ]
    alphabet = "aZ09-_.+$:/@ é٣\t"
    picker = random.Random(11)
    samples = ["", "a", "$", "a$", "a$$", "-a", "123456", "12345", "٣", "http", "h+t.t-p", "9x"]
    samples += ["".join(picker.choice(alphabet) for _ in range(picker.randrange(8)))
                for _ in range(5000)]  # fmt: skip
    for check, pattern in checks:
        for text in samples:
            assert check(text) is bool(re.fullmatch(pattern, text)), (pattern, text)
    assert parse("http://node-1.example:80").host == "node-1.example"
    with pytest.raises(EndpointError, match="bad host"):
        parse("http://node\n:80")
