"""Run ``nvidia-docker-ctl`` in a process whose low descriptor numbers are all taken.

::

    python -m tests.support.crowded_ctl --hold 1100 --nofile 8192 -- status --nodes F

``select.select`` fails (``ValueError: filedescriptor out of range``) for any descriptor above
1,023. Holding 1,100 descriptors open (``/dev/null``) before the tool starts makes every
socket, pipe and epoll handle it opens land above that line, as in a query of a few hundred
SSH nodes at once: any code path still using ``select`` breaks at the first node. The soft
``RLIMIT_NOFILE`` is set to ``--nofile`` first (it must be above 4,096: the fleet tool's
``--parallel`` goes to 4,096), and the tool then runs as ``python -m controller.ctl.main``.
"""

from __future__ import annotations

import argparse
import os
import resource
import runpy
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=int, default=1100, help="descriptors to hold open")
    parser.add_argument("--nofile", type=int, default=8192, help="soft RLIMIT_NOFILE to set")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < options.nofile:
        sys.exit(f"crowded_ctl: the hard descriptor limit {hard} is below {options.nofile}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (options.nofile, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(options.hold)]
    if max(held) < 1024:
        sys.exit("crowded_ctl: the held descriptors do not reach above 1,023")
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    sys.argv = ["nvidia-docker-ctl", *args]
    runpy.run_module("controller.ctl.main", run_name="__main__")


if __name__ == "__main__":
    main()
