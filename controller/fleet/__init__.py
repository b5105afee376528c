"""Fleet queries: which nodes (``nodes``, ``inventory``), asking them all (``query``), and the
table and JSON the operator reads (``output``, ``table``)."""
