"""The sharded draft head (mtpkern.shard, docs/distributed.md) in a world of threads.

Every rank of a 2- or 4-rank world loads its slice of a synthetic checkpoint and runs the
same call script as a single-rank proposer; after every call the drafts, confidences,
refusals and catch-ups are identical to the single rank's, and each rank's KV is its slice
of the single-rank KV (tests/shard_cases.py). Covered: MoE with shared experts, experts by
id ("ep") and by intermediate slice ("tp"), the dense MLP, MLA, GQA with fewer KV heads
than ranks, DeepSeek-V4's attention (a grouped output split by whole groups), both KV modes. tests/mpi_worker.py runs the same under ``mpirun`` on the cpu
backend (tests/test_comm.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shard_cases
from comm_cases import ThreadWorld
from mtpkern import MultiModuleMtpHead
from mtpkern.block import BlockSpec
from mtpkern.comm import LocalComm
from mtpkern.config import tiny_config
from mtpkern.shard import Shard, ShardError
from mtpkern.weights import load_weights, write_synthetic_checkpoint
from mtpkern.backends import get_backend

KW = dict(block_size=4, num_blocks=160, prefill_chunk=6)
_SINGLE: dict = {}


def whole_weights(ckpt):
    """(config, the numpy backend, the checkpoint's unsharded weights): what a rank's slices
    are compared with."""
    from mtpkern.config import MtpConfig

    cfg = MtpConfig.from_json(ckpt / "config.json")
    be = get_backend("numpy")
    return cfg, be, load_weights(ckpt, cfg, be)


def single_log(ckpt, kv_mode, steps, conf, stop: bool = False):
    key = (str(ckpt), kv_mode)
    if key not in _SINGLE:
        _SINGLE[key] = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=kv_mode, **KW)
    return shard_cases.run_script(_SINGLE[key], steps, conf, stop)


def check_planned_world(ckpt, kv_mode, on_rank=None, seed: int = 31, length: int = 10, size: int = 2,
                        stop: bool = False) -> None:
    """The planned step (run eagerly on NumPy, ``capture=False``) over a head sharded on ``size`` ranks
    takes the planned step and gives, call for call, the single rank's log of
    ``shard_cases.script(seed, length)``. ``on_rank(prop, comm)``: checks of a rank's head
    before it runs. ``stop``: the proposes stop early (``run_script``), the single rank eagerly."""
    from mtpkern.cuda_graph import StepRunner

    steps = shard_cases.script(seed, length=length)
    want = single_log(ckpt, kv_mode, steps, True, stop)

    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=kv_mode, comm=comm, **KW)
        if on_rank is not None:
            on_rank(prop, comm)
        prop.step_runner = StepRunner(prop, capture=False)
        log = shard_cases.run_script(prop, steps, True, stop)
        assert prop.step_runner.counts["executed"] > 0, prop.step_runner.counts
        assert not stop or prop.step_runner.counts["early_stop"] > 0, prop.step_runner.counts
        return prop, log

    for prop, log in ThreadWorld(size).run(rank):
        shard_cases.compare(want, log, prop)


def world_logs(ckpt, size, kv_mode, steps, conf, experts="ep"):
    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=kv_mode, comm=comm,
                                                  experts=experts, **KW)
        assert prop.needs_comm() and prop.shard.rank == comm.rank
        return prop, shard_cases.run_script(prop, steps, conf)

    return ThreadWorld(size).run(rank)


def check_world(ckpt, size, kv_mode, seed, conf=False, experts="ep"):
    steps = shard_cases.script(seed)
    want = single_log(ckpt, kv_mode, steps, conf)
    for prop, log in world_logs(ckpt, size, kv_mode, steps, conf, experts):
        shard_cases.compare(want, log, prop)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), conf=st.booleans())
def test_sharded_moe_matches_one_rank(tiny_ckpt, size, kv_mode, seed, conf):
    """Experts by id, shared experts by slice, 4 query heads over 2 KV heads (at 4 ranks one
    query head each, a KV head held by two ranks), the LM head in whole mask words."""
    check_world(tiny_ckpt, size, kv_mode, seed, conf)


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_moe_tp_experts_matches_one_rank(tiny_ckpt, size):
    check_world(tiny_ckpt, size, "exact", 11, conf=True, experts="tp")


def test_sharded_dense_matches_one_rank(tiny_ckpt_dense):
    check_world(tiny_ckpt_dense, 2, "exact", 5, conf=True)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_mla_matches_one_rank(mla_ckpt, kv_mode):
    """MLA: query heads split, the latent rows (the pool) replicated on every rank."""
    check_world(mla_ckpt, 2, kv_mode, 3)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_hyper_connections_match_one_rank(hc_ckpt, kv_mode):
    """Hyper-connections: their weights and the streams replicated on every rank; each rank
    writes the streams back (hc_post) after the sublayer's partial sums meet."""
    check_world(hc_ckpt, 2, kv_mode, 5, conf=True)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_dsa_matches_one_rank(dsa_ckpt, kv_mode):
    """DSA: the indexer (its weights, its key plane, the selection) replicated on every rank,
    so every rank picks the same keys; the query heads split as MLA's."""
    check_world(dsa_ckpt, 2, kv_mode, 3)


@pytest.mark.parametrize("name", ["mla_nope", "mla_nope_dsa"])
@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_nope_mla_matches_one_rank(tmp_path, name, kv_mode):
    """MLA without RoPE (qk_rope_head_dim 0, GLM-5.3's; tests/test_blocks.py's configs), alone
    and under DSA's indexer: latent rows of L values, the query heads split as any MLA's."""
    import test_blocks

    check_world(write_synthetic_checkpoint(tmp_path, test_blocks.feature_config(name), seed=8), 2, kv_mode, 3)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_glm5_3_pooled_indexer_matches_one_rank(tmp_path, kv_mode):
    """GLM-5.3's block (NoPE MLA, the pooled indexer: pools of 2 keys, their gate scores in the
    indexer's plane, the tail; the position-0 mask; postnorm) at 2 ranks: the indexer's weights,
    its plane and the pools' selection replicated on every rank, the query heads split."""
    import test_family_glm5_next

    cfg = tiny_config(**test_family_glm5_next.G53)
    check_world(write_synthetic_checkpoint(tmp_path, cfg, seed=9, dtype="float32"), 2, kv_mode, 3)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_draft_vocab_matches_one_rank(tiny_ckpt, tiny_cfg, kv_mode):
    """A draft vocabulary over a sharded head: each rank reads the rows of its share of the
    subset's tokens only, and drafts, confidences, trees and KV are the single-rank proposer's
    with the same draft vocabulary (masks and ids in target space)."""
    ids = np.random.default_rng(4).choice(tiny_cfg.vocab_size, 97, replace=False)
    steps = shard_cases.script(12, length=10)
    one = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=kv_mode, draft_vocab=ids, **KW)
    want = shard_cases.run_script(one, steps, True)

    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=kv_mode, comm=comm,
                                                  draft_vocab=ids, **KW)
        lo, hi = prop.shard.vocab(97)
        np.testing.assert_array_equal(prop.modules[0].vocab.ids, np.sort(ids)[lo:hi])
        assert prop.weights.modules[0].head.shape[0] == hi - lo
        return prop, shard_cases.run_script(prop, steps, True)

    for prop, log in ThreadWorld(2).run(rank):
        shard_cases.compare(want, log, prop)


