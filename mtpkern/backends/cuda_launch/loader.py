"""The one memoised loader of the CUDA kernel families.

Every family is one source file ``kernels/<family>.cu`` (plus the shared
``common.cuh``) compiled into one ``cupy.RawModule`` with the template
instantiations listed in :data:`NAME_EXPRESSIONS`. Nothing compiles at import:
a module is built on the first :func:`get_kernel` of its family, then kept
for the life of the process (CuPy also caches the binary on disk).

This module imports without CuPy; ``mtpkern.nvrtc_check`` uses the same table
and options to compile every family with NVRTC where there is no GPU.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path
from typing import Any

#: C++ type of a stored weight / KV element, keyed by the NumPy dtype name of the
#: array holding it (CuPy has no bfloat16: BF16 lives as its uint16 bits; FP8 E4M3
#: weights as their uint8 bytes, beside their scales: ``CudaFp8``).
CTYPE: dict[str, str] = {"float32": "float", "uint16": "__nv_bfloat16", "uint8": "__nv_fp8_e4m3"}
#: element types of the KV cache and of the embedding table (mtp_norms_kernel)
_CTYPES = ("float", "__nv_bfloat16")
#: element types of the GEMV families' weights: those and FP8 E4M3
_WEIGHT_CTYPES = _CTYPES + ("__nv_fp8_e4m3",)

#: Head-dim elements per lane in the PV pass of paged_attention (D <= 32 * DC).
ATTENTION_DC = (2, 4, 8)
#: Latent dims per thread in the PV pass of mla_attention_kernel (L <= 256 * LPT); the same for
#: mla_attention_tc_kernel (a warp's 4 LPT n-tiles of 8 dims: 16 LPT accumulators per thread).
MLA_LPT = (1, 2)

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
                 for nm in ("false", "true")),
    "rope_kv": tuple(f"qk_norm_rope_kv_write_kernel<{t}, {il}>" for t in _CTYPES for il in ("false", "true")),
    "attention": tuple(f"paged_attention_kernel<{t}, {dc}>" for t in _CTYPES for dc in ATTENTION_DC)
    + ("paged_attention_merge_kernel",),
    "mla": tuple(f"mla_latent_write_kernel<{t}, {il}>" for t in _CTYPES for il in ("false", "true"))
    + tuple(f"mla_q_absorb_kernel<{t}>" for t in _CTYPES)
    + tuple(f"mla_attention_kernel<{t}, {lpt}>" for t in _CTYPES for lpt in MLA_LPT)
    + tuple(f"mla_attention_tc_kernel<{lpt}>" for lpt in MLA_LPT)
    + tuple(f"mla_out_kernel<{t}>" for t in _CTYPES),
    "gate": ("sigmoid_gate_kernel<false>", "sigmoid_gate_kernel<true>"),
    "moe": ("moe_router_select_kernel", "moe_combine_kernel")
    + tuple(f"moe_expert_kernel<{t}, {g}, {nr}, false>" for t in _WEIGHT_CTYPES for g in ("true", "false")
            for nr in GEMV_NR)
    + tuple(f"moe_expert_kernel<{t}, true, {nr}, true>" for t in _WEIGHT_CTYPES for nr in GEMV_NR),
    # CONF: the confidence epilogue (lm_head_argmax(..., conf=)); false is the plain argmax
    "lm_head": tuple(f"lm_head_argmax_partial_kernel<{t}, {c}, {nr}>" for t in _WEIGHT_CTYPES
                     for c in ("false", "true") for nr in GEMV_NR)
    + ("argmax_final_kernel<false>", "argmax_final_kernel<true>", "masked_topk_kernel"),
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


def include_dirs() -> tuple[str, ...]:
    """``kernels/`` for ``common.cuh``, and the CUDA runtime headers (``cuda_bf16.h``)
    of the nvidia-cuda-runtime wheel when cuda-pathfinder finds them (else NVRTC's
    and CuPy's defaults must find them)."""
    dirs = [str(kernel_dir())]
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        cudart = find_nvidia_header_directory("cudart")
        if cudart:
            dirs.append(str(cudart))
    except Exception:  # no cuda-pathfinder, or no header wheel: rely on the defaults
        pass
    return tuple(dirs)


def headers_digest() -> str:
    """Hash of the ``.cuh`` files: CuPy's disk cache keys on the ``.cu`` text and
    the options only, so it goes into the options as a define."""
    h = hashlib.sha256()
    for p in sorted(kernel_dir().glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def compile_options() -> tuple[str, ...]:
    """Options shared by the loader and nvrtc_check (which adds the arch and -Xptxas=-v).

    CuPy adds ``-ftz=true`` to every NVRTC compile; nvrtc_check adds it too so
    that the register counts it records are those of the loaded kernels."""
    return ("-std=c++17", f"-DMTPKERN_HEADERS={headers_digest()}") + tuple(
        f"-I{d}" for d in include_dirs()
    )


@functools.cache
def _module(family: str) -> Any:
    import cupy

    return cupy.RawModule(
        code=source(family),
        options=compile_options(),
        name_expressions=NAME_EXPRESSIONS[family],
    )


@functools.cache
def get_kernel(family: str, name: str) -> Any:
    """The ``cupy.RawKernel`` for ``name`` (one of ``NAME_EXPRESSIONS[family]``),
    compiling the family on first use."""
    if name not in NAME_EXPRESSIONS.get(family, ()):
        raise ValueError(f"kernel {name!r} is not an instantiation of family {family!r}")
    return _module(family).get_function(name)
