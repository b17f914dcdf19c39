"""CuPy RawModule launchers, one module per kernel family (see mtpkern.ops), and the memoised module loader."""
