"""Whether the docker command runs rootless Podman, and as which user
(``controller.wrapper.rootless_podman``; docs/nvidia-docker.md, "Rootless Podman").

Podman is not run here: what is read is the command's words, the environment, the files
found on ``PATH`` (a ``podman``, a ``docker`` that is the docker CLI, podman-docker's script
or a link to ``podman``), Podman's settings files and the owners of socket files, made here
with the owners a user's Podman service and root's give them. The effective uid is set per
test (the tests run as root, who may give files to uid 1000). The whole run, with a lease
refused for the uid found, is tested in ``test_wrapper_leases.py`` (section "rootless
Podman") and with real rootless Podman in ``tests/e2e/test_leases_rootless_podman.py``.
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest

from controller.wrapper.rootless_podman import rootless_uid, runs_podman

USER = 1000  # the user running the wrapper, unless a test says root
SSH = "ssh://alice@gpu-7/run/user/1000/podman/podman.sock"  # a service on another machine
# Debian's and Fedora's podman-docker: /usr/bin/docker (the Podman 4.3 source's docker file)
PODMAN_DOCKER = """#!/bin/sh
[ -e /etc/containers/nodocker ] || \\
echo "Emulate Docker CLI using podman. Create /etc/containers/nodocker to quiet msg." >&2
exec {podman} "$@"
"""


class Machine:
    """Programs on ``PATH``, a user's settings and runtime directory, as the wrapper sees
    them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.podman = self.program("podman")
        self.config = tmp / "config"
        self.runtime = tmp / "run"
        self.environment = {
            "PATH": str(self.bin),
            "HOME": str(tmp / "home"),
            "XDG_CONFIG_HOME": str(self.config),
            "XDG_RUNTIME_DIR": str(self.runtime),
        }

    def program(self, name: str, text: bytes = b"\x7fELF\x02\x01\x01") -> Path:
        """An executable file on ``PATH`` (by default the head of an ELF program)."""
        path = self.bin / name
        path.write_bytes(text)
        path.chmod(0o755)
        return path

    def socket(self, owner: int, path: Path | None = None) -> Path:
        """A socket file of ``owner`` (by default the user's Podman service socket, in its
        runtime directory)."""
        found = path or self.runtime / "podman" / "podman.sock"
        found.parent.mkdir(parents=True, exist_ok=True)
        found.touch()
        os.chown(found, owner, owner)
        return found

    def settings(self, text: str) -> None:
        """The user's containers.conf."""
        conf = self.config / "containers" / "containers.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(text)

    def uid(self, *docker: str, **environment: str) -> int | None:
        """``rootless_uid`` of ``docker`` with no global options, in the environment."""
        return rootless_uid(docker, (), {**self.environment, **environment})


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    monkeypatch.setattr(os, "geteuid", lambda: USER)
    return Machine(tmp_path)


def _as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)


# --- a local podman: rootless unless root ---------------------------------------------------


