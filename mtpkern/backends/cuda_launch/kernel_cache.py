"""The kernel families' CUBINs on disk, so that a process loads what an earlier one built.

CuPy's own disk cache skips modules built with ``name_expressions`` (every family here),
so without this each process compiles every family it uses with NVRTC: 85 s for all
twelve on the first H200 (NVRTC 13.0), the MoE family alone 21 s. An entry is built
here with NVRTC through ctypes (``nvrtc.Nvrtc``) straight to a CUBIN for the device's
architecture, and is two files in :func:`cache_dir`:

- ``<family>-<key>.json``: the lowered (mangled) name of each name expression, the
  NVRTC version, the architecture, the build's seconds;
- ``<family>-<key>.cubin``: the binary, written last (an entry without it is a miss).

``key`` hashes everything the binary depends on: the family's source, the options
(which carry the headers' digest and include directories), the name expressions, the
architecture and the NVRTC version. Both files are written under temporary names and
renamed into place, so processes building the same entry at once leave one whole copy.

``MTPKERN_KERNEL_CACHE``: the directory (default ``$XDG_CACHE_HOME/mtpkern/kernels``, else
``~/.cache/mtpkern/kernels``); ``off`` (or ``0``) disables the cache: the loader then
compiles through CuPy as before. This module needs no CuPy and no device.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from .nvrtc import CompileError, load

ENV = "MTPKERN_KERNEL_CACHE"
#: bump when an entry's layout or the way it is built changes
FORMAT = 1


def cache_dir() -> Path | None:
    """Where entries live, or None when ``MTPKERN_KERNEL_CACHE`` is ``off`` / ``0``."""
    v = os.environ.get(ENV, "")
    if v.lower() in ("off", "0", "false", "no"):
        return None
    if v:
        return Path(v)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtpkern" / "kernels"


def entry_key(source: str, options, names, arch: str, nvrtc_version: str) -> str:
    h = hashlib.sha256()
    for part in (f"format {FORMAT}", source, "\0".join(options), "\0".join(names), arch, nvrtc_version):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()[:24]


def _paths(directory: Path, family: str, key: str) -> tuple[Path, Path]:
    stem = directory / f"{family}-{key}"
    return stem.with_suffix(".json"), stem.with_suffix(".cubin")


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def lookup(directory: Path, family: str, key: str, names) -> tuple[Path, dict[str, str]] | None:
    """(cubin path, {name expression: lowered name}) of a whole entry, else None."""
    meta_p, cubin_p = _paths(directory, family, key)
    try:
        if not cubin_p.is_file():
            return None
        meta = json.loads(meta_p.read_text())
        lowered = meta["lowered"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(lowered, dict) or any(n not in lowered for n in names):
        return None
    return cubin_p, {n: lowered[n] for n in names}


def build(family: str, source: str, options, names, arch: str, nvrtc_path: str,
          directory: Path) -> tuple[Path, dict[str, str], float]:
    """Compile ``family`` for ``arch`` ("sm_90") with the libnvrtc at ``nvrtc_path`` and store
    the entry; -> (cubin path, lowered names, seconds the compile took). An entry already
    there is returned as it is (0 seconds). :class:`nvrtc.CompileError` when NVRTC fails."""
    nv = load(nvrtc_path)
    version = nv.version()
    key = entry_key(source, options, names, arch, version)
    hit = lookup(directory, family, key, names)
    if hit is not None:
        return (*hit, 0.0)
    t0 = time.perf_counter()
    out: list[bytes] = []
    ok, log, lowered = nv.compile(source, f"{family}.cu", (*options, f"-arch={arch}"), names, cubin=out)
    seconds = time.perf_counter() - t0
    if not ok:
        raise CompileError(f"{family}.cu for {arch} does not compile with NVRTC {version}:\n{log}")
    directory.mkdir(parents=True, exist_ok=True)
    meta_p, cubin_p = _paths(directory, family, key)
    meta = {"family": family, "arch": arch, "nvrtc": version, "seconds": round(seconds, 3), "lowered": lowered}
    _write_atomic(meta_p, json.dumps(meta, indent=1, sort_keys=True).encode())
    _write_atomic(cubin_p, out[0])
    return cubin_p, lowered, seconds


def find(family: str, source: str, options, names, arch: str, nvrtc_path: str,
         directory: Path) -> tuple[Path, dict[str, str]] | None:
    """The entry for these inputs if it is on disk (no compile), else None."""
    key = entry_key(source, options, names, arch, load(nvrtc_path).version())
    return lookup(directory, family, key, names)