@pytest.mark.parametrize("block", [(8, 8), (0, 0)])
def test_sharded_fp8_matches_one_rank(tmp_path_factory, block):
    """FP8 projections (block scales of 8, or per-channel): each rank reads its rows /
    columns with their scales; experts by id at 4 ranks, by slice at 2 (their 8-row scale
    blocks cut along)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_config(), weight_quant="fp8", fp8_block=block)
    ckpt = write_synthetic_checkpoint(tmp_path_factory.mktemp("fp8"), cfg, seed=4)
    check_world(ckpt, 2, "exact", 8, conf=True, experts="tp")
    check_world(ckpt, 4, "draft", 9)


def test_sharded_fp8_refuses_a_cut_scale_block(tmp_path):
    """A shard boundary inside an FP8 scale block cannot be read: CheckpointError naming the
    tensor (4 ranks cut the attention projections' 32-row blocks at 16 rows; the first one read
    is named)."""
    import dataclasses

    from mtpkern.errors import CheckpointError

    cfg = dataclasses.replace(tiny_config(), weight_quant="fp8", fp8_block=(32, 32))
    ckpt = write_synthetic_checkpoint(tmp_path / "fp8", cfg, seed=4)
    with pytest.raises(CheckpointError, match=r"self_attn\.[qk]_proj\.weight'.*scale blocks of 32"):
        load_weights(ckpt, cfg, get_backend("numpy"), shard=Shard(1, 4))


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_planned_early_stop_matches_one_rank(tiny_ckpt, kv_mode):
    """Proposes with min_confidence take the planned step on every rank of a sharded head (the
    confidences all-gathered, so every rank stops each sequence at the same draft and trims the
    same rows): the single rank's eager early stop, call for call."""
    check_planned_world(tiny_ckpt, kv_mode, length=12, stop=True)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
@pytest.mark.parametrize("size", [2, 4])
def test_sharded_planned_step_matches_one_rank(tiny_ckpt, kv_mode, size):
    """The planned propose step (mtpkern.cuda_graph, what the cuda backend captures) over a
    sharded head, run eagerly on NumPy: its all-reduces inside the modules' launches, each
    draft's LM-head reduction between them, the masks staged in the rank's words, the
    expert ids mapped into a persistent buffer; call for call the single rank's."""
    check_planned_world(tiny_ckpt, kv_mode, length=12, size=size)


#: DeepSeek-V4's attention at test size (tests/test_v4_attention.py): one K = V head of 32 that
#: every rank replicates, 8 rotary dims in pairs, a query latent of 24, a grouped output of rank
#: 16, sinks, a window of 6
V4_ATTN = dict(num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, rope_interleave=True,
               q_lora_rank=24, shared_kv=True, out_rope=True, o_groups=2, o_lora_rank=16, attn_sinks=True,
               attention_bias=False, sliding_window=6)
#: 8 heads in 4 groups of 2: 2 ranks hold 2 groups each, 4 ranks one each
V4_GROUPS4 = dict(V4_ATTN, num_attention_heads=8, o_groups=4)
_V4_CKPTS: dict = {}


