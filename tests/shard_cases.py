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
from mtpkern.errors import NoAllowedToken, StateError

#: the calls a script draws from: a batched propose round (verify, catch-up), a new
#: sequence, a carried sequence (and its next turn's tokens, caught up), a freed one, a
#: propose that no grammar allows, a draft tree (verified along a path, caught up), steps
#: decoded without drafting (K = 0: a propose of no drafts, the tokens caught up), a fork,
#: and a state sharing a prefix of another's tokens (caught up): every rank forks and shares alike
OPS = ("round", "round", "round", "new", "carry", "free", "refused", "tree", "k0", "fork", "share")


def script(seed: int, length: int = 8) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    return [(OPS[int(rng.integers(0, len(OPS)))], int(rng.integers(0, 2**31 - 1))) for _ in range(length)]


def run_script(prop, steps: list[tuple[str, int]], conf: bool = False, stop: bool = False) -> list:
    """Drive ``prop`` through ``steps`` ([(op, seed)]); the log of every call (module doc).
    The script's random draws depend on the seeds only, so every rank draws the same.
    ``stop``: every chain propose has an early stop (a ``min_confidence`` drawn in 0.2 .. 0.7)."""
    cfg = prop.config
    H, V, W = cfg.stream_size, cfg.vocab_size, cfg.bitmask_words
    seqs: list[list] = []                      # [state, position, next hidden, verified tokens]
    log: list = []

    def snapshot(what):
        log.append((what, [[kv_rows(prop, s[0], m) for m in range(prop.num_modules)] for s in seqs]))

    def new(rng):
        n = int(rng.integers(1, 12))
        st = prop.alloc_state()
        hid = rng.standard_normal((n, H)).astype(np.float32)
        toks = rng.integers(0, V, n)
        prop.prefill_drafter(toks, hid, st)
        seqs.append([st, n, hid[-1], toks.tolist()])

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
        if op == "fork":
            s = seqs[int(rng.integers(0, len(seqs)))]
            seqs.append([prop.fork_state(s[0]), s[1], s[2], list(s[3])])
            snapshot("fork")
            continue
        if op == "share":
            s = seqs[int(rng.integers(0, len(seqs)))]
            L = int(rng.integers(1, len(s[3]) + 1))
            try:
                st = prop.share_prefix(s[0], s[3][:L])
            except StateError:                 # a sliding window released rows this prefix reads
                log.append(("shared", "refused", L))
                continue
            h = st.num_hiddens
            toks_ = s[3][h + 1:L] if prop.kv_mode == "exact" else []
            log.append(("shared", st.rows_per_module(), h))
            prop.catchup_drafter(toks_, rng.standard_normal((len(toks_), H)).astype(np.float32), st)
            seqs.append([st, L, rng.standard_normal(H).astype(np.float32), s[3][:L]])
            snapshot("share")
            continue
        if op in ("carry", "k0"):
            s = seqs[int(rng.integers(0, len(seqs)))]
            if op == "carry":
                prop.install_drafter_kv(s[0], prop.take_drafter_kv(s[0]))
            else:
                log.append(("no drafts", prop.propose(int(rng.integers(0, V)), s[2], s[1], 0, s[0])))
            c = int(rng.integers(1, 6))           # the next turn's tokens, or c steps without drafting
            h = rng.standard_normal((c, H)).astype(np.float32)
            h[0] = s[2]                           # the hidden before the first of them
            caught = rng.integers(0, V, c).tolist()
            log.append(("caught up", prop.catchup_drafter(caught, h, s[0])))
            s[3] += caught
            s[1] += c
            s[2] = rng.standard_normal(H).astype(np.float32)
            snapshot(op)
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
            s[3] += [int(tree.root_token)] + toks_
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
        thr = float(rng.uniform(0.2, 0.7)) if stop else None
        try:
            drafts = prop.propose_batch(toks, hs_, pos, k, [s[0] for s in seqs], masks, out_conf=out_conf,
                                        min_confidence=thr)
        except NoAllowedToken as e:
            assert op == "refused", e
            log.append(("refused", type(e).__name__, e.row, e.draft))
            snapshot("after refused")
            continue
        log.append(("drafts", drafts, out_conf))
        snapshot("propose")
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            a = int(rng.integers(0, len(d) + 1))
            prop.after_verify(a, s[0])
            h = rng.standard_normal((a, H)).astype(np.float32)
            log.append(("caught up", np.asarray(prop.catchup_drafter(d[:a], h, s[0])).tolist()))
            s[3] += [toks[i]] + d[:a]
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
        elif a[0] in ("refused", "caught up", "shared"):
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


# -- refusals: a call that one rank refuses, fails or makes differently fails on every rank ---

class GrammarBoom(RuntimeError):
    """What a grammar callable raises in the refusal cases (mid-draft, on one rank)."""


def _kv(prop, sts) -> list:
    return [(prop.drafter_rows(s), [kv_rows(prop, s, m) for m in range(prop.num_modules)]) for s in sts]


def _same_kv(a: list, b: list) -> bool:
    return len(a) == len(b) and all(ra == rb and all(np.array_equal(x, y) for (ka, va), (kb, vb) in zip(ma, mb)
                                                     for x, y in ((ka, kb), (va, vb)))
                                    for (ra, ma), (rb, mb) in zip(a, b))


