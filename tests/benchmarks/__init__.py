"""Benchmarks: scripts run by hand (``python -m tests.benchmarks.<name>``), not collected by
pytest; their figures are in docs/performance.md and the pages it links.

The agents they start write no CDI spec unless a benchmark asks for one: the agent's
default directory, /var/run/cdi, is the machine's own and every CDI engine on it reads it
(tests/conftest.py does the same for the test suite).
"""

import os

os.environ.setdefault("NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR", "")
