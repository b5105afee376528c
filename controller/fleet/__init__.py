"""Fleet queries: which nodes (``nodes``, ``inventory``, ``vars_dirs``), asking them all
(``query``), and the table and JSON the operator reads (``output``, ``table``), streamed in
bounded memory (``report``)."""
