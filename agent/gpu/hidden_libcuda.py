"""Keeps ``libcuda`` out of the GPU worker, where NVML would load it for the CUDA version only.

``nvmlInit`` opens ``libcuda.so.1`` (by name, through the dynamic loader) and keeps it mapped
for as long as NVML is open, only to answer ``nvmlSystemGetCudaDriverVersion``: 3.9 MB of
the worker's resident memory on an H100 node with driver 580, and libcuda's initialisers
running in a process that lives as long as the agent. Every other NVML call the agent makes
works without it (docs/gpu-backends.md, "Where each `/gpu/info` field comes from": "The GPU
worker's NVML runs without libcuda").

So the worker starts with ``EMPTY_LIBCUDA_DIR`` first on ``LD_LIBRARY_PATH``: a directory of
this package holding an empty file named ``libcuda.so.1``. The loader, asked for that name,
finds the empty file first and fails ("file too short") instead of searching on, so NVML
carries on without libcuda and its CUDA version call answers "not found". The CUDA version
then comes from the short-lived child that reads CUDA's facts anyway (``cuda_probe``), whose
environment has the directory removed again (``without_empty_libcuda``), so that it loads
the same ``libcuda.so.1`` NVML would have loaded. A loader that searched on, or an NVML that
opened libcuda by path, would only bring back the memory: the version is still right.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

EMPTY_LIBCUDA_DIR = os.path.join(os.path.dirname(__file__), "empty_libcuda")
VARIABLE = "LD_LIBRARY_PATH"


def with_empty_libcuda(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``EMPTY_LIBCUDA_DIR`` first on ``LD_LIBRARY_PATH`` (the worker's)."""
    env = without_empty_libcuda(environ)
    rest = env.get(VARIABLE)
    env[VARIABLE] = f"{EMPTY_LIBCUDA_DIR}{os.pathsep}{rest}" if rest else EMPTY_LIBCUDA_DIR
    return env


def without_empty_libcuda(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``EMPTY_LIBCUDA_DIR`` taken off ``LD_LIBRARY_PATH`` (the worker's
    children); the variable is removed when nothing else was on it, never left empty (an
    empty entry would mean the current directory)."""
    env = dict(environ)
    value = env.get(VARIABLE)
    if value is None:
        return env
    entries = value.split(os.pathsep)
    if EMPTY_LIBCUDA_DIR not in entries:
        return env
    kept = [entry for entry in entries if entry != EMPTY_LIBCUDA_DIR]
    if kept:
        env[VARIABLE] = os.pathsep.join(kept)
    else:
        del env[VARIABLE]
    return env