def v4_ckpt(tmp_path_factory, name):
    """A synthetic checkpoint of one of the V4 shapes below, written once per session."""
    from test_family_deepseek_v4 import V4 as V4_FAMILY      # the release's features (4 streams, ...)

    shapes = {"groups2": V4_ATTN, "groups4": V4_GROUPS4, "groups4_hc": dict(V4_GROUPS4, hc_mult=4),
              "family": dict(V4_FAMILY, num_attention_heads=8, o_groups=4)}
    if name not in _V4_CKPTS:
        _V4_CKPTS[name] = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"v4_{name}"),
                                                     tiny_config(**shapes[name]), seed=3)
    return _V4_CKPTS[name]


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
@pytest.mark.parametrize("name,size", [("groups2", 2), ("groups4", 2), ("groups4", 4), ("groups4_hc", 2),
                                       ("groups4_hc", 4), ("family", 2), ("family", 4)])
def test_sharded_v4_attention_matches_one_rank(tmp_path_factory, name, size, kv_mode):
    """DeepSeek-V4's attention by whole output groups: each rank's query heads (q_b_proj rows,
    sinks, the inverse RoPE of their outputs) cover its groups, whose o_a_proj rows and
    o_b_proj columns it holds; the one K = V head (kv_proj), the query latent (q_a_proj and its
    norm) and the streams replicated; the [n, H] partial products meet in o_proj's all-reduce.
    With 4 streams, and in the release layout (``family``: each head's dims reordered at load,
    e_proj / h_proj joined)."""
    check_world(v4_ckpt(tmp_path_factory, name), size, kv_mode, 17, conf=True)


def test_sharded_v4_attention_with_the_wrong_groups_differs(tmp_path_factory, monkeypatch):
    """Negative control: each rank reading another rank's output groups (o_a_proj rows and
    o_b_proj columns alike) drafts otherwise than one rank."""
    ckpt = v4_ckpt(tmp_path_factory, "groups4")
    swap = Shard.groups

    def other(self, b, where=""):
        return swap(Shard((self.rank + 1) % self.size, self.size, self.experts), b, where)

    monkeypatch.setattr(Shard, "groups", other)
    with pytest.raises(AssertionError):
        check_world(ckpt, 2, "exact", 17, conf=True)


@pytest.mark.parametrize("shape", ["groups4", "groups4_hc"])
def test_sharded_v4_planned_step_matches_one_rank(tmp_path_factory, shape):
    """The planned step over a sharded V4 head (each rank's query heads and output groups, K = V
    on every rank; with 4 streams, the hyper-connections replicated) takes the planned step,
    call for call the single rank's."""
    check_planned_world(v4_ckpt(tmp_path_factory, shape), "draft")


@pytest.mark.parametrize("name,size", [("groups4", 4), ("family", 2)])
def test_sharded_v4_weights_are_slices(tmp_path_factory, name, size):
    """A rank's V4 attention tensors: its groups' o_a_proj rows (one prepared weight a group,
    the whole head's reordered columns in the family layout), o_b_proj's columns of its groups,
    q_b_proj's rows and the sinks of its heads; kv_proj, q_a_proj and its norm whole."""
    ckpt = v4_ckpt(tmp_path_factory, name)
    cfg, be, full = whole_weights(ckpt)
    b = cfg.block(0)
    g, r, D = b.o_groups, b.o_lora_rank, b.head_dim
    gl, hq = g // size, b.num_attention_heads // size            # a rank's groups and heads
    for rank in range(size):
        sh = Shard(rank, size)
        assert sh.groups(b) == (rank * gl, (rank + 1) * gl)
        lb = sh.block(b)
        assert (lb.num_attention_heads, lb.num_key_value_heads, lb.o_groups, lb.o_lora_rank) == (hq, 1, gl, r)
        part = load_weights(ckpt, cfg, be, shard=sh)
        for m, f in zip(part.modules, full.modules):
            assert len(m.w_o_a) == gl
            for i in range(gl):
                np.testing.assert_array_equal(m.w_o_a[i], f.w_o_a[rank * gl + i])
            np.testing.assert_array_equal(m.w_o_b, f.w_o_b[:, rank * gl * r:(rank + 1) * gl * r])
            np.testing.assert_array_equal(m.q_b, f.q_b[rank * hq * D:(rank + 1) * hq * D])
            np.testing.assert_array_equal(m.sinks, f.sinks[rank * hq:(rank + 1) * hq])
            for k in ("w_qkv", "mla_q_a", "mla_q_a_norm", "k_norm"):
                np.testing.assert_array_equal(getattr(m, k), getattr(f, k), err_msg=k)


class _CountingBackend:
    """A backend that counts the weights and vectors prepared on it (a load that builds anything)."""

    def __init__(self, inner):
        self.inner, self.prepared = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prepare_weight(self, a):
        self.prepared += 1
        return self.inner.prepare_weight(a)

    def prepare_vector(self, a):
        self.prepared += 1
        return self.inner.prepare_vector(a)


