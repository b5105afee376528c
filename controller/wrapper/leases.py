"""GPU leases for ``nvidia-docker run|create``: the ask, the grant, and what docker gets.

docs/nvidia-docker.md ("Leases") is the user's side, docs/leases.md ("The REST API") the
agent's contract. Four forms ask the node's agent for a lease:

- ``NV_GPU=auto`` / ``auto:N``: N free whole GPUs (the agent picks the best-connected set);
- ``NV_GPU=auto:mig:PROFILE`` / ``auto:mig:PROFILE:N``: N free MIG devices of that profile;
- docker's own ``--gpus N`` (also ``count=N``), ``--gpus all`` (every healthy GPU of the
  node: refused, with who holds what, while any of them is taken) and
  ``--gpus '"device=0,1"'`` (the devices named, checked against the lease table).

Everything else keeps nvidia-docker 1.0's behaviour (docs/nvidia-docker.md), with no
lease: ``NV_GPU=0,1`` (explicit GPUs, as Mesos frameworks set it), and no selection at all
(every GPU).

``lease_ask(command, options)`` reads the form (``LeaseAsk``, or None), before docker is
asked anything; ``ask_lease(agent, ask, ...)`` runs inside the wrapper's one connection to
the agent, after the CUDA check: ``POST /leases``, then ``Grant`` (201) or one
``GpuError`` line with the agent's own reason (409 refused, 408 waited and got none, 503 the
agent may not follow an engine, 400 the ask is malformed, 404/405 an agent older than
leases). The grant's ``Dev`` is what
``/docker/cli?dev=`` (or its CDI form) is asked for; ``Grant.docker_args`` are the labels
that bind the lease to the container when docker creates it, the cpuset of the GPUs' NUMA
nodes and ``NVIDIA_VISIBLE_DEVICES`` (so that an NVIDIA runtime, when it is the engine's
default, hands out the same GPUs, not the image's ``all``). A lease whose container never
comes (docker fails after the wrapper has become docker) is given back by the wrapper's
watcher (``lease_watch``) where the agent says how long it stays pending (``Grant.
pending_s``), else it ends by itself after the agent's pending time; one the wrapper cannot
use (its own later step fails) it gives back at once (``release``).
"""

from __future__ import annotations

import sys
import time

from controller import json_codec
from controller.errors import Failure, GpuError, NodeError
from controller.options import AutoGpus, Options
from controller.record import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from controller.transport.plain_http import BlockingAgent
    from controller.wrapper.docker_args import DockerCommand

GPUS_OPTION = "gpus"  # docker's --gpus: dropped from the command line when it asks
CPUSET_OPTIONS = ("cpuset-cpus", "cpuset-mems")
LEASES_PATH = "/leases"
HEALTH_PATH = "/gpu/health/json"
ENGINES_PATH = "/engines/json"
WAIT_MARGIN_S = 10.0  # a waiting ask's answer may come this long after its wait
WAIT_NOTE_AFTER_S = 1.0  # on a terminal, say that the ask waits once it has this long
RELEASE_TIMEOUT_S = 2.0
# The lease labels Podman's start hook reads, given to Podman's containers as annotations too
ANNOTATED_LABELS = (
    "nvidia-docker.lease",
    "nvidia-docker.lease.devices",
    "nvidia-docker.lease.mode",
)
MAX_OWNER_VALUE = 128  # the agent's bound on an owner label's value
MAX_PENDING_S = 24 * 3600.0  # a grant's PendingS beyond this is not the agent's
WAITABLE = frozenset({"not_enough", "taken", "others_waiting"})  # refusals a wait may cure
_GPUS_KEYS = "N, all, count=N, device=LIST, capabilities=, driver=, options="


