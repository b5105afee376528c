#!/usr/bin/env python3
"""A recording stand-in for the docker CLI, for the wrapper's unit tests (NV_DOCKER).

State lives in ``$FAKE_DOCKER_DIR``: ``calls`` (one JSON argv per line), ``images/<name>.json``
(labels of present images), ``registry/<name>.json`` (what ``pull`` can fetch),
``volumes/<name>`` (volumes that exist), ``engine.json`` (what ``version --format`` and
``info --format`` answer: ``{"version": {...}, "cdi_spec_dirs": [...]}``; default a Docker
20.10 engine, which has no CDI), ``warning`` (written to stderr first by every command, as
Podman 5 warns about cgroups v1 at each), ``inspect-error`` (``image inspect`` fails with it).
Any other command prints ``EXEC <argv as JSON>``:
that is the command the wrapper finally executed; then ``ENV <its CUDA_* variables>``.
"""

import json
import os
import sys
from pathlib import Path

state = Path(os.environ["FAKE_DOCKER_DIR"])
argv = sys.argv[1:]
with (state / "calls").open("a") as calls:
    calls.write(json.dumps(argv) + "\n")

# skip global options the wrapper may pass through (-H x, -D)
args = list(argv)
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-H", "--host", "-c", "--context", "-l") else args[1:]


def key(name: str) -> str:
    return name.replace("/", "_").replace(":", "_")


if (state / "warning").exists():
    sys.stderr.write((state / "warning").read_text())
if args[:2] == ["image", "inspect"]:
    image = args[-1]
    if (state / "inspect-error").exists():
        sys.stderr.write((state / "inspect-error").read_text())
        sys.exit(125)
    path = state / "images" / f"{key(image)}.json"
    if not path.exists():
        sys.stderr.write(f"Error response from daemon: No such image: {image}\n")
        sys.exit(1)
    print(path.read_text().strip())
elif args[:1] == ["pull"]:
    image = args[-1]
    source = state / "registry" / f"{key(image)}.json"
    if not source.exists():
        sys.stderr.write(f"Error response from daemon: pull access denied for {image}\n")
        sys.exit(1)
    print(f"pulling {image}: done")
    (state / "images" / f"{key(image)}.json").write_text(source.read_text())
elif args[:1] in (["version"], ["info"]) and "--format" in args:
    engine_file = state / "engine.json"
    engine = json.loads(engine_file.read_text()) if engine_file.exists() else {}
    version = engine.get("version") or {
        "Client": {"Version": "28.2.2", "ApiVersion": "1.41", "Os": "linux", "Arch": "amd64"},
        "Server": {"Version": "20.10.24+dfsg1", "ApiVersion": "1.41"},
    }
    if args[0] == "version":
        print(json.dumps(version))
    elif "OsArch" in version.get("Client", {}):  # podman: no such field in its info
        sys.stderr.write("Error: template: info:1:7: can't evaluate field CDISpecDirs\n")
        sys.exit(125)
    else:
        print(json.dumps(engine.get("cdi_spec_dirs")))
elif args[:2] == ["volume", "inspect"]:
    if not (state / "volumes" / args[2]).exists():
        sys.stderr.write(f"Error response from daemon: get {args[2]}: no such volume\n")
        sys.exit(1)
    print("[{}]")
else:
    print("EXEC " + json.dumps(argv))
    # the CUDA variables docker was given: the wrapper must pass the user's through unchanged
    print("ENV " + json.dumps({k: v for k, v in os.environ.items() if k.startswith("CUDA_")}))
