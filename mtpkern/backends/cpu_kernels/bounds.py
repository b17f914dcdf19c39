"""Index checks the launchers run before a kernel reads or writes at those
indices (NumPy would wrap a negative one around; a kernel would read or write
out of bounds). One serial pass each: ``a.min()`` and ``a.max()`` plus the
fancy indexing for the attention tables cost ~30 us of Python per call."""

from __future__ import annotations

from numba import njit


@njit(cache=True, fastmath=False)
def first_outside(a, lo, hi):
    """Flat index of the first element of ``a`` (C-contiguous, any rank) outside [lo, hi), or -1."""
    f = a.reshape(-1)
    for i in range(f.shape[0]):
        if f[i] < lo or f[i] >= hi:
            return i
    return -1


@njit(cache=True, fastmath=False)
def first_outside_each(a, hi):
    """The first index r with ``a[r]`` outside [0, hi[r]), or -1 (a, hi: 1-D, one length)."""
    for r in range(a.shape[0]):
        if a[r] < 0 or a[r] >= hi[r]:
            return r
    return -1


@njit(cache=True, fastmath=False)
def first_bad_table_entry(block_tables, row_seq, row_start, row_len, BS, NB):
    """The first block-table entry some row reads (row r reads
    ``block_tables[row_seq[r], row_start[r] // BS : ceil(row_len[r] / BS)]``, rows in
    order; ``row_start`` empty: from 0) outside [0, NB): ``(r, b)``, or (-1, -1).
    row_seq, row_start and row_len are already checked."""
    for r in range(row_seq.shape[0]):
        s = row_seq[r]
        b0 = row_start[r] // BS if row_start.shape[0] > 0 else 0
        for b in range(b0, (row_len[r] + BS - 1) // BS):
            if block_tables[s, b] < 0 or block_tables[s, b] >= NB:
                return r, b
    return -1, -1
