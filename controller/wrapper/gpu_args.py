"""The GPU arguments of one ``docker run|create``: image labels, node facts, CUDA check.

``gpu_arguments(command, options)`` is the slow half of ``nvidia-docker`` (the wrapper
imports it only for run/create; ``options`` are the ones its edge built: ``NV_GPU``,
``NV_HOST``, ``NV_CDI``, TLS and SSH settings, ...):

1. the node (``controller.transport.endpoint.resolve``: ``NV_HOST``, else the daemon of
   ``--context``, ``-H``, ``DOCKER_HOST``, ``DOCKER_CONTEXT`` or ``docker context use``, in
   docker's order, its contexts read from ``--config`` when given, as docker reads them),
   first: a bad ``NV_HOST`` is said before docker is asked anything;
2. the image's labels, from ``docker image inspect`` (pulled first when missing; the pull's
   output goes to stderr so that stdout stays the container's; a lease that the agent on
   loopback refuses already is refused before the pull: ``_refuse_before_pull``); when the
   docker CLI would ask a local unix socket, the wrapper asks that socket itself
   (``engine_api``: the same ``GET``, without starting the CLI), and the CLI answers
   whatever that cannot; with Podman the labels are remembered while its image store is
   unchanged (``podman_labels``);
3. no ``com.nvidia.volumes.needed`` label: no GPU arguments (the command runs unchanged);
4. the node's facts: remote nodes answer ``GET /gpu/info/json`` and
   ``GET /docker/cli?vol=...&dev=...``; the local node asks its agent on localhost:3476 when
   it answers, else NVML directly (``agent.gpu``), and adds ``--volume-driver=nvidia-docker``
   only when ``docker volume inspect`` (or the engine's socket) does not find the driver
   volume; a GPU the agent
   refuses is said with the agent's own reason (``GPU 0 is not in MIG mode``);
5. the CUDA check: ``com.nvidia.cuda.version`` newer than the driver's is refused.

The agent is asked through one connection, synchronously (``open_agent``): over plain HTTP
without a token, the local agent included, with the standard library's client
(``controller.transport.plain_http``), so that this path imports neither aiohttp nor
asyncio; over HTTPS, with a token or over SSH, with ``AgentClient`` (aiohttp, paramiko).

When the engine reads CDI (``engine_cdi``: Podman, Docker 25+ with CDI on; asked only here,
after the label says GPUs are wanted), the GPU arguments are the CDI form instead:
``--device=nvidia.com/gpu=<UUID>`` per selected GPU or MIG device
(``GET /docker/cli?format=cdi``), and the node's spec brings the control nodes and the driver
volume. An agent that writes no spec (or predates CDI) gets the volume form, with a warning.

A lease (``NV_GPU=auto[:N]``, ``auto:mig:PROFILE[:N]``, docker's ``--gpus``: ``leases``)
changes steps 3 and 4: it wants GPUs whatever the image's label says (without the label,
every driver volume), and after the CUDA check the agent is asked for the lease
(``POST /leases``) in the same connection; the grant's ``Dev`` is what ``/docker/cli`` is
asked for, its labels, cpuset and ``NVIDIA_VISIBLE_DEVICES`` are inserted too, and
``--gpus`` is dropped (``GpuArguments.drop``). It needs the node's agent: the local NVML
path knows the GPUs, not who holds them. ``NV_GPU=0,1`` and no selection ask for none.
``GpuArguments.watch`` is what the wrapper's watcher needs to give the lease back if docker
ends without creating the container (``lease_watch``; None for an agent that does not say
how long its lease stays pending).

Every failure is a ``ControllerError`` with one line; no container is created.

Speed (docs/nvidia-docker.md, "Speed"): this path imports no ``dataclasses`` (its value
classes are ``controller.record``'s), ``subprocess`` (the docker CLI runs through
``docker_cli``, ``os.posix_spawnp``; only a pull takes ``subprocess``), ``typing`` or
``contextlib``.
"""

from __future__ import annotations

import sys
import time

