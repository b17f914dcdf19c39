"""A reduced draft vocabulary (``draft_vocab=``, mtpkern.vocab): the LM heads read only a
token subset; drafts, masks and confidences stay in target ids. A subset of the whole
vocabulary equals no subset; random subsets under random call sequences agree with the
float64 oracle over the same subset (numpy and cpu, both KV modes); the heads' bytes
shrink by ``(V - V') H``; bad subsets are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from conftest import rand_hiddens
from mtpkern import MultiModuleMtpHead, NoAllowedToken
from mtpkern.testing import reference_weights
from mtpkern.testing.machine import proposer_machine
from mtpkern.vocab import DraftVocab

V, H = 301, 64


def _run(prop, rng_seed=0, rounds=5):
    rng = np.random.default_rng(rng_seed)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 9).tolist(), rand_hiddens(rng, 9, H), st)
    out, P = [], 9
    for _ in range(rounds):
        conf: list = []
        d = prop.propose(int(rng.integers(0, V)), rand_hiddens(rng, 1, H)[0], P, 3, st, out_conf=conf)
        a = int(rng.integers(0, len(d) + 1))
        prop.after_verify(a, st)
        prop.catchup_drafter(d[:a], rand_hiddens(rng, a, H), st)
        out.append((d, conf))
        P += 1 + a
    return out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_the_whole_vocabulary_as_a_subset_changes_nothing(tiny_ckpt, backend, mode):
    kw = dict(backend=backend, kv_mode=mode, block_size=4, num_blocks=64)
    plain = MultiModuleMtpHead.from_pretrained(tiny_ckpt, **kw)
    whole = MultiModuleMtpHead.from_pretrained(tiny_ckpt, draft_vocab=np.arange(V)[::-1], **kw)   # any order
    assert whole.draft_vocab.size == V
    assert _run(plain) == _run(whole)


@pytest.mark.parametrize("backend,mode", [("numpy", "exact"), ("cpu", "draft"), ("cpu", "exact")])
def test_random_calls_with_a_subset_agree_with_the_oracle(tiny_ckpt, backend, mode):
    ids = np.random.default_rng(3).permutation(V)[:120]
    weights = reference_weights(tiny_ckpt)
    machine = proposer_machine(lambda: MultiModuleMtpHead.from_pretrained(
        tiny_ckpt, backend=backend, kv_mode=mode, block_size=4, num_blocks=40, prefill_chunk=5, draft_vocab=ids),
        weights)
    machine.steps.clear()
    machine.TestCase.settings = settings(max_examples=10, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
    assert machine.steps["propose"] + machine.steps["propose_batch"] > 15, dict(machine.steps)


def test_drafts_come_from_the_subset_and_the_heads_shrink(tiny_ckpt, tmp_path):
    ids = np.random.default_rng(4).permutation(V)[:50]
    path = tmp_path / "ids.txt"
    path.write_text(" ".join(map(str, ids)))
    plain = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="cpu", block_size=4, num_blocks=64)
    sub = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="cpu", block_size=4, num_blocks=64, draft_vocab=path)
    np.testing.assert_array_equal(sub.draft_vocab.ids, np.sort(ids))
    for d, _ in _run(sub, 1, 6):
        assert set(d) <= set(ids.tolist())
    heads = {id(mw.head) for mw in plain.weights.modules}          # distinct heads (shared by the modules here)
    assert plain.memory().weights - sub.memory().weights == len(heads) * sub.draft_vocab.head_bytes_saved(H)
    np.save(tmp_path / "ids.npy", ids)
    sub2 = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", draft_vocab=tmp_path / "ids.npy")
    np.testing.assert_array_equal(sub2.draft_vocab.ids, sub.draft_vocab.ids)


def test_a_mask_outside_the_subset_allows_no_draft(tiny_ckpt):
    ids = np.arange(0, 100)
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", block_size=4, num_blocks=64,
                                              draft_vocab=ids)
    rng = np.random.default_rng(0)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, 6).tolist(), rand_hiddens(rng, 6, H), st)
    mask = np.zeros((V + 31) // 32, np.int32)
    mask[200 >> 5] = 1 << (200 & 31)                                # token 200 only: not in the subset
    before = st.rows_per_module()
    with pytest.raises(NoAllowedToken):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st, grammar_bitmask=mask)
    assert st.rows_per_module() == before
    mask[150 >> 5] |= 1 << (150 & 31)
    mask[42 >> 5] |= 1 << (42 & 31)                                  # 42 is: every draft is 42
    assert prop.propose(1, rand_hiddens(rng, 1, H)[0], 6, 2, st, grammar_bitmask=mask) == [42, 42]


@pytest.mark.parametrize("ids,exc,match", [
    ([], ValueError, "draft_vocab: expected a non-empty 1-D array of token ids"),
    ([[1, 2]], ValueError, "draft_vocab: expected a non-empty 1-D array"),
    ([3, 5, 3], ValueError, "draft_vocab: token id 3 appears twice"),
    ([0, 301], ValueError, r"draft_vocab: expected token ids in \[0, 301\), got 301"),
    ([-1, 2], ValueError, r"draft_vocab: expected token ids in \[0, 301\), got -1"),
    ([0.5, 1.5], TypeError, r"draft_vocab\[0\]: expected an int token id, got float 0.5"),
])
def test_bad_subsets_are_refused_by_name(ids, exc, match):
    with pytest.raises(exc, match=match):
        DraftVocab(ids, V)


@pytest.mark.parametrize("name", ["numpy", "cpu"])
def test_a_bad_id_map_is_refused_before_anything_is_written(name):
    from mtpkern.backends import get_backend

    be = get_backend(name)
    x, w = np.ones((2, 4), np.float32), be.prepare_weight(np.ones((10, 4), np.float32))
    conf, out = np.full(2, 7.0, np.float32), np.full(2, 7, np.int32)
    with pytest.raises(ValueError, match=r"id_map: expected shape \[10\]"):
        be.lm_head_argmax(x, w, out=out, conf=conf, id_map=np.arange(9, dtype=np.int32))
    with pytest.raises(TypeError, match="id_map: expected dtype int32"):
        be.lm_head_argmax(x, w, out=out, conf=conf, id_map=np.arange(10, dtype=np.int64))
    assert (conf == 7.0).all() and (out == 7).all()
    ids = be.lm_head_argmax(x, w, id_map=np.arange(100, 110, dtype=np.int32))
    assert be.to_host(ids).tolist() == [100, 100]
