"""Compile every CUDA kernel family with NVRTC, without a GPU, under each installed toolkit.

Each ``kernels/<family>.cu`` is compiled to a CUBIN for every requested
architecture with the loader's options and name expressions, plus
``-Xptxas=-v``; the ptxas log gives, per kernel, registers and spill bytes::

    python -m mtpkern.nvrtc_check                       # every toolkit found, sm_80 and sm_90
    python -m mtpkern.nvrtc_check --toolkit 13          # CUDA 13 only
    python -m mtpkern.nvrtc_check --write kernels/registers.json

A toolkit is one CUDA major (:data:`TOOLKITS`): its ``libnvrtc.so.<major>``
(the ``nvidia-cuda-nvrtc-cu12`` / ``nvidia-cuda-nvrtc`` 13 wheels, else
``$CUDA_PATH`` / ``$CUDA_HOME``, ``$LD_LIBRARY_PATH`` or ldconfig's cache) and
the runtime headers of the same major (``nvidia-cuda-runtime-cu12`` /
``nvidia-cuda-runtime`` 13). NVRTC is called through ctypes, the same code for
every toolkit, each toolkit's compiles in worker processes of their own (one
libnvrtc per process). Both come with ``pip install 'mtpkern[nvrtc]'`` (``pip install -e '.[nvrtc]'`` from a source
checkout); no CUDA
driver or device.

Exit status 1 when a family fails to compile or a kernel spills, 2 when no
requested toolkit is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .backends.cuda_launch import loader
from .backends.cuda_launch.nvrtc import NVRTC_WHEEL_DIRS, CompileError, Nvrtc, find_nvrtc, load  # noqa: F401 (re-exported)

ARCHS: tuple[str, ...] = ("sm_80", "sm_90")
#: the CUDA majors checked: 12 (CI's first table) and 13 (the GPU machine's CuPy)
TOOLKITS: tuple[int, ...] = (12, 13)
#: what installs each toolkit (for the message when one is missing); setup.cfg's nvrtc extra
INSTALL_HINT: dict[int, str] = {
    12: "pip install 'nvidia-cuda-nvrtc-cu12==12.9.*' 'nvidia-cuda-runtime-cu12==12.9.*'",
    13: "pip install 'nvidia-cuda-nvrtc==13.5.*' 'nvidia-cuda-runtime==13.5.*'",
}
#: where the recorded register counts live (shipped with the kernels)
REGISTERS_FILE = "registers.json"
REFRESH = "python -m mtpkern.nvrtc_check --write kernels/registers.json"


class ToolkitMissing(LookupError):
    """A toolkit's libnvrtc or runtime headers are not installed; the message says what to install."""


@dataclass(frozen=True, slots=True)
class KernelInfo:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int   # bytes
    stack: int         # bytes of stack frame (local arrays and spills)


@dataclass(frozen=True, slots=True)
class Toolkit:
    """One CUDA toolkit's NVRTC and the runtime headers of the same major."""

    major: int
    nvrtc: str    # path of libnvrtc.so.<major>
    include: str  # directory holding cuda_bf16.h


def find_toolkit(major: int) -> Toolkit:
    """The installed toolkit ``major`` (12 or 13); :class:`ToolkitMissing` naming what is absent."""
    if major not in TOOLKITS:
        raise ValueError(f"major: expected one of {', '.join(map(str, TOOLKITS))}, got {major!r}")
    lib = find_nvrtc(major)
    include = loader.cuda_include_dir(major)
    missing = [w for w, ok in ((f"libnvrtc.so.{major}", lib), (f"CUDA {major} runtime headers (cuda_bf16.h)", include)) if not ok]
    if missing:
        raise ToolkitMissing(f"CUDA {major} toolkit not found: no {' and no '.join(missing)} ({INSTALL_HINT[major]})")
    return Toolkit(major, lib, include)


def find_toolkits(majors=TOOLKITS) -> tuple[dict[int, Toolkit], dict[int, str]]:
    """-> ({major: Toolkit} of those installed, {major: why not} of the others)."""
    found, missing = {}, {}
    for m in majors:
        try:
            found[m] = find_toolkit(m)
        except ToolkitMissing as e:
            missing[m] = str(e)
    return found, missing