def test_a_split_that_cuts_an_output_group_is_refused(tmp_path_factory):
    """4 ranks of 4 heads in 2 groups would give each rank one head of a 2-head group:
    ShardError naming o_groups with the expected and actual values, from Shard, load_weights
    and from_pretrained alike, before any tensor is prepared; a later module whose groups a
    split cuts is refused before the earlier modules are built."""
    from mtpkern.config import MtpConfig

    ckpt = v4_ckpt(tmp_path_factory, "groups2")
    cfg = MtpConfig.from_json(ckpt / "config.json")
    msg = (r"o_groups \(module 0\): a grouped output's 2 groups of 2 query heads cannot be split over 4 ranks: "
           r"a rank's 1 query heads would cut a group \(expected o_groups a multiple of the world size 4, got 2\)")
    for rank in range(4):
        with pytest.raises(ShardError, match=msg):
            Shard(rank, 4).block(cfg.block(0), " (module 0)")
    be = _CountingBackend(get_backend("numpy"))
    with pytest.raises(ShardError, match=msg):
        load_weights(ckpt, cfg, be, shard=Shard(2, 4))
    assert be.prepared == 0
    with pytest.raises(ShardError, match=msg):
        MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", comm=ThreadWorldComm(3, 4), **KW)
    # module 2 alone in 2 groups of 4 heads: 4 ranks cut it, though modules 0 and 1 split
    cut = tiny_config(**dict(V4_GROUPS4, blocks=[{}, {}, {"o_groups": 2}]))
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("v4_cut"), cut, seed=3)
    be = _CountingBackend(get_backend("numpy"))
    with pytest.raises(ShardError, match=r"o_groups \(module 2\): .* 2 groups of 4 query heads .* got 2\)"):
        load_weights(path, cut, be, shard=Shard(0, 4))
    assert be.prepared == 0
    assert len(load_weights(path, cut, be, shard=Shard(0, 2)).modules[2].w_o_a) == 1     # 2 ranks: whole groups


def test_sharded_weights_are_slices(tiny_ckpt, tiny_cfg):
    """Each rank reads only its slice: the shapes of the rank's weights, and bytes read that
    add up over the ranks to the whole checkpoint's plus the replicated tensors' copies."""
    be = get_backend("numpy")
    full = load_weights(tiny_ckpt, tiny_cfg, be)
    parts = [load_weights(tiny_ckpt, tiny_cfg, be, shard=Shard(r, 2)) for r in range(2)]
    b = tiny_cfg.block(0)
    for r, w in enumerate(parts):
        m, f = w.modules[0], full.modules[0]
        lo, hi = Shard(r, 2).vocab(tiny_cfg.vocab_size)
        np.testing.assert_array_equal(m.head, f.head[lo:hi])
        np.testing.assert_array_equal(m.embed, f.embed)                  # replicated
        np.testing.assert_array_equal(m.experts_w13, f.experts_w13[4 * r:4 * r + 4])
        np.testing.assert_array_equal(m.w_o, f.w_o[:, 2 * r * b.head_dim:(2 * r + 2) * b.head_dim])
        Is = tiny_cfg.shared_intermediate_size // 2
        np.testing.assert_array_equal(m.shared_w2, f.shared_w2[:, r * Is:(r + 1) * Is])
        assert m.w_qkv.shape[0] == full.modules[0].w_qkv.shape[0] // 2
        assert w.shard == Shard(r, 2)
    # every rank reads the replicated tensors (here mostly the [V, H] embedding) and half the rest
    sizes = [p.nbytes for p in parts]
    assert sum(sizes) > full.nbytes and max(sizes) < 0.65 * full.nbytes, (full.nbytes, sizes)


