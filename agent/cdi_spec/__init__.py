"""The CDI spec on disk: the node's facts and host files as spec inputs, the other specs
of the directories engines read, and the writer that keeps ours current beside them."""
