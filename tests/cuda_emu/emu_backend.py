"""mtpkern's CUDA kernels on the CPU: build the emulator, and a ``CudaBackend`` on NumPy arrays.

The real ``kernels/*.cu`` are compiled by g++ against ``include/emu_cuda.h`` (the
emulated subset of CUDA; what it cannot check is listed there) and scheduled by
``emu_runtime.cpp``. :class:`Emulator` loads the library; inside
``Emulator.installed()`` the launchers of ``mtpkern.backends.cuda_launch`` see NumPy
arrays as device arrays and launch into the emulator, so the launchers' own shape
rules, launch configurations and argument lists are what runs. :class:`EmuCudaBackend`
is ``CudaBackend`` with NumPy storage. Nothing here imports CuPy.

Checks the emulator adds on top of the kernels' results (each raises
:class:`EmulatorError` naming the kernel, block and thread):

- every launch argument against the kernel's C++ signature (pointer element type
  vs array dtype, ``int`` vs ``np.int32``, ...): CuPy passes arguments by value
  with their own size and checks nothing;
- deadlocks and divergent warp collectives, misaligned vector loads, shared memory
  over 48 KiB, and UBSan's alignment / bounds / integer overflow / shift / null
  checks (ASan too in the ASan build);
- outputs the launcher allocates start as 0xff bytes (NaN / -1), as does shared
  memory in every block, so a value never written shows.

Environment (all optional):

- ``MTPKERN_CUDA_EMU_ASAN=1``: build with ``-fsanitize=address,undefined``; the
  process must preload the ASan runtime (``tests/cuda_emu/run.sh --asan`` does);
- ``MTPKERN_CUDA_EMU_ORDER=forward|reverse|shuffle`` (and ``MTPKERN_CUDA_EMU_SEED``):
  the order of the blocks of a grid and of the threads between synchronisation points;
- ``MTPKERN_CUDA_EMU_CONTRACT=1``: compile the kernels with floating-point contraction on
  (``-ffp-contract=fast -mfma``: ``a * b + c`` may become one fused multiply-add, as NVRTC
  does by default) instead of off; needs a CPU with FMA (else the emulator is unavailable:
  without FMA g++ cannot contract, so NVRTC's rounding cannot be emulated). A separate
  cached build. g++ and NVRTC need not fuse the same pairs: this mode shows which
  results depend on contraction, it does not reproduce NVRTC's bits;
- ``MTPKERN_CUDA_EMU_CACHE``: where builds are kept (default
  ``$XDG_CACHE_HOME/mtpkern/cuda_emu`` or ``~/.cache/mtpkern/cuda_emu``), one
  directory per hash of the sources, flags and compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mtpkern.backends.cuda_launch import loader
from mtpkern.ops._check import expect_dtype, shape_of

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
RUNTIME = HERE / "emu_runtime.cpp"
SELFTEST = HERE / "selftest.cu"
#: bump when the source translation below changes (part of the build key)
TRANSLATION_VERSION = "1"
ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
#: streaming multiprocessors the launchers plan for (H100 SXM / H200)
DEFAULT_SM_COUNT = 132
DEFAULT_SMEM_OPTIN = 227 * 1024
#: builds kept in the cache directory (the most recently used)
KEEP_BUILDS = 6


class EmulatorUnavailable(Exception):
    """The emulator cannot be built here (no g++, not x86-64 Linux, ...): a reason to skip."""


class EmulatorBuildError(RuntimeError):
    """g++ works but the kernels do not compile against the emulator: a failure."""


class EmulatorError(RuntimeError):
    """A kernel failed one of the emulator's checks (the message says where)."""


def asan_requested() -> bool:
    return os.environ.get("MTPKERN_CUDA_EMU_ASAN", "0") not in ("", "0")


def contract_requested() -> bool:
    return os.environ.get("MTPKERN_CUDA_EMU_CONTRACT", "0") not in ("", "0")


def cpu_has_fma(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has FMA3 (a ``fma`` flag in ``/proc/cpuinfo``)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and "fma" in line.split(":", 1)[-1].split()
               for line in cpuinfo.splitlines())


def order_from_env() -> tuple[str, int]:
    order = os.environ.get("MTPKERN_CUDA_EMU_ORDER", "forward")
    if order not in ORDERS:
        raise ValueError(f"MTPKERN_CUDA_EMU_ORDER: expected one of {', '.join(ORDERS)}, got {order!r}")
    return order, int(os.environ.get("MTPKERN_CUDA_EMU_SEED", "1"))


