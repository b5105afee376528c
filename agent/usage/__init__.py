"""The usage ledger: who held which GPU, for how long, how busy, and which GPUs sit idle
(docs/usage.md)."""
