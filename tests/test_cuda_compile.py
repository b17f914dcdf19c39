"""Every CUDA kernel family compiles with NVRTC (no GPU needed) for sm_80 and
sm_90 under each CUDA toolkit (12 and 13: CI's and the GPU machine's), with the
loader's options and name expressions, without register spills, and with the
register counts recorded for that toolkit in kernels/registers.json (so a change
in register pressure shows up in review).

All families, both architectures and both toolkits compile once per session
(~80 s of CPU on two cores, the two toolkits side by side); a toolkit whose libnvrtc
or runtime headers are missing is skipped with what to install.
"""

from __future__ import annotations

import json

import pytest

from mtpkern import nvrtc_check
from mtpkern.backends.cuda_launch import loader

REFRESH = nvrtc_check.REFRESH
FOUND, MISSING = nvrtc_check.find_toolkits()
toolkit = pytest.mark.parametrize("major", nvrtc_check.TOOLKITS, ids=[f"cuda{m}" for m in nvrtc_check.TOOLKITS])


@pytest.fixture(scope="session")
def compiled_all() -> dict[int, tuple[str, dict[str, dict[str, nvrtc_check.KernelInfo]]]]:
    """{major: (NVRTC version, {arch: {name expression: KernelInfo}})} of every installed toolkit."""
    infos = nvrtc_check.check_all(nvrtc_check.ARCHS, toolkits=tuple(FOUND.values()))
    return {int(v.split(".")[0]): (v, t) for v, t in infos.items()}


@pytest.fixture
def compiled(request, major):
    if major in MISSING:
        pytest.skip(MISSING[major])
    return request.getfixturevalue("compiled_all")[major]


@toolkit
def test_every_instantiation_compiles(compiled, major):
    version, table = compiled
    want = {n for names in loader.NAME_EXPRESSIONS.values() for n in names}
    for arch in nvrtc_check.ARCHS:
        assert set(table[arch]) == want, f"NVRTC {version} {arch}: missing {sorted(want - set(table[arch]))}"


@toolkit
def test_no_register_spills(compiled, major):
    version, table = compiled
    spills = [
        f"{arch} {name}: {i.spill_stores} B stored, {i.spill_loads} B loaded"
        for arch, kernels in table.items()
        for name, i in kernels.items()
        if i.spill_stores or i.spill_loads
    ]
    assert not spills, f"kernels spill registers to local memory under NVRTC {version}:\n" + "\n".join(spills)


@toolkit
def test_registers_match_recorded(compiled, major):
    version, table = compiled
    recorded_file = json.loads(nvrtc_check.recorded_registers_path().read_text())
    found = nvrtc_check.recorded_table(major, recorded_file)
    assert found is not None, f"kernels/registers.json has no table for CUDA {major} (NVRTC {version}): {REFRESH}"
    recorded_version, recorded = found
    if recorded_version != version:
        pytest.skip(
            f"registers.json's CUDA {major} table was recorded with NVRTC {recorded_version}, this is "
            f"{version}: allocation may differ (setup.cfg's nvrtc extra pins the recorded one; {REFRESH} to re-record)"
        )
    now = nvrtc_check.registers_table({version: table})["toolkits"][version]
    diffs = [
        f"{arch} {name}: recorded {recorded.get(arch, {}).get(name)}, now {regs}"
        for arch, kernels in now.items()
        for name, regs in kernels.items()
        if recorded.get(arch, {}).get(name) != regs
    ]
    stale = [
        f"{arch} {name}: recorded but no longer compiled"
        for arch, kernels in recorded.items()
        for name in kernels
        if name not in now.get(arch, {})
    ]
    assert not diffs + stale, (
        f"register counts under NVRTC {version} differ from kernels/registers.json:\n" + "\n".join(diffs + stale)
        + f"\nIf the change is intended, refresh the file: {REFRESH}"
    )


def test_toolkits_pair_nvrtc_and_headers_of_one_major():
    """Each toolkit found compiles with headers of its own major (NVRTC 12 with CUDA 13's
    cuda_bf16.h, or the reverse, is not what either machine compiles)."""
    if not FOUND:
        pytest.skip("; ".join(MISSING.values()))
    for major, tk in FOUND.items():
        assert tk.nvrtc.endswith(f"libnvrtc.so.{major}")
        assert loader.cuda_headers_major(tk.include) == major, tk.include


def test_missing_toolkit_names_what_to_install(monkeypatch):
    monkeypatch.setattr(nvrtc_check, "find_nvrtc", lambda major: None)
    with pytest.raises(nvrtc_check.ToolkitMissing, match=r"libnvrtc\.so\.13.*pip install 'nvidia-cuda-nvrtc==13"):
        nvrtc_check.find_toolkit(13)
    with pytest.raises(ValueError, match="major: expected one of 12, 13, got 11"):
        nvrtc_check.find_toolkit(11)


def test_write_keeps_tables_of_toolkits_not_compiled():
    info = nvrtc_check.KernelInfo(40, 0, 0, 0)
    previous = {"toolkits": {"12.9": {"sm_90": {"k": 30}}, "13.0": {"sm_90": {"k": 31}}}}
    got = nvrtc_check.registers_table({"13.5": {"sm_90": {"k": info}}}, previous)
    assert got["toolkits"] == {"12.9": {"sm_90": {"k": 30}}, "13.5": {"sm_90": {"k": 40}}}
    assert nvrtc_check.recorded_table(13, got) == ("13.5", {"sm_90": {"k": 40}})
    assert nvrtc_check.recorded_table(11, got) is None
    # the one-toolkit layout of earlier files still reads, and its table is kept
    old = {"nvrtc": "12.9", "registers": {"sm_90": {"k": 30}}}
    assert nvrtc_check.recorded_table(12, old) == ("12.9", {"sm_90": {"k": 30}})
    assert nvrtc_check.registers_table({"13.5": {"sm_90": {"k": info}}}, old)["toolkits"] == {
        "12.9": {"sm_90": {"k": 30}}, "13.5": {"sm_90": {"k": 40}}}


def test_write_of_one_family_keeps_the_other_families_kernels():
    """--family moe --write: the compiled toolkit's table takes the moe kernels compiled now
    (a moe kernel no longer compiled is dropped) and keeps every other family's."""
    info = nvrtc_check.KernelInfo(40, 0, 0, 0)
    previous = {"toolkits": {"13.5": {"sm_90": {"linear_kernel<float, 1, false>": 30, "moe_combine_kernel": 20,
                                                "moe_expert_kernel<float, false, 1, false>": 70},
                                      "sm_80": {"linear_kernel<float, 1, false>": 33}}}}
    got = nvrtc_check.registers_table({"13.5": {"sm_90": {"moe_combine_kernel": info}}}, previous, ["moe"])
    assert got["toolkits"] == {"13.5": {"sm_80": {"linear_kernel<float, 1, false>": 33},
                                        "sm_90": {"linear_kernel<float, 1, false>": 30, "moe_combine_kernel": 40}}}
    whole = nvrtc_check.registers_table({"13.5": {"sm_90": {"moe_combine_kernel": info}}}, previous)
    assert whole["toolkits"] == {"13.5": {"sm_90": {"moe_combine_kernel": 40}}}   # every family: the table


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
