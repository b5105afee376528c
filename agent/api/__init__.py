"""The REST API: its routes, the query at the edge, and the renderers of every answer."""
