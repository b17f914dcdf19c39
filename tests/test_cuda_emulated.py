"""The CUDA backend's real kernels (kernels/*.cu) on the CPU, through the emulator in
tests/cuda_emu/ (g++ against a CUDA shim; every GPU thread a fiber; docs/cuda.md,
"Emulated kernels on the CPU").

- the emulator itself: collectives, barriers and shared memory behave as in CUDA, and
  each check it claims fires (deadlock, divergent collective, misaligned vector load,
  UBSan bounds / overflow, shared memory limit, launch argument types);
- every op test of tests/test_ops_backends.py against the emulated ``CudaBackend``
  (tests that touch the KV cache with BF16 and FP32 KV, the others once);
- odd and large shapes: misaligned views (scalar paths), every split-K width of the
  GEMV kernels, split-KV attention, routers up to 1024 experts with exact ties and NaN
  scores, expert weights and KV caches past 2^31 elements (64-bit offsets);
- every kernel instantiation launched, with bit-identical results whatever the order
  of blocks and threads (no race the order can expose, deterministic reductions);
- the proposer on the emulated backend with CUDA graphs on (captures and replays through
  the fake CUDA runtime of tests/test_cuda_graph_fake.py): hypothesis' random call
  sequences of tests/test_backend_parity.py against the reference, tests/test_gpu.py's two checks,
  against the NumPy reference in both KV dtypes, and replays against eager bit for bit;
  the tiny config in both KV modes, the mid-size one in draft mode with BF16 KV by default.

Skipped, with the reason, where the emulator cannot be built (no g++, not x86-64
Linux). ``MTPKERN_CUDA_EMU_ASAN=1`` (``tests/cuda_emu/run.sh --asan``) builds with
ASan + UBSan; ``MTPKERN_CUDA_EMU_ORDER=reverse|shuffle`` changes the block and thread
order; ``MTPKERN_CUDA_EMU_CONTRACT=1`` (``run.sh --contract``) contracts multiply-adds into
FMAs as NVRTC does (no test here depends on it: docs/cuda.md, "Floating-point contraction"). The mid-size proposer runs are ``slow`` (``pytest -m slow tests/test_cuda_emulated.py``).
"""

from __future__ import annotations

import dataclasses
import inspect

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
import test_backend_parity
import test_blocks
import test_family_mimo_v2_flash as mimo_v2
import test_family_qwen3_next as qwen3_next
import test_family_step3p5 as step3p5
import test_gpu
import test_ops_backends
import test_ops_mla
import test_planned_step
import test_v4_attention
from cuda_emu import emu_backend
from test_cuda_graph_fake import FakeRuntime
from conftest import kv_rows

from mtpkern import Fp8Weight, cuda_graph
from mtpkern.quant import Fp4Weight
from mtpkern.backends import get_backend
from mtpkern.backends.cuda_launch import gemm_tc as gemm_tc_launch
from mtpkern.backends.cuda_launch import linear as linear_launch
from mtpkern.backends.cuda_launch import lm_head as lm_launch
from mtpkern.backends.cuda_launch import loader
from mtpkern.backends.cuda_launch._util import CudaFp8
from mtpkern.backends.cuda_launch import step as step_launch
from mtpkern.config import tiny_config
from mtpkern.errors import NoAllowedToken
from mtpkern.ops.lm_head import bitmask_allowed, masked_argmax
from mtpkern.ops.mlp import swiglu_act, swiglu_limit
from mtpkern.ops.moe import RouterSpec
from mtpkern.ops.rope_kv import inv_freq
from mtpkern.ops import sampling
from mtpkern.ops.sampling import SamplingParams, row_keys
from mtpkern.tolerance import assert_close

REF = get_backend("numpy")
BF16 = ml_dtypes.bfloat16
KV_DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def emu():
    """The emulator, built once (cached across runs), routing the cuda launchers for this module."""
    yield from emu_backend.installed_emulator()


@pytest.fixture(scope="module")
def be(request, emu):
    return emu_backend.backend(request.param)


def _touches_kv(fn) -> bool:
    """Whether a test reads or writes a KV cache (its source names one, or an op that does)."""
    src = inspect.getsource(inspect.unwrap(fn))
    return any(w in src for w in ("kv", "paged_attention", "qk_norm_rope"))


def pytest_generate_tests(metafunc):
    """``be``: BF16 and FP32 KV for tests that touch the KV cache, BF16 KV for the others."""
    if "be" in metafunc.fixturenames:
        kvs = KV_DTYPES if _touches_kv(metafunc.function) else KV_DTYPES[:1]
        metafunc.parametrize("be", kvs, indirect=True, scope="module", ids=[f"kv_{k}" for k in kvs])


@pytest.fixture
def sm_count(emu):
    """Set the SM count the launchers plan for (split-K widths, attention partitions)."""
    def set_count(n: int):
        emu.sm_count = n
    yield set_count
    emu.sm_count = emu_backend.DEFAULT_SM_COUNT


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def misaligned(a):
    """The same values at an address 4 bytes past a 16-byte boundary (the scalar paths);
    for an FP8 weight, its codes."""
    if isinstance(a, CudaFp8):
        return CudaFp8(misaligned(a.data), a.scale, a.bn, a.bk)
    flat = np.empty(a.size + 16, a.dtype)
    start = (-flat.ctypes.data % 16) // a.itemsize + 4 // a.itemsize
    v = flat[start: start + a.size].reshape(a.shape)
    v[...] = a
    assert v.ctypes.data % 16 == 4
    return v


def stored(w, wd: str, block=(128, 128)):
    """FP32 ``w`` as the weight kind ``wd`` (bf16, f32, fp8: block scales, fp8c: per-channel,
    fp4: E2M1 with E8M0 scales per 32, nvfp4: E2M1 with E4M3 scales per 16 and row scales that
    differ row to row and are no powers of two), and its values as the reference sees them (FP32)."""
    if wd == "bf16":
        return w.astype(BF16), np.asarray(w.astype(BF16), np.float32)
    if wd == "fp4":
        q = Fp4Weight.quantize(w)
        return q, q.dequantize()
    if wd == "nvfp4":
        q = Fp4Weight.quantize(w, "nvfp4")
        rows = np.arange(q.global_scale.size, dtype=np.float32).reshape(q.global_scale.shape)
        q = Fp4Weight(q.data, q.scale, q.global_scale * (np.float32(0.8123457) + rows % 5 / np.float32(7)))
        return q, q.dequantize()
    if wd in ("fp8", "fp8c"):
        q = Fp8Weight.quantize(w, block if wd == "fp8" else None)
        return q, q.dequantize()
    return w, w


# -- the emulator itself ---------------------------------------------------------------------

