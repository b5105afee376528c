"""Where the tests find the captures read off real machines: ``tests/fixtures`` of this
repository (``tests/fixtures/README.md`` says which machine and command each file came from).

Nothing is looked up outside the repository, and a missing file is an error (the read raises
``FileNotFoundError``), never a reason to skip: a checkout without its fixtures is broken.
"""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H200 = FIXTURES / "h200"  # one H200, driver 580.159.04
H200X2 = FIXTURES / "h200x2"  # two H200s joined by 18 NVLinks
ENGINES = FIXTURES / "engines"  # what real dockerd and Podman said of containers, events
REFERENCE_V101 = H200 / "reference-v1.0.1"  # what nvidia-docker-plugin 1.0.1 answered there