@record
class LeaseAsk:
    """One ask, as ``POST /leases`` takes it, and how the user wrote it (``source``)."""

    source: str  # "NV_GPU=auto:2", "--gpus all": how messages name the ask
    count: int = 1
    mig_profile: str | None = None
    devices: str | None = None  # dev entries, space separated
    every_gpu: bool = False  # --gpus all: the node's healthy GPUs, named
    exclusive: bool = True
    wait_s: float = 0.0
    cpuset: bool = True
    owner: tuple[tuple[str, str], ...] = ()
    # the uid of the rootless Podman that makes the container (``rootless_podman``); None: none
    rootless_podman: int | None = None

    @property
    def what(self) -> str:
        """The ask in words: ``2 GPUs``, ``2 MIG 1g.18gb devices``, ``devices 0 1``."""
        if self.every_gpu:
            return "every GPU"
        if self.devices is not None:
            return "devices " + self.devices
        plural = "s" if self.count != 1 else ""
        if self.mig_profile is not None:
            return f"{self.count} MIG {self.mig_profile} device{plural}"
        return f"{self.count} GPU{plural}"

    def body(self, devices: str | None = None) -> dict[str, Any]:
        """The JSON body; ``devices`` names them (``--gpus all``: the node's, found now)."""
        named = devices if devices is not None else self.devices
        body: dict[str, Any] = {}
        if named is not None:
            body["devices"] = named
        else:
            body["count"] = self.count
            if self.mig_profile is not None:
                body["mig_profile"] = self.mig_profile
        body.update(
            exclusive=self.exclusive, wait_s=self.wait_s, owner=dict(self.owner), cpuset=self.cpuset
        )
        return body


@record
class GpusFlag:
    """docker's ``--gpus`` value, read as docker reads it (opts/gpus.go)."""

    count: int = 1  # -1: all
    devices: tuple[str, ...] = ()


def parse_gpus_flag(value: str) -> GpusFlag:
    """``--gpus`` as docker parses it: comma separated fields (CSV, so ``"device=0,1"``
    keeps its comma), a bare field is the count (``all`` or a number), ``count=``,
    ``device=``; ``capabilities=`` and ``options=`` are taken and need nothing here (the
    leased GPUs come with the whole driver volume or the CDI spec's files). Unlike docker,
    ``device=0,1`` without the inner quotes also means devices 0 and 1 (docker refuses it)."""
    # csv's C module: its reader with csv.reader's default dialect (excel), without csv.py,
    # which imports re (docs/nvidia-docker.md, "Speed")
    import _csv  # noqa: PLC0415 (--gpus only)

    shown = f"--gpus {value!r}"
    try:
        fields = next(_csv.reader([value]), [])
    except _csv.Error as err:
        raise GpuError(f"{shown} cannot be read: {err}") from None
    if not any(raw.strip() for raw in fields):
        raise GpuError(f"{shown} asks for nothing: docker's --gpus takes {_GPUS_KEYS}")
    count: int | None = None
    devices: list[str] = []
    seen: set[str] = set()
    for raw in fields:
        field = raw.strip()
        key, eq, val = field.partition("=")
        key = key.strip().lower()
        if not eq:
            if "device" in seen and field:  # device=0,1 unquoted: more devices
                devices.append(field)
                continue
            key, val = "count", field
        if key in seen:
            raise GpuError(f"{shown}: {key} is given twice; give it once")
        seen.add(key)
        if key == "count":
            count = _gpus_count(val.strip(), shown)
        elif key == "device":
            devices += [entry.strip() for entry in val.split(",") if entry.strip()]
        elif key == "driver":
            if val.strip().lower() not in ("", "nvidia"):
                raise GpuError(
                    f"{shown}: nvidia-docker leases NVIDIA GPUs, not driver {val.strip()!r}: "
                    "run docker itself for that driver"
                )
        elif key not in ("capabilities", "options"):
            raise GpuError(f"{shown}: unexpected key {key!r} (docker's --gpus takes {_GPUS_KEYS})")
    if "device" in seen and not devices:
        raise GpuError(f"{shown} names no device: give device=0,1 (indices or UUIDs), or a count")
    if devices and count is not None:
        raise GpuError(f"{shown}: a count and devices together; give one of them")
    if devices:
        return GpusFlag(count=0, devices=tuple(devices))
    return GpusFlag(count=1 if count is None else count)


def _gpus_count(text: str, shown: str) -> int:
    if text.lower() == "all":
        return -1
    try:
        count = int(text)
    except ValueError:
        raise GpuError(
            f"{shown}: the count must be a number or all (docker's --gpus takes {_GPUS_KEYS})"
        ) from None
    if count == 0:
        raise GpuError(
            f"{shown} asks for no GPU (docker reads a bare number as a count): for GPU 0 "
            "write --gpus '\"device=0\"', for one free GPU --gpus 1"
        )
    return -1 if count < 0 else count  # docker: a negative count is all


