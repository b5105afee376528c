"""The lease table at work in the daemon: its owner, its state file, its REST routes and
what feeds it (docs/leases.md)."""
