"""The numeric contract at the boundary: positions within the model's range, integer
forms of token ids and counts (NumPy scalars and 0-d arrays yes, booleans never)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rand_hiddens
from mtpkern import MultiModuleMtpHead, StateError, write_synthetic_checkpoint
from mtpkern.config import tiny_config

H, V = 64, 301
LIMIT = 40


@pytest.fixture(scope="module")
def short_ckpt(tmp_path_factory):
    """A checkpoint whose model knows positions 0 .. LIMIT - 1 only."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("short"), tiny_config(max_position_embeddings=LIMIT),
                                      seed=2)


def _prop(ckpt, mode):
    return MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=mode, block_size=4, num_blocks=64)


def _state_at(prop, n, rng):
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, V, n).tolist(), rand_hiddens(rng, n, H), st)
    return st


def _fingerprint(prop, st):
    return (tuple(prop.kv_blocks_in_use()), tuple(st.rows_per_module()), st.num_verified, st.num_hiddens,
            tuple(st.tail), st.drafted, st.next_position)


@pytest.mark.parametrize("P", [LIMIT, LIMIT + 5, 2**31 + 7, 2**32 + 7, 2**63 - 1])
def test_draft_mode_positions_past_the_limit_are_refused(short_ckpt, P):
    prop = _prop(short_ckpt, "draft")
    rng = np.random.default_rng(0)
    st = _state_at(prop, 5, rng)
    before = _fingerprint(prop, st)
    with pytest.raises(ValueError, match=rf"position: .* past the model's max_position_embeddings \({LIMIT}"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], P, 1, st)
    assert _fingerprint(prop, st) == before


def test_draft_mode_counts_the_drafts_rows(short_ckpt):
    prop = _prop(short_ckpt, "draft")
    rng = np.random.default_rng(1)
    st = _state_at(prop, 5, rng)
    with pytest.raises(ValueError, match=f"position {LIMIT},"):
        prop.propose(1, rand_hiddens(rng, 1, H)[0], LIMIT - 2, 3, st)     # rows at 38, 39, 40
    assert len(prop.propose(1, rand_hiddens(rng, 1, H)[0], LIMIT - 3, 3, st)) == 3


def test_exact_mode_stops_at_the_limit(short_ckpt):
    """A propose at P writes rows up to position P + min(k, M - 1) (modules past the
    drafting ones follow the drafts); prefill and catch-up up to their last token."""
    prop = _prop(short_ckpt, "exact")
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match=rf"prompt_tokens: .* position {LIMIT},"):
        _state_at(prop, LIMIT + 1, rng)
    assert prop.kv_blocks_in_use() == [0, 0, 0]
    st = _state_at(prop, LIMIT - 2, rng)                                  # P = 38
    for k in (2, 3):                                                      # rows up to 38 + 2 = 40
        before = _fingerprint(prop, st)
        with pytest.raises(ValueError, match=rf"position {LIMIT}, past"):
            prop.propose(1, rand_hiddens(rng, 1, H)[0], LIMIT - 2, k, st)
        assert _fingerprint(prop, st) == before
    d = prop.propose(1, rand_hiddens(rng, 1, H)[0], LIMIT - 2, 1, st)      # rows up to 38 + 1 = 39
    prop.after_verify(1, st)
    before = _fingerprint(prop, st)
    with pytest.raises(ValueError, match=rf"tokens: .* position {LIMIT},"):
        prop.catchup_drafter(d + [5], rand_hiddens(rng, 2, H), st)        # a token at position 40
    assert _fingerprint(prop, st) == before
    prop.catchup_drafter(d, rand_hiddens(rng, 1, H), st)
    prop.check_invariants()


def test_head_forward_one_refuses_positions_past_the_limit(short_ckpt):
    prop = _prop(short_ckpt, "draft")
    head = prop.modules[0]
    seq = head.alloc_seq()
    h = np.zeros(H, np.float32)
    for pos in (LIMIT, 2**32 + 7):
        with pytest.raises(ValueError, match="max_position_embeddings"):
            head.forward_one(1, h, pos, seq)
    assert seq.rows == 0 and head.pool.num_used == 0
    head.forward_one(1, h, LIMIT - 1, seq)
    head.free_seq(seq)


BOOLS = [True, np.bool_(True), np.array(True)]


@pytest.mark.parametrize("b", BOOLS, ids=["bool", "np.bool_", "0-d bool array"])
def test_booleans_are_not_token_ids_or_counts(make_prop, b):
    prop = make_prop("exact")
    rng = np.random.default_rng(3)
    st = prop.alloc_state()
    with pytest.raises(TypeError, match=r"prompt_tokens\[0\]: expected an int token id, got .*bool"):
        prop.prefill_drafter([b, 1, 2], rand_hiddens(rng, 3, H), st)
    assert prop.kv_blocks_in_use() == [0, 0, 0]
    prop.prefill_drafter([4, 1, 2], rand_hiddens(rng, 3, H), st)
    hid = rand_hiddens(rng, 1, H)[0]
    with pytest.raises(TypeError, match="last_token: expected an int token id, got"):
        prop.propose(b, hid, 3, 2, st)
    with pytest.raises(TypeError, match="position: expected an int"):
        prop.propose(1, hid, b, 2, st)
    with pytest.raises(TypeError, match="num_drafts: expected an int"):
        prop.propose(1, hid, 3, b, st)
    d = prop.propose(1, hid, 3, 2, st)
    with pytest.raises(TypeError, match="num_accepted: expected an int"):
        prop.after_verify(b, st)
    prop.after_verify(1, st)
    with pytest.raises(TypeError, match=r"tokens(\[0\])?: expected .*bool"):
        prop.catchup_drafter([b], rand_hiddens(rng, 1, H), st)
    with pytest.raises(TypeError, match=r"tokens\[1\]: expected an int token id, got .*bool"):
        prop.catchup_drafter([d[0], b], rand_hiddens(rng, 2, H), st)
    prop.catchup_drafter(d[:1], rand_hiddens(rng, 1, H), st)
    with pytest.raises(TypeError, match="module: expected an int"):
        prop.stats.acceptance_rate(b)
    with pytest.raises(TypeError, match="budget_tokens: expected an int"):
        prop.alloc_state_for(b)
    prop.check_invariants()


def test_numpy_integer_scalars_and_0d_arrays_are_accepted(make_prop):
    prop = make_prop("exact")
    rng = np.random.default_rng(4)
    toks, hids, hid = [4, 1, 2], rand_hiddens(rng, 3, H), rand_hiddens(rng, 1, H)[0]
    a, b, c = (prop.alloc_state() for _ in range(3))
    prop.prefill_drafter(toks, hids, a)
    prop.prefill_drafter(np.array(toks, np.int64), hids, b)
    prop.prefill_drafter(tuple(np.int16(t) for t in toks), hids, c)
    want = prop.propose(1, hid, 3, 2, a)
    assert prop.propose(np.array(1), hid, np.array(3, np.int32), np.int8(2), b) == want
    assert prop.propose(np.int64(1), hid, 3, np.array(2), c) == want
    prop.after_verify(np.uint8(0), b)
    assert prop.stats.acceptance_rate(np.array(0)) == 0.0
    with pytest.raises(TypeError, match="last_token: expected an int token id, got 0-d array of float64"):
        prop.propose(np.array(1.0), hid, 4, 2, b)
    with pytest.raises(StateError):
        prop.propose(1, hid, 4, 2, a)                                     # still awaiting after_verify
