"""Hypothesis drives one proposer with many sequences through random call orders.

The machine is mtpkern.testing's (the kit engines use): every rule is a Driver
step run through the checked proposer, so after every call the pools'
accounting, the registries, every state's rules, the rows each module must hold
(docs/semantics.md's draft-mode rule in draft mode, the exact-mode rule otherwise) and, in exact mode,
the drafts against the from-scratch oracle are checked; a failed call (full
pool, bad input, a copied state or carried entry, a grammar that allows nothing,
a callback re-entering with the state in use) must leave everything as it was.

An eleventh is a compressed-tensors container whose routed experts are NVFP4 (E2M1 codes,
E4M3 scales per 16, the row scale; mtpkern.quant.Fp4Weight): the oracle reads the weights as
loaded (dequantized), so the machine checks the packed GEMVs' drafts against them. A tenth is
Nemotron-3's (``nemotron_h``: the MTP step's "*E" sublayers in the release layout, NoPE
attention, relu2 experts and shared expert, the postnorm chain), with and without LatentMoE
(``moe_latent_size``: numpy / cpu only). A ninth is Qwen3.5-MoE's (two modules, experts packed as
gate_up_proj / down_proj, the release's names under its vision-language wrapper). An eighth is GLM-5.3's block (NoPE MLA, the pooled indexer: pools of 2 keys, 4 keys picked, and
its tail; the position-0 mask). A seventh is DeepSeek-V4's (4 streams, the shared-KV attention
with sinks and a window of 6, grouped output, the sqrtsoftplus router, clamps).
A sixth has vLLM's position-0 mask (``embed_mask_pos0``: each prompt's module-0 key 0 reads
no embedding; exact mode checks its drafts against the oracle, which masks by its own code).
A fifth has hyper-connections (4 streams of H per hidden). A fourth config is MLA with DSA's indexer (4 keys picked per row: sparse from the fifth
key on). A third config has a sliding window in every module, in a pool that sequences
holding all their rows would outgrow: after every step each windowed module of every
state and carried entry holds at most ``ceil((W + T + BS - 2) / BS)`` blocks.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

import test_family_deepseek_v4
import test_family_glm5_next
import test_family_nemotron_h
import test_family_qwen3_5
import test_family_qwen3_next
from conftest import DSA_FIELDS
from mtpkern import MultiModuleMtpHead, ReferenceTarget
from mtpkern.config import tiny_config
from mtpkern.cuda_graph import StepRunner
from mtpkern.testing import reference_weights
from mtpkern.testing.machine import proposer_machine
from mtpkern.weights import write_synthetic_checkpoint
from test_quant_containers import container
from test_testing_kit_target import target_checkpoints

CFG = tiny_config()
#: a second block form: Qwen3-Next (gated attention output, gated shared expert, softmax
#: routing without a bias, zero-centred norms, the postnorm chain), two modules
QWEN = test_family_qwen3_next.QWEN2
#: every module with a window of 5 keys (blocks of 4: 2 or 3 blocks per sequence)
WINDOW = tiny_config(sliding_window=5)
DSA = tiny_config(**DSA_FIELDS)
#: hyper-connections: 4 streams of H per hidden (DeepSeek-V4's mHC)
HC = tiny_config(hc_mult=4)
#: vLLM's position-0 mask: every prompt's module-0 key 0 reads no embedding (embed_mask_pos0)
MASK = tiny_config(embed_mask_pos0=True)
#: DeepSeek-V4's and GLM-5.3's blocks as their families read them
V4 = tiny_config(**test_family_deepseek_v4.V4)
G53 = tiny_config(**test_family_glm5_next.G53)
POOL = {"sm_ckpt": 28, "qwen_ckpt": 28, "window_ckpt": 16, "dsa_ckpt": 28, "hc_ckpt": 28, "mask_ckpt": 28,
        "v4_ckpt": 28, "g53_ckpt": 28, "qwen35_ckpt": 28, "nemo_ckpt": 28, "nemo_latent_ckpt": 28,
        "nvfp4_ckpt": 28}
SETTINGS = settings(max_examples=60, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def sm_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_ckpt"), CFG, seed=21)
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    path = test_family_qwen3_next._ckpt(tmp_path_factory.mktemp("sm_qwen"), QWEN, seed=22)
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def window_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_window"), WINDOW, seed=23)
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def dsa_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_dsa"), DSA, seed=24)
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def hc_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_hc"), HC, seed=25)
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def mask_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_mask"), MASK, seed=26)
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_v4"), V4, seed=27, dtype="float32")
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def g53_ckpt(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("sm_g53"), G53, seed=28, dtype="float32")
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def qwen35_ckpt(tmp_path_factory):
    path = test_family_qwen3_5._ckpt(tmp_path_factory.mktemp("sm_qwen35"), test_family_qwen3_5.MOE2, packed=True,
                                     seed=29)
    return path, reference_weights(path)


def _nemotron(tmp_path_factory, name: str, seed: int):
    """Nemotron-3's tiny block (tests/test_family_nemotron_h.py) in the release layout and config."""
    import json

    cfg = test_family_nemotron_h.CONFIGS[name]
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp(f"sm_nemo_{name}"), cfg, seed=seed, dtype="float32")
    (path / "config.json").write_text(json.dumps(test_family_nemotron_h.release_config(cfg)))
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def nemo_ckpt(tmp_path_factory):
    return _nemotron(tmp_path_factory, "plain", 30)


