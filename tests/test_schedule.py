"""Module schedules (``module_schedule=``, mtpkern.schedule): more drafts than modules.

A schedule's steps are modules to the proposer (the scheduled module's weights, a KV pool
of their own), so its exact mode must equal the dense oracle over the expanded chain, and
its draft mode the oracle's draft-mode rows, under random call sequences; a one-module
checkpoint drafts three tokens with "last"; the weights are held once; bad schedules are
refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from conftest import rand_hiddens
from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.schedule import expand, resolve
from mtpkern.testing import reference_weights
from mtpkern.testing.machine import proposer_machine


def test_resolve():
    assert resolve(None, 3, None) == [0, 1, 2] == resolve("clamp", 3, None)
    assert resolve("last", 1, 3) == [0, 0, 0] and resolve("last", 2, 4) == [0, 1, 1, 1]
    assert resolve("cycle", 2, 5) == [0, 1, 0, 1, 0]
    assert resolve([0, 2, 1, 1], 3, None) == [0, 2, 1, 1]
    for spec, k, match in [("last", None, "max_drafts: expected an int in \\[1, 64\\]"),
                           ("loop", 3, "module_schedule: expected None, 'clamp'"),
                           ([0, 3], None, "module_schedule\\[1\\]: expected a module index in \\[0, 3\\)"),
                           ([], None, "expected a list of 1 .. 64 module indices"),
                           ([0, 1], 2, "a list schedule has as many steps"),
                           (None, 4, "the clamp schedule drafts at most M = 3")]:
        with pytest.raises(ValueError, match=match):
            resolve(spec, 3, k)


@pytest.fixture(scope="module")
def one_module(tmp_path_factory):
    """A one-module checkpoint (as DeepSeek-V3, GLM-4.5, Qwen3-Next release theirs)."""
    cfg = tiny_config(num_nextn_predict_layers=1)
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("one"), cfg, seed=21, dtype="float32")
    return path, reference_weights(path)


@pytest.fixture(scope="module")
def two_modules(tmp_path_factory):
    cfg = tiny_config(num_nextn_predict_layers=2, blocks=[{}, {"num_attention_heads": 8}])
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("two"), cfg, seed=22, dtype="float32")
    return path, reference_weights(path)


def test_a_one_module_checkpoint_drafts_three_with_its_module_reused(one_module):
    path, _ = one_module
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", module_schedule="last", max_drafts=3,
                                              block_size=4, num_blocks=48)
    assert prop.num_modules == 3 and prop.module_schedule == [0, 0, 0]
    assert len({id(mw.eh_proj) for mw in prop.weights.modules}) == 1          # the weights once
    assert len({id(p.k) for p in prop.pools}) == 3                             # a pool per step
    rng = np.random.default_rng(0)
    st = prop.alloc_state()
    prop.prefill_drafter(rng.integers(0, 301, 8).tolist(), rand_hiddens(rng, 8, 64), st)
    assert len(prop.propose(5, rand_hiddens(rng, 1, 64)[0], 8, 3, st)) == 3 and prop.clamped_calls == 0
    one = MultiModuleMtpHead.from_pretrained(path, backend="numpy", block_size=4, num_blocks=48)
    mem_one, mem_three = one.memory(), prop.memory()
    assert mem_three.weights == mem_one.weights and mem_three.kv_pools == 3 * mem_one.kv_pools


def _expanded_weights(weights, schedule):
    return expand(weights.config, weights, schedule)[1]


@pytest.mark.parametrize("which,spec,k", [("one", "last", 3), ("two", "cycle", 4), ("two", [1, 0, 1], None)])
@pytest.mark.parametrize("backend,mode", [("numpy", "exact"), ("cpu", "draft"), ("cpu", "exact")])
def test_schedules_agree_with_the_oracle_of_their_steps(one_module, two_modules, which, spec, k, backend, mode):
    """The oracle over the expanded chain (one module per step, the scheduled weights) is
    the from-scratch recomputation the schedule's exact mode must equal, and its draft-mode
    rows the draft mode's."""
    path, weights = one_module if which == "one" else two_modules
    sched = resolve(spec, weights.config.num_modules, k)
    machine = proposer_machine(lambda: MultiModuleMtpHead.from_pretrained(
        path, backend=backend, kv_mode=mode, block_size=4, num_blocks=40, prefill_chunk=5, module_schedule=spec,
        max_drafts=k), _expanded_weights(weights, sched))
    machine.steps.clear()
    machine.TestCase.settings = settings(max_examples=8, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
    assert machine.steps["propose"] + machine.steps["propose_batch"] > 12, dict(machine.steps)


def test_the_clamp_schedule_is_the_default(two_modules):
    path, _ = two_modules
    a = MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    b = MultiModuleMtpHead.from_pretrained(path, backend="numpy", module_schedule="clamp")
    assert a.module_schedule == b.module_schedule == [0, 1] and a.config == b.config


@pytest.mark.parametrize("backend,mode,ckpt", [("cpu", "exact", "mla_ckpt"), ("cpu", "draft", "mla_ckpt"),
                                               ("numpy", "exact", "mla_ckpt"), ("cpu", "exact", "dsa_ckpt")])
def test_every_drafting_option_at_once_agrees_with_the_oracle(request, backend, mode, ckpt):
    """An MLA checkpoint (and one with DSA's indexer: each step picks keys from its own pool)
    with its modules cycled to four steps, a draft vocabulary of 150 tokens, and the machine's
    confidences and early stops: the oracle of the expanded chain over the same subset."""
    mla_ckpt = request.getfixturevalue(ckpt)
    weights = reference_weights(mla_ckpt)
    sched = resolve("cycle", weights.config.num_modules, 4)
    vocab = np.random.default_rng(9).permutation(301)[:150]
    machine = proposer_machine(lambda: MultiModuleMtpHead.from_pretrained(
        mla_ckpt, backend=backend, kv_mode=mode, block_size=4, num_blocks=48, prefill_chunk=5,
        module_schedule="cycle", max_drafts=4, draft_vocab=vocab), _expanded_weights(weights, sched))
    machine.steps.clear()
    machine.TestCase.settings = settings(max_examples=6, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
    assert machine.steps["propose"] + machine.steps["propose_batch"] > 10, dict(machine.steps)