def refusal_cases(prop, rank: int, size: int) -> list:
    """Every case: the last rank makes the call otherwise (a bad token, a NaN hidden, a grammar
    callable raising mid-draft, out_conf / min_confidence / num_drafts / tree widths of its own, a
    chain where the others draft a tree, a bad prefill token, other catch-up tokens), the others
    make the good call. Each rank asserts that it raised, that its states' KV and rows are as
    before and its invariants hold, then makes the good call (the same on every rank), which
    succeeds. Returns the log: per case (name, error type, message, drafts of the good call), to
    be compared across the ranks (identical) and against the expected types."""
    cfg = prop.config
    H, V, M = cfg.hidden_size, cfg.vocab_size, prop.num_modules
    bad = rank == size - 1
    rng = np.random.default_rng(5)
    sts = [prop.alloc_state() for _ in range(2)]
    pos = []
    for s in sts:
        n = int(rng.integers(M + 2, 10))
        prop.prefill_drafter(rng.integers(0, V, n), rng.standard_normal((n, H)).astype(np.float32), s)
        pos.append(n)
    toks = [int(t) for t in rng.integers(0, V, 2)]
    hid = rng.standard_normal((2, H)).astype(np.float32)
    nan = hid.copy()
    nan[1, 3] = np.nan

    def grammar(raise_at):
        def fn(m, drafts):
            if bad and m == raise_at:
                raise GrammarBoom(f"grammar failed at draft {m}")
            return None
        return fn

    def batch(**kw):
        args = dict(last_tokens=toks, target_hiddens=hid, positions=pos, num_drafts=M, states=sts)
        args.update(kw)
        return prop.propose_batch(**args)

    def tree(widths):
        return prop.propose_tree(toks[0], hid[0], pos[0], sts[0], widths=widths)

    fresh = []

    def prefill(t):
        s = prop.alloc_state()
        fresh.append(s)
        return prop.prefill_drafter([1, t, 3], np.ones((3, H), np.float32), s)

    good_batch = lambda: batch()                                        # noqa: E731
    cases = [
        ("bad token", lambda: batch(last_tokens=[toks[0], V] if bad else toks), good_batch),
        ("NaN hidden", lambda: batch(target_hiddens=nan if bad else hid), good_batch),
        ("grammar raises", lambda: batch(grammar_bitmasks=[grammar(1), None]), good_batch),
        ("out_conf", lambda: batch(out_conf=[] if bad else None), good_batch),
        ("min_confidence", lambda: batch(min_confidence=0.5 if bad else None), good_batch),
        ("num_drafts", lambda: batch(num_drafts=1 if bad else M), good_batch),
        ("tree widths", lambda: tree([2, 1] if bad else [2, 2]), lambda: tree([2, 2])),
        ("tree grammar raises", lambda: prop.propose_tree(toks[0], hid[0], pos[0], sts[0], widths=[2, 2],
                                                           grammar_bitmask=grammar(1)), lambda: tree([2, 2])),
        ("chain or tree", lambda: (prop.propose(toks[0], hid[0], pos[0], M, sts[0]) if bad else tree([2, 2])),
         lambda: tree([2, 2])),
        ("prefill token", lambda: prefill(V + 5 if bad else 2), lambda: prefill(2)),
    ]
    cases.append(("catch-up tokens", "catchup", None))     # draft mode: refused by the agreement
    log = []
    for name, call, good in cases:
        if call == "catchup":                     # after a verify of one draft: other tokens on one rank
            d = batch()
            for s in sts:
                prop.after_verify(1, s)
            h1 = rng.standard_normal((1, H)).astype(np.float32)
            h2 = rng.standard_normal((2, H)).astype(np.float32)
            before = _kv(prop, sts)
            call = lambda: prop.catchup_batch([d[0][:1] + [7], d[1][:1]] if bad else [d[0][:1], d[1][:1]],  # noqa
                                              [h2 if bad else h1, h1], sts)
            good = lambda: prop.catchup_batch([d[0][:1], d[1][:1]], [h1, h1], sts)    # noqa: E731
            for i in range(2):
                pos[i] += 2
        before = _kv(prop, sts)
        try:
            call()
        except Exception as e:                    # noqa: BLE001 - compared across the ranks
            got = (type(e).__name__, str(e))
        else:
            raise AssertionError(f"{name}: rank {rank} did not raise")
        assert _same_kv(before, _kv(prop, sts)), f"{name}: rank {rank}'s states changed"
        prop.check_invariants()
        out = good()
        if isinstance(out, list):                 # a chain propose: verify nothing
            for i, s in enumerate(sts):
                prop.after_verify(0, s)
                pos[i] += 1
        elif out is not None and hasattr(out, "tokens"):
            prop.after_verify_tree([], sts[0])
            pos[0] += 1
            out = out.tokens.tolist()
        prop.check_invariants()
        log.append((name, *got, out))
    for s in sts + fresh:
        prop.free_state(s)
    prop.check_invariants()
    return log


#: the error type each refusal case raises on every rank
REFUSED_AS = {"bad token": "ValueError", "NaN hidden": "ValueError", "grammar raises": "RuntimeError",
              "tree grammar raises": "RuntimeError", "prefill token": "ValueError"}


def check_refusals(logs: list[list], size: int) -> None:
    """The ranks' refusal logs: identical (type, message and the good call's drafts), each case's
    type the expected one (a divergent call: RankMismatch), its message naming the last rank
    or the differing argument."""
    for r, log in enumerate(logs[1:], 1):
        assert log == logs[0], (r, [(a, b) for a, b in zip(logs[0], log) if a != b])
    for name, typ, msg, _ in logs[0]:
        want = REFUSED_AS.get(name, "RankMismatch")
        assert typ == want, (name, typ, want, msg)
        if want == "RankMismatch":
            field = {"tree widths": "widths / shape", "chain or tree": "call", "catch-up tokens": "tokens"}.get(name, name)
            assert f"different arguments ({field}" in msg or f", {field}" in msg, (name, msg)
        else:
            assert f"rank {size - 1} of {size}" in msg, (name, msg)