def lease_ask(command: DockerCommand, options: Options) -> LeaseAsk | None:
    """The lease this ``run``/``create`` asks for, or None (no lease: nvidia-docker 1.0's
    ``NV_GPU`` list, or no selection); ``GpuError`` for a ``--gpus`` that cannot be read or
    that meets ``NV_GPU``."""
    gpus = options.gpus
    flags = command.given(GPUS_OPTION)
    if flags > 1:
        raise GpuError(f"--gpus is given {flags} times: give it once (one lease per container)")
    flag = command.options.get(GPUS_OPTION) if flags else None
    if flag is not None and gpus:
        nv_gpu = gpus.text if isinstance(gpus, AutoGpus) else gpus
        raise GpuError(
            f"NV_GPU={nv_gpu} and --gpus {flag} both choose GPUs: use one of them (unset NV_GPU, "
            "or drop --gpus)"
        )
    if flag is None and not isinstance(gpus, AutoGpus):
        return None
    user_cpuset = any(name in command.options for name in CPUSET_OPTIONS)
    common: dict[str, Any] = {
        "exclusive": not options.gpu_shared,
        "wait_s": options.gpu_wait_s,
        "cpuset": options.cpuset and not user_cpuset,
        "owner": owner_labels(command, options),
    }
    if isinstance(gpus, AutoGpus):
        return LeaseAsk(f"NV_GPU={gpus.text}", gpus.count, gpus.mig_profile, **common)
    assert flag is not None
    parsed = parse_gpus_flag(flag)
    source = f"--gpus {flag}"
    if parsed.devices:
        return LeaseAsk(source, devices=" ".join(parsed.devices), **common)
    if parsed.count < 0:
        return LeaseAsk(source, every_gpu=True, **common)
    return LeaseAsk(source, parsed.count, **common)


def rootless_refusal(ask: LeaseAsk) -> str:
    """The line for a lease asked with rootless Podman (of user ``ask.rootless_podman``)
    whose containers the node's agent does not follow: the lease would not hold."""
    return (
        f"{ask.source} asks for a GPU lease, but Podman runs rootless here (uid "
        f"{ask.rootless_podman}) "
        "and the node's agent does not follow this user's containers, so the lease would end "
        "as soon as podman returns and its GPUs would go to the next ask: run it with root "
        'Podman (NV_DOCKER="sudo podman"), or name GPUs without a lease (NV_GPU=0,1, and no '
        "--gpus)"
    )


def refuse_rootless(agent: BlockingAgent, ask: LeaseAsk) -> None:
    """``GpuError`` (``rootless_refusal``) for an ask of rootless Podman whose user's own
    service ``agent`` does not follow (``engine_cdi.follows_own_engine``)."""
    uid = ask.rootless_podman
    if uid is not None and not _follows_own_engine(agent, uid):
        raise GpuError(rootless_refusal(ask))


def _follows_own_engine(agent: BlockingAgent, uid: int) -> bool:
    from controller.wrapper.engine_cdi import follows_own_engine  # noqa: PLC0415 (rootless only)

    status, body, _headers = agent.request("GET", ENGINES_PATH, answers=(200, 404, 405))
    if status != 200:  # an agent older than the route follows no such engine
        return False
    try:
        return follows_own_engine(json_codec.loads(body), uid)
    except ValueError:
        return False


def owner_labels(command: DockerCommand, options: Options) -> tuple[tuple[str, str], ...]:
    """Who asks: the user, the image, the container's ``--name`` when given (each value cut
    to the agent's bound)."""
    found = [("user", options.user), ("image", command.image or "")]
    name = command.options.get("name")
    if name:
        found.append(("name", name))
    return tuple(
        (key, value[:MAX_OWNER_VALUE]) for key, value in found if value and value.isprintable()
    )


def annotation_args(labels: Iterable[tuple[str, str]]) -> list[str]:
    """The lease's id, devices and mode among ``labels`` as Podman's ``--annotation`` flags,
    which its start hook reads (a runtime config has no labels: ``plugin.start_hook``); the
    devices joined by ``;``, as Podman 4 splits an ``--annotation`` value at commas and
    Podman 5 does not."""
    return [
        f"--annotation={key}={value.replace(',', ';')}"
        for key, value in labels
        if key in ANNOTATED_LABELS
    ]


