"""The cpu backend's warm-up compiles only what a loaded checkpoint runs (``KernelNeeds``),
and the command line says "compiling kernels" only when a kernel compiles."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mtpkern import write_synthetic_checkpoint
from mtpkern.backends.base import Backend
from mtpkern.backends.numpy_backend import NumpyBackend
from mtpkern.backends.warm_up import FAMILIES, KernelNeeds, family_calls, weight_kind
from mtpkern.config import tiny_config
from mtpkern.progress import WarmUpReport, warm_up
from mtpkern.quant import Fp4Weight, Fp8Weight

GQA = {"qk_norm_rope_kv_write", "paged_attention"}


def dense_config():
    """tiny's shapes with a dense SwiGLU MLP in place of the experts."""
    return tiny_config(n_routed_experts=0, num_experts_per_tok=0, n_shared_experts=0, n_group=1, topk_group=1,
                       intermediate_size=48)


def _load(path, backend="cpu"):
    from mtpkern import MultiModuleMtpHead

    return MultiModuleMtpHead.from_pretrained(path, backend=backend)


def test_needs_of_a_dense_bf16_checkpoint(tmp_path):
    prop = _load(write_synthetic_checkpoint(tmp_path / "d", dense_config(), dtype="bfloat16"))
    assert KernelNeeds.of(prop) == KernelNeeds({
        "rmsnorm": (), "qk_norm_rope_kv_write": (), "paged_attention": (), "linear": ["bfloat16"],
        "mtp_input": [("bfloat16", "bfloat16")], "swiglu_mlp": ["bfloat16"], "lm_head": ["bfloat16"]})


def test_needs_of_an_moe_fp32_checkpoint(tmp_path, tiny_cfg):
    prop = _load(write_synthetic_checkpoint(tmp_path / "m", tiny_cfg, dtype="float32"))
    needs = KernelNeeds.of(prop)
    assert set(needs.kinds) == {"rmsnorm", "linear", "mtp_input", "moe_router", "moe_experts", "swiglu_mlp",
                                "lm_head"} | GQA
    assert needs.kinds["mtp_input"] == {("float32", "float32")}
    assert all(k == {"float32"} for f, k in needs.kinds.items() if f not in GQA | {"rmsnorm", "mtp_input"})


class Recording(NumpyBackend):
    """The numpy backend, recording each op ``family_calls`` runs and the kind of each weight
    it is given to prepare (the numpy backend widens them all to FP32)."""

    def __init__(self):
        super().__init__()
        self.ops, self.prepared = set(), set()

    def prepare_weight(self, w):
        self.prepared.add("fp8" if isinstance(w, Fp8Weight) else "fp4" if isinstance(w, Fp4Weight)
                          else np.asarray(w).dtype.name)
        return super().prepare_weight(w)

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if callable(attr) and name in Backend.__abstractmethods__ and not name.startswith(("prepare", "empty")):
            super().__getattribute__("ops").add(name)
        return attr


def test_a_dense_bf16_warm_up_runs_no_moe_mla_gate_fp8_or_fp32_weight(tmp_path):
    prop = _load(write_synthetic_checkpoint(tmp_path / "d", dense_config(), dtype="bfloat16"))
    be = Recording()
    calls = family_calls(be, needs=KernelNeeds.of(prop))
    assert [name for name, _ in calls] == [f for f in FAMILIES if f in KernelNeeds.of(prop)]
    for _, call in calls:
        call()
    assert be.prepared == {"bfloat16"}
    assert not be.ops & {"moe_router", "moe_experts", "mla_latent_write", "mla_attention_absorbed", "sigmoid_gate"}
    assert {"mtp_input", "linear", "swiglu_mlp", "paged_attention", "lm_head_argmax"} <= be.ops
    every = Recording()
    for _, call in family_calls(every):          # the default: every family and weight kind, as before
        call()
    assert every.prepared == {"bfloat16", "float32", "fp8", "fp4"} and every.ops > be.ops


def test_needs_refuse_what_they_do_not_know():
    with pytest.raises(ValueError, match="families among"):
        KernelNeeds({"moe": ["bfloat16"]})
    with pytest.raises(ValueError, match=r"needs\['linear'\]: expected kinds among"):
        KernelNeeds({"linear": ["bf16"]})
    with pytest.raises(ValueError, match=r"needs\['mtp_input'\]"):
        KernelNeeds({"mtp_input": [("fp8", "bfloat16")]})          # an FP8 embedding table
    with pytest.raises(TypeError, match="model: expected a MultiModuleMtpHead or MtpWeights"):
        KernelNeeds.of(object())
    with pytest.raises(TypeError, match="needs: expected a KernelNeeds"):
        family_calls(NumpyBackend(), needs={"rmsnorm": ()})
    with pytest.raises(TypeError, match="w: expected a prepared weight"):
        weight_kind(np.zeros(3, np.int8))
    assert KernelNeeds.everything().without_fp8() == KernelNeeds.everything(fp8=False)


