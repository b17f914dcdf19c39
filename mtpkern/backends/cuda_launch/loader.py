"""The one memoised loader of the CUDA kernel families.

Every family is one source file ``kernels/<family>.cu`` (plus the shared
``common.cuh``) compiled into one ``cupy.RawModule`` with the template
instantiations listed in :data:`NAME_EXPRESSIONS`. Nothing compiles at import:
a module is built on the first :func:`get_kernel` of its family, then kept
for the life of the process. The binary is also kept on disk (``kernel_cache``):
a later process loads it instead of compiling, and :func:`prebuild` builds every
family at once in worker processes (``python -m mtpkern kernels``). Where that path
cannot run (no ``libnvrtc`` of CuPy's major found, the cache turned off) the family
compiles through CuPy's ``RawModule(code=...)`` instead, as it always did.

This module imports without CuPy; ``mtpkern.nvrtc_check`` uses the same table
and options to compile every family with NVRTC where there is no GPU.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

from . import kernel_cache
from .nvrtc import find_nvrtc

#: C++ type of a stored weight / KV element, keyed by the NumPy dtype name of the
#: array holding it (CuPy has no bfloat16: BF16 lives as its uint16 bits; FP8 E4M3
#: weights as their uint8 bytes, beside their scales: ``CudaFp8``).
CTYPE: dict[str, str] = {"float32": "float", "uint16": "__nv_bfloat16", "uint8": "__nv_fp8_e4m3"}
#: C++ type of a packed FP4 weight (two E2M1 codes a byte, common.cuh; ``CudaFp4``)
FP4_CTYPE = "fp4x2_e2m1"
#: C++ type of a packed NVFP4 weight (the same codes; E4M3 scales per 16 behind an FP32 row
#: scale, one record a row: common.cuh ``nvfp4_record``; ``CudaNvFp4``)
NVFP4_CTYPE = "nvfp4x2_e2m1"
#: element types of the KV cache and of the embedding table (mtp_norms_kernel)
_CTYPES = ("float", "__nv_bfloat16")
#: element types of the GEMV families' weights: those, FP8 E4M3 and FP4 E2M1 (MXFP4, NVFP4)
_WEIGHT_CTYPES = _CTYPES + ("__nv_fp8_e4m3", FP4_CTYPE, NVFP4_CTYPE)

#: Head-dim elements per lane in the PV pass of paged_attention (D <= 32 * DC).
ATTENTION_DC = (2, 4, 8)
#: (m-tiles of 16 query vectors, DC) of paged_attention_tc_kernel: 32 query vectors a block as
#: the scalar kernel's for DC <= 4, 16 for DC 8 (attn_mw: 4 warps x MW)
ATTENTION_TC = tuple((mt, dc) for dc in ATTENTION_DC for mt in (1, 2) if 16 * mt <= 4 * (4 if dc == 8 else 8))
#: Latent dims per thread in the PV pass of mla_attention_kernel (L <= 256 * LPT); the same for
#: mla_attention_tc_kernel (a warp's 4 LPT n-tiles of 8 dims: 16 LPT accumulators per thread).
MLA_LPT = (1, 2)

#: Streams hc_post_kernel holds in registers (MR): a launch over m streams takes the smaller that holds m
HC_MR = (4, 16)

#: Keys per thread of dsa_topk_kernel held in registers (512 threads: rows up to 2048, 8192, 32768;
#: a longer row's other keys are read again at each pass)
DSA_KPT = (4, 16, 64)

#: n-tiles of 8 input rows of gemm_tc_kernel (n <= 8 * NT rows per launch)
GEMM_TC_NT = (1, 2, 3, 4)
#: Input rows per pass of the GEMV kernels (their NR template parameter, common.cuh): a launch
#: over n rows takes the smallest >= min(n, 8) (``linear.gemv_rows``).
GEMV_NR = (1, 2, 4, 8)

#: family -> the instantiations to compile (``nvrtcAddNameExpression``); a
#: launcher asks for exactly one of these strings.
NAME_EXPRESSIONS: dict[str, tuple[str, ...]] = {
    "norm": ("rmsnorm_kernel",) + tuple(f"mtp_norms_kernel<{t}>" for t in _CTYPES),
    # NORM (the last parameter): an RMSNorm of x fused into the GEMV (the ops' norm=)
    "linear": tuple(f"linear_kernel<{t}, {nr}, {nm}>" for t in _WEIGHT_CTYPES for nr in GEMV_NR
                    for nm in ("false", "true")),
    "mlp": tuple(f"swiglu_gate_up_kernel<{t}, {nr}, {nm}>" for t in _WEIGHT_CTYPES for nr in GEMV_NR
                 for nm in ("false", "true")) + ("relu2_kernel",)
    # SITU (the last parameter): Kimi K3's gated SiTU in place of SwiGLU
    + tuple(f"swiglu_gate_up_kernel<{t}, {nr}, {nm}, true>" for t in _WEIGHT_CTYPES for nr in GEMV_NR
            for nm in ("false", "true")),
    # NT n-tiles of 8 input rows (linear's and swiglu_mlp's BF16 path for n >= 4), NORM: the
    # RMSNorm prologue
    "gemm_tc": tuple(f"{k}<{nt}, {nm}>" for k in ("gemm_tc_kernel", "swiglu_tc_kernel") for nt in GEMM_TC_NT
                     for nm in ("false", "true"))
    + tuple(f"swiglu_tc_kernel<{nt}, {nm}, true>" for nt in GEMM_TC_NT for nm in ("false", "true")),   # SiTU
    # VIS_K (the last parameter): the value is the key as written (DeepSeek-V4's shared KV)
    "rope_kv": tuple(f"qk_norm_rope_kv_write_kernel<{t}, {il}, {vk}>" for t in _CTYPES for il in ("false", "true")
                     for vk in ("false", "true"))
    # an FP8 KV cache (E4M3 codes and per-row scales; not with VIS_K)
    + tuple(f"qk_norm_rope_kv_write_kernel<__nv_fp8_e4m3, {il}, false>" for il in ("false", "true"))
    + tuple(f"rope_heads_kernel<{il}, {inv}>" for il in ("false", "true") for inv in ("false", "true")),
    "attention": tuple(f"paged_attention_kernel<{t}, {dc}>" for t in _CTYPES + ("__nv_fp8_e4m3",)
                       for dc in ATTENTION_DC)
    + tuple(f"paged_attention_tc_kernel<{mt}, {dc}>" for mt, dc in ATTENTION_TC)
    + ("paged_attention_merge_kernel",),
    "mla": tuple(f"mla_latent_write_kernel<{t}, {il}>" for t in _CTYPES for il in ("false", "true"))
    + tuple(f"mla_q_absorb_kernel<{t}>" for t in _CTYPES)
    + tuple(f"mla_attention_kernel<{t}, {lpt}>" for t in _CTYPES for lpt in MLA_LPT)
    + tuple(f"mla_attention_tc_kernel<{lpt}>" for lpt in MLA_LPT)
    + tuple(f"mla_out_kernel<{t}>" for t in _CTYPES),
    # DSA's indexer: the key write, the scores (of rows; of pools), the top-k selection (KPT keys per thread)
    "dsa": tuple(f"dsa_key_write_kernel<{t}, {il}>" for t in _CTYPES for il in ("false", "true"))
    + tuple(f"dsa_score_kernel<{t}>" for t in _CTYPES)
    + tuple(f"dsa_pool_score_kernel<{t}>" for t in _CTYPES)
    + tuple(f"dsa_topk_kernel<{k}>" for k in DSA_KPT),
    "gate": ("sigmoid_gate_kernel<false>", "sigmoid_gate_kernel<true>"),
    # hyper-connections: the streams' (and hc_post's f's) element type, hc_post's MR
    "hc": tuple(f"{k}<{t}>" for k in ("hc_pre_kernel", "hc_head_kernel") for t in _CTYPES)
    + tuple(f"hc_post_kernel<{tf}, {tx}, {mr}>" for tf in _CTYPES for tx in _CTYPES for mr in HC_MR),
    # one row's down pass is moe_down_combine_kernel (the combine fused in): no <W, false, 1, false>
    "moe": ("moe_router_select_kernel", "moe_combine_kernel")
    + tuple(f"moe_expert_kernel<{t}, true, {nr}, false>" for t in _WEIGHT_CTYPES for nr in GEMV_NR)
    + tuple(f"moe_expert_kernel<{t}, false, {nr}, false>" for t in _WEIGHT_CTYPES for nr in GEMV_NR if nr > 1)
    + tuple(f"moe_expert_kernel<{t}, true, {nr}, true>" for t in _WEIGHT_CTYPES for nr in GEMV_NR)
    # RELU2 (the last parameter): Nemotron-H's non-gated up pass, NORM either way
    + tuple(f"moe_expert_kernel<{t}, false, {nr}, {nm}, true>" for t in _WEIGHT_CTYPES for nr in GEMV_NR
            for nm in ("false", "true"))
    # SITU (the last parameter): Kimi K3's gated SiTU in the gate/up pass, NORM either way
    + tuple(f"moe_expert_kernel<{t}, true, {nr}, {nm}, false, true>" for t in _WEIGHT_CTYPES for nr in GEMV_NR
            for nm in ("false", "true"))
    + tuple(f"moe_down_combine_kernel<{t}>" for t in _WEIGHT_CTYPES)
    # one row's router: the logits' GEMV and the selection in one launch
    + tuple(f"moe_router_kernel<{t}, {nm}>" for t in _WEIGHT_CTYPES for nm in ("false", "true")),
    # CONF: the confidence epilogue (lm_head_argmax(..., conf=)); false is the plain argmax
    "lm_head": tuple(f"lm_head_argmax_partial_kernel<{t}, {c}, {nr}>" for t in _WEIGHT_CTYPES
                     for c in ("false", "true") for nr in GEMV_NR)
    + ("argmax_final_kernel<false>", "argmax_final_kernel<true>", "masked_topk_kernel")
    # the sampled draw fused into the GEMV (temperature-only rows: no [n, V] logits)
    + tuple(f"lm_head_sample_partial_kernel<{t}, {nr}>" for t in _WEIGHT_CTYPES for nr in GEMV_NR)
    + ("sample_final_kernel",)
    # per-block top-k partials (k <= 64) and the draw over a row's top_k (top_p within them)
    + tuple(f"lm_head_topk_partial_kernel<{t}, {nr}>" for t in _WEIGHT_CTYPES for nr in GEMV_NR)
    + ("topk_sample_final_kernel",),
    # sampled drafts over the logits (one block per row)
    "sampling": ("sample_kernel",),
    "step": ("copy_segments_kernel",),
    # a probe of mma.cuh's fragment layout, for the tests only (kernels/mma.cu)
    "mma": ("mma_bf16_probe_kernel",),
}

FAMILIES: tuple[str, ...] = tuple(NAME_EXPRESSIONS)


def kernel_dir() -> Path:
    """Directory holding the ``.cu`` / ``.cuh`` sources: the ``kernels/`` of the source tree
    this package sits in, when there is one, else the installed package ``mtpkern.kernels``
    (shipped in the wheel). The source tree comes first because an editable install maps
    ``mtpkern.kernels`` to the checkout it was installed from: a second worktree run with
    that environment would otherwise compile the other checkout's kernels."""
    src = Path(__file__).resolve().parents[3] / "kernels"
    if (src / "common.cuh").is_file():
        return src
    try:
        d = Path(str(resources.files("mtpkern.kernels")))
        if (d / "common.cuh").is_file():
            return d
    except (ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError(f"mtpkern kernel sources not found (looked in {src} and mtpkern.kernels)")


def source(family: str) -> str:
    if family not in NAME_EXPRESSIONS:
        raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}")
    return (kernel_dir() / f"{family}.cu").read_text()


