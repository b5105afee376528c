"""The container engines' APIs (Docker's, and Podman's compatible one): one bounded client
per engine (``http``), shared with attribution; their containers as the lease table takes
them (``containers``) and their container events (``events``)."""
