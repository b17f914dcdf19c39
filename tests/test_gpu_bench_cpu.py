"""The host side of benchmarks/gpu_bench.py, without a GPU: its shortcut to a long
context (``fake_context``) leaves a state the proposer accepts, eager and planned,
and its byte counts and report behave."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mtpkern import MultiModuleMtpHead
from mtpkern.cuda_graph import StepRunner

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_fake_context_is_a_valid_state(bench, tiny_ckpt, tiny_cfg, mode):
    prop = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=mode, block_size=16,
                                              num_blocks=64)
    prop.step_runner = StepRunner(prop, capture=False)
    rng = np.random.default_rng(0)
    sts = [prop.alloc_state() for _ in range(2)]
    for st in sts:
        bench.fake_context(prop, st, 100, rng)
    prop.check_invariants()
    pos = [100, 100]
    for k in (1, 2, 3):
        d = prop.propose_batch([1, 2], rng.standard_normal((2, 64)).astype(np.float32), pos, k, sts)
        assert [len(x) for x in d] == [k, k]
        for st in sts:
            prop.after_verify(0, st)
        pos = [p + 1 for p in pos]
        prop.check_invariants()
    assert prop.step_runner.counts["executed"] == 3          # every propose took the planned step


def test_floor_bytes_and_report(bench):
    cfg = bench.glm45_air()
    assert cfg.hidden_size == 4096 and cfg.vocab_size == 151552 and cfg.num_modules == 3
    b = [bench.propose_floor_bytes(cfg, "exact", k, 1, 512, 2) for k in (1, 2, 3)]
    assert b[0] < b[1] < b[2]
    # k = 1, batch 1: 3 modules' dense weights + one LM head (1.24 GB) at least
    assert b[0] > 151552 * 4096 * 2
    assert bench.propose_floor_bytes(cfg, "draft", 1, 8, 8192, 2) < bench.propose_floor_bytes(cfg, "exact", 1, 8, 8192, 2)
    res = {"device": "X", "config": "c", "copy_GB/s": 4000.0, "elapsed_s": 1.0,
           "kernels": [{"op": "rmsnorm", "rows": 1, "context": 0, "bytes": 1e6, "median_us": 2.0, "p20_us": 1.9,
                        "p80_us": 2.1, "GB/s": 500.0, "of_copy": 0.125, "timed": "graph"}],
           "propose": [{"kv_mode": "exact", "context": 512, "batch": 1, "k": 1, "eager_median_us": 900.0,
                        "graph_median_us": 450.0, "graph_speedup": 2.0, "floor_us": 300.0, "graph_x_floor": 1.5}]}
    text = bench.summary(res)
    assert "| rmsnorm | 1 |" in text and "2.00x" in text


def test_the_deepseek_v3_section_has_the_released_shapes(bench):
    cfg = bench.deepseek_v3()
    b = cfg.block(0)
    assert (cfg.hidden_size, b.num_attention_heads, b.kv_lora_rank, b.qk_rope_head_dim, b.q_lora_rank) == \
        (7168, 128, 512, 64, 1536)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size) == \
        (256, 8, 2048, 129280)
    assert b.mla and b.qk_nope_head_dim == 128 and b.v_dim == 128 and cfg.family == "deepseek_v3"
    text = bench.summary({"kernels": [], "mla_config": cfg.describe(), "mla_skipped": "time budget"})
    assert "DeepSeek-V3 rows (`dsv3 ...`)" in text and "mla_skipped: time budget" in text