def test_shard_layout_rules():
    """Spans, heads (GQA, KV heads fewer than ranks), vocabulary words, expert maps."""
    for size in (1, 2, 3, 4, 8):
        for V in (32 * size, 301, 1000, 32768):
            if (V + 31) // 32 < size:
                continue
            spans = [Shard(r, size).vocab(V) for r in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == V
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(lo % 32 == 0 and hi > lo for lo, hi in spans)
    b = BlockSpec(num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    hs = [Shard(r, 4).heads(b) for r in range(4)]
    assert [(h.q0, h.q1, h.kv0, h.kv1) for h in hs] == [(0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]
    for h in hs:                                   # each rank's query heads read its KV head
        assert h.q0 // (8 // 2) == h.kv0 and (h.q1 - 1) // (8 // 2) == h.kv0
    assert Shard(1, 2).block(b).num_attention_heads == 4 and Shard(1, 2).block(b).num_key_value_heads == 1
    np.testing.assert_array_equal(Shard(1, 2).expert_map(8), [-1, -1, -1, -1, 0, 1, 2, 3])
    assert Shard(1, 2, "tp").expert_map(8) is None and Shard(1, 2, "tp").routed_slice(32) == (16, 32)
    with pytest.raises(ShardError, match="num_attention_heads"):
        Shard(0, 3).heads(b)
    with pytest.raises(ShardError, match="num_key_value_heads"):
        Shard(0, 4).heads(BlockSpec(num_attention_heads=12, num_key_value_heads=3, head_dim=16))
    with pytest.raises(ShardError, match="vocab_size"):
        Shard(0, 4).vocab(70)
    for bad, match in (((2, 2), "rank"), ((0, 0), "size"), ((0, 2, "xx"), "experts")):
        with pytest.raises(ValueError, match=match):
            Shard(*bad)


def test_sharded_head_refuses_what_it_cannot(tmp_path, tiny_ckpt, tiny_cfg):
    """Weights and communicator must agree; an unsplittable checkpoint names its field; a
    draft vocabulary other than the one the heads were read for is refused."""
    be = get_backend("numpy")
    rank1 = load_weights(tiny_ckpt, tiny_cfg, be, shard=Shard(1, 2))
    with pytest.raises(ValueError, match="comm"):
        MultiModuleMtpHead(tiny_cfg, rank1, be, **KW)
    with pytest.raises(ValueError, match="weights"):
        MultiModuleMtpHead(tiny_cfg, load_weights(tiny_ckpt, tiny_cfg, be), be, comm=ThreadWorldComm(0, 2), **KW)
    with pytest.raises(ValueError, match="rank 0 of 2"):
        MultiModuleMtpHead(tiny_cfg, rank1, be, comm=ThreadWorldComm(0, 2), **KW)
    one = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=LocalComm(), **KW)
    assert not one.needs_comm() and one.shard is None
    odd = write_synthetic_checkpoint(tmp_path / "odd", tiny_config(num_attention_heads=3, num_key_value_heads=1))
    with pytest.raises(ShardError, match="num_attention_heads"):
        MultiModuleMtpHead.from_pretrained(odd, backend="numpy", comm=ThreadWorldComm(0, 2), **KW)

    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=comm, **KW)
        st_ = prop.alloc_state()
        H = tiny_cfg.hidden_size
        prop.prefill_drafter([1, 2, 3], np.ones((3, H), np.float32), st_)
        assert prop.drafter_rows(st_) == 2
        prop.free_state(st_)
        prop.check_invariants()
        with pytest.raises(ValueError, match="draft_vocab: a sharded head's LM heads were read for the whole"):
            MultiModuleMtpHead(tiny_cfg, prop.weights, prop.backend, comm=comm, draft_vocab=np.arange(64), **KW)

    ThreadWorld(2).run(rank)


class ThreadWorldComm:
    """A communicator's rank and size only (for the checks made before any collective)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def all_reduce(self, buf, op):
        raise AssertionError("no collective expected")

    all_gather = broadcast = all_reduce


def test_propose_bytes_of_a_rank(tiny_cfg):
    """A rank's bytes: at one rank the whole head's; over the ranks at least the whole (the
    replicated tensors are read by every rank), each rank under the whole."""
    from mtpkern.bench import propose_bytes

    for mode in ("exact", "draft"):
        for B in (1, 8):
            whole = propose_bytes(tiny_cfg, 3, 500, B, 4, mode)
            assert propose_bytes(tiny_cfg, 3, 500, B, 4, mode, shard=Shard(0, 1)) == whole
            for size in (2, 4):
                parts = [propose_bytes(tiny_cfg, 3, 500, B, 4, mode, shard=Shard(r, size)) for r in range(size)]
                assert sum(parts) >= whole and max(parts) < whole, (mode, B, size, parts, whole)


def test_bench_shard_runs_every_world(tmp_path):
    """``mtpkern bench-shard`` on the tiny shapes at 1 and 2 ranks (mpirun): a row per world,
    mode and batch, the bytes per rank falling with the shard."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("mpi4py", reason="MPI: pip install 'mtpkern[mpi]'")
    out = tmp_path / "shard.json"
    r = subprocess.run([sys.executable, "-m", "mtpkern", "bench-shard", "--shapes", "tiny", "--ranks", "1,2",
                        "--contexts", "16", "--batches", "1,2", "--runs", "2", "--warmup", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 and {row["ranks"] for row in rows} == {1, 2}
    for row in rows:
        assert row["median_us"] > 0 and row["shared_floor_us"] == pytest.approx(row["ranks"] * row["floor_us"])
        one = next(q for q in rows if q["ranks"] == 1 and q["kv_mode"] == row["kv_mode"] and q["batch"] == row["batch"])
        assert row["ranks"] == 1 or row["bytes_per_rank"] < one["bytes_per_rank"]
    assert "shared floor" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_head_on_the_gpu(tiny_ckpt, kv_mode):
    """scripts/gpu_check.sh: two ranks as threads on one GPU (CuPy buffers through the thread
    world's collectives), eagerly, call for call the single-rank reference's: the expert
    kernels' empty slots, the LM head's partial result and map_ids on the device."""
    from mtpkern.backends import cuda_available

    if not cuda_available():
        pytest.skip("no usable CUDA device")
    steps = shard_cases.script(51)
    want = single_log(tiny_ckpt, kv_mode, steps, True)

    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="cuda", kv_mode=kv_mode, comm=comm,
                                                  cuda_graphs=False, **KW)
        return prop, shard_cases.run_script(prop, steps, True)

    for prop, log in ThreadWorld(2).run(rank):
        shard_cases.compare(want, log, prop, tol=2e-2)               # BF16 KV on cuda


# -- agreement: a failure on one rank is a failure on every rank -------------------------------

@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank(tiny_ckpt, kv_mode):
    """The last rank of 2 gets a bad token, a NaN hidden, a grammar callable that raises
    mid-draft (chain and tree), out_conf / min_confidence / num_drafts / tree widths of its
    own, a chain where the other drafts a tree, a bad prefill token, other catch-up tokens:
    every rank raises the same error (the refusing rank's type, or RankMismatch naming the
    argument), no state changes, and the next identical call succeeds on every rank. Without
    the agreement the other rank waits in its next collective (here a 10 s barrier timeout, a
    hang under mpirun) or runs other collectives than its peer."""
    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=kv_mode, comm=comm, **KW)
        return shard_cases.refusal_cases(prop, comm.rank, comm.size)

    shard_cases.check_refusals(ThreadWorld(2, timeout=10).run(rank), 2)


def test_a_refusal_on_one_rank_of_four_with_the_planned_step(tiny_ckpt):
    """The same at 4 ranks with the planned step (mtpkern.cuda_graph, run eagerly): the
    agreement comes before the plan runs."""
    from mtpkern.cuda_graph import StepRunner

    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode="draft", comm=comm, **KW)
        prop.step_runner = StepRunner(prop, capture=False)
        return shard_cases.refusal_cases(prop, comm.rank, comm.size)

    shard_cases.check_refusals(ThreadWorld(4, timeout=10).run(rank), 4)


