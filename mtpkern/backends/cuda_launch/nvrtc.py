"""NVRTC's C API through ctypes, one ``libnvrtc`` per object, and where a toolkit's
``libnvrtc.so.<major>`` is: what the compile check (``mtpkern.nvrtc_check``) and the
kernel binary cache (``kernel_cache``) share. No CUDA driver or device, no CuPy."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from pathlib import Path

#: where each major's libnvrtc sits in a site-packages directory (the nvidia-cuda-nvrtc wheels)
NVRTC_WHEEL_DIRS: dict[int, tuple[str, ...]] = {12: ("nvidia/cuda_nvrtc/lib",), 13: ("nvidia/cu13/lib",)}

class CompileError(RuntimeError):
    """NVRTC rejected a family; the message holds the compiler log."""


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def find_nvrtc(major: int) -> str | None:
    """``libnvrtc.so.<major>``: the wheel's on ``sys.path``, else ``$CUDA_PATH`` /
    ``$CUDA_HOME``'s, else one on ``$LD_LIBRARY_PATH`` or in ldconfig's cache
    (looked up, not loaded: this process loads no libnvrtc)."""
    soname = f"libnvrtc.so.{major}"
    candidates = [p / sub / soname for p in _site_dirs() for sub in NVRTC_WHEEL_DIRS.get(major, ())]
    for v in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(v):
            candidates += [Path(os.environ[v]) / lib / soname for lib in ("lib64", "lib")]
    candidates += [Path(d) / soname for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for c in candidates:
        if c.is_file():
            return str(c)
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in cache.splitlines():  # "\tlibnvrtc.so.13 (libc6,x86-64) => /usr/local/cuda/lib64/libnvrtc.so.13"
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] == soname and Path(path).is_file():
            return path
    return None


# --------------------------------------------------------------------------
# NVRTC's C API through ctypes (the same calls for every toolkit)

class Nvrtc:
    """The few nvrtc* entry points a compile (and its CUBIN) needs, from one libnvrtc."""

    def __init__(self, path: str):
        # libnvrtc dlopens its builtins by soname at the first compile: load the ones beside
        # it first (a wheel's lib directory is on no search path), so that this name is found
        for b in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
            ctypes.CDLL(str(b))
        lib = ctypes.CDLL(path)
        P, S, I = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int  # noqa: E741
        sigs = {
            "nvrtcVersion": [ctypes.POINTER(I), ctypes.POINTER(I)],
            "nvrtcCreateProgram": [ctypes.POINTER(P), S, S, I, ctypes.POINTER(S), ctypes.POINTER(S)],
            "nvrtcAddNameExpression": [P, S],
            "nvrtcCompileProgram": [P, I, ctypes.POINTER(S)],
            "nvrtcGetProgramLogSize": [P, ctypes.POINTER(ctypes.c_size_t)],
            "nvrtcGetProgramLog": [P, ctypes.c_char_p],
            "nvrtcGetLoweredName": [P, S, ctypes.POINTER(S)],
            "nvrtcDestroyProgram": [ctypes.POINTER(P)],
            "nvrtcGetCUBINSize": [P, ctypes.POINTER(ctypes.c_size_t)],
            "nvrtcGetCUBIN": [P, ctypes.c_char_p],
        }
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, I
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [I], S
        self.lib, self.path = lib, path

    def check(self, status: int, what: str) -> None:
        if status != 0:  # NVRTC_SUCCESS
            raise CompileError(f"{what} failed: {self.lib.nvrtcGetErrorString(status).decode()} ({self.path})")

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, src: str, name: str, options, name_expressions, cubin: list | None = None
                ) -> tuple[bool, str, dict[str, str]]:
        """-> (compiled, log, {name expression: lowered (mangled) name}); the names only when compiled.
        ``cubin``: a list that gets the CUBIN's bytes appended (the options must name a real
        architecture, ``-arch=sm_XX``)."""
        prog = ctypes.c_void_p()
        self.check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None),
                   "nvrtcCreateProgram")
        try:
            for n in name_expressions:
                self.check(self.lib.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value + 1)
            self.check(self.lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace").rstrip()
            if status != 0:
                return False, log, {}
            lowered = {}
            for n in name_expressions:
                out = ctypes.c_char_p()
                self.check(self.lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)), f"nvrtcGetLoweredName({n})")
                lowered[n] = out.value.decode()
            if cubin is not None:
                self.check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
                data = ctypes.create_string_buffer(size.value)
                self.check(self.lib.nvrtcGetCUBIN(prog, data), "nvrtcGetCUBIN")
                cubin.append(data.raw)
            return True, log, lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def load(path: str) -> Nvrtc:
    """The :class:`Nvrtc` of the libnvrtc at ``path``, one per path and process."""
    return Nvrtc(path)
