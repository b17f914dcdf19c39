"""The whole proposer on a fast backend against the NumPy reference, call for call.

Hypothesis draws a sequence of calls over several sequences (prefill, batched
propose with grammar masks, verify, catch-up, carry, free); both proposers get
the same calls. Drafts must be identical and every module's KV rows within the
tolerance of the backend's KV dtype, after every call.

On cuda (FP32 KV, as the reference's) the device sums in another order and fuses
multiply-adds, so a draft whose reference logits are tied to FP32 rounding (the best
two allowed within the float32 tolerance) may differ; the sequence then verifies
only the agreed prefix. The cpu backend's drafts must match exactly. (Seen on an
H200 before this rule: BF16 KV against the FP32 reference flipped a draft whose two
best logits were 0.0065 apart at 10.9.)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from conftest import kv_rows, near_tie, record_margins
from mtpkern import MultiModuleMtpHead
from mtpkern.tolerance import assert_close

FAST = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
_PROPS: dict = {}


def _pair(ckpt, backend, kv_mode, chain, block_size=4):
    key = (str(ckpt), backend, kv_mode, chain, block_size)
    if key not in _PROPS:
        kw = dict(kv_mode=kv_mode, chain=chain, block_size=block_size, num_blocks=640 // block_size,
                  prefill_chunk=6)
        if backend == "cuda":              # the reference's KV dtype: only the order of sums differs
            from mtpkern.backends.cuda import CudaBackend

            backend = CudaBackend(kv_dtype="float32")
        ref = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", **kw)
        _PROPS[key] = (ref, MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, **kw), record_margins(ref))
    return _PROPS[key]


def _same_kv(ref, fast, s_ref, s_fast, what):
    assert s_ref.rows_per_module() == s_fast.rows_per_module(), what
    tol = "float32" if np.dtype(fast.backend.kv_dtype) == np.float32 else "bfloat16"
    for m in range(ref.num_modules):
        for a, b, name in zip(kv_rows(ref, s_ref, m), kv_rows(fast, s_fast, m), "KV"):
            assert_close(b, a, tol, what=f"{what}: module {m} {name}")


ops = hs.lists(hs.tuples(hs.sampled_from(["round", "round", "round", "new", "carry", "free"]),
                         hs.integers(0, 2**31 - 1)), min_size=3, max_size=10)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("kv_mode,chain", [("exact", "prenorm"), ("exact", "postnorm"), ("draft", "prenorm")])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_fast_backend_matches_reference(tiny_ckpt, tiny_cfg, backend, kv_mode, chain, script):
    ref, fast, margins = _pair(tiny_ckpt, backend, kv_mode, chain)
    run_script(ref, fast, tiny_cfg, script, margins=margins if backend == "cuda" else None)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_cpu_backend_with_blocks_of_16_matches_reference(tiny_ckpt, tiny_cfg, kv_mode, script):
    """Blocks of 16 rows: the cpu backend's own key layout (rows innermost, CpuBackend.empty_keys)
    and its vector score tiles, through every call of the script."""
    ref, fast, _ = _pair(tiny_ckpt, "cpu", kv_mode, "prenorm", block_size=16)
    assert not fast.pools[0].k.flags.c_contiguous            # the transposed key cache is in use
    run_script(ref, fast, tiny_cfg, script)


def run_script(ref, fast, cfg, script, margins: dict | None = None) -> None:
    """Drive ``ref`` and ``fast`` through ``script`` ([(op, seed)]), checking drafts and
    KV after every call (tests/test_cuda_emulated.py runs it on the emulated kernels).
    ``margins``: None, drafts must be identical; else ``conftest.record_margins(ref)``, and a
    draft may differ where the reference's best two logits are FP32-tied (``near_tie``): that
    sequence then accepts no more than the drafts before it."""
    H, V, W = cfg.hidden_size, cfg.vocab_size, cfg.bitmask_words
    seqs = []                                  # [state_ref, state_fast, position, next hidden]

    def new(rng):
        n = int(rng.integers(1, 14))
        toks = rng.integers(0, V, n)
        hid = rng.standard_normal((n, H)).astype(np.float32)
        pair = [ref.alloc_state(), fast.alloc_state(), n, hid[-1]]
        ref.prefill_drafter(toks, hid, pair[0])
        fast.prefill_drafter(toks, hid, pair[1])
        _same_kv(ref, fast, pair[0], pair[1], "prefill")
        seqs.append(pair)

    for op, seed in script:
        rng = np.random.default_rng(seed)
        if op == "new" or not seqs:
            new(rng)
            continue
        if op == "free":
            s = seqs.pop(int(rng.integers(0, len(seqs))))
            ref.free_state(s[0])
            fast.free_state(s[1])
            continue
        if op == "carry":
            s = seqs[int(rng.integers(0, len(seqs)))]
            kr, kf = ref.take_drafter_kv(s[0]), fast.take_drafter_kv(s[1])
            ref.install_drafter_kv(s[0], kr)
            fast.install_drafter_kv(s[1], kf)
            continue
        k = int(rng.integers(1, 5))
        toks = rng.integers(0, V, len(seqs)).tolist()
        hs_ = np.stack([s[3] for s in seqs])
        masks = [None if rng.random() < 0.5 else rng.integers(-2**31, 2**31, W, dtype=np.int64).astype(np.int32)
                 for _ in seqs]
        pos = [s[2] for s in seqs]
        d_ref = ref.propose_batch(toks, hs_, pos, k, [s[0] for s in seqs], masks)
        d_fast = fast.propose_batch(toks, hs_, pos, k, [s[1] for s in seqs], masks)
        agreed = [len(d) for d in d_ref]
        if margins is None:
            assert d_fast == d_ref
        else:
            assert [len(d) for d in d_fast] == agreed
            for i, (df, dr) in enumerate(zip(d_fast, d_ref)):
                j = next((j for j, (a, b) in enumerate(zip(df, dr)) if a != b), len(dr))
                assert j == len(dr) or near_tie(margins, j, i, "float32"), (
                    f"sequence {i}, draft {j}: {df} against the reference's {dr}, whose best two logits are "
                    f"{margins[j][0][i]:.4g} apart at {margins[j][1][i]:.4g}: not a tie")
                agreed[i] = j
        for s, d, j in zip(seqs, d_ref, agreed):
            if j == len(d):            # past a flipped draft the rows were written from other tokens
                _same_kv(ref, fast, s[0], s[1], "propose")
            a = min(int(rng.integers(0, len(d) + 1)), j)
            ref.after_verify(a, s[0])
            fast.after_verify(a, s[1])
            h = rng.standard_normal((a, H)).astype(np.float32)
            assert ref.catchup_drafter(d[:a], h, s[0]) == fast.catchup_drafter(d[:a], h, s[1])
            _same_kv(ref, fast, s[0], s[1], "catchup")
            s[2] += 1 + a
            s[3] = rng.standard_normal(H).astype(np.float32)
    for s in seqs:
        ref.free_state(s[0])
        fast.free_state(s[1])
    ref.check_invariants()
    fast.check_invariants()
    assert fast.kv_blocks_in_use() == [0] * fast.num_modules


def test_margins_are_those_of_the_allowed_tokens(tiny_ckpt, tiny_cfg):
    """record_margins (the tie rule above): the gap between the best two tokens the mask
    allows, inf where it allows one; and run_script with margins drives a pair end to end."""
    ref, fast, margins = _pair(tiny_ckpt, "cpu", "draft", "prenorm")
    H, V, W = tiny_cfg.hidden_size, tiny_cfg.vocab_size, tiny_cfg.bitmask_words
    rng = np.random.default_rng(3)
    st = ref.alloc_state()
    ref.prefill_drafter(rng.integers(0, V, 5).tolist(), rng.standard_normal((5, H)).astype(np.float32), st)
    hid = rng.standard_normal((1, H)).astype(np.float32)
    logits = []
    orig = ref.modules[0].logits
    ref.modules[0].logits = lambda x: logits.append(np.asarray(orig(x), np.float64)) or logits[-1]
    try:
        for pos, allowed in ((5, [7, 200]), (6, [42])):
            mask = np.zeros(W, np.uint32)
            for t in allowed:
                mask[t >> 5] |= np.uint32(1 << (t & 31))
            d = ref.propose_batch([1], hid, [pos], 1, [st], [mask.view(np.int32)])
            assert d[0][0] in allowed
            want = abs(logits[-1][0, allowed[0]] - logits[-1][0, allowed[1]]) if len(allowed) == 2 else np.inf
            assert margins[0][0][0] == pytest.approx(want)
            ref.after_verify(0, st)
            ref.catchup_drafter([], np.zeros((0, H), np.float32), st)
    finally:
        ref.modules[0].logits = orig
        ref.free_state(st)
    run_script(ref, fast, tiny_cfg, [("new", 1), ("round", 2), ("round", 3), ("free", 4)], margins=margins)
