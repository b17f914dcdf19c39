"""mtpkern.integrations stays optional: ``import mtpkern`` imports neither it nor torch, and
calling the Hugging Face adapter without torch raises the ImportError naming the ``hf`` extra.
Runs with or without torch (torch is hidden from a child interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtpkern.integrations import hf


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)


def test_import_mtpkern_imports_no_integration_and_no_torch():
    r = _python("import sys, mtpkern\n"
                "print(sorted(m for m in sys.modules if m.startswith('mtpkern.integrations') "
                "or m.split('.')[0] in ('torch', 'transformers')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


#: a child interpreter in which torch cannot be imported (None in sys.modules: ImportError)
NO_TORCH = "import sys\nsys.modules['torch'] = None\nfrom mtpkern.integrations import hf\n"


@pytest.mark.parametrize("call", ["hf.generate(None, None, None)", "hf.candidate_generator(None)"])
def test_the_adapter_without_torch_names_the_extra(call):
    r = _python(NO_TORCH + f"try:\n    {call}\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.startswith("ImportError: mtpkern.integrations.hf needs torch and transformers (torch is missing)")
    assert "pip install 'mtpkern[hf]'" in out and "pip install -e '.[hf]'" in out


def test_importing_the_adapter_module_imports_no_torch():
    r = _python(NO_TORCH + "print(hf.INSTALL_HINT)")
    assert r.returncode == 0, r.stderr and "mtpkern[hf]" in r.stdout


def test_an_old_transformers_is_named(monkeypatch):
    """transformers without MTP generation (< 5.24) is refused with the version found."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    monkeypatch.setattr(transformers, "__version__", "5.23.1")
    with pytest.raises(ImportError, match=r"needs transformers >= 5.24 \(MTP generation\), found 5.23.1"):
        hf.require_hf()