class _FailingComm:
    """A rank's communicator whose ``fail_at``-th all-reduce raises (a transport error) before
    meeting the others."""

    def __init__(self, inner, fail_at):
        self.inner, self.rank, self.size, self.fail_at, self.n = inner, inner.rank, inner.size, fail_at, 0

    def all_reduce(self, buf, op):
        self.n += 1
        if self.n == self.fail_at:
            raise ConnectionError("transport: link down")
        self.inner.all_reduce(buf, op)

    def all_gather(self, send, recv):
        self.inner.all_gather(send, recv)

    def broadcast(self, buf, root):
        self.inner.broadcast(buf, root)


def test_a_transport_error_mid_call_marks_every_rank_broken(tiny_ckpt):
    """A collective that raises on one rank mid-call: that rank raises, the other raises when
    its collective times out (its transport's error), both states are unchanged, and each
    proposer refuses its later sharded calls (StateError: the ranks may be out of step) at
    once instead of entering collectives its peers will not match."""
    from mtpkern.errors import StateError

    H = tiny_config().hidden_size

    def rank(comm):
        c = _FailingComm(comm, 10**9)
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=c, **KW)
        st_ = prop.alloc_state()
        prop.prefill_drafter([1, 2, 3, 4, 5], np.ones((5, H), np.float32), st_)
        before = shard_cases._kv(prop, [st_])
        c.n, c.fail_at = 0, (3 if comm.rank == 1 else 10**9)     # mid-call: after the agreement, in module 0
        with pytest.raises(Exception) as e:
            prop.propose(7, np.ones(H, np.float32), 5, 3, st_)
        assert shard_cases._same_kv(before, shard_cases._kv(prop, [st_]))
        prop.check_invariants()
        with pytest.raises(StateError, match="communicator failed in an earlier call"):
            prop.propose(7, np.ones(H, np.float32), 5, 3, st_)
        return type(e.value).__name__

    import threading

    assert ThreadWorld(2, timeout=2).run(rank) == ["BrokenBarrierError", "ConnectionError"]
    assert threading.BrokenBarrierError.__mro__


def test_agreement_can_be_turned_off(tiny_ckpt):
    """``agree_calls = False``: no agreement collective (a propose makes one all-reduce fewer),
    the same drafts."""
    H = tiny_config().hidden_size

    def rank(comm):
        n = [0]

        class Counting:
            rank, size = comm.rank, comm.size

            def all_reduce(self, buf, op):
                n[0] += 1
                comm.all_reduce(buf, op)

            def all_gather(self, send, recv):
                comm.all_gather(send, recv)

            def broadcast(self, buf, root):
                comm.broadcast(buf, root)

        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=Counting(), **KW)
        counts, out = [], []
        for agree in (True, False):
            prop.agree_calls = agree
            st_ = prop.alloc_state()
            prop.prefill_drafter([1, 2, 3, 4, 5], np.ones((5, H), np.float32), st_)
            n[0] = 0
            out.append(prop.propose(7, np.ones(H, np.float32), 5, 3, st_))
            counts.append(n[0])
            prop.free_state(st_)
        return counts, out

    for counts, out in ThreadWorld(2).run(rank):
        assert counts[0] == counts[1] + 1 and out[0] == out[1], (counts, out)


def test_experts_is_checked_without_a_communicator(tiny_ckpt):
    """``experts`` is validated whether or not a communicator is given (it was ignored without)."""
    with pytest.raises(ValueError, match="experts: expected one of ep, tp, got 'bogus'"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", experts="bogus", **KW)
    with pytest.raises(ValueError, match="experts: expected one of ep, tp, got 1"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=LocalComm(), experts=1, **KW)
    with pytest.raises(TypeError, match="comm.rank: expected an int, got bool"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", comm=ThreadWorldComm(True, 2), **KW)


# -- Nemotron-3's block; the FP4 / FP8 containers --------------------------------------------

_FAMILY_CKPTS: dict = {}


def nemotron_ckpt(tmp_path_factory, name: str = "plain"):
    """Nemotron-3's tiny block (tests/test_family_nemotron_h.py: NoPE GQA of 4 / 2 heads, 8 relu2
    experts, a relu2 shared expert of 2 x 32 rows) in the release layout and config."""
    if name not in _FAMILY_CKPTS:
        import json

        import test_family_nemotron_h

        cfg = test_family_nemotron_h.CONFIGS[name]
        path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"nemo_{name}"), cfg, seed=13, dtype="float32")
        (path / "config.json").write_text(json.dumps(test_family_nemotron_h.release_config(cfg)))
        _FAMILY_CKPTS[name] = path
    return _FAMILY_CKPTS[name]


@pytest.mark.parametrize("kv_mode,experts", [("exact", "ep"), ("draft", "ep"), ("exact", "tp")])
def test_sharded_nemotron_matches_one_rank(tmp_path_factory, kv_mode, experts):
    """Nemotron-3's '*E' step over 2 ranks: a query head pair and one KV head a rank (NoPE), the
    relu2 experts by id or each one's 16 of 32 up rows / down columns, the relu2 shared expert's
    32 of 64 up rows (no gate rows to pair: w13 is up alone): every call as one rank."""
    check_world(nemotron_ckpt(tmp_path_factory), 2, kv_mode, 51, conf=kv_mode == "exact", experts=experts)


