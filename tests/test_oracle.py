"""Exact KV mode against the from-scratch oracle (mtpkern.testing.oracle).

After every propose the drafts must equal the oracle's, and after every call
each module's K/V rows must equal the oracle's within the FP32 tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from conftest import kv_rows, rand_hiddens
from mtpkern import MultiModuleMtpHead
from mtpkern.testing import oracle
from mtpkern.tolerance import assert_close

_PROPS: dict = {}


def _prop(ckpt, chain, atn, backend="numpy"):
    key = (str(ckpt), chain, atn, backend)
    if key not in _PROPS:
        _PROPS[key] = MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, kv_mode="exact", chain=chain,
                                                         apply_target_norm=atn, block_size=4, num_blocks=256,
                                                         prefill_chunk=7)
    return _PROPS[key]


def _check_kv(prop, st, cfg, weights, tokens, hiddens, chain, tn):
    rows = oracle.chain_state(cfg, weights, tokens, hiddens, chain, tn)
    for m in range(cfg.num_modules):
        k, v = kv_rows(prop, st, m)
        assert k.shape[0] == rows[m].k.shape[0], f"module {m}: {k.shape[0]} rows, oracle {rows[m].k.shape[0]}"
        assert_close(k, rows[m].k, what=f"module {m} K")
        assert_close(v, rows[m].v, what=f"module {m} V")


def run_scenario(prop, cfg, weights, seed, n, rounds, chain, tn, check_kv=True):
    rng = np.random.default_rng(seed)
    H, V = cfg.stream_size, cfg.vocab_size
    st = prop.alloc_state()
    tokens = rng.integers(0, V, n).tolist()          # verified t_0 ..
    hid = rand_hiddens(rng, n, H)
    prop.prefill_drafter(tokens, hid, st)
    hiddens = list(hid[: n - 1])                      # consumed: h_0 .. h_{n-2}
    pending_h = hid[n - 1]                            # h_{n-1}, comes with the first propose
    if check_kv:
        _check_kv(prop, st, cfg, weights, tokens, hiddens, chain, tn)
    for k, frac in rounds:
        P = len(tokens)
        t_P = int(rng.integers(0, V))
        drafts = prop.propose(t_P, pending_h, P, k, st)
        st.check_invariants()
        hiddens.append(pending_h)
        tokens.append(t_P)
        want = oracle.propose(cfg, weights, tokens, hiddens, k, chain, target_norm=tn)
        assert drafts == want, f"P={P} k={k}: drafts {drafts}, oracle {want}"
        if check_kv:
            _check_kv(prop, st, cfg, weights, tokens + drafts, hiddens, chain, tn)
        a = int(round(frac * len(drafts)))
        prop.after_verify(a, st)
        tokens += drafts[:a]
        acc_h = rand_hiddens(rng, a, H)
        prop.catchup_drafter(drafts[:a], acc_h, st)
        hiddens += list(acc_h)
        pending_h = rand_hiddens(rng, 1, H)[0]
        st.check_invariants()
        if check_kv:
            _check_kv(prop, st, cfg, weights, tokens, hiddens, chain, tn)
    prop.free_state(st)
    prop.check_invariants()


scenario = dict(
    seed=hs.integers(0, 2**31 - 1),
    n=hs.integers(1, 23),
    rounds=hs.lists(hs.tuples(hs.integers(1, 5), hs.floats(0, 1)), min_size=1, max_size=5),
)


@pytest.mark.parametrize("chain", ["prenorm", "postnorm"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**scenario, atn=hs.booleans())
def test_exact_mode_matches_oracle(tiny_ckpt, tiny_cfg, ref_weights, chain, seed, n, rounds, atn):
    prop = _prop(tiny_ckpt, chain, atn)
    tn = ref_weights.target_norm if atn else None
    run_scenario(prop, tiny_cfg, ref_weights, seed, n, rounds, chain, tn)


def test_edge_scenarios(tiny_ckpt, tiny_cfg, ref_weights):
    """a = 0 and a = k, k < M, prompts shorter than M, multi-block prompts."""
    prop = _prop(tiny_ckpt, "prenorm", False)
    for n, rounds in [(1, [(3, 0.0), (3, 1.0), (1, 1.0), (2, 0.0)]),
                      (2, [(1, 1.0), (1, 0.0), (2, 1.0), (3, 1.0)]),
                      (21, [(3, 1.0), (3, 1.0), (3, 0.0), (2, 0.5), (5, 1.0)])]:
        run_scenario(prop, tiny_cfg, ref_weights, 11, n, rounds, "prenorm", None)


def test_dense_mlp_checkpoint(tiny_ckpt_dense):
    from mtpkern.backends import get_backend
    from mtpkern.config import MtpConfig
    from mtpkern.weights import load_weights

    cfg = MtpConfig.from_json(tiny_ckpt_dense / "config.json")
    w = load_weights(tiny_ckpt_dense, cfg, get_backend("numpy"))
    prop = _prop(tiny_ckpt_dense, "postnorm", False)
    run_scenario(prop, cfg, w, 5, 9, [(2, 1.0), (2, 0.0), (2, 0.5)], "postnorm", None)


def test_long_prompt_is_chunked(tiny_ckpt, tiny_cfg, ref_weights):
    """prefill_chunk=7 with a 40-token prompt runs 6 chunks; the KV must not notice."""
    prop = _prop(tiny_ckpt, "prenorm", False)
    run_scenario(prop, tiny_cfg, ref_weights, 3, 40, [(3, 1.0)], "prenorm", None)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=hs.integers(0, 2**31 - 1), B=hs.integers(2, 4), k=hs.integers(1, 4),
       mode=hs.sampled_from(["exact", "draft"]))
def test_batch_equals_per_sequence(make_prop, tiny_cfg, seed, B, k, mode):
    """propose_batch / catchup_batch give what per-sequence calls give."""
    prop = make_prop(mode, num_blocks=256)
    rng = np.random.default_rng(seed)
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    lens = rng.integers(1, 14, B)
    prompts = [rng.integers(0, V, n).tolist() for n in lens]
    hids = [rand_hiddens(rng, n, H) for n in lens]
    batch = [prop.alloc_state() for _ in range(B)]
    single = [prop.alloc_state() for _ in range(B)]
    for i in range(B):
        prop.prefill_drafter(prompts[i], hids[i], batch[i])
        prop.prefill_drafter(prompts[i], hids[i], single[i])
    pos = [int(n) for n in lens]
    last_h = [h[-1] for h in hids]
    for _ in range(3):
        toks = rng.integers(0, V, B).tolist()
        got = prop.propose_batch(toks, np.stack(last_h), pos, k, batch)
        want = [prop.propose(toks[i], last_h[i], pos[i], k, single[i]) for i in range(B)]
        assert got == want
        accs = [int(rng.integers(0, len(d) + 1)) for d in want]
        acc_tok, acc_h = [], []
        for i in range(B):
            prop.after_verify(accs[i], batch[i])
            prop.after_verify(accs[i], single[i])
            acc_tok.append(want[i][:accs[i]])
            acc_h.append(rand_hiddens(rng, accs[i], H))
        rb = prop.catchup_batch(acc_tok, acc_h, batch)
        rs = sum(prop.catchup_drafter(acc_tok[i], acc_h[i], single[i]) for i in range(B))
        assert rb == rs
        for i in range(B):
            assert batch[i].rows_per_module() == single[i].rows_per_module()
            for m in range(prop.num_modules):
                kb, vb = kv_rows(prop, batch[i], m)
                ks, vs = kv_rows(prop, single[i], m)
                assert_close(kb, ks, what="K batch vs single")
                assert_close(vb, vs, what="V batch vs single")
            pos[i] += 1 + accs[i]
            last_h[i] = rand_hiddens(rng, 1, H)[0]
    for s in batch + single:
        prop.free_state(s)
    prop.check_invariants()
    assert prop.kv_blocks_in_use() == [0] * prop.num_modules
