"""Benchmark harness: ``mtpkern bench --backend cpu --shapes small`` (benchmarks/README.md).

Per op: warm-up, then the median and p20/p80 of N timed runs; the bytes each op
must move are counted explicitly (weights read + activations and KV in/out), and
GB/s is reported beside the bandwidth of a plain NumPy copy of a buffer larger
than the caches, measured in the same run (the memory floor of this machine).

Per propose: latency for k = 1..M at each batch and context in both KV modes, on
the built-in synthetic checkpoint of the shape set (``mtpkern.synthetic``), with
``context`` rows of KV in every sequence; the floor is (bytes a propose must
read) / (the read bandwidth of an FP32 BLAS GEMV over a buffer larger than the
caches: what this machine streams when it only reads, as a propose does).
Every figure is judged (``mtpkern.timing``): runs that spread too widely, and
times below the floor of a propose that reads more than the last-level cache,
are marked in the table and the JSON.

When ``torch`` is importable (never a dependency), the same propose step is also
timed as a PyTorch eager implementation of the module on the same weights (one
row per module, as a Hugging Face MTP generation step runs), and the ratio is
printed. Results: a table on stdout; JSON with ``--json PATH``; a plot of
latency against context and batch with ``--plot PATH`` (matplotlib, ``mtpkern[plot]``).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from . import argtypes
from .config import MtpConfig
from .errors import MissingExtra, install_hint
from .ops.sampling import SamplingParams
from .synthetic import CONFIGS, synthetic_checkpoint
from .timing import MAX_SPREAD, Timing, floor_error, measure, warnings_of

#: Named shape sets: the config (``mtpkern.synthetic.CONFIGS``) and the default rows of
#: context already in the KV.
SHAPES: dict[str, tuple[Callable[[], MtpConfig], int]] = {
    "tiny": (CONFIGS["tiny"], 64),
    # H=1024, 16 q / 4 kv heads, D=64, E=32 top-4, 4 groups / 2 kept, I=512, 1 shared, V=32768, M=3
    "small": (CONFIGS["small"], 512),
    # GLM-4.5-Air-sized module (GPU benchmarks: benchmarks/gpu_bench.py)
    "glm45air": (CONFIGS["glm45air"], 512),
    # Step-3.5-shaped (a quarter of its width): a window of 512 inside 2048 rows of context
    "step35": (CONFIGS["step35"], 2048),
    # DeepSeek-V3's MLA block at H=1024 (16 heads, L 512, R 64, q_lora 384), MoE as small
    "mla": (CONFIGS["mla"], 2048),
    # the mla block with DeepSeek-V3.2's DSA indexer: its cost at 4096 keys against the attention it saves
    "dsa": (CONFIGS["dsa"], 4096),
    # DeepSeek-V4-Flash's MTP block at a quarter of its width (streams, V4's attention, FP4
    # experts): a window of 128 inside 2048 rows of context
    "dsv4": (CONFIGS["dsv4"], 2048),
}


def last_level_cache() -> int | None:
    """Bytes of the CPU's largest cache (Linux sysfs), or None where unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()                               # e.g. "491520K"
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


def stream_bytes(llc: int | None) -> int:
    """The buffer of the bandwidth probes: twice the last-level cache, so that it streams
    from memory (a 2-core VM here reports 480 MiB of L3), 256 MiB to 1 GiB."""
    return min(max(256 << 20, 2 * (llc or 0)), 1 << 30)


def copy_bandwidth(nbytes: int = 256 << 20, runs: int = 10) -> float:
    """Bytes copied per second by ``np.copyto`` over a buffer larger than the caches, in GB/s
    (the memory moves twice that: a read and a write). An op that moves N bytes in the
    time a plain copy of N bytes takes scores 100 % "of copy"."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t = measure(lambda: np.copyto(dst, src), 2, runs)
    return nbytes / (t.median_us * 1e-6) / 1e9


def read_bandwidth(nbytes: int = 256 << 20, runs: int = 10) -> float:
    """GB/s at which this machine streams a matrix it only reads (the memory floor of a
    propose, which only reads weights and KV): the faster of an FP32 BLAS GEMV over ``nbytes``
    and ``stream_read``, the cpu GEMV's own pattern (8 rows a stride apart per task, every
    core), each the median of ``runs``. A BLAS GEMV alone read 27 GB/s on the 2-core VM where
    the cpu backend's LM head streamed 31-35: the floor was below what the kernels reached."""
    return max(_blas_read(nbytes, runs), stream_read(nbytes, runs))


