"""Checkpoints shipped inside the package, as package data (docs/trained.md).

``STDLIB_GLM_TINY`` is a tiny GLM-4.5-layout (``glm4_moe``) target with 3 MTP modules, trained
on the Python standard library's sources with a byte-level vocabulary (token id = byte value):
a model whose drafts mean something, for measuring acceptance. It is not a useful language model.

    from mtpkern import MultiModuleMtpHead, checkpoints
    ckpt = checkpoints.path(checkpoints.STDLIB_GLM_TINY)
    prop = MultiModuleMtpHead.from_pretrained(ckpt, kv_mode="exact",
                                              chain=checkpoints.training(checkpoints.STDLIB_GLM_TINY)["chain"])

Nothing here imports the rest of mtpkern: it only finds files.
"""

from __future__ import annotations

import json
from pathlib import Path

#: trained with scripts/train_tiny.py (docs/trained.md)
STDLIB_GLM_TINY = "stdlib-glm-tiny"

_HERE = Path(__file__).resolve().parent
_NAMES = (STDLIB_GLM_TINY,)


def names() -> tuple[str, ...]:
    """The shipped checkpoints' names."""
    return _NAMES


def path(name: str) -> Path:
    """The directory of shipped checkpoint ``name`` (``config.json``, ``model.safetensors``,
    ``training.json``), for ``MultiModuleMtpHead.from_pretrained``."""
    if not isinstance(name, str) or name not in _NAMES:
        raise ValueError(f"name: expected one of {list(_NAMES)}, got {name!r}")
    d = _HERE / name
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"checkpoint {name!r}: {d / 'model.safetensors'} is missing "
                                "(an install without the package data?)")
    return d


def prompts(name: str) -> list[str]:
    """Short excerpts of the held-out text of shipped checkpoint ``name`` (its ``prompts.json``:
    files its training never read), for prompting it in demos and benchmarks."""
    return [p["text"] for p in json.loads((path(name) / "prompts.json").read_text())["prompts"]]


def training(name: str) -> dict:
    """The training record of shipped checkpoint ``name`` (its ``training.json``): command, seed,
    data and held-out files, steps, wall time, losses per head, and ``chain``, the module chaining
    it was trained with (pass it to ``from_pretrained``)."""
    return json.loads((path(name) / "training.json").read_text())
