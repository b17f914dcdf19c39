"""The shipped trained checkpoint (``mtpkern.checkpoints.STDLIB_GLM_TINY``, docs/trained.md).

Without torch: it loads through ``mtpkern.checkpoints.path``, its record says what it was trained
on, and mtpkern's exact-mode drafts on the fixture's target hiddens
(``tests/data/stdlib-glm-tiny_expect.json``, written by ``scripts/train_tiny.py fixture``) are the
drafts the torch model computed, for a propose at every position of a held-out prompt. Negative
controls: the other chaining, and the target's norm applied a second time, draft differently.

With torch (optional, skipped without it): the training script's own model, loaded from the
same BF16 file, computes the target hiddens (after ``model.norm``) and the modules' chained
argmax on a longer held-out text, and mtpkern drafts the same tokens from those hiddens.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from mtpkern import MultiModuleMtpHead, checkpoints
from mtpkern.config import MtpConfig

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "stdlib-glm-tiny_expect.json"
NAME = checkpoints.STDLIB_GLM_TINY
#: a draft whose top-2 logits (torch float64) are closer than this may flip in FP32
NEAR_TIE = 1e-3
#: confidences: FP32 (ours) against float64 (torch), the same BF16 weights; observed 1e-7
CONF_TOL = 1e-5


@pytest.fixture(scope="module")
def expect() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def record() -> dict:
    return checkpoints.training(NAME)


def _proposer(chain: str, **kw):
    return MultiModuleMtpHead.from_pretrained(checkpoints.path(NAME), backend="numpy", kv_mode="exact",
                                              chain=chain, **kw)


def _drafts(prop, tokens: list[int], hiddens: np.ndarray, P: int) -> tuple[list[int], list[float]]:
    """An exact-mode propose at P after prefilling t_0..t_{P-1} with h_0..h_{P-1}: drafts, confidences."""
    st = prop.alloc_state()
    conf: list[float] = []
    try:
        prop.prefill_drafter(tokens[:P], hiddens[:P], st)
        drafts = prop.propose(tokens[P], hiddens[P - 1], P, prop.num_modules, st, out_conf=conf)
        return [int(d) for d in drafts], conf
    finally:
        prop.free_state(st)


def _compare(prop, expect: dict) -> tuple[list, float]:
    """(proposals whose drafts differ: (P, ours, torch's, margins); the largest confidence
    difference where they agree)."""
    h = np.asarray(expect["prompt_hiddens"], np.float32)
    bad, worst = [], 0.0
    for p in expect["proposals"]:
        got, conf = _drafts(prop, expect["prompt"], h, p["P"])
        if got != p["drafts"]:
            bad.append((p["P"], got, p["drafts"], p["margins"]))
        else:
            worst = max(worst, float(np.max(np.abs(np.asarray(conf) - p["confidences"]))))
    return bad, worst


def test_path_finds_the_package_data_and_refuses_other_names():
    d = checkpoints.path(NAME)
    assert {"config.json", "model.safetensors", "training.json"} <= {p.name for p in d.iterdir()}
    assert d.parent == Path(checkpoints.__file__).resolve().parent
    assert NAME in checkpoints.names()
    with pytest.raises(ValueError, match=r"name: expected one of \['stdlib-glm-tiny'\], got 'nope'"):
        checkpoints.path("nope")


def test_config_is_glm4_moe_with_three_moe_modules_and_bytes():
    cfg = MtpConfig.from_json(checkpoints.path(NAME) / "config.json")
    raw = json.loads((checkpoints.path(NAME) / "config.json").read_text())
    assert raw["model_type"] == "glm4_moe" and raw["architectures"] == ["Glm4MoeForCausalLM"]
    assert cfg.num_modules == 3 and cfg.vocab_size == 256          # byte-level: token id = byte value
    assert all(cfg.block(m).moe for m in range(3))
    assert cfg.block(0).rotary_dim == cfg.block(0).head_dim // 2     # GLM's partial RoPE


def test_record_names_its_data_and_losses(record, expect):
    assert not set(record["held_out_files"]) & set(record["train_files"])
    assert set(record["held_out_files"]) == set(expect["held_out_files"])
    heads = ["target", "module 0", "module 1", "module 2"]
    for key in ("loss_train", "loss_held_out"):
        assert list(record[key]) == heads
        # trained: far below a uniform guess over 256 bytes (ln 256 = 5.55 nats)
        assert all(0 < v < 3.0 for v in record[key].values()), record[key]
    assert record["chain"] in ("postnorm", "prenorm") and record["steps"] > 0
    assert record["parameters"] == record["target_parameters"] + record["mtp_parameters"]


def test_fixture_is_byte_level_text(expect):
    assert bytes(expect["prompt"]).decode("utf-8") == expect["prompt_text"]
    assert len(expect["greedy"]) == 64 and all(0 <= t < 256 for t in expect["greedy"])
    # the continuation is the target's own argmax, position by position
    n = len(expect["prompt"])
    assert expect["sequence_target_argmax"][n - 1:-1] == expect["greedy"]


def test_exact_drafts_equal_the_torch_models(expect, record):
    prop = _proposer(record["chain"])
    bad, worst = _compare(prop, expect)
    assert all(min(m) < NEAR_TIE for *_, m in bad), f"drafts differ (P, ours, torch's, margins): {bad}"
    assert len(bad) <= 1, bad
    assert worst < CONF_TOL, f"confidences differ by {worst:.3g}"
    # the drafts are not one repeated byte: the comparison can tell models apart
    assert len({tuple(p["drafts"]) for p in expect["proposals"]}) > 3


@pytest.mark.parametrize("wrong", ["chain", "apply_target_norm"])
def test_negative_controls_draft_differently(expect, record, wrong):
    if wrong == "chain":
        prop = _proposer("prenorm" if record["chain"] == "postnorm" else "postnorm")
    else:
        prop = _proposer(record["chain"], apply_target_norm=True)
    bad, worst = _compare(prop, expect)
    # a wrong wiring moves the drafts or at least their probabilities (shared_head.norm's weights
    # are the only difference between the chains once hnorm has normed the handed-on hidden)
    assert bad or worst > CONF_TOL, f"{wrong}: still equal (confidences within {worst:.3g})"


# ----------------------------------------------------------------------------- with torch (optional)

def _script():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_drafts_equal_torch_on_a_held_out_text(record):
    torch = pytest.importorskip("torch", reason="the torch check of the trained checkpoint needs torch "
                                                "(pip install torch; not a dependency of mtpkern)")
    pytest.importorskip("safetensors.torch")
    tt = _script()
    torch.set_num_threads(1)
    model = tt.load_checkpoint(checkpoints.path(NAME)).double()
    try:
        tokens = tt.held_out_prompt("heapq.py", "def heappush(heap, item):", 48)
    except (OSError, ValueError, SystemExit) as e:               # another Python's standard library
        pytest.skip(f"held-out text not found in this interpreter's standard library: {e}")
    with torch.no_grad():
        h = model.target(torch.tensor([tokens]))[0].float()      # FP32, after model.norm
    hd = h.double()
    prop = _proposer(record["chain"])
    hn = h[0].numpy()
    bad, distinct, worst = [], set(), 0.0
    for P in range(1, len(tokens) - 1):
        want, margins, confs = tt.chain_drafts(model, tokens[:P + 1], hd[:, :P])
        distinct.add(tuple(want))
        got, conf = _drafts(prop, tokens, hn, P)
        if got != want:
            bad.append((P, got, want, margins))
        else:
            worst = max(worst, float(np.max(np.abs(np.asarray(conf) - confs))))
    assert all(min(m) < NEAR_TIE for *_, m in bad) and len(bad) <= 2, bad
    assert worst < CONF_TOL, f"confidences differ by {worst:.3g}"
    assert len(distinct) > 5
