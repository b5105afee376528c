"""A container create that asks for GPUs, read and rewritten (pure: JSON in, JSON out).

``is_create`` tells a ``POST (/vN.NN)?/containers/create`` apart; ``gpu_request`` reads
what its ``HostConfig.DeviceRequests`` ask of GPUs (a request whose driver is ``nvidia``,
whose capabilities name ``gpu``, or that has no driver and capabilities that dockerd's
nvidia driver matches; ``Count`` N, -1 for every GPU, or ``DeviceIDs``), or None
when they ask for none. ``rewrite`` returns the body an engine without NVIDIA's runtime
understands: those requests removed (others kept), and in their place either the lease's
CDI devices (one request of driver ``cdi``, as the docker CLI sends ``--device
nvidia.com/gpu=...`` to an engine that reads CDI) or its device nodes added to
``HostConfig.Devices`` and the driver volume to ``HostConfig.Mounts`` (a volume of the
plugin's driver, as ``/docker/cli`` gives it; for Podman's service, which has no Docker
volume plugins, the volume's directory bound read-only); then the lease labels (over any
the client sent), ``NVIDIA_VISIBLE_DEVICES`` (over the client's), and the cpuset unless the
client set one.
A create labelled ``nvidia-docker.lease.wait=SECONDS`` (``WAIT_LABEL``; 0 to
``MAX_WAIT_S``) waits that long in the lease queue when its GPUs are not free now.
A GPU request whose ``Options`` hold ``mig-profile`` (``MIG_OPTION``: ``docker run --gpus
'count=2,options=mig-profile=1g.18gb'``, Compose's ``options:``) asks for ``Count`` MIG devices
of that profile.
``CreateError`` is a body that cannot be read, with the status and line to answer.

dockerd reads a create with Go's ``encoding/json``, which takes a key spelled in any case
for a field (``hostConfig``; by Unicode's simple case folding, so ``Ho\u017ftConfig`` with
a long s too), and decodes a key given twice twice, the later value over the earlier (into
the object or array decoded before, merged). So every create is refused (400) where a key
on the way to GPU requests (``HostConfig``, its ``DeviceRequests``, their ``Driver``,
``Count``, ``DeviceIDs``, ``Capabilities``, ``Options``) is spelled otherwise than Docker's
API spells it or is given twice, or where ``DeviceRequests`` is a top-level key (dockerd
20.10 reads it as the ``HostConfig``'s of a create without one); a GPU create also for the
keys the rewrite sets (``Env``, ``Labels``, ``HostConfig.Devices``, ``Mounts``,
``CpusetCpus``, ``CpusetMems``). Otherwise a create read here as asking for no GPU, or for
GPUs under other keys than those rewritten, could ask dockerd for GPUs without a lease.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.leases.settings import MAX_WAIT_S
from plugin.json_body import BodyError, parse_json

MAX_CREATE_BYTES = 4 * 1024 * 1024
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
CDI_DRIVER = "cdi"  # the device driver of Docker 25+ that resolves CDI names
_CREATE = re.compile(rb"(?:/v[0-9]{1,3}\.[0-9]{1,3})?/containers/create(?:\?.*)?", re.DOTALL)
MAX_IDS = 64
WAIT_LABEL = "nvidia-docker.lease.wait"  # seconds a create may wait for its GPUs
MIG_OPTION = "mig-profile"  # a GPU request's option: Count MIG devices of this profile
_REQUEST_KEYS = ("Driver", "Count", "DeviceIDs", "Capabilities", "Options")
# What dockerd's nvidia device driver matches a request without a Driver by: one of its
# capability lists holding only these (moby registers it where NVIDIA's hook is installed).
NVIDIA_CAPABILITIES = frozenset(
    ("gpu", "nvidia", "compute", "compat32", "graphics", "utility", "video", "display")
)


class CreateError(ValueError):
    """A create the socket answers itself: ``status``, ``str()`` the one line (``text``
    after ``nvidia-docker: ``, so that whoever reads it knows who refused it)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"nvidia-docker: {text}")
        self.status = status


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """What a create asks of GPUs: ``count`` (-1: every GPU) whole GPUs, or ``count`` MIG
    devices of ``mig_profile``, or the ``device_ids``; how long it may wait for them
    (``wait_s``, its ``WAIT_LABEL``)."""

    count: int = 0
    device_ids: tuple[str, ...] = ()
    wait_s: float = 0.0
    mig_profile: str | None = None

    @property
    def every_gpu(self) -> bool:
        return self.count < 0 and not self.device_ids