# -- sources ------------------------------------------------------------------------------

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")
_SHARED = re.compile(r"__shared__\s+([\w:]+)\s+([^;]+);")


def _static_shared(m: re.Match) -> str:
    """``__shared__ T a[..], b;`` -> ``static T a[..], b; EMU_SHARED(a); EMU_SHARED(b);``"""
    names = [re.match(r"\s*(\w+)", d).group(1) for d in m.group(2).split(",")]
    return f"static {m.group(1)} {m.group(2)};" + "".join(f" EMU_SHARED({n});" for n in names)


def translate(source: str) -> str:
    """CUDA source (a family's .cu or a .cuh) as C++ for the emulator: only the shared
    memory declarations change (comments are left alone)."""
    lines = []
    for line in source.splitlines():
        code, sep, comment = line.partition("//")
        code = _EXTERN_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(emu::dynamic_shared());", code)
        code = _SHARED.sub(_static_shared, code)
        if "__shared__" in code:
            raise EmulatorBuildError(f"a __shared__ declaration the emulator does not translate: {line.strip()}")
        lines.append(code + sep + comment)
    return "\n".join(lines) + "\n"


def headers() -> dict[str, str]:
    """The kernels' headers (common.cuh), translated; they go first on the include path."""
    return {p.name: translate(p.read_text()) for p in sorted(loader.kernel_dir().glob("*.cuh"))}


def _symbol(family: str, i: int) -> str:
    return f"emu_{family}_{i}"


def units() -> dict[str, str]:
    """One C++ translation unit per kernel family: the translated source, then an
    ``extern "C"`` launch entry and signature function per instantiation."""
    out = {}
    for family, names in loader.NAME_EXPRESSIONS.items():
        lines = ['#include "emu_cuda.h"', f'#line 1 "{family}.cu"', translate(loader.source(family)), ""]
        for i, name in enumerate(names):
            sym = _symbol(family, i)
            lines.append(
                f'extern "C" int {sym}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned long smem, '
                f'void** args) {{ return emu::launch("{name}", &{name}, dim3(gx, gy, gz), dim3(bx), smem, args); }}')
            lines.append(f'extern "C" const char* {sym}_sig() {{ return emu::signature(&{name}); }}')
        out[family] = "\n".join(lines) + "\n"
    return out


# -- build --------------------------------------------------------------------------------