@record
class Grant:
    """A ``201`` answer: the lease, its devices and what the container must carry."""

    lease: str  # "lease-3"
    dev: str  # /docker/cli's dev: "GPU-… GPU-…"
    uuids: tuple[str, ...]  # the units' UUIDs, for NVIDIA_VISIBLE_DEVICES
    labels: tuple[tuple[str, str], ...]
    cpuset_cpus: str | None
    cpuset_mems: str | None
    shared: tuple[str, ...]  # "GPU 3 (2 of 4)" for each unit the lease shares
    text: str  # the agent's line
    expires: str | None = None
    # seconds the lease stays pending (``PendingS``): an agent that says it serves
    # ``DELETE /leases/{id}/pending``, which the wrapper's watcher asks; None: an older one
    pending_s: float | None = None

    def docker_args(self, *, annotations: bool = False) -> list[str]:
        """The labels, the cpuset flags (when the answer has them) and the NVIDIA runtime's
        variable, as ``docker run`` takes them. ``annotations`` (Podman): the lease's id,
        devices and mode as OCI annotations too (``annotation_args``)."""
        args = [f"--label={key}={value}" for key, value in self.labels]
        if annotations:
            args += annotation_args(self.labels)
        if self.cpuset_cpus:
            args.append(f"--cpuset-cpus={self.cpuset_cpus}")
        if self.cpuset_mems:
            args.append(f"--cpuset-mems={self.cpuset_mems}")
        visible = ",".join(self.uuids) or ",".join(self.dev.split())
        args.append(f"--env=NVIDIA_VISIBLE_DEVICES={visible}")
        return args

    def warnings(self) -> list[str]:
        if not self.shared:
            return []
        return [
            f"{self.lease} is a shared lease: {', '.join(self.shared)}; other containers may "
            "use these GPUs at the same time"
        ]


def _grant(node: str, body: Any, ask: LeaseAsk) -> Grant:
    """The grant of a 201 body; ``NodeError`` when it is not one."""
    try:
        lease, dev = body["Lease"], body["Dev"]
        labels = body.get("Labels") or {}
        devices = body.get("Devices") or []
        if not (isinstance(lease, str) and lease and isinstance(dev, str) and dev.split()):
            raise TypeError
        if not isinstance(labels, dict) or not isinstance(devices, list):
            raise TypeError
        pairs = tuple((str(k), str(v)) for k, v in labels.items())
        uuids = tuple(str(d["UUID"]) for d in devices if isinstance(d, dict) and d.get("UUID"))
        shared = tuple(
            f"{_unit_name(d)} ({d.get('Sharers')} of {d.get('Sharing')})"
            for d in devices
            if isinstance(d, dict) and isinstance(d.get("Sharing"), int) and d["Sharing"] > 1
        )
        cpus, mems = body.get("CpusetCpus"), body.get("CpusetMems")
        pending = body.get("PendingS")
    except (KeyError, TypeError, AttributeError):
        raise NodeError(
            node,
            f"the answer to POST {LEASES_PATH} is not a lease grant (no Lease, Dev, Labels): "
            "is this an nvidia-docker agent?",
            Failure.NOT_AN_AGENT,
        ) from None
    return Grant(
        lease=lease,
        dev=" ".join(dev.split()),
        uuids=uuids,
        labels=pairs,
        cpuset_cpus=str(cpus) if ask.cpuset and cpus else None,
        cpuset_mems=str(mems) if ask.cpuset and mems not in (None, "") else None,
        shared=shared if not ask.exclusive else (),
        text=str(body.get("Text") or ""),
        expires=str(body["Expires"]) if body.get("Expires") else None,
        pending_s=_pending_s(pending),
    )


def _pending_s(value: object) -> float | None:
    """A grant's ``PendingS``: a number of seconds from 0 to ``MAX_PENDING_S``, else None
    (an older agent's grant has none: its release would not be conditional)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 < value <= MAX_PENDING_S else None


def _unit_name(device: dict[str, Any]) -> str:
    """``GPU 3``, ``MIG 0:1`` (a ``Devices`` entry of the grant)."""
    name = device.get("Name") or device.get("UUID")
    return f"{'GPU' if device.get('MIG') is None else 'MIG'} {name}"


def _said(body: bytes) -> tuple[str, dict[str, Any]]:
    """The agent's one line (``Error`` of a JSON body, else the first line) and the body."""
    try:
        decoded = json_codec.loads(body)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict) and isinstance(decoded.get("Error"), str):
        return " ".join(decoded["Error"].split()), decoded
    lines = body.decode("utf-8", "replace").strip().splitlines()
    return (lines[0].strip() if lines else "no reason given"), {}