#: where the CUDA runtime headers (cuda_bf16.h) of each toolkit major sit in a
#: site-packages directory: the nvidia-cuda-runtime-cu12 and nvidia-cuda-runtime (13) wheels
CUDA_INCLUDE_WHEEL_DIRS: dict[int, tuple[str, ...]] = {
    12: ("nvidia/cuda_runtime/include",),
    13: ("nvidia/cu13/include",),
}


def cuda_headers_major(d: str | Path) -> int | None:
    """The toolkit major of the CUDA runtime headers in ``d`` (its ``cuda_runtime_api.h``'s
    ``CUDART_VERSION``), or None when ``d`` holds no readable ``cuda_bf16.h`` and version."""
    d = Path(d)
    try:
        if not (d / "cuda_bf16.h").is_file():
            return None
        m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", (d / "cuda_runtime_api.h").read_text(errors="replace"))
    except OSError:
        return None
    return int(m.group(1)) // 1000 if m else None


def cuda_include_dir(major: int | None = None) -> str | None:
    """The directory holding ``cuda_bf16.h`` and the rest of the CUDA runtime headers.

    ``major`` None: the first that cuda-pathfinder finds (it prefers the CUDA 13 wheel).
    ``major`` 12 or 13: headers of that toolkit only (NVRTC 12 does not compile CUDA 13's
    ``cuda_bf16.h`` faithfully, nor the reverse): the runtime wheel of that major on
    ``sys.path``, else cuda-pathfinder's or ``$CUDA_PATH`` / ``$CUDA_HOME``'s ``include``
    when their ``CUDART_VERSION`` has that major. None when nothing fits."""
    found: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cudart")
        if d:
            found.append(str(d))
    except Exception:  # no cuda-pathfinder, or it finds nothing: the other places
        pass
    if major is None:
        return found[0] if found else None
    wheel = [
        str(Path(p) / sub) for p in sys.path if p for sub in CUDA_INCLUDE_WHEEL_DIRS.get(major, ())
    ]
    env = [str(Path(os.environ[v]) / "include") for v in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(v)]
    for d in wheel + found + env:
        if cuda_headers_major(d) == major:
            return d
    return None


