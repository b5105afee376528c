"""How the controller reaches a node's agent: the ``NV_HOST`` grammar (``endpoint``; docker's
own address and contexts: ``docker_context``), the HTTP clients (``client`` for one node,
``fleet_http`` for thousands; what a failed answer means: ``agent_errors``), TLS and tokens
(``tls``), and the SSH tunnel under them (``ssh_tunnel``, with ``ssh_config``)."""
