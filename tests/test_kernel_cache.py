"""The kernel families' CUBINs on disk (mtpkern/backends/cuda_launch/kernel_cache.py) and the
loader's use of them, without a GPU: NVRTC builds real entries (skipped where no toolkit is
installed), and a stand-in ``cupy`` module records what the loader asks CuPy to load."""

from __future__ import annotations

import json
import sys
import types

import pytest

from mtpkern import nvrtc_check
from mtpkern.backends.cuda_launch import kernel_cache, loader
from mtpkern.backends.cuda_launch.nvrtc import Nvrtc

TOOLKITS, _MISSING = nvrtc_check.find_toolkits()
needs_nvrtc = pytest.mark.skipif(not TOOLKITS, reason=f"no CUDA toolkit: {'; '.join(_MISSING.values())}")
MAJOR = max(TOOLKITS) if TOOLKITS else 13


def _inputs(family="norm"):
    return (family, loader.source(family), loader.compile_options(MAJOR) + loader.BINARY_OPTIONS,
            loader.NAME_EXPRESSIONS[family], "sm_90", TOOLKITS[MAJOR].nvrtc)


@needs_nvrtc
def test_an_entry_is_built_once_and_found_after(tmp_path):
    path, lowered, seconds = kernel_cache.build(*_inputs(), tmp_path)
    assert path.read_bytes()[:4] == b"\x7fELF" and seconds > 0
    assert set(lowered) == set(loader.NAME_EXPRESSIONS["norm"])
    assert all(v.startswith("_Z") for v in lowered.values())           # mangled names to look up
    again = kernel_cache.build(*_inputs(), tmp_path)
    assert again == (path, lowered, 0.0)                                # no second compile
    assert kernel_cache.find(*_inputs(), tmp_path) == (path, lowered)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["arch"] == "sm_90" and meta["family"] == "norm" and meta["nvrtc"].startswith(f"{MAJOR}.")


@needs_nvrtc
def test_the_key_covers_what_the_binary_depends_on(tmp_path):
    fam, src, opts, names, arch, lib = _inputs()
    base = kernel_cache.entry_key(src, opts, names, arch, "13.0")
    changed = [kernel_cache.entry_key(src + "\n// edited", opts, names, arch, "13.0"),
               kernel_cache.entry_key(src, opts + ("-DX=1",), names, arch, "13.0"),
               kernel_cache.entry_key(src, opts, names[:1], arch, "13.0"),
               kernel_cache.entry_key(src, opts, names, "sm_80", "13.0"),
               kernel_cache.entry_key(src, opts, names, arch, "13.1")]
    assert len({base, *changed}) == 6
    # the headers' digest is in the options: an edited .cuh is a new key
    assert any(o.startswith("-DMTPKERN_HEADERS=") for o in opts)


@needs_nvrtc
def test_a_partial_or_damaged_entry_is_a_miss_and_is_rebuilt(tmp_path):
    path, lowered, _ = kernel_cache.build(*_inputs(), tmp_path)
    path.unlink()                                                       # the CUBIN is written last
    assert kernel_cache.find(*_inputs(), tmp_path) is None
    _, _, seconds = kernel_cache.build(*_inputs(), tmp_path)
    assert seconds > 0 and path.is_file()
    path.with_suffix(".json").write_text("{not json")
    assert kernel_cache.find(*_inputs(), tmp_path) is None
    path.with_suffix(".json").write_text(json.dumps({"lowered": {"rmsnorm_kernel": "x"}}))    # names missing
    assert kernel_cache.find(*_inputs(), tmp_path) is None
    assert not list(tmp_path.glob("*.tmp"))


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "k"))
    assert kernel_cache.cache_dir() == tmp_path / "k"
    for off in ("off", "0", "OFF"):
        monkeypatch.setenv(kernel_cache.ENV, off)
        assert kernel_cache.cache_dir() is None
    monkeypatch.delenv(kernel_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert kernel_cache.cache_dir() == tmp_path / "x" / "mtpkern" / "kernels"


class _FakeCupy(types.ModuleType):
    """What the loader touches of CuPy: the NVRTC version, the device's compute capability and
    RawModule, which records how it was asked to load."""

    def __init__(self, major):
        super().__init__("cupy")
        self.loads = []
        fake = self

        class RawModule:
            def __init__(self, **kw):
                fake.loads.append(kw)
                self.kw = kw

            def get_function(self, name):
                return ("function", name, tuple(sorted(self.kw)))

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(nvrtc=types.SimpleNamespace(getVersion=lambda: (major, 0)),
                                          Device=lambda: types.SimpleNamespace(compute_capability="90"))


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path):
    cp = _FakeCupy(MAJOR)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "kernels"))
    loader._module.cache_clear()
    loader.get_kernel.cache_clear()
    loader._WARNED.clear()
    yield cp
    loader._module.cache_clear()
    loader.get_kernel.cache_clear()