from controller import json_codec
from controller.errors import DockerError, GpuError, NodeError
from controller.logs import configure_pending
from controller.record import record, replace
from controller.transport.agent_errors import AgentHttpError
from controller.transport.endpoint import Endpoint, resolve
from controller.transport.plain_http import PlainAgentClient
from controller.transport.tls import TlsOptions
from controller.wrapper import docker_cli, engine_api, podman_labels
from controller.wrapper.engine_cdi import (
    EngineCdi,
    agent_engine_cdi,
    engine_cdi,
    engine_rows,
    is_podman,
    local_rows,
)
from controller.wrapper.lease_watch import LeaseWatch, watchable
from controller.wrapper.leases import (
    GPUS_OPTION,
    Grant,
    LeaseAsk,
    ask_lease,
    lease_ask,
    refuse_rootless,
    release,
)

# typing, dataclasses, subprocess: not imported on the run path (docs/nvidia-docker.md, "Speed")
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

    from controller.options import Options
    from controller.transport.plain_http import BlockingAgent
    from controller.transport.ssh_tunnel import SshOptions
    from controller.wrapper.docker_args import DockerCommand

VOLUMES_LABEL = "com.nvidia.volumes.needed"
CUDA_LABEL = "com.nvidia.cuda.version"
VOLUME_DRIVER_ARG = "--volume-driver="
CDI_DEVICE_ARG = "--device=nvidia.com/gpu="
LOCAL_PROBE_CONNECT_S = 0.5


@record
class GpuFacts:
    """What the wrapper needs from a node."""

    cuda_version: str  # "13.0"
    docker_args: tuple[str, ...]  # ("--volume-driver=...", "--volume=...", "--device=...")
    cdi: bool = False  # docker_args are the CDI form ("--device=nvidia.com/gpu=...")
    warnings: tuple[str, ...] = ()
    grant: Grant | None = None  # the lease these devices are (NV_GPU=auto..., --gpus)
    agent: Endpoint | None = None  # the agent that granted it


@record
class GpuArguments:
    """What ``gpu_arguments`` changes in the command line: arguments inserted right after
    ``run``/``create``, the run options dropped (``--gpus``: the lease gives the GPUs), and
    the warnings to print."""

    insert: list[str]
    drop: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    watch: LeaseWatch | None = None  # the lease to give back if docker creates no container


def parse_version(text: str, what: str) -> tuple[int, ...]:
    parts = text.strip().split(".")
    if not all(part.isdigit() for part in parts):
        raise GpuError(f"{what} is not a version number: {text!r}")
    return tuple(int(part) for part in parts)


def check_cuda(driver: str, image: str) -> None:
    """Refuse an image that needs a newer CUDA than the driver supports (numerically)."""
    driver_v = parse_version(driver, "the driver's CUDA version")
    image_v = parse_version(image, f"the image label {CUDA_LABEL}")
    if _padded(driver_v, image_v) < _padded(image_v, driver_v):
        raise GpuError(f"unsupported CUDA version: driver {driver} < image {image}")


def _padded(version: tuple[int, ...], other: tuple[int, ...]) -> tuple[int, ...]:
    return version + (0,) * (len(other) - len(version))


# --- docker ---------------------------------------------------------------------------------


def _docker(options: Options, command: DockerCommand, *args: str) -> docker_cli.Answer:
    docker = options.docker
    try:
        return docker_cli.ask([*docker, *command.global_args, *args], options.environment)
    except FileNotFoundError:
        raise DockerError(
            f"the docker command {docker[0]!r} was not found: install docker, "
            "or name it in NV_DOCKER"
        ) from None


