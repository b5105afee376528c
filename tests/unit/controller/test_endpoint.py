"""The NV_HOST grammar and the environment rules of docs/nvidia-docker.md (``NV_HOST``)."""

from __future__ import annotations

import pytest

from controller.errors import EndpointError
from controller.transport.endpoint import LOCAL, Endpoint, parse_endpoint, resolve


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
    got = parse_endpoint(value)
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
        parse_endpoint(value, source="NV_HOST")
    message = str(info.value)
    assert message.startswith(f"invalid remote host URI {value!r} (NV_HOST): ")
    assert why in message
    assert "e.g. ssh://admin@10.0.0.1:" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("value", "port", "uri"),
    [
        ("https://10.0.0.1:", 3476, "https://10.0.0.1:3476"),
        ("https://node1:8443", 8443, "https://node1:8443"),
        ("HTTPS://[fd00::5]:22:9443", 9443, "https://[fd00::5]:9443"),
    ],
)
def test_https_is_http_with_tls(value: str, port: int, uri: str) -> None:
    got = parse_endpoint(value)
    assert (got.transport, got.tls, got.http_port) == ("http", True, port)
    assert got.agent_url == uri
    assert got.uri() == uri
    assert parse_endpoint(got.uri()) == got
    assert "route      HTTPS to " + uri in got.describe()
    assert parse_endpoint(value.lower().replace("https", "http")).tls is False


def test_ssh_defaults_name_what_was_not_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ~/.ssh/config may fill in: the user and the SSH port, when not written."""
    monkeypatch.setenv("USER", "alice")
    assert parse_endpoint("ssh://gpu1").ssh_defaults == {"user", "ssh_port"}
    assert parse_endpoint("ssh://bob@gpu1").ssh_defaults == {"ssh_port"}
    assert parse_endpoint("ssh://gpu1:2222:80").ssh_defaults == {"user"}
    assert parse_endpoint("ssh://bob@gpu1::80").ssh_defaults == {"ssh_port"}
    assert parse_endpoint("gpu1:").ssh_defaults == frozenset()


def test_docker_address_always_uses_the_agent_port() -> None:
    # DOCKER_HOST's port is docker's, not the agent's
    got = parse_endpoint("tcp://10.0.0.1:2375", docker_address=True)
    assert (got.transport, got.host, got.http_port) == ("http", "10.0.0.1", 3476)
    got = parse_endpoint("ssh://root@10.0.0.1:2222", docker_address=True)
    assert (got.transport, got.ssh_port, got.http_port, got.user) == ("ssh", 2222, 3476, "root")


def test_uri_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER", "alice")
    for value in ("ssh://bob@[fd00::5]:2222:80", "http://10.0.0.1:9", "10.0.0.1:", "ssh://n:"):
        once = parse_endpoint(value)
        assert parse_endpoint(once.uri()) == once


def test_endpoint_is_a_frozen_value() -> None:
    endpoint = parse_endpoint("10.0.0.1:")
    with pytest.raises(AttributeError):
        endpoint.host = "other"  # type: ignore[misc]
    assert endpoint == parse_endpoint("10.0.0.1")
    assert hash(endpoint) == hash(parse_endpoint("10.0.0.1"))


def test_urls_and_names() -> None:
    remote = parse_endpoint("http://[fd00::5]:9000")
    assert remote.agent_url == "http://[fd00::5]:9000"
    assert remote.node == "[fd00::5]:9000"
    tunnel = parse_endpoint("ssh://admin@node2:2222:80")
    assert tunnel.agent_url == "http://localhost:80"  # as the node itself sees it
    assert tunnel.node == "admin@node2:2222"
    assert "SSH to node2:2222 as admin, then http://localhost:80 on that node" in (
        tunnel.describe()
    )
    assert LOCAL.agent_url == "http://localhost:3476"
    assert tunnel.as_dict()["ssh_port"] == 2222


# --- resolve(): the environment rules -------------------------------------------------------


def test_neither_set_means_local() -> None:
    assert resolve({}) == (LOCAL, None)
    assert resolve({"NV_HOST": "", "DOCKER_HOST": ""}) == (LOCAL, None)


def test_nv_host_wins_over_docker_host() -> None:
    env = {"USER": "alice", "DOCKER_HOST": "10.0.0.1:", "NV_HOST": "ssh://user@10.0.0.1:22:80"}
    endpoint, warning = resolve(env)
    assert (endpoint.transport, endpoint.user, endpoint.ssh_port, endpoint.http_port) == (
        "ssh",
        "user",
        22,
        80,
    )
    assert endpoint.source == "NV_HOST"
    assert warning is None


def test_docker_host_alone_goes_to_port_3476() -> None:
    endpoint, warning = resolve({"DOCKER_HOST": "tcp://10.0.0.1:2375"})
    assert endpoint == http("10.0.0.1", 3476, source="DOCKER_HOST")
    assert warning is None
    # docs/nvidia-docker.md's example: DOCKER_HOST='10.0.0.1:' nvidia-docker run cuda
    assert resolve({"DOCKER_HOST": "10.0.0.1:"})[0].agent_url == "http://10.0.0.1:3476"


def test_docker_host_unix_socket_is_local() -> None:
    endpoint, _ = resolve({"DOCKER_HOST": "unix:///var/run/docker.sock"})
    assert endpoint.is_local


def test_nv_host_without_docker_host_warns() -> None:
    endpoint, warning = resolve({"USER": "u", "NV_HOST": "ssh://10.0.0.1:"})
    assert endpoint.transport == "ssh"
    assert warning is not None
    assert "NV_HOST is set but DOCKER_HOST is not" in warning


def test_docker_host_option_counts_as_docker_address() -> None:
    # docs/nvidia-docker.md's example: NV_HOST='ssh://10.0.0.1:' nvidia-docker -H 10.0.0.1: run cuda
    endpoint, warning = resolve(
        {"USER": "u", "NV_HOST": "ssh://10.0.0.1:"}, docker_host_option="10.0.0.1:"
    )
    assert (endpoint.transport, endpoint.ssh_port, warning) == ("ssh", 22, None)
    # -H without NV_HOST selects the node like DOCKER_HOST, and wins over it (as in docker)
    endpoint, _ = resolve({"DOCKER_HOST": "10.9.9.9:"}, docker_host_option="tcp://10.0.0.2:2375")
    assert (endpoint.host, endpoint.http_port, endpoint.source) == ("10.0.0.2", 3476, "-H")
    endpoint, _ = resolve({}, docker_host_option="unix:///run/docker.sock")
    assert endpoint.is_local


def test_bad_docker_host_names_its_source() -> None:
    with pytest.raises(EndpointError, match=r"\(DOCKER_HOST\)"):
        resolve({"DOCKER_HOST": "fd://"})


def test_default_user_is_user_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint, _ = resolve({"NV_HOST": "ssh://n:", "USER": "carol", "DOCKER_HOST": "n:"})
    assert endpoint.user == "carol"
    endpoint, _ = resolve({"NV_HOST": "ssh://n:", "DOCKER_HOST": "n:"})
    assert endpoint.user  # falls back to the name of the current uid