def _blas_read(nbytes: int, runs: int) -> float:
    w = np.ones((nbytes // 4096, 1024), np.float32)
    x = np.ones(1024, np.float32)
    t = measure(lambda: w @ x, 2, runs)
    time.sleep(0.2)             # let BLAS's spinning threads park before Numba's pool runs
    return nbytes / (t.median_us * 1e-6) / 1e9


def stream_read(nbytes: int = 256 << 20, runs: int = 10) -> float:
    """GB/s of a Numba read of ``nbytes`` on every core: a task per 8 rows of 2 KiB a stride
    apart (``linear.group8``'s pattern: 8 streams a core keep more lines in flight than one),
    XOR-folded so nothing is written; the median of ``runs``."""
    import numba

    kernel = _stream_kernel()
    a = np.ones((max(64, nbytes // 2048) // 64 * 64, 512), np.uint32)
    threads = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        t = measure(lambda: kernel(a, a.shape[0] // 8), 2, runs)
    finally:
        numba.set_num_threads(threads)
    return a.nbytes / (t.median_us * 1e-6) / 1e9


@functools.lru_cache(maxsize=1)
def _stream_kernel():
    from numba import njit, prange

    @njit(parallel=True, fastmath=True)
    def kernel(a, q):                 # rows t, t + q, .. t + 7q of each [8q, 512] block
        out = np.zeros(a.shape[0] // 8, np.uint32)
        for t in prange(a.shape[0] // 8):
            r = a[t], a[t + q], a[t + 2 * q], a[t + 3 * q], a[t + 4 * q], a[t + 5 * q], a[t + 6 * q], a[t + 7 * q]
            acc = np.uint32(0)
            for j in range(a.shape[1]):
                acc += r[0][j] ^ r[1][j] ^ r[2][j] ^ r[3][j] ^ r[4][j] ^ r[5][j] ^ r[6][j] ^ r[7][j]
            out[t] = acc
        return out

    return kernel


# -- per-op benchmarks -------------------------------------------------------------------

#: block of the FP8 op cases: DeepSeek-V3's and GLM-4.5's ``weight_block_size``
FP8_BLOCK = (128, 128)


def fma_rate(n: int = 1024, runs: int = 10) -> float:
    """GFMA/s (FP32 multiply-adds per second, 1e9) this machine sustains on an ``n``-cubed
    BLAS sgemm: the compute roofline a propose's multiply-adds are held to (``propose_fmas``),
    beside its memory floor: the fastest of ``runs`` (a ceiling, as the floor's stream is the
    fastest this machine showed). Measured in a child process: a multi-threaded sgemm in this one
    left BLAS's threads in the way of Numba's (proposes timed after it ran ~30 % slower)."""
    code = ("import time, numpy as np\n"
            f"a = np.ones(({n}, {n}), np.float32); a @ a\n"
            f"ts = []\nfor _ in range({runs}):\n    t = time.perf_counter(); a @ a; ts.append(time.perf_counter() - t)\n"
            f"print({n} ** 3 / min(ts) / 1e9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


#: MXFP8's scale blocks: one E8M0 scale per 32 weights of a row (held as FP32 once loaded)
MXFP8_BLOCK = (1, 32)


def fp8_bytes(*shape: int, block: tuple[int, int] = FP8_BLOCK) -> int:
    """Bytes an FP8 weight ``[.., N, K]`` with ``block`` scales (``FP8_BLOCK``; ``MXFP8_BLOCK``)
    is read in: one per weight, 4 per FP32 scale."""
    *lead, N, K = shape
    blocks = -(-N // block[0]) * -(-K // block[1])
    return int(np.prod(lead, dtype=np.int64)) * (N * K + 4 * blocks)


def fp4_bytes(*shape: int, fmt: str = "mxfp4") -> int:
    """Bytes an FP4 weight ``[.., N, K]`` is read in: half a byte per weight and one per scale,
    an E8M0 per 32 weights (MXFP4) or an E4M3 per 16 and an FP32 global scale per row (NVFP4)."""
    *lead, N, K = shape
    per = N * K // 2 + (N * -(-K // 32) if fmt == "mxfp4" else N * -(-K // 16) + 4 * N)
    return int(np.prod(lead, dtype=np.int64)) * per


def op_cases(cfg: MtpConfig, be, context: int, n: int, rng: np.random.Generator,
             be8=None) -> list[tuple[str, int, Callable]]:
    """(name, bytes moved, thunk) for every op at decode shape ``n`` rows: BF16 weights, then
    every GEMV again with the same weights in FP8 (``FP8_BLOCK`` scales; ``<op>_fp8``), then the
    SwiGLUs (routed experts, shared / dense MLP) in the re-published formats: FP4 (``<op>_fp4``:
    E2M1 with E8M0 scales per 32, MXFP4, DeepSeek-V4's experts), NVFP4 (``<op>_nvfp4``: E2M1
    with E4M3 scales per 16 and a global scale) and MXFP8 (``<op>_mxfp8``: E4M3 with a scale
    per 32). ``be8``: an FP8-KV twin of ``be`` (``--fp8-kv``): GQA's KV write and attention on it too."""
    import ml_dtypes

    from .ops.moe import RouterSpec
    from .quant import Fp4Weight, Fp8Weight

    bf16 = np.dtype(ml_dtypes.bfloat16)
    H, V = cfg.hidden_size, cfg.vocab_size
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    moe = cfg.is_moe
    # the block's other MLP: the shared experts of a MoE block, or a dense block's MLP (the same op)
    mlp, Is = ("swiglu_shared", cfg.shared_intermediate_size) if moe else ("swiglu_dense", cfg.intermediate_size)

    host: dict[int, np.ndarray] = {}              # id(prepared BF16 weight) -> its host values

    def W(*shape):
        w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(bf16)
        p = be.prepare_weight(w)
        host[id(p)] = w
        return p

    def W8(w):                                    # the same weight in FP8 (once: its host copy goes)
        return be.prepare_weight(Fp8Weight.quantize(host.pop(id(w)), FP8_BLOCK))

    def W4(w, fmt="mxfp4"):                       # the same weight in FP4 (before W8 drops its host copy)
        return be.prepare_weight(Fp4Weight.quantize(host[id(w)], fmt))

    def Wmx8(w):                                  # the same weight in MXFP8 (before W8 drops it)
        return be.prepare_weight(Fp8Weight.quantize(host[id(w)], MXFP8_BLOCK))

    def act(*shape):
        return be.from_host(rng.standard_normal(shape).astype(np.float32))

    def vec(k):
        return be.prepare_vector(np.ones(k, np.float32))

    x, g = act(n, H), act(n, H)
    embed, head = W(V, H), W(V, H)
    eh = W(H, 2 * H)
    if moe:
        gate = W(E, H)
        w13, w2 = W(E, 2 * I, H), W(E, H, I)
    s13, s2 = W(2 * Is, H), W(H, Is)
    tokens = be.from_host(rng.integers(0, V, n).astype(np.int32))
    f4, b2 = 4, 2
    eh8, head8 = W8(eh), W8(head)
    s13_4, s2_4 = W4(s13), W4(s2)
    s13_n4, s2_n4 = W4(s13, "nvfp4"), W4(s2, "nvfp4")
    s13_mx, s2_mx = Wmx8(s13), Wmx8(s2)
    s13_8, s2_8 = W8(s13), W8(s2)
    if moe:
        spec = RouterSpec.from_config(cfg)
        ids, wts = be.moe_router(x, gate, vec(E), spec)
        distinct = len(np.unique(be.to_host(ids)))
        w13_4, w2_4 = W4(w13), W4(w2)
        w13_n4, w2_n4 = W4(w13, "nvfp4"), W4(w2, "nvfp4")
        w13_mx, w2_mx = Wmx8(w13), Wmx8(w2)
        gate8, w13_8, w2_8 = W8(gate), W8(w13), W8(w2)
        used13, used2 = fp8_bytes(distinct, 2 * I, H), fp8_bytes(distinct, H, I)
    attention = (mla_op_cases(cfg, be, context, n, W, W8, act, vec, rng) if cfg.block(0).mla
                 else gqa_op_cases(cfg, be, context, n, W, W8, act, vec, rng, be8))
    cases = [
        ("rmsnorm", 2 * n * H * f4 + H * f4, lambda: be.rmsnorm(x, vec(H), 1e-5)),
        ("mtp_input", 2 * H * H * b2 + n * H * b2 + 2 * n * H * f4, lambda: be.mtp_input(embed, tokens, g, vec(H), vec(H), eh, 1e-5)),
    ] + [c for c in attention if not c[0].endswith("_fp8")]
    if moe:
        cases += [
            ("moe_router", E * H * b2 + n * H * f4, lambda: be.moe_router(x, gate, vec(E), spec)),
            ("moe_experts", distinct * 3 * I * H * b2 + 2 * n * H * f4,
             lambda: be.moe_experts(x, ids, wts, w13, w2, x)),
        ]
    cases += [
        (mlp, 3 * Is * H * b2 + 2 * n * H * f4, lambda: be.swiglu_mlp(x, s13, s2, x)),
        ("lm_head_argmax", V * H * b2 + n * H * f4, lambda: be.lm_head_argmax(x, head)),
        ("mtp_input_fp8", fp8_bytes(H, 2 * H) + n * H * b2 + 2 * n * H * f4,
         lambda: be.mtp_input(embed, tokens, g, vec(H), vec(H), eh8, 1e-5)),
    ] + [c for c in attention if c[0].endswith("_fp8")]
    if moe:
        cases += [
            ("moe_router_fp8", fp8_bytes(E, H) + n * H * f4, lambda: be.moe_router(x, gate8, vec(E), spec)),
            ("moe_experts_fp8", used13 + used2 + 2 * n * H * f4, lambda: be.moe_experts(x, ids, wts, w13_8, w2_8, x)),
        ]
    cases += [
        (f"{mlp}_fp8", fp8_bytes(2 * Is, H) + fp8_bytes(H, Is) + 2 * n * H * f4,
         lambda: be.swiglu_mlp(x, s13_8, s2_8, x)),
        ("lm_head_argmax_fp8", fp8_bytes(V, H) + n * H * f4, lambda: be.lm_head_argmax(x, head8)),
    ]
    nbytes = {"fp4": fp4_bytes, "nvfp4": functools.partial(fp4_bytes, fmt="nvfp4"),
              "mxfp8": functools.partial(fp8_bytes, block=MXFP8_BLOCK)}
    shared = {"fp4": (s13_4, s2_4), "nvfp4": (s13_n4, s2_n4), "mxfp8": (s13_mx, s2_mx)}
    experts = {"fp4": (w13_4, w2_4), "nvfp4": (w13_n4, w2_n4), "mxfp8": (w13_mx, w2_mx)} if moe else {}
    for fmt, nb in nbytes.items():
        if moe:
            e13, e2 = experts[fmt]
            cases += [(f"moe_experts_{fmt}", nb(distinct, 2 * I, H) + nb(distinct, H, I) + 2 * n * H * f4,
                       functools.partial(be.moe_experts, x, ids, wts, e13, e2, x))]
        m13, m2 = shared[fmt]
        cases += [(f"{mlp}_{fmt}", nb(2 * Is, H) + nb(H, Is) + 2 * n * H * f4,
                   functools.partial(be.swiglu_mlp, x, m13, m2, x))]
    return cases


#: the op cases' KV block size
BENCH_BLOCK = 16


def decode_rows(be, n: int, context: int) -> tuple:
    """The row index of ``n`` decode rows, one sequence each, over ``context`` rows of KV in
    blocks of ``BENCH_BLOCK`` (sequence i owns blocks i * nb ..): (nb, tables, row_seq,
    row_len, positions, the slots of the rows' own KV write)."""
    nb = -(-context // BENCH_BLOCK) + 1
    tables = be.from_host(np.arange(nb * n, dtype=np.int32).reshape(n, nb))
    row_seq = be.from_host(np.arange(n, dtype=np.int32))
    row_len = be.from_host(np.full(n, context, np.int32))
    pos = be.from_host(np.full(n, context, np.int32))
    slots = be.from_host((np.arange(n, dtype=np.int32) * nb * BENCH_BLOCK) + context - 1)
    return nb, tables, row_seq, row_len, pos, slots


def written(cache, rng: np.random.Generator):
    """``cache``, a KV pool, with every row written (random values) when it is a host array:
    ``np.zeros`` leaves the pages of a large pool mapped to the kernel's one zero page until
    they are written, and a read of them finds that page in the cache (the cpu attention over
    8 x 32768 never-written rows timed 59 GB/s, twice the machine's read rate). A device pool
    is written by its allocation (``cupy.zeros`` runs a kernel)."""
    if isinstance(cache, np.ndarray):
        if cache.dtype == np.uint8:                 # FP8 codes: any finite E4M3 code (0x7F / 0xFF are NaN)
            cache[...] = rng.integers(0, 0x7E, cache.shape, dtype=np.uint8) | (rng.integers(0, 2, cache.shape,
                                                                                             dtype=np.uint8) << 7)
        else:
            cache[...] = rng.standard_normal(cache.shape, dtype=np.float32)
    return cache


def kv_twin(be, kv_dtype: str):
    """A backend of ``be``'s kind (and thread count) whose KV caches are ``kv_dtype``: the bench's
    FP8-KV rows (``--fp8-kv``) beside the backend's own."""
    from .backends.cpu import CpuBackend
    from .backends.numpy_backend import NumpyBackend

    if be.name == "numpy":
        return NumpyBackend(kv_dtype)
    if be.name == "cpu":
        return CpuBackend(threads=be.threads, kv_dtype=kv_dtype)
    from .backends.cuda import CudaBackend

    return CudaBackend(kv_dtype=kv_dtype)


def kv_scale_planes(be, NB: int, Hkv: int) -> dict:
    """An FP8 backend's KV scale planes for ``NB`` bench blocks ({} otherwise): the ops' keywords."""
    if not be.kv_fp8:
        return {}
    return {"k_scale": written_scales(be.empty_kv_scales(NB, BENCH_BLOCK, Hkv)),
            "v_scale": written_scales(be.empty_kv_scales(NB, BENCH_BLOCK, Hkv))}


def written_scales(plane):
    """A scale plane with every row's scale written (a host array; see ``written``)."""
    if isinstance(plane, np.ndarray):
        plane[...] = 2.0 ** -6
    return plane


def gqa_op_cases(cfg: MtpConfig, be, context: int, n: int, W, W8, act, vec,
                 rng: np.random.Generator, be8=None) -> list[tuple[str, int, Callable]]:
    """The attention ops of a GQA block at decode shape ``n`` rows: the fused projection,
    the q/k norm + RoPE + KV write, the paged attention (full, and a window of 128 with
    sinks), the head-wise gate, ``o_proj`` (BF16, then the projections in FP8). ``be8``: a
    twin of ``be`` with an FP8 KV cache (``kv_twin``): the KV write and the attention again on
    it (``<op>_fp8kv``: one byte a value and a 4-byte scale per row and KV head, read and
    counted)."""
    from .ops.rope_kv import inv_freq

    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    f4, b2 = 4, 2
    x = act(n, H)
    wqkv, wo = W((Hq + 2 * Hkv) * D, H), W(H, Hq * D)
    nb, tables, row_seq, row_len, pos, slots = decode_rows(be, n, context)
    kc = written(be.empty_keys(nb * n, BENCH_BLOCK, Hkv, D), rng)
    vc = written(be.empty_kv(nb * n, BENCH_BLOCK, Hkv, D), rng)
    skw = kv_scale_planes(be, nb * n, Hkv)
    kvr = be.kv_row_bytes(D)                      # bytes of one row of one KV head (an FP8 cache's scale too)
    qkv = act(n, (Hq + 2 * Hkv) * D)
    q = act(n, Hq, D)
    invf = be.from_host(inv_freq(cfg.rotary_dim, cfg.rope_theta))
    wqkv8, wo8 = W8(wqkv), W8(wo)
    xo = act(n, Hq * D)
    gates = act(n, Hq + 5)[:, 5:]                 # head-wise gates: a column slice of a wider projection
    gated = act(n, Hq * D)                        # their output (a buffer, as a planned step passes)
    window = min(128, context)                    # a sliding window of 128 rows, with sinks
    starts = be.from_host(np.full(n, context - window, np.int32))
    sinks = vec(Hq)
    return [
        ("linear_qkv", (Hq + 2 * Hkv) * D * H * b2 + n * (H + (Hq + 2 * Hkv) * D) * f4, lambda: be.linear(x, wqkv)),
        ("linear_o", H * Hq * D * b2 + n * (Hq * D + 2 * H) * f4, lambda: be.linear(xo, wo, None, x)),
        ("qk_norm_rope_kv_write", n * ((Hq + 2 * Hkv) * D + Hq * D) * f4 + 2 * n * Hkv * kvr,
         lambda: be.qk_norm_rope_kv_write(qkv, Hq, Hkv, vec(D), vec(D), 1e-5, invf, pos, kc, vc, slots, **skw)),
        (f"paged_attention_ctx{context}", 2 * n * context * Hkv * kvr + 2 * n * Hq * D * f4,
         lambda: be.paged_attention(q, kc, vc, tables, row_seq, row_len, D ** -0.5, **skw)),
        (f"paged_attention_ctx{context}_w{window}_sinks", 2 * n * window * Hkv * kvr + 2 * n * Hq * D * f4,
         lambda: be.paged_attention(q, kc, vc, tables, row_seq, row_len, D ** -0.5, row_start=starts, sinks=sinks,
                                    **skw)),
    ] + ([] if be8 is None else fp8_kv_cases(be8, n, context, (Hq, Hkv, D), (qkv, q, invf, vec), rng)) + [
        ("sigmoid_gate", 2 * n * Hq * D * f4 + n * Hq * f4, lambda: be.sigmoid_gate(xo, gates, out=gated)),
        ("linear_qkv_fp8", fp8_bytes((Hq + 2 * Hkv) * D, H) + n * (H + (Hq + 2 * Hkv) * D) * f4,
         lambda: be.linear(x, wqkv8)),
        ("linear_o_fp8", fp8_bytes(H, Hq * D) + n * (Hq * D + 2 * H) * f4, lambda: be.linear(xo, wo8, None, x)),
    ]


def fp8_kv_cases(be8, n: int, context: int, dims: tuple, args: tuple, rng: np.random.Generator) -> list:
    """The KV write and the paged attention (``<op>_fp8kv``) on ``be8``, a twin backend with an FP8 KV
    cache, at the shapes of ``gqa_op_cases``'s rows: the codes (one byte a value) and the scales (4
    bytes per row and KV head) counted."""
    (Hq, Hkv, D), (qkv, q, invf, vec) = dims, args
    f4 = 4
    nb, tables, row_seq, row_len, pos, slots = decode_rows(be8, n, context)
    kc = written(be8.empty_keys(nb * n, BENCH_BLOCK, Hkv, D), rng)
    vc = written(be8.empty_kv(nb * n, BENCH_BLOCK, Hkv, D), rng)
    skw = kv_scale_planes(be8, nb * n, Hkv)
    kvr = be8.kv_row_bytes(D)
    return [
        ("qk_norm_rope_kv_write_fp8kv", n * ((Hq + 2 * Hkv) * D + Hq * D) * f4 + 2 * n * Hkv * kvr,
         lambda: be8.qk_norm_rope_kv_write(qkv, Hq, Hkv, vec(D), vec(D), 1e-5, invf, pos, kc, vc, slots, **skw)),
        (f"paged_attention_ctx{context}_fp8kv", 2 * n * context * Hkv * kvr + 2 * n * Hq * D * f4,
         lambda: be8.paged_attention(q, kc, vc, tables, row_seq, row_len, D ** -0.5, **skw)),
    ]


def mla_op_cases(cfg: MtpConfig, be, context: int, n: int, W, W8, act, vec,
                 rng: np.random.Generator) -> list[tuple[str, int, Callable]]:
    """The attention ops of an MLA block at decode shape ``n`` rows (mtpkern.ops.mla): the
    query and latent projections (BF16, then FP8; an element-wise output gate's g_proj rows
    stacked with kv_a_proj_with_mqa's, and its ``sigmoid_gate``), the latent write with the
    query's RoPE (the block's frequencies: zeros under ``nope``), the absorbed attention over
    ``context`` latent rows (w_uk / w_uv in BF16), ``o_proj``."""
    b = cfg.block(0)
    H, Hq, L, R, P, Dv, Q = (cfg.hidden_size, b.num_attention_heads, b.kv_lora_rank, b.qk_rope_head_dim,
                             b.qk_nope_head_dim, b.v_dim, b.q_lora_rank)
    f4, b2 = 4, 2
    kvb = np.dtype(be.kv_dtype).itemsize
    nb, tables, row_seq, row_len, pos, slots = decode_rows(be, n, context)
    cache = written(be.empty_latent_kv(nb * n, BENCH_BLOCK, L + R), rng)
    invf = be.from_host(b.inv_freq())
    KA = b.kv_a_size                       # L + R (+ the gate's Hq Dv)
    x, q_in, kv_a, xo = act(n, H), act(n, Hq, P + R), act(n, L + R), act(n, Hq * Dv)
    q_src = Q or H
    wkva, wq, wo = W(KA, H), W(Hq * (P + R), q_src), W(H, Hq * Dv)
    uk, uv = W(Hq, P, L), W(Hq, Dv, L)
    q_lat = act(n, Q or H)
    cases = [
        ("linear_kv_a", KA * H * b2 + n * (H + KA) * f4, lambda: be.linear(x, wkva)),
        ("linear_q", Hq * (P + R) * q_src * b2 + n * (q_src + Hq * (P + R)) * f4, lambda: be.linear(q_lat, wq)),
        ("mla_latent_write", n * ((L + R) + 2 * Hq * (P + R)) * f4 + n * (L + R) * kvb,
         lambda: be.mla_latent_write(kv_a, vec(L), 1e-6, invf, pos, cache, slots, q=q_in, interleave=True)),
        (f"mla_attention_ctx{context}", Hq * (P + Dv) * L * b2 + n * context * (L + R) * kvb
         + n * Hq * (P + R + Dv) * f4,
         lambda: be.mla_attention_absorbed(q_in, uk, uv, cache, tables, row_seq, row_len, (P + R) ** -0.5)),
        ("linear_o", H * Hq * Dv * b2 + n * (Hq * Dv + 2 * H) * f4, lambda: be.linear(xo, wo, None, x)),
    ]
    wq_a = W(Q, H) if Q else None
    if Q:
        cases.insert(1, ("linear_q_a", Q * H * b2 + n * (H + Q) * f4, lambda: be.linear(x, wq_a)))
    if b.gate_size:                        # o * sigmoid(gate): x, gate and out, Hq Dv each
        gate = act(n, b.gate_size)
        cases.insert(-1, ("sigmoid_gate", 3 * n * Hq * Dv * f4, lambda: be.sigmoid_gate(xo, gate)))
    wkva8, wq8, wo8 = W8(wkva), W8(wq), W8(wo)
    cases += [
        ("linear_kv_a_fp8", fp8_bytes(KA, H) + n * (H + KA) * f4, lambda: be.linear(x, wkva8)),
        ("linear_q_fp8", fp8_bytes(Hq * (P + R), q_src) + n * (q_src + Hq * (P + R)) * f4,
         lambda: be.linear(q_lat, wq8)),
        ("linear_o_fp8", fp8_bytes(H, Hq * Dv) + n * (Hq * Dv + 2 * H) * f4, lambda: be.linear(xo, wo8, None, x)),
    ]
    if b.dsa:
        cases += dsa_op_cases(b, be, context, n, W, act, vec, cache, uk, uv, q_in, (tables, row_seq, row_len, pos,
                                                                                  slots, nb))
    return cases


def dsa_op_cases(b, be, context: int, n: int, W, act, vec, cache, uk, uv, q_in, rows) -> list:
    """DSA's indexer at decode shape (mtpkern.ops.dsa): its query projection, the key write,
    the selection over ``context`` keys, and the MLA attention over the ``index_topk`` keys
    it picks (``mla_attention_ctx{context}``, the dense row, is what that one replaces)."""
    tables, row_seq, row_len, pos, slots, nb = rows
    Hi, Di, T, Q, R, P = (b.index_n_heads, b.index_head_dim, b.index_topk, b.q_lora_rank, b.qk_rope_head_dim,
                          b.qk_nope_head_dim)
    Hq, Dv, L = uk.shape[0], uv.shape[1], uk.shape[2]
    f4, b2 = 4, 2
    kvb = np.dtype(be.kv_dtype).itemsize
    icache = written(be.empty_latent_kv(nb * n, BENCH_BLOCK, Di), np.random.default_rng(1))
    invf = be.from_host(b.inv_freq())      # the block's frequencies (YaRN's; zeros under nope)
    wq_b = W(Hi * Di, Q)
    q_lat, k_raw, iq, iw = act(n, Q), act(n, Di), act(n, Hi, Di), act(n, Hi)
    picked = min(T, context)               # every row's list: T keys spread over its context
    index = np.repeat(np.linspace(0, context - 1, picked).round().astype(np.int32)[None, :], n, axis=0)
    index_b = be.from_host(index)
    return [
        ("linear_index_q", Hi * Di * Q * b2 + n * (Q + Hi * Di) * f4, lambda: be.linear(q_lat, wq_b)),
        ("dsa_key_write", n * (Di + 2 * Hi * Di) * f4 + n * Di * kvb,
         lambda: be.dsa_key_write(k_raw, vec(Di), vec(Di), 1e-6, invf, pos, icache, slots, q=iq)),
        (f"dsa_select_ctx{context}_top{T}", n * context * Di * kvb + n * (Hi * Di + Hi) * f4 + n * picked * 4,
         lambda: be.dsa_select(iq, iw, icache, tables, row_seq, row_len, T, Hi ** -0.5 * Di ** -0.5)),
        (f"mla_attention_ctx{context}_top{T}", Hq * (P + Dv) * L * b2 + n * picked * (L + R) * kvb
         + n * Hq * (P + R + Dv) * f4,
         lambda: be.mla_attention_absorbed(q_in, uk, uv, cache, tables, row_seq, row_len, (P + R) ** -0.5,
                                           index=index_b)),
    ]


def bench_ops(cfg, be, context, n, warmup, runs, copy_gbs, only: str = "", be8=None) -> list[dict]:
    """Every op (or those whose name starts with ``only``) at ``n`` rows and ``context`` rows of KV
    (``be8``: with the FP8-KV rows, ``op_cases``)."""
    rng = np.random.default_rng(0)
    out = []
    for name, nbytes, fn in op_cases(cfg, be, context, n, rng, be8):
        if not name.startswith(only):
            continue
        t = measure(fn, warmup, runs, be.synchronize)
        gbs = nbytes / (t.median_us * 1e-6) / 1e9
        out.append({"op": name, "rows": n, "context": context, "bytes": nbytes, **asdict(t), "GB/s": gbs,
                    "of_copy": gbs / copy_gbs, "spread": t.spread, "warnings": warnings_of(t)})
    return out


# -- propose benchmarks ---------------------------------------------------------------------

def expected_experts(E: int, K: int, rows: int) -> float:
    """Distinct experts ``rows`` rows route to in expectation when each picks ``K`` of ``E``
    uniformly (each expert is missed by a row with probability 1 - K / E): what the routed
    experts' weights cost a module that runs those rows (the synthetic checkpoint routes
    about uniformly). 8 rows at top-4 of 32 reach 21.3 experts, not 32."""
    return E * (1.0 - (1.0 - K / E) ** rows) if E and rows else 0.0


def propose_parts(cfg: MtpConfig, k: int, context: int, B: int, kv_itemsize: int, kv_mode: str = "exact",
                  head_rows: int | None = None, shard: Any = None,
                  kv_scale_bytes: int = 0) -> list[tuple[str, float, int]]:
    """What one propose of k drafts must do, module by module and part by part, as
    ``(part, bytes, multiply-adds)``: ``m<i> proj`` (eh_proj, the attention's projections and
    o_proj), ``m<i> ffn`` (router, routed and shared experts or the dense MLP), ``m<i> attn``
    (the KV rows read; a score and a weighted value per key and query head; MLA: the latent
    rows and the absorption) and ``m<i> head`` (the LM head, read once a draft, once per
    sequence). Bytes: the weights as BF16, read once a propose for all the module's rows (the
    routed experts those rows reach in expectation, ``expected_experts``), plus the KV.
    Multiply-adds: every row the module writes (``cuda_graph.step_rows``: exact mode
    ``min(m, k) + 1`` a sequence, draft mode 1) through every projection and its experts.

    Modules: draft mode runs the k drafting ones; exact mode all of them, the ones past k
    without their LM head (they write the rows of the token just verified and of the drafts).
    Exact mode's last module feeds no module (``ExactChain.run``): its rows stop after their
    K/V (eh_proj and the q|k|v projection), and only one row a sequence goes on through the
    attention, o_proj and the FFN when it drafts (M - 1 < k), none when it does not.
    Module 0 attends over ``context`` rows; modules m >= 1 too in exact mode, but in draft
    mode only over the row they write (after_verify(0) left none of theirs); a sliding
    window caps the rows a module reads. ``head_rows``: the LM head's rows (a draft
    vocabulary's size; default the whole vocabulary). ``shard``: one rank of a sharded head
    (mtpkern.shard): its heads, KV heads and vocabulary rows, ``1 / size`` of the experts'
    and the MLPs' (the routed experts' in expectation, by id or by slice), the replicated
    tensors whole. ``kv_scale_bytes``: an FP8 KV cache's scale per row and KV head, of K and of V
    (4; ``Backend.kv_row_bytes``), read with the codes."""
    H, V = cfg.hidden_size, cfg.vocab_size if head_rows is None else head_rows
    if shard is not None:
        lo, hi = shard.vocab(cfg.vocab_size)
        V = hi - lo
    share = 1 if shard is None else shard.size
    parts: list[tuple[str, float, int]] = []
    M = cfg.num_modules
    for m in range(M if kv_mode == "exact" else k):
        b = cfg.block(m) if shard is None else shard.block(cfg.block(m))
        rows = B * (min(m, k) + 1 if kv_mode == "exact" else 1)       # the rows the module writes
        # the rows that go on past their K/V: exact mode's last module, the drafting rows only
        on = rows if kv_mode != "exact" or m < M - 1 else (B if m < k else 0)
        kv_proj = H * H * 2                                               # eh (its K/V's rows)
        on_proj = H * b.o_size                                             # o
        keys = context if m == 0 or kv_mode == "exact" else 1
        if b.sliding_window:
            keys = min(keys, b.sliding_window)
        if b.mla:          # q_a (or q_proj), q_b, kv_a_proj_with_mqa, kv_b_proj (w_uk and w_uv)
            Q, L, R = b.q_lora_rank, b.kv_lora_rank, b.qk_rope_head_dim
            kv_proj += (Q * H + b.q_size * Q if Q else b.q_size * H) + b.latent_width * H
            on_proj += b.num_attention_heads * (b.qk_nope_head_dim + b.v_dim) * L          # the absorption
            attn_fmas = keys * b.num_attention_heads * (2 * L + R)
        else:
            kv_proj += b.qkv_size * H                                     # q|k|v|gate
            if b.q_lora_rank:                                             # q_a, then q_b from the latent
                kv_proj += b.q_lora_rank * H + b.q_size * b.q_lora_rank - b.q_size * H
            if b.o_groups:                                                # o_a per group, then o_b
                on_proj += b.o_lora_rank * b.o_size + H * b.o_groups * b.o_lora_rank - H * b.o_size
            attn_fmas = keys * b.num_attention_heads * (b.head_dim + b.v_dim)
        if cfg.hc_mult > 1:              # the FP32 hyper-connection mixes: hc_attn_fn; hc_ffn_fn and hc_head_fn
            s_, w_ = cfg.hc_mult * H, (2 + cfg.hc_mult) * cfg.hc_mult
            parts.append((f"m{m} hc", 4 * s_ * (w_ + (w_ + cfg.hc_mult if on else 0)),
                          rows * w_ * s_ + on * (w_ + cfg.hc_mult) * s_))
        if not on:
            ffn_bytes, ffn_fmas = 0, 0
        elif b.moe:
            E, K, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
            Is = cfg.shared_intermediate_size
            ffn_bytes = 2 * (E * H + expected_experts(E, K, on) * 3 * I * H / share + 3 * Is * H // share)
            ffn_fmas = E * H + (K * 3 * I * H + 3 * Is * H) // share
        else:
            ffn_bytes = 2 * (3 * cfg.intermediate_size * H // share)
            ffn_fmas = 3 * cfg.intermediate_size * H // share
        parts += [(f"m{m} proj", 2 * (kv_proj + (on_proj if on else 0)), rows * kv_proj + on * on_proj),
                  (f"m{m} ffn", ffn_bytes, on * ffn_fmas),
                  (f"m{m} attn", B * keys * (b.kv_row_values * kv_itemsize
                                             + (0 if b.mla else 2 * b.num_key_value_heads * kv_scale_bytes))
                   if on else 0, on * attn_fmas)]
        if m < k:
            parts.append((f"m{m} head", 2 * V * H, B * V * H))
    return parts


def propose_bytes(cfg: MtpConfig, k: int, context: int, B: int, kv_itemsize: int, kv_mode: str = "exact",
                  head_rows: int | None = None, shard: Any = None) -> int:
    """Bytes one propose of k drafts must read: the sum of ``propose_parts`` (same arguments)."""
    return round(sum(p[1] for p in propose_parts(cfg, k, context, B, kv_itemsize, kv_mode, head_rows, shard)))


def propose_fmas(cfg: MtpConfig, k: int, context: int, B: int, kv_mode: str = "exact",
                 head_rows: int | None = None) -> int:
    """Multiply-adds one propose of k drafts must do: the sum of ``propose_parts``."""
    return sum(p[2] for p in propose_parts(cfg, k, context, B, 4, kv_mode, head_rows))


def propose_roof_us(parts: list[tuple[str, float, int]], read_gbs: float, gfma: float | None) -> float:
    """The roofline of a propose: each part at the slower of its bytes at ``read_gbs`` and its
    multiply-adds at ``gfma`` (GFMA/s; None: bytes only), summed. Above the floor where some
    part is bound by arithmetic: at batch 8 the LM head's 8 rows (8 x V x H multiply-adds
    against its 2 x V x H bytes) while the experts are still bound by their bytes."""
    return sum(max(nb / (read_gbs * 1e9), (f / (gfma * 1e9) if gfma else 0.0)) for _, nb, f in parts) * 1e6


@contextmanager
def fast_fill(be) -> Iterator[None]:
    """Within: every op of ``be`` except the KV write returns zeros (into its ``out=``
    buffers when given), so a prefill of 32768 rows writes its KV in seconds instead of
    the minutes its O(n^2) attention and O(n) GEMMs would take on a CPU. A propose's
    cost does not depend on the values in the KV, only on how many rows it holds."""
    xp = be.xp

    def zeros(buf, shape, dtype=np.float32):
        if buf is None:
            return xp.zeros(shape, dtype)
        buf[...] = 0
        return buf

    def fake(shape_of):                   # an op writing zeros of shape_of(its arguments)
        return lambda *a, out=None, **workspaces: zeros(out, shape_of(*a))

    def router(x, gate_w, bias, spec, *, ids=None, weights=None, **workspaces):
        return zeros(ids, (x.shape[0], spec.top_k), np.int32), zeros(weights, (x.shape[0], spec.top_k))

    fakes = {
        "rmsnorm": fake(lambda x, *a: x.shape),
        "mtp_input": fake(lambda embed, tokens, *a: (tokens.shape[0], embed.shape[1])),
        "linear": fake(lambda x, w, *a: (x.shape[0], w.shape[0])),
        "paged_attention": fake(lambda q, k_cache, v_cache, *a: (q.shape[0], q.shape[1] * v_cache.shape[3])),
        "mla_attention_absorbed": fake(lambda q, w_uk, w_uv, *a: (q.shape[0], q.shape[1] * w_uv.shape[1])),
        "sigmoid_gate": fake(lambda x, *a: x.shape),
        "moe_router": router,
        "moe_experts": fake(lambda x, *a: x.shape),
        "swiglu_mlp": fake(lambda x, *a: x.shape),
    }
    for name, fake in fakes.items():
        setattr(be, name, fake)           # an instance attribute shadows the method
    try:
        yield
    finally:
        for name in fakes:
            delattr(be, name)


def make_proposer(ckpt: Path, be, kv_mode: str, max_batch: int, max_context: int, steps: int,
                  draft_vocab: Any = None):
    """A proposer whose pools hold ``max_batch`` sequences of ``max_context + steps`` rows."""
    from .proposer import MultiModuleMtpHead

    rows = max_context + 2 * steps + 64
    tree = 4 * 84                            # a width-4 tree's other lines: a block or two per row, M = 3
    return MultiModuleMtpHead.from_pretrained(ckpt, backend=be, kv_mode=kv_mode, draft_vocab=draft_vocab,
                                              num_blocks=max_batch * (-(-rows // 16) + 1 + tree) + 8)


def _filled_states(prop, B: int, context: int) -> tuple[list, list[int], np.ndarray]:
    """``B`` states prefilled with ``context`` rows (``fast_fill``), and a token and a hidden
    for each one's propose."""
    rng = np.random.default_rng(1)
    H, V = prop.config.stream_size, prop.config.vocab_size          # (hyper-connections: the streams)
    sts = []
    with fast_fill(prop.backend):
        for _ in range(B):
            st = prop.alloc_state()
            prop.prefill_drafter(rng.integers(0, V, context), np.zeros((context, H), np.float32), st)
            sts.append(st)
    return sts, rng.integers(0, V, B).tolist(), rng.standard_normal((B, H)).astype(np.float32)


#: the sampled rows' draws (``+sample``): a temperature with top-p, as engines sample at T > 0
BENCH_SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, seed=1)


def time_proposes(prop, k: int, B: int, context: int, warmup: int, runs: int, conf: bool = False,
                  min_confidence: float | None = None, sampled: bool = False) -> Timing:
    """``propose_batch`` of ``k`` drafts for ``B`` fresh sequences of ``context`` rows each
    (filled with ``fast_fill``): the time of the propose alone, over ``runs`` calls; ``conf``:
    asking for the drafts' confidences (``out_conf``); ``min_confidence``: an early stop;
    ``sampled``: every sequence's drafts sampled (``BENCH_SAMPLING``) with their probabilities
    (``out_prob``, what rejection sampling divides by)."""
    sts, toks, hs = _filled_states(prop, B, context)
    ts = []
    try:
        for i in range(warmup + runs):
            t0 = time.perf_counter()
            prop.propose_batch(toks, hs, [context + i] * B, k, sts, out_conf=[] if conf else None,
                               min_confidence=min_confidence, sampling=[BENCH_SAMPLING] * B if sampled else None,
                               out_prob=[] if sampled else None)
            prop.backend.synchronize()
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
            for st in sts:                   # a trim with no compute: kept out of the time
                prop.after_verify(0, st)
    finally:
        for st in sts:
            prop.free_state(st)
    return Timing.of(ts)


def time_trees(prop, widths: list[int], B: int, context: int, warmup: int, runs: int,
               batched: bool = False) -> Timing:
    """``propose_tree`` of ``widths`` for ``B`` fresh sequences of ``context`` rows, one tree
    per sequence (a call each; ``batched``: one ``propose_tree_batch`` of all ``B``), timed
    together as one step; each tree verified with nothing accepted (kept out of the time)."""
    sts, toks, hs = _filled_states(prop, B, context)
    ts = []
    try:
        for i in range(warmup + runs):
            t0 = time.perf_counter()
            if batched:
                prop.propose_tree_batch(toks[:B], hs[:B], [st.next_position for st in sts], sts, widths=widths)
            else:
                for j in range(B):
                    prop.propose_tree(toks[j], hs[j], sts[j].next_position, sts[j], widths=widths)
            prop.backend.synchronize()
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
            if batched:                      # nothing accepted: no catch-up in either mode
                prop.after_verify_tree_batch([[] for _ in sts], sts)
            else:
                for st in sts:
                    prop.after_verify_tree([], st)
    finally:
        for st in sts:
            prop.free_state(st)
    return Timing.of(ts)


# -- the command ------------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``mtpkern bench``."""
    ap.add_argument("--backend", default="cpu", choices=["numpy", "cpu", "cuda"], help="backend to time")
    ap.add_argument("--threads", type=argtypes.positive_int, default=None, metavar="N",
                    help="Numba threads of the cpu backend (default: the backend's, half the cores)")
    ap.add_argument("--shapes", default="small", choices=sorted(SHAPES),
                    help="shape set: tiny (H=64, V=301), small (H=1024, V=32768), glm45air (H=4096, V=151552), "
                         "step35 (Step-3.5's MTP block at H=1024: window 512, head-wise gate, dense), "
                         "mla (DeepSeek-V3's MLA block at H=1024: 16 heads, L 512, R 64, q_lora 384), "
                         "dsa (the mla block with DeepSeek-V3.2's indexer: 64 heads of 128, top 2048), "
                         "dsv4 (DeepSeek-V4-Flash's MTP block at H=1024: 4 streams, 16 heads of 512 over one "
                         "K = V head, window 128, FP8 + FP4 experts)")
    ap.add_argument("--contexts", type=argtypes.positive_ints, default=None, metavar="N[,N...]",
                    help="rows of KV already in each sequence, e.g. 512,4096,32768 "
                         "(default: the shape set's: tiny 64, small 512, glm45air 512, step35 2048, mla 2048, dsa 4096, "
                         "dsv4 2048)")
    ap.add_argument("--batches", type=argtypes.positive_ints, default="1,8", metavar="B[,B...]",
                    help="sequences per propose_batch")
    ap.add_argument("--kv-modes", type=argtypes.choices_list("draft", "exact"), default="draft,exact",
                    metavar="MODE[,MODE]", help="KV modes to time")
    ap.add_argument("--runs", type=argtypes.positive_int, default=20, help="timed runs per figure")
    ap.add_argument("--warmup", type=argtypes.nonnegative_int, default=3, help="untimed runs before them")
    ap.add_argument("--no-ops", action="store_true", help="skip the per-op table")
    ap.add_argument("--no-propose", action="store_true", help="skip the propose table")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager peer even if torch imports")
    ap.add_argument("--fp8-kv", action="store_true",
                    help="also time the KV write and the paged attention with an FP8 KV cache (E4M3 codes and a "
                         "scale per row and KV head; rows '<op>_fp8kv', at every context) beside the backend's "
                         "own (BF16 on cuda, FP32 on cpu / numpy); GQA shapes only")
    ap.add_argument("--tree-widths", type=argtypes.positive_int, nargs="*", default=[1, 4], metavar="W",
                    help="draft-tree rows: a tree of depth M with W children per node, for each W, "
                         "a propose_tree per sequence (+treeW) and one propose_tree_batch of the batch "
                         "(+treebatchW) (default 1 4; none: no tree rows)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="also time k = M with a reduced draft vocabulary of the first N token ids (rows '+vocabN'; "
                         "0: off)")
    ap.add_argument("--json", type=argtypes.output_file, default=None, metavar="PATH",
                    help="write every figure as JSON to PATH (default: not written)")
    ap.add_argument("--plot", type=argtypes.output_file, default=None, metavar="PATH",
                    help="draw propose latency against context and batch, with the floor, as a PNG "
                         f"(needs matplotlib: {install_hint('plot')}) (default: not drawn)")


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or ``MissingExtra`` naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra(f"--plot needs matplotlib, which is not installed: {install_hint('plot')}",
                           extra="plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``mtpkern bench``: print the tables; returns the figures (what ``--json`` writes)."""
    from .backends import get_backend
    from .progress import warm_up

    if args.plot is not None and args.no_propose:
        raise ValueError("--plot draws the propose figures: drop --no-propose")
    plt = require_matplotlib() if args.plot is not None else None   # fail before the long part
    make_cfg, default_context = SHAPES[args.shapes]
    cfg = make_cfg()
    contexts = args.contexts or [default_context]
    batches = args.batches
    be = get_backend(args.backend, threads=args.threads)
    warm_up(be)
    be8 = None
    if getattr(args, "fp8_kv", False):
        if cfg.block(0).mla:
            raise ValueError(f"--fp8-kv: the FP8 KV cache is implemented for GQA attention; --shapes {args.shapes} "
                             f"is MLA")
        be8 = kv_twin(be, "fp8")
        warm_up(be8)
    threads = getattr(be, "threads", None)
    res: dict[str, Any] = {"shapes": args.shapes, "config": cfg.describe(), "contexts": contexts,
                           "backend": be.describe(), "threads": threads,
                           "machine": f"{_cpu_model()} ({platform.machine()}), {_cpu_count()} cores",
                           "runs": args.runs, "warmup": args.warmup, "max_spread": MAX_SPREAD}
    llc = last_level_cache() if be.name != "cuda" else None
    copy_gbs = copy_bandwidth(stream_bytes(llc)) if be.name != "cuda" else _device_copy_bandwidth()
    read_gbs = read_bandwidth(stream_bytes(llc)) if be.name != "cuda" else copy_gbs
    gfma = fma_rate() if be.name != "cuda" else None
    res["last_level_cache_bytes"] = llc
    res["copy_GB/s"] = copy_gbs
    res["read_GB/s"] = read_gbs
    res["sgemm_GFMA/s"] = gfma
    print(f"mtpkern bench: {cfg.describe()}, contexts {','.join(map(str, contexts))}, backend {be.describe()}")
    print(f"machine: {res['machine']}; copy {copy_gbs:.1f} GB/s (bytes copied per second; "
          f"{2 * copy_gbs:.1f} GB/s read + write); read {read_gbs:.1f} GB/s (BLAS GEMV or an 8-stream read, the faster)"
          + (f"; last-level cache {llc / 2**20:.0f} MiB" if llc else "")
          + (f"; sgemm {gfma:.0f} GFMA/s" if gfma else ""))
    if not args.no_ops:
        res["ops"] = []
        for n in batches:
            res["ops"] += bench_ops(cfg, be, contexts[0], n, args.warmup, args.runs, copy_gbs, be8=be8)
            for c in contexts[1:]:
                res["ops"] += bench_ops(cfg, be, c, n, args.warmup, args.runs, copy_gbs,
                                        only="mla_attention" if cfg.block(0).mla else "paged_attention", be8=be8)
        print_ops(res["ops"])
    if not args.no_propose:
        res["propose"] = bench_proposes(args, cfg, be, contexts, read_gbs, llc, res, gfma)
    noisy = [r for r in res.get("ops", []) + res.get("propose", []) if r["warnings"]]
    res["untrusted"] = len(noisy)
    if noisy:
        print(f"\nwarning: {len(noisy)} figure(s) marked '!' are not to be trusted: runs spread more than "
              f"p80/p20 = {MAX_SPREAD} (a busy machine: rerun with more --runs when it is quiet) or a time "
              f"is below its floor (a measurement error)")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2))
        print(f"\nwrote {args.json}")
    if plt is not None:
        plot(plt, res, args.plot)
        print(f"drew {args.plot}")
    return res


def bench_proposes(args, cfg: MtpConfig, be, contexts: list[int], read_gbs: float, llc: int | None,
                   res: dict, gfma: float | None = None) -> list[dict]:
    """The propose table. A figure is held to its floor only when the propose reads more
    than the last-level cache: a working set that fits can stay cached from one call to
    the next and beat any memory floor."""
    ckpt = synthetic_checkpoint(args.shapes, say=lambda line: print("\n" + line))
    torch_peer = None if args.no_torch else _torch_peer(ckpt, cfg)
    if torch_peer is None:
        res["torch"] = ("skipped" if args.no_torch else "no MLA in the eager peer"
                        if any(cfg.block(m).mla for m in range(cfg.num_modules)) else "not importable")
        print("\nPyTorch: " + res["torch"] + " (no eager comparison)")
    steps = args.warmup + args.runs
    props = {mode: make_proposer(ckpt, be, mode, max(args.batches), max(contexts), steps)
             for mode in args.kv_modes}
    nv = getattr(args, "draft_vocab", 0)
    if nv and not 1 <= nv <= cfg.vocab_size:
        raise ValueError(f"--draft-vocab: expected 1 .. {cfg.vocab_size} (the vocabulary), got {nv}")
    sub = {mode: make_proposer(ckpt, be, mode, max(args.batches), max(contexts), steps, np.arange(nv))
           for mode in args.kv_modes} if nv else {}
    kvb = np.dtype(be.kv_dtype).itemsize
    kvs = 4 if be.kv_fp8 else 0                      # an FP8 cache's scales
    rows = []
    print(f"\n{'kv_mode':<17}{'k':>3}{'B':>4}{'ctx':>7}{'median us':>12}{'p20':>10}{'p80':>10}{'floor us':>10}"
          f"{'x floor':>9}{'roof us':>9}{'x roof':>8}{'torch us':>10}{'vs torch':>9}")
    for context in contexts:
        for B in args.batches:
            M = cfg.num_modules
            # k = 1 .. M; then k = M with confidences, and with an early stop at 0.5 (the floor
            # of a propose of all M drafts: the stop reads less when it stops)
            cases = [(k, False, None, False, 0) for k in range(1, M + 1)]
            cases += [(M, True, None, False, 0), (M, True, 0.5, False, 0)]
            cases += [(M, False, None, True, 0)] if sub else []               # the draft vocabulary's heads
            cases += [(M, False, None, "sample", 0)]           # sampled drafts beside the greedy k = M row
            # draft trees of depth M: width 1 (the chain, through propose_tree) and 4 (4 + 16 + 64 nodes at M = 3),
            # a call per sequence, then all B in one propose_tree_batch (negative widths below)
            cases += [(M, True, None, False, w) for w in getattr(args, "tree_widths", ())]
            cases += [(M, True, None, False, -w) for w in getattr(args, "tree_widths", ())]
            for k, conf, stop, reduced, width in cases:
                batched, width = width < 0, abs(width)
                sampled, reduced = reduced == "sample", reduced is True
                tt = torch_peer(k, B, args.warmup, args.runs, context) \
                    if torch_peer and not (conf or reduced or width) else None
                for mode, prop in (sub if reduced else props).items():
                    parts = propose_parts(cfg, k, context, B, kvb, mode, nv if reduced else None, kv_scale_bytes=kvs)
                    nbytes = round(sum(p[1] for p in parts))
                    floor_us = nbytes / (read_gbs * 1e9) * 1e6
                    fmas = sum(p[2] for p in parts)
                    roof_us = propose_roof_us(parts, read_gbs, gfma)   # each part at its slower bound
                    # a tree's floor is its chain's (its other rows read no more weights; they cost compute)
                    judged = (llc is None or nbytes > llc) and stop is None and not width
                    if width:
                        t = time_trees(prop, [width] * k, B, context, args.warmup, args.runs, batched)
                        tag = f"+treebatch{width}" if batched else f"+tree{width}"
                    else:
                        t = time_proposes(prop, k, B, context, args.warmup, args.runs, conf, stop, sampled)
                        tag = (f"+vocab{nv}" if reduced else "+sample" if sampled else "" if not conf
                               else "+conf" if stop is None else f"+stop{stop:g}")
                    row = {"kv_mode": mode + tag, "conf": conf, "min_confidence": stop, "tree_width": width or None,
                           "tree_batched": batched if width else None,
                           "sampling": asdict(BENCH_SAMPLING) if sampled else None,
                           "draft_vocab": nv if reduced else None, "k": k, "batch": B,
                           "context": context, **asdict(t),
                           "bytes": nbytes, "floor_us": floor_us, "x_floor": t.median_us / floor_us,
                           "fmas": fmas, "roof_us": roof_us, "x_roof": t.median_us / roof_us,
                           "floor_judged": judged, "spread": t.spread,
                           "warnings": warnings_of(t, floor_us if judged else None)}
                    if tt is not None:
                        row["torch_median_us"] = tt.median_us
                        row["speedup_vs_torch"] = tt.median_us / t.median_us
                    rows.append(row)
                    print(f"{row['kv_mode']:<17}{k:>3}{B:>4}{context:>7}{t.median_us:>12.0f}{t.p20_us:>10.0f}"
                          f"{t.p80_us:>10.0f}{floor_us:>10.0f}{row['x_floor']:>9.2f}{roof_us:>9.0f}{row['x_roof']:>8.2f}"
                          + (f"{tt.median_us:>10.0f}{row['speedup_vs_torch']:>8.2f}x" if tt else "")
                          + _marks(row))
    return rows


def print_ops(ops: list[dict]) -> None:
    print(f"\n{'op':<28}{'rows':>5}{'median us':>12}{'p20':>10}{'p80':>10}{'MB':>9}{'GB/s':>8}{'of copy':>9}")
    for r in ops:
        print(f"{r['op']:<28}{r['rows']:>5}{r['median_us']:>12.1f}{r['p20_us']:>10.1f}{r['p80_us']:>10.1f}"
              f"{r['bytes'] / 1e6:>9.2f}{r['GB/s']:>8.2f}{r['of_copy']:>8.0%}" + _marks(r))


def _marks(row: dict) -> str:
    """The table's note for a figure: '!' and why, when it is not to be trusted."""
    if not row["warnings"]:
        return ""
    why = ["spread %.1f" % row["spread"] if row["spread"] > MAX_SPREAD else "",
           "below floor" if row.get("floor_judged") and floor_error(row["median_us"], row["floor_us"]) else ""]
    return "  ! " + ", ".join(w for w in why if w)


def _plain_log_label(ax, minor: bool):
    """Tick labels of a log y axis as plain numbers (``0.2``, ``20``; matplotlib's default
    writes ``2x10^1``): every decade; on an axis spanning less than two decades the minor
    ticks at 2 and 5 times a decade as well, and on one spanning less than one decade every
    minor tick (else few or no ticks in view would be labelled)."""
    def label(v: float, _pos) -> str:
        if v <= 0:
            return ""
        if minor:
            lo, hi = sorted(ax.get_ylim())
            span = hi / lo if lo > 0 else np.inf
            mant = v / 10.0 ** np.floor(np.log10(v) + 1e-9)
            if span > 100 or (span > 10 and min(abs(mant - 2), abs(mant - 5)) > 1e-6):
                return ""
        return f"{v:g}"
    return label


def plot(plt, res: dict, path: Path):
    """Propose latency (median, p20-p80 bars) with k = M against context (left) and against
    batch (right): one colour per batch / context, solid draft, dotted exact, and each mode's
    memory floor as a line of its own (dashed draft, dash-dotted exact: the two modes read
    different bytes, so one line through both would zig-zag). Plain-number ticks on both log
    axes; the legends sit below the plots, off the data. Returns the (closed) figure."""
    from matplotlib.ticker import FuncFormatter

    k = max(r["k"] for r in res["propose"])
    rows = [r for r in res["propose"] if r["k"] == k and r["kv_mode"] in ("draft", "exact")]
    modes = (("draft", "-o", "--"), ("exact", ":s", "-."))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    legends = []
    for ax, x, series in ((axes[0], "context", "batch"), (axes[1], "batch", "context")):
        for i, s in enumerate(sorted({r[series] for r in rows})):
            colour = f"C{i % 10}"
            for mode, style, floor_style in modes:
                pts = sorted(((r[x], r) for r in rows if r[series] == s and r["kv_mode"] == mode),
                             key=lambda p: p[0])
                if not pts:
                    continue
                med = np.array([r["median_us"] for _, r in pts]) / 1e3                      # ms
                err = np.array([[r["median_us"] - r["p20_us"], r["p80_us"] - r["median_us"]]
                                for _, r in pts]).T / 1e3
                ax.errorbar([p for p, _ in pts], med, yerr=err, fmt=style, color=colour, capsize=3,
                            label=f"{mode}, {series} {s}")
                ax.plot([p for p, _ in pts], [r["floor_us"] / 1e3 for _, r in pts], floor_style, color=colour,
                        linewidth=0.8, label=f"{mode} floor, {series} {s}")
        values = sorted({r[x] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_plain_log_label(ax, minor=False)))   # 20, not 2x10^1
        ax.yaxis.set_minor_formatter(FuncFormatter(_plain_log_label(ax, minor=True)))
        ax.set_xlabel("context (rows of KV per sequence)" if x == "context" else "batch (sequences)")
        ax.set_ylabel("propose latency, ms")
        ax.grid(True, which="both", alpha=0.3)
        legends.append(ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
                                 frameon=False))
    fig.suptitle(f"mtpkern propose, k={k}: {res['config']}\n{res['backend']}; {res['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=legends)
    plt.close(fig)
    return fig


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _device_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    import cupy as cp

    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    t = measure(lambda: cp.copyto(dst, src), 3, 10, cp.cuda.get_current_stream().synchronize)
    return nbytes / (t.median_us * 1e-6) / 1e9


def _torch_peer(ckpt: Path, cfg: MtpConfig):
    """A timing function ``(k, B, warmup, runs, context) -> Timing`` for a PyTorch eager
    MTP step on the same weights, or None."""
    if any(cfg.block(m).mla for m in range(cfg.num_modules)):
        return None                        # the eager peer computes GQA blocks only
    try:
        from . import bench_torch
    except ImportError:
        return None
    return bench_torch.make_timer(ckpt, cfg)