def _error_line(text: str) -> str:
    """A CLI's error: the last line it wrote (warnings come first, such as Podman 5's about
    cgroups v1 at every command)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def image_labels(
    options: Options,
    command: DockerCommand,
    engine: str | None = None,
    before_pull: Callable[[], None] | None = None,
) -> tuple[dict[str, str] | None, str]:
    """The image's labels, pulling it when missing, and who said them (for ``NV_DEBUG``);
    None when docker should just run (``--pull never`` and the image is not here: docker
    says so itself). ``engine``: the engine's unix socket, asked first (``engine_api``);
    the docker CLI answers whatever it cannot, so its errors are docker's own.
    ``before_pull`` runs before a pull, and may refuse the run (``GpuError``)."""
    image = command.image
    assert image is not None
    by_engine = f"the engine's API on {engine}"
    missing = False
    if engine is not None:
        seen = engine_api.image_labels(engine, image)
        if isinstance(seen, dict):
            return seen, by_engine
        missing = seen == engine_api.NO_SUCH_IMAGE
    memory = podman_labels.Memory.open(options.docker, command.global_args, options.environment)
    if not missing:
        if memory is not None:
            known = memory.recall(image)
            if known is not None:
                return known, podman_labels.REMEMBERED
        done = _inspect(options, command, image, memory)
        if done.returncode == 0:
            return _read_labels(done.stdout, image, memory), _BY_CLI
        message = done.stderr.lower()
        if "no such image" not in message and "image not known" not in message:  # docker, podman
            raise DockerError(f"docker image inspect {image} failed: {_error_line(done.stderr)}")
    if command.options.get("pull") == "never":
        return None, by_engine if missing else _BY_CLI
    if before_pull is not None:
        before_pull()
    _pull(options, command, image)
    if engine is not None:
        seen = engine_api.image_labels(engine, image)
        if isinstance(seen, dict):
            return seen, by_engine
    done = _inspect(options, command, image, memory)
    if done.returncode != 0:
        raise DockerError(f"docker image inspect {image} failed: {_error_line(done.stderr)}")
    return _read_labels(done.stdout, image, memory), _BY_CLI


_BY_CLI = "docker image inspect"


def _inspect(
    options: Options, command: DockerCommand, image: str, memory: podman_labels.Memory | None
) -> docker_cli.Answer:
    labels = "{{json .Config.Labels}}" if memory is None else podman_labels.FORMAT
    return _docker(options, command, "image", "inspect", "--format", labels, image)


def _read_labels(printed: str, image: str, memory: podman_labels.Memory | None) -> dict[str, str]:
    return _labels(printed) if memory is None else memory.learn(image, printed)


def _labels(printed: str) -> dict[str, str]:
    labels = json_codec.loads(printed or "null")
    return {str(k): str(v) for k, v in (labels or {}).items()}


def _pull(options: Options, command: DockerCommand, image: str) -> None:
    import subprocess  # noqa: PLC0415 (a missing image only: the pull takes seconds)

    docker = options.docker
    platform = command.options.get("platform")
    args = ["pull", *(["--platform", platform] if platform else []), image]
    try:
        pulled = subprocess.run(
            [*docker, *command.global_args, *args],
            stdout=sys.stderr.fileno(),
            stdin=subprocess.DEVNULL,
            env=options.environment,
            check=False,
        )
    except FileNotFoundError:
        raise DockerError(f"the docker command {docker[0]!r} was not found") from None
    if pulled.returncode != 0:
        raise DockerError(
            f"cannot pull the image {image} (docker pull exited {pulled.returncode}, "
            "see its message above): check the name and your registry login"
        )


def volume_exists(
    options: Options, command: DockerCommand, name: str, engine: str | None = None
) -> bool:
    if engine is not None:
        seen = engine_api.volume_exists(engine, name)
        if seen is not None:
            return seen
    return _docker(options, command, "volume", "inspect", name).returncode == 0


def drop_volume_driver_when_present(
    args: Sequence[str], options: Options, command: DockerCommand, engine: str | None = None
) -> list[str]:
    """Local node: no ``--volume-driver`` when every driver volume already exists."""
    names = [a.split("=", 1)[1].split(":", 1)[0] for a in args if a.startswith("--volume=")]
    if names and all(volume_exists(options, command, name, engine) for name in names):
        return [a for a in args if not a.startswith(VOLUME_DRIVER_ARG)]
    return list(args)


# --- node facts -----------------------------------------------------------------------------


@record
class Reach:
    """How to talk to the node's agent: the edge's TLS and SSH settings."""

    tls: TlsOptions
    ssh: SshOptions | None = None  # for ssh:// nodes


def open_agent(endpoint: Endpoint, reach: Reach, connect_timeout_s: float | None) -> BlockingAgent:
    """The client of the node's agent: over plain HTTP without a token (most runs) the
    standard library's (``plain_http``: no aiohttp or asyncio to import), else
    ``AgentClient`` (HTTPS, tokens, SSH) behind the same methods."""
    if endpoint.transport == "http" and endpoint.scheme == "http" and reach.tls.token_file is None:
        return PlainAgentClient(endpoint, connect_timeout_s=connect_timeout_s)
    configure_pending()  # aiohttp (and paramiko) log: controller.logs
    from controller.transport.client import BlockingAgentClient  # noqa: PLC0415 (aiohttp)

    return BlockingAgentClient(
        endpoint, connect_timeout_s=connect_timeout_s, ssh=reach.ssh, tls=reach.tls
    )


def _facts_from_agent(
    endpoint: Endpoint,
    volumes: str,
    devices: str,
    cuda_needed: str | None,
    *,
    probe: bool,
    cdi: CdiChoice,
    reach: Reach | None = None,
    lease: LeaseAsk | None = None,
    terminal: bool = False,
) -> GpuFacts:
    """The node's facts from its agent; ``probe``: the local agent on ``localhost``, given
    ``LOCAL_PROBE_CONNECT_S`` to connect (``_node_facts`` asks NVML when it does not
    answer). An agent on this machine's loopback may also say whether this machine's engine
    reads CDI (``cdi``)."""
    connect_s = LOCAL_PROBE_CONNECT_S if probe else None
    with open_agent(endpoint, reach or Reach(TlsOptions()), connect_s) as agent:
        info = agent.get_json("/gpu/info/json")
        try:
            cuda = str(info["Version"]["CUDA"])
        except (KeyError, TypeError):
            raise NodeError(agent.node, "GET /gpu/info/json has no Version.CUDA") from None
        if cuda_needed is not None:
            check_cuda(cuda, cuda_needed)

        def reads_cdi() -> bool:
            return cdi(agent if _on_loopback(endpoint) else None)

        if lease is None:
            return _device_args(agent, info, cuda, volumes, devices, cdi=reads_cdi())
        if cdi.lease_engine is not None or cdi.lease_address is not None:
            _refuse_an_unfollowed_engine(agent, lease, cdi)
        grant = ask_lease(agent, lease, info, terminal=terminal)
        try:
            facts = _device_args(agent, info, cuda, volumes, grant.dev, cdi=reads_cdi())
        except Exception:  # not on Ctrl-C: the pending lease then ends by itself
            release(agent, grant.lease)
            raise
        warnings = (*facts.warnings, *grant.warnings())
        return replace(facts, grant=grant, agent=endpoint, warnings=warnings)


def _refuse_an_unfollowed_engine(agent: BlockingAgent, lease: LeaseAsk, cdi: CdiChoice) -> None:
    """``GpuError`` where the docker CLI's engine (``cdi.lease_engine``, a unix socket, or
    ``cdi.lease_address``) is a dockerd the agent does not follow: a lease for its container
    would not hold (``followed_engine``). A unix socket is compared with the sockets of an
    agent on this machine; otherwise (``tcp://``, ``ssh://``, an agent of another machine)
    the engine's ``ID`` with those of the engines the agent follows."""
    from controller.wrapper import followed_engine  # noqa: PLC0415 (a lease on docker's engine)

    answer = cdi.engines(agent)
    if not any(engine_rows(answer)):  # an agent before the route, or following no engine
        return
    engine = cdi.lease_engine
    if engine is not None and any(local_rows(answer)):
        if followed_engine.engine_followed(answer, engine) is False:
            raise GpuError(followed_engine.refusal(lease, engine, answer))
        return
    said = cdi.lease_engine_id()
    if followed_engine.followed_by_id(answer, said) is False:
        assert said is not None
        address = cdi.lease_address or f"unix://{engine}"
        raise GpuError(followed_engine.refusal_by_id(lease, address, said, answer, agent.node))


def _refuse_before_pull(
    endpoint: Endpoint, options: Options, lease: LeaseAsk, cdi: CdiChoice
) -> None:
    """Before docker pulls a missing image for a run with a lease (gigabytes, at times), the
    refusals that the node's agent on this machine's loopback can tell already: a Docker
    engine it does not follow (``_refuse_an_unfollowed_engine``), rootless Podman whose
    service it does not follow (``leases.refuse_rootless``). Plain HTTP only (no password
    to ask); an agent that does not answer here is asked after the pull, as always."""
    if endpoint.is_local:
        endpoint = Endpoint(transport="http", host="localhost", source="local agent")
    if not _on_loopback(endpoint) or endpoint.scheme != "http":
        return
    asks_engine = cdi.lease_engine is not None or cdi.lease_address is not None
    if not asks_engine and lease.rootless_podman is None:
        return
    try:
        with PlainAgentClient(endpoint, connect_timeout_s=LOCAL_PROBE_CONNECT_S) as agent:
            if asks_engine:
                _refuse_an_unfollowed_engine(agent, lease, cdi)
            refuse_rootless(agent, lease)
    except NodeError:
        return


def _on_loopback(endpoint: Endpoint) -> bool:
    """The agent is reached on this machine's loopback (not through SSH): it may run here
    (its boot id says: ``engine_cdi.agent_engine_cdi``), or be a tunnel's end."""
    host = endpoint.host
    return endpoint.transport in ("local", "http") and (
        host in ("localhost", "::1") or host.startswith("127.")
    )


def _device_args(
    agent: BlockingAgent, info: Any, cuda: str, volumes: str, devices: str, *, cdi: bool
) -> GpuFacts:
    """``/docker/cli`` for ``devices`` (``dev``), in the CDI form when the engine reads it."""
    count = len(info.get("Devices") or [])
    params = {"vol": volumes, "dev": devices}
    warnings: list[str] = []
    try:
        if cdi:
            try:
                body = agent.get("/docker/cli", params={**params, "format": "cdi"})
                args = tuple(body.decode().split())
                if not args:
                    raise GpuError(
                        f"{agent.node} has no CDI device for the GPUs asked for "
                        f"(NV_GPU={devices or 'all'}): see GET /cdi/spec on the node"
                    )
                if all(arg.startswith(CDI_DEVICE_ARG) for arg in args):
                    return GpuFacts(cuda, args, cdi=True)
                warnings.append(_NO_CDI.format(node=agent.node, why="predates CDI"))
                return GpuFacts(cuda, args, warnings=tuple(warnings))
            except AgentHttpError as err:
                if err.status != 400 or err.invalid_parameter != "format":
                    raise
            warnings.append(_NO_CDI.format(node=agent.node, why="writes no CDI spec"))
        body = agent.get("/docker/cli", params=params)
    except AgentHttpError as err:
        if err.status == 400 and err.invalid_parameter and err.invalid_value is not None:
            raise _refused(
                err.invalid_parameter, err.invalid_value, count, agent.node, err.agent_message
            ) from None
        if err.status == 409:  # the GPU exists but is unhealthy: the agent says why
            raise GpuError(
                f"NV_GPU names a GPU that {agent.node} does not hand out now: {err.agent_message}"
            ) from None
        raise
    return GpuFacts(cuda, tuple(body.decode().split()), warnings=tuple(warnings))


_NO_CDI = (
    "the engine reads CDI but the agent of {node} {why}: using the volume form (start the "
    "agent with --cdi-spec-dir, or set NV_CDI=no)"
)


_HINT = (
    "use indices or UUID prefixes starting GPU-, as nvidia-smi -L lists them, or for MIG "
    "devices <gpu>:<mig> or UUID prefixes starting MIG-"
)


def _refused(parameter: str, entry: str, count: int, node: str, said: str = "") -> GpuError:
    """The agent (or the local NVML path) refused one entry of ``dev`` or ``vol``: say where
    that entry came from (NV_GPU, or the image's label), what the node offers, and the
    agent's own reason when it gave more than "invalid device" (``said``: its one line,
    ``invalid device: 0:1 (GPU 0 is not in MIG mode)``)."""
    if parameter == "vol":
        return GpuError(
            f"the image's label {VOLUMES_LABEL} names an unknown volume: {entry} ({node} "
            "offers nvidia_driver; fix the label, or ask the image's maintainer)"
        )
    have = f"GPUs 0 to {count - 1}" if count else "no GPUs"
    reason = said.partition(": ")[2].removeprefix(entry).strip().removeprefix("(")
    reason = reason.removesuffix(")").strip()
    if reason:
        return GpuError(
            f"NV_GPU names a GPU that {node} cannot give: {entry} ({reason}; it has {have}; "
            f"{_HINT})"
        )
    return GpuError(f"NV_GPU names an unknown GPU: {entry} ({node} has {have}; {_HINT})")


def _facts_from_nvml(
    volumes: str, devices: str, cuda_needed: str | None, cdi: bool = False
) -> GpuFacts:
    configure_pending()  # the agent's modules log: controller.logs
    from agent.api.cdi_cli import cdi_cli  # noqa: PLC0415
    from agent.api.docker_cli import control_devices, docker_cli_for  # noqa: PLC0415
    from agent.gpu.backend import GpuBackendError  # noqa: PLC0415
    from agent.node.selection import InvalidParameter, select_targets, select_volumes  # noqa: PLC0415

    try:
        from agent.gpu.nvml_backend import NvmlBackend  # noqa: PLC0415

        # No CUDA facts: the wrapper needs paths, UUIDs and the CUDA version, all from NVML;
        # reading L2 and shared memory sizes would start a CUDA child process per run.
        backend = NvmlBackend.start(cuda=lambda _bus_ids: None)
    except GpuBackendError as err:
        found = str(err).split("): ", 1)[0] + (")" if "): " in str(err) else "")
        raise GpuError(
            f"no GPU facts: no agent answers on localhost:3476 and NVML cannot be used here "
            f"({found}): start the agent on this node (nvidia-docker-plugin), or name a GPU "
            "node's agent in NV_HOST (e.g. NV_HOST=ssh://user@gpu-node:)"
        ) from None
    try:
        info = backend.node_info()
    finally:
        backend.close()
    if cuda_needed is not None:
        check_cuda(info.cuda_version, cuda_needed)
    try:
        chosen = select_targets(info.devices, devices)
        specs = select_volumes(volumes)
    except InvalidParameter as err:
        raise _refused(err.parameter, err.entry, len(info.devices), "this node", str(err)) from None
    if cdi:  # the spec the agent left in place names the same devices (docs/cdi.md)
        args = tuple(cdi_cli(chosen).text().split())
        return GpuFacts(cuda_version=info.cuda_version, docker_args=args, cdi=True)
    cli = docker_cli_for(info.driver_version, control_devices(), chosen, specs)
    return GpuFacts(cuda_version=info.cuda_version, docker_args=tuple(cli.text().split()))


def _node_facts(
    endpoint: Endpoint,
    volumes: str,
    devices: str,
    cuda_needed: str | None,
    cdi: CdiChoice,
    reach: Reach | None = None,
    lease: LeaseAsk | None = None,
    terminal: bool = False,
) -> GpuFacts:
    if not endpoint.is_local:
        return _facts_from_agent(
            endpoint,
            volumes,
            devices,
            cuda_needed,
            probe=False,
            cdi=cdi,
            reach=reach,
            lease=lease,
            terminal=terminal,
        )
    local_agent = Endpoint(transport="http", host="localhost", source="local agent")
    try:
        return _facts_from_agent(
            local_agent,
            volumes,
            devices,
            cuda_needed,
            probe=True,
            cdi=cdi,
            reach=reach,
            lease=lease,
            terminal=terminal,
        )
    except NodeError as err:
        if isinstance(err, AgentHttpError):
            raise
        if lease is not None:  # NVML knows the GPUs, not who holds them
            raise GpuError(
                f"{lease.source} asks the node's agent for a GPU lease, but none answers on "
                f"localhost:3476 ({err.reason}): start the agent on this node "
                "(nvidia-docker-plugin), or name a GPU node's agent in NV_HOST (e.g. "
                "NV_HOST=ssh://user@gpu-node:)"
            ) from None
    return _facts_from_nvml(volumes, devices, cuda_needed, cdi(None))


# --- the whole step -------------------------------------------------------------------------


def reach(endpoint: Endpoint, options: Options) -> Reach:
    """The edge's TLS settings, and its SSH settings for an ``ssh://`` node (a password may
    be asked for when standard input is a terminal)."""
    tls = TlsOptions.from_options(options)
    if endpoint.transport != "ssh":
        return Reach(tls)
    configure_pending()  # paramiko logs: controller.logs
    from controller.transport.ssh_tunnel import SshOptions  # noqa: PLC0415 (paramiko)

    return Reach(tls, SshOptions.from_options(options, prompt=True))


class CdiChoice:
    """Whether the engine reads CDI, decided once, when the GPU arguments are made
    (``engine``: the answer and how it was found, for ``NV_DEBUG``): from the word of an
    agent on this machine's loopback when it follows that engine, or, where a lease's check
    asked the agent's engines and the engine's ``ID``, from the agent's row of that ``ID``
    (``agent_engine_cdi``: no question to dockerd), else by asking the engine
    (``engine_cdi``)."""

    def __init__(
        self,
        options: Options,
        command: DockerCommand,
        socket: str | None,
        lease_engine: str | None = None,
        lease_address: str | None = None,
    ) -> None:
        self._options = options
        self._command = command
        self.socket = socket  # the docker CLI's engine, where the wrapper may ask it itself
        # the docker CLI's engine with its global options too: the followed-engine check's
        self.lease_engine = lease_engine or socket  # a unix socket
        self.lease_address = lease_address  # or another address (tcp://, ssh://)
        self.engine: EngineCdi | None = None
        self._engines: tuple[object] | None = None
        self._engine_id: tuple[str | None] | None = None

    def __call__(self, agent: BlockingAgent | None) -> bool:
        """``agent``: the open connection to an agent on loopback, or None (a node's agent
        through SSH or on another host, or none): then the engine is asked, unless a lease's
        check already has the agent's row of the engine's ``ID``."""
        if self.engine is None:
            self.engine = (
                self._agents_word(agent)
                or self._agents_word_by_id()
                or engine_cdi(self._options, self._command, self.socket)
            )
            if self._options.debug:
                engine = self.engine
                sys.stderr.write(
                    f"nvidia-docker | engine: {engine.engine}, CDI: "
                    f"{'yes' if engine.reads_cdi else 'no'} ({engine.reason}; asked in "
                    f"{engine.seconds * 1000:.1f} ms"
                    f"{': ' + ', '.join(engine.asked) if engine.asked else ''})\n"
                )
        return self.engine.reads_cdi

    def engines(self, agent: BlockingAgent) -> object:
        """The agent's ``GET /engines/json``, asked once a run where it answers (None: an
        agent before the route, remembered; or no answer now, not remembered: the connection
        after a pull asks again, since the one before it may have found no agent yet)."""
        if self._engines is None:
            try:
                self._engines = (agent.get_json("/engines/json"),)
            except AgentHttpError:  # it answered: an agent before the route (404)
                self._engines = (None,)
            except NodeError:  # no answer (refused, timed out, cut off, not JSON)
                return None
        return self._engines[0]

    def lease_engine_id(self) -> str | None:
        """The ``ID`` of the docker CLI's engine (its ``GET /info``; for an address that is
        not a unix socket, ``followed_engine.address_id``), asked once a run; None: unknown."""
        if self._engine_id is None:
            said = None
            if self.lease_engine is not None:
                said = engine_api.engine_id(self.lease_engine)
            elif self.lease_address is not None:
                from controller.wrapper.followed_engine import address_id  # noqa: PLC0415

                options, command = self._options, self._command
                said = address_id(
                    self.lease_address, options.docker, command.global_args, options.environment
                )
            self._engine_id = (said,)
        return self._engine_id[0]

    def _agents_word_by_id(self) -> EngineCdi | None:
        """The agent's word on an engine reached other than by the socket the wrapper asks
        (``tcp://``, ``ssh://``, ``-H``), where a lease's check has asked both the agent's
        ``GET /engines/json`` and the engine's ``ID``: no further question."""
        options = self._options
        if self.socket is not None or options.cdi != "auto":
            return None
        if self._engines is None or self._engine_id is None:
            return None
        answer, said = self._engines[0], self._engine_id[0]
        if answer is None or said is None:
            return None
        return agent_engine_cdi(
            answer, "", options.docker, self._command, options.environment, engine_id=said
        )

    def _agents_word(self, agent: BlockingAgent | None) -> EngineCdi | None:
        options = self._options
        if agent is None or self.socket is None or options.cdi != "auto":
            return None
        answer = self.engines(agent)
        if answer is None:  # an agent before the route: the engine is asked
            return None
        return agent_engine_cdi(
            answer, self.socket, options.docker, self._command, options.environment
        )


def gpu_arguments(command: DockerCommand, options: Options) -> GpuArguments:
    """What to change in the command line (nothing inserted: run unchanged), and warnings."""
    docker = options.docker
    # docker --config DIR reads its config.json (docker context use) and contexts there
    settings = options
    if command.docker_config is not None:
        settings = replace(options, docker_config=command.docker_config)
    endpoint, warning = resolve(
        settings,
        docker_host_option=command.docker_host,
        docker_context_option=command.docker_context,
        docker_reads_docker_host=not is_podman(docker),
    )
    lease = lease_ask(command, options)  # a --gpus that cannot be read: before docker is asked
    if lease is not None:
        from controller.wrapper.rootless_podman import rootless_uid  # noqa: PLC0415 (a lease)

        rootless = rootless_uid(docker, command.global_args, options.environment)
        lease = replace(lease, rootless_podman=rootless)
    engine_socket = engine_api.engine_socket(options, command)
    lease_engine = lease_address = None
    if lease is not None and engine_socket is None:  # -H, --context, tcp://, ssh://
        lease_address = engine_api.cli_engine_address(settings, command)
        lease_engine = engine_api.unix_path(lease_address)
        lease_address = None if lease_engine is not None else lease_address
    cdi = CdiChoice(options, command, engine_socket, lease_engine, lease_address)
    refuse = None if lease is None else lambda: _refuse_before_pull(endpoint, options, lease, cdi)
    started = time.perf_counter()
    labels, asked = image_labels(options, command, engine_socket, refuse)
    if options.debug:
        sys.stderr.write(
            f"nvidia-docker | image: {command.image}'s labels from {asked} (in "
            f"{(time.perf_counter() - started) * 1000:.1f} ms)\n"
        )
    if labels is None or (VOLUMES_LABEL not in labels and lease is None):
        return GpuArguments([])
    # An ask for a lease wants GPUs whatever the image says: without the label, every volume
    wanted_volumes = " ".join(labels.get(VOLUMES_LABEL, "").split())
    devices_only = VOLUMES_LABEL in labels and not wanted_volumes
    cuda_needed = labels.get(CUDA_LABEL) or None
    started = time.perf_counter()
    gpus = options.gpus if isinstance(options.gpus, str) else ""
    reached = reach(endpoint, options)
    facts = _node_facts(
        endpoint,
        wanted_volumes,
        gpus,
        cuda_needed,
        cdi=cdi,
        reach=reached,
        lease=lease,
        terminal=options.progress,
    )
    if options.debug and facts.grant is not None:
        sys.stderr.write(
            f"nvidia-docker | lease: {facts.grant.text or facts.grant.lease} (node asked in "
            f"{(time.perf_counter() - started) * 1000:.1f} ms)\n"
        )
    warnings = (*([warning] if warning else []), *facts.warnings)
    args = list(facts.docker_args)
    if facts.cdi:  # the node's spec brings the control nodes and the driver volume
        pass
    elif devices_only:  # the label is there but names no volume: devices only
        args = [a for a in args if a.startswith("--device=")]
    elif endpoint.is_local:
        args = drop_volume_driver_when_present(args, options, command, engine_socket)
    if facts.grant is None:
        return GpuArguments(args, warnings=warnings)
    leased = facts.grant.docker_args(annotations=_runs_podman(docker, options.environment))
    return GpuArguments(
        [*args, *leased], (GPUS_OPTION,), warnings, _watch(facts.grant, facts.agent, reached)
    )


def _runs_podman(docker: Sequence[str], environment: Mapping[str, str]) -> bool:
    """Podman creates the leased container, and takes the lease's annotations too (its start
    hook reads them: docs/leases.md): ``podman``, ``sudo podman``, and a ``docker`` that runs
    Podman (podman-docker's script: ``rootless_podman.runs_podman``)."""
    if is_podman(docker):
        return True
    from controller.wrapper.rootless_podman import runs_podman  # noqa: PLC0415 (a lease)

    return runs_podman(docker, environment)


def _watch(grant: Grant, agent: Endpoint | None, reached: Reach) -> LeaseWatch | None:
    """What the watcher needs (``lease_watch``), for a grant it can watch."""
    if agent is None or grant.pending_s is None or not watchable(grant.lease, grant.pending_s):
        return None
    if reached.ssh is not None:  # the watcher has no terminal to ask a password on
        import dataclasses  # noqa: PLC0415 (SSH only: SshOptions is a dataclass)

        ssh = dataclasses.replace(reached.ssh, allow_password_prompt=False)
        reached = replace(reached, ssh=ssh)
    return LeaseWatch(agent, reached, grant.lease, grant.pending_s)
