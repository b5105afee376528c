"""The HTTP edge: listening, TLS, tokens, connection bounds, the error log, the plugin socket."""
