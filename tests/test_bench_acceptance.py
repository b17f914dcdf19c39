"""``mtpkern acceptance`` (mtpkern/bench_acceptance.py): the rows it reports, their figures
consistent with the verifier's decisions, every run lossless; a negative control (the
drafter's weights shuffled: acceptance falls to chance, the tokens stay the target's). Few
tokens on the numpy backend: structure only, speed is measured in benchmarks/."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np

from mtpkern import checkpoints
from mtpkern.cli import main

SMALL = ["acceptance", "--backend", "numpy", "--prompts", "2", "--max-new-tokens", "8"]


def _consistent(r: dict) -> None:
    off, acc, n = r["offered_at"], r["accepted_at"], r["verifies"]
    assert n >= 1 and all(0 <= a <= o <= n for a, o in zip(acc, off))
    assert r["acceptance_per_position"] == [round(a / o, 4) if o else 0.0 for a, o in zip(acc, off)]
    assert r["tokens_per_verify"] == round(1 + sum(acc) / n, 4)


def test_rows_and_figures(tmp_path, capsys):
    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    assert main(SMALL + ["--kv-modes", "exact", "--tree-widths", "2", "--min-confidence", "0.5",
                         "--json", str(out)] + plot) == 0
    assert png.is_file() == bool(plot)
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(r["kind"], r.get("k"), r.get("width")) for r in rows] == [
        ("chain", 1, None), ("chain", 2, None), ("chain", 3, None), ("tree", 3, 2), ("early_stop", 3, None),
        ("k_policy", 3, None), ("k_policy", 3, None), ("k_policy", 3, None)]
    assert res["prompts"] == 2 and res["max_new_tokens"] == 8 and res["chain"] == "postnorm"
    for r in rows:
        assert r["lossless"] is True and r["tokens_per_s"] > 0, r
        _consistent(r)
    for r in rows[:3]:                                       # a chain of k offers k drafts every verify
        assert r["offered_at"] == [r["verifies"]] * r["k"] and r["drafts_per_verify"] == r["k"]
    assert [(run["prior"], run["optimism"]) for run in res["k_policy"]["runs"]] == \
        [([1.0, 1.0], 0.0), ([1.0, 1.0], 1.0), ([4.0, 1.0], 0.0)]
    assert [n for n, _ in res["k_policy"]["catchup_s"]] == [1, 2, 3]
    assert sorted(res["k_policy"]["fixed_k_tokens_per_s"]) == ["0", "1", "2", "3"]
    assert any("batch 8 not run" in n for n in res["notes"]) and any("FP8 not run" in n for n in res["notes"])
    assert "chain k=3 exact" in text and "tree w=2 exact" in text and "early stop c=0.5" in text


def _shuffled_drafter(dst):
    """The shipped checkpoint with every MTP module tensor's values shuffled (target untouched)."""
    from safetensors.numpy import save_file

    from mtpkern.weights import read_tensors

    shutil.copytree(checkpoints.path(checkpoints.STDLIB_GLM_TINY), dst)
    tensors = read_tensors(dst)
    rng = np.random.default_rng(0)
    hit = 0
    for key, a in tensors.items():
        if key.startswith(("model.layers.4.", "model.layers.5.", "model.layers.6.")):
            tensors[key] = np.ascontiguousarray(a.reshape(-1)[rng.permutation(a.size)].reshape(a.shape))
            hit += 1
    assert hit > 30
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_shuffled_drafter_is_accepted_at_chance(tmp_path, capsys):
    """Negative control: the figures come from the verifier's decisions, not from the drafter."""
    args = SMALL + ["--kv-modes", "exact", "--tree-widths", "--min-confidence", "--no-policy", "--max-new-tokens",
                    "12"]
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    assert main(args + ["--json", str(good)]) == 0
    assert main(args + ["--ckpt", str(_shuffled_drafter(tmp_path / "shuffled")), "--json", str(bad)]) == 0
    capsys.readouterr()
    g, b = json.loads(good.read_text())["rows"], json.loads(bad.read_text())["rows"]
    assert [r["k"] for r in b] == [1, 2, 3] and all(r["lossless"] for r in b)
    for rg, rb in zip(g, b):
        _consistent(rb)
        assert rb["mean_accepted"] <= 0.2 < rg["mean_accepted"], (rg, rb)
