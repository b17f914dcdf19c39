"""The built wheel carries kernels/ and the trained checkpoint as package data, and an installed
copy finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the test extra installs setuptools and wheel, so no network is needed.
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (whl,) = out.glob("mtpkern-*.whl")
    return whl


def test_wheel_contains_every_kernel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    assert len(sources) >= 8
    for s in sources:
        assert f"mtpkern/kernels/{s}" in names, f"{s} missing from the wheel"
    assert "mtpkern/kernels/registers.json" in names
    assert "mtpkern/py.typed" in names                   # type checkers read the annotations (PEP 561)


def test_wheel_contains_every_subpackage(wheel):
    """Every directory of mtpkern/ with an __init__.py is listed in setup.cfg's packages and shipped."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for init in sorted((ROOT / "mtpkern").rglob("__init__.py")):
        rel = init.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} missing from the wheel (setup.cfg's packages)"
    assert "mtpkern/integrations/hf.py" in names and "mtpkern/integrations/_hf_torch.py" in names


def test_wheel_contains_the_trained_checkpoint(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    ckpt = ROOT / "mtpkern" / "checkpoints" / "stdlib-glm-tiny"
    files = sorted(p.name for p in ckpt.iterdir())
    assert {"config.json", "model.safetensors", "training.json", "prompts.json", "byte_counts.json",
            "README.md"} <= set(files)
    for f in files:
        assert f"mtpkern/checkpoints/stdlib-glm-tiny/{f}" in names, f"{f} missing from the wheel"


def _run_installed(wheel, tmp_path, code: str):
    """The wheel installed under ``tmp_path / "site"`` alone, then ``code`` run there: (the
    install directory, the finished process)."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    return target, subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                                  check=True, capture_output=True, text=True)


def test_installed_wheel_finds_its_checkpoint(wheel, tmp_path):
    code = ("from mtpkern import checkpoints as c; p = c.path(c.STDLIB_GLM_TINY); "
            "print(p); print((p / 'model.safetensors').stat().st_size)")
    target, res = _run_installed(wheel, tmp_path, code)
    where, size = res.stdout.split()
    assert Path(where).resolve().is_relative_to(target.resolve()), f"checkpoint found at {where}, not in the install"
    assert int(size) == (ROOT / "mtpkern" / "checkpoints" / "stdlib-glm-tiny" / "model.safetensors").stat().st_size


def test_installed_wheel_finds_its_kernels(wheel, tmp_path):
    code = ("import mtpkern.backends.cuda_launch.loader as l; d = l.kernel_dir(); "
            "print(d); print(len(l.source('attention')))")
    target, res = _run_installed(wheel, tmp_path, code)
    kdir, nchars = res.stdout.split()
    assert Path(kdir).resolve().is_relative_to(target.resolve()), f"kernels found at {kdir}, not in the install"
    assert int(nchars) > 1000


def test_cpu_backend_in_a_read_only_install(wheel, tmp_path):
    """An install nobody may write to (a system site-packages, a read-only image) still
    runs the cpu backend, and its compiled kernels are cached, in Numba's per-user cache
    directory. The install is made read-only by a read-only bind mount in a private mount
    namespace (root ignores file modes); skipped where that is not permitted."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    target, home = tmp_path / "site", tmp_path / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    probe = subprocess.run([unshare, "-m", "sh", "-c", f'mount --bind -o ro "{target}" "{target}"'],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"read-only bind mounts not permitted here: {probe.stderr.strip()}")
    code = "\n".join([
        "import os, numpy as np, mtpkern",
        "from mtpkern.backends import get_backend",
        "be = get_backend('cpu')",
        "x = np.arange(12, dtype=np.float32).reshape(2, 6) - 5",
        "y = be.rmsnorm(x, be.prepare_vector(np.full(6, 2, np.float32)), 1e-6)",
        "np.testing.assert_allclose(y, 2 * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6), rtol=1e-5)",
        "try:",
        "    open(os.path.join(os.path.dirname(mtpkern.__file__), 'probe'), 'w')",
        "    print('writable')",
        "except OSError:",
        "    print('read-only')",
    ])
    env = {"PYTHONPATH": str(target), "HOME": str(home), "PATH": "/usr/bin:/bin"}
    script = f'mount --bind -o ro "{target}" "{target}" && exec "{sys.executable}" -c "$0"'
    for run in ("compiles and writes the cache", "loads the cache"):
        res = subprocess.run([unshare, "-m", "sh", "-c", script, code], env=env, cwd=tmp_path,
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{run}: {res.stderr[-2000:]}"
        assert res.stdout.split() == ["read-only"], res.stdout
    assert not list(target.rglob("*.nbi")), "an index was written into the install"
    assert list(home.rglob("*rmsnorm*.nbi")), f"no cached rmsnorm kernel under {home}"
