"""GPU benchmark of the cuda backend on GLM-4.5-Air-sized shapes (run by scripts/gpu_check.sh).

    python3 benchmarks/gpu_bench.py --out ./out [--runs 20] [--budget-s 140] [--no-mla] [--no-torch]

Shapes: H = 4096, 96 query / 8 KV heads, D = 128, 128 routed experts (top-8,
one group), moe_intermediate = 1408, 1 shared expert, V = 151552, M = 3;
contexts 512 and 8192. The weights are random BF16 generated on the device
(no checkpoint is written; ~16 GB of device memory).

1. ``copy``: the ceiling every GB/s below is compared with ("of copy"), the faster of
   a 1 GiB device-to-device cudaMemcpyAsync (2 bytes moved per byte copied) and a
   streaming-read kernel over 2 GiB (16-byte loads, a persistent grid: the access of a
   decode step, which reads and barely writes). The first H200 run measured the memcpy
   alone, captured in a graph: 2.7 TB/s, under what the LM head's GEMV read (3.85 TB/s),
   so every "floor" of that run is ~1.4x too generous.
2. ``kernels``: each op at decode shapes (1 and 8 rows), median over ``--runs``
   runs with the L2 flushed before each (a memset of max(4 x L2, 256 MiB)),
   timed with CUDA events around a CUDA graph of the op (so the host launch
   cost is not in the number; "eager" where the op could not be captured).
   Bytes are counted explicitly per op (weights, activations, KV, workspaces
   written and read back); GB/s = bytes / median, "of copy" = GB/s / copy GB/s.
   Then ``linear_o`` / ``moe_experts`` / ``lm_head_argmax`` with their weights stored ``fp8``
   (E4M3, FP32 scales per 128 x 128) and ``fp4`` (E2M1 two a byte, an E8M0 scale per 32) at
   the same shapes and rows: random codes, bytes counted as stored (docs/fp8.md, docs/fp4.md).
   Then Kimi K3's block features at the same shape: ``moe_experts situ`` / ``swiglu_shared
   situ`` (the SiTU epilogue on the same weights) and LatentMoE at Lt 1024 (``linear
   fc1_latent``, ``moe_experts latent`` with experts of width Lt, ``linear fc2_latent norm``
   with the latent norm fused).
   Then ``dsv4 hc_*``: DeepSeek-V4-Flash's hyper-connections (m 4 streams of H 4096, 20
   Sinkhorn iterations, FP32 streams) at 1 and 64 rows: ``hc_pre`` (coefficients and the
   collapse), ``hc_post`` (the write-back), ``hc_head``.
   Then ``sample ...``: ``sample_kernel`` (kernels/sampling.cu, the sampled draft over given
   logits; the launch alone, its per-row parameters already on the device) at V = 32768 and
   151936, 1 and 8 rows: temperature 0.8 alone, with top_k 50, with top_p 0.95; logits
   3 * N(0, 1). Bytes: the logits read once (the kernel reads a row once per pass, from L2);
   us per row = median / rows. Then ``lm_head fused sample T`` beside ``lm_head argmax`` at the
   same shapes: the temperature-only draw fused into a BF16 head [V, 4096] (no logits written)
   against the greedy argmax on the same head, and ``lm_head fused sample top_k 50 top_p 0.95``
   (the top_k draw, through ``lm_head_sample``: its host read of the ids included); bytes: the
   head, x and the outputs.
   Then ``dsv4 ...``: the ops DeepSeek-V4's attention adds to a GQA block at its shape (64
   heads x 512, 64 rotary dims) at 1 and 64 rows: ``rope_heads`` (the output's rotary dims
   turned back) and the shared-KV write (``qk_norm_rope_kv_write(v_is_k=True)``).
3. ``propose``: one ``propose_batch`` (host included: validation, staging, the
   drafts' device-to-host copy) for k = 1..3 at batch 1 and 8, exact and draft
   KV modes, eager vs CUDA-graph replay, L2 flushed before each. "floor" is
   (bytes the step must read) / (copy bandwidth): weights of every module that
   runs, the LM head of the modules that draft, each sequence's KV once per
   module, and the routed experts expected under uniform routing,
   E (1 - (1 - K/E)^rows) (an estimate: the router decides).

4. ``dsv3 ...`` kernels (``--no-mla`` leaves them out): DeepSeek-V3's MTP module (MLA: 128
   heads, kv_lora 512, rope 64, q_lora 1536; 256 experts top-8, moe_intermediate 2048;
   V = 129280) op by op at 1 and 8 rows, its own random BF16 weights (~27 GB, freed after):
   the MLA projections, the latent write, the absorbed attention at each context, o_proj,
   router, experts, shared expert, LM head. Then ``dsv32 ...``: DeepSeek-V3.2's sparse attention
   at contexts 4096 and 32768 (one sequence a row): ``dsa_select`` (64 indexer heads of 128,
   topk 2048, the scores included) and the MLA attention it saves, over the 2048 listed rows
   (``index=``) beside the dense one over the whole context; ``glm5.3 dsa_select kpool``: GLM-5.3's
   pooled indexer at the same contexts (32 heads of 128, pools of 16 rows, topk 2048 and the tail).

5. ``torch`` (``--no-torch`` leaves it out): beside each propose row, the PyTorch eager peer
   (``mtpkern/bench_torch.py``) at the same context, batch and k on the same device weights
   (shared through DLPack), L2 flushed before each step, timed between
   ``torch.cuda.synchronize()`` calls; "torch / graph" is its time over the graph replay's.
   Beside the kernel rows that have a one-call counterpart (rmsnorm, linear_qkv, linear_o,
   swiglu_shared, lm_head_argmax, paged_attention as SDPA over a contiguous cache), that
   ``nn.functional`` call on the same weights with BF16 activations, timed with torch CUDA
   events (eager: launch gaps included), L2 flushed before each run.

Results are written as they are measured (``Recorder``): ``gpu_bench.jsonl`` (one JSON
record a line: meta, kernel, propose, note, error, end) and ``gpu_bench.md`` (the tables,
a row a measurement), both in ``--out`` and flushed after every record, so a run cut short
(SIGTERM from the check script's time limit, a crash, SIGKILL) keeps every row it measured;
SIGTERM also writes the end record. Elapsed times are printed as it goes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from mtpkern.config import MtpConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

T0 = time.perf_counter()


#: the ceiling's streaming read: each thread loads 16 bytes at a time over a grid-stride loop, four in flight,
#: folded into one word that is stored only when it is a value no input makes (so it cannot be
#: optimised away and writes nothing)
READ_KERNEL = r"""
extern "C" __global__ void read_stream_kernel(const uint4* __restrict__ src, long long n16, unsigned* out) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride],
          d = src[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += stride) {
    uint4 a = src[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def decode_tables(n: int, ctx: int, BS: int = 16):
    """``n`` sequences of ``ctx`` cached rows each, in consecutive blocks of ``BS``: (blocks per
    sequence, block tables [n, nb], row_seq, row_len), int32 device arrays, one decode row a
    sequence."""
    import cupy as cp

    nb = -(-ctx // BS)
    return (nb, cp.arange(n * nb, dtype=cp.int32).reshape(n, nb), cp.arange(n, dtype=cp.int32),
            cp.full(n, ctx, cp.int32))


def glm45_air(M: int = 3) -> "MtpConfig":
    from mtpkern.config import small_config

    return small_config(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                        vocab_size=151552, n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1,
                        moe_intermediate_size=1408, n_shared_experts=1, routed_scaling_factor=1.0,
                        use_qk_norm=False, partial_rotary_factor=0.5, rope_theta=1e6,
                        num_hidden_layers=46, num_nextn_predict_layers=M, max_position_embeddings=131072)


def deepseek_v3() -> "MtpConfig":
    """DeepSeek-V3's MTP module (one, as released): MLA (128 heads, kv_lora 512, rope 64,
    nope 128, v 128, q_lora 1536), 256 experts top-8 of 8 groups / 4 kept, moe_intermediate
    2048, one shared expert, V = 129280."""
    from mtpkern.config import MtpConfig

    return MtpConfig(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, head_dim=192,
                     vocab_size=129280, num_hidden_layers=61, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
                     kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                     rope_interleave=True, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                     moe_intermediate_size=2048, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                     max_position_embeddings=163840, family="deepseek_v3")


def say(msg: str) -> None:
    print(f"[gpu_bench +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# -- device helpers ---------------------------------------------------------------------------

_FILL_SRC = r"""
unsigned long long z = (unsigned long long)i * 0x9E3779B97F4A7C15ULL + seed;
z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
z ^= z >> 31;
float u = (float)(z >> 40) * (1.0f / 16777216.0f);
unsigned int b = __float_as_uint((2.0f * u - 1.0f) * scale);
out = (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
"""
_fill_kernel = None


def bf16_uniform(shape, fan_in: int, seed: int):
    """A uint16 (BF16 bits) device array, uniform in +-sqrt(3 / fan_in) (std 1/sqrt(fan_in)),
    from a counter hash: no host data, ~memory speed."""
    import cupy as cp

    global _fill_kernel
    if _fill_kernel is None:
        _fill_kernel = cp.ElementwiseKernel("float32 scale, uint64 seed", "uint16 out", _FILL_SRC,
                                            "mtpkern_bench_fill_bf16")
    out = cp.empty(shape, cp.uint16)
    scale = np.float32(math.sqrt(3.0 / fan_in))
    if out.size < 1 << 30 or out.ndim < 2:
        _fill_kernel(scale, np.uint64(seed * 0x1000193 + 7), out)
    else:                           # DeepSeek-V3's experts (7.5 G values): one fill per leading index
        for e in range(shape[0]):
            _fill_kernel(scale, np.uint64((seed * 0x1000193 + 7) ^ (e * 0x9E3779B9)), out[e])
    return out


def build_weights(cfg: MtpConfig, seed: int = 0):
    """``MtpWeights`` with random BF16 device weights, one embedding / LM head shared by the modules."""
    import cupy as cp

    from mtpkern.weights import ModuleWeights, MtpWeights

    H, D, Hq, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    E, I, Is = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    s = iter(range(seed * 1000, seed * 1000 + 1000))

    def ones(n):
        return cp.ones(n, cp.float32)

    embed = bf16_uniform((V, H), 3, next(s))            # rows of O(1) entries (enorm rescales them)
    head = bf16_uniform((V, H), H, next(s))
    modules = []
    for _ in range(cfg.num_modules):
        modules.append(ModuleWeights(
            embed=embed, head=head, enorm=ones(H), hnorm=ones(H), eh_proj=bf16_uniform((H, 2 * H), 2 * H, next(s)),
            input_layernorm=ones(H), post_attention_layernorm=ones(H),
            w_qkv=bf16_uniform(((Hq + 2 * Hkv) * D, H), H, next(s)),
            b_qkv=cp.zeros((Hq + 2 * Hkv) * D, cp.float32) if cfg.attention_bias else None,
            q_norm=ones(D) if cfg.use_qk_norm else None, k_norm=ones(D) if cfg.use_qk_norm else None,
            w_o=bf16_uniform((H, Hq * D), Hq * D, next(s)), shared_head_norm=ones(H),
            gate_w=bf16_uniform((E, H), H, next(s)), gate_bias=cp.zeros(E, cp.float32),
            experts_w13=bf16_uniform((E, 2 * I, H), H, next(s)), experts_w2=bf16_uniform((E, H, I), I, next(s)),
            shared_w13=bf16_uniform((2 * Is, H), H, next(s)), shared_w2=bf16_uniform((H, Is), Is, next(s))))
    nbytes = sum(int(getattr(mw, f).nbytes) for mw in modules for f in mw.__slots__
                 if getattr(mw, f) is not None and f not in ("embed", "head")) + embed.nbytes + head.nbytes
    return MtpWeights(cfg, modules, None, nbytes, 2)


class Gpu:
    """Events, the L2 flush, and graph-timed runs."""

    def __init__(self):
        import cupy as cp

        self.cp = cp
        dev = cp.cuda.Device()
        self.props = cp.cuda.runtime.getDeviceProperties(dev.id)
        self.l2 = int(dev.attributes.get("L2CacheSize", 50 << 20))
        self.sms = int(self.props["multiProcessorCount"])
        self.last_sm_mhz: int | None = None
        try:                                   # NVML (nvidia-ml-py): the SM clock right after a timed op
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(dev.id))
        except Exception:
            self._nvml = None
        self.flush_buf = cp.empty(max(4 * self.l2, 256 << 20), cp.uint8)
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()

    def sm_clock(self) -> int | None:
        """The SM clock now, MHz (NVML), or None without NVML. The first H200 run's compute-heavy
        ops (attention, 8-row GEMVs) ran several times slower than their instruction counts
        predict at 1980 MHz while the streaming ones read at 3.8 TB/s: a low SM clock would do
        that, so every timed op records the clock it ran at."""
        if self._nvml is None:
            return None
        try:
            nv, h = self._nvml
            return int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        except Exception:
            return None

    def name(self) -> str:
        n = self.props["name"]
        return n.decode() if isinstance(n, bytes) else str(n)

    def flush(self) -> None:
        cp = self.cp
        cp.cuda.runtime.memsetAsync(self.flush_buf.data.ptr, 0, self.flush_buf.nbytes,
                                    cp.cuda.get_current_stream().ptr)

    def capture(self, fn: Callable[[], Any]):
        """``fn`` as a CUDA graph (all its buffers preallocated), or None when it cannot be captured."""
        cp = self.cp
        stream = cp.cuda.Stream(non_blocking=True)
        graph, err = None, None
        with stream:
            stream.begin_capture()
            try:
                fn()
            except Exception as e:
                err = e
            try:
                graph = stream.end_capture()
            except Exception as e:
                err = err or e
        stream.synchronize()
        return None if err is not None else graph

    def time_op(self, fn: Callable[[], Any], runs: int) -> tuple[list[float], str]:
        """Device time in microseconds of ``fn`` per run, L2 flushed before each."""
        cp = self.cp
        fn()                                             # compile and load
        cp.cuda.get_current_stream().synchronize()
        graph = self.capture(fn)
        how = "graph" if graph is not None else "eager"
        out = []
        for _ in range(runs):
            self.flush()
            self.start.record()
            if graph is not None:
                graph.launch(cp.cuda.get_current_stream())
            else:
                fn()
            self.end.record()
            self.end.synchronize()
            out.append(cp.cuda.get_elapsed_time(self.start, self.end) * 1e3)
        self.last_sm_mhz = self.sm_clock()
        return out, how

    def time_torch(self, fn: Callable[[], Any], runs: int) -> list[float]:
        """Device time in microseconds of the PyTorch eager ``fn`` per run (torch CUDA events on
        torch's stream, launch gaps included: that is eager), L2 flushed and the device idle
        before each."""
        import torch

        fn()                                             # cuBLAS handles, heuristics
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(runs):
            self.flush()
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        return out

    def read_bandwidth(self, nbytes: int = 2 << 30, runs: int = 10) -> tuple[float, float]:
        """(GB/s, median us) of READ_KERNEL streaming ``nbytes`` (each byte read once)."""
        cp = self.cp
        n16 = nbytes // 16
        src = cp.ones(n16 * 4, cp.uint32)
        out = cp.zeros(1, cp.uint32)
        kern = cp.RawKernel(READ_KERNEL, "read_stream_kernel")
        blocks = 4 * self.sms

        def read():
            kern((blocks,), (512,), (src, np.int64(n16), out))

        ts, _ = self.time_op(read, runs)
        med = float(np.median(ts))
        return n16 * 16 / (med * 1e-6) / 1e9, med

    def copy_bandwidth(self, nbytes: int = 1 << 30, runs: int = 10) -> tuple[float, float]:
        """(GB/s counting read + write, median us) of a device-to-device cudaMemcpyAsync."""
        cp = self.cp
        src, dst = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)

        def copy():
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                        cp.cuda.get_current_stream().ptr)

        ts, _ = self.time_op(copy, runs)
        med = float(np.median(ts))
        return 2 * nbytes / (med * 1e-6) / 1e9, med


def stats(ts: list[float]) -> dict:
    a = np.asarray(ts)
    return {"median_us": float(np.median(a)), "p20_us": float(np.percentile(a, 20)),
            "p80_us": float(np.percentile(a, 80)), "runs": len(ts)}


# -- kernels ------------------------------------------------------------------------------------

def kernel_cases(cfg: MtpConfig, be, w, n: int, contexts: list[int]) -> list[tuple[str, int, int, Callable]]:
    """(op, context, bytes moved, thunk) at ``n`` decode rows; every output preallocated."""
    import cupy as cp

    from mtpkern.backends.cuda_launch import attention as attn_launch
    from mtpkern.backends.cuda_launch import lm_head as lm_launch
    from mtpkern.backends.cuda_launch._util import sm_count
    from mtpkern.ops.moe import RouterSpec
    from mtpkern.ops.rope_kv import inv_freq

    H, D, Hq, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    E, K, I, Is = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    QKV = (Hq + 2 * Hkv) * D
    f4, b2 = 4, 2
    rs = cp.random.RandomState(n)

    def act(*shape):
        return rs.standard_normal(shape, dtype=cp.float32)

    def empty(*shape, dtype=cp.float32):
        return cp.empty(shape, dtype)

    x, g, r = act(n, H), act(n, H), act(n, H)
    y, out_h = empty(n, H), empty(n, H)
    tokens = cp.asarray(np.random.default_rng(n).integers(0, V, n).astype(np.int32))
    xcat = empty(n, 2 * H)
    qkv, q, o = act(n, QKV), empty(n, Hq, D), empty(n, Hq * D)
    eps = np.float32(cfg.rms_norm_eps)
    invf = cp.asarray(inv_freq(cfg.rotary_dim, cfg.rope_theta))
    spec = RouterSpec.from_config(cfg)
    logits, ids, wts = empty(n, E), empty(n, K, dtype=cp.int32), empty(n, K)
    be.moe_router(x, w.gate_w, w.gate_bias, spec, ids=ids, weights=wts, logits=logits)
    distinct = int(np.unique(ids.get()).size)
    act_e, partial = empty(n * K, I), empty(n * K, H)
    act_s = empty(n, Is)
    P = lm_launch.num_partials(V, sm_count())
    part_v, part_i, lm_ids = empty(n, P), empty(n, P, dtype=cp.int32), empty(n, dtype=cp.int32)

    cases = [
        ("rmsnorm", 0, 2 * n * H * f4 + H * f4, lambda: be.rmsnorm(x, w.input_layernorm, eps, out=y)),
        ("mtp_input", 0, n * H * b2 + n * H * f4 + 2 * H * f4 + 2 * n * 2 * H * f4 + 2 * H * H * b2 + n * H * f4,
         lambda: be.mtp_input(w.embed, tokens, g, w.enorm, w.hnorm, w.eh_proj, eps, out=out_h, xcat=xcat)),
        ("linear_qkv", 0, QKV * H * b2 + n * H * f4 + QKV * f4 + n * QKV * f4,
         lambda: be.linear(x, w.w_qkv, w.b_qkv, out=qkv)),
    ]
    # KV for attention: n sequences of `ctx` rows each, blocks of 16, random BF16 values.
    BS = 16
    for ctx in contexts:
        nb, tables, row_seq, row_len = decode_tables(n, ctx, BS)
        kc = bf16_uniform((n * nb, BS, Hkv, D), 3, 100 + ctx)
        vc = bf16_uniform((n * nb, BS, Hkv, D), 3, 200 + ctx)
        pos = cp.full(n, ctx - 1, cp.int32)
        slots = cp.asarray(np.arange(n, dtype=np.int32) * nb * BS + ctx - 1)
        # the same KV as an FP8 cache (E4M3 codes, one FP32 scale per row and KV head; mtpkern.ops.kv_fp8):
        # finite codes at random, every scale 2^-6; one byte a value and 4 a (row, KV head) read
        crs = cp.random.RandomState(300 + ctx)
        kc8, vc8 = ((crs.randint(0, 0x7E, (n * nb, BS, Hkv, D)) | (crs.randint(0, 2, (n * nb, BS, Hkv, D)) << 7))
                    .astype(cp.uint8) for _ in range(2))
        sc8 = {"k_scale": cp.full((n * nb, BS, Hkv), 2.0 ** -6, cp.float32),
               "v_scale": cp.full((n * nb, BS, Hkv), 2.0 ** -6, cp.float32)}
        if ctx == contexts[0]:
            cases.append(("qk_norm_rope_kv_write", 0,
                          n * QKV * f4 + n * Hq * D * f4 + 2 * n * Hkv * D * b2,
                          lambda kc=kc, vc=vc, pos=pos, slots=slots: be.qk_norm_rope_kv_write(
                              qkv, Hq, Hkv, w.q_norm, w.k_norm, eps, invf, pos, kc, vc, slots, out=q)))
            cases.append(("qk_norm_rope_kv_write fp8kv", 0,
                          n * QKV * f4 + n * Hq * D * f4 + 2 * n * Hkv * (D + 4),
                          lambda kc8=kc8, vc8=vc8, pos=pos, slots=slots, sc8=sc8: be.qk_norm_rope_kv_write(
                              qkv, Hq, Hkv, w.q_norm, w.k_norm, eps, invf, pos, kc8, vc8, slots, out=q, **sc8)))
        p = attn_launch.plan(Hq // Hkv, D, nb * BS, work=n * Hkv, target_blocks=2 * sm_count())
        ws = {}
        part_bytes = 0
        if p.num_parts > 1:
            ws = {"part_o": empty(n, Hq, p.num_parts, D), "part_ml": empty(n, Hq, p.num_parts, 2)}
            part_bytes = 2 * n * Hq * p.num_parts * (D + 2) * f4          # partials written, then merged
        qa = act(n, Hq, D)
        cases.append(("paged_attention", ctx, 2 * n * ctx * Hkv * D * b2 + 2 * n * Hq * D * f4 + part_bytes,
                      lambda kc=kc, vc=vc, tables=tables, row_seq=row_seq, row_len=row_len, qa=qa, ws=ws:
                      be.paged_attention(qa, kc, vc, tables, row_seq, row_len, D ** -0.5, out=o, **ws)))
        cases.append(("paged_attention fp8kv", ctx, 2 * n * ctx * Hkv * (D + 4) + 2 * n * Hq * D * f4 + part_bytes,
                      lambda kc8=kc8, vc8=vc8, tables=tables, row_seq=row_seq, row_len=row_len, qa=qa, ws=ws, sc8=sc8:
                      be.paged_attention(qa, kc8, vc8, tables, row_seq, row_len, D ** -0.5, out=o, **ws, **sc8)))
        # a sliding window of 128 rows with sinks (Step-3.5 / MiMo-V2 modules): the same grid
        # (partitions come from the shapes), most of its blocks exit at once
        win = min(128, ctx)
        starts, sinks = cp.full(n, ctx - win, cp.int32), act(Hq)
        win_bytes = 2 * n * win * Hkv * D * b2 + 2 * n * Hq * D * f4 + part_bytes
        cases.append((f"paged_attention w{win} sinks", ctx, win_bytes,
                      lambda kc=kc, vc=vc, tables=tables, row_seq=row_seq, row_len=row_len, qa=qa, ws=ws,
                      starts=starts, sinks=sinks:
                      be.paged_attention(qa, kc, vc, tables, row_seq, row_len, D ** -0.5, row_start=starts,
                                         sinks=sinks, out=o, **ws)))
    gates = act(n, QKV + Hq)[:, QKV:]               # head-wise gates: a column slice of a fused projection
    gated = empty(n, Hq * D)
    cases += [
        ("sigmoid_gate", 0, 2 * n * Hq * D * f4 + n * Hq * f4, lambda: be.sigmoid_gate(o, gates, out=gated)),
        ("linear_o", 0, H * Hq * D * b2 + n * Hq * D * f4 + 2 * n * H * f4,
         lambda: be.linear(o, w.w_o, None, x, out=out_h)),
        ("moe_router", 0, E * H * b2 + n * H * f4 + 2 * n * E * f4 + E * f4 + 2 * n * K * f4,
         lambda: be.moe_router(x, w.gate_w, w.gate_bias, spec, ids=ids, weights=wts, logits=logits)),
        (f"moe_experts ({distinct} experts)", 0,
         distinct * 3 * I * H * b2 + n * H * f4 + 2 * n * K * I * f4 + 2 * n * K * H * f4 + 2 * n * H * f4,
         lambda: be.moe_experts(x, ids, wts, w.experts_w13, w.experts_w2, r, out=y, act=act_e, partial=partial)),
        ("swiglu_shared", 0, 3 * Is * H * b2 + n * H * f4 + 2 * n * Is * f4 + 2 * n * H * f4,
         lambda: be.swiglu_mlp(x, w.shared_w13, w.shared_w2, r, out=y, act=act_s)),
        ("lm_head_argmax", 0, V * H * b2 + n * H * f4 + 2 * n * P * 8 + n * 4,
         lambda: be.lm_head_argmax(x, w.head, None, out=lm_ids, part_v=part_v, part_i=part_i, check=False)),
    ]
    return cases + situ_latent_cases(cfg, be, w, n, x, r, y, ids, wts, distinct)


#: LatentMoE's width in the ``latent`` rows: Nemotron-3 Super's 1024 (at H 4096)
LATENT_LT = 1024


def situ_latent_cases(cfg: MtpConfig, be, w, n: int, x, r, y, ids, wts, distinct: int
                      ) -> list[tuple[str, int, int, Callable]]:
    """Kimi K3's block features at this shape: the routed experts and the shared expert with
    the SiTU activation (beta 2, linear beta 4; the same weights and bytes as their SwiGLU rows:
    only the epilogue differs), and LatentMoE at Lt = ``LATENT_LT``: fc1_latent_proj [Lt, H],
    the experts at width Lt ([E, 2I, Lt], [E, Lt, I], random BF16), fc2_latent_proj [H, Lt] with
    the latent norm fused. (op, context, bytes, thunk)."""
    import cupy as cp

    H, Lt = cfg.hidden_size, LATENT_LT
    E, K, I, Is = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    f4, b2 = 4, 2
    situ = {"activation": "situ", "situ_beta": 2.0, "situ_linear_beta": 4.0}
    act_e, partial, act_s = (cp.empty(s, cp.float32) for s in ((n * K, I), (n * K, H), (n, Is)))
    fc1, fc2 = bf16_uniform((Lt, H), H, 301), bf16_uniform((H, Lt), Lt, 302)
    l13, l2 = bf16_uniform((E, 2 * I, Lt), Lt, 303), bf16_uniform((E, Lt, I), I, 304)
    g_lat = cp.ones(Lt, cp.float32)
    lat, lat_y, part_l = (cp.empty(s, cp.float32) for s in ((n, Lt), (n, Lt), (n * K, Lt)))
    eps = np.float32(cfg.rms_norm_eps)
    return [
        (f"moe_experts situ ({distinct} experts)", 0,
         distinct * 3 * I * H * b2 + n * H * f4 + 2 * n * K * I * f4 + 2 * n * K * H * f4 + 2 * n * H * f4,
         lambda: be.moe_experts(x, ids, wts, w.experts_w13, w.experts_w2, r, out=y, act=act_e, partial=partial,
                                **situ)),
        ("swiglu_shared situ", 0, 3 * Is * H * b2 + n * H * f4 + 2 * n * Is * f4 + 2 * n * H * f4,
         lambda: be.swiglu_mlp(x, w.shared_w13, w.shared_w2, r, out=y, act=act_s, **situ)),
        (f"linear fc1_latent (Lt {Lt})", 0, Lt * H * b2 + n * H * f4 + n * Lt * f4,
         lambda: be.linear(x, fc1, out=lat)),
        (f"moe_experts latent ({distinct} experts)", 0,
         distinct * 3 * I * Lt * b2 + n * Lt * f4 + 2 * n * K * I * f4 + 2 * n * K * Lt * f4 + n * Lt * f4,
         lambda: be.moe_experts(lat, ids, wts, l13, l2, out=lat_y, act=act_e, partial=part_l, **situ)),
        ("linear fc2_latent norm", 0, H * Lt * b2 + n * Lt * f4 + Lt * f4 + 2 * n * H * f4,
         lambda: be.linear(lat_y, fc2, None, r, out=y, norm=(g_lat, eps))),
    ]


def deepseek_v4_rope_cases(be, n: int) -> list[tuple[str, int, int, Callable]]:
    """DeepSeek-V4's attention ops at ``n`` rows: its output's rotary dims turned back
    (``rope_heads``, inverse, 64 heads x 512, R = 64) and its shared-KV write (64 query heads and
    one K = V head of 512 into a BF16 cache); every output preallocated. (op, context, bytes, thunk)."""
    import cupy as cp

    from mtpkern.ops.rope_kv import inv_freq

    Hq, D, R = 64, 512, 64
    f4, b2 = 4, 2
    rs = cp.random.RandomState(n)
    o, qk = rs.standard_normal((n, Hq, D), dtype=cp.float32), rs.standard_normal((n, (Hq + 1) * D), dtype=cp.float32)
    out, q = cp.empty((n, Hq, D), cp.float32), cp.empty((n, Hq, D), cp.float32)
    kc, vc = cp.zeros((n, 1, 1, D), cp.uint16), cp.zeros((n, 1, 1, D), cp.uint16)      # a block of one row each
    invf, ones = cp.asarray(inv_freq(R, 10000.0)), cp.ones(D, cp.float32)
    pos, slots = cp.arange(4096, 4096 + n, dtype=cp.int32), cp.arange(n, dtype=cp.int32)
    return [
        ("dsv4 rope_heads inverse", 0, 2 * n * Hq * D * f4 + R // 2 * f4 + n * 4,
         lambda: be.rope_heads(o, pos, invf, interleave=True, inverse=True, out=out)),
        ("dsv4 qk_norm_rope_kv_write v_is_k", 0, n * (2 * Hq + 1) * D * f4 + 2 * D * f4 + 2 * n * D * b2,
         lambda: be.qk_norm_rope_kv_write(qk, Hq, 1, ones, ones, 1e-6, invf, pos, kc, vc, slots, interleave=True,
                                          v_is_k=True, out=q)),
    ]


#: (name, temperature, top_k, top_p) of the sampled-draft rows
SAMPLE_CASES = (("T", 0.8, 0, 1.0), ("top_k 50", 0.8, 50, 1.0), ("top_p 0.95", 0.8, 0, 0.95))


def sample_cases(n: int, vocabs=(32768, 151936), xp: Any = None) -> list[tuple[str, int, int, Callable]]:
    """``sample_kernel`` over ``n`` rows of given logits (3 * N(0, 1), FP32) at each vocabulary,
    its per-row keys and parameters already on the device, every output preallocated: the
    launch alone, as the launcher ``masked_sample`` makes it (without its host read of the ids).
    (op, context, bytes, thunk); bytes = the logits read once. ``xp``: CuPy by default (NumPy
    under the emulator, tests/test_gpu_bench_cpu.py)."""
    if xp is None:
        import cupy as xp

    from mtpkern.backends.cuda_launch import lm_head as lm_launch
    from mtpkern.backends.cuda_launch._util import NULL, i32
    from mtpkern.ops.sampling import SamplingParams, row_keys

    kernel = lm_launch.get_kernel("sampling", "sample_kernel")
    out = []
    for V in vocabs:
        logits = xp.random.RandomState(V + n).standard_normal((n, V)).astype(xp.float32) * xp.float32(3)
        ids, probs = xp.empty(n, xp.int32), xp.empty(n, xp.float32)
        for name, T, k, p in SAMPLE_CASES:
            ps = [SamplingParams(T, k, p, seed=i) for i in range(n)]
            keys = xp.asarray(row_keys(ps, list(range(n)), 0))
            Ts, Ks, Ps = xp.full(n, T, xp.float64), xp.full(n, k, xp.int32), xp.full(n, p, xp.float64)
            args = (logits, NULL, i32(V), keys, Ts, Ks, Ps, NULL, ids, probs, NULL)
            out.append((f"sample {name} V={V}", 0, n * V * 4,
                        lambda args=args: kernel((n,), (lm_launch.SAMPLE_THREADS,), args)))
    return out


def fused_sample_cases(n: int, H: int = 4096, vocabs=(32768, 151936), xp: Any = None, head: Callable | None = None
                       ) -> list[tuple[str, int, int, Callable]]:
    """The temperature-only sampled draw fused into the LM head (``lm_head_sample_fused``: the
    logits never written) beside the greedy ``lm_head_argmax`` on the same BF16 head [V, H] and
    ``n`` rows, both through their launchers without the host read of the ids (``check=False``).
    (op, context, bytes, thunk); bytes = the head's weights, x and the outputs (the partials,
    36 n bytes a block, L2-resident, not counted). ``xp`` / ``head(V, H)`` (a BF16 device
    weight): CuPy and ``bf16_uniform`` by default (NumPy and a host BF16 array under the
    emulator, tests/test_gpu_bench_cpu.py)."""
    if xp is None:
        import cupy as xp
    if head is None:
        def head(V, H):
            return bf16_uniform((V, H), H, V)

    from mtpkern.backends.cuda_launch import lm_head as lm_launch
    from mtpkern.ops.sampling import SamplingParams, row_keys

    out = []
    for V in vocabs:
        w = head(V, H)
        x = xp.asarray(np.random.RandomState(V + n).standard_normal((n, H)).astype(np.float32))
        ps = [SamplingParams(0.8, 0, 1.0, seed=i) for i in range(n)]
        keys, T = xp.asarray(row_keys(ps, list(range(n)), 0)), xp.full(n, 0.8, xp.float64)
        nbytes = V * H * 2 + n * H * 4
        out.append((f"lm_head fused sample T V={V}", 0, nbytes + n * 8,
                    lambda x=x, w=w, keys=keys, T=T: lm_launch.lm_head_sample_fused(x, w, keys=keys, temperature=T,
                                                                                    check=False)))
        out.append((f"lm_head argmax V={V}", 0, nbytes + n * 4,
                    lambda x=x, w=w: lm_launch.lm_head_argmax(x, w, check=False)))
        ks, ps_ = np.full(n, 50, np.int32), np.full(n, 0.95)
        out.append((f"lm_head fused sample top_k 50 top_p 0.95 V={V}", 0, nbytes + n * 8,
                    lambda x=x, w=w, keys=keys, ks=ks, ps_=ps_: lm_launch.lm_head_sample(
                        x, w, keys=keys, temperature=np.full(n, 0.8), top_k=ks, top_p=ps_)))
    return out


def hc_cases(be, n: int) -> list[tuple[str, int, int, Callable]]:
    """DeepSeek-V4-Flash's hyper-connections at ``n`` rows: m 4 streams of H 4096, 20 Sinkhorn
    iterations, FP32 streams; every output preallocated. (op, context, bytes, thunk)."""
    import cupy as cp

    m, H, f4 = 4, 4096, 4
    w = (2 + m) * m
    rs = cp.random.RandomState(n)
    X, f = rs.standard_normal((n, m * H), dtype=cp.float32), rs.standard_normal((n, H), dtype=cp.float32)
    mix, mh = rs.standard_normal((n, w), dtype=cp.float32), rs.standard_normal((n, m), dtype=cp.float32)
    base, scale = cp.zeros(w, cp.float32), cp.ones(3, cp.float32)
    u, post, comb = cp.empty((n, H), cp.float32), cp.empty((n, m), cp.float32), cp.empty((n, m, m), cp.float32)
    y, h = cp.empty((n, m * H), cp.float32), cp.empty((n, H), cp.float32)
    be.hc_pre(X, mix, base, scale, 1e-6, 20, u=u, post=post, comb=comb)     # a doubly stochastic comb for hc_post
    return [
        ("dsv4 hc_pre", 0, n * (m * H + w + H + m + m * m) * f4 + (w + 3) * f4,
         lambda: be.hc_pre(X, mix, base, scale, 1e-6, 20, u=u, post=post, comb=comb)),
        ("dsv4 hc_post", 0, n * (H + 2 * m * H + m + m * m) * f4, lambda: be.hc_post(f, X, post, comb, out=y)),
        ("dsv4 hc_head", 0, n * (m * H + m + H) * f4 + (m + 1) * f4,
         lambda: be.hc_head(X, mh, base[:m], scale[:1], 1e-6, out=h)),
    ]


def quant_weight(kind: str, shape: tuple[int, ...], seed: int, xp: Any = None):
    """A random device weight of ``shape`` [.., N, K] stored as ``kind``: ``fp8`` (E4M3 codes,
    FP32 scales per 128 x 128 block, as the DeepSeek / GLM FP8 releases), ``fp4`` (E2M1 codes
    two a byte, an E8M0 scale code per 32, as DeepSeek-V4's experts) or ``nvfp4`` (the same
    codes, an E4M3 scale code per 16 and an FP32 row scale, in ``CudaNvFp4``'s row records) or
    ``mxfp8`` (FP8's codes with a scale per 32 along K, held FP32 as the loader holds MXFP8's
    E8M0 scales); codes drawn on the device (no NaN code: FP8's bit 3 cleared), scales near
    1 / 448, 2^-7 and (NVFP4) 2^-4 times a row scale of 0.01, MXFP8's 2^-8. The values only have to be
    finite: the kernels read the same bytes whatever they hold. ``xp``: CuPy (None) or NumPy
    (the emulated kernels' arrays, tests/test_gpu_bench_cpu.py)."""
    from mtpkern.backends.cuda_launch._util import CudaFp4, CudaFp8, CudaNvFp4, nvfp4_record_bytes

    if xp is None:
        import cupy as xp

    *lead, N, K = shape
    rs = xp.random.RandomState(seed)
    if kind == "fp8":
        data = (rs.randint(0, 256, size=shape, dtype=np.int32).astype(np.uint8) & np.uint8(0xF7))
        scale = xp.full((*lead, -(-N // 128), -(-K // 128)), 1.0 / 448, np.float32)
        return CudaFp8(data, scale, 128, 128)
    if kind == "mxfp8":
        data = (rs.randint(0, 256, size=shape, dtype=np.int32).astype(np.uint8) & np.uint8(0xF7))
        return CudaFp8(data, xp.full((*lead, N, -(-K // 32)), 2.0 ** -8, np.float32), 1, 32)
    if kind == "fp4":
        data = rs.randint(0, 256, size=(*lead, N, K // 2), dtype=np.int32).astype(np.uint8)
        return CudaFp4(data, xp.full((*lead, N, -(-K // 32)), 120, np.uint8), 1, 32)
    if kind == "nvfp4":
        data = rs.randint(0, 256, size=(*lead, N, K // 2), dtype=np.int32).astype(np.uint8)
        rec = np.zeros(nvfp4_record_bytes(K), np.uint8)          # one row's record, every row the same
        rec[:4] = np.array([0.01], "<f4").view(np.uint8)
        rec[4:4 + -(-K // 16)] = 0x18                             # E4M3 2^-4
        return CudaNvFp4(data, xp.asarray(np.broadcast_to(rec, (*lead, N, rec.size)).copy()), 1, 16)
    raise ValueError(f"kind: expected 'fp8', 'mxfp8', 'fp4' or 'nvfp4', got {kind!r}")


def quant_bytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes a ``quant_weight`` of ``shape`` holds (codes and scales): what its GEMV reads."""
    *lead, N, K = shape
    m = int(np.prod(lead)) if lead else 1
    if kind == "fp8":
        return m * (N * K + 4 * -(-N // 128) * -(-K // 128))
    if kind == "mxfp8":
        return m * (N * K + 4 * N * -(-K // 32))
    if kind == "fp4":
        return m * (N * K // 2 + N * -(-K // 32))
    if kind == "nvfp4":
        from mtpkern.backends.cuda_launch._util import nvfp4_record_bytes

        return m * (N * K // 2 + N * nvfp4_record_bytes(K))
    raise ValueError(f"kind: expected 'fp8', 'mxfp8', 'fp4' or 'nvfp4', got {kind!r}")


def quant_cases(cfg: MtpConfig, be, w, n: int) -> list[tuple[str, int, int, Callable]]:
    """The weight-bound ops of ``kernel_cases`` (o_proj, the routed experts, the LM head) with
    their weights stored FP8, MXFP8, FP4 (MXFP4) and NVFP4 instead of BF16, at the same shapes and rows,
    beside the BF16 rows: what half and a quarter of the bytes buy (NVFP4: a scale per 16 and a
    row scale, against MXFP4's per 32). The experts' ids are the BF16 rows'
    router's, so each row reads the same experts. (op, context, bytes, thunk)."""
    import cupy as cp

    from mtpkern.backends.cuda_launch import lm_head as lm_launch
    from mtpkern.backends.cuda_launch._util import sm_count
    from mtpkern.ops.moe import RouterSpec

    H, D, Hq, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.vocab_size
    E, K, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    f4 = 4
    rs = cp.random.RandomState(1000 + n)
    x, r, o = (rs.standard_normal(s, dtype=cp.float32) for s in ((n, H), (n, H), (n, Hq * D)))
    y, out_h = cp.empty((n, H), cp.float32), cp.empty((n, H), cp.float32)
    ids, wts = cp.empty((n, K), cp.int32), cp.empty((n, K), cp.float32)
    be.moe_router(x, w.gate_w, w.gate_bias, RouterSpec.from_config(cfg), ids=ids, weights=wts,
                  logits=cp.empty((n, E), cp.float32))
    distinct = int(np.unique(ids.get()).size)
    act_e, partial = cp.empty((n * K, I), cp.float32), cp.empty((n * K, H), cp.float32)
    P = lm_launch.num_partials(V, sm_count())
    part_v, part_i, lm_ids = (cp.empty((n, P), cp.float32), cp.empty((n, P), cp.int32),
                              cp.empty(n, cp.int32))
    cases = []
    for i, kind in enumerate(("fp8", "fp4", "nvfp4", "mxfp8")):
        wo = quant_weight(kind, (H, Hq * D), 10 * i + 1)
        w13, w2 = quant_weight(kind, (E, 2 * I, H), 10 * i + 2), quant_weight(kind, (E, H, I), 10 * i + 3)
        head = quant_weight(kind, (V, H), 10 * i + 4)
        per_expert = (quant_bytes(kind, (2 * I, H)) + quant_bytes(kind, (H, I)))
        cases += [
            (f"linear_o {kind}", 0, quant_bytes(kind, (H, Hq * D)) + n * Hq * D * f4 + 2 * n * H * f4,
             lambda wo=wo: be.linear(o, wo, None, x, out=out_h)),
            (f"moe_experts {kind} ({distinct} experts)", 0,
             distinct * per_expert + n * H * f4 + 2 * n * K * I * f4 + 2 * n * K * H * f4 + 2 * n * H * f4,
             lambda w13=w13, w2=w2: be.moe_experts(x, ids, wts, w13, w2, r, out=y, act=act_e, partial=partial)),
            (f"lm_head_argmax {kind}", 0, quant_bytes(kind, (V, H)) + n * H * f4 + 2 * n * P * 8 + n * 4,
             lambda head=head: be.lm_head_argmax(x, head, None, out=lm_ids, part_v=part_v, part_i=part_i,
                                                 check=False)),
        ]
    return cases


def torch_kernel_peers(cfg: MtpConfig, w, n: int, contexts: list[int], device: str | None = None
                       ) -> dict[tuple[str, int], Callable]:
    """PyTorch eager counterparts of the kernel rows that have one, keyed (op, context):
    ``nn.functional`` on the same BF16 device weights (shared through DLPack) with BF16
    activations of the same shapes, as a Hugging Face module runs them; attention is SDPA
    over a contiguous [n, Hkv, ctx, D] cache (the same bytes as the paged one). ``device``:
    CuPy's current device when None (the tests pass "cpu")."""
    import torch
    import torch.nn.functional as F

    from mtpkern.bench_torch import as_torch, rms_norm

    dev = torch.device(device or _cupy_device())
    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    Is = cfg.shared_intermediate_size
    bf = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(n)

    def act(*shape):
        return torch.randn(*shape, device=dev, dtype=bf, generator=gen)

    x, r, o = act(n, H), act(n, H), act(n, Hq * D)
    ln = as_torch(w.input_layernorm)
    wqkv, wo, s13, s2, head = (as_torch(a) for a in (w.w_qkv, w.w_o, w.shared_w13, w.shared_w2, w.head))
    bqkv = None if w.b_qkv is None else as_torch(w.b_qkv).to(bf)
    eps = cfg.rms_norm_eps

    def swiglu_shared():
        gu = F.linear(x, s13)                                       # [n, 2 Is]
        return r + F.linear(F.silu(gu[:, :Is]) * gu[:, Is:], s2)

    peers = {("rmsnorm", 0): lambda: rms_norm(x, ln, eps),
             ("linear_qkv", 0): lambda: F.linear(x, wqkv, bqkv),
             ("linear_o", 0): lambda: r + F.linear(o, wo),
             ("swiglu_shared", 0): swiglu_shared,
             ("lm_head_argmax", 0): lambda: F.linear(x, head).argmax(-1)}
    for ctx in contexts:
        q, k, v = act(n, Hq, 1, D), act(n, Hkv, ctx, D), act(n, Hkv, ctx, D)
        peers["paged_attention", ctx] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return peers


def mla_kernel_cases(cfg: MtpConfig, be, n: int, contexts: list[int], seed: int = 7
                     ) -> list[tuple[str, int, int, Callable]]:
    """DeepSeek-V3's MTP module at ``n`` decode rows: its MLA ops (projections, the latent
    write with the query's RoPE, the absorbed attention over ``contexts`` latent rows with
    its workspaces), its router, experts, shared expert and LM head; random BF16 weights
    made on the device (~27 GB), every output preallocated. (op, context, bytes, thunk)."""
    import cupy as cp

    from mtpkern.backends.cuda_launch import lm_head as lm_launch
    from mtpkern.backends.cuda_launch import mla as mla_launch
    from mtpkern.backends.cuda_launch._util import sm_count, smem_optin
    from mtpkern.ops.moe import RouterSpec
    from mtpkern.ops.rope_kv import inv_freq

    b = cfg.block(0)
    H, V, Hq, L, R, P, Dv, Q = (cfg.hidden_size, cfg.vocab_size, b.num_attention_heads, b.kv_lora_rank,
                                b.qk_rope_head_dim, b.qk_nope_head_dim, b.v_dim, b.q_lora_rank)
    E, K, I, Is = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    f4, b2 = 4, 2
    s = iter(range(seed * 1000, seed * 1000 + 100))
    rs = cp.random.RandomState(n)

    def act(*shape):
        return rs.standard_normal(shape, dtype=cp.float32)

    def empty(*shape, dtype=cp.float32):
        return cp.empty(shape, dtype)

    w_kva, w_qa = bf16_uniform((L + R, H), H, next(s)), bf16_uniform((Q, H), H, next(s))
    w_qb, w_o = bf16_uniform((Hq * (P + R), Q), Q, next(s)), bf16_uniform((H, Hq * Dv), Hq * Dv, next(s))
    w_uk, w_uv = bf16_uniform((Hq, P, L), L, next(s)), bf16_uniform((Hq, Dv, L), L, next(s))
    gate_w, gate_bias = bf16_uniform((E, H), H, next(s)), cp.zeros(E, cp.float32)
    w13, w2 = bf16_uniform((E, 2 * I, H), H, next(s)), bf16_uniform((E, H, I), I, next(s))
    s13, s2 = bf16_uniform((2 * Is, H), H, next(s)), bf16_uniform((H, Is), Is, next(s))
    head = bf16_uniform((V, H), H, next(s))
    x, r = act(n, H), act(n, H)
    kv_a, qc, qf, q_rot, o, y = empty(n, L + R), empty(n, Q), empty(n, Hq, P + R), empty(n, Hq, P + R), \
        empty(n, Hq * Dv), empty(n, H)
    ones = cp.ones(max(L, Q), cp.float32)
    invf = cp.asarray(inv_freq(R, 10000.0))
    spec = RouterSpec.from_config(cfg)
    logits, ids, wts = empty(n, E), empty(n, K, dtype=cp.int32), empty(n, K)
    be.moe_router(x, gate_w, gate_bias, spec, ids=ids, weights=wts, logits=logits)
    distinct = int(np.unique(ids.get()).size)
    act_e, partial, act_s = empty(n * K, I), empty(n * K, H), empty(n, Is)
    PB = lm_launch.num_partials(V, sm_count())
    part_v, part_i, lm_ids = empty(n, PB), empty(n, PB, dtype=cp.int32), empty(n, dtype=cp.int32)
    cases = [
        ("dsv3 linear_kv_a", 0, (L + R) * H * b2 + n * (H + L + R) * f4, lambda: be.linear(x, w_kva, out=kv_a)),
        ("dsv3 linear_q_a", 0, Q * H * b2 + n * (H + Q) * f4, lambda: be.linear(x, w_qa, out=qc)),
        ("dsv3 linear_q_b", 0, Hq * (P + R) * Q * b2 + n * (Q + Hq * (P + R)) * f4,
         lambda: be.linear(qc, w_qb, out=qf.reshape(n, -1))),
    ]
    BS = 64
    for ctx in contexts:
        nb, tables, row_seq, row_len = decode_tables(n, ctx, BS)
        cache = bf16_uniform((n * nb, BS, L + R), 3, 300 + ctx)
        pos = cp.full(n, ctx - 1, cp.int32)
        slots = cp.asarray(np.arange(n, dtype=np.int32) * nb * BS + ctx - 1)
        if ctx == contexts[0]:
            cases.append(("dsv3 mla_latent_write", 0, n * ((L + R) + 2 * Hq * (P + R)) * f4 + n * (L + R) * b2,
                          lambda cache=cache, pos=pos, slots=slots: be.mla_latent_write(
                              kv_a, ones[:L], 1e-6, invf, pos, cache, slots, q=qf, interleave=True, out=q_rot)))
        mp = mla_launch.plan(Hq, L, R, nb * BS, n, target_blocks=2 * sm_count(), smem_max=smem_optin())
        ws = {k: empty(*shape) for k, shape in mla_launch.workspace_shapes(n, Hq, L, R, mp.num_parts).items()}
        ws_bytes = 2 * sum(int(a.nbytes) for a in ws.values())            # written, then read back
        cases.append(("dsv3 mla_attention", ctx, Hq * (P + Dv) * L * b2 + n * ctx * (L + R) * b2
                      + n * Hq * (P + R + Dv) * f4 + ws_bytes,
                      lambda cache=cache, tables=tables, row_seq=row_seq, row_len=row_len, ws=ws:
                      be.mla_attention_absorbed(q_rot, w_uk, w_uv, cache, tables, row_seq, row_len,
                                                (P + R) ** -0.5, out=o, **ws)))
    cases += [
        ("dsv3 linear_o", 0, H * Hq * Dv * b2 + n * (Hq * Dv + 2 * H) * f4,
         lambda: be.linear(o, w_o, None, x, out=y)),
        ("dsv3 moe_router", 0, E * H * b2 + n * H * f4 + 2 * n * E * f4 + E * f4 + 2 * n * K * f4,
         lambda: be.moe_router(x, gate_w, gate_bias, spec, ids=ids, weights=wts, logits=logits)),
        (f"dsv3 moe_experts ({distinct} experts)", 0,
         distinct * 3 * I * H * b2 + n * H * f4 + 2 * n * K * I * f4 + 2 * n * K * H * f4 + 2 * n * H * f4,
         lambda: be.moe_experts(x, ids, wts, w13, w2, r, out=y, act=act_e, partial=partial)),
        ("dsv3 swiglu_shared", 0, 3 * Is * H * b2 + n * H * f4 + 2 * n * Is * f4 + 2 * n * H * f4,
         lambda: be.swiglu_mlp(x, s13, s2, r, out=y, act=act_s)),
        ("dsv3 lm_head_argmax", 0, V * H * b2 + n * H * f4 + 2 * n * PB * 8 + n * 4,
         lambda: be.lm_head_argmax(x, head, None, out=lm_ids, part_v=part_v, part_i=part_i, check=False)),
    ]
    return cases


#: contexts of the DSA rows (``dsv32 ...``) and the releases' top-k
DSA_CONTEXTS = (4096, 32768)
DSA_TOPK = 2048


def dsa_kernel_cases(be, n: int, contexts=DSA_CONTEXTS, topk: int = DSA_TOPK, seed: int = 9
                     ) -> list[tuple[str, int, int, Callable]]:
    """DeepSeek-V3.2's sparse attention at ``n`` decode rows, one sequence each: ``dsa_select``
    (Hi 64, Di 128, a BF16 index cache, the releases' scale) over each context, then the MLA
    attention it feeds (Hq 128, P 128, R 64, L 512, Dv 128, BF16) over the selected rows
    (``index=``) and, beside it, dense over the whole context; GLM-5.3's pooled ``dsa_select``
    (Hi 32, Di 128, pools of 16, the tail; a BF16 plane of key and gate scores, 2 Di a row) over
    each context. Random data made on the device, outputs and workspaces preallocated. (op,
    context, bytes, thunk)."""
    import cupy as cp

    from mtpkern.backends.cuda_launch import dsa as dsa_launch
    from mtpkern.backends.cuda_launch import mla as mla_launch
    from mtpkern.backends.cuda_launch._util import sm_count, smem_optin

    Hi, Di, Hq, P, R, L, Dv, BS = 64, 128, 128, 128, 64, 512, 128, 64
    f4, b2 = 4, 2
    rs = cp.random.RandomState(seed + n)
    w_uk, w_uv = bf16_uniform((Hq, P, L), L, seed), bf16_uniform((Hq, Dv, L), L, seed + 1)
    q_rot = rs.standard_normal((n, Hq, P + R), dtype=cp.float32)
    qi, wi = rs.standard_normal((n, Hi, Di), dtype=cp.float32), rs.standard_normal((n, Hi), dtype=cp.float32)
    o = cp.empty((n, Hq * Dv), cp.float32)
    scale = Hi ** -0.5 * Di ** -0.5
    cases = []
    for ctx in contexts:
        nb, tables, row_seq, row_len = decode_tables(n, ctx, BS)
        cap = nb * BS
        icache = bf16_uniform((n * nb, BS, Di), 3, 400 + ctx)
        lcache = bf16_uniform((n * nb, BS, L + R), 3, 500 + ctx)
        sel = cp.empty((n, topk), cp.int32)
        ws = {k: cp.empty(s, cp.float32) for k, s in dsa_launch.workspace_shapes(n, cap, topk).items()}
        be.dsa_select(qi, wi, icache, tables, row_seq, row_len, topk, scale, out=sel, **ws)   # the lists read below
        cases.append(("dsv32 dsa_select", ctx, n * ctx * Di * b2 + n * (Hi * Di + Hi) * f4 + 2 * n * cap * f4
                      + n * topk * 4,
                      lambda icache=icache, tables=tables, row_seq=row_seq, row_len=row_len, sel=sel, ws=ws:
                      be.dsa_select(qi, wi, icache, tables, row_seq, row_len, topk, scale, out=sel, **ws)))
        for name, index, rows in (("dsv32 mla_attention sparse", sel, min(topk, ctx)),
                                  ("dsv32 mla_attention dense", None, ctx)):
            mp = mla_launch.plan(Hq, L, R, mla_launch.max_rows(cap, index), n, target_blocks=2 * sm_count(),
                                 smem_max=smem_optin())
            mws = {k: cp.empty(s, cp.float32) for k, s in mla_launch.workspace_shapes(n, Hq, L, R, mp.num_parts).items()}
            nbytes = (Hq * (P + Dv) * L * b2 + n * rows * (L + R) * b2 + n * Hq * (P + R + Dv) * f4
                      + 2 * sum(int(a.nbytes) for a in mws.values()) + (0 if index is None else n * topk * 4))
            cases.append((name, ctx, nbytes,
                          lambda lcache=lcache, tables=tables, row_seq=row_seq, row_len=row_len, index=index, mws=mws:
                          be.mla_attention_absorbed(q_rot, w_uk, w_uv, lcache, tables, row_seq, row_len,
                                                    (P + R) ** -0.5, index=index, out=o, **mws)))
    Hp, Kp = 32, 16                                  # GLM-5.3: index_n_heads, index_kpool
    qp, wp = rs.standard_normal((n, Hp, Di), dtype=cp.float32), rs.standard_normal((n, Hp), dtype=cp.float32)
    ape = rs.standard_normal((Kp, Di), dtype=cp.float32)
    pscale = Hp ** -0.5 * Di ** -0.5
    for ctx in contexts:
        nb, tables, row_seq, row_len = decode_tables(n, ctx, BS)
        cap = nb * BS
        pcache = bf16_uniform((n * nb, BS, 2 * Di), 3, 600 + ctx)          # [key | gate scores]
        psel = cp.empty((n, topk + Kp - 1), cp.int32)
        pws = {k: cp.empty(s, cp.float32) for k, s in dsa_launch.workspace_shapes(n, cap, topk, Kp).items()}
        cases.append(("glm5.3 dsa_select kpool", ctx, n * ctx * 2 * Di * b2 + n * (Hp * Di + Hp) * f4
                      + Kp * Di * f4 + 2 * n * (cap // Kp) * f4 + n * (topk + Kp - 1) * 4,
                      lambda pcache=pcache, tables=tables, row_seq=row_seq, row_len=row_len, psel=psel, pws=pws:
                      be.dsa_select(qp, wp, pcache, tables, row_seq, row_len, topk, pscale, out=psel, kpool=Kp,
                                    ape=ape, tail=True, **pws)))
    return cases


# -- propose -------------------------------------------------------------------------------------

def fake_context(prop, st, n: int, rng) -> None:
    """Put ``st`` where an exact- or draft-mode prefill of ``n`` tokens leaves it, without the
    compute: rows allocated (the pools hold random BF16), counters, token tail, exact windows."""
    M, H = prop.num_modules, prop.config.hidden_size
    exact = prop.kv_mode == "exact"
    for m, (h, seq) in enumerate(zip(prop.modules, st.kv)):
        rows = max(0, n - 1 - m) if exact else (n - 1 if m == 0 else 0)
        h.pool.append(seq, 0, rows, st)
        if exact and m < M - 1 and rows:
            w = min(rows, prop.window)
            st._win[m] = prop.backend.from_host(rng.standard_normal((w, H)).astype(np.float32))
            st._win_start[m] = rows - w
    st._num_verified, st._num_hiddens, st._next_position = n, n - 1, n
    st._tail, st._tail_start = [], n


def propose_floor_bytes(cfg: MtpConfig, mode: str, k: int, B: int, ctx: int, kv_itemsize: int) -> int:
    """Bytes a propose must read at least (see the module docstring)."""
    from mtpkern.cuda_graph import step_rows

    H, D, Hq, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    E, K, I, Is = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    dense = (2 * H * H + (Hq + 2 * Hkv) * D * H + H * Hq * D + E * H + 3 * Is * H) * 2
    total = 0
    for m, c in enumerate(step_rows(mode, cfg.num_modules, k)):
        if not c:
            continue
        rows = B * c
        experts = E * (1 - (1 - K / E) ** rows)
        total += dense + int(experts * 3 * I * H * 2) + B * ctx * 2 * Hkv * D * kv_itemsize + rows * H * 2
        if m < k:
            total += V * H * 2
    return total


def _cupy_device() -> str:
    import cupy as cp

    return f"cuda:{cp.cuda.Device().id}"


def torch_peer(cfg: MtpConfig, weights, gpu: Gpu, rec: "Recorder", device: str | None = None) -> Callable | None:
    """The PyTorch eager step (``mtpkern/bench_torch.py``) on this run's own device weights,
    shared with the CuPy arrays through DLPack (no copy), as a timing function
    ``(k, B, warmup, runs, context) -> Timing`` with the L2 flushed before each step; None
    (and a note saying why) when torch or its CUDA is not there. ``device``: CuPy's current
    device when None (the tests pass "cpu")."""
    try:
        import torch

        from mtpkern import bench_torch

        device = device or _cupy_device()
        mods = bench_torch.module_weights(weights.modules, torch.bfloat16, device)
        peer = bench_torch.TorchMtp(cfg, mods, torch.bfloat16, device)
    except Exception as e:                  # no torch, a CPU-only torch, no DLPack: the rows go on without it
        rec.note("torch", f"not run ({type(e).__name__}: {e})")
        return None
    rec.note("torch", f"torch {torch.__version__} eager on {device}: BF16 nn.functional ops on the same "
                      f"weights, KV [B, ctx, Hkv, D] per module, routed experts looped, one row per module; "
                      f"wall time between torch.cuda.synchronize() calls, L2 flushed before each step")
    return bench_torch.step_timer([peer], before=gpu.flush)


def bench_propose(gpu: Gpu, cfg, weights, be, rec: "Recorder", args, deadline: float) -> None:
    import cupy as cp

    from mtpkern.proposer import MultiModuleMtpHead

    res = rec.res
    rng = np.random.default_rng(0)
    V, H, M = cfg.vocab_size, cfg.hidden_size, cfg.num_modules
    steps = len(args.batches) * M * 2 * (args.warmup + args.propose_runs) + 8
    max_rows = max(args.batches) * (max(args.contexts) + 4 * steps)
    num_blocks = -(-max_rows // 16) + 64
    kvb = np.dtype(be.kv_dtype).itemsize
    peer = [torch_peer(cfg, weights, gpu, rec) if args.torch else None]
    if not args.torch:
        rec.note("torch", "not run (--no-torch)")
    torch_t: dict[tuple[int, int, int], Any] = {}         # (context, B, k) -> the peer's Timing, shared by the modes

    def peer_time(ctx: int, B: int, k: int):
        if peer[0] is not None and (ctx, B, k) not in torch_t:
            try:
                torch_t[ctx, B, k] = peer[0](k, B, args.warmup, args.propose_runs, ctx)
            except Exception as e:          # out of memory, an op torch lacks: no more peer rows
                rec.error(f"torch peer ctx {ctx} B {B} k {k}: {type(e).__name__}: {e}")
                peer[0] = None
        return torch_t.get((ctx, B, k))

    for mode in args.kv_modes:
        prop = MultiModuleMtpHead(cfg, weights, be, kv_mode=mode, block_size=16, num_blocks=num_blocks,
                                  max_batch=max(args.batches), cuda_graphs=True)
        for h in prop.modules:                     # random BF16 KV content (exact values do not matter)
            h.pool.k[...] = bf16_uniform(h.pool.k.shape, 3, 7 + h.index)
            h.pool.v[...] = bf16_uniform(h.pool.v.shape, 3, 17 + h.index)
        runner = prop.step_runner
        for ctx in args.contexts:
            for B in args.batches:
                if time.perf_counter() > deadline:
                    rec.note("propose_skipped", f"time budget: from {mode} context {ctx} batch {B} on")
                    return
                sts = [prop.alloc_state() for _ in range(B)]
                for st in sts:
                    fake_context(prop, st, ctx, rng)
                pos = [ctx] * B
                for k in range(1, M + 1):
                    floor_b = propose_floor_bytes(cfg, mode, k, B, ctx, kvb)
                    row = {"kv_mode": mode, "context": ctx, "batch": B, "k": k, "floor_bytes": floor_b,
                           "floor_us": floor_b / (res["copy_GB/s"] * 1e9) * 1e6}
                    for path in ("eager", "graph"):
                        prop.step_runner = runner if path == "graph" else None
                        ts = []
                        for it in range(args.warmup + args.propose_runs):
                            toks = rng.integers(0, V, B).tolist()
                            hid = cp.asarray(rng.standard_normal((B, H)).astype(np.float32))
                            gpu.flush()
                            cp.cuda.get_current_stream().synchronize()
                            t0 = time.perf_counter()
                            prop.propose_batch(toks, hid, pos, k, sts)
                            be.synchronize()
                            t = (time.perf_counter() - t0) * 1e6
                            if it >= args.warmup:
                                ts.append(t)
                            for st in sts:
                                prop.after_verify(0, st)
                            pos = [p + 1 for p in pos]
                        s = stats(ts)
                        row[f"{path}_median_us"] = s["median_us"]
                        row[f"{path}_p20_us"], row[f"{path}_p80_us"] = s["p20_us"], s["p80_us"]
                        row[f"{path}_x_floor"] = s["median_us"] / row["floor_us"]
                    row["graph_speedup"] = row["eager_median_us"] / row["graph_median_us"]
                    row["sm_MHz"] = gpu.sm_clock()                  # right after the graph runs
                    prop.step_runner = runner
                    tt = peer_time(ctx, B, k)
                    if tt is not None:
                        row.update(torch_median_us=tt.median_us, torch_p20_us=tt.p20_us, torch_p80_us=tt.p80_us,
                                   speedup_vs_torch=tt.median_us / row["graph_median_us"])
                    rec.row("propose", row)
                    say(f"propose {mode} ctx {ctx} B {B} k {k}: eager {row['eager_median_us']:.0f} us, "
                        f"graph {row['graph_median_us']:.0f} us, floor {row['floor_us']:.0f} us"
                        + (f", torch {tt.median_us:.0f} us ({row['speedup_vs_torch']:.2f}x)" if tt else ""))
                for st in sts:
                    prop.free_state(st)
        prop.step_runner = runner
        rec.note("graph_counts_" + mode, dict(runner.counts))
        del prop


# -- report ----------------------------------------------------------------------------------------

#: the two files of a run, in ``--out``
JSONL, MD = "gpu_bench.jsonl", "gpu_bench.md"

_KERNEL_HEAD = ("| op | rows | context | MB moved | median us | p20 | p80 | GB/s | of copy | timed | torch us "
                "| torch / ours | SM MHz |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|\n")
_PROPOSE_HEAD = ("| kv_mode | context | B | k | eager us | graph us | graph speedup | floor us | graph / floor "
                 "| torch us | torch / graph |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
#: table -> (its title, its header)
TABLES = {"kernels": ("GLM-4.5-Air-sized kernels", _KERNEL_HEAD),
          "dsv3": ("DeepSeek-V3's MTP module, kernels (`dsv3 ...`)", _KERNEL_HEAD),
          "propose": ("propose_batch (host included)", _PROPOSE_HEAD)}
#: notes shown under the tables, in this order
NOTES = ("torch", "torch_kernels", "errors", "kernels_skipped", "mla_skipped", "dsa_skipped", "propose_skipped")


def table_of(kind: str, row: dict) -> str:
    if kind == "propose":
        return "propose"
    return "dsv3" if row["op"].startswith("dsv3 ") else "kernels"


def row_md(table: str, r: dict) -> str:
    if table == "propose":
        torch_cols = (f"{r['torch_median_us']:.0f} | {r['speedup_vs_torch']:.2f}x" if "torch_median_us" in r
                      else " | ")
        return (f"| {r['kv_mode']} | {r['context']} | {r['batch']} | {r['k']} | "
                f"{r['eager_median_us']:.0f} | {r['graph_median_us']:.0f} | {r['graph_speedup']:.2f}x | "
                f"{r['floor_us']:.0f} | {r['graph_x_floor']:.2f} | {torch_cols} |\n")
    torch_cols = (f"{r['torch_median_us']:.1f} | {r['speedup_vs_torch']:.2f}x" if "torch_median_us" in r
                  else " | ")
    return (f"| {r['op']} | {r['rows']} | {r['context'] or ''} | {r['bytes'] / 1e6:.1f} | "
            f"{r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} | {r['GB/s']:.0f} | "
            f"{r['of_copy']:.0%} | {r['timed']} | {torch_cols} | {r.get('sm_MHz') or ''} |\n")


def header_md(res: dict) -> str:
    return (f"# mtpkern GPU benchmark: {res.get('device', '?')}\n\n"
            f"config: {res.get('config', '?')}; copy bandwidth (the ceiling) {res.get('copy_GB/s', float('nan')):.0f} "
            f"GB/s: the faster of a device-to-device memcpy, read + write "
            f"({res.get('memcpy_GB/s', float('nan')):.0f}), and a streaming read "
            f"({res.get('read_GB/s', float('nan')):.0f}); L2 flushed before every run\n")


def table_md(table: str) -> str:
    title, head = TABLES[table]
    return f"\n## {title}\n\n{head}"


def footer_md(res: dict) -> str:
    lines = [""]
    if res.get("mla_config"):
        lines.append(f"DeepSeek-V3 rows (`dsv3 ...`): {res['mla_config']}")
    for key in NOTES:
        if res.get(key):
            lines += [f"error: {m}" for m in res[key]] if key == "errors" else [f"{key}: {res[key]}"]
    lines.append(f"elapsed: {res.get('elapsed_s', 0):.0f} s" + (f", stopped by {res['stopped']}"
                                                                if res.get("stopped") else ""))
    return "\n".join(lines) + "\n"


def summary(res: dict) -> str:
    """The whole markdown of ``res``: what ``gpu_bench.md`` holds once a run has ended."""
    text = header_md(res)
    rows = [("kernel", r) for r in res.get("kernels", [])] + [("propose", r) for r in res.get("propose", [])]
    table = None
    for kind, r in rows:
        if table_of(kind, r) != table:
            table = table_of(kind, r)
            text += table_md(table)
        text += row_md(table, r)
    return text + footer_md(res)


def _plain(v: Any) -> Any:
    """A value ``json`` does not know (a NumPy scalar or array, anything else) as one it does."""
    return v.tolist() if isinstance(v, (np.generic, np.ndarray)) else str(v)


class Recorder:
    """Every result as it is measured. ``gpu_bench.jsonl`` gets one JSON line per record
    (``{"kind": "meta" | "kernel" | "propose" | "note" | "error" | "end", ...}``) and
    ``gpu_bench.md`` its markdown (the header, a table's title and header before its first
    row, one row per measurement, the notes at the end); both files are flushed after every
    record, so a run cut short (a time limit, a crash, SIGKILL) leaves every row measured
    before it. ``res`` holds the same records, for :func:`summary`; a run that ends leaves
    ``gpu_bench.md`` equal to ``summary(res)``."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.res: dict[str, Any] = {"kernels": [], "propose": [], "errors": []}
        self._jsonl = open(out / JSONL, "w", encoding="utf-8")
        self._md = open(out / MD, "w", encoding="utf-8")
        self._header = False
        self._table: str | None = None

    def _write(self, record: dict, md: str = "") -> None:
        self._jsonl.write(json.dumps({**record, "t_s": round(time.perf_counter() - T0, 3)}, default=_plain) + "\n")
        self._jsonl.flush()
        if md:
            self._md.write(md)
            self._md.flush()

    def meta(self, **kw: Any) -> None:
        """Facts of the run (device, config, copy bandwidth); the markdown header is written
        with the first row (or at the end), when they are all known."""
        self.res.update(kw)
        self._write({"kind": "meta", **kw})

    def row(self, kind: str, row: dict) -> None:
        if kind not in ("kernel", "propose"):
            raise ValueError(f"kind: expected 'kernel' or 'propose', got {kind!r}")
        self.res["kernels" if kind == "kernel" else "propose"].append(row)
        md = ""
        if not self._header:
            md, self._header = header_md(self.res), True
        table = table_of(kind, row)
        if table != self._table:
            md += table_md(table)
            self._table = table
        self._write({"kind": kind, **row}, md + row_md(table, row))

    def note(self, key: str, value: Any) -> None:
        self.res[key] = value
        self._write({"kind": "note", "key": key, "value": value})

    def error(self, message: str) -> None:
        self.res["errors"].append(message)
        self._write({"kind": "error", "message": message})
        say(message)

    def close(self, rc: int, stopped: str | None = None) -> None:
        """The end record and the markdown's notes; the files are closed."""
        self.res["elapsed_s"] = time.perf_counter() - T0
        if stopped:
            self.res["stopped"] = stopped
        md = "" if self._header else header_md(self.res)
        self._header = True
        self._write({"kind": "end", "rc": rc, "elapsed_s": self.res["elapsed_s"], "stopped": stopped},
                    md + footer_md(self.res))
        self._jsonl.close()
        self._md.close()


def attention_sweep_cases(cfg: MtpConfig, n: int, ctx: int, rec: "Recorder") -> list[tuple[str, int, int, Callable]]:
    """Paged attention at ``n`` sequences of ``ctx`` rows under other launch plans than the
    launcher's: part sizes from 64 to the whole context (one partition: no merge), 2 and 3
    stages, the FP32-FMA kernel where the launcher takes the tensor-core one (the two side by
    side), and one query head per KV head (group 1: a twelfth of the FMAs on the same bytes).
    The first H200 run put this op at 3-19 % of the read rate with a ~30 us fixed cost; these
    rows say whether the time follows the blocks, the partitions, the ring or the arithmetic.
    Each variant's output is checked against the default plan's (a note when it differs)."""
    import dataclasses

    import cupy as cp

    from mtpkern.backends.cuda_launch import attention as attn_launch
    from mtpkern.backends.cuda_launch._util import cdiv, sm_count, smem_optin

    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    BS, b2, f4 = 16, 2, 4
    nb, tables, row_seq, row_len = decode_tables(n, ctx, BS)
    kc = bf16_uniform((n * nb, BS, Hkv, D), 3, 300 + ctx)
    vc = bf16_uniform((n * nb, BS, Hkv, D), 3, 400 + ctx)
    rs = cp.random.RandomState(7)
    cases, ref = [], {}
    for hq in (Hq, Hkv):                                    # the model's group, then group 1
        qa = rs.standard_normal((n, hq, D), dtype=cp.float32)
        base = attn_launch.plan(hq // Hkv, D, nb * BS, work=n * Hkv, target_blocks=2 * sm_count(),
                                smem_max=smem_optin(), kv_itemsize=2, rows=n)
        variants = [("", base)]
        if hq == Hq:
            for ps in (64, 256, 512, 1024, nb * BS):
                if ps != base.part_size:
                    variants.append((f" part {ps}", dataclasses.replace(base, part_size=ps,
                                                                          num_parts=max(1, cdiv(nb * BS, ps)))))
            other = 5 - base.stages                          # 2 <-> 3
            smem = attn_launch.smem_bytes(D, D, base.dc, base.heads, base.rows, other, 2, base.variant)
            if smem <= max(attn_launch.SMEM_LIMIT, smem_optin()):
                variants.append((f" stages {other}", dataclasses.replace(base, stages=other, smem_bytes=smem)))
        if base.variant == "tc":                             # the FP32-FMA kernel on the same plan
            smem = attn_launch.smem_bytes(D, D, base.dc, base.heads, base.rows, base.stages, 2, "scalar")
            variants.append((" scalar", dataclasses.replace(base, variant="scalar", smem_bytes=smem)))
        for label, p in variants:
            o = cp.empty((n, hq * D), cp.float32)
            ws = {} if p.num_parts == 1 else {"part_o": cp.empty((n, hq, p.num_parts, D), cp.float32),
                                              "part_ml": cp.empty((n, hq, p.num_parts, 2), cp.float32)}
            part_bytes = 0 if p.num_parts == 1 else 2 * n * hq * p.num_parts * (D + 2) * f4
            name = (f"attn sweep g{hq // Hkv} {p.variant} part {p.part_size} x{p.num_parts} st {p.stages}"
                    + (" (default)" if not label else ""))

            def fn(qa=qa, p=p, o=o, ws=ws):
                return attn_launch.paged_attention(qa, kc, vc, tables, row_seq, row_len, D ** -0.5, out=o,
                                                   attention_plan=p, **ws)
            try:
                fn()
                got = o.get()
                if hq not in ref:
                    ref[hq] = got
                elif not np.allclose(got, ref[hq], rtol=1e-3, atol=1e-4):
                    rec.note("attention_sweep", f"{name}: differs from the default plan's output by "
                                                f"{float(np.max(np.abs(got - ref[hq]))):.3g}")
            except Exception as e:
                rec.error(f"{name}: {type(e).__name__}: {e}")
                continue
            cases.append((name, ctx, 2 * n * ctx * Hkv * D * b2 + 2 * n * hq * D * f4 + part_bytes, fn))
    return cases


def tc_sweep_cases(cfg: MtpConfig, w, n: int) -> list[tuple[str, int, int, Callable]]:
    """The tensor-core GEMM at ``n`` rows under each k-warp count (qkv's weights), and the LM
    head's logits on it beside the kernel table's ``lm_head_argmax`` (the GEMV core at NR = 8).
    The first H200 run had 8 rows of qkv on gemm_tc at 1943 GB/s (half its one-row GEMV rate)
    and 8 rows of the head's GEMV at 1814 GB/s; these rows say whether the grid's k-warps
    (224 blocks at qkv's shapes) are the cause, and whether the head would gain from the
    tensor cores (its GEMV reads ~8 bytes of x from L1 per weight byte at NR = 8)."""
    import cupy as cp

    from mtpkern.backends.cuda_launch import gemm_tc as tc_launch

    H, D, Hq, Hkv, V = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    QKV = (Hq + 2 * Hkv) * D
    f4, b2 = 4, 2
    x = cp.random.RandomState(n + 11).standard_normal((n, H), dtype=cp.float32)
    y, logits = cp.empty((n, QKV), cp.float32), cp.empty((n, V), cp.float32)
    cases = []
    for kw in tc_launch.KW:
        cases.append((f"tc sweep qkv kw {kw}", 0, QKV * H * b2 + n * H * f4 + n * QKV * f4,
                      lambda kw=kw: tc_launch.gemm_tc(x, w.w_qkv, out=y, kw=kw)))
    cases.append(("tc sweep lm_head logits", 0, V * H * b2 + n * H * f4 + n * V * f4,
                  lambda: tc_launch.gemm_tc(x, w.head, out=logits)))
    return cases


def run_cases(gpu: Gpu, rec: Recorder, cases, n: int, runs: int,
              peers: dict[tuple[str, int], Callable] | None = None) -> None:
    """Time each (op, context, bytes, thunk) and record its row, beside its PyTorch eager
    peer when ``peers`` has one; an op that fails is recorded as an error and the rest go on."""
    copy = rec.res["copy_GB/s"]
    for name, ctx, nbytes, fn in cases:
        try:
            ts, how = gpu.time_op(fn, runs)
        except Exception as e:          # keep going: one op's failure is a result too
            rec.error(f"kernel {name} rows {n}: {type(e).__name__}: {e}")
            continue
        s = stats(ts)
        gbs = nbytes / (s["median_us"] * 1e-6) / 1e9
        row = {"op": name, "rows": n, "context": ctx, "bytes": nbytes, **s, "GB/s": gbs, "of_copy": gbs / copy,
               "timed": how, "sm_MHz": gpu.last_sm_mhz}
        peer = (peers or {}).get((name, ctx))
        if peer is not None:
            try:
                t = stats(gpu.time_torch(peer, runs))
                row.update(torch_median_us=t["median_us"], torch_p20_us=t["p20_us"], torch_p80_us=t["p80_us"],
                           speedup_vs_torch=t["median_us"] / s["median_us"])
            except Exception as e:
                rec.error(f"torch peer of {name} rows {n}: {type(e).__name__}: {e}")
        rec.row("kernel", row)
        say(f"{name:<28} rows {n} ctx {ctx or '-':>5}: {s['median_us']:8.1f} us  {gbs:7.0f} GB/s "
            f"({gbs / copy:.0%} of copy, {how})"
            + (f"; torch {row['torch_median_us']:.1f} us" if "torch_median_us" in row else ""))


class Stopped(BaseException):
    """SIGTERM (the check script's time limit): ends the run through its ``finally``."""


def _on_sigterm(signum, frame) -> None:
    raise Stopped("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per kernel")
    ap.add_argument("--propose-runs", type=int, default=10, help="timed proposes per (mode, context, B, k, path)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="time budget: kernels start until 35%% of it, DeepSeek-V3's until 50%%, "
                         "proposes until 90%%")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--kv-modes", default="exact,draft")
    ap.add_argument("--modules", type=int, default=3)
    ap.add_argument("--no-mla", dest="mla", action="store_false",
                    help="leave out DeepSeek-V3's module (MLA kernels, its experts and LM head)")
    ap.add_argument("--no-attention-sweep", dest="attention_sweep", action="store_false",
                    help="leave out paged attention under other launch plans (part sizes, stages, group 1)")
    ap.add_argument("--no-tc-sweep", dest="tc_sweep", action="store_false",
                    help="leave out gemm_tc under each k-warp count and the LM head's logits on it")
    ap.add_argument("--no-torch", dest="torch", action="store_false",
                    help="leave out the PyTorch eager peer of the propose rows")
    args = ap.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.kv_modes = args.kv_modes.split(",")
    out = Path(args.out)
    sweep_until = T0 + 0.42 * args.budget_s
    kernels_until, mla_until, propose_until = T0 + 0.35 * args.budget_s, T0 + 0.5 * args.budget_s, \
        T0 + 0.9 * args.budget_s
    rec = Recorder(out)
    rec.meta(argv=sys.argv[1:] if argv is None else list(argv), python=platform.python_version(),
             budget_s=args.budget_s)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    rc, stopped = 0, None
    try:
        import cupy as cp

        from mtpkern.backends.cuda import CudaBackend

        gpu = Gpu()
        be = CudaBackend()
        cfg = glm45_air(args.modules)
        rec.meta(device=f"{gpu.name()} (L2 {gpu.l2 >> 20} MiB)", cupy=cp.__version__, config=cfg.describe(),
                 contexts=args.contexts)
        say(f"device {rec.res['device']}, CuPy {cp.__version__}; {cfg.describe()}")
        memcpy_gbs, memcpy_us = gpu.copy_bandwidth()
        try:
            read_gbs, read_us = gpu.read_bandwidth()
        except Exception as e:                           # the ceiling falls back to the memcpy's
            rec.note("read_bandwidth", f"the streaming-read kernel failed: {type(e).__name__}: {e}")
            read_gbs, read_us = float("nan"), float("nan")
        ceiling = max(memcpy_gbs, read_gbs) if read_gbs == read_gbs else memcpy_gbs
        rec.meta(sm_MHz_after_copy=gpu.sm_clock())
        rec.meta(**{"copy_GB/s": ceiling, "memcpy_GB/s": memcpy_gbs, "memcpy_us": memcpy_us, "read_GB/s": read_gbs,
                    "read_us": read_us})
        say(f"ceiling {ceiling:.0f} GB/s: memcpy {memcpy_gbs:.0f} GB/s (1 GiB device-to-device, read + write), "
            f"streaming read {read_gbs:.0f} GB/s (2 GiB)")

        weights = build_weights(cfg)
        cp.cuda.get_current_stream().synchronize()
        rec.meta(weights_GB=weights.nbytes / 1e9)
        say(f"random BF16 weights on the device: {weights.nbytes / 1e9:.1f} GB")

        for n in args.batches:
            if time.perf_counter() > kernels_until:
                rec.note("kernels_skipped", f"time budget: from {n} rows on")
                break
            peers = {}
            if args.torch:
                try:
                    peers = torch_kernel_peers(cfg, weights.modules[0], n, args.contexts)
                except Exception as e:      # no torch, a CPU-only torch: the rows go on without peers
                    rec.note("torch_kernels", f"no peers at {n} rows ({type(e).__name__}: {e})")
            run_cases(gpu, rec, kernel_cases(cfg, be, weights.modules[0], n, args.contexts), n, args.runs, peers)
            del peers
            cp.get_default_memory_pool().free_all_blocks()
        for n in args.batches:                             # o_proj, experts, LM head stored FP8 / FP4
            if time.perf_counter() > kernels_until:
                rec.note("quant_skipped", f"time budget: from {n} rows on")
                break
            try:
                run_cases(gpu, rec, quant_cases(cfg, be, weights.modules[0], n), n, args.runs)
            except Exception as e:
                rec.error(f"quantized rows {n}: {type(e).__name__}: {e}")
                traceback.print_exc()
            cp.get_default_memory_pool().free_all_blocks()
        for n in (1, 8):                                   # sampled drafts over given logits
            if time.perf_counter() > kernels_until:
                rec.note("sample_skipped", f"time budget: from {n} rows on")
                break
            try:
                run_cases(gpu, rec, sample_cases(n), n, args.runs)
                run_cases(gpu, rec, fused_sample_cases(n), n, args.runs)
            except Exception as e:
                rec.error(f"sample rows {n}: {type(e).__name__}: {e}")
                traceback.print_exc()
        for n in (1, 64):                                  # DeepSeek-V4's attention ops, at its shape
            if time.perf_counter() > kernels_until:
                rec.note("dsv4_skipped", f"time budget: from {n} rows on")
                break
            try:
                run_cases(gpu, rec, deepseek_v4_rope_cases(be, n), n, args.runs)
            except Exception as e:
                rec.error(f"dsv4 rows {n}: {type(e).__name__}: {e}")
                traceback.print_exc()

        for n in (1, 64):                                  # DeepSeek-V4-Flash's hyper-connections
            if time.perf_counter() > kernels_until:
                rec.note("hc_skipped", f"time budget: from {n} rows on")
                break
            try:
                run_cases(gpu, rec, hc_cases(be, n), n, args.runs)
            except Exception as e:
                rec.error(f"hc rows {n}: {type(e).__name__}: {e}")
                traceback.print_exc()

        if args.attention_sweep:                           # where paged attention's time goes
            for n in args.batches:
                if time.perf_counter() > sweep_until:
                    rec.note("attention_sweep_skipped", f"time budget: from {n} rows on")
                    break
                try:
                    run_cases(gpu, rec, attention_sweep_cases(cfg, n, max(args.contexts), rec), n, args.runs)
                except Exception as e:
                    rec.error(f"attention sweep rows {n}: {type(e).__name__}: {e}")
                    traceback.print_exc()
                cp.get_default_memory_pool().free_all_blocks()

        if args.tc_sweep:                                  # where the 8-row GEMMs' time goes
            for n in (b for b in args.batches if b >= 4):
                if time.perf_counter() > sweep_until:
                    rec.note("tc_sweep_skipped", f"time budget: from {n} rows on")
                    break
                try:
                    run_cases(gpu, rec, tc_sweep_cases(cfg, weights.modules[0], n), n, args.runs)
                except Exception as e:
                    rec.error(f"tc sweep rows {n}: {type(e).__name__}: {e}")
                    traceback.print_exc()
                cp.get_default_memory_pool().free_all_blocks()

        if args.mla and time.perf_counter() < mla_until:     # DeepSeek-V3's module (MLA), its own weights
            dsv3 = deepseek_v3()
            rec.note("mla_config", dsv3.describe())
            say(f"DeepSeek-V3 kernels: {dsv3.describe()}")
            try:
                for n in args.batches:
                    if time.perf_counter() > mla_until:
                        rec.note("mla_skipped", f"time budget: from {n} rows on")
                        break
                    run_cases(gpu, rec, mla_kernel_cases(dsv3, be, n, args.contexts), n, args.runs)
            except Exception as e:
                rec.error(f"mla kernels: {type(e).__name__}: {e}")
                traceback.print_exc()
            cp.get_default_memory_pool().free_all_blocks()
        elif args.mla:
            rec.note("mla_skipped", "time budget")

        if args.mla and time.perf_counter() < mla_until:     # DeepSeek-V3.2's indexer and the MLA it saves
            try:
                for n in args.batches:
                    if time.perf_counter() > mla_until:
                        rec.note("dsa_skipped", f"time budget: from {n} rows on")
                        break
                    run_cases(gpu, rec, dsa_kernel_cases(be, n), n, args.runs)
            except Exception as e:
                rec.error(f"dsa kernels: {type(e).__name__}: {e}")
                traceback.print_exc()
            cp.get_default_memory_pool().free_all_blocks()
        elif args.mla:
            rec.note("dsa_skipped", "time budget")

        try:
            bench_propose(gpu, cfg, weights, be, rec, args, propose_until)
        except Exception as e:
            rec.error(f"propose: {type(e).__name__}: {e}")
            traceback.print_exc()
            rc = 1
    except Stopped as e:
        stopped, rc = str(e), 143
        say(f"stopped by {stopped}: the rows measured so far are in {out / JSONL} and {out / MD}")
    except Exception as e:
        rec.error(f"{type(e).__name__}: {e}")
        traceback.print_exc()
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        rec.close(rc, stopped)
        print(summary(rec.res))
        say(f"wrote {out / JSONL} and {out / MD}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