@pytest.mark.parametrize(
    ("docker", "euid", "expected"),
    [
        (("podman",), USER, USER),
        (("/usr/bin/podman", "--log-level=info"), USER, USER),
        (("podman", "--root", "/tmp/store", "--remote=false"), USER, USER),
        (("podman", "-r=0"), USER, USER),
        (("podman",), 0, None),  # root Podman: the agent's own --podman-socket
        (("docker",), USER, None),  # the docker CLI (an ELF program named docker)
        (("nerdctl",), USER, None),
    ],
)
def test_a_local_podman_is_rootless_podman_of_its_user_unless_root(
    machine: Machine,
    docker: tuple[str, ...],
    euid: int,
    expected: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine.program("docker")
    machine.program("nerdctl")
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    assert machine.uid(*docker) == expected


def test_the_global_options_of_the_command_line_count_too(machine: Machine) -> None:
    """``nvidia-docker --url ... run``: podman's options before the command."""
    machine.socket(0, machine.tmp / "root.sock")
    url = f"unix://{machine.tmp / 'root.sock'}"
    assert rootless_uid(("podman",), ("--url", url), machine.environment) is None
    assert rootless_uid(("podman",), ("--log-level", "debug"), machine.environment) == USER


# --- a client of a service: its socket's owner ----------------------------------------------


@pytest.mark.parametrize(
    "form",
    ["--url {url}", "--url={url}", "-H {url}", "--host={url}", "CONTAINER_HOST={url}"],
)
def test_a_client_of_a_users_own_socket_is_that_users_rootless_podman(
    machine: Machine, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's own Podman service (``podman system service``, ``podman.socket``): its
    containers are the user's, whoever asks it (root too)."""
    socket = machine.socket(USER)
    words = form.format(url=f"unix://{socket}").split()
    variables = dict(word.split("=", 1) for word in words if word.startswith("CONTAINER_"))
    options = [word for word in words if not word.startswith("CONTAINER_")]
    assert machine.uid("podman", *options, **variables) == USER
    _as_root(monkeypatch)
    assert machine.uid("podman", *options, **variables) == USER


@pytest.mark.parametrize(
    "url",
    ["unix://{root}", "unix:{root}", "unix://{missing}", SSH, "tcp://gpu-7:8080"],
)
def test_a_client_of_roots_socket_or_another_machine_is_not_rootless(
    machine: Machine, url: str
) -> None:
    """Root's service (a user in its group may use it), a socket that is not there (podman
    cannot reach it), a service on another machine."""
    root = machine.socket(0, machine.tmp / "root.sock")
    url = url.format(root=root, missing=machine.tmp / "missing.sock")
    assert machine.uid("podman", "--url", url) is None
    assert machine.uid("podman", CONTAINER_HOST=url) is None
    own = f"unix://{machine.socket(USER)}"
    assert machine.uid("podman", "--url", url, CONTAINER_HOST=own) is None  # --url wins


def test_a_client_without_a_url_talks_to_the_users_default_socket(machine: Machine) -> None:
    """``--remote``, ``podman-remote``, containers.conf's ``remote = true``: Podman's
    default socket, ``$XDG_RUNTIME_DIR/podman/podman.sock`` for a user."""
    forms = [("podman", "--remote"), ("podman", "-r"), ("podman-remote",)]
    for docker in forms:
        assert machine.uid(*docker) is None  # no service there: podman fails by itself
    machine.socket(USER)
    for docker in forms:
        assert machine.uid(*docker) == USER
    machine.settings("[engine]\nremote = true\n")
    assert machine.uid("podman") == USER
    machine.socket(0)  # a socket there that is root's
    assert machine.uid("podman") is None


def test_the_default_socket_is_in_the_runtime_directory_podman_finds(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``XDG_RUNTIME_DIR``: ``/run/user/<uid>`` where that is the user's (not here:
    no such uid's directory), else ``$TMPDIR/podman-run-<uid>``."""
    uid = 4_000_000_123  # a uid with no /run/user directory
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    runtime = machine.tmp / f"podman-run-{uid}"
    machine.socket(uid, runtime / "podman" / "podman.sock")
    assert machine.uid("podman", "--remote", XDG_RUNTIME_DIR="", TMPDIR=str(machine.tmp)) == uid


# --- connections by name, and the default one -----------------------------------------------


def _containers_conf(*destinations: tuple[str, str], active: str = "") -> str:
    """A containers.conf as Podman 4's ``podman system connection add`` writes it (its TOML
    writer indents tables, quotes a name that is not a bare key)."""
    lines = ["[containers]", "", "[engine]"]
    lines += [f'  active_service = "{active}"'] if active else []
    lines += ["  [engine.service_destinations]"]
    for name, uri in destinations:
        quoted = name if name.replace("-", "").replace("_", "").isalnum() else f'"{name}"'
        lines += [f"    [engine.service_destinations.{quoted}]", f'      uri = "{uri}"']
    return "\n".join([*lines, "", "[machine]", ""])


def _connections_json(*connections: tuple[str, str], default: str = "") -> str:
    """Podman 5's podman-connections.json as ``podman system connection add`` writes it."""
    return json.dumps({
        "Connection": {
            **({"Default": default} if default else {}),
            "Connections": {name: {"URI": uri, "Identity": ""} for name, uri in connections},
        },
        "Farm": {},
    })  # fmt: skip


def _write_connections(machine: Machine, text: str) -> Path:
    path = machine.config / "containers" / "podman-connections.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


NAMED = [
    ("--connection", "{name}"),
    ("--connection={name}",),
    ("-c", "{name}"),
    ("-c{name}",),
    ("--context", "{name}"),
    ("--remote", "CONTAINER_CONNECTION={name}"),
]


@pytest.mark.parametrize("form", NAMED)
@pytest.mark.parametrize("where", ["podman-connections.json", "containers.conf"])
def test_a_connection_by_name_is_its_uri(
    machine: Machine, form: tuple[str, ...], where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``podman --connection NAME`` (``-c``, ``--context``, ``CONTAINER_CONNECTION``) talks
    to the URI of that connection, of Podman 5's podman-connections.json or Podman 4's
    containers.conf: a socket of the user's is the user's rootless Podman, whoever asks it;
    root's, or another machine's, is not."""
    own = machine.socket(USER)
    root = machine.socket(0, machine.tmp / "root.sock")
    named = {"mine.local": f"unix://{own}", "root": f"unix://{root}", "gpu-7": SSH}
    if where == "containers.conf":
        machine.settings(_containers_conf(*named.items()))
    else:
        _write_connections(machine, _connections_json(*named.items()))

    def uid(name: str) -> int | None:
        words = [word.format(name=name) for word in form]
        variables = dict(word.split("=", 1) for word in words if word.startswith("CONTAINER_"))
        options = [word for word in words if not word.startswith("CONTAINER_")]
        return machine.uid("podman", *options, **variables)

    assert uid("mine.local") == USER
    assert uid("root") is None
    assert uid("gpu-7") is None
    assert uid("not-there") is None  # podman fails: no such connection
    _as_root(monkeypatch)
    assert uid("mine.local") == USER


def test_the_connections_file_names_a_connection_before_containers_conf(
    machine: Machine,
) -> None:
    """A name in both: Podman 5 takes podman-connections.json's (``GetConnection``); a
    later containers.conf's table wins over an earlier one's."""
    own = f"unix://{machine.socket(USER)}"
    root = f"unix://{machine.socket(0, machine.tmp / 'root.sock')}"
    machine.settings(_containers_conf(("gpu", root)))
    connections = _write_connections(machine, _connections_json(("gpu", own)))
    assert machine.uid("podman", "-c", "gpu") == USER
    connections.write_text(_connections_json(("gpu", root)))
    machine.settings(_containers_conf(("gpu", own)))
    assert machine.uid("podman", "-c", "gpu") is None
    connections.unlink()
    assert machine.uid("podman", "-c", "gpu") == USER
    later = machine.tmp / "later.conf"
    later.write_text(_containers_conf(("gpu", root)))
    assert machine.uid("podman", "-c", "gpu", CONTAINERS_CONF=str(later)) is None


def test_a_containers_conf_that_is_not_toml_names_no_connection(machine: Machine) -> None:
    """Podman refuses a containers.conf its TOML parser cannot read (a table given twice):
    no URL, as for a name that is not there."""
    own = f"unix://{machine.socket(USER)}"
    machine.settings(_containers_conf(("mine", own)))
    assert machine.uid("podman", "-c", "mine") == USER
    machine.settings(_containers_conf(("mine", own)) + "[engine]\n")
    assert machine.uid("podman", "-c", "mine") is None


def test_the_options_and_variables_choose_in_podmans_order(machine: Machine) -> None:
    """``--connection``, then ``--url``, then ``--context NAME``, then ``--host``; then
    ``CONTAINER_CONNECTION``, then ``CONTAINER_HOST`` (Podman 5's ``readRemoteCliFlags`` and
    ``setupRemoteConnection``)."""
    own = f"unix://{machine.socket(USER)}"
    root = f"unix://{machine.socket(0, machine.tmp / 'root.sock')}"
    machine.settings(_containers_conf(("mine", own), ("root", root)))
    assert machine.uid("podman", "--url", root, "--connection", "mine") == USER
    assert machine.uid("podman", "--url", own, "--context", "root") == USER
    assert machine.uid("podman", "--context", "mine", "-H", root) == USER
    assert machine.uid("podman", "--context", "default", "-H", own) == USER
    assert machine.uid("podman", "--context", "default", "-H", root) is None
    assert machine.uid("podman", "-c", "mine", "--context", "mine") is None  # podman refuses
    assert machine.uid("podman", CONTAINER_CONNECTION="mine", CONTAINER_HOST=root) == USER
    assert machine.uid("podman", "--url", own, CONTAINER_CONNECTION="root") == USER


def test_a_default_connection_is_its_uri(machine: Machine) -> None:
    """A client without a URL: the default connection (podman-connections.json's
    ``Default``, else containers.conf's ``active_service``); none, or one not there: Podman's
    default socket. A local podman: made by its user, whatever the settings name."""
    own = f"unix://{machine.socket(USER, machine.tmp / 'own.sock')}"
    root = f"unix://{machine.socket(0, machine.tmp / 'root.sock')}"
    machine.socket(USER)  # the default socket: the user's
    machine.settings(_containers_conf(("mine", own), ("root", root), active="root"))
    assert machine.uid("podman", "--remote") is None
    assert machine.uid("podman-remote") is None
    assert machine.uid("podman") == USER  # a local podman
    connections = _write_connections(machine, _connections_json(default="mine"))
    assert machine.uid("podman", "--remote") == USER  # the file's default, from containers.conf
    connections.write_text(_connections_json(("mine", root), default="mine"))
    assert machine.uid("podman", "--remote") is None  # the file's own "mine"
    connections.write_text(_connections_json(default="not-there"))
    assert machine.uid("podman", "--remote") == USER  # the default socket
    machine.socket(0)
    assert machine.uid("podman", "--remote") is None
    connections.write_text(_connections_json(("ssh", SSH), default="ssh"))
    assert machine.uid("podman", "--remote") is None
    connections.write_text(_connections_json(("mine", own), default="mine"))
    machine.settings("[engine]\nremote = true\n")
    assert machine.uid("podman") == USER  # remote = true: a client of the default connection


def test_the_connections_file_is_where_podman_finds_it(machine: Machine) -> None:
    """``PODMAN_CONNECTIONS_CONF`` (set, even empty: no file), else beside the user's
    containers.conf; its keys whatever their case, as Go's encoding/json reads them."""
    own = f"unix://{machine.socket(USER, machine.tmp / 'own.sock')}"
    elsewhere = machine.tmp / "connections.json"
    elsewhere.write_text(_connections_json(("mine", own), default="mine"))
    assert machine.uid("podman", "-c", "mine") is None
    assert machine.uid("podman", "-c", "mine", PODMAN_CONNECTIONS_CONF=str(elsewhere)) == USER
    _write_connections(machine, _connections_json(("mine", own)))
    assert machine.uid("podman", "-c", "mine") == USER
    assert machine.uid("podman", "-c", "mine", PODMAN_CONNECTIONS_CONF="") is None
    lowered = {"connection": {"connections": {"mine": {"uri": own}}}}
    _write_connections(machine, json.dumps(lowered))
    assert machine.uid("podman", "-c", "mine") == USER


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"Connection": ' + "[" * 100_000 + "]" * 100_000 + "}",  # deeper than Python parses
        json.dumps({"Connection": {"Default": 7, "Connections": {}}}),
        json.dumps({"Connection": {"Connections": {"mine": {"URI": ["unix:///x"]}}}}),
        json.dumps({"Connection": []}),
        json.dumps([]),
        " " * (1 << 20) + "{}",  # more than MAX_SETTINGS_BYTES
    ],
)
def test_a_connections_file_podman_cannot_parse(machine: Machine, text: str) -> None:
    """Podman fails on a connection named (no URL: None), and talks to its default socket
    without one (the user's here; not containers.conf's ``active_service``, root's); nothing
    raises (not a RecursionError)."""
    own = f"unix://{machine.socket(USER)}"
    root = f"unix://{machine.socket(0, machine.tmp / 'root.sock')}"
    machine.settings(_containers_conf(("mine", own), ("root", root), active="root"))
    _write_connections(machine, text)
    assert machine.uid("podman", "--connection", "mine") is None
    assert machine.uid("podman", "--remote", CONTAINER_CONNECTION="mine") is None
    assert machine.uid("podman", "--remote") == USER


def test_podman_4s_remote_uri_or_the_default_socket(machine: Machine) -> None:
    """containers.conf's ``remote_uri``, where no connection is the default: Podman 4 talks
    to it, Podman 5 to its default socket; either that is a user's counts."""
    own = f"unix://{machine.socket(USER, machine.tmp / 'own.sock')}"
    root = f"unix://{machine.socket(0, machine.tmp / 'root.sock')}"
    machine.settings(f'[engine]\nremote_uri = "{own}"\n')
    assert machine.uid("podman", "--remote") == USER  # Podman 4's; no default socket here
    machine.socket(0)
    assert machine.uid("podman", "--remote") == USER
    machine.settings(f'[engine]\nremote_uri = "{root}"\n')
    assert machine.uid("podman", "--remote") is None
    machine.socket(USER)
    assert machine.uid("podman", "--remote") == USER  # Podman 5's: the default socket


# --- podman-docker: a docker that is Podman -------------------------------------------------


def test_podman_dockers_script_is_podman(machine: Machine, monkeypatch: pytest.MonkeyPatch) -> None:
    """NV_DOCKER unset (``docker``), with podman-docker's ``/usr/bin/docker`` found first on
    ``PATH``: a user's own Podman. Root's is not rootless."""
    docker = machine.program("docker", PODMAN_DOCKER.format(podman=machine.podman).encode())
    assert machine.uid("docker") == USER
    assert machine.uid(str(docker)) == USER
    assert machine.uid("docker", "--url", "ssh://alice@gpu-7/run/podman/podman.sock") is None
    _as_root(monkeypatch)
    assert machine.uid("docker") is None


def test_a_docker_that_runs_podman_takes_the_leases_annotations(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root's podman-docker too: its containers meet Podman's start hook, which reads them."""
    env = machine.environment
    assert not runs_podman(("docker",), env)  # the docker CLI
    machine.program("docker", PODMAN_DOCKER.format(podman=machine.podman).encode())
    _as_root(monkeypatch)
    assert runs_podman(("docker",), env)
    assert runs_podman(("env", "LANG=C", "docker"), env)
    assert runs_podman(("sudo", "podman"), env)
    assert not runs_podman(("env", "-S", "docker"), env)  # not seen through


def test_a_docker_linked_to_podman_is_podman(machine: Machine) -> None:
    (machine.bin / "docker").symlink_to(machine.podman)
    assert machine.uid("docker") == USER


def test_a_script_that_runs_something_else_is_not_podman(machine: Machine) -> None:
    machine.program("docker", b'#!/bin/sh\nexec /usr/libexec/docker/cli "$@"\n')
    assert machine.uid("docker") is None
    machine.program("docker", b"#!/bin/sh\n# not podman\necho podman\n")
    assert machine.uid("docker") is None


def test_the_options_a_script_gives_podman_count(machine: Machine) -> None:
    socket = machine.socket(USER, machine.tmp / "service.sock")
    machine.program("docker", f'#!/bin/sh\nexec podman --url "unix://{socket}" "$@"\n'.encode())
    assert machine.uid("docker") == USER
    os.chown(socket, 0, 0)
    assert machine.uid("docker") is None


# --- prefixes: env, sudo --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("docker", "with_ssh_host"),
    [
        (("env", "podman"), None),
        (("/usr/bin/env", "LANG=C", "podman", "--log-level=info"), None),
        (("env", "-i", "PATH=/usr/bin", "podman"), USER),
        (("env", "-u", "CONTAINER_HOST", "podman"), USER),
        (("env", "--unset=CONTAINER_HOST", "podman"), USER),
        (("env", "-", "podman"), USER),
        (("env", "-v", "--", "podman"), None),
    ],
)
def test_env_is_seen_through(
    machine: Machine, docker: tuple[str, ...], with_ssh_host: int | None
) -> None:
    """Its variables are podman's: ``CONTAINER_HOST`` of another machine, unless env
    removes it."""
    assert machine.uid(*docker) == USER
    assert machine.uid(*docker, CONTAINER_HOST=SSH) == with_ssh_host


def test_envs_variables_choose_the_service(machine: Machine) -> None:
    socket = machine.socket(USER, machine.tmp / "service.sock")
    assert machine.uid("env", f"CONTAINER_HOST=unix://{socket}", "podman") == USER
    os.chown(socket, 0, 0)
    assert machine.uid("env", f"CONTAINER_HOST=unix://{socket}", "podman") is None
    assert machine.uid("env", "-S", "podman --remote") is None  # -S: not seen through


ROOT_SUDO = [
    ("sudo", "podman"),
    ("sudo", "-n", "podman"),
    ("sudo", "-u", "root", "podman"),
    ("sudo", "--user=#0", "podman"),
    ("sudo", "-H", "--", "podman"),
]


def test_sudo_runs_root_podman(machine: Machine) -> None:
    """sudo resets the environment: the caller's ``CONTAINER_HOST`` is not root podman's."""
    own = f"unix://{machine.socket(USER)}"
    for docker in ROOT_SUDO:
        assert machine.uid(*docker) is None, docker
        assert machine.uid(*docker, CONTAINER_HOST=own) is None, docker
    # ... unless it keeps the caller's variables: root asks the user's service
    assert machine.uid("sudo", "-E", "podman", CONTAINER_HOST=own) == USER
    kept = "--preserve-env=CONTAINER_HOST"
    assert machine.uid("sudo", kept, "podman", CONTAINER_HOST=own) == USER
    assert machine.uid("sudo", f"CONTAINER_HOST={own}", "podman") == USER


NOBODY = pwd.getpwnam("nobody").pw_uid
OTHER_SUDO = [
    ("sudo", "-u", "nobody", "podman"),
    ("sudo", "--user=nobody", "podman"),
    ("sudo", "-unobody", "podman"),
    ("sudo", "-nu", "nobody", "podman"),
    ("sudo", "--user", "nobody", "env", "A=1", "podman"),
    ("sudo", "-u", f"#{NOBODY}", "podman"),
    ("env", "A=1", "sudo", "-u", "nobody", "podman"),
]


def test_sudo_as_another_user_runs_that_users_rootless_podman(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sudo -u USER podman``: USER's own Podman (the agent must follow USER's socket)."""
    for docker in OTHER_SUDO:
        assert machine.uid(*docker) == NOBODY, docker
    assert machine.uid("sudo", "-u", "#4000000123", "podman") == 4_000_000_123  # no entry
    _as_root(monkeypatch)
    assert machine.uid("sudo", "-u", "nobody", "podman") == NOBODY
    assert machine.uid("sudo", "-g", "nogroup", "podman") is None  # root, another group
    monkeypatch.setattr(os, "geteuid", lambda: USER)
    assert machine.uid("sudo", "-g", "nogroup", "podman") == USER  # -g alone: the caller


def test_a_sudo_that_cannot_be_read_is_not_seen_through(machine: Machine) -> None:
    assert machine.uid("sudo", "-u", "no-such-user-here", "podman") is None
    assert machine.uid("sudo", "-h", "podman") is None
    assert machine.uid("sudo", "--host=gpu-7", "podman") is None
    assert machine.uid("sudo", "-u") is None
    assert machine.uid("sudo") is None


def test_a_socket_the_wrapper_may_not_look_at_is_that_of_the_podmans_user(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sudo -u alice podman --url unix:///run/user/<alice's uid>/podman/podman.sock`` run
    by another user, who may not look into alice's runtime directory (EACCES): alice's
    Podman reaches it, so it is alice's (the uid of its path; elsewhere, that Podman's user),
    not a socket that is not there."""
    hidden = machine.tmp / "hidden"
    runtime = f"/run/user/{NOBODY}/podman/podman.sock"
    stat = os.stat

    def stat_as_another_user(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path) == runtime or str(path).startswith(f"{hidden}/"):
            raise PermissionError(13, "Permission denied", str(path))
        return stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat_as_another_user)
    for url in (f"unix://{runtime}", f"unix://{hidden}/podman.sock"):
        assert machine.uid("sudo", "-u", "nobody", "podman", "--url", url) == NOBODY, url
    assert machine.uid("podman", "--url", f"unix://{runtime}") == NOBODY
    assert machine.uid("sudo", "podman", "--url", f"unix://{hidden}/podman.sock") is None


# --- prefixes: runuser, doas ----------------------------------------------------------------

OTHER_RUNUSER = [
    ("runuser", "-u", "nobody", "podman"),
    ("runuser", "-u", "nobody", "--", "podman"),
    ("/usr/sbin/runuser", "--user=nobody", "podman"),
    ("runuser", "-unobody", "podman"),
    ("runuser", "-u", "nobody", "-g", "nogroup", "-G", "nogroup", "podman"),
    ("runuser", "-m", "-u", "nobody", "-P", "podman"),
    ("runuser", "-u", str(NOBODY), "podman"),
    ("runuser", "-u", "nobody", "env", "A=1", "podman"),
    ("env", "A=1", "runuser", "-u", "nobody", "podman"),
    ("sudo", "runuser", "-u", "nobody", "podman"),
]


def test_runuser_as_another_user_runs_that_users_rootless_podman(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``runuser -u USER podman`` (root's: runuser refuses anyone else): USER's own Podman,
    in the caller's environment with USER's ``HOME``."""
    _as_root(monkeypatch)
    for docker in OTHER_RUNUSER:
        assert machine.uid(*docker) == NOBODY, docker
    assert machine.uid("runuser", "-u", "root", "podman") is None  # root's Podman
    # the caller's variables are podman's: root's CONTAINER_HOST names the user's service
    own = f"unix://{machine.socket(USER)}"
    assert machine.uid("runuser", "-u", "nobody", "podman", CONTAINER_HOST=own) == USER
    # USER's HOME, where its containers.conf is (not the caller's: remote = true there)
    home = machine.tmp / "caller"
    (home / ".config" / "containers").mkdir(parents=True)
    (home / ".config" / "containers" / "containers.conf").write_text("[engine]\nremote = true\n")
    caller = {"XDG_CONFIG_HOME": "", "HOME": str(home), "XDG_RUNTIME_DIR": str(machine.runtime)}
    assert machine.uid("runuser", "-u", "nobody", "podman", **caller) == NOBODY
    socket = machine.socket(0)  # the caller's default socket, read with -m: root's
    assert machine.uid("runuser", "-m", "-u", "nobody", "podman", **caller) is None
    os.chown(socket, USER, USER)
    assert machine.uid("runuser", "-p", "-u", "nobody", "podman", **caller) == USER


def test_a_runuser_that_runs_a_shell_or_fails_is_not_seen_through(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert machine.uid("runuser", "-u", "nobody", "podman") is None  # not root: it refuses
    _as_root(monkeypatch)
    assert machine.uid("runuser", "nobody", "-c", "podman") is None
    assert machine.uid("runuser", "-l", "nobody", "-c", "podman") is None
    assert machine.uid("runuser", "-", "nobody") is None
    assert machine.uid("runuser", "-u", "nobody", "-", "podman") is None
    assert machine.uid("runuser", "-s", "/bin/sh", "-u", "nobody", "podman") is None
    assert machine.uid("runuser", "-u", "no-such-user-here", "podman") is None
    assert machine.uid("runuser", "-u", "nobody") is None
    assert machine.uid("runuser") is None


OTHER_DOAS = [
    ("doas", "-u", "nobody", "podman"),
    ("/usr/bin/doas", "-n", "-u", "nobody", "podman"),
    ("doas", "-nu", "nobody", "podman"),
    ("doas", "-unobody", "--", "podman"),
    ("doas", "-u", str(NOBODY), "podman"),
    ("env", "A=1", "doas", "-u", "nobody", "podman"),
]


def test_doas_runs_root_podman_or_that_of_another_user(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``doas podman``: root's Podman; ``doas -u USER podman``: USER's own. In the
    environment doas makes (its default ``doas.conf`` rule): the caller's ``CONTAINER_HOST``
    is not podman's."""
    for docker in OTHER_DOAS:
        assert machine.uid(*docker) == NOBODY, docker
    own = f"unix://{machine.socket(USER)}"
    assert machine.uid("doas", "-u", "nobody", "podman", CONTAINER_HOST=own) == NOBODY
    assert machine.uid("doas", "podman") is None
    assert machine.uid("doas", "-u", "root", "podman") is None
    assert machine.uid("doas", "podman", CONTAINER_HOST=own) is None
    # its own runtime directory, not the caller's: nobody's service is not there
    assert machine.uid("doas", "-u", "nobody", "podman", "--remote") is None
    assert machine.uid("doas", "-u", "nobody", "podman-remote") is None
    _as_root(monkeypatch)
    assert machine.uid("doas", "-u", "nobody", "podman") == NOBODY
    assert runs_podman(("doas", "podman"), machine.environment)


def test_a_doas_that_runs_no_podman_is_not_seen_through(machine: Machine) -> None:
    assert machine.uid("doas", "-s") is None
    assert machine.uid("doas", "-u", "nobody", "-s") is None
    assert machine.uid("doas", "-C", "/etc/doas.conf", "podman") is None
    assert machine.uid("doas", "-L") is None
    assert machine.uid("doas", "-x", "podman") is None
    assert machine.uid("doas", "-u", "no-such-user-here", "podman") is None
    assert machine.uid("doas", "-u") is None
    assert machine.uid("doas") is None