def _nvrtc(tk: Toolkit) -> Nvrtc:
    return load(tk.nvrtc)


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> dict[str, KernelInfo]:
    """ptxas ``-v`` output -> {mangled entry name: KernelInfo}."""
    out: dict[str, KernelInfo] = {}
    name, spill = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            name, spill = m.group(1), (0, 0, 0)
        elif (m := _SPILL.search(line)) and name:
            spill = tuple(int(g) for g in m.groups())
        elif (m := _REGS.search(line)) and name:
            out[name] = KernelInfo(int(m.group(1)), spill[1], spill[2], spill[0])
            name = None
    return out


def compile_family(family: str, arch: str, tk: Toolkit) -> tuple[str, dict[str, KernelInfo]]:
    """Compile one family for one arch ('sm_90') with toolkit ``tk``;
    -> (NVRTC version, {name expression: KernelInfo})."""
    nv = _nvrtc(tk)
    names = loader.NAME_EXPRESSIONS[family]
    # the loader's options, its include path with this toolkit's headers
    opts = (*(o for o in loader.compile_options(tk.major) if not o.startswith("-I")),
            f"-I{loader.kernel_dir()}", f"-I{tk.include}", "-ftz=true", f"-arch={arch}", "-Xptxas=-v")
    ok, log, lowered = nv.compile(loader.source(family), f"{family}.cu", opts, names)
    version = nv.version()
    if not ok:
        raise CompileError(f"{family}.cu for {arch} does not compile with NVRTC {version}:\n{log}")
    by_mangled = parse_ptxas_log(log)
    out = {}
    for n in names:
        if lowered[n] not in by_mangled:
            raise CompileError(f"{family}.cu for {arch}, NVRTC {version}: no ptxas report for {n} ({lowered[n]})")
        out[n] = by_mangled[lowered[n]]
    return version, out


def _compile_task(task: tuple[str, str, Toolkit]) -> tuple[str, dict[str, KernelInfo]]:
    return compile_family(*task)


