"""Every CUDA kernel family compiles with NVRTC (no GPU needed) for sm_80 and
sm_90, with the loader's options and name expressions, without register
spills, and with the register counts recorded in kernels/registers.json (so a
change in register pressure shows up in review).

All families and both architectures compile once per session (~30 s on two
cores); skipped cleanly where cuda-bindings or the CUDA runtime headers are
missing.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed (pip install mtpkern[nvrtc])")

from mtpkern import nvrtc_check  # noqa: E402
from mtpkern.backends.cuda_launch import loader  # noqa: E402

REFRESH = "python -m mtpkern.nvrtc_check --write kernels/registers.json"


@pytest.fixture(scope="session")
def compiled() -> dict[str, dict[str, nvrtc_check.KernelInfo]]:
    try:
        return nvrtc_check.check_all(nvrtc_check.ARCHS)
    except nvrtc_check.CompileError as e:
        if 'cannot open source file "cuda_bf16.h"' in str(e):
            pytest.skip("CUDA runtime headers (cuda_bf16.h) not found: pip install nvidia-cuda-runtime-cu12")
        raise


def test_every_instantiation_compiles(compiled):
    want = {n for names in loader.NAME_EXPRESSIONS.values() for n in names}
    for arch in nvrtc_check.ARCHS:
        assert set(compiled[arch]) == want, f"{arch}: missing {sorted(want - set(compiled[arch]))}"


def test_no_register_spills(compiled):
    spills = [
        f"{arch} {name}: {i.spill_stores} B stored, {i.spill_loads} B loaded"
        for arch, kernels in compiled.items()
        for name, i in kernels.items()
        if i.spill_stores or i.spill_loads
    ]
    assert not spills, "kernels spill registers to local memory:\n" + "\n".join(spills)


def test_registers_match_recorded(compiled):
    recorded = json.loads(nvrtc_check.recorded_registers_path().read_text())
    if recorded["nvrtc"] != nvrtc_check.nvrtc_version():
        pytest.skip(
            f"registers.json was recorded with NVRTC {recorded['nvrtc']}, this is "
            f"{nvrtc_check.nvrtc_version()}: allocation may differ ({REFRESH} to re-record)"
        )
    now = nvrtc_check.registers_table(compiled)["registers"]
    diffs = [
        f"{arch} {name}: recorded {recorded['registers'].get(arch, {}).get(name)}, now {regs}"
        for arch, kernels in now.items()
        for name, regs in kernels.items()
        if recorded["registers"].get(arch, {}).get(name) != regs
    ]
    stale = [
        f"{arch} {name}: recorded but no longer compiled"
        for arch, kernels in recorded["registers"].items()
        for name in kernels
        if name not in now.get(arch, {})
    ]
    assert not diffs + stale, (
        "register counts differ from kernels/registers.json:\n" + "\n".join(diffs + stale)
        + f"\nIf the change is intended, refresh the file: {REFRESH}"
    )


def test_parse_ptxas_log():
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function '_Z1kIfEvPKT_' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kIfEvPKT_\n"
        "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 360 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function '_Z1gv' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1gv\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 8 registers\n"
    )
    got = nvrtc_check.parse_ptxas_log(log)
    assert got == {
        "_Z1kIfEvPKT_": nvrtc_check.KernelInfo(40, 8, 16, 24),
        "_Z1gv": nvrtc_check.KernelInfo(8, 0, 0, 0),
    }