@dataclass(frozen=True, slots=True)
class Mount:
    """A named volume of a volume driver (``driver``), or a host directory bound (``driver``
    None: ``source`` is its path), as ``HostConfig.Mounts`` takes it."""

    source: str
    target: str
    read_only: bool
    driver: str | None


@dataclass(frozen=True, slots=True)
class Addition:
    """What a grant adds to a create."""

    devices: tuple[str, ...]  # device nodes, the same path inside
    mounts: tuple[Mount, ...] = ()
    cdi_devices: tuple[str, ...] = ()  # "nvidia.com/gpu=GPU-...": the CDI form
    labels: Mapping[str, str] = field(default_factory=dict)
    visible: str = ""  # NVIDIA_VISIBLE_DEVICES
    cpuset_cpus: str | None = None
    cpuset_mems: str | None = None


def is_create(method: bytes, target: bytes) -> bool:
    return method == b"POST" and _CREATE.fullmatch(target) is not None


def container_name(target: bytes) -> str | None:
    """The ``name`` query parameter of a create's target, when given and printable."""
    query = urllib.parse.urlsplit(target.decode("latin-1")).query
    names = urllib.parse.parse_qs(query).get("name")
    name = names[-1].lstrip("/") if names else ""
    return name if name and name.isprintable() else None


class _Object(dict[str, Any]):
    """A JSON object as read: ``keys_read`` are its keys in order, a repeated one as often
    as it was given (the dict keeps the last value, dockerd decodes each)."""

    keys_read: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    read = _Object(pairs)
    read.keys_read = tuple(key for key, _ in pairs)
    return read


def read_body(raw: bytes) -> dict[str, Any]:
    """The create's JSON object; ``CreateError`` (400) when it is not one."""
    try:
        parse_json(raw)  # within its bounds, else its line
    except BodyError as err:
        raise CreateError(400, f"the container's create body: {err}") from None
    body = json.loads(raw, object_pairs_hook=_object)
    if not isinstance(body, dict):
        raise CreateError(400, "the container's create body is not a JSON object")
    return body


def _check_keys(obj: Mapping[str, Any], where: str, names: tuple[str, ...]) -> None:
    """``CreateError`` (400) for a key of ``obj`` that dockerd reads as one of ``names``
    but that is spelled otherwise, or that is given twice. ``casefold`` folds at least
    what Go's case-insensitive match folds to these ASCII names."""
    folded = {name.casefold(): name for name in names}
    seen: set[str] = set()
    for key in obj.keys_read if isinstance(obj, _Object) else tuple(obj):
        name = folded.get(key.casefold())
        if name is None:
            continue
        if key != name:
            raise CreateError(
                400,
                f"the create body's key {where}{key!a} is read by the engine as {where}{name} "
                f"and not here: spell it {name!r}, as Docker's API does",
            )
        if key in seen:
            raise CreateError(400, f"the create body gives {where}{name} twice: give it once")
        seen.add(key)


def _is_gpu(request: object) -> bool:
    """Whether a device request asks for GPUs: its driver is ``nvidia``, a capability list
    names ``gpu``, or it has no driver and a capability list of ``NVIDIA_CAPABILITIES``
    only (``[["nvidia"]]``, ``[["compute", "utility"]]``), which dockerd gives to NVIDIA."""
    if not isinstance(request, dict):
        return False
    driver = request.get("Driver")
    if str(driver or "").lower() == "nvidia":
        return True
    capabilities = request.get("Capabilities") or []
    if not isinstance(capabilities, list):
        return False
    groups = [group for group in capabilities if isinstance(group, list)]
    return any("gpu" in group for group in groups) or (
        not driver
        and any(
            all(isinstance(c, str) and c in NVIDIA_CAPABILITIES for c in group) for group in groups
        )
    )


