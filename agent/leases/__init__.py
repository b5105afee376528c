"""The node's GPU lease table: a pure model (GPU facts, health, topology, holders and a clock
in; decisions out) with no I/O of its own. ``table.LeaseTable`` is the one entry point;
docs/leases.md is the page."""
