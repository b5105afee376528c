"""The CDI spec on disk: the node's facts as spec inputs, and the writer that keeps it current."""