def include_dirs(cuda_major: int | None = None) -> tuple[str, ...]:
    """``kernels/`` for ``common.cuh``, and the CUDA runtime headers (``cuda_bf16.h``)
    of toolkit ``cuda_major`` (:func:`cuda_include_dir`) when they are found (else NVRTC's
    and CuPy's defaults must find them)."""
    dirs = [str(kernel_dir())]
    cudart = cuda_include_dir(cuda_major)
    if cudart:
        dirs.append(cudart)
    return tuple(dirs)


def headers_digest() -> str:
    """Hash of the ``.cuh`` files: CuPy's disk cache keys on the ``.cu`` text and
    the options only, so it goes into the options as a define."""
    h = hashlib.sha256()
    for p in sorted(kernel_dir().glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def compile_options(cuda_major: int | None = None) -> tuple[str, ...]:
    """Options shared by the loader and nvrtc_check (which adds the arch and -Xptxas=-v),
    with the runtime headers of toolkit ``cuda_major`` (that of the NVRTC compiling).

    CuPy adds ``-ftz=true`` to every NVRTC compile; nvrtc_check adds it too so
    that the register counts it records are those of the loaded kernels."""
    return ("-std=c++17", f"-DMTPKERN_HEADERS={headers_digest()}") + tuple(
        f"-I{d}" for d in include_dirs(cuda_major)
    )


#: what the binary path adds to :func:`compile_options`: CuPy adds -ftz=true to every NVRTC
#: compile, so the cached binaries flush denormals as the ones CuPy builds do
BINARY_OPTIONS = ("-ftz=true",)


def _binary_inputs(major: int | None) -> tuple[str, tuple[str, ...]]:
    """(the libnvrtc.so.<major> to build cached binaries with, their options); FileNotFoundError
    when no libnvrtc of that major is found."""
    lib = find_nvrtc(major) if major else None
    if lib is None:
        raise FileNotFoundError(f"no libnvrtc.so.{major} (NVRTC major {major}) was found to build with")
    return lib, compile_options(major) + BINARY_OPTIONS


def _cupy_nvrtc_major(cupy) -> int | None:
    try:  # the headers of the toolkit whose NVRTC CuPy compiles with
        return int(cupy.cuda.nvrtc.getVersion()[0])
    except Exception:
        return None


def device_arch(cupy) -> str:
    """``sm_XY`` of the current CuPy device."""
    return f"sm_{cupy.cuda.Device().compute_capability}"


class _Binary:
    """A family loaded from its cached CUBIN: ``get_function`` by name expression."""

    def __init__(self, module: Any, lowered: dict[str, str]):
        self.module, self.lowered = module, lowered

    def get_function(self, name: str) -> Any:
        return self.module.get_function(self.lowered[name])


_WARNED: set[str] = set()


def _from_cache(cupy, family: str, major: int | None) -> Any:
    """The family from the kernel cache (built into it on a miss), or None (then CuPy compiles):
    the cache turned off, no libnvrtc of CuPy's major, or any failure on the way (warned once)."""
    directory = kernel_cache.cache_dir()
    if directory is None:
        return None
    try:
        lib, options = _binary_inputs(major)
        path, lowered, _ = kernel_cache.build(family, source(family), options, NAME_EXPRESSIONS[family],
                                              device_arch(cupy), lib, directory)
        binary = _Binary(cupy.RawModule(path=str(path)), lowered)
        binary.get_function(NAME_EXPRESSIONS[family][0])    # CuPy loads a file lazily: load it here, in the try
        return binary
    except Exception as e:  # noqa: BLE001: any failure leaves CuPy's own compile, which always worked
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if why not in _WARNED:
            _WARNED.add(why)
            warnings.warn(f"mtpkern: the kernel cache ({directory}) is not used for {family} ({why}); "
                          f"compiling through CuPy instead", RuntimeWarning, stacklevel=3)
        return None


@functools.cache
def _module(family: str) -> Any:
    import cupy

    major = _cupy_nvrtc_major(cupy)
    cached = _from_cache(cupy, family, major)
    if cached is not None:
        return cached
    return cupy.RawModule(
        code=source(family),
        options=compile_options(major),
        name_expressions=NAME_EXPRESSIONS[family],
    )


def prebuild(families=None, *, arch: str | None = None, nvrtc_major: int | None = None, jobs: int | None = None,
             directory: Path | None = None) -> dict[str, float]:
    """Build every family (or ``families``) into the kernel cache, ``jobs`` worker processes
    at once (default: one per CPU), the largest families first; -> {family: seconds of its
    compile, 0.0 when it was cached already}. ``arch`` ("sm_90") and ``nvrtc_major`` (12, 13)
    default to the CuPy device's and CuPy's NVRTC; without CuPy both must be given. Raises
    when the cache is off, no libnvrtc of that major is found, or a family fails to compile."""
    families = tuple(families or FAMILIES)
    for f in families:
        source(f)                                       # an unknown family: ValueError, naming it
    if arch is None or nvrtc_major is None:
        import cupy

        arch = arch or device_arch(cupy)
        nvrtc_major = nvrtc_major or _cupy_nvrtc_major(cupy)
    directory = directory or kernel_cache.cache_dir()
    if directory is None:
        raise ValueError(f"the kernel cache is off ({kernel_cache.ENV}={os.environ.get(kernel_cache.ENV)!r})")
    lib, options = _binary_inputs(nvrtc_major)
    order = sorted(families, key=lambda f: -len(NAME_EXPRESSIONS[f]))
    with ProcessPoolExecutor(max_workers=max(1, min(len(order), jobs or os.cpu_count() or 1)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {f: pool.submit(kernel_cache.build, f, source(f), options, NAME_EXPRESSIONS[f], arch, lib,
                                  directory) for f in order}
        return {f: futures[f].result()[2] for f in families}


@functools.cache
def get_kernel(family: str, name: str) -> Any:
    """The ``cupy.RawKernel`` for ``name`` (one of ``NAME_EXPRESSIONS[family]``),
    compiling the family on first use."""
    if name not in NAME_EXPRESSIONS.get(family, ()):
        raise ValueError(f"kernel {name!r} is not an instantiation of family {family!r}")
    return _module(family).get_function(name)