def check_all(archs=ARCHS, families=None, jobs: int | None = None, toolkits=None) -> dict[str, dict[str, dict[str, KernelInfo]]]:
    """-> {NVRTC version: {arch: {name expression: KernelInfo}}} over every family and
    every toolkit in ``toolkits`` (Toolkit objects; default: every one installed).

    Each toolkit's (family, arch) compiles run in a process pool of its own (so a
    process loads one libnvrtc only), the pools side by side, ``jobs`` workers in all
    (default: one per CPU; at least one per toolkit)."""
    families = tuple(families or loader.FAMILIES)
    if toolkits is None:
        toolkits = tuple(find_toolkits()[0].values())
    toolkits = tuple(toolkits)
    if not toolkits:
        return {}
    tasks = [(f, a) for a in archs for f in families]
    jobs = jobs or os.cpu_count() or 1
    per = max(1, min(len(tasks), jobs // len(toolkits)))
    # largest first, so the long compiles do not end up last on one worker
    order = sorted(range(len(tasks)), key=lambda i: -len(loader.NAME_EXPRESSIONS[tasks[i][0]]))
    pools = [ProcessPoolExecutor(max_workers=per) for _ in toolkits]
    try:
        futures = [[pool.submit(_compile_task, (*tasks[i], tk)) for i in order] for pool, tk in zip(pools, toolkits)]
        out: dict[str, dict[str, dict[str, KernelInfo]]] = {}
        for fs in futures:
            done = dict(zip(order, (f.result() for f in fs)))
            table = out.setdefault(done[order[0]][0], {a: {} for a in archs})
            for i, (_, a) in enumerate(tasks):
                table[a].update(done[i][1])
        return out
    finally:
        for pool in pools:
            pool.shutdown(cancel_futures=True)


def registers_table(infos: dict[str, dict[str, dict[str, KernelInfo]]], previous: dict | None = None,
                    families: "list[str] | None" = None) -> dict:
    """The content of registers.json: registers per (NVRTC version, arch, kernel) (another
    version may allocate differently). The tables of ``previous`` (the file's content)
    for toolkit majors not in ``infos`` are kept (a toolkit not installed here). ``families``:
    the ones compiled, when not all: a compiled toolkit's table keeps the other families'
    kernels from ``previous`` (a kernel of a compiled family not compiled now is gone)."""
    now = {v: {a: {k: i.registers for k, i in ks.items()} for a, ks in t.items()} for v, t in infos.items()}
    recorded = recorded_tables(previous or {})
    if families is not None:
        ours = {n.split("<")[0] for f in families for n in loader.NAME_EXPRESSIONS[f]}
        for v, t in now.items():
            for a, old in recorded.get(v, {}).items():
                t[a] = {**{k: r for k, r in old.items() if k.split("<")[0] not in ours}, **t.get(a, {})}
    now = {v: {a: dict(sorted(ks.items())) for a, ks in sorted(t.items())} for v, t in now.items()}
    majors = {v.split(".")[0] for v in now}
    kept = {v: t for v, t in recorded.items() if v.split(".")[0] not in majors}
    return {"refresh": REFRESH, "toolkits": dict(sorted({**kept, **now}.items(), key=lambda kv: _version_key(kv[0])))}


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def recorded_tables(recorded: dict) -> dict[str, dict]:
    """{NVRTC version: {arch: {kernel: registers}}} of registers.json's content (also of
    the one-toolkit layout before it had tables per toolkit: ``nvrtc`` and ``registers``)."""
    if "toolkits" in recorded:
        return dict(recorded["toolkits"])
    if "nvrtc" in recorded and "registers" in recorded:
        return {recorded["nvrtc"]: recorded["registers"]}
    return {}


def recorded_table(major: int, recorded: dict) -> tuple[str, dict] | None:
    """(version, {arch: {kernel: registers}}) of toolkit ``major`` in registers.json's
    content, or None when it has no table for that major."""
    for v, t in recorded_tables(recorded).items():
        if v.split(".")[0] == str(major):
            return v, t
    return None


def recorded_registers_path() -> Path:
    return loader.kernel_dir() / REGISTERS_FILE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtpkern.nvrtc_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="sm_XX (repeatable); default sm_80 and sm_90")
    ap.add_argument("--family", action="append", choices=loader.FAMILIES, help="default: all")
    ap.add_argument("--toolkit", action="append", type=int, choices=TOOLKITS,
                    help="CUDA major (repeatable); default: every one installed")
    ap.add_argument("--write", metavar="PATH",
                    help="write the register table (JSON) here: the toolkits compiled replace theirs (with --family, "
                         "only that family's kernels in them), the others' are kept")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles, all toolkits together")
    args = ap.parse_args(argv)
    archs = tuple(args.arch or ARCHS)
    found, missing = find_toolkits(tuple(args.toolkit or TOOLKITS))
    for why in missing.values():
        print(f"skipped: {why}", file=sys.stderr)
    if not found:
        return 2
    try:
        infos = check_all(archs, args.family, args.jobs, tuple(found.values()))
    except CompileError as e:
        print(e, file=sys.stderr)
        return 1
    bad = 0
    print(f"{'nvrtc':6} {'arch':6} {'kernel':52} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6}")
    for v, table in infos.items():
        for a, ks in table.items():
            for k, i in ks.items():
                flag = "  <-- spills" if i.spill_stores or i.spill_loads else ""
                bad += bool(flag)
                print(f"{v:6} {a:6} {k:52} {i.registers:5} {i.spill_stores:9} {i.spill_loads:9} {i.stack:6}{flag}")
    if args.write:
        path = Path(args.write)
        previous = json.loads(path.read_text()) if path.is_file() else None
        table = registers_table(infos, previous, args.family)
        path.write_text(json.dumps(table, indent=1) + "\n")
        kept = sorted(set(table["toolkits"]) - set(infos))
        print(f"wrote {args.write}" + (f" (NVRTC {', '.join(kept)} kept from the file: not installed here)" if kept else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
