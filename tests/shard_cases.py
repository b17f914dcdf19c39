"""Shared by tests/test_shard.py and tests/mpi_worker.py: one call script run by a single-rank
proposer and by every rank of a sharded one, and the comparison of their logs.

A log holds, after every call of the script, the drafts (and confidences) it returned, the
error it raised (by type), and every live state's KV rows per module, so that the ranks and
the single-rank run can be compared call for call: drafts identical, each rank's KV its
slice of the single-rank KV (its KV heads; MLA: the latent row whole).
"""

from __future__ import annotations

import numpy as np

from conftest import kv_rows
from mtpkern.errors import NoAllowedToken

#: the calls a script draws from: a batched propose round (verify, catch-up), a new
#: sequence, a carried sequence, a freed one, a propose that no grammar allows, and a draft
#: tree (verified along a path, caught up)
OPS = ("round", "round", "round", "new", "carry", "free", "refused", "tree")


def script(seed: int, length: int = 8) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    return [(OPS[int(rng.integers(0, len(OPS)))], int(rng.integers(0, 2**31 - 1))) for _ in range(length)]


def run_script(prop, steps: list[tuple[str, int]], conf: bool = False) -> list:
    """Drive ``prop`` through ``steps`` ([(op, seed)]); the log of every call (module doc).
    The script's random draws depend on the seeds only, so every rank draws the same."""
    cfg = prop.config
    H, V, W = cfg.hidden_size, cfg.vocab_size, cfg.bitmask_words
    seqs: list[list] = []                      # [state, position, next hidden]
    log: list = []

    def snapshot(what):
        log.append((what, [[kv_rows(prop, s[0], m) for m in range(prop.num_modules)] for s in seqs]))

    def new(rng):
        n = int(rng.integers(1, 12))
        st = prop.alloc_state()
        hid = rng.standard_normal((n, H)).astype(np.float32)
        prop.prefill_drafter(rng.integers(0, V, n), hid, st)
        seqs.append([st, n, hid[-1]])

    for op, seed in steps:
        rng = np.random.default_rng(seed)
        if op == "new" or not seqs:
            new(rng)
            snapshot("prefill")
            continue
        if op == "free":
            prop.free_state(seqs.pop(int(rng.integers(0, len(seqs))))[0])
            snapshot("free")
            continue
        if op == "carry":
            s = seqs[int(rng.integers(0, len(seqs)))]
            prop.install_drafter_kv(s[0], prop.take_drafter_kv(s[0]))
            snapshot("carry")
            continue
        if op == "tree":
            s = seqs[int(rng.integers(0, len(seqs)))]
            D = int(rng.integers(1, prop.num_modules + 1))
            mask = None if rng.random() < 0.5 else rng.integers(-2**31, 2**31, W, dtype=np.int64).astype(np.int32)
            try:
                tree = prop.propose_tree(int(rng.integers(0, V)), s[2], s[1], s[0],
                                         widths=[int(w) for w in rng.integers(1, 4, D)], grammar_bitmask=mask)
            except NoAllowedToken as e:
                log.append(("refused", type(e).__name__, e.row, e.draft))
                snapshot("after refused")
                continue
            log.append(("tree", tree.tokens.tolist(), tree.parents.tolist(), tree.probs.astype(np.float64)))
            snapshot("tree drafted")
            path = tree.greedy_path()[:int(rng.integers(0, tree.depth + 1))]
            prop.after_verify_tree(path, s[0])
            toks_ = [int(tree.tokens[i]) for i in path]
            h = rng.standard_normal((len(toks_), H)).astype(np.float32)
            log.append(("caught up", np.asarray(prop.catchup_drafter(toks_, h, s[0])).tolist()))
            s[1] += 1 + len(toks_)
            s[2] = rng.standard_normal(H).astype(np.float32)
            snapshot("tree verified")
            continue
        k = int(rng.integers(1, prop.num_modules + 1))
        toks = rng.integers(0, V, len(seqs)).tolist()
        hs_ = np.stack([s[2] for s in seqs])
        masks = [None if rng.random() < 0.5 else rng.integers(-2**31, 2**31, W, dtype=np.int64).astype(np.int32)
                 for _ in seqs]
        if op == "refused":                    # a mask that allows nothing: refused, nothing changes
            masks[int(rng.integers(0, len(seqs)))] = np.zeros(W, np.int32)
        pos = [s[1] for s in seqs]
        out_conf = [[] for _ in seqs] if conf else None
        try:
            drafts = prop.propose_batch(toks, hs_, pos, k, [s[0] for s in seqs], masks, out_conf=out_conf)
        except NoAllowedToken as e:
            assert op == "refused", e
            log.append(("refused", type(e).__name__, e.row, e.draft))
            snapshot("after refused")
            continue
        log.append(("drafts", drafts, out_conf))
        snapshot("propose")
        for s, d in zip(seqs, drafts):
            a = int(rng.integers(0, len(d) + 1))
            prop.after_verify(a, s[0])
            h = rng.standard_normal((a, H)).astype(np.float32)
            log.append(("caught up", np.asarray(prop.catchup_drafter(d[:a], h, s[0])).tolist()))
            s[1] += 1 + a
            s[2] = rng.standard_normal(H).astype(np.float32)
        snapshot("catchup")
    for s in seqs:
        prop.free_state(s[0])
    prop.check_invariants()
    return log


def kv_slice(rows: np.ndarray, prop, m: int) -> np.ndarray:
    """The KV heads of module ``m`` that rank ``prop.shard`` holds, of single-rank ``rows``
    [rows, Hkv, D] (MLA: the latent row, replicated: all of it)."""
    b = prop.config.block(m)
    if b.mla:
        return rows
    h = prop.shard.heads(b)
    return rows[:, h.kv0:h.kv1]


def compare(single: list, sharded: list, prop, tol: float = 2e-5) -> None:
    """A rank's log against the single-rank one, entry for entry: drafts, refusals and
    catch-up results identical, confidences within float32 rounding, KV within ``tol`` of its
    slice of the single-rank KV (the partial sums meet in another order)."""
    assert len(single) == len(sharded), (len(single), len(sharded))
    for i, (a, b) in enumerate(zip(single, sharded)):
        assert a[0] == b[0], (i, a[0], b[0])
        if a[0] == "drafts":
            assert a[1] == b[1], (i, a[1], b[1])
            if a[2] is not None:
                np.testing.assert_allclose(np.concatenate([np.asarray(c, np.float64) for c in b[2]] or [[]]),
                                           np.concatenate([np.asarray(c, np.float64) for c in a[2]] or [[]]),
                                           rtol=1e-4, err_msg=f"entry {i}: confidences")
        elif a[0] == "tree":
            assert a[1:3] == b[1:3], (i, a[1:3], b[1:3])
            np.testing.assert_allclose(b[3], a[3], rtol=1e-4, err_msg=f"entry {i}: tree probabilities")
        elif a[0] in ("refused", "caught up"):
            assert a[1:] == b[1:], (i, a, b)
        else:
            assert len(a[1]) == len(b[1]), (i, "live states")
            for s, (mods_a, mods_b) in enumerate(zip(a[1], b[1])):
                for m, ((ka, va), (kb, vb)) in enumerate(zip(mods_a, mods_b)):
                    for name, x, y in (("K", ka, kb), ("V", va, vb)):
                        want = kv_slice(x, prop, m)
                        assert y.shape == want.shape, (i, a[0], s, m, name, y.shape, want.shape)
                        np.testing.assert_allclose(y, want, rtol=tol, atol=tol,
                                                   err_msg=f"entry {i} ({a[0]}): state {s} module {m} {name}")
