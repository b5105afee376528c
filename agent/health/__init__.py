"""GPU health: the daemon's monitor, what unhealthy GPUs may not be handed out, and its
rendering."""
