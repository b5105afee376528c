"""``nvidia-docker-ctl``: the operators' command (``main``) and its command groups."""