def test_emulator_collectives_barriers_and_blocks(emu):
    out = np.zeros((2 * 3, 4, 128), np.int32)
    emu.selftest_kernel("collectives")((2, 3), (128,), (out, np.int32(77)))
    t = np.arange(128)
    np.testing.assert_array_equal(out[:, 0], np.broadcast_to(t // 32 * 1024 + 496, (6, 128)))   # warp sums
    bits = (t % 3 == 0).reshape(4, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    ballots = np.repeat(bits.sum(axis=1).astype(np.uint32).view(np.int32), 32)
    np.testing.assert_array_equal(out[:, 1], np.broadcast_to(ballots, (6, 128)))
    assert (out[:, 2] == 1).all()                                # __syncthreads_or: thread 77 says yes
    np.testing.assert_array_equal(out[:, 3, 0], np.arange(6))    # blockIdx / gridDim of a 2-D grid
    small = np.zeros((4, 64), np.int32)
    emu.selftest_kernel("collectives")((1,), (64,), (small, np.int32(99)))
    assert (small[2] == 0).all()                                 # nobody says yes


def test_emulator_atomics_run_the_last_block_pattern(emu):
    """atomicInc tickets: whichever block runs last (the grid's last in forward order, its
    first in reverse, any when shuffled) combines the partials, in block order, so the sum is
    the same bits in every order; the counter is back at 0 for the next launch."""
    rng = np.random.default_rng(5)
    blocks, per = 7, 5
    x = rng.standard_normal(blocks * per).astype(np.float32)
    sums, lasts = set(), []
    try:
        for order, seed in (("forward", 1), ("reverse", 1), ("shuffle", 3), ("shuffle", 4)):
            emu.set_order(order, seed)
            partial, ticket, out = np.zeros(blocks, np.float32), np.zeros(1, np.uint32), np.zeros(2, np.float32)
            for _ in range(2):                                    # a second launch on the same counter
                emu.selftest_kernel("last_block")((blocks,), (64,), (x, np.int32(per), partial, ticket, out))
                assert ticket[0] == 0
            sums.add(out[0].tobytes())
            lasts.append(int(out[1]))
    finally:
        emu.set_order(*emu_backend.order_from_env())
    assert len(sums) == 1
    np.testing.assert_allclose(np.frombuffer(sums.pop(), np.float32)[0], x.astype(np.float64).sum(), rtol=1e-5)
    assert lasts[:2] == [blocks - 1, 0]


def test_emulator_unwritten_shared_memory_reads_nan(emu):
    out = np.zeros(2, np.float32)
    emu.selftest_kernel("shared_unwritten")((2,), (64,), (out,), shared_mem=64)
    assert np.isnan(out).all()


def test_emulator_orders_expose_a_write_race(emu):
    got = {}
    for order in ("forward", "reverse", "shuffle"):
        emu.set_order(order, 3)
        out = np.zeros(1, np.int32)
        emu.selftest_kernel("racy_store")((1,), (128,), (out,))
        got[order] = int(out[0])
    emu.set_order(*emu_backend.order_from_env())
    assert got["forward"] == 127 and got["reverse"] == 0, got


def test_emulator_shared_memory_opt_in(emu):
    """Over 48 KiB of dynamic shared memory needs the kernel's opt-in attribute (as
    CuPy's RawKernel.max_dynamic_shared_size_bytes), up to the device's opt-in limit."""
    out = np.zeros(1, np.float32)
    k = emu.selftest_kernel("big_shared")                  # 40 KiB static
    with pytest.raises(emu_backend.EmulatorError, match="over 48 KiB"):
        k((1,), (128,), (out,), shared_mem=16384)
    with pytest.raises(emu_backend.EmulatorError, match="over the kernel's 49152"):
        k((1,), (128,), (out,), shared_mem=64 * 1024)
    k.max_dynamic_shared_size_bytes = 64 * 1024
    k((1,), (128,), (out,), shared_mem=64 * 1024)
    assert out[0] == 1.0
    k.max_dynamic_shared_size_bytes = emu.smem_optin + 1
    with pytest.raises(emu_backend.EmulatorError, match="over the device's opt-in limit"):
        k((1,), (128,), (out,), shared_mem=16384)


def test_emulator_contraction_mode(emu):
    """The default build rounds a * b + c twice (-ffp-contract=off); the contraction build
    (MTPKERN_CUDA_EMU_CONTRACT=1, tests/cuda_emu/run.sh --contract) fuses it into one
    rounding, as NVRTC does. a * a = 1 + 2^-11 + 2^-24 rounds (a tie, to even) to
    1 + 2^-11, so the two differ by 2^-24."""
    a = np.array([1 + 2.0**-12], np.float32)
    out = np.zeros(1, np.float32)
    emu.selftest_kernel("mul_add")((1,), (32,), (a, a, np.array([-1.0], np.float32), out))
    want = 2.0**-11 + 2.0**-24 if emu.contract else 2.0**-11
    assert float(out[0]) == want, (emu.contract, float(out[0]))


def test_contraction_needs_fma():
    assert emu_backend.cpu_has_fma("processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2\n")
    assert not emu_backend.cpu_has_fma("processor\t: 0\nflags\t\t: fpu sse2 avx fma4\n")
    kernels, runtime, _ = emu_backend.compile_flags(asan=False, contract=False)
    assert "-ffp-contract=off" in kernels and "-mfma" not in kernels
    if not emu_backend.cpu_has_fma():
        with pytest.raises(emu_backend.EmulatorUnavailable, match="cannot be emulated faithfully"):
            emu_backend.compile_flags(asan=False, contract=True)
        return
    kernels, runtime, _ = emu_backend.compile_flags(asan=False, contract=True)
    assert {"-ffp-contract=fast", "-mfma"} <= set(kernels) and "-ffp-contract=off" not in kernels
    assert "-ffp-contract=off" in runtime


@pytest.mark.parametrize("name,args,smem,match", [
    pytest.param("partial_warp_shuffle", lambda: (np.zeros(128, np.float32),), 0,
                 r"deadlock.*\n  warp 0: lanes 0-15 warp collective, lanes 16-31 exited", id="shuffle_with_exited_lanes"),
    pytest.param("partial_warp_mma", lambda: (np.zeros(128, np.float32),), 0,
                 r"deadlock.*\n  warp 0: lanes 0-15 warp collective, lanes 16-31 exited", id="mma_with_exited_lanes"),
    pytest.param("barrier_vs_shuffle", lambda: (np.zeros(128, np.float32),), 0, "deadlock",
                 id="barrier_against_shuffle"),
    pytest.param("mixed_collectives", lambda: (np.zeros(128, np.int32),), 0, "different warp collectives",
                 id="shuffle_against_ballot"),
    pytest.param("vector_load", lambda: (np.zeros(16, np.float32), np.int32(1), np.zeros(1, np.float32)), 0,
                 r"thread \d+: misaligned __ldg\(float4\)", id="misaligned_vector_load"),
    pytest.param("big_shared", lambda: (np.zeros(1, np.float32),), 16384, "over 48 KiB", id="shared_memory_limit"),
    pytest.param("vector_load", lambda: (np.zeros(16, np.float32), np.int32(1)), 0, "2 arguments for 3 parameters",
                 id="argument_count"),
    pytest.param("vector_load", lambda: (np.zeros(16, np.float64), np.int32(0), np.zeros(1, np.float32)), 0,
                 "a float64 array for a float32 pointer", id="pointer_element_type"),
    pytest.param("vector_load", lambda: (np.zeros(16, np.float32), 0, np.zeros(1, np.float32)), 0,
                 "int for a int32 parameter", id="scalar_type"),
])
def test_emulator_checks_fire(emu, name, args, smem, match):
    with pytest.raises(emu_backend.EmulatorError, match=match):
        emu.selftest_kernel(name)((1,), (128,), args(), shared_mem=smem)
    ok = {"vector_load": (np.zeros(16, np.float32), np.int32(4), np.zeros(1, np.float32)),
          "big_shared": (np.zeros(1, np.float32),)}
    if name in ok:                                          # the same kernel within the rules runs
        emu.selftest_kernel(name)((1,), (128,), ok[name])


@pytest.mark.parametrize("name,args,match", [
    pytest.param("local_index", lambda: (np.int32(4), np.zeros(1, np.float32)),
                 r"UBSan: index 4 out of bounds of 'float \[4\]' at selftest.cu:\d+", id="bounds"),
    pytest.param("int_product", lambda: (np.int32(65536), np.int32(65536), np.zeros(1, np.int64)),
                 r"UBSan: signed integer overflow: 65536 \* 65536", id="int32_overflow"),
])
def test_emulator_ubsan_checks(emu, name, args, match):
    if emu.asan:
        pytest.skip("the ASan build reports through the sanitizer runtime (and aborts)")
    with pytest.raises(emu_backend.EmulatorError, match=match):
        emu.selftest_kernel(name)((1,), (32,), args())


# -- tensor cores: kernels/mma.cuh's fragment layout ------------------------------------------------

def test_mma_fragment_layout(emu):
    """kernels/mma.cu's probe on the emulator: A [16 x 16] and B [16 x 8] BF16 loaded into
    fragments by mma.cuh's loaders (B from both storage orders), one mma, D stored by the
    accumulator layout, against A B + C in float64; each deliberately wrong layout of the
    probe (A transposed, a[1] / a[2] or b[0] / b[1] exchanged, D's row halves exchanged) is
    caught. The emulated mma rebuilds A and B from its own copy of the PTX ISA's layout, so
    this checks the loaders against it; tests/test_gpu.py runs the same probe on a device."""
    probe = emu.kernel("mma", "mma_bf16_probe_kernel")

    def run(layout, args):
        d = np.full((2, 16, 8), np.nan, np.float32)
        probe((1,), (32,), (*args, d, np.int32(layout)))
        return d

    test_gpu.check_mma_probe(run)


# -- tests/test_ops_backends.py on the emulated backend -----------------------------------------

def _is_fixture(obj) -> bool:
    return type(obj).__name__ == "FixtureFunctionDefinition" or hasattr(obj, "_pytestfixturefunction")


def _takes_be(name: str, obj) -> bool:
    return name.startswith("test_") and callable(obj) and "be" in inspect.signature(obj).parameters


# every test that takes `be`, and the module's other fixtures (if any) that they may use
for _name, _obj in vars(test_ops_backends).items():
    if _takes_be(_name, _obj) or (_is_fixture(_obj) and _name != "be"):
        globals()[_name] = _obj
del _name, _obj


# -- odd and large shapes ------------------------------------------------------------------------

def _filled_caches(be, rng, NB, BS, Hkv, D, Dv=None):
    n, Dv = NB * BS, D if Dv is None else Dv
    k, v = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, Dv)
    be.qk_norm_rope_kv_write(rnd(rng, n, 2 * Hkv * D + Hkv * Dv), Hkv, Hkv, None, None, 1e-6, inv_freq(2, 1e4),
                             np.zeros(n, np.int32), k, v, np.arange(n, dtype=np.int32))
    return k, v


@pytest.mark.parametrize("Hq,Hkv,D,BS,max_blocks", [
    (12, 1, 128, 16, 40), (64, 1, 128, 16, 9), (32, 2, 256, 16, 20), (6, 3, 100, 5, 30),
    (5, 5, 19, 3, 50), (16, 2, 64, 7, 33), (40, 4, 96, 16, 8), (20, 1, 72, 4, 64)])
def test_attention_shapes(be, Hq, Hkv, D, BS, max_blocks):
    """GQA groups up to 64, head dims 19..256 (every DC), partitions split and merged."""
    rng = np.random.default_rng(Hq * 1000 + D)
    S = 3
    NB = S * max_blocks + 2
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = rng.permutation(NB)[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    cap = max_blocks * BS
    row_seq = np.array([0, 1, 1, 2, 2, 0, 1], np.int32)
    row_len = np.array([1, cap, cap - 1, 2, BS + 1, 513 if cap >= 513 else cap // 2 + 1, 129 % cap + 1], np.int32)
    q = rnd(rng, row_seq.size, Hq, D)
    got = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5)
    assert_close(got, want, "float32", "paged_attention")


@pytest.mark.parametrize("Hq,Hkv,D,Dv,rows", [(12, 1, 128, 128, 1), (8, 1, 64, 64, 3), (16, 2, 32, 48, 2)])
def test_attention_tc_keeps_fp32_accuracy(Hq, Hkv, D, Dv, rows):
    """The tensor-core kernel (BF16 cache) splits q into three BF16 parts and P into two, so it
    holds the float32 tolerance where rounding either operand to BF16 would not: peaked
    softmaxes (|q| ~ 40, scores in the hundreds), checked against float64. The same data with
    q or P rounded to BF16 (computed here in float64) is shown to miss that tolerance, so the
    test can tell a kernel that drops a part."""
    from mtpkern.backends.cuda_launch import attention as attn_launch

    be = emu_backend.backend("bfloat16")
    rng = np.random.default_rng(D + Dv + rows)
    BS, max_blocks = 16, 6
    NB = max_blocks
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D, Dv)
    tables = rng.permutation(NB).reshape(1, max_blocks).astype(np.int32)
    row_seq = np.zeros(rows, np.int32)
    row_len = (max_blocks * BS - np.arange(rows)[::-1] * 7).astype(np.int32)
    q = rnd(rng, rows, Hq, D, scale=40.0)
    scale = D ** -0.5
    p = attn_launch.plan(Hq // Hkv, D, max_blocks * BS, work=Hkv, target_blocks=2, rows=rows, Dv=Dv,
                         smem_max=227 * 1024)
    assert p.variant == "tc", p
    got = be.to_host(be.paged_attention(q, k, v, tables, row_seq, row_len, scale))
    K, V = be.kv_to_host(k), be.kv_to_host(v)
    want = REF.paged_attention(q, K, V, tables, row_seq, row_len, scale)
    assert_close(got, want, "float32", "paged_attention, tensor cores")

    def brute(qq, round_p):                       # float64 attention, P optionally rounded to BF16
        out = np.zeros((rows, Hq * Dv))
        for r in range(rows):
            slots = (tables[0, np.arange(row_len[r]) // BS] * BS + np.arange(row_len[r]) % BS)
            for hq in range(Hq):
                kk = K.reshape(-1, Hkv, D)[slots, hq // (Hq // Hkv)].astype(np.float64)
                vv = V.reshape(-1, Hkv, Dv)[slots, hq // (Hq // Hkv)].astype(np.float64)
                s = kk @ np.asarray(qq[r, hq], np.float64) * scale
                e = np.exp(s - s.max())
                pe = e.astype(np.float32).astype(BF16).astype(np.float64) if round_p else e
                out[r, hq * Dv:(hq + 1) * Dv] = pe @ vv / e.sum()
        return out

    q_bf16 = (q * np.float32(scale)).astype(BF16).astype(np.float32) / np.float32(scale)
    for what, other in (("q", brute(q_bf16, False)), ("P", brute(q, True))):
        with pytest.raises(AssertionError):
            assert_close(other, want, "float32", f"{what} rounded to BF16")


def test_attention_under_other_plans(be):
    """The launcher's ``attention_plan=`` (benchmarks/gpu_bench.py's sweep): part sizes from 64
    to the whole context (one partition, no merge), the other ring depth and, over a BF16
    cache, the scalar kernel instead of the tensor-core one, all equal to the reference; a
    plan whose partitions miss rows, or too little shared memory, is refused."""
    import dataclasses

    from mtpkern.backends.cuda_launch import attention as attn_launch

    rng = np.random.default_rng(21)
    Hq, Hkv, D, BS, S, max_blocks = 12, 2, 32, 16, 2, 20
    NB = S * max_blocks
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = rng.permutation(NB).reshape(S, max_blocks).astype(np.int32)
    cap = max_blocks * BS
    row_seq, row_len = np.array([0, 1], np.int32), np.array([cap, cap - 37], np.int32)
    q = rnd(rng, 2, Hq, D)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5)
    isz = np.dtype(be.kv_dtype).itemsize                   # 2: BF16 stored as uint16; 4: FP32
    base = attn_launch.plan(Hq // Hkv, D, cap, work=2 * Hkv, target_blocks=264, rows=2, kv_itemsize=isz)
    plans = [dataclasses.replace(base, part_size=ps, num_parts=-(-cap // ps)) for ps in (64, 128, 512, cap)]
    other = 5 - base.stages
    plans.append(dataclasses.replace(base, stages=other, smem_bytes=attn_launch.smem_bytes(
        D, D, base.dc, base.heads, base.rows, other, isz, base.variant)))
    assert base.variant == ("tc" if isz == 2 else "scalar"), base
    if base.variant == "tc":                               # the FP32-FMA kernel over the same BF16 cache
        plans.append(dataclasses.replace(base, variant="scalar", smem_bytes=attn_launch.smem_bytes(
            D, D, base.dc, base.heads, base.rows, base.stages, isz, "scalar")))
    for p in plans:
        got = attn_launch.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, attention_plan=p)
        assert_close(be.to_host(got), want, "float32", f"paged_attention under {p}")
    bad = dataclasses.replace(base, part_size=64, num_parts=-(-cap // 64) - 1)
    with pytest.raises(ValueError, match=r"attention_plan: expected num_parts = ceil\(320 / 64\) = 5"):
        attn_launch.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, attention_plan=bad)
    small = dataclasses.replace(base, smem_bytes=base.smem_bytes - 16)
    with pytest.raises(ValueError, match=r"attention_plan: expected smem_bytes >= \d+"):
        attn_launch.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, attention_plan=small)


@pytest.mark.parametrize("budget_rows", [1, 3, 7])
def test_attention_rows_in_workspace_groups(be, sm_count, monkeypatch, budget_rows):
    """Without caller workspaces the launcher bounds part_o / part_ml to WORKSPACE_BYTES
    by running the rows in groups (a long prefill chunk would otherwise allocate GBs):
    the result is the reference's whatever the group size, the last group short."""
    from mtpkern.backends.cuda_launch import attention as attention_launch
    Hq, Hkv, D, BS, max_blocks = 8, 2, 32, 16, 40                            # 640 rows: 2+ partitions
    sm_count(1)
    p = attention_launch.plan(Hq // Hkv, D, max_blocks * BS, work=7 * Hkv, target_blocks=2)   # the launcher's plan
    assert p.num_parts == 2
    monkeypatch.setattr(attention_launch, "WORKSPACE_BYTES", budget_rows * Hq * p.num_parts * (D + 2) * 4)
    rng = np.random.default_rng(budget_rows)
    NB = 2 * max_blocks
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = rng.permutation(NB).reshape(2, max_blocks).astype(np.int32)
    row_seq = np.array([0, 1, 1, 0, 1, 0, 0], np.int32)
    row_len = np.array([640, 1, 513, 17, 600, 2, 639], np.int32)
    q = rnd(rng, 7, Hq, D)
    got = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5)
    assert_close(got, want, "float32", "paged_attention (row groups)")


def test_attention_group_past_48_kib_opts_in(be, emu, monkeypatch):
    """96 query heads of 128 sharing one KV head: queries and scores need ~58 KB of shared
    memory at the smallest partition, so the launcher raises the kernel's dynamic shared
    memory attribute (the device allows 227 KiB); with a 48 KiB device it refuses."""
    from mtpkern.backends.cuda_launch import attention as attention_launch
    Hq, Hkv, D, BS, max_blocks = 96, 1, 128, 16, 12
    p = attention_launch.plan(Hq // Hkv, D, max_blocks * BS, work=2, target_blocks=264, smem_max=227 * 1024)
    assert p.smem_bytes > attention_launch.SMEM_LIMIT
    rng = np.random.default_rng(96)
    NB = max_blocks + 1
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = rng.permutation(NB)[:max_blocks].reshape(1, max_blocks).astype(np.int32)
    row_seq, row_len = np.zeros(2, np.int32), np.array([max_blocks * BS, 70], np.int32)
    q = rnd(rng, 2, Hq, D)
    got = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5)
    assert_close(got, want, "float32", "paged_attention (opt-in shared memory)")
    monkeypatch.setattr(emu, "smem_optin", 48 * 1024)
    with pytest.raises(ValueError, match=r"96 query heads per KV head x head dim 128 need \d+ B of shared memory, "
                                         r"over this device's 49152"):
        be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5)


def test_attention_empty_row_gives_zeros(be):
    """row_len 0 is a documented precondition violation: zeros, never NaN or a stray read."""
    rng = np.random.default_rng(1)
    k, v = _filled_caches(be, rng, 8, 4, 2, 16)
    tables = np.arange(8, dtype=np.int32).reshape(1, 8)
    got = be.paged_attention(rnd(rng, 2, 4, 16), k, v, tables, np.zeros(2, np.int32), np.array([0, 3], np.int32),
                             0.25)
    assert not got[0].any() and np.isfinite(got).all()


def _window_rows(rng, S, cap, n):
    """Rows of S sequences: lengths up to cap (the first row of each the longest), windows of
    1 row, 3, 64, 200 rows and one past the context -> (row_seq, row_len, row_start)."""
    row_seq = (np.arange(n) % S).astype(np.int32)
    row_len = rng.integers(1, cap + 1, n).astype(np.int32)
    row_len[:S] = cap
    window = np.resize(np.array([1, 3, 64, 200, cap + 7]), n)
    return row_seq, row_len, np.maximum(0, row_len - window).astype(np.int32)


@pytest.mark.parametrize("Hq,Hkv,D,Dv,BS,max_blocks", [
    (8, 1, 192, 128, 16, 40), (16, 2, 256, 256, 16, 12), (6, 3, 19, 72, 5, 30), (24, 4, 128, 64, 7, 33),
    (4, 4, 64, 17, 16, 20)])
@pytest.mark.parametrize("sms", [1, 132])
def test_attention_window_sinks_shapes(be, sm_count, Hq, Hkv, D, Dv, BS, max_blocks, sms):
    """Windows and sinks with head dims 19..256, value head dims of their own (DC chosen by
    Dv: 2, 4, 8), GQA groups up to 16: split into partitions from each row's window (132
    SMs) and merged with the sink once, or in one partition (1 SM)."""
    sm_count(sms)
    rng = np.random.default_rng(Hq * 1000 + D + Dv)
    S = 3
    NB = S * max_blocks + 2
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D, Dv)
    tables = rng.permutation(NB)[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    row_seq, row_len, row_start = _window_rows(rng, S, max_blocks * BS, 9)
    sinks = np.resize(np.array([8.0, -30.0, 0.5], np.float32), Hq)
    q = rnd(rng, row_seq.size, Hq, D)
    for kw in ({"row_start": row_start}, {"sinks": sinks}, {"row_start": row_start, "sinks": sinks}):
        got = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, **kw)
        want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5, **kw)
        assert_close(got, want, "float32", f"paged_attention {sorted(kw)}")


@pytest.mark.parametrize("budget_rows", [1, 3, 0])
def test_attention_window_sinks_workspaces(be, sm_count, monkeypatch, budget_rows):
    """The split-KV workspaces with Dv != D: the launcher's own row groups (row_start sliced
    with its rows; 0: one group) and the caller's part_o [n, Hq, P, Dv] / part_ml [n, Hq, P, 2],
    as a planned step passes them, with out= too."""
    from mtpkern.backends.cuda_launch import attention as attention_launch
    Hq, Hkv, D, Dv, BS, max_blocks, n = 8, 2, 48, 24, 16, 40, 7
    sm_count(1)
    p = attention_launch.plan(Hq // Hkv, D, max_blocks * BS, work=n * Hkv, target_blocks=2, Dv=Dv)
    assert p.num_parts == 2
    if budget_rows:
        monkeypatch.setattr(attention_launch, "WORKSPACE_BYTES", budget_rows * Hq * p.num_parts * (Dv + 2) * 4)
    rng = np.random.default_rng(budget_rows + 40)
    NB = 2 * max_blocks
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D, Dv)
    tables = rng.permutation(NB).reshape(2, max_blocks).astype(np.int32)
    row_seq, row_len, row_start = _window_rows(rng, 2, max_blocks * BS, n)
    sinks = rnd(rng, Hq, scale=3.0)
    q = rnd(rng, n, Hq, D)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5,
                               row_start=row_start, sinks=sinks)
    got = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, row_start=row_start, sinks=sinks)
    assert_close(got, want, "float32", "paged_attention (launcher's workspaces)")
    out = np.zeros((n, Hq * Dv), np.float32)
    ws = {"part_o": np.zeros((n, Hq, p.num_parts, Dv), np.float32), "part_ml": np.zeros((n, Hq, p.num_parts, 2),
                                                                                          np.float32)}
    assert be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, row_start=row_start, sinks=sinks,
                              out=out, **ws) is out
    assert_close(out, want, "float32", "paged_attention (caller's workspaces)")
    with pytest.raises(ValueError, match=r"part_o: expected shape \[7, 8, 2, 24\]"):
        be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5, out=out,
                           part_o=np.zeros((n, Hq, p.num_parts, D), np.float32), part_ml=ws["part_ml"])


def test_attention_plan_runs_heads_stages():
    """The launch plan: query heads x rows of one sequence fill the block's 32 query vectors
    (16 for Dv > 128), a group past that is split over blocks, 3 pipeline stages when they fit
    (2 when not, then fewer rows), and partitions halved down to 64 rows to fill 264 blocks."""
    from mtpkern.backends.cuda_launch import attention as attention_launch
    plan = attention_launch.plan
    p = plan(4, 128, 4096, work=8, target_blocks=264, smem_max=227 * 1024)
    assert (p.dc, p.heads, p.rows, p.stages) == (4, 4, 8, 3)
    assert (p.part_size, p.num_parts) == (64, 64)                    # 8 x 32 blocks at 128: short of 264
    assert plan(4, 128, 2048, work=8, target_blocks=264).num_parts == 32   # 64 rows at least
    assert plan(4, 128, 32768, work=64, target_blocks=264).part_size == 512
    p = plan(12, 128, 512, work=3 * 8, target_blocks=264, smem_max=227 * 1024)
    assert (p.heads, p.rows) == (12, 2)
    p = plan(96, 128, 512, work=8, target_blocks=0, smem_max=227 * 1024)
    assert (p.heads, p.rows, p.part_size) == (32, 1, 512)
    p = plan(8, 256, 512, smem_max=227 * 1024, Dv=256)
    assert (p.dc, p.heads, p.rows) == (8, 8, 2)
    p = plan(4, 256, 512, smem_max=163 * 1024, Dv=256, kv_itemsize=4)   # an A100's opt-in limit
    assert p.stages == 2 and p.smem_bytes <= 163 * 1024
    assert plan(4, 128, 512, rows=3).rows == 3                          # the launcher passes rows=n
    assert plan(4, 128, 512, rows=1, smem_max=227 * 1024).smem_bytes < plan(4, 128, 512, smem_max=227 * 1024).smem_bytes


@pytest.mark.parametrize("sms", [1, 132])
def test_attention_prefill_chunk_in_runs(be, sm_count, sms):
    """A 70-row prefill chunk of one sequence (causal lengths 31..100) between rows of two
    others: the kernel cuts it into runs of plan.rows rows (8 here), each its own block, and
    every row gets the reference's result, in one partition (1 SM) or many (132); the same
    launch twice gives the same bits."""
    from mtpkern.backends.cuda_launch import attention as attention_launch
    sm_count(sms)
    Hq, Hkv, D, BS, max_blocks = 8, 2, 32, 8, 16
    rng = np.random.default_rng(70 + sms)
    NB = 3 * max_blocks
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = rng.permutation(NB).reshape(3, max_blocks).astype(np.int32)
    row_seq = np.array([1, 1] + [0] * 70 + [2], np.int32)
    row_len = np.array([5, 6] + list(range(31, 101)) + [128], np.int32)
    n = row_seq.size
    p = attention_launch.plan(Hq // Hkv, D, max_blocks * BS, work=n * Hkv, target_blocks=2 * sms, rows=n)
    assert p.rows == 8 and (p.num_parts > 1) == (sms > 1)
    q = rnd(rng, n, Hq, D)
    got = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5)
    assert_close(got, want, "float32", "paged_attention (prefill chunk in runs)")
    again = be.paged_attention(q, k, v, tables, row_seq, row_len, D ** -0.5)
    assert np.array_equal(got.view(np.uint32), again.view(np.uint32))


def test_attention_run_with_disjoint_windows(be, sm_count):
    """Two consecutive rows of one sequence whose windows do not meet (KV rows 0..9 and
    500..519): the block of their run reads only the rows one of them sees; the table entries
    of the blocks in between are far out of range (a read would fault)."""
    sm_count(1)                                                          # one partition: one block
    Hq, Hkv, D, BS, max_blocks = 4, 1, 16, 10, 60
    rng = np.random.default_rng(5)
    NB = max_blocks
    k, v = _filled_caches(be, rng, NB, BS, Hkv, D)
    tables = rng.permutation(NB).reshape(1, max_blocks).astype(np.int32)
    row_seq, row_len, row_start = np.zeros(2, np.int32), np.array([10, 520], np.int32), np.array([0, 500], np.int32)
    q = rnd(rng, 2, Hq, D)
    want = REF.paged_attention(q, be.kv_to_host(k), be.kv_to_host(v), tables, row_seq, row_len, D ** -0.5,
                               row_start=row_start)
    bad = tables.copy()
    bad[0, 1:50] = 1 << 28                                               # KV rows 10..499: never read
    bad[0, 52:] = 1 << 28
    got = be.paged_attention(q, k, v, bad, row_seq, row_len, D ** -0.5, row_start=row_start)
    assert_close(got, want, "float32", "paged_attention (disjoint windows in one run)")


# -- MLA (kernels/mla.cu): split-KV, DeepSeek-V3's shapes, workspaces ---------------------------

def _latent_cache(be, rng, NB, BS, W):
    """A latent cache of be's kv dtype holding random rows, and those rows in FP32."""
    vals = rnd(rng, NB, BS, W)
    lc = be.empty_latent_kv(NB, BS, W)
    lc[...] = vals.astype(BF16).view(np.uint16) if lc.dtype == np.uint16 else vals
    return lc, be.kv_to_host(lc)


def _mla_rows(rng, S, cap, n, window: bool):
    """n rows of S sequences, the first of each at capacity (decode rows of a long context),
    the others ragged; with ``window``, windows of 1, 37, 200 rows and one past the context."""
    row_seq = (np.arange(n) % S).astype(np.int32)
    row_len = rng.integers(1, cap + 1, n).astype(np.int32)
    row_len[:S] = cap
    row_start = None
    if window:
        w = np.resize(np.array([200, 1, 37, cap + 9]), n)
        row_start = np.maximum(0, row_len - w).astype(np.int32)
    return row_seq, row_len, row_start


def _mla_case(be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, window, wd="bf16"):
    S = 2
    NB = S * max_blocks + 3
    lc, host = _latent_cache(be, rng, NB, BS, L + R)
    tables = rng.permutation(NB)[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    row_seq, row_len, row_start = _mla_rows(rng, S, max_blocks * BS, n, window)
    if window:                                  # blocks wholly before every window of a sequence: freed
        for s in range(S):
            tables[s, : min(int(row_start[r]) // BS for r in range(n) if row_seq[r] == s)] = -1
    q = rnd(rng, n, Hq, P + R)
    w_uk, w_uk32 = stored(rnd(rng, Hq, P, L, scale=P ** -0.5), wd)
    w_uv, w_uv32 = stored(rnd(rng, Hq, Dv, L, scale=L ** -0.5), wd)
    args = (q, be.prepare_weight(w_uk), be.prepare_weight(w_uv), lc, tables, row_seq, row_len, (P + R) ** -0.5)
    want = REF.mla_attention_absorbed(q, w_uk32, w_uv32, host, tables, row_seq, row_len, (P + R) ** -0.5,
                                      row_start=row_start)
    return args, row_start, want


@pytest.mark.parametrize("Hq,P,R,L,Dv,BS,max_blocks", [
    (5, 16, 16, 100, 24, 16, 40),      # 640 rows, W = 116: scalar staging
    (20, 24, 32, 300, 40, 5, 90),      # two tiles of 10 heads, L > 256 (LPT 2), W = 332
    (16, 32, 64, 512, 32, 7, 60),      # L 512, W 576: 16-byte staging, BS 7
    (1, 8, 8, 33, 12, 1, 300)])        # one head, one row per block
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("sms", [1, 132])
def test_mla_split_kv_shapes(be, sm_count, Hq, P, R, L, Dv, BS, max_blocks, window, sms):
    """Contexts of 300..640 latent rows split into partitions (132 SMs: from each row's window,
    merged by attention.cu's merge kernel with Dv = L) or walked by one block (1 SM: tiles
    with the online softmax rescaling); windows whose blocks before them are -1 in the table."""
    from mtpkern.backends.cuda_launch import mla as mla_launch
    sm_count(sms)
    n = 5
    rng = np.random.default_rng(Hq * 1000 + L + BS)
    p = mla_launch.plan(Hq, L, R, max_blocks * BS, n, target_blocks=2 * sms, smem_max=227 * 1024)
    assert (p.num_parts > 1) == (sms == 132), p
    args, row_start, want = _mla_case(be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, window)
    got = be.mla_attention_absorbed(*args, row_start=row_start)
    tol = test_ops_mla.attention_tol(be, Hq, L, R, max_blocks * BS)      # Hq 16, BF16: tensor cores
    assert_close(got, want, tol, f"mla_attention_absorbed ({p.num_parts} partitions, {tol} tolerance)")


@pytest.mark.parametrize("wd", ["bf16", "f32"])
def test_mla_deepseek_v3_shapes(be, emu, wd):
    """DeepSeek-V3's MLA (Hq 128, P 128, R 64, L 512, Dv 128) at ~300 rows of context: a decode
    row at capacity and a shorter one, split over partitions as on a 132-SM device; on tensor
    cores with a BF16 cache (BF16's tolerance: test_ops_mla.attention_tol), FP32 FMAs with FP32."""
    from mtpkern.backends.cuda_launch import mla as mla_launch
    Hq, P, R, L, Dv, BS, max_blocks = 128, 128, 64, 512, 128, 16, 19      # 304 rows
    kv_itemsize = np.dtype(be.kv_dtype).itemsize
    p = mla_launch.plan(Hq, L, R, max_blocks * BS, 2, target_blocks=2 * emu_backend.DEFAULT_SM_COUNT,
                        smem_max=emu_backend.DEFAULT_SMEM_OPTIN, kv_itemsize=kv_itemsize)
    assert p.heads == 16 and p.num_parts == 3 and p.lpt == 2, p
    assert p.variant == ("tc" if kv_itemsize == 2 else "scalar"), p
    rng = np.random.default_rng(3)
    args, _, want = _mla_case(be, rng, Hq, P, R, L, Dv, BS, max_blocks, 2, False, wd)
    before = emu.launches.copy()
    got = be.mla_attention_absorbed(*args)
    kernel = ("mla_attention_tc_kernel<2>" if p.variant == "tc"
              else f"mla_attention_kernel<{loader.CTYPE[np.dtype(be.kv_dtype).name]}, 2>")
    assert (emu.launches - before)[kernel] == 1, emu.launches - before
    tol = test_ops_mla.attention_tol(be, Hq, L, R, max_blocks * BS)
    assert_close(got, want, tol, f"mla_attention_absorbed (DeepSeek-V3 shapes, {p.variant} kernel)")


def test_mla_workspaces_given_allocate_nothing(be, sm_count, monkeypatch):
    """The planned step's call: out and every workspace given (sized by plan + workspace_shapes,
    as workspace_floats counts them): the launcher allocates nothing and writes into them;
    a workspace of the wrong shape is refused by name."""
    from mtpkern.backends.cuda_launch import mla as mla_launch
    Hq, P, R, L, Dv, BS, max_blocks, n = 12, 16, 16, 64, 24, 16, 32, 3
    sm_count(4)
    rng = np.random.default_rng(11)
    args, row_start, want = _mla_case(be, rng, Hq, P, R, L, Dv, BS, max_blocks, n, True)
    p = mla_launch.plan(Hq, L, R, max_blocks * BS, n, target_blocks=8, smem_max=emu_backend.DEFAULT_SMEM_OPTIN,
                        kv_itemsize=np.dtype(be.kv_dtype).itemsize)
    assert p.num_parts > 1
    shapes = mla_launch.workspace_shapes(n, Hq, L, R, p.num_parts)
    assert set(shapes) == {"q_full", "o_lat", "part_o", "part_ml"}
    assert mla_launch.workspace_floats(n, Hq, L, R, max_blocks * BS, target_blocks=8,
                                       smem_max=emu_backend.DEFAULT_SMEM_OPTIN) == sum(
        int(np.prod(s)) for s in shapes.values())
    ws = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    out = np.zeros((n, Hq * Dv), np.float32)
    real_output = mla_launch.output

    def no_alloc(buf, name, shape, dtype):
        assert buf is not None, f"{name}: allocated by the launcher"
        return real_output(buf, name, shape, dtype)

    monkeypatch.setattr(mla_launch, "output", no_alloc)
    assert be.mla_attention_absorbed(*args, row_start=row_start, out=out, **ws) is out
    assert_close(out, want, "float32", "mla_attention_absorbed (caller's workspaces)")
    q = args[0]
    np.testing.assert_array_equal(ws["q_full"][..., L:], q[..., P:])           # q_pe rides along
    w_uv = args[2].view(BF16).astype(np.float32) if args[2].dtype == np.uint16 else args[2]
    assert_close(out.reshape(n, Hq, Dv), np.einsum("rhl,hvl->rhv", ws["o_lat"], w_uv), "float32",
                 "out = w_uv o_lat (o_lat the merged latent output)")
    with pytest.raises(ValueError, match=rf"part_o: expected shape \[{n}, {Hq}, {p.num_parts}, {L}\]"):
        be.mla_attention_absorbed(*args, row_start=row_start, out=out,
                                  **{**ws, "part_o": np.zeros((n, Hq, p.num_parts, L + 1), np.float32)})


def test_mla_device_slots_out_of_range_write_nothing(emu, monkeypatch):
    """Slots in device memory are not read back: the kernel itself writes no row when one is
    outside the cache (every block scans them), and the query is still roped."""
    from mtpkern.backends.cuda_launch import mla as mla_launch
    be = emu_backend.backend("bfloat16")
    rng = np.random.default_rng(5)
    L, R, NB, BS, n = 40, 8, 3, 4, 4
    cache = be.empty_latent_kv(NB, BS, L + R)
    q = rnd(rng, n, 2, 16 + R)
    monkeypatch.setattr(mla_launch, "is_device_array", lambda a: True)
    got = be.mla_latent_write(rnd(rng, n, L + R), rnd(rng, L), 1e-6, inv_freq(R, 1e4), np.arange(n, dtype=np.int32),
                              cache, np.array([0, 5, NB * BS, 1], np.int32), q=q)
    assert not cache.any()
    want = REF.mla_latent_write(rnd(rng, n, L + R), rnd(rng, L), 1e-6, inv_freq(R, 1e4),
                                np.arange(n, dtype=np.int32), np.zeros((NB, BS, L + R), np.float32),
                                np.arange(n, dtype=np.int32), q=q)
    assert_close(got, want, "float32", "q roped")


@pytest.mark.parametrize("n,F,G", [(1, 4096, 32), (5, 2049, 2049), (3, 999, 1), (300, 64, 16), (2, 1, 1)])
@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
def test_sigmoid_gate_shapes(be, n, F, G, mis):
    """Rows wider than one block's 1024 columns, a column slice of a fused buffer at an odd
    offset and stride, misaligned x / out."""
    rng = np.random.default_rng(n * F + G)
    x, res = rnd(rng, n, F), rnd(rng, n, F)
    fused = rnd(rng, n, G + 5, scale=3.0)
    gate = fused[:, 3:3 + G]
    if mis:
        x, res = misaligned(x), misaligned(res)
    want = REF.sigmoid_gate(x, gate, res)
    out = misaligned(np.zeros((n, F), np.float32)) if mis else None
    assert_close(be.sigmoid_gate(x, gate, res, out=out), want, "float32", "sigmoid_gate")
    y = x.copy()
    assert_close(be.sigmoid_gate(y, gate, None, out=y), REF.sigmoid_gate(x, gate), "float32", "sigmoid_gate in place")


@pytest.mark.parametrize("wd", ["bf16", "f32", "fp8", "fp8c"])
@pytest.mark.parametrize("n,K,N", [(1, 64, 7), (9, 128, 33), (17, 72, 3), (256, 64, 40), (3, 4104, 5)])
@pytest.mark.parametrize("mis", [False, True], ids=["aligned", "misaligned"])
def test_linear_views(be, wd, n, K, N, mis):
    rng = np.random.default_rng(n * K + N)
    x, w, b, r = rnd(rng, n, K), rnd(rng, N, K, scale=K ** -0.5), rnd(rng, N), rnd(rng, n, N)
    wq, wf = stored(w, wd)
    wp = be.prepare_weight(wq)
    if mis:
        x, wp = misaligned(x), misaligned(wp)
    assert_close(be.linear(x, wp, b, r), REF.linear(x, wf, b, r), "float32", "linear")


def test_fp8_dequantizes_each_weight_as_the_reference(be):
    """One input of 1.0 against every E4M3 code: each dot is exactly one dequantized weight
    (code * scale, rounded once), so the kernel's value must equal it bit for bit; a row
    holding a NaN code (0x7F, 0xFF) is NaN."""
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scale = np.array([[0.3], [1.7e-3]], np.float32)                      # not powers of two
    q = Fp8Weight(np.tile(codes, (2, 1)), scale, (16, 16))
    deq = q.dequantize()
    nan_rows = np.isnan(deq).any(axis=1)
    assert nan_rows.sum() == 4
    for col in range(16):
        x = np.zeros((1, 16), np.float32)
        x[0, col] = 1.0
        got = be.linear(x, be.prepare_weight(q))[0]
        np.testing.assert_array_equal(got[~nan_rows], deq[~nan_rows, col])
        assert np.isnan(got[nan_rows]).all()



def test_gemv_split_k_widths(emu, be, sm_count):
    """linear, swiglu_mlp, lm_head and moe_router logits at SM counts that make the
    launcher pick each split-K width (1, 2 and 4 warps per row group)."""
    rng = np.random.default_rng(7)
    seen = set()
    for sms, N in ((2, 40), (2, 20), (2, 6), (132, 64), (1, 2000)):
        sm_count(sms)
        seen.add(linear_launch.gemv_config(-(-N // 2))[1])
        for wd in ("bf16", "f32", "fp8"):
            K, n = 72, 5
            x, w = rnd(rng, n, K), rnd(rng, N, K, scale=K ** -0.5)
            wq, wf = stored(w, wd)
            assert_close(be.linear(x, be.prepare_weight(wq)), REF.linear(x, wf), "float32", f"linear {sms} {N}")
            (w13, f13), (w2, f2) = (stored(rnd(rng, 2 * N, K, scale=K ** -0.5), "fp8" if wd == "fp8" else "f32"),
                                    stored(rnd(rng, K, N, scale=N ** -0.5), "fp8" if wd == "fp8" else "f32"))
            assert_close(be.swiglu_mlp(x, be.prepare_weight(w13), be.prepare_weight(w2)),
                         REF.swiglu_mlp(x, f13, f2), "float32", f"swiglu {sms} {N}")
            np.testing.assert_array_equal(be.lm_head_argmax(x, be.prepare_weight(wq)), REF.lm_head_argmax(x, wf))
    assert seen == {1, 2, 4}, seen


# -- gemm_tc: the GEMV of 4 rows or more on tensor cores (kernels/gemm_tc.cu) ---------------------

def _tc_ref64(x, w, bias, residual, norm):
    """float64 y = (inv_rms *) (x (* g)) w^T + bias + residual, and a bound of gemm_tc's error:
    x carried by three BF16 terms (|x - sum| <= 2^-26 |x|, 2^-24 for margin) plus FP32 sums of K
    terms (K 2^-23), times sum_k |w x|; FP32 rounding of the bias / residual adds."""
    x64, w64 = x.astype(np.float64), np.asarray(w, np.float64)
    scale = np.ones((x.shape[0], 1))
    if norm is not None:
        g, eps = norm
        scale = 1.0 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + eps)
        x64 = x64 * g.astype(np.float64)
    y = scale * (x64 @ w64.T)
    mag = scale * (np.abs(x64) @ np.abs(w64).T)
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    K = x.shape[1]
    return y, (2.0 ** -24 + K * 2.0 ** -23) * mag + 2.0 ** -22 * np.abs(y)


@pytest.mark.parametrize("n", [4, 5, 8, 9, 16, 24, 33])
@pytest.mark.parametrize("K,N", [(72, 33), (520, 20)])          # K % 32 == 8; two chunks of 512
@pytest.mark.parametrize("extras", ["plain", "bias+residual", "norm", "norm+bias+residual"])
def test_gemm_tc_against_float64(emu, be, n, K, N, extras):
    """gemm_tc_kernel through linear (and gemm_tc for the norm) against a float64 product, within
    FP32 sums of K terms (_tc_ref64). Measured on the emulator (n = 4 .. 33, N = 64): max |err| /
    sum|w x| = 6.1e-8 at K = 72, 3.4e-8 at K = 264, 5.5e-8 at K = 2048; linear_kernel's 6.4e-8,
    3.7e-8, 1.7e-8 (with two terms of x instead of three: 1.9e-6, 8.8e-7, 3.3e-7)."""
    rng = np.random.default_rng(n * 1000 + K + N)
    x, w = rnd(rng, n, K), rnd(rng, N, K, scale=K ** -0.5)
    wq, wf = stored(w, "bf16")
    wp = be.prepare_weight(wq)
    bias = rnd(rng, N) if "bias" in extras else None
    res = rnd(rng, n, N) if "residual" in extras else None
    norm = (rnd(rng, K) + 1.0, 1e-5) if "norm" in extras else None
    before = emu.launches.copy()
    if norm is None:
        got = be.linear(x, wp, bias, res)
    else:
        got = gemm_tc_launch.gemm_tc(x, wp, bias, res, norm=norm)
    ran = emu.launches - before
    assert set(ran) == {f"gemm_tc_kernel<{nt}, {'false' if norm is None else 'true'}>"
                        for nt in ({4, 1} if n == 33 else {-(-n // 8)})}, ran
    want, bound = _tc_ref64(x, wf, bias, res, norm)
    err = np.abs(got - want)
    assert (err <= bound).all(), f"max err {err.max()}, bound there {bound[np.unravel_index(err.argmax(), err.shape)]}"
    assert_close(got, want, "float32", "gemm_tc")


def test_gemm_tc_is_fp32_level(emu, be):
    """x split into three BF16 terms keeps gemm_tc at FP32 level: max |err| / sum|w x| under
    2^-20 (measured 6.1e-8 at K = 72, as linear_kernel's 6.4e-8), where x carried by one term
    (bf16(x)) or two (hi + lo, 16 bits) misses it even with exact float64 products and sums."""
    rng = np.random.default_rng(3)
    x, w = rnd(rng, 24, 72), rnd(rng, 64, 72, scale=72 ** -0.5)
    wq, wf = stored(w, "bf16")
    want, _ = _tc_ref64(x, wf, None, None, None)
    mag = np.abs(x.astype(np.float64)) @ np.abs(np.asarray(wf, np.float64)).T
    hi = np.asarray(x.astype(BF16), np.float64)
    lo = np.asarray((x - hi.astype(np.float32)).astype(BF16), np.float64)
    for terms in (hi, hi + lo):
        assert (np.abs(terms @ np.asarray(wf, np.float64).T - want) / mag).max() > 2.0 ** -20
    assert (np.abs(be.linear(x, be.prepare_weight(wq)) - want) / mag).max() <= 2.0 ** -20


def test_gemm_tc_keeps_inf_and_nan(emu, be):
    """An infinite input stays infinite (its lower terms are 0, not inf - inf) and a NaN stays
    NaN, as in the reference; the other rows are untouched."""
    rng = np.random.default_rng(9)
    x, w = rnd(rng, 8, 72), np.abs(rnd(rng, 16, 72, scale=72 ** -0.5)) + 0.01      # w > 0
    x[1, 5], x[2, 7], x[3, 0] = np.inf, -np.inf, np.nan
    wq, wf = stored(w, "bf16")
    got = be.linear(x, be.prepare_weight(wq))
    assert (got[1] == np.inf).all() and (got[2] == -np.inf).all() and np.isnan(got[3]).all()
    keep = [0, 4, 5, 6, 7]
    assert_close(got[keep], REF.linear(x[keep], wf), "float32", "gemm_tc rows without inf / nan")


def test_gemm_tc_selection(emu, be):
    """Which kernel linear runs: gemm_tc_kernel<ceil(n / 8), false> for n >= 4 rows of BF16
    weights with K % 8 == 0 (n > 32: launches of 32 rows); linear_kernel<W, NR, false> (NR the
    smallest of 1, 2, 4, 8 >= min(n, 8)) for fewer rows, FP32 or FP8 weights, and K % 8 != 0
    (the boundary: K = 76 falls back, K = 72 and 80 do not)."""
    rng = np.random.default_rng(11)
    cases = [(1, 72, "bf16", {"linear_kernel<__nv_bfloat16, 1, false>"}),
             (3, 72, "bf16", {"linear_kernel<__nv_bfloat16, 4, false>"}),
             (4, 72, "bf16", {"gemm_tc_kernel<1, false>"}),
             (8, 80, "bf16", {"gemm_tc_kernel<1, false>"}),
             (9, 72, "bf16", {"gemm_tc_kernel<2, false>"}),
             (17, 72, "bf16", {"gemm_tc_kernel<3, false>"}),
             (32, 72, "bf16", {"gemm_tc_kernel<4, false>"}),
             (40, 72, "bf16", {"gemm_tc_kernel<4, false>", "gemm_tc_kernel<1, false>"}),
             (8, 76, "bf16", {"linear_kernel<__nv_bfloat16, 8, false>"}),
             (8, 72, "f32", {"linear_kernel<float, 8, false>"}),
             (8, 72, "fp8", {"linear_kernel<__nv_fp8_e4m3, 8, false>"}),
             (8, 72, "fp8c", {"linear_kernel<__nv_fp8_e4m3, 8, false>"})]
    for n, K, wd, want in cases:
        x, w = rnd(rng, n, K), rnd(rng, 24, K, scale=K ** -0.5)
        wq, wf = stored(w, wd, (16, 8))
        before = emu.launches.copy()
        got = be.linear(x, be.prepare_weight(wq))
        assert set(emu.launches - before) == want, (n, K, wd)
        assert_close(got, REF.linear(x, wf), "float32", f"linear n={n} K={K} {wd}")


def test_gemm_tc_k_warps_misaligned_and_in_place(emu, be, sm_count):
    """Every k-warp count (1, 2, 4, 8 warps splitting K, chosen by N against the SM count), a
    weight and input 4 bytes off 16 (the 2-byte weight loads), and out = residual in place."""
    rng = np.random.default_rng(5)
    seen = set()
    K = 520                                                           # two chunks of 512
    for sms, N in ((2, 320), (2, 160), (2, 80), (2, 32), (132, 40)):      # 20, 10, 5, 2 tiles x kw >= 20
        sm_count(sms)
        seen.add(gemm_tc_launch.tc_config(-(-N // 16))[1])
        x, w, r = rnd(rng, 12, K), rnd(rng, N, K, scale=K ** -0.5), rnd(rng, 12, N)
        wq, wf = stored(w, "bf16")
        wp = be.prepare_weight(wq)
        want, bound = _tc_ref64(x, wf, None, r, None)
        for mis in (False, True):
            xa, wa = (misaligned(x), misaligned(wp)) if mis else (x, wp)
            y = r.copy()
            got = be.linear(xa, wa, None, y, out=y)
            assert got is y
            assert (np.abs(y - want) <= bound).all(), (sms, N, mis)
    assert seen == {1, 2, 4, 8}, seen


def test_gemm_tc_k_warps_forced(emu, be):
    """gemm_tc(kw=) (benchmarks/gpu_bench.py's sweep) takes the k-warps it is given: each within
    the float64 bound, not all with the same bits (the k-warps' sums are added in another order);
    a count the kernel has no layout for is refused."""
    rng = np.random.default_rng(8)
    K, N = 1040, 48                                                   # three chunks, 3 tiles
    x, w = rnd(rng, 8, K), rnd(rng, N, K, scale=K ** -0.5)
    wq, wf = stored(w, "bf16")
    wp = be.prepare_weight(wq)
    want, bound = _tc_ref64(x, wf, None, None, None)
    bits = set()
    for kw in gemm_tc_launch.KW:
        got = gemm_tc_launch.gemm_tc(x, wp, kw=kw)
        assert (np.abs(got - want) <= bound).all(), kw
        bits.add(got.tobytes())
    assert len(bits) > 1                      # the k-warps' partial sums: other orders, other bits
    for bad in (3, 0, 16):
        with pytest.raises(ValueError, match=r"kw: expected one of \(1, 2, 4, 8\), got " + str(bad)):
            gemm_tc_launch.gemm_tc(x, wp, kw=bad)


def _swiglu_ref(x, w13, L, norm, clamp_gate=False):
    """act = swiglu_act of the float64 gate | up (rounded to FP32 once), the kernel's inputs."""
    gu, _ = _tc_ref64(x, w13, None, None, norm)
    return swiglu_act(gu.astype(np.float32), L, clamp_gate=clamp_gate)


@pytest.mark.parametrize("n", [4, 9, 24, 33])
@pytest.mark.parametrize("I,H", [(20, 72), (64, 520)])          # I % 8 != 0: a partial tile of units
@pytest.mark.parametrize("limit,gate", [(None, False), (0.7, False), (0.7, True)])
@pytest.mark.parametrize("norm", [False, True])
def test_swiglu_tc_against_float64(emu, be, n, I, H, limit, gate, norm):
    """swiglu_tc_kernel (mlp's gate/up product for n >= 4 rows of BF16 w13) against the float64
    gate and up through the reference's activation and clamp (``gate``: DeepSeek-V4's, before
    silu); with the down projection, the whole swiglu_mlp against the reference (norm off:
    swiglu_mlp has no norm)."""
    rng = np.random.default_rng(n * 100 + I + H)
    x = rnd(rng, n, H)
    (w13, f13), (w2, f2) = stored(rnd(rng, 2 * I, H, scale=H ** -0.5), "bf16"), stored(rnd(rng, H, I), "bf16")
    nrm = (rnd(rng, H) + 1.0, 1e-5) if norm else None
    L = swiglu_limit(limit)
    before = emu.launches.copy()
    act = gemm_tc_launch.swiglu_tc(x, be.prepare_weight(w13), limit=limit, clamp_gate=gate, norm=nrm)
    nt = {4, 1} if n == 33 else {-(-n // 8)}
    assert set(emu.launches - before) == {f"swiglu_tc_kernel<{t}, {'true' if norm else 'false'}>" for t in nt}
    assert_close(act, _swiglu_ref(x, f13, L, nrm, gate), "float32", "swiglu_tc")
    if limit is not None:
        assert (np.abs(act) <= max(L, 0.28) * L).all()                          # silu >= -0.279
        assert (np.abs(act - _swiglu_ref(x, f13, swiglu_limit(None), nrm)) > 1e-3).any()   # the clamp bites
        other = _swiglu_ref(x, f13, L, nrm, not gate)                           # the other clamp: other values
        assert (np.abs(act - other) > 1e-3).any()
    if not norm:
        res = rnd(rng, n, H)
        before = emu.launches.copy()
        y = be.swiglu_mlp(x, be.prepare_weight(w13), be.prepare_weight(w2), res, limit=limit, clamp_gate=gate)
        down = "gemm_tc_kernel" if I % 8 == 0 else "linear_kernel"                # K = I of the down projection
        assert {k.split("<")[0] for k in emu.launches - before} == {"swiglu_tc_kernel", down}
        assert_close(y, REF.swiglu_mlp(x, f13, f2, res, limit=limit, clamp_gate=gate), "float32",
                     "swiglu_mlp on tensor cores")


def test_swiglu_tc_selection_and_k_warps(emu, be, sm_count):
    """swiglu_mlp's gate/up on swiglu_tc_kernel for n >= 4 rows of BF16 w13, H % 8 == 0; the
    scalar swiglu_gate_up_kernel for 3 rows, FP32 / FP8 weights and H % 8 != 0; every k-warp
    count (units I against the SM count)."""
    rng = np.random.default_rng(21)
    for n, H, wd, want in ((3, 72, "bf16", "swiglu_gate_up_kernel<__nv_bfloat16, 4, false>"),
                           (4, 72, "bf16", "swiglu_tc_kernel<1, false>"),
                           (8, 76, "bf16", "swiglu_gate_up_kernel<__nv_bfloat16, 8, false>"),
                           (8, 72, "f32", "swiglu_gate_up_kernel<float, 8, false>"),
                           (8, 72, "fp8", "swiglu_gate_up_kernel<__nv_fp8_e4m3, 8, false>")):
        x = rnd(rng, n, H)
        (w13, f13), (w2, f2) = (stored(rnd(rng, 48, H, scale=H ** -0.5), wd, (16, 8)),
                                stored(rnd(rng, H, 24, scale=0.2), wd, (16, 8)))
        before = emu.launches.copy()
        y = be.swiglu_mlp(x, be.prepare_weight(w13), be.prepare_weight(w2))
        assert want in set(emu.launches - before), (n, H, wd)
        assert_close(y, REF.swiglu_mlp(x, f13, f2), "float32", f"swiglu_mlp n={n} H={H} {wd}")
    seen = set()
    for sms, I in ((2, 160), (2, 80), (2, 40), (2, 16)):
        sm_count(sms)
        seen.add(gemm_tc_launch.tc_config(-(-I // 8))[1])
        x = rnd(rng, 12, 520)
        w13, f13 = stored(rnd(rng, 2 * I, 520, scale=520 ** -0.5), "bf16")
        assert_close(gemm_tc_launch.swiglu_tc(x, be.prepare_weight(w13)), _swiglu_ref(x, f13, swiglu_limit(None), None),
                     "float32", f"swiglu_tc sms={sms} I={I}")
    assert seen == {1, 2, 4, 8}, seen


def test_gemm_tc_bad_input(emu, be):
    rng = np.random.default_rng(1)
    x = rnd(rng, 8, 72)
    wq = be.prepare_weight(stored(rnd(rng, 16, 72), "bf16")[0])
    with pytest.raises(TypeError, match="w: expected BF16"):
        gemm_tc_launch.gemm_tc(x, rnd(rng, 16, 72))
    with pytest.raises(ValueError, match="K % 8 == 0"):
        gemm_tc_launch.gemm_tc(rnd(rng, 8, 76), be.prepare_weight(stored(rnd(rng, 16, 76), "bf16")[0]))
    with pytest.raises(ValueError, match=r"norm weight: expected shape \[72\], got \[71\]"):
        gemm_tc_launch.gemm_tc(x, wq, norm=(rnd(rng, 71), 1e-5))
    with pytest.raises(ValueError, match="norm eps: expected > 0"):
        gemm_tc_launch.gemm_tc(x, wq, norm=(rnd(rng, 72), 0.0))
    with pytest.raises(ValueError, match=r"w13: expected an even number of rows \[2I, 72\], got \[15, 72\]"):
        gemm_tc_launch.swiglu_tc(x, be.prepare_weight(stored(rnd(rng, 15, 72), "bf16")[0]))
    with pytest.raises(TypeError, match="w13: expected BF16"):
        gemm_tc_launch.swiglu_tc(x, rnd(rng, 16, 72))


@pytest.mark.parametrize("wd", ["bf16", "f32", "fp8", "fp8c"])
@pytest.mark.parametrize("n,V,H", [(1, 1000, 64), (9, 1001, 64), (17, 129, 48), (3, 64, 40), (8, 2, 8)])
def test_lm_head_shapes(be, wd, n, V, H):
    rng = np.random.default_rng(V * n + H)
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=H ** -0.5)
    wq, wf = stored(w, wd)
    mask = rng.integers(-2**31, 2**31, (n, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    mask[:, 0] |= 1
    for bm in (None, mask):
        np.testing.assert_array_equal(be.lm_head_argmax(x, be.prepare_weight(wq), bm), REF.lm_head_argmax(x, wf, bm))


def conf_reference(logits: np.ndarray, bitmask: np.ndarray | None) -> np.ndarray:
    """[n, V] FP32 logits (the reference's, ``ops.lm_head.lm_head_logits``) -> conf [n] float64:
    the softmax over each row's allowed, non-NaN logits at its maximum, ``1 / sum exp(l - l_max)``;
    exp(l - l_max) is 1 where l == l_max (so an infinite maximum is shared by the tokens tied with
    it, as the kernel's online log-sum-exp); NaN for a row without a candidate."""
    n, V = logits.shape
    ok = ~np.isnan(logits)
    if bitmask is not None:
        ok &= bitmask_allowed(bitmask, V)
    out = np.full(n, np.nan)
    for r in range(n):
        lr = logits[r, ok[r]].astype(np.float64)
        if lr.size:
            top = lr.max()
            with np.errstate(invalid="ignore"):
                out[r] = 1.0 / np.where(lr == top, 1.0, np.exp(lr - top)).sum()
    return out


def ref_ids(logits: np.ndarray, bitmask: np.ndarray | None) -> np.ndarray:
    """The reference's masked argmax, -1 for a row without a candidate (as the kernels)."""
    ids = np.full(logits.shape[0], -1, np.int32)
    for r in range(logits.shape[0]):
        try:
            ids[r] = masked_argmax(logits[r:r + 1], None if bitmask is None else bitmask[r:r + 1])[0]
        except NoAllowedToken:
            pass
    return ids


def lm_argmax_conf(be, x, w, bitmask=None, **kw):
    """-> (ids, conf) of the emulated op with ``conf=`` (check=False: rows without a token give -1)."""
    conf = np.full(x.shape[0], 7.0, np.float32)                 # every element must be written
    ids = be.lm_head_argmax(x, w, bitmask, conf=conf, check=False, **kw)
    return ids, conf


def expect_conf(got, want, what):
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    ok = ~np.isnan(want)
    assert_close(got[ok], want[ok], "float32", what)
    assert ((got[ok] > 0) & (got[ok] <= 1)).all(), what


@pytest.mark.parametrize("wd", ["bf16", "f32", "fp8", "fp8c"])
@pytest.mark.parametrize("n,V,H", [(1, 1, 16), (2, 63, 40), (3, 64, 32), (8, 65, 24), (5, 301, 48),
                                   (9, 130, 16), (4, 2500, 32), (2, 4099, 24)])
def test_lm_head_conf(be, wd, n, V, H):
    """conf against the float64 softmax of the reference's logits over odd shapes (every row
    count of a chunk, NR = 1, 2, 4, 8, two chunks at n = 9), with and without masks; ids with
    conf= are the ids without it; a mask of one token gives conf = 1 exactly; a row without
    an allowed token gives -1 and NaN."""
    rng = np.random.default_rng(31 * V + n + H)
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=2 * H ** -0.5)   # logits of a few units: conf spread over (0, 1]
    wq, wf = stored(w, wd)
    wb = be.prepare_weight(wq)
    logits = REF.lm_head_logits(x, wf)
    words = (V + 31) // 32
    dense = rng.integers(-2**31, 2**31, (n, words), dtype=np.int64).astype(np.int32)
    one = np.zeros((n, words), np.int32)
    pick = rng.integers(0, V, n)
    one[np.arange(n), pick >> 5] = (np.uint32(1) << (pick & 31).astype(np.uint32)).view(np.int32)
    for name, bm in (("no mask", None), ("random mask", dense), ("one token", one)):
        ids, conf = lm_argmax_conf(be, x, wb, bm)
        np.testing.assert_array_equal(ids, be.lm_head_argmax(x, wb, bm, check=False), err_msg=name)
        np.testing.assert_array_equal(ids, ref_ids(logits, bm), err_msg=name)
        expect_conf(conf, conf_reference(logits, bm), f"conf {wd} n={n} V={V} {name}")
        if name == "one token":
            np.testing.assert_array_equal(ids, pick)
            np.testing.assert_array_equal(conf, np.ones(n, np.float32))
    empty = dense.copy()
    empty[n - 1] = 0                                              # the last row allows nothing
    ids, conf = lm_argmax_conf(be, x, wb, empty)
    assert ids[-1] == -1 and np.isnan(conf[-1])
    expect_conf(conf, conf_reference(logits, empty), f"conf {wd} n={n} V={V} empty row")


@pytest.mark.parametrize("sms", [1, 3])
def test_lm_head_persistent_grid(emu, be, sm_count, sms):
    """The first stage's persistent grid: with few SMs each block takes a contiguous share of
    many row pairs (the emulator's estimate: 4 resident blocks per SM), each warp a running best
    over its pairs; ids and conf match the reference (two chunks at n = 9), and a caller's
    workspaces are written in their first 4 * sms columns only."""
    sm_count(sms)
    rng = np.random.default_rng(sms)
    V, H = 2501, 24
    P = lm_launch.num_partials(V, sms)
    used = 4 * sms
    assert used < P
    for n in (1, 3, 9):
        x, w = rnd(rng, n, H), rnd(rng, V, H, scale=2 * H ** -0.5)
        wq, wf = stored(w, "bf16")
        wb = be.prepare_weight(wq)
        logits = REF.lm_head_logits(x, wf)
        mask = rng.integers(-2**31, 2**31, (n, (V + 31) // 32), dtype=np.int64).astype(np.int32)
        for bm in (None, mask):
            part_v, part_s = np.full((n, P), 7.0, np.float32), np.full((n, P), 7.0, np.float32)
            part_i = np.full((n, P), 7, np.int32)
            conf, ids = np.zeros(n, np.float32), np.zeros(n, np.int32)
            be.lm_head_argmax(x, wb, bm, out=ids, part_v=part_v, part_i=part_i, part_s=part_s, conf=conf,
                              check=False)
            np.testing.assert_array_equal(ids, ref_ids(logits, bm))
            expect_conf(conf, conf_reference(logits, bm), f"persistent sms={sms} n={n}")
            assert (part_v[:, used:] == 7.0).all() and (part_s[:, used:] == 7.0).all()
            assert (part_i[:, used:] == 7).all() and (part_i[:, :used] < V).all()


@pytest.mark.parametrize("wd", ["bfloat16", "float32", "fp8_block", "fp8_channel"])
def test_lm_head_conf_nan_inf_and_ties(be, wd):
    """Exact logits (an identity head, x on a grid of few values: many ties at the maximum),
    NaN tokens (NaN weight rows: never counted), -inf tokens (-inf on the diagonal times
    x > 0: counted as 0), a row whose allowed logits are all -inf (they tie: 1 / count),
    a row with two +inf logits (1 / 2) -- FP8 has no infinity: NaN only there."""
    V = 150
    rng = np.random.default_rng(5)
    x = rng.choice(np.array([0.25, 0.5, 1.0, 2.0, 3.0], np.float32), (6, V))
    w = np.eye(V, dtype=np.float32)
    w[[3, 70, 149]] = np.nan                                       # NaN for every row
    fp8 = wd.startswith("fp8")
    if not fp8:
        w[[5, 64, 100], [5, 64, 100]] = -np.inf                    # -inf where x > 0
        x[4, [7, 140]] = -1.0
        w[[7, 140], [7, 140]] = -np.inf                            # -1 * -inf = +inf: row 4 only
    wt = test_ops_backends.exact_weight(w, wd)
    wf = REF.prepare_weight(wt)
    logits = REF.lm_head_logits(x, wf)
    mask = np.full((6, (V + 31) // 32), -1, np.int32)
    if not fp8:
        mask[5] = 0                                                # row 5: only the -inf tokens
        for j in (5, 64, 100):
            mask[5, j >> 5] |= np.int32(1 << (j & 31))
    want = conf_reference(logits, mask)
    ids, conf = lm_argmax_conf(be, x, be.prepare_weight(wt), mask)
    np.testing.assert_array_equal(ids, ref_ids(logits, mask))
    expect_conf(conf, want, f"conf {wd}")
    top = logits[:4].max(axis=1, initial=-np.inf, where=~np.isnan(logits[:4]))
    assert ((logits[:4] == top[:, None]).sum(axis=1) > 1).all()    # ties at the maximum in every plain row
    if not fp8:
        assert ids[4] == 7 and conf[4] == 0.5                      # two +inf
        assert ids[5] == 5 and conf[5] == np.float32(1 / 3)        # three -inf, nothing else allowed
    assert np.isfinite(conf).all()


def test_lm_head_conf_none_is_the_plain_argmax(emu, be):
    """Without conf= the plain instantiations run (the CONF ones do not), with the same ids;
    part_s without conf is refused; conf is checked by name; given workspaces are used."""
    rng = np.random.default_rng(2)
    n, V, H = 5, 200, 32
    x, w = rnd(rng, n, H), be.prepare_weight(rnd(rng, V, H).astype(BF16))
    before = emu.launches.copy()
    ids = be.lm_head_argmax(x, w)
    ran = {k for k, c in (emu.launches - before).items() if c}
    assert ran == {"lm_head_argmax_partial_kernel<__nv_bfloat16, false, 8>", "argmax_final_kernel<false>"}, ran
    P = lm_launch.num_partials(V, emu.sm_count)
    part_v, part_i, part_s = (np.zeros((n, P), t) for t in (np.float32, np.int32, np.float32))
    conf, out = np.zeros(n, np.float32), np.zeros(n, np.int32)
    before = emu.launches.copy()
    got = be.lm_head_argmax(x, w, out=out, part_v=part_v, part_i=part_i, part_s=part_s, conf=conf)
    ran = {k for k, c in (emu.launches - before).items() if c}
    assert ran == {"lm_head_argmax_partial_kernel<__nv_bfloat16, true, 8>", "argmax_final_kernel<true>"}, ran
    assert got is out
    np.testing.assert_array_equal(out, ids)
    assert (part_s >= 1).all() and (conf > 0).all()               # every block holds its best (adds 1)
    m = part_v.max(axis=1, keepdims=True)                          # the final merge, in float64
    np.testing.assert_allclose(conf, 1 / (part_s * np.exp(part_v.astype(np.float64) - m)).sum(axis=1), rtol=1e-6)
    with pytest.raises(ValueError, match="part_s"):
        be.lm_head_argmax(x, w, part_s=part_s)
    with pytest.raises(TypeError, match="conf: expected dtype float32"):
        be.lm_head_argmax(x, w, conf=np.zeros(n, np.float64))
    with pytest.raises(ValueError, match=r"conf: expected shape \[5\]"):
        be.lm_head_argmax(x, w, conf=np.zeros(n + 1, np.float32))
    with pytest.raises(ValueError, match=rf"part_s: expected shape \[5, {P}\]"):
        be.lm_head_argmax(x, w, part_s=np.zeros((n, P + 1), np.float32), conf=conf)


def test_lm_head_conf_matches_the_numpy_backend(be):
    """Once the NumPy reference has conf= (mtpkern/ops/lm_head.py), the emulated op agrees with it."""
    import inspect

    if "conf" not in inspect.signature(REF.lm_head_argmax).parameters:
        pytest.skip("the NumPy backend's lm_head_argmax has no conf= yet")
    rng = np.random.default_rng(3)
    x, w = rnd(rng, 4, 40), rnd(rng, 301, 40, scale=0.3)
    mask = rng.integers(-2**31, 2**31, (4, 10), dtype=np.int64).astype(np.int32)
    mask[:, 0] |= 1
    want = np.zeros(4, np.float32)
    REF.lm_head_argmax(x, w, mask, conf=want)
    ids, conf = lm_argmax_conf(be, x, be.prepare_weight(w), mask)
    np.testing.assert_array_equal(ids, REF.lm_head_argmax(x, w, mask))
    assert_close(conf, want, "float32", "conf against the NumPy backend")


def test_lm_head_sample_matches_the_numpy_backend(be):
    """Sampled drafts drawn on the device (kernels/sampling.cu) from the head's logits: the
    reference's drafts with its probabilities and distributions, with a mask, an id_map and
    top_k / top_p; a row with nothing allowed raises NoAllowedToken naming it."""
    rng = np.random.default_rng(5)
    n, V, H = 4, 301, 40
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=0.3)
    mask = rng.integers(-2**31, 2**31, (n, 10), dtype=np.int64).astype(np.int32)
    mask[:, 0] |= 1
    id_map = np.sort(rng.permutation(4 * V)[:V]).astype(np.int32)
    ps = [sampling.SamplingParams(0.8, 0, 1.0, 1), sampling.SamplingParams(1.5, 10, 1.0, 2),
          sampling.SamplingParams(1.0, 0, 0.7, 3), sampling.SamplingParams(0.5, 1, 1.0, 4)]
    T, K, P = sampling.check_params("sampling", ps, n)
    keys = sampling.row_keys(ps, [3, 4, 5, 6], 1)
    want_q = np.empty((n, V), np.float32)
    want = REF.lm_head_sample(x, w, mask, keys=keys, temperature=T, top_k=K, top_p=P, id_map=id_map, dist=want_q)
    q = be.xp.empty((n, V), np.float32)
    ids, probs = be.lm_head_sample(x, be.prepare_weight(w), be.from_host(mask), keys=keys, temperature=T, top_k=K,
                                   top_p=P, id_map=be.from_host(id_map), dist=q)
    np.testing.assert_array_equal(be.to_host(ids), want[0])
    assert_close(be.to_host(probs), want[1], "float32", "sampled drafts' probabilities")
    np.testing.assert_allclose(be.to_host(q), want_q, rtol=1e-4, atol=1e-7)
    mask[2] = 0
    with pytest.raises(NoAllowedToken, match="row 2"):
        be.lm_head_sample(x, be.prepare_weight(w), be.from_host(mask), keys=keys, temperature=T, top_k=K, top_p=P)


#: (temperature, top_k, top_p) of the sampled-draft sweep
SAMPLE_PARAMS = {"T": (0.8, 0, 1.0), "top_k": (1.3, 5, 1.0), "top_p": (0.7, 0, 0.9), "top_k_top_p": (1.1, 7, 0.6),
                 "greedy": (0.9, 1, 0.8)}
#: FP32 rounding: the kernel's FP64 sums (in another order than the reference's rank order)
#: differ by a few ulps, so an FP32 probability may land one FP32 ulp away
SAMPLE_RTOL = 2.0 ** -22


def sample_case(rng, n: int, V: int, special: bool):
    """Logits [n, V] FP32 (special: row r % 4 == 0 has NaN and -inf logits, 1 two +inf logits,
    2 only -inf logits, 3 logits rounded to halves: ties), and a bitmask [n, ceil(V / 32)]
    keeping about half the tokens; token V - 1 stays a candidate in every row."""
    logits = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    if special:
        for r in range(n):
            kind = r % 4
            if kind == 0:
                logits[r, rng.random(V) < 0.1] = np.nan
                logits[r, rng.random(V) < 0.1] = -np.inf
            elif kind == 1:
                logits[r, rng.integers(0, V, 2)] = np.inf
            elif kind == 2:
                logits[r] = -np.inf
            else:
                logits[r] = np.round(logits[r] * 2) / 2
        logits[:, V - 1] = np.where(np.isnan(logits[:, V - 1]), 1.0, logits[:, V - 1])
    mask = rng.integers(-2**31, 2**31, (n, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    mask[:, (V - 1) >> 5] |= np.int32(np.uint32(1 << ((V - 1) & 31)).view(np.int32))
    return logits, mask


def sample_logits(be, logits, params, keys, mask=None, id_map=None, dist=None):
    """The cuda launcher ``masked_sample`` over given logits (inf logits cannot come out of a
    GEMV with x = I: 0 * inf is NaN) -> host (ids, probs)."""
    n = logits.shape[0]
    T, K, P = sampling.check_params("sampling", params, n)
    ids, probs = lm_launch.masked_sample(be.from_host(logits), None if mask is None else be.from_host(mask),
                                         keys=keys, temperature=T, top_k=K, top_p=P,
                                         id_map=None if id_map is None else be.from_host(id_map), dist=dist)
    return be.to_host(ids), be.to_host(probs)


def check_sample_matches_reference(be, V: int, n: int, params: str) -> None:
    """The cuda launcher ``masked_sample`` against mtpkern.ops.sampling.masked_sample on the same
    logits: the drafts bit for bit, probs and the whole q within FP32 rounding, plain and with a
    grammar bitmask, a draft vocabulary's id_map, NaN / -inf / +inf logits and ties; with top_k
    or top_p the cut is seen to remove candidates (the case exercises it). Run on the emulator
    here and on a device by tests/test_gpu.py."""
    T, k, p = SAMPLE_PARAMS[params]
    rng = np.random.default_rng(V * 31 + n)
    for special in (False, True):
        logits, mask = sample_case(rng, n, V, special)
        mask = mask if special else None
        id_map = np.sort(rng.permutation(4 * V)[:V]).astype(np.int32) if special else None
        ps = [sampling.SamplingParams(T, k, p, seed=17 * V + i) for i in range(n)]
        keys = sampling.row_keys(ps, list(range(3, 3 + n)), 1)
        want = sampling.masked_sample(logits, mask, keys, *sampling.check_params("s", ps, n), id_map=id_map,
                                      want_dist=True)
        dist = be.xp.empty((n, V), np.float32)
        ids, probs = sample_logits(be, logits, ps, keys, mask, id_map, dist)
        what = f"V {V}, n {n}, {params}, special={special}"
        np.testing.assert_array_equal(ids, want[0], err_msg=f"drafts, {what}")
        np.testing.assert_allclose(probs, want[1], rtol=SAMPLE_RTOL, atol=0, err_msg=what)
        np.testing.assert_allclose(be.to_host(dist), want[2], rtol=SAMPLE_RTOL, atol=0, err_msg=what)
        if (k > 0 or p < 1.0) and V >= 257 and not special:             # no mask, no NaN: V candidates
            assert (np.count_nonzero(want[2], axis=1) < V).all(), "the cut removed no candidate"


@pytest.mark.parametrize("params", list(SAMPLE_PARAMS))
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("V", [1, 31, 33, 257, 1000])
def test_sample_kernel_matches_the_reference(be, V, n, params):
    """kernels/sampling.cu against the reference over odd shapes: check_sample_matches_reference."""
    check_sample_matches_reference(be, V, n, params)


def test_sample_kernel_with_a_wrong_key_draws_other_drafts(be):
    """Negative control: the same logits drawn with each row's key + 1 give other drafts in
    most rows, so the sweep's comparison of drafts does test the noise."""
    rng = np.random.default_rng(2)
    n, V = 7, 1000
    logits = rng.standard_normal((n, V)).astype(np.float32)
    ps = [sampling.SamplingParams(1.0, 0, 1.0, seed=i) for i in range(n)]
    keys = sampling.row_keys(ps, list(range(n)), 0)
    want = sampling.masked_sample(logits, None, keys, *sampling.check_params("s", ps, n))[0]
    np.testing.assert_array_equal(sample_logits(be, logits, ps, keys)[0], want)
    wrong = sample_logits(be, logits, ps, keys + np.uint64(1))[0]
    assert (wrong != want).sum() >= n // 2


def test_sample_kernel_top_k_ties_keep_the_lowest_ids(be):
    """Equal logits: top_k keeps the k lowest allowed ids, each drawn with probability 1 / k."""
    n, V = 3, 50
    logits = np.zeros((n, V), np.float32)
    mask = np.full((n, 2), -1, np.int32)
    mask[:, 0] = ~0b1011                                                 # tokens 0, 1, 3 not allowed
    ps = [sampling.SamplingParams(1.0, 5, 1.0, seed=i) for i in range(n)]
    dist = be.xp.empty((n, V), np.float32)
    ids, probs = sample_logits(be, logits, ps, sampling.row_keys(ps, [0] * n, 0), mask, dist=dist)
    kept = [2, 4, 5, 6, 7]
    assert set(ids.tolist()) <= set(kept)
    np.testing.assert_allclose(probs, 0.2, rtol=1e-6)
    np.testing.assert_allclose(be.to_host(dist)[:, kept], 0.2, rtol=1e-6)
    assert be.to_host(dist).sum() == pytest.approx(n, rel=1e-6)


def test_sample_kernel_rows_without_a_candidate_raise(be):
    """A row whose tokens are all masked out, or all NaN, raises NoAllowedToken naming it."""
    rng = np.random.default_rng(4)
    n, V = 3, 33
    logits = rng.standard_normal((n, V)).astype(np.float32)
    ps = [sampling.SamplingParams(0.9, 3, 0.8, seed=i) for i in range(n)]
    keys = sampling.row_keys(ps, [1] * n, 0)
    mask = np.full((n, 2), -1, np.int32)
    mask[1] = 0
    with pytest.raises(NoAllowedToken, match="row 1: .*grammar"):
        sample_logits(be, logits, ps, keys, mask)
    logits[2] = np.nan
    with pytest.raises(NoAllowedToken, match="row 2"):
        sample_logits(be, logits, ps, keys)
    with pytest.raises(ValueError, match=r"top_p: expected values in \(0, 1\]"):
        be.lm_head_sample(np.eye(n, dtype=np.float32), be.prepare_weight(np.ascontiguousarray(logits.T)), keys=keys,
                          temperature=np.ones(n), top_k=np.zeros(n, np.int32), top_p=np.full(n, 1.5))


# -- the sampled draw fused into the LM head (temperature only) --------------------------------

#: the fused draw's heads: exact identity heads (kind -> its weight, its values as the reference sees them)
FUSED_WDS = ("float32", "bfloat16", "fp8_block", "fp8_channel", "fp4")


def identity_head(V: int, wd: str, special: bool):
    """An identity head [V, H] (H = V, or V rounded up to 32 for FP4's packing) so the logits are
    x's first V columns exactly, whatever the summation order; special: NaN rows 3 and V // 2 (NaN
    logits in every row; not FP4, whose quantizer takes finite values only) and, FP32 / BF16 only
    (FP8 and FP4 have no infinity), -inf on the diagonal at 5 and V - 3 (where x > 0: -inf logits;
    x < 0: +inf)."""
    H = -(-V // 32) * 32 if wd == "fp4" else V
    w = np.zeros((V, H), np.float32)
    w[np.arange(V), np.arange(V)] = 1.0
    if special and V > 8 and wd != "fp4":
        w[[3, V // 2]] = np.nan
        if wd in ("float32", "bfloat16"):
            w[[5, V - 3], [5, V - 3]] = -np.inf
    if wd == "fp4":
        q, wf = stored(w, "fp4")
        np.testing.assert_array_equal(wf, w)                     # 0 and 1 are exact E2M1 codes
        return q, wf
    wt = test_ops_backends.exact_weight(w, wd)
    return wt, REF.prepare_weight(wt)


def fused_case(rng, n: int, V: int, H: int, special: bool):
    """x [n, H] on a grid of few values (ties in the logits; row r % 3 == 1 with x = -1 at 5 and V - 3:
    +inf logits where the head has -inf), temperatures (row r % 3 == 2 of a special case: T = 1e-308,
    so z = l / T overflows to +-inf for |l| >= 2: the m = +inf and m = -inf rules without an infinite
    logit) and a bitmask keeping about half the tokens, token V - 1 always."""
    x = rng.choice(np.array([-2.0, -0.75, 0.25, 0.5, 1.0, 1.5, 2.5, 3.0], np.float32), (n, H))
    T = np.array([(0.7, 1.0, 1.9)[r % 3] for r in range(n)])
    if special:
        x[1::3, [5, V - 3]] = -1.0
        T[2::3] = 1e-308
    mask = rng.integers(-2**31, 2**31, (n, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    mask[:, (V - 1) >> 5] |= np.int32(np.uint32(1 << ((V - 1) & 31)).view(np.int32))
    return x, T, mask


def fused_sample(be, x, head, mask, keys, T, id_map=None):
    """The cuda launcher's temperature-only draw -> host (ids, probs)."""
    n = x.shape[0]
    ids, probs = be.lm_head_sample(x, head, None if mask is None else be.from_host(mask), keys=keys,
                                   temperature=T, top_k=np.zeros(n, np.int32), top_p=np.ones(n),
                                   id_map=None if id_map is None else be.from_host(id_map))
    return be.to_host(ids), be.to_host(probs)


def check_fused_sample_matches_reference(be, wd: str, n: int, V: int) -> None:
    """The fused draw against mtpkern.ops.sampling.lm_head_sample on exact logits: the drafts bit
    for bit, probs within FP32 rounding, plain, masked, with an id_map, NaN / +-inf logits and z
    overflowing to +-inf. Run on the emulator here and on a device by tests/test_gpu.py."""
    rng = np.random.default_rng(V * 7 + n)
    for special in (False, True):
        head, wf = identity_head(V, wd, special)
        x, T, mask = fused_case(rng, n, V, wf.shape[1], special)
        id_map = np.sort(rng.permutation(4 * V)[:V]).astype(np.int32)
        ps = [SamplingParams(float(T[r]), 0, 1.0, seed=13 * V + r) for r in range(n)]
        keys = row_keys(ps, list(range(5, 5 + n)), 2)
        for bm, im in ((None, None), (mask, None), (mask, id_map)):
            want = sampling.lm_head_sample(x, wf, bm, keys, T, np.zeros(n, np.int32), np.ones(n), id_map=im)
            ids, probs = fused_sample(be, x, be.prepare_weight(head), bm, keys, T, im)
            what = f"{wd} V {V}, n {n}, special={special}, mask={bm is not None}, id_map={im is not None}"
            np.testing.assert_array_equal(ids, want[0], err_msg=f"drafts, {what}")
            np.testing.assert_allclose(probs, want[1], rtol=SAMPLE_RTOL, atol=0, err_msg=what)


@pytest.mark.parametrize("wd", FUSED_WDS)
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("V", [31, 33, 257, 1000])
def test_fused_sample_matches_the_reference(be, wd, n, V):
    """check_fused_sample_matches_reference over odd shapes (H = V odd, and 1000: the 16-byte path;
    FP4 at H a multiple of 32) and every weight kind the argmax kernel has exactly."""
    check_fused_sample_matches_reference(be, wd, n, V)


def check_fused_topk_sample_matches_reference(be, wd: str, n: int, V: int, emu=None) -> None:
    """The top_k draw fused into the LM head (every row 1 <= top_k <= 64, top_p 1, 0.9 or 0.5)
    against mtpkern.ops.sampling.lm_head_sample on exact logits: the drafts bit for bit, probs within
    FP32 rounding (the kernel adds the weights in the reference's rank order: equal on the
    emulator), plain and with a mask and an id_map, NaN / +-inf logits and z overflowing; ``emu``:
    the launches are the fused pair's. Run on the emulator here and on a device by test_gpu.py."""
    rng = np.random.default_rng(V * 5 + n)
    for special in (False, True):
        head, wf = identity_head(V, wd, special)
        x, T, mask = fused_case(rng, n, V, wf.shape[1], special)
        id_map = np.sort(rng.permutation(4 * V)[:V]).astype(np.int32)
        K = rng.integers(1, 65, n).astype(np.int32)
        K[0] = 1 if n > 1 else K[0]                                # the greedy draft among them
        P = np.array([(1.0, 0.9, 0.5)[r % 3] for r in range(n)])
        ps = [SamplingParams(float(T[r]), int(K[r]), float(P[r]), seed=r) for r in range(n)]
        keys = row_keys(ps, list(range(n)), 1)
        for bm, im in ((None, None), (mask, None), (mask, id_map)):
            want = sampling.lm_head_sample(x, wf, bm, keys, T, K, P, id_map=im)
            before = None if emu is None else emu.launches.copy()
            ids, probs = be.lm_head_sample(x, be.prepare_weight(head), None if bm is None else be.from_host(bm),
                                           keys=keys, temperature=T, top_k=K, top_p=P,
                                           id_map=None if im is None else be.from_host(im))
            what = f"{wd} V {V}, n {n}, special={special}, mask={bm is not None}, id_map={im is not None}"
            if emu is not None:
                ran = {k.split("<")[0] for k, c in (emu.launches - before).items() if c}
                assert ran == {"lm_head_topk_partial_kernel", "topk_sample_final_kernel"}, (ran, what)
            np.testing.assert_array_equal(be.to_host(ids), want[0], err_msg=f"drafts, {what}")
            np.testing.assert_allclose(be.to_host(probs), want[1], rtol=SAMPLE_RTOL, atol=0, err_msg=what)


@pytest.mark.parametrize("wd", FUSED_WDS)
@pytest.mark.parametrize("n", [1, 3, 7, 9])
@pytest.mark.parametrize("V", [31, 33, 257, 1000])
def test_fused_topk_sample_matches_the_reference(emu, be, wd, n, V):
    """check_fused_topk_sample_matches_reference over odd shapes, every exact weight kind, two
    chunks of rows at n = 9 (top_k up to 64 > the candidates of V = 31 / 33)."""
    check_fused_topk_sample_matches_reference(be, wd, n, V, emu)


def test_fused_topk_sample_cuts_and_falls_back(emu, be):
    """The top_k cut is seen (top_k = 1 gives the argmax with probability 1; a row's drafts over
    many keys stay within its top_k logits and cover more than one of them), a top_k past 64 or a
    row without top_k in the call takes the written logits, and dist asked does too."""
    rng = np.random.default_rng(8)
    n, V, H = 4, 1000, 32
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=0.1)
    head, logits = be.prepare_weight(w), REF.lm_head_logits(x, w)
    T = np.ones(n)
    top = np.argsort(-logits, axis=1, kind="stable")
    for k in (1, 3):
        K, P = np.full(n, k, np.int32), np.ones(n)
        seen = [set() for _ in range(n)]
        for step in range(12):
            ps = [SamplingParams(1.0, k, 1.0, seed=r) for r in range(n)]
            ids, probs = be.lm_head_sample(x, head, keys=row_keys(ps, [step] * n, 0), temperature=T, top_k=K,
                                           top_p=P)
            for r in range(n):
                assert int(be.to_host(ids)[r]) in top[r, :k]
                seen[r].add(int(be.to_host(ids)[r]))
            if k == 1:
                np.testing.assert_array_equal(be.to_host(ids), top[:, 0])
                np.testing.assert_array_equal(be.to_host(probs), np.ones(n, np.float32))
        if k == 3:
            assert all(len(s) > 1 for s in seen), seen              # logits within 0.1-ish: all three drawn
    keys = row_keys([SamplingParams(1.0, 0, 1.0, seed=r) for r in range(n)], [0] * n, 0)
    for K, dist in ((np.array([5, 65, 5, 5], np.int32), None), (np.array([5, 0, 5, 5], np.int32), None),
                    (np.full(n, 5, np.int32), be.xp.empty((n, V), np.float32))):
        before = emu.launches.copy()
        be.lm_head_sample(x, head, keys=keys, temperature=T, top_k=K, top_p=np.ones(n), dist=dist)
        ran = {k.split("<")[0] for k, c in (emu.launches - before).items() if c}
        assert "sample_kernel" in ran and "topk_sample_final_kernel" not in ran, (K, ran)


@pytest.mark.parametrize("wd", ["bf16", "fp8c", "nvfp4"])
def test_fused_sample_on_a_random_head(be, wd):
    """A random head (logits rounded differently by the reference's matmul: the drafts still
    agree, probs within the FP32 tolerance), two chunks of rows (n = 9), misaligned x."""
    rng = np.random.default_rng(9)
    n, V, H = 9, 701, 64
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=2 * H ** -0.5)
    wq, wf = stored(w, wd, (16, 32))
    T = rng.uniform(0.3, 2.0, n)
    ps = [SamplingParams(float(T[r]), 0, 1.0, seed=r) for r in range(n)]
    keys = row_keys(ps, [9] * n, 0)
    want = sampling.lm_head_sample(x, wf, None, keys, T, np.zeros(n, np.int32), np.ones(n))
    for xx in (x, misaligned(x)):
        ids, probs = fused_sample(be, xx, be.prepare_weight(wq), None, keys, T)
        np.testing.assert_array_equal(ids, want[0])
        assert_close(probs, want[1], "float32", f"fused draw's probabilities, {wd}")


def test_fused_sample_never_writes_the_logits(emu, be, monkeypatch):
    """A temperature-only call runs the fused pair (no linear_kernel, no sample_kernel) and
    allocates nothing of V floats per row; a call with a top_k row, or asking dist, takes the
    logits and sample_kernel; a wrong keying (the noise on the head row instead of the returned
    id under an id_map) would change the drafts: the reference itself keyed that way differs."""
    rng = np.random.default_rng(12)
    n, V, H = 3, 257, 32
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=0.5)
    head = be.prepare_weight(w)
    T = np.array([0.8, 1.0, 1.3])
    ps = [SamplingParams(float(t), 0, 1.0, seed=i) for i, t in enumerate(T)]
    keys = row_keys(ps, [4] * n, 1)
    sizes = []
    real_output = lm_launch.output

    def spy(out, name, shape, dtype):
        sizes.append((name, tuple(shape)))
        return real_output(out, name, shape, dtype)
    monkeypatch.setattr(lm_launch, "output", spy)
    before = emu.launches.copy()
    fused_sample(be, x, head, None, keys, T)
    ran = {k for k, c in (emu.launches - before).items() if c}
    assert ran == {"lm_head_sample_partial_kernel<float, 4>", "sample_final_kernel"}, ran
    assert sizes and all(np.prod(s) < n * V for _, s in sizes), sizes
    sizes.clear()
    before = emu.launches.copy()
    be.lm_head_sample(x, head, keys=keys, temperature=T, top_k=np.array([0, 5, 0], np.int32), top_p=np.ones(n))
    ran = {k.split("<")[0] for k, c in (emu.launches - before).items() if c}
    assert "sample_kernel" in ran and "lm_head_sample_partial_kernel" not in ran, ran
    assert max(np.prod(s) for _, s in sizes) == n * V              # the spy sees the logits when written
    before = emu.launches.copy()
    be.lm_head_sample(x, head, keys=keys, temperature=T, top_k=np.zeros(n, np.int32), top_p=np.ones(n),
                      dist=be.xp.empty((n, V), np.float32))
    assert "sample_kernel" in {k for k, c in (emu.launches - before).items() if c}


def test_fused_sample_keys_the_noise_on_the_returned_id(be):
    """Negative control: under an id_map the fused draw matches the reference's noise keyed on the
    returned (target) ids, and the draw keyed on the head rows (id_map's identity) differs in most
    rows: the comparison does see which id the noise is keyed on."""
    rng = np.random.default_rng(21)
    n, V, H = 7, 1000, 32
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=0.2)             # small logits: q spread wide
    id_map = np.sort(rng.permutation(4 * V)[:V]).astype(np.int32)
    T = np.ones(n)
    ps = [SamplingParams(1.0, 0, 1.0, seed=i) for i in range(n)]
    keys = row_keys(ps, [2] * n, 0)
    zeros, ones = np.zeros(n, np.int32), np.ones(n)
    want = sampling.lm_head_sample(x, w, None, keys, T, zeros, ones, id_map=id_map)[0]
    rows_keyed = id_map[sampling.lm_head_sample(x, w, None, keys, T, zeros, ones)[0]]
    got = fused_sample(be, x, be.prepare_weight(w), None, keys, T, id_map)[0]
    np.testing.assert_array_equal(got, want)
    assert (got != rows_keyed).sum() >= n // 2


def test_fused_sample_rows_without_a_candidate_raise(be):
    rng = np.random.default_rng(4)
    n, V, H = 3, 33, 16
    x, w = rnd(rng, n, H), rnd(rng, V, H)
    mask = np.full((n, 2), -1, np.int32)
    mask[1] = 0
    ps = [SamplingParams(1.0, 0, 1.0, seed=i) for i in range(n)]
    with pytest.raises(NoAllowedToken, match="row 1: .*grammar"):
        fused_sample(be, x, be.prepare_weight(w), mask, row_keys(ps, [0] * n, 0), np.ones(n))
    with pytest.raises(ValueError, match="temperature: expected finite values > 0"):
        fused_sample(be, x, be.prepare_weight(w), None, row_keys(ps, [0] * n, 0), np.array([1.0, 0.0, 1.0]))


_LOGITS = [-3.0, -2.25, -1.5, -0.75, 0.0, 0.5, 1.0, 1.25, 2.0, 2.5]
_BIAS = [-0.5, -0.125, 0.0, 0.25, 0.5]


@pytest.mark.parametrize("E,spec", [
    (256, RouterSpec(8, 8, 4, 2.5, True)), (1000, RouterSpec(6, 8, 3, 1.0, True)),
    (1024, RouterSpec(16, 16, 16, 1.0, False)), (160, RouterSpec(6, 1, 1, 16.0, False, "softmax")),
    (96, RouterSpec(8, 32, 4, 1.0, True)), (33, RouterSpec(3, 3, 2, 1.0, True, "softmax")),
    (256, RouterSpec(8, 1, 1, 1.5, True, "sqrtsoftplus")), (1000, RouterSpec(6, 8, 3, 1.0, True, "sqrtsoftplus"))])
def test_router_large(be, E, spec):
    """Up to 1024 experts (a thread each), exact logits from an identity gate, many exact ties."""
    rng = np.random.default_rng(E)
    logits = rng.choice(_LOGITS, (5, E)).astype(np.float32)
    bias = rng.choice(_BIAS, E).astype(np.float32)
    gate = np.eye(E, dtype=np.float32)
    ids, w = be.moe_router(logits, be.prepare_weight(gate), bias, spec)
    ids_ref, w_ref = REF.moe_router(logits, gate, bias, spec)
    np.testing.assert_array_equal(ids, ids_ref)
    assert_close(w, w_ref, "float32", "router weights")


@pytest.mark.parametrize("wd,ctype", [("bf16", "__nv_bfloat16"), ("f32", "float"), ("fp8", "__nv_fp8_e4m3")])
@pytest.mark.parametrize("E,spec", [
    (256, RouterSpec(8, 8, 4, 2.5, True)), (1000, RouterSpec(6, 8, 3, 1.0, True)),
    (160, RouterSpec(6, 1, 1, 16.0, False, "softmax")), (33, RouterSpec(3, 3, 2, 1.0, True, "softmax")),
    (384, RouterSpec(6, 1, 1, 1.5, True, "sqrtsoftplus"))])
def test_router_one_row_selects_in_the_last_block(emu, be, wd, ctype, E, spec):
    """One row: moe_router_kernel alone (the logits' GEMV, then the selection in the block that
    finishes last, 128 threads over up to 1000 experts), in every block order; ids as the
    reference and as the two-launch path gives that row, weights close to both; the caller's
    ticket is zero again after each launch (a second launch on it is right too), the logits
    workspace holds the row's logits."""
    rng = np.random.default_rng(E)
    H = 24
    x = rnd(rng, 2, H)
    gate, f_gate = stored(rnd(rng, E, H, scale=H ** -0.5), wd, (8, 8))
    gate = be.prepare_weight(gate)
    bias = (rng.integers(-3, 3, size=E) * 0.125).astype(np.float32)
    ids_ref, w_ref = REF.moe_router(x[:1], f_gate, bias, spec)
    two_ids, two_w = be.moe_router(x, gate, bias, spec)               # n = 2: linear + select
    ticket, logits = np.zeros(1, np.uint32), np.zeros((1, E), np.float32)
    try:
        for order, seed in (("forward", 1), ("reverse", 1), ("shuffle", 3)):
            emu.set_order(order, seed)
            for _ in range(2):
                before = emu.launches.copy()
                ids, w = be.moe_router(x[:1], gate, bias, spec, ticket=ticket, logits=logits)
                ran = {k for k, c in (emu.launches - before).items() if c}
                assert ran == {f"moe_router_kernel<{ctype}, false>"}, ran
                assert ticket[0] == 0
                np.testing.assert_array_equal(ids, ids_ref)
                np.testing.assert_array_equal(ids[0], two_ids[0])
                assert_close(w, w_ref, "float32", "router weights, one row")
                assert_close(w[0], two_w[0], "float32", "router weights, one row against two")
                assert_close(logits, x[:1] @ f_gate.T, "float32", "router logits")
    finally:
        emu.set_order(*emu_backend.order_from_env())
    with pytest.raises(ValueError, match="ticket"):
        be.moe_router(x[:1], gate, bias, spec, ticket=np.zeros(2, np.uint32))
    with pytest.raises(TypeError, match="ticket"):
        be.moe_router(x[:1], gate, bias, spec, ticket=np.zeros(1, np.int32))


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("nan_at", [[3], [0, 5, 6, 7], list(range(16))])
def test_router_nan_scores(be, scoring, nan_at):
    """NaN scores rank after every number (as the reference's argsort) and every id slot
    is written: the kernel once left slots unwritten here (found by this emulator)."""
    rng = np.random.default_rng(len(nan_at))
    E, n, H = 16, 3, 8
    spec = RouterSpec(6, 4, 2, 1.0, True, scoring)
    x = rnd(rng, n, H)
    x[2] = np.nan
    gate = rnd(rng, E, H)
    gate[nan_at] = np.nan
    bias = (rng.integers(-3, 3, size=E) * 0.25).astype(np.float32)
    with np.errstate(invalid="ignore"):
        ids_ref, w_ref = REF.moe_router(x, gate, bias, spec)
    ids, w = be.moe_router(x, be.prepare_weight(gate), bias, spec, ids=np.full((n, 6), 77, np.int32),
                           weights=np.zeros((n, 6), np.float32))
    np.testing.assert_array_equal(ids, ids_ref)
    assert_close(w, w_ref, "float32", "router weights")


@pytest.mark.parametrize("wd", ["bf16", "f32", "fp8"])
@pytest.mark.parametrize("n,E,K,H,I", [(1, 128, 8, 64, 16), (16, 128, 8, 32, 24), (17, 128, 8, 40, 16),
                                       (256, 16, 4, 16, 8), (40, 3, 2, 24, 5), (9, 64, 1, 8, 8)])
def test_experts_shapes(be, wd, n, E, K, H, I):
    """Few hot experts (many pairs per expert, more than 8 per pass), slots by pair and by expert."""
    rng = np.random.default_rng(n * E + K)
    x = rnd(rng, n, H)
    hot = rng.choice(E, min(E, K + 3), replace=False)
    ids = np.stack([rng.choice(hot, K, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.random((n, K)).astype(np.float32)
    (w13, f13), (w2, f2) = (stored(rnd(rng, E, 2 * I, H, scale=H ** -0.5), wd, (8, 16)),
                            stored(rnd(rng, E, H, I, scale=I ** -0.5), wd, (8, 16)))
    res = rnd(rng, n, H)
    got = be.moe_experts(x, ids, wts, be.prepare_weight(w13), be.prepare_weight(w2), res)
    want = REF.moe_experts(x, ids, wts, f13, f2, res)
    assert_close(got, want, "float32", "moe_experts")


def test_experts_invalid_ids_add_nothing(be):
    rng = np.random.default_rng(3)
    n, E, K, H, I = 3, 4, 2, 16, 8
    x = rnd(rng, n, H)
    ids = np.array([[0, -1], [4, 1], [1, 0]], np.int32)
    w13, w2 = rnd(rng, E, 2 * I, H), rnd(rng, E, H, I)
    got = be.moe_experts(x, ids, np.ones((n, K), np.float32), be.prepare_weight(w13), be.prepare_weight(w2))
    want = np.zeros((n, H), np.float32)
    for r in range(n):
        for k in range(K):
            if 0 <= ids[r, k] < E:
                want[r] += REF.moe_experts(x[r:r + 1], ids[r:r + 1, k:k + 1], np.ones((1, 1), np.float32), w13, w2)[0]
    assert_close(got, want, "float32", "moe_experts with invalid ids")


@pytest.mark.parametrize("wd,ctype", [("bf16", "__nv_bfloat16"), ("f32", "float"), ("fp8", "__nv_fp8_e4m3"),
                                      ("fp8c", "__nv_fp8_e4m3")])
def test_experts_one_row_fuses_the_combine(emu, be, wd, ctype):
    """One row: the gate/up pass and moe_down_combine_kernel, two launches (partial never
    written); an odd H (the last warp's second row absent), an id outside [0, E) adding
    nothing, out given as the residual itself; as the reference, and bitwise as the two-row
    path computes that row (the same dots, summed in k order)."""
    rng = np.random.default_rng(11)
    E, K, H, I = 16, 4, 37, 24
    x = rnd(rng, 2, H)
    ids = np.array([[3, -1, 15, 7], [3, -1, 15, 7]], np.int32)
    wts = rng.random((2, K)).astype(np.float32)
    (w13, f13), (w2, f2) = (stored(rnd(rng, E, 2 * I, H, scale=H ** -0.5), wd, (8, 16)),
                            stored(rnd(rng, E, H, I, scale=I ** -0.5), wd, (8, 16)))
    w13, w2 = be.prepare_weight(w13), be.prepare_weight(w2)
    res = rnd(rng, 2, H)
    want = res[:1].copy()
    for k in (0, 2, 3):
        want += wts[0, k] * REF.moe_experts(x[:1], ids[:1, k:k + 1], np.ones((1, 1), np.float32), f13, f2)
    two = be.moe_experts(x, ids, wts, w13, w2, res.copy())           # the n > 1 path: down + combine
    partial = np.full((K, H), 7.0, np.float32)
    y = res[:1].copy()
    before = emu.launches.copy()
    got = be.moe_experts(x[:1], ids[:1], wts[:1], w13, w2, y, out=y, partial=partial)
    ran = {k for k, c in (emu.launches - before).items() if c}
    assert ran == {f"moe_expert_kernel<{ctype}, true, 1, false>", f"moe_down_combine_kernel<{ctype}>"}, ran
    assert got is y and (partial == 7.0).all()
    assert_close(got, want, "float32", "moe_experts, one row")
    np.testing.assert_array_equal(got[0], two[0])


@pytest.mark.parametrize("interleave,rope_scale", [(False, 1.0), (True, 1.0), (True, 0.7), (False, 1.4)])
@pytest.mark.parametrize("n,Hq,Hkv,D,R", [(3, 12, 2, 128, 64), (2, 8, 8, 64, 64), (5, 3, 1, 80, 2), (1, 2, 1, 7, 6),
                                         (13, 5, 1, 72, 70)])
def test_rope_shapes(be, n, Hq, Hkv, D, R, interleave, rope_scale):
    rng = np.random.default_rng(D + R)
    NB, BS = 5, 3
    qkv = rnd(rng, n, (Hq + 2 * Hkv) * D, scale=2.0)
    qn, kn = rnd(rng, D), rnd(rng, D)
    invf = inv_freq(R, 1e6)
    pos = rng.integers(0, 100_000, n).astype(np.int32)
    slots = rng.choice(NB * BS, n, replace=False).astype(np.int32)
    k, v = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
    kr, vr = np.zeros((NB, BS, Hkv, D), np.float32), np.zeros((NB, BS, Hkv, D), np.float32)
    kw = dict(interleave=interleave, rope_scale=rope_scale)                  # lanes past 32 pairs: R = 70
    q = be.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, invf, pos, k, v, slots, **kw)
    qr = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, qn, kn, 1e-6, invf, pos, kr, vr, slots, **kw)
    assert_close(q, qr, "float32", "q")
    b, o = slots // BS, slots % BS
    if be.kv_dtype == np.float32:
        assert_close(be.kv_to_host(k)[b, o], kr[b, o], "float32", "k")
        np.testing.assert_array_equal(be.kv_to_host(v)[b, o], vr[b, o])
    else:   # V is a pure conversion (round to nearest even, as ml_dtypes): exact
        np.testing.assert_array_equal(be.kv_to_host(v)[b, o], vr[b, o].astype(BF16).astype(np.float32))
        assert_close(be.kv_to_host(k)[b, o], kr[b, o], "bfloat16", "k")


@pytest.mark.parametrize("wd", ["bf16", "f32"])
@pytest.mark.parametrize("n,H", [(1, 64), (3, 4096), (2, 36), (4, 17)])
def test_mtp_input_shapes(be, wd, n, H):
    rng = np.random.default_rng(H + n)
    V = 11
    embed, eh = rnd(rng, V, H), rnd(rng, H, 2 * H, scale=(2 * H) ** -0.5)
    if wd == "bf16":
        embed, eh = embed.astype(BF16), eh.astype(BF16)
    toks = rng.integers(0, V, n).astype(np.int32)
    g, ew, hw = rnd(rng, n, H), rnd(rng, H), rnd(rng, H)
    ef, ehf = np.asarray(embed, np.float32), np.asarray(eh, np.float32)
    got = be.mtp_input(be.prepare_weight(embed), toks, g, ew, hw, be.prepare_weight(eh), 1e-5)
    assert_close(got, REF.mtp_input(ef, toks, g, ew, hw, ehf, 1e-5), "float32", "mtp_input")
    bad = toks.copy()
    bad[0] = V                                   # a token past the vocabulary: a NaN row, no stray read
    assert np.isnan(be.mtp_input(be.prepare_weight(embed), bad, g, ew, hw, be.prepare_weight(eh), 1e-5)[0]).all()


def test_rmsnorm_views(be):
    rng = np.random.default_rng(0)
    for n, H in ((2, 4096), (3, 36), (1, 5)):
        x, w = rnd(rng, n, H), rnd(rng, H)
        want = REF.rmsnorm(x, w, 1e-6)
        for xv in (x, misaligned(x)):
            assert_close(be.rmsnorm(xv, w, 1e-6), want, "float32", "rmsnorm")
            out = misaligned(np.zeros_like(x))
            be.rmsnorm(xv, misaligned(w), 1e-6, out=out)
            assert_close(out, want, "float32", "rmsnorm out=")
        y = x.copy()
        be.rmsnorm(y, w, 1e-6, out=y)
        assert_close(y, want, "float32", "rmsnorm in place")


def test_copy_segments(emu):
    """Aligned (16-byte) and scalar segments, empty ones, odd lengths."""
    rng = np.random.default_rng(0)
    src, dst = rnd(rng, 1000), np.zeros(1000, np.float32)
    a, d = src.ctypes.data, dst.ctypes.data
    segs = [(a, d, 0), (a + 4, d + 4, 5), (a + 64, d + 64, 8), (a + 400, d + 804, 300), (a + 40, d + 2004, 1)]
    step_launch.copy_segments(np.array(segs, np.int64))
    want = np.zeros(1000, np.float32)
    for s, t, w in segs:
        want[(t - d) // 4:(t - d) // 4 + w] = src[(s - a) // 4:(s - a) // 4 + w]
    np.testing.assert_array_equal(dst, want)


def _huge_zeros(shape, dtype):
    """A zeroed array past 2^31 elements; pages are only backed where written."""
    try:
        return np.zeros(shape, dtype)
    except MemoryError:
        pytest.skip(f"cannot map {np.prod(shape) * np.dtype(dtype).itemsize / 2**30:.1f} GiB of address space here")


def test_expert_weights_past_2_31_elements(be):
    """w13 of 130 experts x [4096, 4096] BF16: expert 129 starts 2.16e9 elements in (64-bit offsets)."""
    E, I, H = 130, 2048, 4096
    w13, w2 = _huge_zeros((E, 2 * I, H), np.uint16), _huge_zeros((E, H, I), np.uint16)
    rng = np.random.default_rng(0)
    last = (E - 1, E - 2)
    for e in last:
        w13[e] = rnd(rng, 2 * I, H, scale=H ** -0.5).astype(BF16).view(np.uint16)
        w2[e] = rnd(rng, H, I, scale=I ** -0.5).astype(BF16).view(np.uint16)
    x = rnd(rng, 1, H)
    ids, wts = np.array([last], np.int32), np.array([[0.7, 0.3]], np.float32)
    got = be.moe_experts(x, ids, wts, w13, w2)
    small = [a[E - 2:].view(BF16).astype(np.float32) for a in (w13, w2)]
    assert_close(got, REF.moe_experts(x, ids - (E - 2), wts, *small), "float32", "moe_experts (E*2I*H > 2^31)")


def test_kv_cache_past_2_31_elements(emu):
    """A BF16 KV cache of 2^31 + 4096 elements: RoPE writes and attention reads at its end."""
    be = emu_backend.backend("bfloat16")
    BS, Hkv, D, Hq = 16, 1, 128, 4
    NB = 2**31 // (BS * Hkv * D) + 2
    k, v = _huge_zeros((NB, BS, Hkv, D), np.uint16), _huge_zeros((NB, BS, Hkv, D), np.uint16)
    rng = np.random.default_rng(1)
    blocks = np.array([NB - 1, 3, NB - 2], np.int32)            # table of one sequence, 3 blocks
    n = 3 * BS
    slots = (blocks[np.arange(n) // BS] * BS + np.arange(n) % BS).astype(np.int32)
    qkv = rnd(rng, n, (Hq + 2 * Hkv) * D)
    invf = inv_freq(D, 1e4)
    pos = np.arange(n, dtype=np.int32)
    q = be.qk_norm_rope_kv_write(qkv, Hq, Hkv, None, None, 1e-6, invf, pos, k, v, slots)
    row_len = np.array([n, n - 5, 1], np.int32)
    got = be.paged_attention(q[:3], k, v, blocks[None, :], np.zeros(3, np.int32), row_len, D ** -0.5)
    # the reference on a small cache holding the same three blocks
    small_k, small_v = (np.stack([a[b].view(BF16).astype(np.float32) for b in blocks]) for a in (k, v))
    kr, vr = np.zeros_like(small_k), np.zeros_like(small_v)
    qr = REF.qk_norm_rope_kv_write(qkv, Hq, Hkv, None, None, 1e-6, invf, pos, kr, vr,
                                   np.arange(n, dtype=np.int32))
    assert_close(small_k, kr, "bfloat16", "K rows written past 2^31 elements")
    np.testing.assert_array_equal(small_v, vr.astype(BF16).astype(np.float32))
    want = REF.paged_attention(qr[:3], small_k, small_v, np.arange(3, dtype=np.int32)[None, :],
                               np.zeros(3, np.int32), row_len, D ** -0.5)
    assert_close(got, want, "bfloat16", "attention over a cache past 2^31 elements")


# -- every instantiation, any order ---------------------------------------------------------------

def _every_kernel(seed: int) -> dict[str, np.ndarray]:
    """Runs every op so that every instantiation in loader.NAME_EXPRESSIONS launches; -> outputs."""
    rng = np.random.default_rng(seed)
    out = {}
    x = rnd(rng, 5, 64)
    for wd in ("bf16", "f32", "fp8", "fp4", "nvfp4"):
        def w(*shape, _wd=wd):
            return stored(rnd(rng, *shape, scale=shape[-1] ** -0.5), _wd, (16, 32))[0]
        be = emu_backend.backend()
        pw = be.prepare_weight
        for n in (1, 2, 3, 5):                                  # the GEMV kernels' NR = 1, 2, 4, 8
            xn, t = x[:n], f"{wd} n={n}"
            out[f"linear {t}"] = be.linear(xn, pw(w(33, 64)), rnd(rng, 33), rnd(rng, n, 33))
            embed = stored(rnd(rng, 11, 64), "f32" if wd == "f32" else "bf16")[0]      # never FP8
            out[f"mtp_input {t}"] = be.mtp_input(pw(embed), np.array([1, 10, 0, 3, 3][:n], np.int32), xn,
                                                 rnd(rng, 64), rnd(rng, 64), pw(w(64, 128)), 1e-5)
            out[f"swiglu {t}"] = be.swiglu_mlp(xn, pw(w(48, 64)), pw(w(64, 24)), xn)
            g = rnd(rng, 64)                                     # the NORM instantiations (norm=)
            out[f"linear norm {t}"] = be.linear(xn, pw(w(33, 64)), None, None, norm=(g, 1e-6))
            out[f"swiglu norm {t}"] = be.swiglu_mlp(xn, pw(w(48, 64)), pw(w(64, 24)), xn, norm=(g, 1e-6))
            if n > 3:   # BF16 at 4+ rows takes gemm_tc when K % 8 == 0: K = 60 keeps NR = 4, 8 launched
                x60 = np.ascontiguousarray(xn[:, :60])
                out[f"linear K60 {t}"] = be.linear(x60, pw(w(33, 60)), rnd(rng, 33), rnd(rng, n, 33))
                out[f"linear norm K60 {t}"] = be.linear(x60, pw(w(33, 60)), None, None, norm=(g[:60].copy(), 1e-6))
                out[f"swiglu K60 {t}"] = be.swiglu_mlp(x60, pw(w(48, 60)), pw(w(60, 24)), x60)
                out[f"swiglu norm K60 {t}"] = be.swiglu_mlp(x60, pw(w(48, 60)), pw(w(60, 24)), x60,
                                                            norm=(g[:60].copy(), 1e-6))
            mask = rng.integers(-2**31, 2**31, (n, 5), dtype=np.int64).astype(np.int32)
            mask[:, 0] |= 1
            head = pw(w(130, 64))
            out[f"lm_head {t}"] = be.lm_head_argmax(xn, head, mask)
            out[f"lm_head conf {t}"] = np.full(n, np.nan, np.float32)                 # the CONF instantiations
            out[f"lm_head conf ids {t}"] = be.lm_head_argmax(xn, head, mask, conf=out[f"lm_head conf {t}"])
            out[f"lm_head topk ids {t}"], out[f"lm_head topk probs {t}"] = be.lm_head_topk(xn, head, mask, 4)
            sp = [SamplingParams(0.9, (0, 3)[i % 2], (1.0, 0.8, 0.5)[i % 3], seed=i) for i in range(n)]
            out[f"lm_head sample dist {t}"] = np.empty((n, 130), np.float32)
            out[f"lm_head sample ids {t}"], out[f"lm_head sample probs {t}"] = be.lm_head_sample(
                xn, head, mask, keys=row_keys(sp, [7] * n, 0), temperature=np.full(n, 0.9),
                top_k=np.array([p.top_k for p in sp], np.int32), top_p=np.array([p.top_p for p in sp]),
                dist=out[f"lm_head sample dist {t}"])
            out[f"lm_head fused sample ids {t}"], out[f"lm_head fused sample probs {t}"] = be.lm_head_sample(
                xn, head, mask, keys=row_keys(sp, [8] * n, 0), temperature=np.full(n, 0.9),
                top_k=np.zeros(n, np.int32), top_p=np.ones(n))                   # temperature only: fused
            out[f"lm_head fused topk ids {t}"], out[f"lm_head fused topk probs {t}"] = be.lm_head_sample(
                xn, head, mask, keys=row_keys(sp, [9] * n, 0), temperature=np.full(n, 0.9),
                top_k=np.array([5, 64, 1, 7, 2][:n], np.int32), top_p=np.array([1.0, 0.8, 1.0, 0.5, 0.9][:n]))
            ids, wts = be.moe_router(xn, pw(w(32, 64)), rnd(rng, 32), RouterSpec(4, 4, 2, 2.0, True))
            out[f"router {t}"] = ids
            out[f"router norm {t}"] = be.moe_router(xn, pw(w(32, 64)), rnd(rng, 32), RouterSpec(4, 4, 2, 2.0, True),
                                                    norm=(g, 1e-6))[0]
            e13, e2 = rnd(rng, 32, 48, 64, scale=0.125), rnd(rng, 32, 64, 24, scale=24 ** -0.5)
            w13, w2 = (pw(stored(a, wd, (16, 32))[0]) for a in (e13, e2))
            out[f"experts by pair {t}"] = be.moe_experts(xn, ids, wts, w13, w2, xn)      # n*K <= 20 <= E
            out[f"experts norm {t}"] = be.moe_experts(xn, ids, wts, w13, w2, xn, norm=(g, 1e-6))
            u13 = pw(stored(e13[:, :24], wd, (16, 32))[0])                       # relu2: the up rows alone
            out[f"experts relu2 {t}"] = be.moe_experts(xn, ids, wts, u13, w2, xn, activation="relu2")
            out[f"experts relu2 norm {t}"] = be.moe_experts(xn, ids, wts, u13, w2, xn, norm=(g, 1e-6),
                                                            activation="relu2")
            out[f"mlp relu2 {t}"] = be.swiglu_mlp(xn, pw(w(24, 64)), pw(w(64, 24)), xn, activation="relu2")
            situ = {"activation": "situ", "situ_beta": 2.0, "situ_linear_beta": 3.0}     # Kimi K3's SiTU
            out[f"experts situ {t}"] = be.moe_experts(xn, ids, wts, w13, w2, xn, **situ)
            out[f"experts situ norm {t}"] = be.moe_experts(xn, ids, wts, w13, w2, xn, norm=(g, 1e-6), **situ)
            out[f"mlp situ {t}"] = be.swiglu_mlp(xn, pw(w(48, 64)), pw(w(64, 24)), xn, **situ)
            out[f"mlp situ norm {t}"] = be.swiglu_mlp(xn, pw(w(48, 64)), pw(w(64, 24)), xn, norm=(g, 1e-6), **situ)
            if n > 3:                                                            # gemm_tc's SiTU (BF16)
                out[f"mlp situ K60 {t}"] = be.swiglu_mlp(x60, pw(w(48, 60)), pw(w(60, 24)), x60, **situ)
                out[f"mlp situ norm K60 {t}"] = be.swiglu_mlp(x60, pw(w(48, 60)), pw(w(60, 24)), x60,
                                                              norm=(g[:60].copy(), 1e-6), **situ)
            hot = np.array([[1, 2, 3, 4]] * n, np.int32)
            w13, w2 = (pw(stored(a[:4], wd, (16, 32))[0]) for a in (e13, e2))
            out[f"experts by expert {t}"] = be.moe_experts(xn, hot, wts, w13, w2)
    xt = rnd(rng, 32, 64)
    wt = emu_backend.backend().prepare_weight(stored(rnd(rng, 40, 64, scale=0.125), "bf16")[0])
    for rows in (8, 16, 24, 32):                                                        # NT = 1 .. 4
        for norm in (None, (rnd(rng, 64), 1e-6)):
            out[f"gemm_tc {rows} {norm is None}"] = gemm_tc_launch.gemm_tc(xt[:rows], wt, rnd(rng, 40), norm=norm)
            out[f"swiglu_tc {rows} {norm is None}"] = gemm_tc_launch.swiglu_tc(xt[:rows], wt, limit=1.5, norm=norm)
            out[f"situ_tc {rows} {norm is None}"] = gemm_tc_launch.swiglu_tc(
                xt[:rows], wt, norm=norm, activation="situ", situ_beta=2.0, situ_linear_beta=3.0)
    out["rmsnorm"] = emu_backend.backend().rmsnorm(x, rnd(rng, 64), 1e-6)
    fused = rnd(rng, 5, 80)
    out["sigmoid_gate"] = emu_backend.backend().sigmoid_gate(x, fused[:, 8:16])
    out["sigmoid_gate residual"] = emu_backend.backend().sigmoid_gate(x, fused[:, 70:71], x)
    for il in (False, True):                                 # rope_heads_kernel<INTERLEAVE, INVERSE>
        for inv in (False, True):
            out[f"rope_heads {il} {inv}"] = emu_backend.backend().rope_heads(
                rnd(rng, 3, 5, 40), np.array([0, 9, 7000], np.int32), inv_freq(12, 1e4), interleave=il,
                rope_scale=1.25, inverse=inv)
    be = emu_backend.backend()
    for td in ("f32", "bf16"):                  # hc.cu: streams FP32 / BF16 bits; hc_post's MR = 4, 16
        def act(*shape, _td=td):
            a = rnd(rng, *shape)
            return a if _td == "f32" else a.astype(ml_dtypes.bfloat16).view(np.uint16)
        for m in (4, 6):
            H = 40
            X = act(3, m * H)
            u, post, comb = be.hc_pre(X, rnd(rng, 3, (2 + m) * m), rnd(rng, (2 + m) * m), rnd(rng, 3) + 1,
                                      1e-6, 3)
            out[f"hc_pre {td} {m}"] = u
            out[f"hc_head {td} {m}"] = be.hc_head(X, rnd(rng, 3, m), rnd(rng, m), rnd(rng, 1) + 1, 1e-6)
            for fd in ("f32", "bf16"):
                f = rnd(rng, 3, H) if fd == "f32" else rnd(rng, 3, H).astype(ml_dtypes.bfloat16).view(np.uint16)
                out[f"hc_post {td} {fd} {m}"] = be.hc_post(f, X, post, comb)
    for kv in KV_DTYPES + ("fp8",):                                   # fp8: codes and their scale planes
        be = emu_backend.backend(kv)
        for D in (48, 128, 256):                                                        # DC = 2, 4, 8
            NB, BS, Hkv, Hq = 24, 16, 2, 4
            k, v = be.empty_kv(NB, BS, Hkv, D), be.empty_kv(NB, BS, Hkv, D)
            sc = ({"k_scale": be.empty_kv_scales(NB, BS, Hkv), "v_scale": be.empty_kv_scales(NB, BS, Hkv)}
                  if kv == "fp8" else {})
            n = NB * BS
            q = be.qk_norm_rope_kv_write(rnd(rng, n, (Hq + 2 * Hkv) * D), Hq, Hkv, rnd(rng, D), rnd(rng, D), 1e-6,
                                         inv_freq(D // 2, 1e4), np.arange(n, dtype=np.int32), k, v,
                                         rng.permutation(n).astype(np.int32), **sc)
            if kv == "fp8":                                   # interleaved pairs, without q / k norms
                out[f"kv write interleave {kv} {D}"] = be.qk_norm_rope_kv_write(
                    rnd(rng, 3, (Hq + 2 * Hkv) * D), Hq, Hkv, None, None, 1e-6, inv_freq(D // 2, 1e4),
                    np.arange(3, dtype=np.int32), k, v, np.arange(3, dtype=np.int32), interleave=True, **sc)
            tables = rng.permutation(NB).astype(np.int32).reshape(2, 12)
            out[f"attention {kv} {D}"] = be.paged_attention(q[:4], k, v, tables, np.array([0, 1, 1, 0], np.int32),
                                                            np.array([192, 1, 100, 17], np.int32), D ** -0.5, **sc)
            out[f"attention window sinks {kv} {D}"] = be.paged_attention(
                q[:4], k, v, tables, np.array([0, 1, 1, 0], np.int32), np.array([192, 1, 100, 17], np.int32),
                D ** -0.5, row_start=np.array([60, 0, 99, 3], np.int32), sinks=rnd(rng, Hq), **sc)
            if kv == "bfloat16":                 # the FP32-FMA kernel over BF16 (the launcher takes the tc one)
                from mtpkern.backends.cuda_launch import attention as attn_launch
                base = attn_launch.plan(Hq // Hkv, D, 12 * BS, work=2 * Hkv, target_blocks=2, rows=4,
                                        smem_max=227 * 1024)
                scalar = dataclasses.replace(base, variant="scalar", smem_bytes=attn_launch.smem_bytes(
                    D, D, base.dc, base.heads, base.rows, base.stages, 2, "scalar"))
                out[f"attention scalar {kv} {D}"] = be.to_host(attn_launch.paged_attention(
                    q[:4], k, v, tables, np.array([0, 1, 1, 0], np.int32), np.array([192, 1, 100, 17], np.int32),
                    D ** -0.5, attention_plan=scalar))
                if D < 256:                      # 16 query heads x 2 rows: the tc kernel's two m-tiles
                    q16 = rnd(rng, 4, 16 * Hkv, D)
                    out[f"attention tc m-tiles 2 {D}"] = be.paged_attention(
                        q16, k, v, tables, np.array([0, 0, 1, 1], np.int32), np.array([150, 151, 99, 100], np.int32),
                        D ** -0.5)
            out[f"kv {kv} {D}"] = np.concatenate([k.view(np.uint8).ravel(), v.view(np.uint8).ravel()])
        if kv == "fp8":                           # GQA's write and attention only: the rest refuses FP8 KV
            continue
        k, v = be.empty_kv(3, 4, 1, 14), be.empty_kv(3, 4, 1, 14)                     # interleaved pairs
        out[f"rope interleave {kv}"] = be.qk_norm_rope_kv_write(
            rnd(rng, 5, 4 * 14), 2, 1, rnd(rng, 14), None, 1e-6, inv_freq(10, 1e4),
            np.array([0, 7, 90, 3, 4000], np.int32), k, v, np.array([0, 11, 5, 2, 7], np.int32),
            interleave=True, rope_scale=1.25)
        for il in (False, True):                                               # VIsK: the key is the value
            k, v = be.empty_kv(3, 4, 1, 14), be.empty_kv(3, 4, 1, 14)
            out[f"rope v_is_k {kv} {il}"] = be.qk_norm_rope_kv_write(
                rnd(rng, 5, 3 * 14), 2, 1, rnd(rng, 14), rnd(rng, 14), 1e-6, inv_freq(10, 1e4),
                np.array([0, 7, 90, 3, 4000], np.int32), k, v, np.array([0, 11, 5, 2, 7], np.int32),
                interleave=il, v_is_k=True)
            out[f"rope v_is_k caches {kv} {il}"] = np.concatenate([c.view(np.uint8).ravel() for c in (k, v)])
        for il, (L, R, Hq, P, Dv) in zip((False, True), ((72, 16, 3, 24, 20), (300, 32, 17, 16, 24))):   # LPT 1, 2
            NB, BS = 12, 16
            n = NB * BS
            lc = be.empty_latent_kv(NB, BS, L + R)
            slots = rng.permutation(n).astype(np.int32)
            slots[-3:] = slots[:3]                                             # given twice: the later row wins
            qr = be.mla_latent_write(rnd(rng, n, L + R), rnd(rng, L), 1e-6, inv_freq(R, 1e4),
                                     np.arange(n, dtype=np.int32), lc, slots, q=rnd(rng, n, Hq, P + R),
                                     interleave=il, rope_scale=1.1)
            out[f"mla q {kv} {il}"] = qr
            out[f"mla cache {kv} {il}"] = lc.view(np.uint8).ravel()
            tables = rng.permutation(NB).astype(np.int32).reshape(2, 6)
            for wd in ("bf16", "f32"):
                w_uk, w_uv = (be.prepare_weight(stored(rnd(rng, Hq, d, L, scale=d ** -0.5), wd)[0]) for d in (P, Dv))
                out[f"mla attention {kv} {L} {wd}"] = be.mla_attention_absorbed(
                    qr[:4], w_uk, w_uv, lc, tables, np.array([0, 1, 1, 0], np.int32),
                    np.array([96, 1, 70, 17], np.int32), 0.2, row_start=np.array([0, 0, 9, 16], np.int32))
            if kv == "bfloat16":                                               # 16-head tiles: tensor cores
                Htc = 16 if L < 256 else 32
                w_uk, w_uv = (be.prepare_weight(stored(rnd(rng, Htc, d, L, scale=d ** -0.5), "bf16")[0])
                              for d in (P, Dv))
                out[f"mla attention tc {L}"] = be.mla_attention_absorbed(
                    rnd(rng, 4, Htc, P + R), w_uk, w_uv, lc, tables, np.array([0, 1, 1, 0], np.int32),
                    np.array([96, 1, 70, 17], np.int32), 0.2, row_start=np.array([0, 0, 9, 16], np.int32))
        for il in (False, True):                                               # DSA's indexer (dsa.cu)
            NB, BS, Di, Hi = 40, 64, 24, 3
            ic = be.empty_latent_kv(NB, BS, Di)
            n = NB * BS
            qi = be.dsa_key_write(rnd(rng, n, Di), rnd(rng, Di), rnd(rng, Di), 1e-6, inv_freq(8, 1e4),
                                  np.arange(n, dtype=np.int32), ic, rng.permutation(n).astype(np.int32),
                                  q=rnd(rng, n, Hi, Di), interleave=il, rope_scale=1.1)
            out[f"dsa q {kv} {il}"] = qi
            out[f"dsa cache {kv} {il}"] = ic.view(np.uint8).ravel()
            tables = rng.permutation(NB).astype(np.int32)[None]
            for cap, rows in ((1024, [1000, 700]), (5120, [5000, 2600]), (2560 * 4, [2560, 2400])):  # KPT 4, 16, 64
                tab = np.resize(tables, (1, cap // BS)) if cap > NB * BS else np.ascontiguousarray(tables[:, :cap // BS])
                out[f"dsa select {kv} {il} {cap}"] = be.dsa_select(
                    qi[:2], rnd(rng, 2, Hi), ic, tab, np.zeros(2, np.int32), np.array(rows, np.int32), 300, 0.2,
                    row_start=np.array([0, 17], np.int32))
        NB, BS, Di, Hi, P = 24, 16, 16, 2, 4                                  # the pooled indexer (GLM-5.3)
        pc = be.empty_latent_kv(NB, BS, 2 * Di)
        n = NB * BS
        qp = be.dsa_key_write(rnd(rng, n, Di), rnd(rng, Di), rnd(rng, Di), 1e-6, np.zeros(0, np.float32),
                              np.arange(n, dtype=np.int32), pc, rng.permutation(n).astype(np.int32),
                              q=rnd(rng, n, Hi, Di), gate=rnd(rng, n, Di))
        out[f"dsa pooled cache {kv}"] = pc.view(np.uint8).ravel()
        out[f"dsa pooled select {kv}"] = be.dsa_select(
            qp[:2], rnd(rng, 2, Hi), pc, rng.permutation(NB).astype(np.int32)[None], np.zeros(2, np.int32),
            np.array([n, 201], np.int32), 32, 0.2, kpool=P, ape=rnd(rng, P, Di))
    mma_args, _ = test_gpu.mma_probe_case(seed)
    out["mma probe"] = np.zeros((2, 16, 8), np.float32)
    step_launch.get_kernel("mma", "mma_bf16_probe_kernel")(          # (the emulator's get_kernel)
        (1,), (32,), (*mma_args, out["mma probe"], np.int32(0)))
    src, dst = rnd(rng, 64), np.zeros(64, np.float32)
    step_launch.copy_segments(np.array([(src.ctypes.data, dst.ctypes.data, 64)], np.int64))
    out["copy_segments"] = dst
    return out


def test_every_kernel_instantiation_runs(emu):
    before = emu.launches.copy()
    out = _every_kernel(0)
    ran = {n for n, c in (emu.launches - before).items() if c}
    missing = [n for names in loader.NAME_EXPRESSIONS.values() for n in names if n not in ran]
    assert not missing, f"instantiations no test launches: {missing}"
    for name, a in out.items():
        assert np.isfinite(a).all(), name


def test_results_do_not_depend_on_block_or_thread_order(emu):
    """The same launch on the same data gives the same bits in any block / thread order
    (docs/cuda.md: fixed summation order, no atomics)."""
    try:
        runs = {}
        for order, seed in (("forward", 1), ("reverse", 1), ("shuffle", 11), ("shuffle", 12)):
            emu.set_order(order, seed)
            runs[(order, seed)] = _every_kernel(5)
    finally:
        emu.set_order(*emu_backend.order_from_env())
    first = runs[("forward", 1)]
    for key, out in runs.items():
        for name, a in out.items():
            assert a.tobytes() == first[name].tobytes(), f"{name}: order {key} differs from forward"


# -- the proposer ------------------------------------------------------------------------------------

@pytest.fixture
def fake_runtime(emu, monkeypatch):
    """CUDA graphs through tests/test_cuda_graph_fake.py's runtime: a capture records the
    emulated launches (real kernels, copy_segments included), a replay runs them again."""
    rt = FakeRuntime()
    monkeypatch.setattr(cuda_graph, "_cupy", lambda: rt.cupy)
    monkeypatch.setattr(emu, "capture", lambda: rt.recording)
    return rt


@pytest.fixture(scope="module")
def mid_ckpt(tmp_path_factory):
    from mtpkern import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("mid"), tiny_config(**test_gpu.MID), seed=11)


#: (config, mode, kv): the mid-size config (D = 128, V = 4099, 16 experts) runs in draft
#: mode with BF16 KV by default (~7 s); its other cases are slow (up to ~20 s each)
PROPOSER_CASES = [pytest.param(c, m, kv, id=f"{c}-{m}-{kv}",
                               marks=[pytest.mark.slow] * (c == "mid" and (m, kv) != ("draft", "bfloat16")))
                  for c in ("tiny", "mid") for m in ("exact", "draft") for kv in KV_DTYPES]


@pytest.mark.parametrize("config,mode,kv", PROPOSER_CASES)
def test_proposer_matches_numpy_reference(fake_runtime, request, config, mode, kv):
    """tests/test_gpu.py's check: drafts, K/V rows and windows within tolerance of the
    NumPy reference (same KV dtype); CUDA graphs on."""
    if config == "tiny":
        ckpt_cfg = request.getfixturevalue("tiny_ckpt"), request.getfixturevalue("tiny_cfg")
    else:
        ckpt_cfg = request.getfixturevalue("mid_ckpt"), tiny_config(**test_gpu.MID)
    test_gpu.check_cuda_matches_numpy_reference(ckpt_cfg, mode, kv, emu_backend.backend(kv))


@pytest.mark.parametrize("B,want", [(1, 14), (4, 16)])
def test_launches_per_module_of_a_propose(emu, tiny_ckpt, tiny_cfg, B, want):
    """A draft-mode propose of M drafts on the tiny MoE config (shared experts): the norms
    that feed GEMVs fused into them, and at one row the router's selection in its GEMV and the
    experts' down pass and combine in one launch (docs/cuda.md, "Launches"): 14 launches a
    module at batch 1, 16 at batch 4."""
    from mtpkern import MultiModuleMtpHead

    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=emu_backend.backend(), kv_mode="draft",
                                              block_size=4, num_blocks=96)
    prop.step_runner = None                   # eager: the launches themselves, no capture
    rng = np.random.default_rng(0)
    H, V, M = tiny_cfg.hidden_size, tiny_cfg.vocab_size, tiny_cfg.num_modules
    sts = [prop.alloc_state() for _ in range(B)]
    for st in sts:
        prop.prefill_drafter(rng.integers(0, V, 9).tolist(), rnd(rng, 9, H), st)
    before = emu.launches.copy()
    prop.propose_batch(rng.integers(0, V, B).tolist(), rnd(rng, B, H), [9] * B, M, sts)
    ran = emu.launches - before
    assert sum(ran.values()) == want * M, sorted(ran.items())
    fused = {k for k in ran if k.startswith(("moe_down_combine_kernel", "moe_router_kernel"))}
    assert len(fused) == 2 * (B == 1) and ("moe_combine_kernel" in ran) == (B > 1), sorted(ran)
    assert ("moe_router_select_kernel" in ran) == (B > 1), sorted(ran)


@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("B", [1, 3])
def test_graph_replay_equals_eager(fake_runtime, tiny_ckpt, tiny_cfg, mode, B):
    """tests/test_gpu.py's check: captured and replayed steps give the eager path's drafts
    and KV bit for bit (grammar masks, NoAllowedToken rollback)."""
    test_gpu.check_graph_replay_equals_eager(tiny_ckpt, tiny_cfg, emu_backend.backend(), mode, B)
    assert fake_runtime.memcpys["h2d"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_graph_replay_equals_eager_mid(fake_runtime, mid_ckpt, mode):
    test_gpu.check_graph_replay_equals_eager(mid_ckpt, tiny_config(**test_gpu.MID), emu_backend.backend(), mode, 8)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_graph_plans_share_the_attention_workspace(fake_runtime, tiny_ckpt, tiny_cfg, mode):
    """Contexts long enough for split-KV partitions in the captured step: every plan
    carves its partials from the runner's one shared scratch (plans replay one at a time
    on one stream), and replays still equal the eager path."""
    H, V, M = tiny_cfg.hidden_size, tiny_cfg.vocab_size, tiny_cfg.num_modules
    be = emu_backend.backend()
    graph = test_gpu._make(tiny_ckpt, be, mode)
    eager = test_gpu._make(tiny_ckpt, be, mode, cuda_graphs=False)
    rng = np.random.default_rng(3)
    n = 150                                               # 10 blocks of 16: 3 partitions of 64
    toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
    sg, se = graph.alloc_state(), eager.alloc_state()
    graph.prefill_drafter(toks, hid, sg)
    eager.prefill_drafter(toks, hid, se)
    P, last, h = n, toks[-1], hid[-1]
    for k in (M, 1, M, 1):                                # the larger plan first, then a smaller one
        d = [p.propose(last, h, P, k, s) for p, s in ((graph, sg), (eager, se))]
        assert d[0] == d[1]
        for p, s in ((graph, sg), (eager, se)):
            p.after_verify(0, s)
        P, last, h = P + 1, int(rng.integers(0, V)), rng.standard_normal(H).astype(np.float32)
    runner = graph.step_runner
    with_ws = [pl for pl in runner.plans.values() if getattr(pl, "_attn_ws", None) is not None]
    assert len(with_ws) >= 2, "no plan split the KV into partitions"
    assert all(pl._attn_ws is runner._attn_ws for pl in with_ws)
    assert runner.counts["replayed"] >= 2, dict(runner.counts)


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    """Qwen3-Next in its release layout with two modules: output gates, the gated shared
    expert, softmax routing without a bias, the postnorm chain."""
    return qwen3_next._ckpt(tmp_path_factory.mktemp("qwen3next"), qwen3_next.QWEN2, seed=9)


def test_qwen3_next_module_computes_the_reference_forward(fake_runtime, qwen_ckpt):
    from safetensors.numpy import load_file

    rng = np.random.default_rng(5)
    cfg = qwen3_next.QWEN2
    toks = rng.integers(0, cfg.vocab_size, 6).astype(np.int32)
    g = rng.standard_normal((6, cfg.hidden_size)).astype(np.float32)
    want = qwen3_next.qwen3_next_mtp_rows(load_file(str(qwen_ckpt / "model.safetensors")), cfg, toks, g)
    prop = test_gpu._make(qwen_ckpt, emu_backend.backend("float32"), "exact")
    qwen3_next.check_head_forward(prop, toks, g, *want)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_qwen3_next_matches_numpy_reference_and_replays(fake_runtime, qwen_ckpt, mode):
    """The gated step in a captured graph (the gate columns of qkv, the shared expert's
    own buffers) equals the eager path, and both the NumPy reference."""
    cfg = qwen3_next.QWEN2
    test_gpu.check_cuda_matches_numpy_reference((qwen_ckpt, cfg), mode, "float32", emu_backend.backend("float32"))
    test_gpu.check_graph_replay_equals_eager(qwen_ckpt, cfg, emu_backend.backend(), mode, 2)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_step3p5_matches_numpy_reference_and_replays(fake_runtime, tmp_path, mode):
    """Step-3.5's release layout on the kernels: 8 sliding heads with a head-wise gate,
    a window of 6, dense blocks, a head per module."""
    from mtpkern import MtpConfig

    d = step3p5.release_config()
    ckpt = step3p5._ckpt(tmp_path, d, seed=5)
    cfg = MtpConfig.from_dict(d)
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32", emu_backend.backend("float32"))
    test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend(), mode, 2)


def test_step3p5_moe_mtp_layers_on_the_kernels(fake_runtime, tmp_path):
    """Step-3.5 MTP layers built as MoE (moe_layers_enum covering them; the trunk's packed
    expert tensors, router bias, shared expert, routed and shared clamps): the module's float64
    model, and the NumPy reference's drafts."""
    from safetensors.numpy import load_file

    from mtpkern import MtpConfig

    d = step3p5.moe_config()
    ckpt = step3p5._ckpt(tmp_path, d, seed=9)
    prop = test_gpu._make(ckpt, emu_backend.backend("float32"), "exact")
    raw = load_file(str(ckpt / "model.safetensors"))
    rng = np.random.default_rng(2)
    for m in (0, 2):                                          # the MoE modules
        toks, g = rng.integers(0, 301, 6).astype(np.int32), rng.standard_normal((6, 64)).astype(np.float32)
        want = step3p5.step3p5_mtp_rows(raw, d, m, toks, g)[0]
        head = prop.modules[m]
        seq = head.alloc_seq()
        y, _ = head.forward([step3p5.RowJob(seq, toks, 0, 1)], g)
        np.testing.assert_allclose(prop.backend.to_host(y), want, rtol=2e-4, atol=2e-4)
        head.free_seq(seq)
    test_gpu.check_cuda_matches_numpy_reference((ckpt, MtpConfig.from_dict(d)), "draft", "float32",
                                                emu_backend.backend("float32"))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mimo_v2_flash_on_the_kernels(fake_runtime, tmp_path, fp8):
    """MiMo-V2-Flash's release layout: sinks, v_head_dim 16 beside 24, RoPE on 8 dims, the
    value scale folded (into FP8 scales too); the module's float64 model, the NumPy
    reference's drafts and KV, graph replay == eager."""
    from mtpkern import MtpConfig

    d = mimo_v2.release_config(**({"quantization_config": mimo_v2.FP8} if fp8 else {}))
    ckpt = mimo_v2._ckpt(tmp_path, d, seed=6)
    cfg = MtpConfig.from_dict(d)
    if not fp8:
        from safetensors.numpy import load_file

        mimo_v2.check_modules(test_gpu._make(ckpt, emu_backend.backend("float32"), "exact"),
                              load_file(str(ckpt / "model.safetensors")), d)
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), "exact", "float32", emu_backend.backend("float32"))
    test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend(), "draft", 2)


@pytest.mark.parametrize("name", ["mixed", "window_sinks_dv_dense", "yarn_interleave", "rope_per_module", "mla",
                                  "mla_mixed", "v4_ffn", "mla_nope", "mla_gated"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_blocks_match_numpy_reference_and_replay(fake_runtime, tmp_path, name, mode):
    """Modules of different sizes and attention forms (tests/test_blocks.py) on the kernels:
    each module's buffers of its own shape in the captured step, a window's first rows
    staged per call, sinks, Dv < D, interleaved RoPE and YaRN (past its original context of
    12 positions), MLA modules (latent pools, their workspaces in the captured step) beside
    GQA ones; contexts longer than the windows; DeepSeek-V4's FFN (sqrtsoftplus routing, the
    clamps of the gate before silu); GLM-5.3's MLA without RoPE (mla_nope: latent rows of L alone);
    Kimi K3's gated MLA (mla_gated: R dims kept unrotated, the latent write reading its columns of
    kv_a | g_proj's output in place, the gate's columns through sigmoid_gate, both in the plan's rows)."""
    cfg = test_blocks.feature_config(name)
    from mtpkern import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=13)
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32", emu_backend.backend("float32"))
    test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend(), mode, 2)


@pytest.mark.parametrize("name", ["mla_nope_dsa", "gated_dsa"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_nope_mla_with_dsa_matches_numpy_reference(fake_runtime, tmp_path, name, mode):
    """GLM-5.3's MTP attention (tests/test_blocks.py's mla_nope_dsa: MLA with qk_rope_head_dim 0
    under DSA's indexer, nothing rotated) on the kernels against the NumPy reference: the latent
    and indexer writes with an empty inv_freq, the selection, the listed attention over rows of
    L values; proposes take the planned step (the lists' scores workspace and the listed
    attention's, sized by the plan) and none falls back. ``gated_dsa`` (tests/test_gated_mla.py):
    Kimi K3's gated MLA under the indexer, R = 8 dims kept by zero frequencies in both writes."""
    import test_gated_mla
    from mtpkern import write_synthetic_checkpoint

    cfg = (test_blocks.feature_config(name) if name != "gated_dsa" else tiny_config(**test_gated_mla.GATED_DSA))
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=13)
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32", emu_backend.backend("float32"))


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_pooled_dsa_planned_on_the_kernels(fake_runtime, tmp_path, mode):
    """GLM-5.3's block (NoPE MLA under the pooled indexer: pools of 2 keys with their gate
    scores in the plane, lists of index_topk + P - 1 with the tail) on the kernels against the
    NumPy reference, proposes taking the planned step: the pool scores' workspace [n, cap // P]
    and the listed attention's, sized by the plan."""
    import test_family_glm5_next
    from mtpkern import write_synthetic_checkpoint

    cfg = tiny_config(**test_family_glm5_next.G53)
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=13, dtype="float32")
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32", emu_backend.backend("float32"))


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_v4_attention_matches_numpy_reference(fake_runtime, tmp_path, window, mode):
    """DeepSeek-V4's attention (tests/test_v4_attention.py's V4_ATTN: the query's latent, K = V
    through qk_norm_rope_kv_write(v_is_k), sinks, the output unrotated by rope_heads(inverse),
    the grouped low-rank output), with and without a window, on the kernels against the NumPy
    reference; proposes take the planned step (its segment copies join the query's rows with
    k | v and split the output's groups)."""
    from mtpkern import write_synthetic_checkpoint

    cfg = tiny_config(**test_v4_attention.V4_ATTN, sliding_window=window)
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=17, dtype="float32")
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32", emu_backend.backend("float32"))


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_hyper_connections_planned_on_the_kernels(fake_runtime, tmp_path, mode):
    """Hyper-connections (4 streams) on the kernels against the NumPy reference, proposes taking
    the planned step: mtp_input's xcat workspace over a row per stream, the collapses, hc_post
    and hc_head into the plan's buffers, segment copies of stream-wide rows."""
    from mtpkern import write_synthetic_checkpoint

    cfg = tiny_config(hc_mult=4)
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=9, dtype="float32")
    test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32", emu_backend.backend("float32"))


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_windows_release_blocks_on_the_kernels(fake_runtime, tmp_path, mode):
    """Every module with a window of 5 keys over prompts of 150 tokens, in pools of 8 blocks
    of 16 (a sequence that kept its rows would need 10): released blocks' table entries
    (written as block 0) are never read, captured steps replay their eager twins bit for
    bit, and the kernels equal the NumPy reference, with the pools taking blocks back."""
    from mtpkern import write_synthetic_checkpoint

    cfg = tiny_config(sliding_window=5)
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=13)
    kw = dict(num_blocks=8, prefill_chunk=32)
    pairs = [test_gpu.check_cuda_matches_numpy_reference((ckpt, cfg), mode, "float32",
                                                         emu_backend.backend("float32"), lens=(5, 150), **kw),
             test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend(), mode, 2, prompts=(150, 151),
                                                      **kw)]
    for prop in (p for pair in pairs for p in pair):
        assert prop.pools[0].window_released > 0, prop
        assert mode == "draft" or all(p.window_released > 0 for p in prop.pools)


#: proposer pairs (numpy reference, emulated cuda with CUDA graphs), built once per mode
_PARITY: dict = {}


@pytest.mark.parametrize("kv_mode,chain", [("exact", "prenorm"), ("draft", "prenorm"), ("exact", "postnorm")])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=test_backend_parity.ops)
def test_random_call_sequences_match_reference(fake_runtime, tiny_ckpt, tiny_cfg, kv_mode, chain, script):
    """tests/test_backend_parity.py's random call sequences (prefill, batched propose with
    masks, verify, catch-up, carry, free) on the emulated kernels with CUDA graphs on and
    FP32 KV, call for call against the NumPy reference: the planned step and its eager
    fallbacks meet states in every condition the sequences reach."""
    from mtpkern import MultiModuleMtpHead

    key = (kv_mode, chain)
    if key not in _PARITY:
        kw = dict(kv_mode=kv_mode, chain=chain, block_size=4, num_blocks=160, prefill_chunk=6)
        _PARITY[key] = (MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", **kw),
                        MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=emu_backend.backend("float32"), **kw))
    ref, fast = _PARITY[key]
    assert fast.step_runner is not None
    test_backend_parity.run_script(ref, fast, tiny_cfg, script)


@pytest.mark.parametrize("mode", ["draft", "exact"])
@pytest.mark.parametrize("B", [1, 3])
def test_planned_early_stop_on_the_kernels(fake_runtime, tiny_ckpt, tiny_cfg, mode, B):
    """A propose with min_confidence through the emulated kernels: the planned step captured once
    per shape and replayed after, the stop applied after the graph; against the same kernels run
    eagerly with the early stop (the modules past a stop not run): drafts, confidences, KV rows,
    windows and counters, after verifies too; stops after 1, 2 and 3 drafts, apart per sequence."""
    from mtpkern import MultiModuleMtpHead

    kw = dict(kv_mode=mode, chain="prenorm", block_size=4, num_blocks=160, prefill_chunk=6)
    be = emu_backend.backend("float32")
    eager = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=be, cuda_graphs=False, **kw)
    graph = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=be, **kw)
    assert eager.step_runner is None and graph.step_runner is not None
    test_planned_step.early_stop_run(eager, graph, tiny_cfg, B)
    counts = graph.step_runner.counts
    assert counts["captured"] == counts["plans"] > 0 and counts["replayed"] > counts["captured"], dict(counts)


@pytest.mark.parametrize("n,V", [(1, 7), (3, 65), (5, 301)])
def test_lm_head_id_map(be, n, V):
    """id_map (a draft vocabulary's rows -> target ids): the final kernel writes id_map[best];
    a row without an allowed token stays -1; confidences are those of the unmapped argmax."""
    rng = np.random.default_rng(V + n)
    H = 24
    x, w = rnd(rng, n, H), rnd(rng, V, H, scale=2 * H ** -0.5)
    wb = be.prepare_weight(w.astype(BF16))
    id_map = np.sort(rng.permutation(10 * V)[:V]).astype(np.int32)
    plain, conf0 = lm_argmax_conf(be, x, wb)
    mapped, conf1 = lm_argmax_conf(be, x, wb, id_map=id_map)
    np.testing.assert_array_equal(mapped, id_map[plain])
    np.testing.assert_array_equal(conf0, conf1)
    none = np.zeros((n, (V + 31) // 32), np.int32)
    assert (be.lm_head_argmax(x, wb, none, id_map=id_map, check=False) == -1).all()
    with pytest.raises(ValueError, match=rf"id_map: expected shape \[{V}\]"):
        be.lm_head_argmax(x, wb, id_map=id_map[:-1], check=False)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_a_draft_vocabulary_on_the_kernels_replays_like_eager(fake_runtime, tiny_ckpt, tiny_cfg, mode):
    """A draft vocabulary's heads, masks and id_map through the emulated kernels: against the
    NumPy reference, and captured steps replaying their eager twins."""
    ids = np.random.default_rng(5).permutation(301)[:140]
    test_gpu.check_cuda_matches_numpy_reference((tiny_ckpt, tiny_cfg), mode, "float32", emu_backend.backend("float32"),
                                                draft_vocab=ids)
    test_gpu.check_graph_replay_equals_eager(tiny_ckpt, tiny_cfg, emu_backend.backend(), mode, 2, draft_vocab=ids)


# -- draft trees on the emulated kernels -----------------------------------------------------

@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_draft_tree_matches_the_reference(emu, tiny_ckpt, tiny_cfg, mode):
    """propose_tree / after_verify_tree through the CUDA launchers (the copy-on-write rows,
    per-row block tables, masked_topk_kernel): the reference's trees, and after a verify
    off the greedy path the same KV and the same next drafts."""
    ref = test_gpu._make(tiny_ckpt, test_gpu._reference_backend("float32"), mode, block_size=4, num_blocks=128)
    dev = test_gpu._make(tiny_ckpt, emu_backend.backend("float32"), mode, block_size=4, num_blocks=128,
                         cuda_graphs=False)
    rng = np.random.default_rng(12)
    H, V, M = tiny_cfg.hidden_size, tiny_cfg.vocab_size, tiny_cfg.num_modules
    n = 9
    toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
    sr, sd = ref.alloc_state(), dev.alloc_state()
    ref.prefill_drafter(toks, hid, sr)
    dev.prefill_drafter(toks, hid, sd)
    for widths in ([2, 2, 2], [3, 1, 2], [1, 1, 1]):
        h, t = rng.standard_normal(H).astype(np.float32), int(rng.integers(0, V))
        a = ref.propose_tree(t, h, sr.next_position, sr, widths=widths[:M])
        b = dev.propose_tree(t, h, sd.next_position, sd, widths=widths[:M])
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.parents, b.parents)
        assert_close(b.probs, a.probs, "float32", "tree probs")
        path = a.path(a.leaves()[-1])[:2]
        ref.after_verify_tree(path, sr)
        dev.after_verify_tree(path, sd)
        for m in range(M):
            for x, y in zip(kv_rows(ref, sr, m), kv_rows(dev, sd, m)):
                assert_close(y, x, "float32", f"module {m} KV after the tree's verify")
        if mode == "exact":
            got = [int(a.tokens[i]) for i in path]
            hs = rng.standard_normal((len(got), H)).astype(np.float32)
            ref.catchup_drafter(got, hs, sr)
            dev.catchup_drafter(got, hs, sd)
        dev.check_invariants()
    h, t = rng.standard_normal(H).astype(np.float32), int(rng.integers(0, V))
    assert ref.propose(t, h, sr.next_position, M, sr) == dev.propose(t, h, sd.next_position, M, sd)


# -- a sharded head on the emulated kernels ----------------------------------------------------

@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_sharded_proposer_on_emulated_kernels(emu, tiny_ckpt, kv_mode, monkeypatch):
    """Two ranks (threads) of a sharded head on the cuda backend's real kernels, eagerly (FP32
    KV; the emulator's launches serialised, the ranks' collectives between them): every call of
    a script as the single-rank NumPy reference's, drafts, trees and confidences identical,
    each rank's KV its slice (tests/shard_cases.py). The expert kernels' empty slots (-1
    ids) and the LM head's partial result (best=, sum_exp=) run here on every propose."""
    import threading

    import shard_cases
    from comm_cases import ThreadWorld
    from mtpkern import MultiModuleMtpHead

    lock = threading.Lock()
    launch = emu_backend.EmuKernel.__call__

    def serialised(self, *a, **kw):
        with lock:
            return launch(self, *a, **kw)

    monkeypatch.setattr(emu_backend.EmuKernel, "__call__", serialised)
    kw = dict(kv_mode=kv_mode, block_size=4, num_blocks=160, prefill_chunk=6)
    steps = shard_cases.script(21)
    want = shard_cases.run_script(MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", **kw), steps, True)

    def rank(comm):
        prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=emu_backend.backend("float32"), comm=comm,
                                                  cuda_graphs=False, **kw)
        return prop, shard_cases.run_script(prop, steps, True)

    before = emu.launches.copy()
    for prop, log in ThreadWorld(2).run(rank):
        shard_cases.compare(want, log, prop, tol=1e-4)
    ran = {k for k, c in (emu.launches - before).items() if c}
    assert {"argmax_final_kernel<true>", "moe_combine_kernel"} <= ran, ran


# -- NVFP4 ---------------------------------------------------------------------------------------

def test_nvfp4_gemv_families_equal_the_reference(emu):
    """NVFP4 weights (E4M3 scales per 16, row scales that are no powers of two) in linear (K = 64:
    the 4-byte vector loads; K = 100: the scalar path, a partial last block), swiglu_mlp, the
    routed experts (stacked, each expert its own row scales) and the LM head: within the float32
    tolerance of the reference's dequantized weight. Negative controls: the same codes read with
    the row scale ignored, or with one E4M3 code per 32 columns, give other outputs."""
    from mtpkern.backends.cuda_launch._util import CudaNvFp4, nvfp4_record_bytes

    be = emu_backend.backend("float32")
    rng = np.random.default_rng(1616)
    for K in (64, 100):
        x = rnd(rng, 3, K)
        q, f = stored(rnd(rng, 37, K, scale=K ** -0.5), "nvfp4")
        w = be.prepare_weight(q)
        assert isinstance(w, CudaNvFp4)
        got = be.linear(x, w)
        assert_close(got, REF.linear(x, f), "float32", f"NVFP4 linear K={K}")
        unscaled = be.prepare_weight(Fp4Weight(q.data, q.scale, np.ones_like(q.global_scale)))
        assert not np.allclose(be.linear(x, unscaled), got, rtol=1e-3, atol=1e-3), "row scale ignored"
        r32 = nvfp4_record_bytes(K, 32)                        # the row scale and codes read one per 32
        per32 = CudaNvFp4(w.data, np.ascontiguousarray(w.scale[:, :r32]), 1, 32)
        assert not np.allclose(be.linear(x, per32), got, rtol=1e-3, atol=1e-3), "scales per 32"
        with pytest.raises(ValueError, match=r"w.scale: expected an NVFP4 scale record per row, shape \[37, "):
            be.linear(x, CudaNvFp4(w.data, np.ascontiguousarray(w.scale[:, :4]), 1, 16))   # the row scales only
    H, I, E = 64, 24, 6
    x = rnd(rng, 3, H)
    (q13, f13), (q2, f2) = stored(rnd(rng, 2 * I, H, scale=H ** -0.5), "nvfp4"), stored(rnd(rng, H, I), "nvfp4")
    assert_close(be.swiglu_mlp(x, be.prepare_weight(q13), be.prepare_weight(q2)), REF.swiglu_mlp(x, f13, f2),
                 "float32", "NVFP4 swiglu_mlp")
    (e13, g13), (e2, g2) = (stored(rnd(rng, E, 2 * I, H, scale=H ** -0.5), "nvfp4"),
                            stored(rnd(rng, E, H, I, scale=I ** -0.5), "nvfp4"))
    ids = np.array([[0, 5], [3, 1], [5, 2]], np.int32)
    wts = rng.random((3, 2)).astype(np.float32)
    for n in (1, 3):                                           # the fused one-row down pass, and two passes
        assert_close(be.moe_experts(x[:n], ids[:n], wts[:n], be.prepare_weight(e13), be.prepare_weight(e2)),
                     REF.moe_experts(x[:n], ids[:n], wts[:n], g13, g2), "float32", f"NVFP4 experts n={n}")
    qh, fh = stored(rnd(rng, 300, H, scale=H ** -0.5), "nvfp4")
    head = be.prepare_weight(qh)
    assert_close(be.lm_head_logits(x, head), REF.lm_head_logits(x, fh), "float32", "NVFP4 lm_head logits")
    np.testing.assert_array_equal(be.lm_head_argmax(x, head), REF.lm_head_argmax(x, fh))


# -- the benchmark's quantized weights ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["fp8", "mxfp8", "fp4", "nvfp4"])
def test_the_benchmarks_quantized_weights_are_what_the_kernels_read(emu, kind):
    """benchmarks/gpu_bench.py's FP8 / MXFP8 / FP4 / NVFP4 rows (``quant_weight``) hold weights in the layout
    the kernels read: the bytes it counts (``quant_bytes``) are the weight's, and the emulated
    GEMV over it equals the NumPy reference over the host twin of the same codes and scales;
    its FP8 codes hold no NaN (a NaN would make every row's timing meaningless)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench_quant", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    N, K = 40, 256
    w = bench.quant_weight(kind, (N, K), 3, xp=np)
    assert w.nbytes == bench.quant_bytes(kind, (N, K)) and tuple(w.shape) == (N, K)
    twin = (Fp8Weight(w.data, w.scale, (w.bn, w.bk)) if kind in ("fp8", "mxfp8") else Fp4Weight(w.data, w.scale)
            if kind == "fp4" else Fp4Weight(w.data, w.scale[:, 4:4 + K // 16], w.row_scale))
    if kind in ("fp8", "mxfp8"):
        assert not np.isin(w.data & 0x7F, [0x7F]).any()
    wd = twin.dequantize()
    assert np.isfinite(wd).all() and np.abs(wd).max() > 0
    rng = np.random.default_rng(0)
    x = rnd(rng, 3, K)
    got = emu_backend.backend().linear(x, w)
    assert_close(got, REF.linear(x, REF.prepare_weight(twin)), "float32",
                 f"{kind} linear over the benchmark's weight")
    assert bench.quant_bytes(kind, (4, N, K)) == 4 * bench.quant_bytes(kind, (N, K))
    with pytest.raises(ValueError, match="kind: expected 'fp8', 'mxfp8', 'fp4' or 'nvfp4'"):
        bench.quant_bytes("int4", (N, K))


def test_sampled_proposes_on_the_kernels(fake_runtime, tiny_ckpt):
    """propose_batch with sampling= on the emulated cuda backend (the planned step set up, the
    sampled call taking the eager path): the NumPy reference's drafts, probabilities to FP32
    rounding, and a greedy sequence beside them as without sampling."""
    from mtpkern import MultiModuleMtpHead, SamplingParams

    kw = dict(kv_mode="exact", block_size=4, num_blocks=64, prefill_chunk=6)
    ref = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", **kw)
    fast = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=emu_backend.backend("float32"), **kw)
    rng = np.random.default_rng(2)
    H, V = ref.config.hidden_size, ref.config.vocab_size
    sp = [SamplingParams(1.2, seed=5), None, SamplingParams(0.7, top_k=12, top_p=0.9, seed=6)]
    out = []
    for prop in (ref, fast):
        r = np.random.default_rng(2)
        sts = [prop.alloc_state() for _ in sp]
        for st in sts:
            prop.prefill_drafter(r.integers(0, V, 7).tolist(), r.standard_normal((7, H)).astype(np.float32), st)
        prob: list = []
        d = prop.propose_batch([1, 2, 3], r.standard_normal((3, H)).astype(np.float32), [7] * 3, 3, sts,
                               sampling=sp, out_prob=prob)
        out.append((d, prob))
        prop.check_invariants()
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        assert_close(np.array(b, np.float32), np.array(a, np.float32), "float32", "sampled probabilities")


@pytest.mark.parametrize("mode", ["draft", "exact"])
def test_planned_trees_on_the_kernels(fake_runtime, emu, tiny_ckpt, mode):
    """Draft trees of static shapes in the captured step, on the emulated kernels: the eager
    emulated path's trees and KV bit for bit (batches 1 and 3, widths (1, 1, 1), (2, 1, 1),
    (4, 2, 1)), before and after the verify; one capture per tree shape, replays after."""
    from test_tree_plan import run_tree_twins

    be = emu_backend.backend()
    eager = test_gpu._make(tiny_ckpt, be, mode, cuda_graphs=False, block_size=4)
    graph = test_gpu._make(tiny_ckpt, be, mode, block_size=4)
    for B, seed in ((1, 1), (3, 2)):
        before = dict(graph.step_runner.counts)
        counts = run_tree_twins(eager, graph, B, seed, [(1, 1, 1), (2, 1, 1), (4, 2, 1), (4, 2, 1), (2, 1, 1)])
        new = {k: counts.get(k, 0) - before.get(k, 0) for k in ("tree_captured", "tree_replayed")}
        assert new == {"tree_captured": 3, "tree_replayed": 2}, counts
    assert fake_runtime.memcpys["h2d"] == fake_runtime.memcpys["d2h"] == 10


@pytest.mark.parametrize("kind,mode", [("hc", "draft"), ("v4", "exact")])
def test_planned_trees_of_other_blocks_on_the_kernels(fake_runtime, emu, tmp_path_factory, kind, mode):
    """Hyper-connections (stream-wide g rows, the collapses in plan buffers) and DeepSeek-V4's
    windowed attention (the query latent's joined rows, grouped output, sinks) in captured tree
    steps on the kernels: the eager emulated trees and KV bit for bit, a replay among them."""
    from test_tree_plan import _kind_ckpt, _kind_widths, run_tree_twins

    ckpt = _kind_ckpt(tmp_path_factory, kind)
    be = emu_backend.backend("float32")
    eager = test_gpu._make(ckpt, be, mode, cuda_graphs=False, block_size=4)
    graph = test_gpu._make(ckpt, be, mode, block_size=4)
    counts = run_tree_twins(eager, graph, 3, 5, _kind_widths(graph))
    assert counts["tree_captured"] == 2 and counts["tree_replayed"] == 1, counts
