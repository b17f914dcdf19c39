"""Argument hardening (issue 33, section 3): one integer rule for every count and id argument
of the public API (mtpkern.argtypes; docs/api.md, "Integers"), draft-vocabulary files that
cannot be read as ids, ``check_invariants()`` while a tree is drafted, and ``out_conf`` lists
that raise when written."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mtpkern import MultiModuleMtpHead
from mtpkern.errors import StateError

from conftest import rand_hiddens

HUGE = np.uint64(2**64 - 1)
HUGE_TEXT = "18446744073709551615"


def _prop(tiny_ckpt, kv_mode="exact", **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 96)
    return MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=kv_mode, **kw)


@pytest.fixture(scope="module")
def prop(tiny_ckpt):
    p = _prop(tiny_ckpt)
    yield p
    p.close()


def _ready(prop, n=5, seed=0):
    """A state prefilled with ``n`` tokens, and a hidden for its next propose."""
    rng = np.random.default_rng(seed)
    H = prop.config.hidden_size
    st = prop.alloc_state()
    prop.prefill_drafter(list(range(1, n + 1)), rand_hiddens(rng, n, H), st)
    return st, rand_hiddens(rng, 1, H)[0]


# -- the rule itself --------------------------------------------------------------------------

def test_scalar_rule():
    from mtpkern.argtypes import scalar_int

    assert [scalar_int(v) for v in (3, np.int8(3), np.uint64(3), np.array(3), np.array(3, np.uint16))] == [3] * 5
    assert scalar_int(HUGE) == 2**64 - 1                       # its true value, never -1
    for bad in (True, np.bool_(False), 3.0, np.float32(3), "3", b"3", None, [3], np.array([3]), np.array(3.0)):
        assert scalar_int(bad) is None, bad


def test_sequence_rule_keeps_true_values():
    from mtpkern.argtypes import int_sequence

    assert int_sequence("x", np.array([1, 2], np.uint8)).tolist() == [1, 2]
    assert int_sequence("x", [np.int64(1), np.uint64(2), 3]).tolist() == [1, 2, 3]
    assert int_sequence("x", range(3)).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=rf"x\[1\]: expected int in \[0, 9\], got {HUGE_TEXT}"):
        int_sequence("x", np.array([1, HUGE], np.uint64), 0, 9)
    with pytest.raises(ValueError, match=rf"x\[1\]: expected int in \[0, 9\], got {HUGE_TEXT}"):
        int_sequence("x", [np.uint64(1), HUGE, -1], 0, 9)          # NumPy would make this float64
    with pytest.raises(ValueError, match=rf"x\[0\]: expected int in \[0, {2**63 - 1}\], got {2**70}"):
        int_sequence("x", [2**70], 0)                              # past int64 as well
    with pytest.raises(TypeError, match=r"x\[1\]: expected an int int, got bool True"):
        int_sequence("x", [1, True])
    for bad, kind in ((np.array([True]), "bool"), (np.array([1.0]), "float64"), (np.array(["1"]), "<U1")):
        with pytest.raises(TypeError, match=f"x: expected integer ints, got dtype {kind}"):
            int_sequence("x", bad)
    with pytest.raises(TypeError, match="x: expected a 1-D sequence of ints .*got str"):
        int_sequence("x", "12")


# -- every count and id argument of the public calls --------------------------------------------
#
# Each case: (the argument as errors name it, a valid value, how to make the call with value v).
# The sweep gives each argument bool / float / str / np.int64 / np.uint64(2**64 - 1) forms (in a
# one-entry sequence for a sequence argument): NumPy integers are accepted, the huge one is refused
# as out of range with its true value, the others as the wrong kind (TypeError), each error naming
# the argument.

def _propose_arg(which):
    def call(prop, v):
        st, h = _ready(prop)
        args = {"last_token": 3, "position": st.next_position, "num_drafts": 2}
        args[which] = v
        try:
            prop.propose(args["last_token"], h, args["position"], args["num_drafts"], st)
        finally:
            prop.free_state(st)
    return call


def _batch_arg(which):
    def call(prop, seq):
        st, h = _ready(prop)
        args = {"last_tokens": [3], "positions": [st.next_position]}
        args[which] = seq
        try:
            prop.propose_batch(args["last_tokens"], h[None], args["positions"], 2, [st])
        finally:
            prop.free_state(st)
    return call


def _after_verify(prop, v):
    st, h = _ready(prop)
    prop.propose(3, h, st.next_position, 2, st)
    try:
        prop.after_verify(v, st)
    finally:
        prop.free_state(st)


def _tree(kw):
    def call(prop, seq):
        st, h = _ready(prop)
        try:
            prop.propose_tree(3, h, st.next_position, st, **kw(seq))
        finally:
            prop.free_state(st)
    return call


def _after_verify_tree(prop, seq):
    st, h = _ready(prop)
    prop.propose_tree(3, h, st.next_position, st, widths=[1, 1])
    try:
        prop.after_verify_tree(seq, st)
    finally:
        prop.free_state(st)


def _prefill(prop, seq):
    st = prop.alloc_state()
    try:
        prop.prefill_drafter(seq, rand_hiddens(np.random.default_rng(0), 3, prop.config.hidden_size), st)
    finally:
        prop.free_state(st)


def _catchup(prop, seq):
    st, h = _ready(prop)
    prop.propose(3, h, st.next_position, 2, st)
    prop.after_verify(0, st)
    try:
        prop.catchup_drafter(seq, h[None], st)
    finally:
        prop.free_state(st)


def _alloc_for(prop, v):
    prop.free_state(prop.alloc_state_for(v))


def _forward_one(which):
    def call(prop, v):
        head = prop.modules[0]
        seq = head.alloc_seq()
        args = {"token": 3, "position": 1, "key": 0}
        args[which] = v
        try:
            head.forward_one(args["token"], np.zeros(prop.config.hidden_size, np.float32), args["position"], seq,
                             key=args["key"])
        finally:
            head.free_seq(seq)
    return call


def _construct(which, **extra):
    def call(prop, v):
        # a small checkpoint of its own is not needed: the tiny one is the fixture's
        MultiModuleMtpHead.from_pretrained(prop._ckpt, backend="numpy", **{**extra, which: v}).close()
    return call


SCALARS = [
    ("last_token", 3, _propose_arg("last_token")),
    ("position", 5, _propose_arg("position")),                 # the state's next position
    ("num_drafts", 2, _propose_arg("num_drafts")),
    ("num_accepted", 1, _after_verify),
    ("budget_tokens", 8, _alloc_for),
    ("token", 3, _forward_one("token")),
    ("position", 1, _forward_one("position")),
    ("key", 0, _forward_one("key")),
    ("max_drafts", 2, _construct("max_drafts", module_schedule="last")),
    ("block_size", 4, _construct("block_size", num_blocks=64)),
    ("num_blocks", 64, _construct("num_blocks", block_size=4)),
    ("max_batch", 2, _construct("max_batch", block_size=4, num_blocks=64)),
    ("prefill_chunk", 8, _construct("prefill_chunk", block_size=4, num_blocks=64)),
]

#: (the argument as errors name it, a valid entry, the sequence around entry v, the call with a sequence)
SEQUENCES = [
    ("last_tokens[0]", 3, lambda v: [v], _batch_arg("last_tokens")),
    ("positions[0]", 5, lambda v: [v], _batch_arg("positions")),
    ("widths[0]", 2, lambda v: [v], _tree(lambda seq: {"widths": seq})),
    ("shape[0][0]", 0, lambda v: [v], _tree(lambda seq: {"shape": [seq]})),
    ("path[0]", 0, lambda v: [v], _after_verify_tree),
    ("prompt_tokens[2]", 3, lambda v: [1, 2, v], _prefill),
    ("tokens[0]", 3, lambda v: [v], _catchup),
    ("module_schedule[0]", 0, lambda v: [v], _construct("module_schedule")),
    ("draft_vocab", 3, lambda v: [v, 7], _construct("draft_vocab", block_size=4, num_blocks=64)),
]


def _value(good, kind):
    return {"bool": True, "float": float(good), "str": str(good), "np.int64": np.int64(good),
            "np.uint8": np.uint8(good), "huge": HUGE}[kind]


KINDS = ["bool", "float", "str", "np.int64", "np.uint8", "huge"]


@pytest.fixture(scope="module")
def sweep_prop(tiny_ckpt):
    p = _prop(tiny_ckpt, block_size=4, num_blocks=64)
    p._ckpt = tiny_ckpt
    yield p
    p.close()


def _expect(prop, name, call, v, kind, seq):
    """Run ``call(prop, v)`` and check the rule's outcome for ``kind``."""
    if kind in ("np.int64", "np.uint8"):
        call(prop, v)                                            # accepted
    else:
        exc = ValueError if kind == "huge" else TypeError
        with pytest.raises(exc) as e:
            call(prop, v)
        msg = str(e.value)
        head = name.split("[")[0]
        assert head in msg.split(": ")[0], f"{name}: the error does not name the argument: {msg}"
        if kind == "huge":
            assert HUGE_TEXT in msg, msg                        # its true value, never -1
        else:
            assert ("bool" if kind == "bool" else kind) in msg, msg
    prop.check_invariants()
    assert all(not st.drafted for st in prop._states.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,good,call", SCALARS, ids=[f"{c[0]}-{i}" for i, c in enumerate(SCALARS)])
def test_every_count_and_id_argument_follows_the_integer_rule(sweep_prop, name, good, call, kind):
    _expect(sweep_prop, name, call, _value(good, kind), kind, seq=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,good,entries,call", SEQUENCES, ids=[c[0] for c in SEQUENCES])
def test_every_sequence_of_counts_and_ids_follows_the_integer_rule(sweep_prop, name, good, entries, call, kind):
    _expect(sweep_prop, name, lambda p, v: call(p, entries(v)), _value(good, kind), kind, seq=True)


@pytest.mark.parametrize("name,good,entries,call", SEQUENCES, ids=[c[0] for c in SEQUENCES])
def test_integer_arrays_of_any_dtype_are_accepted_and_uint64_max_refused(sweep_prop, name, good, entries, call):
    for dt in (np.int8, np.uint16, np.int32, np.uint64):
        call(sweep_prop, np.array(entries(good), dt))
    with pytest.raises(ValueError, match=HUGE_TEXT):
        call(sweep_prop, np.array(entries(HUGE), np.uint64))
    sweep_prop.check_invariants()


def test_module_schedule_forms(tiny_ckpt):
    """``module_schedule`` as a NumPy array (it raised "truth value of an array is ambiguous"),
    a list of NumPy integers, ``max_drafts`` as a NumPy integer (both refused before)."""
    for spec, k in ((np.array([0, 1]), None), ([np.int64(0), np.int32(1)], None), ("last", np.int64(2))):
        p = _prop(tiny_ckpt, module_schedule=spec, max_drafts=k)
        assert p.module_schedule == [0, 1] and all(type(m) is int for m in p.module_schedule)
        p.close()


def test_draft_vocab_refuses_bools(tiny_ckpt):
    """``[True, 5]`` was taken as ``{1, 5}``."""
    with pytest.raises(TypeError, match=r"draft_vocab\[0\]: expected an int token id, got bool True"):
        _prop(tiny_ckpt, draft_vocab=[True, 5])
    with pytest.raises(TypeError, match="draft_vocab: expected integer token ids, got dtype bool"):
        _prop(tiny_ckpt, draft_vocab=np.array([True, False]))


# -- files of ids -------------------------------------------------------------------------------

def _write(tmp_path, name, data):
    p = tmp_path / name
    if isinstance(data, np.ndarray):
        np.save(p, data)
    elif isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    return p


@pytest.mark.parametrize("name,data,match", [
    ("big.txt", "1 2 99999999999999999999999", r"got 99999999999999999999999"),      # OverflowError before
    ("neg.txt", "1 -2", r"expected token ids in \[0, 301\), got -2"),
    ("float.txt", "1 2.5", r"expected whitespace-separated decimal token ids, got '2.5' \(entry 1\)"),
    ("bool.txt", "1 True", r"got 'True'"),
    ("underscore.txt", "1_0", r"got '1_0'"),                                          # int() would read 10
    ("latin.txt", "1 2 \xe9".encode("latin-1"), r"expected an ASCII text file"),
    ("corrupt.npy", b"\x93NUMPY garbage", r"expected a \.npy file of integer token ids, could not read it"),
    ("empty.npy", b"", r"could not read it"),
    ("max.npy", np.array([1, 2**64 - 1], np.uint64), rf"got {HUGE_TEXT} \(entry 1\)"),   # reported as -1 before
    ("float.npy", np.array([1.0, 2.0]), r"expected integer token ids, got dtype float64"),
    ("bool.npy", np.array([True, False]), r"expected integer token ids, got dtype bool"),
    ("object.npy", np.array([1, "x"], dtype=object), r"could not read it"),                # pickles are not read
])
def test_a_draft_vocab_file_that_is_not_ids_is_refused_naming_argument_and_file(tiny_ckpt, tmp_path, name, data,
                                                                                 match):
    path = _write(tmp_path, name, data)
    with pytest.raises((ValueError, TypeError)) as e:
        _prop(tiny_ckpt, draft_vocab=path)
    msg = str(e.value)
    assert msg.startswith("draft_vocab") and str(path) in msg, msg
    assert e.match(match)
    assert not isinstance(e.value, OverflowError)


def test_a_draft_vocab_file_of_ids_is_read(tiny_ckpt, tmp_path):
    p = _prop(tiny_ckpt, draft_vocab=_write(tmp_path, "ok.txt", "5 +3\n 7\t"))
    assert p.draft_vocab.ids.tolist() == [3, 5, 7]
    p = _prop(tiny_ckpt, draft_vocab=_write(tmp_path, "ok.npy", np.array([9, 4], np.uint16)))
    assert p.draft_vocab.ids.tolist() == [4, 9]


# -- check_invariants() while a tree is drafted ------------------------------------------------

@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_check_invariants_from_a_trees_grammar_callable(tiny_ckpt, kv_mode):
    """A tree's scratch sequences exist before its state records them; the check ran from the
    grammar callable raised "N sequences held in the pool, expected one for each of N-1 states"."""
    prop = _prop(tiny_ckpt, kv_mode)
    st, h = _ready(prop)
    other, _ = _ready(prop, seed=1)
    checked = []

    def grammar(depth, path):
        if depth >= 1:
            # the scratch lines exist now: more sequences in a pool than states hold
            assert any(p.num_seqs > len(prop._states) for p in prop.pools)
            prop.check_invariants()
            checked.append(depth)
        return None

    tree = prop.propose_tree(3, h, st.next_position, st, widths=[2, 2, 1], grammar_bitmask=grammar)
    assert checked and len(tree) == 2 + 4 + 4
    prop.check_invariants()
    prop.after_verify_tree(tree.path(tree.children(tree.children(-1)[1])[0]), st)
    prop.check_invariants()
    assert all(p.num_seqs == 2 for p in prop.pools) and other.rows_per_module()


def test_check_invariants_from_another_thread_while_a_tree_is_drafted(tiny_ckpt):
    prop = _prop(tiny_ckpt, "exact")
    st, h = _ready(prop)
    inside, go, errors = threading.Event(), threading.Event(), []

    def grammar(depth, path):
        if depth == 2 and not inside.is_set():
            inside.set()
            assert go.wait(30), "the checking thread never answered"
        return None

    def draft():
        try:
            prop.propose_tree(3, h, st.next_position, st, widths=[2, 2, 1], grammar_bitmask=grammar)
        except BaseException as e:            # noqa: BLE001 - reported below
            errors.append(e)
            inside.set()

    t = threading.Thread(target=draft)
    t.start()
    try:
        assert inside.wait(30)
        assert any(p.num_seqs > 1 for p in prop.pools)           # the tree's scratch lines exist
        prop.check_invariants()                                  # raised AssertionError before
        with pytest.raises(StateError, match="in use"):
            st.check_invariants()                                # the state itself: in use, as documented
    finally:
        go.set()
        t.join(30)
    assert not errors, errors
    assert st.drafted
    prop.check_invariants()


def test_check_invariants_still_finds_a_stray_scratch_sequence(tiny_ckpt):
    """The check does not excuse every scratch sequence: an idle state's must be its pending tree's,
    and only live states hold any."""
    prop = _prop(tiny_ckpt, "draft")
    st, h = _ready(prop)
    pool = prop.pools[1]
    stray = pool.new_seq(st, scratch=True)
    with pytest.raises(AssertionError, match="module 1: a scratch sequence is held by an idle state"):
        prop.check_invariants()
    pool.retire(stray, st)
    prop.check_invariants()
    stray = pool.new_seq(object(), scratch=True)
    with pytest.raises(AssertionError, match="module 1: a tree's scratch sequence is held by object"):
        prop.check_invariants()


# -- out_conf lists that raise when written ----------------------------------------------------

class RaisingList(list):
    """A list whose writes raise (after writing part of the values, as a careless subclass might)."""

    def __setitem__(self, i, v):
        super().__setitem__(i, list(v)[:1] if isinstance(i, slice) else v)
        raise RuntimeError("out_conf refused the write")


class RaiseOnKth(list):
    """A list whose ``k``-th write raises."""

    def __init__(self, k):
        super().__init__([7.0])
        self.k, self.writes = k, 0

    def __setitem__(self, i, v):
        self.writes += 1
        if self.writes == self.k:
            raise RuntimeError(f"write {self.k} refused")
        super().__setitem__(i, v)


def _twins(tiny_ckpt, kv_mode, n=2):
    prop = _prop(tiny_ckpt, kv_mode)
    a = [_ready(prop, seed=s) for s in range(n)]
    b = [_ready(prop, seed=s) for s in range(n)]
    return prop, a, b


def _same(prop, sa, sb):
    assert sa.rows_per_module() == sb.rows_per_module()
    assert (sa.drafted, sa.num_verified, sa.next_position) == (sb.drafted, sb.num_verified, sb.next_position)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_a_propose_whose_out_conf_raises_changes_nothing(tiny_ckpt, kv_mode):
    prop, [(sa, h)], [(sb, _)] = _twins(tiny_ckpt, kv_mode, 1)
    used = prop.kv_blocks_in_use()
    out = RaisingList([7.0])
    with pytest.raises(RuntimeError, match="out_conf refused"):
        prop.propose(3, h, sa.next_position, 3, sa, out_conf=out)
    assert list(out) == [7.0]                                   # put back as it was
    assert not sa.drafted and prop.kv_blocks_in_use() == used   # drafted, rows written before
    _same(prop, sa, sb)
    prop.check_invariants()
    ca, cb = [], []
    assert prop.propose(3, h, sa.next_position, 3, sa, out_conf=ca) == prop.propose(3, h, sb.next_position, 3, sb,
                                                                                     out_conf=cb)
    assert ca == cb and len(ca) == 3
    _same(prop, sa, sb)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_a_propose_batch_whose_out_conf_raises_changes_nothing(tiny_ckpt, kv_mode):
    prop, a, b = _twins(tiny_ckpt, kv_mode, 2)
    sts_a, sts_b = [s for s, _ in a], [s for s, _ in b]
    hs = np.stack([h for _, h in a])
    used = prop.kv_blocks_in_use()
    out = RaisingList([7.0])
    with pytest.raises(RuntimeError, match="out_conf refused"):
        prop.propose_batch([3, 4], hs, [s.next_position for s in sts_a], 3, sts_a, out_conf=out,
                           min_confidence=0.0)
    assert list(out) == [7.0] and prop.kv_blocks_in_use() == used
    for sa, sb in zip(sts_a, sts_b):
        _same(prop, sa, sb)
    prop.check_invariants()
    ca, cb = [], []
    da = prop.propose_batch([3, 4], hs, [s.next_position for s in sts_a], 3, sts_a, out_conf=ca)
    db = prop.propose_batch([3, 4], hs, [s.next_position for s in sts_b], 3, sts_b, out_conf=cb)
    assert da == db and ca == cb and len(ca) == 2


@pytest.mark.parametrize("batch", [False, True])
def test_an_out_conf_that_raises_on_its_kth_write(tiny_ckpt, batch):
    """Calls before the k-th write complete; the k-th fails and changes nothing; the next completes."""
    prop, [(sa, h)], [(sb, _)] = _twins(tiny_ckpt, "exact", 1)
    out = RaiseOnKth(2)

    def propose(st, conf):
        if batch:
            return prop.propose_batch([3], h[None], [st.next_position], 2, [st], out_conf=conf)[0]
        return prop.propose(3, h, st.next_position, 2, st, out_conf=conf)

    ref = []
    assert propose(sa, out) == propose(sb, ref) and list(out) == ref
    prop.after_verify(0, sa)
    prop.after_verify(0, sb)
    before = list(out)
    with pytest.raises(RuntimeError, match="write 2 refused"):
        propose(sa, out)
    assert list(out) == before and not sa.drafted
    _same(prop, sa, sb)
    ref = []
    assert propose(sa, out) == propose(sb, ref) and list(out) == ref
    prop.check_invariants()