def _host_config(body: Mapping[str, Any]) -> dict[str, Any] | None:
    host = body.get("HostConfig")
    if host is None:
        return None
    if not isinstance(host, dict):
        raise CreateError(400, "HostConfig is not a JSON object")
    return host


def _check_shape(body: Mapping[str, Any], host: Mapping[str, Any]) -> None:
    """``CreateError`` (400) for a field that ``rewrite`` extends and that has not the
    engine's type (the engine would refuse it too; here no lease is taken for it)."""
    env, labels = body.get("Env"), body.get("Labels")
    if env is not None and not (isinstance(env, list) and all(isinstance(e, str) for e in env)):
        raise CreateError(400, "Env is not a JSON array of strings")
    if labels is not None and not isinstance(labels, dict):
        raise CreateError(400, "Labels is not a JSON object")
    for name in ("Devices", "Mounts"):
        value = host.get(name)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, dict) for v in value)
        ):
            raise CreateError(400, f"HostConfig.{name} is not a JSON array of objects")
    for name in ("CpusetCpus", "CpusetMems"):
        if not isinstance(host.get(name) or "", str):
            raise CreateError(400, f"HostConfig.{name} is not a string")
    _check_keys(body, "", ("Env", "Labels"))
    _check_keys(host, "HostConfig.", ("Devices", "Mounts", "CpusetCpus", "CpusetMems"))


def gpu_request(body: Mapping[str, Any]) -> GpuRequest | None:
    """What ``body``'s device requests ask of GPUs; None when none asks for GPUs.
    ``CreateError`` (400) for GPU requests, or fields the rewrite extends, that are
    malformed, or whose keys dockerd would read otherwise (the module's docstring)."""
    _check_keys(body, "", ("HostConfig",))
    if any(key.casefold() == "devicerequests" for key in body):
        raise CreateError(
            400, "the create body has DeviceRequests at its top: put them in its HostConfig"
        )
    host = _host_config(body)
    if host is not None:
        _check_keys(host, "HostConfig.", ("DeviceRequests",))
    requests = host.get("DeviceRequests") if host is not None else None
    if not requests:
        return None
    if not isinstance(requests, list):
        raise CreateError(400, "HostConfig.DeviceRequests is not a JSON array")
    for request in requests:
        if isinstance(request, dict):
            _check_keys(request, "HostConfig.DeviceRequests[].", _REQUEST_KEYS)
    gpus = [r for r in requests if _is_gpu(r)]
    if not gpus:
        return None
    count, ids = 0, []
    profiles = {_mig_profile(request) for request in gpus}
    if len(profiles) > 1:
        raise CreateError(400, "GPU device requests ask for different MIG profiles")
    (profile,) = profiles
    for request in gpus:
        raw_count, raw_ids = request.get("Count", 0), request.get("DeviceIDs") or []
        if isinstance(raw_count, bool) or not isinstance(raw_count, int):
            raise CreateError(400, "a GPU device request's Count is not a whole number")
        if not isinstance(raw_ids, list) or not all(
            isinstance(i, str) and i.strip() and i.isprintable() and " " not in i for i in raw_ids
        ):
            raise CreateError(400, "a GPU device request's DeviceIDs are not device names")
        if raw_ids and raw_count not in (0, len(raw_ids)):
            raise CreateError(400, "a GPU device request gives both a Count and DeviceIDs")
        if raw_ids:
            ids += [i for i in raw_ids if i not in ids]
        elif raw_count < 0 or count < 0:
            count = -1
        else:
            count += raw_count
    if ids and count:
        raise CreateError(400, "GPU device requests ask for a count and for named devices")
    if len(ids) > MAX_IDS:
        raise CreateError(400, f"more than {MAX_IDS} GPU DeviceIDs")
    if not ids and count == 0:
        raise CreateError(400, "a GPU device request asks for no GPU (Count 0, no DeviceIDs)")
    if profile is not None and (ids or count < 0):
        raise CreateError(
            400,
            f"a GPU device request with the option {MIG_OPTION} asks for a count of MIG "
            "devices (count=N), not named devices or all",
        )
    assert host is not None
    _check_shape(body, host)
    return GpuRequest(count, tuple(ids), _wait_s(body.get("Labels") or {}), profile)