# In a fresh process (Numba's dispatchers are per process; the disk cache may be warm or
# cold): which kernels the warm-up put in place, and what a propose adds after it.
_PROBE = r"""
import json, sys
import numba, numpy as np
from mtpkern import MultiModuleMtpHead
from mtpkern.backends.cpu import CpuBackend
from mtpkern.backends.cpu_kernels import (amx, amx_linear, attention, bounds, dsa, gate, gemv_tiles, hc, linear,
                                          lm_head, mla, mlp, moe, norm, rope_kv, simd)
from mtpkern.backends.warm_up import KernelNeeds

def loaded():
    out = {}
    for mod in (amx, amx_linear, attention, bounds, dsa, gate, gemv_tiles, hc, linear, lm_head, mla, mlp, moe,
                norm, rope_kv, simd):
        for name, f in vars(mod).items():
            if (isinstance(f, numba.core.dispatcher.Dispatcher) and f.overloads
                    and f.py_func.__module__ == mod.__name__):      # not a helper imported from another module
                out[f"{mod.__name__.rsplit('.', 1)[1]}.{name}"] = sorted(str(s) for s in f.overloads)
    return out

be = CpuBackend()
prop = MultiModuleMtpHead.from_pretrained(sys.argv[1], backend=be, block_size=4, num_blocks=64)
be.warm_up(needs=KernelNeeds.of(prop))
after_warm_up = loaded()
sys.path.insert(0, sys.argv[2])
from warm_up_calls import every_call
every_call(prop, np.random.default_rng(0))
after = loaded()
print(json.dumps({"warm_up": after_warm_up,
                  "added": {k: sorted(set(v) - set(after_warm_up.get(k, ()))) for k, v in after.items()
                            if set(v) - set(after_warm_up.get(k, ()))}}))
"""


def _probe(ckpt, env=None) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE, str(ckpt), str(Path(__file__).parent)], capture_output=True,
                       text=True, timeout=900, env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


#: The kernels a dense BF16 checkpoint runs: on the FMA tiles, or where the machine has AMX
#: (``amx.available``) the two norms of mtp_input, then its GEMV and the MLP's on the AMX tiles.
_DENSE_KERNELS = {
    "fma": {"norm.mtp_input_kernel", "linear.linear_kernel", "mlp.grouped_swiglu_kernel",
            "attention.paged_attention_kernel", "lm_head.lm_head_argmax_kernel"},
    "amx": {"norm.input_norms", "amx_linear.amx_linear_kernel", "amx_linear.swiglu_rows",
            "attention.paged_attention_kernel", "lm_head.lm_head_argmax_kernel"},
}


@pytest.mark.parametrize("tiles", ["fma", "amx"])
def test_a_dense_checkpoint_loads_only_its_kernels_and_they_suffice(tmp_path, tiles):
    """A dense BF16 checkpoint's warm-up puts no MoE, MLA, gate or FP8 kernel in place, and no
    FP32-weight variant; and a prefill, propose, catch-up and a masked batch after it add no
    kernel (loaded or compiled). Both GEMV paths: the FMA tiles (``MTPKERN_CPU_AMX=0``) and,
    on a machine that has them, the AMX tiles."""
    from mtpkern.backends.cpu_kernels import amx

    if tiles == "amx" and not amx.available():
        pytest.skip("this machine or process has no AMX tiles")
    got = _probe(write_synthetic_checkpoint(tmp_path / "d", dense_config(), dtype="bfloat16"),
                 env={amx.ENV: "0"} if tiles == "fma" else None)
    names = set(got["warm_up"])
    assert _DENSE_KERNELS[tiles] <= names, _DENSE_KERNELS[tiles] - names
    if tiles == "fma":                                    # the AMX path's kernels were not put in place
        assert not [n for n in names if n.startswith("amx")], names
    assert not [n for n in names if n.split(".")[0] in ("moe", "mla", "gate") or "fp8" in n]
    for kernel in ("linear.linear_kernel", "mlp.grouped_swiglu_kernel", "lm_head.lm_head_argmax_kernel",
                   "amx_linear.amx_linear_kernel"):
        for sig in got["warm_up"].get(kernel, ()):     # BF16 weights (their bits), no FP32 variant
            assert "Array(uint16" in sig, (kernel, sig)
    assert got["added"] == {}


def test_an_moe_checkpoint_warm_up_suffices(tmp_path, tiny_cfg):
    got = _probe(write_synthetic_checkpoint(tmp_path / "m", tiny_cfg, dtype="bfloat16"))
    assert "moe.moe_router_kernel" in got["warm_up"] and "mla.mla_absorb_kernel" not in got["warm_up"]
    assert not [n for n in got["warm_up"] if n.startswith(("dsa.", "hc."))]
    assert got["added"] == {}


def test_a_gated_mla_checkpoint_warm_up_suffices(tmp_path):
    """Kimi K3's gated MLA (tests/test_gated_mla.py): its warm-up puts the output gate's kernel in
    place beside MLA's (a GQA gate's rule covers MLA's too), and the calls add nothing."""
    import test_gated_mla
    from mtpkern.config import tiny_config

    got = _probe(write_synthetic_checkpoint(tmp_path / "g", tiny_config(**test_gated_mla.GATED), dtype="bfloat16"))
    assert {"gate.sigmoid_gate_kernel", "mla.mla_latent_write_kernel"} <= set(got["warm_up"])
    assert got["added"] == {}


