"""``nvidia-docker``: the docker wrapper (``cli``), its command-line scan and its GPU arguments.

Nothing is imported here: the wrapper's pass-through path must stay as cheap as a bare exec.
"""
