"""The cpu backend's warm-up (every kernel family compiled up front, nothing left for the
first propose) and its thread count (validated, applied on the calling thread)."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from numba.core import event

from mtpkern import MultiModuleMtpHead
from mtpkern.backends import get_backend
from mtpkern.backends.cpu import CpuBackend, default_threads
from mtpkern.backends.warm_up import family_calls
from warm_up_calls import every_call

POOL = numba.config.NUMBA_NUM_THREADS


def test_warm_up_reports_every_family_and_compiles_nothing_twice():
    be = CpuBackend()
    seen = []
    be.warm_up(lambda done, total, name: seen.append((done, total, name)))
    names = [name for name, _ in family_calls(be)]
    assert seen == [(i, len(names), n) for i, n in enumerate(names)] + [(len(names), len(names), "")]
    assert be.warm_up() == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_after_warm_up_a_propose_compiles_nothing(tmp_path, tiny_cfg, dtype):
    """warm_up covers every argument type the head and the proposer pass (both KV modes,
    batches, bitmasks, catch-up): the first real call loads nothing new."""
    from mtpkern import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(tmp_path / dtype, tiny_cfg, seed=5, dtype=dtype)
    be = CpuBackend()
    be.warm_up()
    rng = np.random.default_rng(0)
    with event.install_recorder("numba:compile") as rec:
        for mode in ("exact", "draft"):
            every_call(MultiModuleMtpHead.from_pretrained(ckpt, backend=be, kv_mode=mode, block_size=4, num_blocks=64),
                       rng)
    compiled = sorted({ev.data["dispatcher"].py_func.__name__ for _, ev in rec.buffer if ev.is_start})
    assert compiled == []


def test_after_warm_up_fp8_ops_compile_nothing():
    """The FP8 weight kernels are warmed up too: every GEMV family with FP8 weights of both
    scale kinds (and the dense MLP as one expert) loads nothing new afterwards."""
    from mtpkern import Fp8Weight
    from mtpkern.ops.moe import RouterSpec

    be = CpuBackend()
    be.warm_up()
    rng = np.random.default_rng(1)
    n, H, I, E, V = 3, 40, 12, 8, 70
    x = rng.standard_normal((n, H)).astype(np.float32)
    ones = np.ones(H, np.float32)
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
    embed = be.prepare_weight(rng.standard_normal((V, H)).astype(np.float32))
    with event.install_recorder("numba:compile") as rec:
        for block in ((128, 128), None):
            def w(*shape):
                return be.prepare_weight(Fp8Weight.quantize(rng.standard_normal(shape).astype(np.float32), block))
            be.linear(x, w(5, H))
            be.linear(x, w(5, H), np.ones(5, np.float32), np.ones((n, 5), np.float32))
            be.mtp_input(embed, np.array([1, 2, 3], np.int32), x, ones, ones, w(H, 2 * H), 1e-5)
            be.swiglu_mlp(x, w(2 * I, H), w(H, I), x)
            ids, wts = be.moe_router(x, w(E, H), np.zeros(E, np.float32), spec)
            be.moe_experts(x, ids, wts, w(E, 2 * I, H), w(E, H, I), x)
            be.moe_experts(x, ids, wts, w(E, 2 * I, H), w(E, H, I))
            head = w(V, H)
            be.lm_head_argmax(x, head)
            be.lm_head_argmax(x, head, np.full((n, -(-V // 32)), -1, np.int32))
            be.lm_head_logits(x, head)
    compiled = sorted({ev.data["dispatcher"].py_func.__name__ for _, ev in rec.buffer if ev.is_start})
    assert compiled == []


def test_numpy_backend_has_nothing_to_warm_up():
    calls = []
    assert get_backend("numpy").warm_up(lambda *a: calls.append(a)) == 0 and calls == []


def test_threads_are_validated():
    assert CpuBackend().threads == default_threads() == max(1, POOL // 2)
    assert CpuBackend(threads=1).threads == 1
    assert CpuBackend(threads=np.int64(POOL)).threads == POOL
    for bad, exc in ((0, ValueError), (POOL + 1, ValueError), (-1, ValueError), (1.5, TypeError),
                     (True, TypeError), ("2", TypeError)):
        with pytest.raises(exc, match="threads: expected"):
            CpuBackend(threads=bad)


def test_get_backend_threads():
    assert get_backend("cpu", threads=1).threads == 1
    assert get_backend("cpu").threads == default_threads()
    for name in ("numpy", "cuda"):
        with pytest.raises(ValueError, match="only the cpu backend has a thread count"):
            get_backend(name, threads=1)
    with pytest.raises(ValueError, match="build it with its thread count"):
        get_backend(CpuBackend(), threads=1)
    with pytest.raises(ValueError, match="expected 1 .."):
        get_backend("cpu", threads=0)


@pytest.mark.skipif(POOL < 2, reason="needs Numba's pool of at least 2 threads")
def test_threads_apply_on_the_calling_thread():
    """numba.set_num_threads is thread-local: a backend used from an engine's worker thread
    applies its count there, and leaves the other threads' counts alone."""
    be = CpuBackend(threads=1)
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    numba.set_num_threads(POOL)
    seen = {}

    def worker():
        numba.set_num_threads(POOL)
        be.rmsnorm(x, w, 1e-5)
        seen["worker"] = numba.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == 1
    assert numba.get_num_threads() == POOL           # this thread's count is its own
    be.linear(x, np.ones((3, 8), np.float32))
    assert numba.get_num_threads() == 1
    numba.set_num_threads(POOL)


def test_from_pretrained_takes_threads(tiny_ckpt):
    from mtpkern import MultiModuleMtpHead

    assert MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="cpu", threads=1).backend.threads == 1
    with pytest.raises(ValueError, match="threads: only the cpu backend"):
        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", threads=1)
