"""``mtpkern acceptance`` (mtpkern/bench_acceptance.py): the rows it reports (chains, trees, early
stop, module schedules, draft vocabularies, FP8, no catch-up, the K policy at batch 1 and 2), their figures
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
    assert main(SMALL + ["--kv-modes", "exact,draft", "--tree-widths", "2", "--min-confidence", "0.5",
                         "--draft-vocabs", "32", "128", "--batch", "2", "--json", str(out)] + plot) == 0
    assert png.is_file() == bool(plot)
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = res["rows"]
    chains = [("chain", 1, None), ("chain", 2, None), ("chain", 3, None), ("tree", 3, 2)]
    assert [(r["kind"], r.get("k"), r.get("width")) for r in rows] == chains + chains + [
        ("early_stop", 3, None), ("schedule", 4, None), ("schedule", 5, None), ("schedule", 4, None),
        ("schedule", 5, None), ("draft_vocab", 3, None), ("draft_vocab", 3, None), ("fp8", 3, None),
        ("no_catchup", 3, None), ("k_policy", 3, None), ("k_policy", 3, None), ("k_policy", 3, None),
        ("batch_chain", 1, None), ("batch_chain", 2, None), ("batch_chain", 3, None),
        ("batch_k_policy", 3, None), ("batch_k_policy", 3, None), ("batch_k_policy", 3, None)]
    assert res["prompts"] == 2 and res["max_new_tokens"] == 8 and res["chain"] == "postnorm"
    for r in rows:
        assert r["lossless"] is True and r["tokens_per_s"] > 0, r
        _consistent(r)
    fixed_k = [r for r in rows if r["kind"] in ("chain", "schedule", "draft_vocab", "fp8", "no_catchup", "batch_chain")]
    for r in fixed_k:                                        # a chain of k offers k drafts every verify
        assert r["offered_at"] == [r["verifies"]] * r["k"] and r["drafts_per_verify"] == r["k"], r
    by = {(r["kind"], r.get("schedule"), r.get("vocab"), r.get("k"), r["kv_mode"]): r for r in rows}
    # module schedules: step s runs module schedule[s]'s weights
    assert by["schedule", "last", None, 5, "exact"]["modules"] == [0, 1, 2, 2, 2]
    assert by["schedule", "cycle", None, 5, "exact"]["modules"] == [0, 1, 2, 0, 1]
    assert {r["vocab"] for r in rows if r["kind"] == "draft_vocab"} == {32, 128}
    # batch rows: B sequences of max_new tokens each; one verify per live sequence a step
    batch = [r for r in rows if r["kind"].startswith("batch")]
    assert all(r["batch"] == 2 for r in batch)
    for r in batch[:3]:                                      # fixed K: the same decisions as two batch-1 runs
        one = by["chain", None, None, r["k"], "exact"]
        assert (r["offered_at"], r["accepted_at"]) == (one["offered_at"], one["accepted_at"])
    bp = res["batched"]
    assert bp["batch"] == 2 and [n for n, _ in bp["catchup_s"]] == [1, 2, 3]
    assert [k for k, _ in bp["propose_s"]] == [1, 2, 3] and [n for n, _ in bp["verify_s"]] == [1, 2, 3, 4]
    assert sorted(bp["fixed_k_tokens_per_s"]) == ["0", "1", "2", "3"]
    for run, r in zip(bp["runs"], batch[3:]):              # the policy's K each step: one per batch step
        steps = sum(run["chosen_k_counts"].values())
        assert r["verifies"] / 2 <= steps <= r["verifies"] and run["tokens_per_s"] == r["tokens_per_s"]
        offered = sum(int(k) * n for k, n in run["chosen_k_counts"].items())
        assert offered <= r["drafts_per_verify"] * r["verifies"] + 1e-6 <= 2 * offered + 1e-3
    assert [(run["prior"], run["optimism"]) for run in res["k_policy"]["runs"]] == \
        [([1.0, 1.0], 0.0), ([1.0, 1.0], 1.0), ([4.0, 1.0], 0.0)]
    assert [n for n, _ in res["k_policy"]["catchup_s"]] == [1, 2, 3]
    assert sorted(res["k_policy"]["fixed_k_tokens_per_s"]) == ["0", "1", "2", "3"]
    assert any("verified in turn" in n for n in res["notes"]) and not any("not run" in n for n in res["notes"])
    assert "chain k=3 exact" in text and "tree w=2 exact" in text and "early stop c=0.5" in text
    assert "chain k=5 cycle" in text and "chain k=3 vocab 32" in text and "chain k=3 FP8" in text
    assert "chain k=3 draft, no catch-up" in text and "K policy at batch 2" in text


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
                    "12", "--draft-vocabs", "64"]
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    assert main(args + ["--json", str(good)]) == 0
    assert main(args + ["--ckpt", str(_shuffled_drafter(tmp_path / "shuffled")), "--json", str(bad)]) == 0
    capsys.readouterr()
    g, b = json.loads(good.read_text())["rows"], json.loads(bad.read_text())["rows"]
    assert [(r["kind"], r["k"]) for r in b] == [("chain", 1), ("chain", 2), ("chain", 3), ("schedule", 4),
                                                ("schedule", 5), ("schedule", 4), ("schedule", 5),
                                                ("draft_vocab", 3), ("fp8", 3)]
    assert all(r["lossless"] for r in b)
    for rg, rb in zip(g, b):
        _consistent(rb)
        assert rb["mean_accepted"] <= 0.2 < rg["mean_accepted"], (rg, rb)