def _mig_profile(request: Mapping[str, Any]) -> str | None:
    """The request's ``MIG_OPTION`` (None without it); ``CreateError`` (400)."""
    options = request.get("Options") or {}
    if not isinstance(options, dict):
        raise CreateError(400, "a GPU device request's Options are not a JSON object")
    profile = options.get(MIG_OPTION)
    if profile is None:
        return None
    if not isinstance(profile, str) or not profile.strip():
        raise CreateError(400, f"the GPU option {MIG_OPTION} is not a MIG profile (like 1g.18gb)")
    return profile.strip()


def _wait_s(labels: Mapping[str, Any]) -> float:
    """The seconds of the create's ``WAIT_LABEL`` (0 without it); ``CreateError`` (400)."""
    raw = labels.get(WAIT_LABEL)
    if raw is None:
        return 0.0
    try:
        wait = float(raw) if isinstance(raw, str) else math.nan
    except ValueError:  # "" and "soon" alike
        wait = math.nan
    if not (math.isfinite(wait) and 0 <= wait <= MAX_WAIT_S):
        shown = str(raw)[:40]
        raise CreateError(
            400,
            f"the label {WAIT_LABEL}={shown!r} is not a number of seconds from 0 to "
            f"{MAX_WAIT_S:g} (how long the create may wait for free GPUs)",
        )
    return wait


def rewrite(body: Mapping[str, Any], addition: Addition) -> dict[str, Any]:
    """``body`` with its GPU device requests replaced by ``addition`` (a new object)."""
    new = dict(body)
    host = dict(_host_config(body) or {})
    requests = host.get("DeviceRequests") or []
    kept = [r for r in requests if not _is_gpu(r)] if isinstance(requests, list) else []
    if addition.cdi_devices:
        kept.append(
            {
                "Driver": CDI_DRIVER,
                "Count": 0,
                "DeviceIDs": list(addition.cdi_devices),
                "Capabilities": None,
                "Options": {},
            }
        )
    host["DeviceRequests"] = kept or None
    devices = list(host.get("Devices") or [])
    present = {d.get("PathOnHost") for d in devices if isinstance(d.get("PathOnHost"), str)}
    for path in addition.devices:
        if path not in present:
            devices.append(
                {"PathOnHost": path, "PathInContainer": path, "CgroupPermissions": "rwm"}
            )
    host["Devices"] = devices
    if addition.mounts:
        mounts = list(host.get("Mounts") or [])
        for mount in addition.mounts:
            given: dict[str, Any] = {
                "Type": "volume" if mount.driver is not None else "bind",
                "Source": mount.source,
                "Target": mount.target,
                "ReadOnly": mount.read_only,
            }
            if mount.driver is not None:
                given["VolumeOptions"] = {"DriverConfig": {"Name": mount.driver}}
            mounts.append(given)
        host["Mounts"] = mounts
    if addition.cpuset_cpus and not host.get("CpusetCpus") and not host.get("CpusetMems"):
        host["CpusetCpus"] = addition.cpuset_cpus
        if addition.cpuset_mems:
            host["CpusetMems"] = addition.cpuset_mems
    new["HostConfig"] = host
    labels = body.get("Labels") or {}
    new["Labels"] = {**(labels if isinstance(labels, dict) else {}), **addition.labels}
    env = body.get("Env") or []
    env = [e for e in env if not (isinstance(e, str) and e.startswith(VISIBLE + "="))]
    new["Env"] = [*env, f"{VISIBLE}={addition.visible}"] if addition.visible else env
    return new
