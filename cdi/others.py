"""Other CDI specs that define devices of our kind, and what engines then do with ours.

Engines (Podman, Docker 25+, containerd, CRI-O) load specs through the CDI project's library
(container-device-interface, ``pkg/cdi``: ``cache.go`` and ``spec-dirs.go``). It reads every
``*.json`` and ``*.yaml`` file of its spec directories (``/etc/cdi``, then ``/var/run/cdi``
unless configured otherwise); a directory's *priority* is its place in that list, later
wins. Two specs that define the same device (kind and name, ``nvidia.com/gpu=0``):

- in directories of different priority: the device of the later directory is used;
- in directories of the same priority, i.e. the same directory: a conflict; the library
  records an error for both files and removes the device from its cache altogether, so
  ``--device nvidia.com/gpu=0`` fails as an unresolvable device, whichever spec you meant.

``standing`` applies those rules to ours and the others found (docs/cdi.md, "Beside NVIDIA's
toolkit"); the agent reads the files (``agent.cdi_spec.other_specs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cdi.spec import valid_kind, valid_name


@dataclass(frozen=True, slots=True)
class OtherSpec:
    """A spec file of another producer, as engines see it."""

    path: str  # in a spec directory (a link there counts where the link is)
    directory: str  # that directory, resolved
    kind: str
    names: frozenset[str]  # its device names (without the kind)


def summarize(document: object) -> tuple[str, frozenset[str]] | None:
    """A parsed spec's kind and device names; None when it is not a spec with a kind."""
    if not isinstance(document, Mapping):
        return None
    kind = document.get("kind")
    if not isinstance(kind, str) or not valid_kind(kind):
        return None
    devices = document.get("devices")
    names = frozenset(
        device["name"]
        for device in (devices if isinstance(devices, list) else [])
        if isinstance(device, Mapping)
        and isinstance(device.get("name"), str)
        and valid_name(device["name"])
    )
    return kind, names


@dataclass(frozen=True, slots=True)
class Standing:
    """Where ours stands among the others that define some of its devices."""

    clashing: tuple[OtherSpec, ...] = ()  # beside ours, in one directory: engines drop both
    elsewhere: tuple[OtherSpec, ...] = ()  # in other directories: directory order decides

    @property
    def aside(self) -> bool:
        """Whether ours must go for the devices to work (the others serve them)."""
        return bool(self.clashing)

    @property
    def names_in_force(self) -> frozenset[str]:
        """When ours is aside: the device names the clashing specs define."""
        return frozenset(name for other in self.clashing for name in other.names)


def standing(
    kind: str, names: Iterable[str], our_dirs: Iterable[str], others: Iterable[OtherSpec]
) -> Standing:
    """Which ``others`` define a device of ours (``kind``, one of ``names``), split into
    those in a directory engines read ours from (``our_dirs``, resolved) and the rest."""
    ours = frozenset(names)
    dirs = frozenset(our_dirs)
    colliding = [o for o in others if o.kind == kind and o.names & ours]
    return Standing(
        clashing=tuple(o for o in colliding if o.directory in dirs),
        elsewhere=tuple(o for o in colliding if o.directory not in dirs),
    )


def later(first: str, second: str, order: Iterable[str]) -> str | None:
    """Of two spec directories, the one an engine with directory list ``order`` takes a
    device from (the later one); None when either is not in the list."""
    listed = list(order)
    if first not in listed or second not in listed:
        return None
    return first if listed.index(first) > listed.index(second) else second
