"""Exact mode's last module feeds no module: past its KV write only the rows it drafts from
go on (``ExactChain.run``, ``MtpHead.compute(out_rows=)``; in a planned step
``ForwardBuffers.pick``, covered by tests/test_planned_step.py and
tests/test_cuda_graph_fake.py, whose twins compare it with the eager path).

A twin proposer whose last module still runs every row through attention, o_proj, the FFN
and the final norm (picking the drafting rows afterwards, as before) must agree after every
call: the same drafts, the same K/V rows in every module and the same exact-mode windows
(bit for bit: they are computed as before), and the drafts' confidences to rounding. Not
bit for bit: NumPy's BLAS sums depend on a call's row count, and so do the cpu attention's
(its score tiles hold the query vectors of all the rows of a sequence that attend together:
a tile of 4 sums a dot in 2 sets, a tile of 1 in 4).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kv_rows, rand_hiddens
from mtpkern import MultiModuleMtpHead
from test_family_qwen3_next import QWEN2
from test_family_qwen3_next import _ckpt as qwen_ckpt_at
from test_family_step3p5 import _ckpt as step_ckpt_at
from test_family_step3p5 import release_config as step_release


def _every_row(prop: MultiModuleMtpHead) -> None:
    """The last module computes all its rows, then hands back the ones asked for."""
    head = prop.modules[-1]
    forward = head._forward

    def full(jobs, g, pad_tables=False, out_rows=None):
        y, normed = forward(jobs, g, pad_tables)
        if out_rows is None:
            return y, normed
        if not len(out_rows):
            return None, None
        return y[out_rows], normed[out_rows]

    head._forward = full


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory, tiny_ckpt, mla_ckpt):
    return {"tiny": tiny_ckpt, "mla": mla_ckpt,
            "step3p5": step_ckpt_at(tmp_path_factory.mktemp("step_last"), step_release()),
            "qwen3_next": qwen_ckpt_at(tmp_path_factory.mktemp("qwen_last"), QWEN2)}


def _twins(path, backend):
    kw = dict(backend=backend, kv_mode="exact", block_size=4, num_blocks=128)
    a, b = MultiModuleMtpHead.from_pretrained(path, **kw), MultiModuleMtpHead.from_pretrained(path, **kw)
    _every_row(b)
    return a, b


def _same_state(a, b, sa, sb) -> None:
    for m in range(a.num_modules):
        for x, y in zip(kv_rows(a, sa, m), kv_rows(b, sb, m)):
            np.testing.assert_array_equal(x, y, err_msg=f"module {m}'s K/V rows")
        wa, wb = sa._win[m], sb._win[m]
        if m < a.num_modules - 1 and wa is not None:
            np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb), err_msg=f"module {m}'s window")
    assert sa.rows_per_module() == sb.rows_per_module()


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("family", ["tiny", "mla", "step3p5", "qwen3_next"])
def test_last_module_rows_past_the_kv_write(family_ckpts, backend, family):
    a, b = _twins(family_ckpts[family], backend)
    rng = np.random.default_rng(11)
    H, V, M = a.config.hidden_size, a.config.vocab_size, a.num_modules
    lens = [9, 5, 14]
    sa, sb = [a.alloc_state() for _ in lens], [b.alloc_state() for _ in lens]
    for n, x, y in zip(lens, sa, sb):
        toks, hid = rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H)
        a.prefill_drafter(toks, hid, x)
        b.prefill_drafter(toks, hid, y)
    pos = list(lens)
    for rnd in range(6):
        k = [M, 1, M, 2, M, M][rnd] if M >= 2 else 1
        stop = 0.3 if rnd == 4 else None                  # an early stop: the active rows shrink
        last, hid = rng.integers(0, V, len(lens)).tolist(), rand_hiddens(rng, len(lens), H)
        ca, cb = [], []
        da = a.propose_batch(last, hid, pos, k, sa, out_conf=ca, min_confidence=stop)
        db = b.propose_batch(last, hid, pos, k, sb, out_conf=cb, min_confidence=stop)
        assert da == db, f"round {rnd}: drafts"
        np.testing.assert_allclose(np.asarray(sum(ca, [])), np.asarray(sum(cb, [])), rtol=2e-5, atol=1e-7,
                                   err_msg=f"round {rnd}: confidences")
        for i, (x, y) in enumerate(zip(sa, sb)):
            acc = int(rng.integers(0, len(da[i]) + 1))
            a.after_verify(acc, x)
            b.after_verify(acc, y)
            h = rand_hiddens(rng, acc, H)
            a.catchup_drafter(da[i][:acc], h, x)
            b.catchup_drafter(db[i][:acc], h, y)
            pos[i] += 1 + acc
            _same_state(a, b, x, y)


def test_last_module_attends_with_its_drafting_rows_only(tiny_ckpt):
    """The rows the last module's attention and experts see: one a drafting sequence, none when
    it does not draft (k < M) and none in a catch-up, while every row's K/V is written."""
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="cpu", kv_mode="exact", block_size=4,
                                              num_blocks=96)
    be, M = prop.backend, prop.num_modules
    last_pool = prop.modules[-1].pool
    seen = {"attention": [], "kv": []}
    attend, write = be.paged_attention, be.qk_norm_rope_kv_write

    def attention(q, k_cache, *a, **kw):
        if k_cache is last_pool.k:
            seen["attention"].append(q.shape[0])
        return attend(q, k_cache, *a, **kw)

    def kv_write(qkv, *a, **kw):
        if a[7] is last_pool.k:                  # (Hq, Hkv, q_norm, k_norm, eps, inv_freq, positions, k, ...)
            seen["kv"].append(qkv.shape[0])
        return write(qkv, *a, **kw)

    be.paged_attention, be.qk_norm_rope_kv_write = attention, kv_write
    rng = np.random.default_rng(3)
    H, V = prop.config.hidden_size, prop.config.vocab_size
    sts = [prop.alloc_state() for _ in range(2)]
    for st in sts:
        prop.prefill_drafter(rng.integers(0, V, 10).tolist(), rand_hiddens(rng, 10, H), st)
    assert seen["attention"] == [] and sum(seen["kv"]) == 2 * (10 - M)    # a catch-up: the K/V only
    seen["kv"].clear()
    prop.propose_batch([1, 2], rand_hiddens(rng, 2, H), [10, 10], M, sts)
    assert seen["attention"] == [2] and seen["kv"] == [2 * M]
    for st in sts:
        prop.after_verify(0, st)
    seen["attention"].clear(), seen["kv"].clear()
    prop.propose_batch([3, 4], rand_hiddens(rng, 2, H), [11, 11], 1, sts)
    assert seen["attention"] == [] and seen["kv"] == [2 * 2]               # k = 1 < M: rows of keys P-2, P-1
