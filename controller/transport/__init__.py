"""How the controller reaches a node's agent: the ``NV_HOST`` grammar (``endpoint``), the HTTP
client (``client``) and the SSH tunnel under it (``ssh_tunnel``)."""