def every_gpu(agent: BlockingAgent, info: Any) -> str:
    """``--gpus all``: the node's healthy GPUs, by UUID (an agent without health routes:
    every GPU of ``/gpu/info/json``)."""
    from controller.transport.agent_errors import AgentHttpError  # noqa: PLC0415

    listed = [d.get("UUID") for d in (info.get("Devices") or []) if isinstance(d, dict)]
    uuids = [str(u) for u in listed if u]
    try:
        health = agent.get_json(HEALTH_PATH)
    except AgentHttpError as err:
        if err.status != 404:
            raise
    else:
        entries = health.get("Devices") if isinstance(health, dict) else None
        if isinstance(entries, list):
            sick = {
                str(e.get("UUID"))
                for e in entries
                if isinstance(e, dict) and e.get("Healthy") is False
            }
            uuids = [u for u in uuids if u not in sick]
    if not uuids:
        raise GpuError(
            f"--gpus all: {agent.node} has no healthy GPU to lease (GET {HEALTH_PATH} says why)"
        )
    return " ".join(uuids)


def ask_lease(agent: BlockingAgent, ask: LeaseAsk, info: Any, *, terminal: bool = False) -> Grant:
    """``POST /leases`` for ``ask`` on ``agent`` (``info``: its ``/gpu/info/json``); the
    grant, or ``GpuError`` with the agent's reason (see the module docstring). ``terminal``:
    stderr is one, so a wait longer than a second is said there. An ask of rootless Podman
    is refused (``rootless_refusal``) unless the agent follows that Podman's user's own
    service (``engine_cdi.follows_own_engine``)."""
    refuse_rootless(agent, ask)
    devices = every_gpu(agent, info) if ask.every_gpu else None
    note = None
    if terminal and ask.wait_s > 0:
        import threading  # noqa: PLC0415 (a waiting ask on a terminal only)

        note = threading.Timer(WAIT_NOTE_AFTER_S, _waiting, (agent.node, ask))
        note.daemon = True
        note.start()
    try:
        status, body, _headers = agent.request(
            "POST",
            LEASES_PATH,
            payload=ask.body(devices),
            answers=(201, 400, 404, 405, 408, 409, 503),
            timeout_s=ask.wait_s + WAIT_MARGIN_S,
        )
    finally:
        if note is not None:
            note.cancel()
    if status == 201:
        try:
            decoded = json_codec.loads(body)
        except ValueError:
            decoded = None
        return _grant(agent.node, decoded, ask)
    said, decoded = _said(body)
    if status in (404, 405):
        raise GpuError(
            f"{ask.source} asks {agent.node} for a GPU lease, but its agent is older than "
            f"leases ({status} to POST {LEASES_PATH}): upgrade nvidia-docker-plugin on that "
            "node, or name GPUs without a lease (NV_GPU=0,1, and no --gpus)"
        )
    if status == 400:
        hint = ""
        if decoded.get("Field") == "devices":
            count = len(info.get("Devices") or [])
            have = f"GPUs 0 to {count - 1}" if count else "no GPUs"
            hint = f" (it has {have}; name indices, GPU-/MIG- UUID prefixes or <gpu>:<mig>)"
        raise GpuError(f"{ask.source}: {agent.node} refused the ask: {said}{hint}")
    refusal = decoded.get("Refusal")
    now = " now" if status == 409 else ""
    wait = ""
    if status == 409 and ask.wait_s == 0 and refusal in WAITABLE:
        wait = " (to wait for them in the node's queue: NV_GPU_WAIT=SECONDS, up to 600)"
    raise GpuError(f"{ask.source}: {agent.node} has no lease for {ask.what}{now}: {said}{wait}")


def _waiting(node: str, ask: LeaseAsk) -> None:
    stamp = time.strftime("%Y/%m/%d %H:%M:%S")
    sys.stderr.write(
        f"nvidia-docker | {stamp} Warning: {ask.source} waits in the queue of {node} for "
        f"{ask.what}, up to {ask.wait_s:g} s (Ctrl-C gives up)\n"
    )
    sys.stderr.flush()


def release(agent: BlockingAgent, lease: str) -> None:
    """Give back a lease the wrapper cannot use (best effort: it also ends by itself)."""
    try:  # noqa: SIM105 (contextlib is not imported on the run path)
        agent.request(
            "DELETE", f"{LEASES_PATH}/{lease}", answers=(200, 404, 409), timeout_s=RELEASE_TIMEOUT_S
        )
    except NodeError:
        pass
