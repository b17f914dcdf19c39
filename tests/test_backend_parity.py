"""The whole proposer on a fast backend against the NumPy reference, call for call.

Hypothesis draws a sequence of calls over several sequences (prefill, batched
propose with grammar masks, verify, catch-up, carry, free); both proposers get
the same calls. Drafts must be identical and every module's KV rows within the
tolerance of the backend's KV dtype, after every call.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from conftest import kv_rows
from mtpkern import MultiModuleMtpHead
from mtpkern.tolerance import assert_close

FAST = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
_PROPS: dict = {}


def _pair(ckpt, backend, kv_mode, chain, block_size=4):
    key = (str(ckpt), backend, kv_mode, chain, block_size)
    if key not in _PROPS:
        kw = dict(kv_mode=kv_mode, chain=chain, block_size=block_size, num_blocks=640 // block_size,
                  prefill_chunk=6)
        _PROPS[key] = (MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", **kw),
                       MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, **kw))
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
    ref, fast = _pair(tiny_ckpt, backend, kv_mode, chain)
    run_script(ref, fast, tiny_cfg, script)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops)
def test_cpu_backend_with_blocks_of_16_matches_reference(tiny_ckpt, tiny_cfg, kv_mode, script):
    """Blocks of 16 rows: the cpu backend's own key layout (rows innermost, CpuBackend.empty_keys)
    and its vector score tiles, through every call of the script."""
    ref, fast = _pair(tiny_ckpt, "cpu", kv_mode, "prenorm", block_size=16)
    assert not fast.pools[0].k.flags.c_contiguous            # the transposed key cache is in use
    run_script(ref, fast, tiny_cfg, script)


def run_script(ref, fast, cfg, script) -> None:
    """Drive ``ref`` and ``fast`` through ``script`` ([(op, seed)]), checking drafts and
    KV after every call (tests/test_cuda_emulated.py runs it on the emulated kernels)."""
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
        assert d_fast == d_ref
        for s, d in zip(seqs, d_ref):
            _same_kv(ref, fast, s[0], s[1], "propose")
            a = int(rng.integers(0, len(d) + 1))
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
