"""GPU model and its backends: NVML (real) and simulated (from a node file)."""