@needs_nvrtc
def test_the_loader_builds_into_the_cache_then_loads_without_compiling(fake_cupy, monkeypatch, tmp_path):
    fn = loader.get_kernel("norm", "mtp_norms_kernel<float>")
    (load,) = fake_cupy.loads
    assert set(load) == {"path"} and load["path"].endswith(".cubin")
    meta = json.loads(open(load["path"][:-len(".cubin")] + ".json").read())
    assert fn == ("function", meta["lowered"]["mtp_norms_kernel<float>"], ("path",))
    # a new process: nothing compiles, the same file loads
    loader._module.cache_clear()
    loader.get_kernel.cache_clear()
    monkeypatch.setattr(Nvrtc, "compile", lambda *a, **k: pytest.fail("compiled although cached"))
    loader.get_kernel("norm", "rmsnorm_kernel")
    assert fake_cupy.loads[-1] == load


def test_with_the_cache_off_cupy_compiles_as_before(fake_cupy, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, "off")
    loader.get_kernel("gate", "sigmoid_gate_kernel<true>")
    (load,) = fake_cupy.loads
    assert load["name_expressions"] == loader.NAME_EXPRESSIONS["gate"] and "path" not in load
    assert load["code"] == loader.source("gate")


def test_a_cache_that_cannot_build_warns_once_and_cupy_compiles(fake_cupy, monkeypatch):
    monkeypatch.setattr(loader, "find_nvrtc", lambda major: None)
    with pytest.warns(RuntimeWarning, match=r"kernel cache .* not used for gate .*no libnvrtc"):
        loader.get_kernel("gate", "sigmoid_gate_kernel<false>")
    assert "code" in fake_cupy.loads[0]


@needs_nvrtc
def test_prebuild_builds_each_family_once(tmp_path):
    d = tmp_path / "k"
    first = loader.prebuild(["norm", "gate"], arch="sm_90", nvrtc_major=MAJOR, jobs=2, directory=d)
    assert set(first) == {"norm", "gate"} and all(s > 0 for s in first.values())
    assert len(list(d.glob("*.cubin"))) == 2
    assert loader.prebuild(["gate", "norm"], arch="sm_90", nvrtc_major=MAJOR, jobs=1, directory=d) == \
        {"gate": 0.0, "norm": 0.0}


def test_prebuild_refuses_what_it_cannot_do(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="family: expected one of"):
        loader.prebuild(["nope"], arch="sm_90", nvrtc_major=13, directory=tmp_path)
    monkeypatch.setenv(kernel_cache.ENV, "off")
    with pytest.raises(ValueError, match="the kernel cache is off"):
        loader.prebuild(["norm"], arch="sm_90", nvrtc_major=13)
    monkeypatch.setattr(loader, "find_nvrtc", lambda major: None)
    with pytest.raises(FileNotFoundError, match="no libnvrtc.so.11"):
        loader.prebuild(["norm"], arch="sm_90", nvrtc_major=11, directory=tmp_path)


def test_a_binary_that_does_not_load_falls_back_to_cupy(fake_cupy, monkeypatch, tmp_path):
    """CuPy loads a RawModule(path=) file at its first get_function: a CUBIN the driver refuses
    must fail inside the loader's fallback, not at a launcher's get_kernel."""
    calls = []
    monkeypatch.setattr(loader.kernel_cache, "build",
                        lambda *a, **k: (tmp_path / "x.cubin", {n: "_Zx" for n in loader.NAME_EXPRESSIONS["gate"]}, 0.0))
    real = fake_cupy.RawModule

    class Refusing(real):
        def get_function(self, name):
            if "path" in self.kw:
                calls.append(name)
                raise RuntimeError("CUDA_ERROR_INVALID_SOURCE")
            return super().get_function(name)

    fake_cupy.RawModule = Refusing
    with pytest.warns(RuntimeWarning, match="CUDA_ERROR_INVALID_SOURCE"):
        fn = loader.get_kernel("gate", "sigmoid_gate_kernel<true>")
    assert calls and fn[2] == ("code", "name_expressions", "options")


@needs_nvrtc
def test_the_kernels_command(tmp_path, monkeypatch, capsys):
    from mtpkern.cli import main

    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "k"))
    assert main(["kernels", "--arch", "sm_90", "--nvrtc", str(MAJOR), "--families", "gate,step", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "gate" in out and "step" in out and f"2 families in {tmp_path / 'k'}" in out
    assert main(["kernels", "--arch", "sm_90", "--nvrtc", str(MAJOR), "--families", "gate"]) == 0
    assert "cached" in capsys.readouterr().out
    assert main(["kernels", "--arch", "sm_90", "--nvrtc", str(MAJOR), "--families", "nope"]) == 2
    assert "family: expected one of" in capsys.readouterr().err
