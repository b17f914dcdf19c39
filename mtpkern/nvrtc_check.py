"""Compile every CUDA kernel family with NVRTC, without a GPU.

Each ``kernels/<family>.cu`` is compiled to a CUBIN for every requested
architecture with the loader's options and name expressions, plus
``-Xptxas=-v``; the ptxas log gives, per kernel, registers and spill bytes::

    python -m mtpkern.nvrtc_check                       # sm_80 and sm_90, print a table
    python -m mtpkern.nvrtc_check --write kernels/registers.json

Exit status 1 when a family fails to compile or a kernel spills.
Needs ``cuda-bindings`` (``pip install mtpkern[nvrtc]``); no CUDA driver or device.
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

ARCHS: tuple[str, ...] = ("sm_80", "sm_90")
#: where the recorded register counts live (shipped with the kernels)
REGISTERS_FILE = "registers.json"


class CompileError(RuntimeError):
    """NVRTC rejected a family; the message holds the compiler log."""


@dataclass(frozen=True, slots=True)
class KernelInfo:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int   # bytes
    stack: int         # bytes of stack frame (local arrays and spills)


def _nvrtc():
    from cuda.bindings import nvrtc

    return nvrtc


def _ok(result):
    """cuda.bindings returns (status, *values); raise on a bad status."""
    nvrtc = _nvrtc()
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC call failed: {status}")
    return values[0] if len(values) == 1 else values


def nvrtc_version() -> str:
    major, minor = _ok(_nvrtc().nvrtcVersion())
    return f"{major}.{minor}"


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


def compile_family(family: str, arch: str) -> dict[str, KernelInfo]:
    """Compile one family for one arch ('sm_90'); -> {name expression: KernelInfo}."""
    nvrtc = _nvrtc()
    names = loader.NAME_EXPRESSIONS[family]
    prog = _ok(nvrtc.nvrtcCreateProgram(loader.source(family).encode(), f"{family}.cu".encode(), 0, [], []))
    try:
        for n in names:
            _ok(nvrtc.nvrtcAddNameExpression(prog, n.encode()))
        opts = [o.encode() for o in (*loader.compile_options(), "-ftz=true", f"-arch={arch}", "-Xptxas=-v")]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _ok(nvrtc.nvrtcGetProgramLogSize(prog))
        buf = b" " * size
        _ok(nvrtc.nvrtcGetProgramLog(prog, buf))
        log = buf.decode(errors="replace").rstrip("\x00 \n")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{family}.cu for {arch} does not compile:\n{log}")
        by_mangled = parse_ptxas_log(log)
        out = {}
        for n in names:
            mangled = _ok(nvrtc.nvrtcGetLoweredName(prog, n.encode())).decode()
            if mangled not in by_mangled:
                raise CompileError(f"{family}.cu for {arch}: no ptxas report for {n} ({mangled})")
            out[n] = by_mangled[mangled]
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile_task(task: tuple[str, str]) -> dict[str, KernelInfo]:
    return compile_family(*task)


def check_all(archs=ARCHS, families=None, jobs: int | None = None) -> dict[str, dict[str, KernelInfo]]:
    """-> {arch: {name expression: KernelInfo}} over every family.

    The (family, arch) compiles run in ``jobs`` worker processes (default: one
    per CPU): cuda.bindings holds the GIL during nvrtcCompileProgram, so
    threads would not overlap."""
    families = tuple(families or loader.FAMILIES)
    tasks = [(f, a) for a in archs for f in families]
    jobs = min(len(tasks), jobs or os.cpu_count() or 1)
    if jobs <= 1:
        results = [_compile_task(t) for t in tasks]
    else:
        # largest first, so the long compiles do not end up last on one worker
        order = sorted(range(len(tasks)), key=lambda i: -len(loader.NAME_EXPRESSIONS[tasks[i][0]]))
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            done = dict(zip(order, pool.map(_compile_task, [tasks[i] for i in order])))
        results = [done[i] for i in range(len(tasks))]
    out: dict[str, dict[str, KernelInfo]] = {a: {} for a in archs}
    for (_, a), res in zip(tasks, results):
        out[a].update(res)
    return out


def registers_table(infos: dict[str, dict[str, KernelInfo]]) -> dict:
    """The content of registers.json: registers per (arch, kernel), and the NVRTC
    version that produced them (another version may allocate differently)."""
    return {
        "nvrtc": nvrtc_version(),
        "refresh": "python -m mtpkern.nvrtc_check --write kernels/registers.json",
        "registers": {a: {k: i.registers for k, i in sorted(ks.items())} for a, ks in infos.items()},
    }


def recorded_registers_path() -> Path:
    return loader.kernel_dir() / REGISTERS_FILE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtpkern.nvrtc_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="sm_XX (repeatable); default sm_80 and sm_90")
    ap.add_argument("--family", action="append", choices=loader.FAMILIES, help="default: all")
    ap.add_argument("--write", metavar="PATH", help="write the register table (JSON) here")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles")
    args = ap.parse_args(argv)
    archs = tuple(args.arch or ARCHS)
    try:
        infos = check_all(archs, args.family, args.jobs)
    except CompileError as e:
        print(e, file=sys.stderr)
        return 1
    bad = 0
    print(f"NVRTC {nvrtc_version()}")
    print(f"{'arch':6} {'kernel':52} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6}")
    for a, ks in infos.items():
        for k, i in ks.items():
            flag = "  <-- spills" if i.spill_stores or i.spill_loads else ""
            bad += bool(flag)
            print(f"{a:6} {k:52} {i.registers:5} {i.spill_stores:9} {i.spill_loads:9} {i.stack:6}{flag}")
    if args.write:
        Path(args.write).write_text(json.dumps(registers_table(infos), indent=1) + "\n")
        print(f"wrote {args.write}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