def cache_root() -> Path:
    env = os.environ.get("MTPKERN_CUDA_EMU_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtpkern" / "cuda_emu"


def _writable_root() -> Path:
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
        return root
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"mtpkern-cuda-emu-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def compile_flags(asan: bool, contract: bool = False) -> tuple[list[str], list[str], list[str]]:
    """-> (flags for the kernels, for the runtime, for the link); the kernels also get
    ``-I`` the directory of the translated headers. ``contract``: the kernels (not the
    runtime) with ``-ffp-contract=fast -mfma`` (EmulatorUnavailable without FMA)."""
    common = ["-std=c++17", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-omit-frame-pointer",
              "-Wno-unknown-pragmas", "-Wno-attributes", f"-I{INCLUDE}"]
    kernels = common
    if contract:
        if not cpu_has_fma():
            raise EmulatorUnavailable(
                "MTPKERN_CUDA_EMU_CONTRACT=1 needs a CPU with FMA (no 'fma' flag in /proc/cpuinfo): without it "
                "g++ cannot fuse a * b + c into one rounding as NVRTC does, so contraction cannot be emulated "
                "faithfully here")
        kernels = [f for f in common if f != "-ffp-contract=off"] + ["-ffp-contract=fast", "-mfma"]
    if asan:
        san = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        return kernels + san, common + san, ["-shared", "-fsanitize=address,undefined"]
    # UBSan checks without its runtime: emu_runtime.cpp defines the handlers, which
    # report through EmulatorError with the kernel, block and thread.
    checks = "alignment,bounds,signed-integer-overflow,shift,integer-divide-by-zero,null,pointer-overflow,return,unreachable"
    ub = [f"-fsanitize={checks}", "-fno-sanitize-recover=all"]
    return kernels + ["-O2"] + ub, common + ["-O2"], ["-shared"]


def _gxx() -> str:
    gxx = os.environ.get("CXX") or shutil.which("g++")
    if not gxx or not shutil.which(gxx):
        raise EmulatorUnavailable("g++ not found (the CUDA emulator compiles the kernels with it)")
    return gxx


def _version(gxx: str) -> str:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise EmulatorUnavailable(f"the CUDA emulator needs x86-64 Linux, this is {platform.system()} "
                                  f"{platform.machine()}")
    try:
        return subprocess.run([gxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise EmulatorUnavailable(f"{gxx} --version failed: {e}") from None


def _probe(gxx: str, asan: bool, work: Path) -> None:
    """EmulatorUnavailable when g++ cannot build a C++17 shared library here (with ASan if asked)."""
    src = work / "probe.cpp"
    src.write_text("#include <cstdio>\n#include <vector>\nextern \"C\" int probe() { std::vector<int> v(3); "
                   "return (int)v.size(); }\n")
    flags = ["-std=c++17", "-fPIC", "-shared"] + (["-fsanitize=address,undefined"] if asan else [])
    r = subprocess.run([gxx, *flags, str(src), "-o", str(work / "probe.so")], capture_output=True, text=True,
                       check=False)
    src.unlink()
    (work / "probe.so").unlink(missing_ok=True)
    if r.returncode:
        raise EmulatorUnavailable(f"{gxx} cannot build a C++17 shared library{' with ASan' if asan else ''}: "
                                  f"{r.stderr.strip()[-500:]}")


def _run_jobs(cmds: list[list[str]], jobs: int) -> None:
    """Run the compile commands, ``jobs`` at a time; raise EmulatorBuildError with g++'s output."""
    pending = list(cmds)
    running: list[tuple[list[str], subprocess.Popen]] = []
    errors = []
    while pending or running:
        while pending and len(running) < jobs:
            cmd = pending.pop(0)
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        cmd, proc = running.pop(0)
        out, _ = proc.communicate()
        if proc.returncode:
            errors.append(f"$ {' '.join(cmd)}\n{out}")
    if errors:
        raise EmulatorBuildError("the kernels do not compile for the CUDA emulator:\n" + "\n".join(errors)[-8000:])


def build(asan: bool = False, jobs: int | None = None, contract: bool = False) -> Path:
    """Build (or find in the cache) the emulator library; -> its path. ``contract``: the
    kernels with floating-point contraction on (``MTPKERN_CUDA_EMU_CONTRACT``)."""
    gxx = _gxx()
    version = _version(gxx)
    root = _writable_root()
    kflags, rflags, lflags = compile_flags(asan, contract)
    srcs = units()
    h = hashlib.sha256()
    for part in (TRANSLATION_VERSION, gxx, version, " ".join(kflags + rflags + lflags)):
        h.update(part.encode() + b"\0")
    hdrs = headers()
    for p in sorted(INCLUDE.iterdir()) + [RUNTIME, SELFTEST]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for name, text in sorted(hdrs.items()) + sorted(srcs.items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    key = f"{'asan' if asan else 'fast'}{'-contract' if contract else ''}-{h.hexdigest()[:16]}"
    final = root / key
    lib = final / "libcudaemu.so"
    if lib.is_file():
        os.utime(final)
        return lib

    work = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
    try:
        _probe(gxx, asan, work)
        (work / "kernels").mkdir()
        for name, text in hdrs.items():
            (work / "kernels" / name).write_text(text)
        kflags = kflags + [f"-I{work / 'kernels'}"]
        cmds, objs = [], []
        for fam, text in srcs.items():
            cpp = work / f"{fam}.cpp"
            cpp.write_text(text)
            objs.append(work / f"{fam}.o")
            cmds.append([gxx, *kflags, "-c", str(cpp), "-o", str(objs[-1])])
        selftest = work / "selftest.cpp"
        selftest.write_text('#include "emu_cuda.h"\n#line 1 "selftest.cu"\n' + translate(SELFTEST.read_text()))
        objs.append(work / "selftest.o")
        cmds.append([gxx, *kflags, "-c", str(selftest), "-o", str(objs[-1])])
        objs.append(work / "runtime.o")
        cmds.append([gxx, *rflags, "-c", str(RUNTIME), "-o", str(objs[-1])])
        # the biggest units first
        order = sorted(range(len(cmds)), key=lambda i: -Path(cmds[i][-3]).stat().st_size)
        _run_jobs([cmds[i] for i in order], jobs or max(1, os.cpu_count() or 1))
        _run_jobs([[gxx, *lflags, *map(str, objs), "-o", str(work / "libcudaemu.so")]], 1)
        for o in objs:          # the translated sources stay, for reading g++ / UBSan line numbers
            o.unlink()
        try:
            os.rename(work, final)
        except OSError:        # built concurrently by another process: keep theirs
            if not lib.is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune(root, keep=final)
    return lib


def _prune(root: Path, keep: Path) -> None:
    builds = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[KEEP_BUILDS:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


# -- the library ---------------------------------------------------------------------------

#: kernel parameter type (from the C++ signature) -> the Python values a launch may pass
_SCALARS = {"int32": np.int32, "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64,
            "float32": np.float32, "float64": np.float64}
_CTYPES = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
           np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}
#: pointer element type -> array dtype (BF16 lives in uint16 arrays, FP8 E4M3 in uint8 ones, FP4
#: E2M1 two a byte (MXFP4's and NVFP4's) and their scale bytes too)
_POINTEES = {"float32": "float32", "float64": "float64", "int32": "int32", "uint32": "uint32", "int64": "int64",
             "uint64": "uint64",
             "bfloat16": "uint16", "fp8e4m3": "uint8", "fp4x2e2m1": "uint8", "nvfp4x2e2m1": "uint8",
             "uint8": "uint8"}


def _asan_runtime_loaded() -> bool:
    try:
        return "libasan" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


class EmuKernel:
    """A kernel instantiation, called as a ``cupy.RawKernel``: ``k(grid, block, args, shared_mem=0)``."""

    def __init__(self, emulator: Emulator, name: str, symbol: str):
        self.emulator = emulator
        self.name = name
        self.fn = getattr(emulator.lib, symbol)
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulong,
                            ctypes.POINTER(ctypes.c_void_p)]
        sig = getattr(emulator.lib, symbol + "_sig")
        sig.restype = ctypes.c_char_p
        #: the kernel's parameter types, e.g. ["*float32", "*bfloat16", "int32"]
        self.params = [p for p in sig().decode().split(",") if p]
        #: as CuPy's RawKernel attribute: dynamic shared memory a launch may take (48 KiB
        #: unless raised, up to the emulated device's opt-in limit)
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def _arg(self, i: int, a: Any, param: str) -> ctypes._SimpleCData:
        where = f"{self.name}: argument {i}"
        if param.startswith("*"):
            if isinstance(a, np.ndarray):
                want = _POINTEES[param[1:]]
                if a.dtype.name != want:
                    raise EmulatorError(f"{where}: a {a.dtype.name} array for a {param[1:]} pointer "
                                        f"(expected {want})")
                if not a.flags.c_contiguous:
                    raise EmulatorError(f"{where}: a non-contiguous array")
                return ctypes.c_void_p(a.ctypes.data)
            if isinstance(a, np.uint64) and int(a) == 0:
                return ctypes.c_void_p(0)          # NULL (cuda_launch._util.NULL)
            raise EmulatorError(f"{where}: {type(a).__name__} for a pointer parameter")
        want = _SCALARS[param]
        if type(a) is not want:
            raise EmulatorError(f"{where}: {type(a).__name__} for a {param} parameter (pass {want.__name__}: "
                                f"CuPy passes a value with its own size)")
        return _CTYPES[want](a)

    def __call__(self, grid, block, args, shared_mem=0):
        grid = [int(g) for g in grid]
        grid += [1] * (3 - len(grid))
        block = [int(b) for b in block]
        if len(block) != 1:
            raise EmulatorError(f"{self.name}: block {tuple(block)}: only 1-D blocks are emulated")
        if len(args) != len(self.params):
            raise EmulatorError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        values = [self._arg(i, a, p) for i, (a, p) in enumerate(zip(args, self.params))]
        ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        smem = int(shared_mem)
        fn, lib, name = self.fn, self.emulator.lib, self.name
        if self.max_dynamic_shared_size_bytes > self.emulator.smem_optin:
            raise EmulatorError(f"{name}: max_dynamic_shared_size_bytes {self.max_dynamic_shared_size_bytes} "
                                f"over the device's opt-in limit {self.emulator.smem_optin}")
        limit, optin = self.max_dynamic_shared_size_bytes, self.emulator.smem_optin

        def run(values=values, ptrs=ptrs, args=tuple(args)):   # keeps the arrays alive for replays
            lib.emu_set_dyn_smem_limit(limit, optin)
            if fn(*grid, block[0], smem, ptrs):
                raise EmulatorError(lib.emu_last_error().decode())

        self.emulator.launches[name] += 1
        recording = self.emulator.capture()
        if recording is not None:
            recording.append(run)
        else:
            run()


class Emulator:
    """The loaded library and the state the fake launch path needs."""

    def __init__(self, lib_path: Path):
        asan = lib_path.parent.name.startswith("asan")
        if asan and not _asan_runtime_loaded():
            raise RuntimeError(
                "the ASan build of the CUDA emulator needs the ASan runtime loaded first: run "
                "`tests/cuda_emu/run.sh --asan`, or set LD_PRELOAD=\"$(g++ -print-file-name=libasan.so) "
                "$(g++ -print-file-name=libubsan.so)\" ASAN_OPTIONS=detect_leaks=0")
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_set_order.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self.asan = bool(self.lib.emu_asan())
        #: kernels built with floating-point contraction on (build(contract=True): the key says so)
        self.contract = "-contract-" in lib_path.parent.name
        self.sm_count = DEFAULT_SM_COUNT
        #: the device's opt-in shared memory limit the launchers plan for (H100 / H200)
        self.smem_optin = DEFAULT_SMEM_OPTIN
        self.lib.emu_set_dyn_smem_limit.argtypes = [ctypes.c_ulong, ctypes.c_ulong]
        #: -> a list to record launches into (a fake stream capture), or None to run them
        self.capture: Callable[[], list | None] = lambda: None
        self.launches: Counter[str] = Counter()
        self._symbols = {name: _symbol(fam, i) for fam, names in loader.NAME_EXPRESSIONS.items()
                         for i, name in enumerate(names)}
        self._kernels: dict[str, EmuKernel] = {}
        self.set_order(*order_from_env())

    def set_order(self, order: str, seed: int = 1) -> None:
        self.lib.emu_set_order(ORDERS[order], seed)

    def kernel(self, family: str, name: str) -> EmuKernel:
        """``loader.get_kernel`` for the emulator."""
        if name not in loader.NAME_EXPRESSIONS.get(family, ()):
            raise ValueError(f"kernel {name!r} is not an instantiation of family {family!r}")
        if name not in self._kernels:
            self._kernels[name] = EmuKernel(self, name, self._symbols[name])
        return self._kernels[name]

    def selftest_kernel(self, name: str) -> EmuKernel:
        """A kernel of selftest.cu (entries ``emu_selftest_<name>``)."""
        return EmuKernel(self, f"selftest {name}", f"emu_selftest_{name}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[Emulator]:
        """Route the launchers of ``mtpkern.backends.cuda_launch`` to the emulator
        (NumPy arrays as device arrays); restored on exit."""
        from mtpkern.backends.cuda_launch import (
            _util,
            attention,
            dsa,
            gate,
            gemm_tc,
            hc,
            linear,
            lm_head,
            mla,
            mlp,
            moe,
            norm,
            rope_kv,
            step,
        )

        fakes = {"device": _device, "optional": _optional, "inplace": _inplace, "output": _output,
                 "zeroed": _zeroed, "device_rows": _device_rows,
                 "expect_disjoint": _expect_disjoint, "expect_same_or_disjoint": _expect_same_or_disjoint,
                 "get_kernel": self.kernel,
                 "sm_count": lambda: self.sm_count, "smem_optin": lambda: self.smem_optin}
        saved = []
        try:
            for mod in (_util, attention, dsa, gate, gemm_tc, hc, linear, lm_head, mla, mlp, moe, norm, rope_kv,
                        step):
                for attr, fake in fakes.items():
                    if hasattr(mod, attr):
                        saved.append((mod, attr, getattr(mod, attr)))
                        setattr(mod, attr, fake)
            yield self
        finally:
            for mod, attr, orig in reversed(saved):
                setattr(mod, attr, orig)


# -- "device" arrays are NumPy arrays (the launchers' _util helpers) ------------------------

def _device(a, name, *dtypes):
    arr = np.asarray(a)
    if dtypes:
        expect_dtype(name, arr, *dtypes)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _device_rows(a, name, *dtypes):
    """``_util.device_rows`` on NumPy: a column slice is spanned in place (the same rule,
    ``_util.row_stride``), anything else copied."""
    from mtpkern.backends.cuda_launch._util import row_stride

    arr = np.asarray(a)
    if dtypes:
        expect_dtype(name, arr, *dtypes)
    ld = row_stride(arr)
    if arr.flags.c_contiguous or ld is None:
        return np.ascontiguousarray(arr).reshape(-1), int(arr.shape[1])
    n, G = arr.shape
    span = np.lib.stride_tricks.as_strided(arr, shape=((n - 1) * ld + G,), strides=(arr.itemsize,), writeable=False)
    return span, ld


def _optional(a, name, *dtypes):
    return None if a is None else _device(a, name, *dtypes)


def _inplace(a, name, *dtypes):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a GPU array (written in place), got {type(a).__name__}")
    if dtypes:
        expect_dtype(name, a, *dtypes)
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (written in place), got strides {a.strides}")
    return a


def _output(out, name, shape, dtype):
    if out is None:
        a = np.empty(shape, dtype)
        a.view(np.uint8)[...] = 0xFF          # an output element never written reads as NaN / -1
        return a
    arr = _inplace(out, name, np.dtype(dtype).name)
    if shape_of(arr) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(shape_of(arr))}")
    return arr


def _zeroed(buf, name, shape, dtype):
    return np.zeros(shape, dtype) if buf is None else _output(buf, name, shape, dtype)


def _expect_disjoint(name_a, a, name_b, b):
    a0, b0 = a.ctypes.data, b.ctypes.data
    if a0 < b0 + b.nbytes and b0 < a0 + a.nbytes and a.nbytes and b.nbytes:
        raise ValueError(f"{name_a} must not overlap {name_b}")


def _expect_same_or_disjoint(name_a, a, name_b, b):
    if b is None or (a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes):
        return
    _expect_disjoint(name_a, a, name_b, b)


# -- the backend ----------------------------------------------------------------------------

@functools.cache
def _cuda_backend_class():
    from mtpkern.backends.base import Backend
    from mtpkern.backends.cuda import CudaBackend, _bf16

    class EmuCudaBackend(CudaBackend):
        """``CudaBackend`` whose device arrays are NumPy arrays (use inside ``Emulator.installed()``)."""

        def __init__(self, kv_dtype: str = "bfloat16"):     # no device to query
            self._set_kv_dtype(kv_dtype)
            self.device_id = 0

        @property
        def xp(self):
            return np

        def prepare_weight(self, w):
            from mtpkern.backends.cuda_launch._util import CudaFp4, CudaFp8
            from mtpkern.quant import Fp4Weight, Fp8Weight

            if isinstance(w, Fp8Weight):
                return CudaFp8.from_weight(w, lambda a: np.array(a, copy=True, order="C"))
            if isinstance(w, Fp4Weight):
                return CudaFp4.from_weight(w, lambda a: np.array(a, copy=True, order="C"))
            w = np.asarray(w)
            if w.dtype == _bf16() or w.dtype == np.uint16:
                return np.ascontiguousarray(w).view(np.uint16).copy()
            if np.issubdtype(w.dtype, np.floating):
                return np.array(w, dtype=np.float32, order="C", copy=True)
            raise TypeError(f"prepare_weight: expected a bfloat16 or float array, got {w.dtype}")

        def from_host(self, a):
            return np.array(a, copy=True, order="C")

        def ingest_float(self, name, x):
            return Backend.ingest_float(self, name, x)

        def to_host(self, a):
            return np.array(a, copy=True)               # a snapshot, as a device-to-host copy

        def empty_kv(self, num_blocks, block_size, num_kv_heads, head_dim):
            return np.zeros((num_blocks, block_size, num_kv_heads, head_dim), self.kv_dtype)

        def synchronize(self):
            pass

        def describe(self):
            return f"cuda (emulated on the CPU, kv {self.kv_name()})"

    return EmuCudaBackend


def backend(kv_dtype: str = "bfloat16"):
    """An ``EmuCudaBackend`` (its ops launch into the emulator inside ``Emulator.installed()``)."""
    return _cuda_backend_class()(kv_dtype)


def installed_emulator() -> Iterator[Emulator]:
    """A pytest fixture's body: the emulator, built once (cached across runs), routing the
    cuda launchers while the fixture lives; the test is skipped where it cannot be built."""
    import pytest

    try:
        lib = build(asan=asan_requested(), contract=contract_requested())
    except EmulatorUnavailable as e:
        pytest.skip(f"CUDA emulator unavailable: {e}")
    with Emulator(lib).installed() as em:
        yield em
