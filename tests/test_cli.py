"""The command line: demo (both KV modes, batch), info."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mtpkern", *args], check=True, capture_output=True, text=True,
                          env=env)


def test_demo_prints_figures(tmp_path, monkeypatch):
    import os

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    out = tmp_path / "demo.json"
    r = run("demo", "--backend", "numpy", "--config", "tiny", "--steps", "12", "--json", str(out), env=env)
    for needle in ("drafts/s", "propose latency", "acceptance/module", "KV blocks in use", "after free"):
        assert needle in r.stdout
    fig = json.loads(out.read_text())
    assert fig["kv_mode"] == "exact" and len(fig["acceptance_per_module"]) == 3 and fig["drafts_per_s"] > 0
    r = run("demo", "--backend", "numpy", "--config", "tiny", "--steps", "5", "--kv-mode", "draft", "--batch", "3",
            env=env)
    assert "batch 3" in r.stdout and "[0, 0, 0] blocks in use" in r.stdout


def test_info(tiny_ckpt):
    r = run("info", str(tiny_ckpt))
    assert "module 2: model.layers.4.*" in r.stdout and "target lm_head.weight: [301, 64] BF16" in r.stdout
