"""Who runs each GPU process: a Docker (or Podman) container, a Mesos task, or the host."""