def test_sharded_nemotron_weights_are_slices(tmp_path_factory):
    """Each rank's relu2 weights are its slice of the whole: the shared expert's up rows and down
    columns, each routed expert's up rows (tp); a rank that read gate / up halves (SwiGLU's split)
    would hold other rows."""
    ckpt = nemotron_ckpt(tmp_path_factory)
    cfg, be, whole = whole_weights(ckpt)
    f = whole.modules[0]
    Is, I = cfg.shared_intermediate_size // 2, cfg.moe_intermediate_size // 2
    for r in range(2):
        m = load_weights(ckpt, cfg, be, shard=Shard(r, 2, "tp")).modules[0]
        np.testing.assert_array_equal(m.shared_w13, f.shared_w13[r * Is:(r + 1) * Is])
        np.testing.assert_array_equal(m.shared_w2, f.shared_w2[:, r * Is:(r + 1) * Is])
        np.testing.assert_array_equal(m.experts_w13, f.experts_w13[:, r * I:(r + 1) * I])
        np.testing.assert_array_equal(m.experts_w2, f.experts_w2[:, :, r * I:(r + 1) * I])


@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_sharded_latent_nemotron_matches_one_rank(tmp_path_factory, experts):
    """Nemotron-3 Super's LatentMoE over 2 ranks: fc1_latent_proj / fc2_latent_proj whole on every
    rank, the Lt-wide relu2 experts by id or by slice, each rank's partial latent sum lifted by
    fc2 (linear) and added in the all-reduce: every call as one rank."""
    check_world(nemotron_ckpt(tmp_path_factory, "latent"), 2, "exact", 52, experts=experts)


#: the tiny config with a shared expert of 2 x 32 rows: at 2 ranks o_proj's 64 columns and the
#: shared down projection's 64 columns are cut at 32, whole blocks of every format
CT_CFG = tiny_config(n_shared_experts=2)
#: container checkpoints (tests/test_quant_containers.py) of each format, every module projection
CT_FORMATS = {"nvfp4": {"proj": "nvfp4", "mlp.gate.": "nvfp4"}, "mxfp4": {"proj": "mxfp4", "mlp.gate.": "mxfp4"},
              "mxfp8": {"proj": "mxfp8"}}


def container_ckpt(tmp_path_factory, fmt: str):
    """A compressed-tensors checkpoint of ``fmt``; NVFP4's global scales made to differ from tensor
    to tensor (x 1, 2, 4, ...), so fused q | k | v and an expert's rows carry different row scales."""
    key = ("ct", fmt)
    if key not in _FAMILY_CKPTS:
        from safetensors.numpy import save_file

        from mtpkern.weights import read_tensors
        from test_quant_containers import container

        modelopt = fmt == "modelopt"
        ct, _ = container(tmp_path_factory.mktemp(f"ct_{fmt}"), CT_CFG, CT_FORMATS["nvfp4" if modelopt else fmt],
                          "modelopt" if modelopt else "compressed-tensors")
        raw = read_tensors(ct)
        for i, k in enumerate(sorted(k for k in raw if k.endswith(("weight_global_scale", "weight_scale_2")))):
            f = np.float32(2.0 ** (i % 3))          # weights x 2^i (compressed-tensors stores the divisor)
            raw[k] = (raw[k] * f if modelopt else raw[k] / f).astype(np.float32)
        save_file(raw, str(ct / "model.safetensors"), metadata={"format": "pt"})
        _FAMILY_CKPTS[key] = ct
    return _FAMILY_CKPTS[key]


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
@pytest.mark.parametrize("fmt", sorted(CT_FORMATS) + ["modelopt"])
def test_sharded_container_matches_one_rank(tmp_path_factory, fmt, kv_mode):
    """NVFP4 (E4M3 per 16, the row scale; compressed-tensors' and ModelOpt's), MXFP4 / MXFP8 (E8M0
    per 32) projections over 2 ranks: each rank reads its rows with their scales and its columns
    at whole blocks; every call as one rank. NVFP4 also with each expert's 32 columns of down_proj
    cut at 16 (experts "tp")."""
    ckpt = container_ckpt(tmp_path_factory, fmt)
    check_world(ckpt, 2, kv_mode, 61, conf=kv_mode == "exact")
    if fmt in ("nvfp4", "modelopt") and kv_mode == "exact":
        check_world(ckpt, 2, kv_mode, 62, experts="tp")