@pytest.fixture(scope="module")
def nemo_latent_ckpt(tmp_path_factory):
    return _nemotron(tmp_path_factory, "latent", 31)


@pytest.fixture(scope="module")
def nvfp4_ckpt(tmp_path_factory):
    """The tiny config with its routed experts NVFP4 in a compressed-tensors container."""
    path, _ = container(tmp_path_factory.mktemp("sm_nvfp4"), CFG, {"mlp.experts": "nvfp4"})
    return path, reference_weights(path)


def window_bound(prop, m: int) -> int | None:
    """docs/api.md, "Sliding-window modules: memory": T = m (exact) or min(m, 1) (draft)."""
    W, BS = prop.config.block(m).sliding_window, prop.block_size
    T = m if prop.kv_mode == "exact" else min(m, 1)
    return -(-(W + T + BS - 2) // BS) if W else None


@pytest.mark.parametrize("backend,kv_mode,ckpt", [
    (b, m, "sm_ckpt") for b in ("numpy", "cpu") for m in ("exact", "draft")] + [
    ("cpu", "exact", "qwen_ckpt"), ("numpy", "draft", "qwen_ckpt"),
    ("cpu", "exact", "window_ckpt"), ("cpu", "draft", "window_ckpt"),
    ("numpy", "exact", "dsa_ckpt"), ("cpu", "draft", "dsa_ckpt"),
    ("numpy", "draft", "hc_ckpt"), ("cpu", "exact", "hc_ckpt"),
    ("numpy", "exact", "mask_ckpt"), ("cpu", "draft", "mask_ckpt"),
    ("cpu", "exact", "v4_ckpt"), ("cpu", "draft", "v4_ckpt"), ("cpu", "exact", "g53_ckpt"),
    ("cpu", "exact", "qwen35_ckpt"),
    ("cpu", "exact", "nemo_ckpt"), ("cpu", "draft", "nemo_ckpt"),
    ("cpu", "exact", "nemo_latent_ckpt"), ("cpu", "draft", "nemo_latent_ckpt"),
    ("cpu", "exact", "nvfp4_ckpt"),
    # an FP8 KV cache (docs/kv_pool.md): the pools' scale planes through every call; no FP32 oracle
    # (its drafts may differ where the two best logits are within the quantization's bound)
    ("cpu-fp8", "exact", "sm_ckpt"), ("numpy-fp8", "draft", "window_ckpt"),
    # the planned step (mtpkern.cuda_graph, mtpkern.tree_plan) run eagerly, as the cuda backend's
    # proposer takes it: chain proposes and static trees without a mask through it, the rest eagerly
    ("numpy-planned", "exact", "sm_ckpt"), ("numpy-planned", "draft", "sm_ckpt")])
def test_proposer_state_machine(kv_mode, backend, ckpt, request):
    path, weights = request.getfixturevalue(ckpt)
    made = []
    if backend.endswith("-fp8"):
        from mtpkern.backends.cpu import CpuBackend
        from mtpkern.backends.numpy_backend import NumpyBackend

        be = CpuBackend(kv_dtype="fp8") if backend == "cpu-fp8" else NumpyBackend("fp8")
        weights = None
    else:
        be = backend.removesuffix("-planned")

    def make():
        made.append(MultiModuleMtpHead.from_pretrained(path, backend=be, kv_mode=kv_mode, block_size=4,
                                                       num_blocks=POOL[ckpt], prefill_chunk=5))
        if backend.endswith("-planned"):
            made[-1].step_runner = StepRunner(made[-1], capture=False)
        return made[-1]

    base = proposer_machine(make, weights)

    class Machine(base):
        @invariant()
        def windows_bound_the_blocks(self) -> None:
            prop = self.driver.prop
            held = [st.kv for st, _ in self.driver.model.seqs.values()] + [kv.seqs for kv in self.driver.carried]
            for seqs in held:
                for m, q in enumerate(seqs):
                    most = window_bound(prop, m)
                    assert most is None or len(q.blocks) <= most, (
                        f"module {m}: {len(q.blocks)} blocks for {q.rows} rows, expected at most {most}")

    machine = Machine
    machine.steps = Counter()
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
    total = sum(machine.steps.values())
    print(f"{kv_mode}/{backend}: {total} proposer calls: {dict(machine.steps)}")
    assert total >= 1000, f"only {total} proposer calls in {kv_mode} mode: {dict(machine.steps)}"
    for kind in ("propose", "propose_batch", "verify", "catchup", "take", "install", "bad_input", "reenter", "fork",
                 "share", "sampled"):
        assert machine.steps[kind] > 0, f"no {kind} step ran: {dict(machine.steps)}"
    if backend.endswith("-planned"):  # both planned steps ran, beside their eager fallbacks
        ran = Counter()
        for prop in made:
            ran.update(prop.step_runner.counts)
        assert ran["executed"] > 0 and ran["tree_executed"] > 0 and ran["tree_fallback_mask"] > 0, dict(ran)
        assert ran["early_stop"] > 0, dict(ran)      # proposes with min_confidence took the planned step
        print(f"planned: {dict(ran)}")
    if ckpt == "window_ckpt":       # the pools really took blocks back (beyond what trims freed)
        assert sum(p.window_released for prop in made for p in prop.pools) > 100


# -- a real target: every hidden and verified token the target's, checked by the kit ----------

@pytest.fixture(scope="module")
def target_ckpts(tmp_path_factory):
    return target_checkpoints(tmp_path_factory)


def _target_machine(path, kv_mode, target):
    def make():
        return MultiModuleMtpHead.from_pretrained(path, backend="numpy", kv_mode=kv_mode, block_size=4, num_blocks=28,
                                                  prefill_chunk=5)
    machine = proposer_machine(make, reference_weights(path), target=target)
    machine.steps, machine.accepted = Counter(), 0
    return machine


@pytest.mark.parametrize("kv_mode,kind", [("exact", "agree"), ("draft", "agree"), ("draft", "plain")])
def test_state_machine_with_a_real_target(kv_mode, kind, target_ckpts):
    """The Driver's steps with the target's hiddens and tokens (tests/test_testing_kit_target.py's
    checkpoints: ``agree`` accepts every unmasked draft, ``plain`` next to none), under
    ``checked(..., target=)``: no false alarm over every kind of call, carries, forks, shared
    prefixes, trees and batches included; the kit's target sequences are freed with their states."""
    path = target_ckpts[kind]
    target = ReferenceTarget.from_pretrained(path, backend="numpy", block_size=4, num_blocks=1024)
    machine = _target_machine(path, kv_mode, target)
    machine.TestCase.settings = settings(SETTINGS, max_examples=40, stateful_step_count=40)
    machine.TestCase().runTest()
    total = sum(machine.steps.values())
    print(f"{kv_mode}/{kind}: {total} proposer calls, {machine.accepted} drafts accepted: {dict(machine.steps)}")
    assert total >= 500, f"only {total} proposer calls: {dict(machine.steps)}"
    for kind_ in ("propose", "propose_batch", "verify", "catchup", "take", "install", "fork", "share", "tree"):
        assert machine.steps[kind_] > 0, f"no {kind_} step ran: {dict(machine.steps)}"
    if kind == "agree":
        assert machine.accepted > 0, "no draft accepted: the agree checkpoint did not exercise acceptance"
    assert target.kv_blocks_in_use() == [0] * len(target.layers)


def test_the_target_machine_catches_a_stale_hidden(target_ckpts, monkeypatch):
    """The negative control: the same machine whose proposes hand in the hidden one position
    back (the last step's) fails the kit's target check."""
    from hypothesis import Phase

    from mtpkern.testing.driver import Driver

    real = Driver._head

    def stale(self, st, s, rng):
        tok, h, P = real(self, st, s, rng)
        line = self.truth.lines[id(st)]
        return tok, (line.hiddens[P - 2] if P >= 2 else h), P

    monkeypatch.setattr(Driver, "_head", stale)
    path = target_ckpts["agree"]
    machine = _target_machine(path, "draft", ReferenceTarget.from_pretrained(path, backend="numpy", block_size=4,
                                                                             num_blocks=1024))
    machine.TestCase.settings = settings(SETTINGS, max_examples=20, stateful_step_count=30,
                                         phases=[Phase.generate], print_blob=False)
    with pytest.raises(AssertionError, match=r"target_hidden(\[\d+\])? \(position \d+\) is not the target's h_\d+"):
        machine.TestCase().runTest()