def test_a_dsa_checkpoint_warm_up_suffices(tmp_path, dsa_cfg):
    """MLA with DSA's indexer (index_topk 4: the calls' rows see more keys): its warm-up puts the
    key write, the selection and the sparse attention's copy in place, and the calls add nothing."""
    got = _probe(write_synthetic_checkpoint(tmp_path / "s", dsa_cfg, dtype="bfloat16"))
    assert {"dsa.dsa_key_write_kernel", "dsa.dsa_select_kernel", "mla.gather_listed_kernel"} <= set(got["warm_up"])
    assert "dsa.dsa_select_pools_kernel" not in got["warm_up"]
    assert got["added"] == {}


def test_a_pooled_dsa_checkpoint_warm_up_suffices(tmp_path):
    """GLM-5.3's pooled indexer (index_kpool 2, index_topk 4): KernelNeeds.of names dsa_pools (a
    plain DSA checkpoint does not); its warm-up puts the pooled selection in place, and the
    calls add nothing."""
    from conftest import MLA_FIELDS
    cfg = tiny_config(**dict(MLA_FIELDS, index_topk=4, index_n_heads=2, index_head_dim=16, index_kpool=2))
    path = write_synthetic_checkpoint(tmp_path / "p", cfg, dtype="bfloat16")
    assert {"dsa", "dsa_pools"} <= set(KernelNeeds.of(_load(path)).kinds)
    got = _probe(path)
    assert {"dsa.dsa_key_write_kernel", "dsa.dsa_select_pools_kernel"} <= set(got["warm_up"])
    assert got["added"] == {}


def test_a_hyper_connection_checkpoint_warm_up_suffices(tmp_path):
    """hc_mult 4 (DeepSeek-V4's mHC): KernelNeeds.of names the hc family (and only such a
    checkpoint: the dense and MoE ones above do not load it); its warm-up puts hc_pre, hc_post
    and hc_head in place, and the calls add nothing."""
    path = write_synthetic_checkpoint(tmp_path / "h", tiny_config(hc_mult=4), dtype="bfloat16")
    assert "hc" in KernelNeeds.of(_load(path))
    got = _probe(path)
    assert {"hc.hc_pre_kernel", "hc.hc_post_kernel", "hc.hc_head_kernel"} <= set(got["warm_up"])
    assert got["added"] == {}


def test_a_v4_attention_checkpoint_warm_up_suffices(tmp_path):
    """DeepSeek-V4's attention (out_rope, shared_kv; tests/test_v4_attention.py's V4_ATTN):
    KernelNeeds.of names the rope_heads family (the dense and MoE checkpoints above, whose needs
    are compared whole, do not); its warm-up puts rope_heads_kernel in place beside the rope_kv
    write (shared_kv's v_is_k is an argument of that kernel), and the calls add nothing."""
    from test_v4_attention import V4_ATTN

    path = write_synthetic_checkpoint(tmp_path / "v4", tiny_config(**V4_ATTN), dtype="bfloat16")
    assert "rope_heads" in KernelNeeds.of(_load(path))
    got = _probe(path)
    assert {"rope_kv.rope_heads_kernel", "rope_kv.qk_norm_rope_kv_write_kernel"} <= set(got["warm_up"])
    assert got["added"] == {}


class _SlowBackend(NumpyBackend):
    """A warm-up that takes its time but compiles nothing (a slow load from a cache)."""

    def warm_up(self, progress=None, *, fp8=True, needs=None):
        for i in range(3):
            progress(i, 3, f"f{i}")
            time.sleep(0.4)
        progress(3, 3, "")
        return 0


class _CompilingBackend(NumpyBackend):
    """A warm-up whose second family compiles a Numba function."""

    def warm_up(self, progress=None, *, fp8=True, needs=None):
        import numba

        progress(0, 2, "loaded")
        progress(1, 2, "compiled")
        numba.njit(lambda a: a + 1)(np.float32(1.0) + np.float32(time.time() % 1))
        progress(2, 2, "")
        return 1


def test_a_slow_warm_up_that_compiles_nothing_says_nothing():
    stream = io.StringIO()
    assert warm_up(_SlowBackend(), stream) == 0
    assert stream.getvalue() == ""


def test_a_compile_is_announced_once_with_its_family():
    stream = io.StringIO()
    warm_up(_CompilingBackend(), stream)
    text = stream.getvalue()
    assert text.startswith(WarmUpReport.MESSAGE + "\n") and text.count("compiling kernels") == 1
    assert "kernels: 1/2 compiled" in text and "kernels ready in" in text and "\r" not in text


def test_the_demo_is_silent_on_a_warm_cache(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "mtpkern", "demo", "--steps", "2", "--repeats", "1"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)     # warms the cache, if not yet
    r = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    assert "compiling kernels" not in r.stderr and "kernels ready" not in r.stderr, r.stderr