@pytest.mark.parametrize("fmt", sorted(CT_FORMATS))
def test_sharded_container_weights_are_slices(tmp_path_factory, fmt):
    """Each rank's weights, dequantized, are its slice of the whole's: the fused q | k | v rows of
    its heads (NVFP4: each part with its own tensor's row scale), o_proj's and the shared down
    projection's columns (every row's scale kept), each routed expert's rows and columns (tp)."""
    ckpt = container_ckpt(tmp_path_factory, fmt)
    cfg, be, full = whole_weights(ckpt)
    b = cfg.block(0)
    D, Hq, Hkv = b.head_dim, b.num_attention_heads, b.num_key_value_heads
    Is, I = cfg.shared_intermediate_size // 2, cfg.moe_intermediate_size // 2
    for m in range(cfg.num_modules):
        f = full.modules[m]
        q, k, v = np.split(f.w_qkv, [Hq * D, (Hq + Hkv) * D])
        for r in range(2):
            tp = fmt == "nvfp4"          # (the per-32 formats refuse tp's cut of 16: below)
            w = load_weights(ckpt, cfg, be, shard=Shard(r, 2, "tp" if tp else "ep")).modules[m]
            hq, hk = Hq // 2 * D, Hkv // 2 * D
            np.testing.assert_array_equal(w.w_qkv, np.concatenate([q[r * hq:(r + 1) * hq], k[r * hk:(r + 1) * hk],
                                                                   v[r * hk:(r + 1) * hk]]))
            np.testing.assert_array_equal(w.w_o, f.w_o[:, r * hq:(r + 1) * hq])
            np.testing.assert_array_equal(w.shared_w2, f.shared_w2[:, r * Is:(r + 1) * Is])
            if tp:                       # each expert's rows of its gate and up, columns of its down
                np.testing.assert_array_equal(w.experts_w2, f.experts_w2[:, :, r * I:(r + 1) * I])
                gate, up = np.split(f.experts_w13, 2, axis=1)
                np.testing.assert_array_equal(w.experts_w13, np.concatenate(
                    [gate[:, r * I:(r + 1) * I], up[:, r * I:(r + 1) * I]], axis=1))
            else:                        # experts by id: whole
                E = cfg.n_routed_experts // 2
                np.testing.assert_array_equal(w.experts_w2, f.experts_w2[r * E:(r + 1) * E])
    if fmt == "nvfp4":                   # the row scales differ from tensor to tensor (the test can see them)
        from mtpkern.weights import read_tensors

        g = {float(v[0]) for k, v in read_tensors(ckpt).items() if k.endswith("weight_global_scale")}
        assert len(g) > 1, g


@pytest.mark.parametrize("fmt", sorted(CT_FORMATS))
def test_sharded_container_reads_only_its_ranges(tmp_path_factory, monkeypatch, fmt):
    """A rank reads its rows / columns of a container's codes from the file, not the whole tensor
    (docs/distributed.md: each rank reads only its slice): q_proj's rows of its heads, o_proj's
    columns (with FP4 codes, two a byte: the byte columns). Negative control: a loader that read
    every container tensor whole and cut it on the host fails here (it did)."""
    from mtpkern.config import MtpConfig
    from mtpkern.weights import CheckpointReader

    ckpt = container_ckpt(tmp_path_factory, fmt)
    cfg = MtpConfig.from_json(ckpt / "config.json")
    reads: dict = {}
    get = CheckpointReader.get

    def logged(self, key, shape, dtypes=None, rows=None, cols=None):
        reads[key] = (rows, cols)
        return get(self, key, shape, *(() if dtypes is None else (dtypes,)), rows, cols)

    monkeypatch.setattr(CheckpointReader, "get", logged)
    load_weights(ckpt, cfg, get_backend("numpy"), shard=Shard(1, 2))
    codes = "weight_packed" if fmt != "mxfp8" else "weight"
    b = cfg.block(0)
    q = next(v for k, v in reads.items() if k.endswith(f"self_attn.q_proj.{codes}"))
    o = next(v for k, v in reads.items() if k.endswith(f"self_attn.o_proj.{codes}"))
    half = b.num_attention_heads // 2 * b.head_dim
    packed = 2 if fmt != "mxfp8" else 1                    # FP4: two codes a byte
    assert q == ((half, 2 * half), None), q
    assert o == (None, (half // packed, 2 * half // packed)), o


@pytest.mark.parametrize("fmt,size,cut,block", [("mxfp4", 2, "16:32", 32), ("mxfp8", 2, "16:32", 32),
                                                 ("nvfp4", 4, "8:16", 16)])
def test_sharded_container_refuses_a_cut_scale_block(tmp_path_factory, fmt, size, cut, block):
    """Experts split by intermediate slice ("tp") cut each expert's 32 down_proj columns at 32 / size:
    inside a per-32 block (MXFP4, MXFP8) at 2 ranks, inside NVFP4's per-16 block at 4. Refused,
    naming the tensor, the cut and the block (rank 1: the first rank whose cut is inside a block)."""
    from mtpkern.config import MtpConfig
    from mtpkern.errors import CheckpointError

    ckpt = container_ckpt(tmp_path_factory, fmt)
    cfg = MtpConfig.from_json(ckpt / "config.json")
    with pytest.raises(CheckpointError, match=rf"tensor '[^']*mlp\.experts\.0\.down_proj\.weight[^']*': a shard of "
                                              rf"columns {cut} cuts its {fmt.upper()} scale blocks of {block}"):
        load_weights(ckpt, cfg, get_backend("numpy"), shard=Shard(1, size, "tp"))


@pytest.mark.parametrize("kv_mode,experts", [("exact", "ep"), ("draft", "tp")])
def test_sharded_qwen3_5_matches_one_rank(tmp_path_factory, kv_mode, experts):
    """Qwen3.5 / 3.6-MoE's step over 2 ranks (two modules, experts packed as gate_up_proj, the
    output gate interleaved per head in q_proj: each rank's heads with their gate rows, the gated
    shared expert's slice): every call as one rank."""
    import test_family_qwen3_5

    key = ("qwen3_5",)
    if key not in _FAMILY_CKPTS:
        _FAMILY_CKPTS[key] = test_family_qwen3_5._ckpt(tmp_path_factory.mktemp("q35"), test_family_qwen3_5.MOE2,
                                                       packed=True, seed=9)
    check_world(_FAMILY_CKPTS[key], 2, kv_mode, 71, conf=kv_mode == "exact", experts=experts)
