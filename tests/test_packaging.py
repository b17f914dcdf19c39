"""The built wheel carries kernels/ as package data, and an installed copy finds them."""

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


def test_installed_wheel_finds_its_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    code = ("import mtpkern.backends.cuda_launch.loader as l; d = l.kernel_dir(); "
            "print(d); print(len(l.source('attention')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         check=True, capture_output=True, text=True)
    kdir, nchars = res.stdout.split()
    assert Path(kdir).resolve().is_relative_to(target.resolve()), f"kernels found at {kdir}, not in the install"
    assert int(nchars) > 1000
