"""CuPy RawModule launchers, one module per kernel family (see mtpkern.ops), and
the memoised module loader (``loader``). Importing them touches neither CuPy
nor a GPU; a family compiles on its first launch.

Every launcher validates with the family's ``check_*``, computes its launch
configuration in one place, passes scalars as exact NumPy types, and takes
optional ``out=`` / workspace buffers (allocation-free launches, as CUDA-graph
capture needs).
"""
