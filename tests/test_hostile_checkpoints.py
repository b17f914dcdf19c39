"""Hostile or inconsistent checkpoints: each class is refused at its mechanism, with one
``ConfigError`` / ``CheckpointError`` line naming the file and the field or tensor
(docs/checkpoints.md). Classes: work bounded before allocating; non-regular files and
JSON caps; index names outside the directory; config that disagrees with the tensors;
bad numbers; malformed JSON; fields and families that are not implemented."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtpkern import CheckpointError, ConfigError, MtpConfig, write_synthetic_checkpoint
from mtpkern.backends import get_backend
from mtpkern.config import FLOAT_RANGES, INT_RANGES, tiny_config
from mtpkern.files import CONFIG_JSON_CAP
from mtpkern.weights import load_weights

CFG = tiny_config()
NP = get_backend("numpy")
P0 = f"model.layers.{CFG.num_hidden_layers}."
INDEX = "model.safetensors.index.json"


def _ckpt(tmp_path: Path, name: str = "ckpt", **kw) -> Path:
    return write_synthetic_checkpoint(tmp_path / name, CFG, dtype="float32", **kw)


def _load(path: Path, **kw):
    """What ``MultiModuleMtpHead.from_pretrained`` does before building the proposer."""
    cfg = MtpConfig.from_json(path / "config.json")
    return load_weights(path, cfg, NP, **kw)


def _edit_config(path: Path, **changes) -> None:
    d = json.loads((path / "config.json").read_text())
    d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


def _edit_tensors(path: Path, fn) -> None:
    t = load_file(str(path / "model.safetensors"))
    fn(t)
    save_file(t, str(path / "model.safetensors"))


def _outcome(fn, fifos=(), timeout: float = 5.0) -> BaseException | None:
    """The exception ``fn()`` raises (None if it returns), failing the test instead of
    hanging it when ``fn`` blocks on one of ``fifos``: a helper process opens each FIFO
    for writing after ``timeout`` seconds, which lets a blocked reader go on. A process,
    not a thread: a reader blocked inside an extension (safetensors) may hold the GIL."""
    unblock = [subprocess.Popen(["sh", "-c", f'sleep {timeout}; exec 3>"$0"', os.fspath(f)]) for f in fifos]
    t0 = time.perf_counter()
    try:
        fn()
        err = None
    except BaseException as e:  # noqa: BLE001 - handed back to the test
        err = e
    finally:
        for p in unblock:
            p.kill()
            p.wait()
    if time.perf_counter() - t0 >= timeout:
        pytest.fail(f"the load blocked for {timeout} s or more: a file was opened, not refused ({err!r})")
    return err


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


# -- 1. the work is bounded before anything is allocated --------------------------------

def test_a_huge_expert_count_fails_fast_naming_the_field(tmp_path):
    """2**30 experts would build ~3e9 key strings (GBs, tens of seconds) before any tensor
    is checked; refused at once by the config's bounds."""
    path = _ckpt(tmp_path)
    _edit_config(path, n_routed_experts=2**30)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        _load(path)
    assert time.perf_counter() - t0 < 5.0
    assert "n_routed_experts" in _one_line(e.value) and str(path / "config.json") in str(e.value)


def test_router_rows_are_checked_before_the_expert_keys_are_listed(tmp_path, monkeypatch):
    """A config inside the bounds but larger than the checkpoint: the router's header
    shape [E, H] is compared with n_routed_experts before E experts' keys are built."""
    import mtpkern.weights as weights

    path = _ckpt(tmp_path)
    cfg = tiny_config(n_routed_experts=4096)

    def no_listing(*a, **k):
        raise AssertionError("the keys of 4096 experts were listed before the router was checked")

    monkeypatch.setattr(weights, "_module_keys", no_listing)
    with pytest.raises(CheckpointError) as e:
        load_weights(path, cfg, NP)
    msg = _one_line(e.value)
    assert "n_routed_experts = 4096" in msg and f"'{P0}mlp.gate.weight'" in msg and "got [8, 64]" in msg


_INT_CASES = [(name, v) for name, (lo, hi) in INT_RANGES.items() for v in (lo - 1, hi + 1)]


@pytest.mark.parametrize("name,value", _INT_CASES, ids=[f"{n}={v}" for n, v in _INT_CASES])
def test_every_size_field_is_bounded(name, value):
    d = CFG.to_dict()
    d[name] = value
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_dict(d)
    assert f"field {name!r} must be in [" in _one_line(e.value) and str(value) in str(e.value)


def test_positions_fit_int32():
    d = CFG.to_dict()
    d["max_position_embeddings"] = 2**31 - 1
    assert MtpConfig.from_dict(d).max_position_embeddings == 2**31 - 1
    d["max_position_embeddings"] = 2**31
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        MtpConfig.from_dict(d)


# -- 2. only regular files, JSON read up to a cap -----------------------------------------

def _assert_refused(err: BaseException | None, what: str, name: str) -> None:
    assert isinstance(err, (ConfigError, CheckpointError)), repr(err)
    assert what in _one_line(err) and name in str(err)


def _make_fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("name", ["config.json", INDEX, "model-00001-of-00002.safetensors", "model.safetensors"])
def test_a_fifo_is_refused_without_blocking(tmp_path, name):
    path = _ckpt(tmp_path, shards=1 if name == "model.safetensors" else 2)
    fifo = _make_fifo(path / name)
    _assert_refused(_outcome(lambda: _load(path), fifos=[fifo]), "is a FIFO", name)


@pytest.mark.parametrize("name", ["config.json", INDEX, "model.safetensors"])
def test_a_symlink_to_a_device_is_refused(tmp_path, name):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    path = _ckpt(tmp_path, shards=2 if name == INDEX else 1)
    (path / name).unlink()
    (path / name).symlink_to("/dev/zero")
    _assert_refused(_outcome(lambda: _load(path)), "is a character device", name)


@pytest.mark.parametrize("name", ["config.json", INDEX, "extra.safetensors"])
def test_a_directory_where_a_file_belongs(tmp_path, name):
    path = _ckpt(tmp_path, shards=2 if name == INDEX else 1)
    with contextlib.suppress(FileNotFoundError):
        (path / name).unlink()
    (path / name).mkdir()
    _assert_refused(_outcome(lambda: _load(path)), "is a directory", name)


def test_config_json_is_read_up_to_its_cap(tmp_path):
    path = _ckpt(tmp_path)
    d = json.loads((path / "config.json").read_text())
    d["padding"] = "x" * CONFIG_JSON_CAP
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        _load(path)
    assert f"cap of {CONFIG_JSON_CAP} bytes" in _one_line(e.value) and "config.json" in str(e.value)


def test_the_index_is_read_up_to_its_cap(tmp_path, monkeypatch):
    import mtpkern.weights as weights

    path = _ckpt(tmp_path, shards=2)
    monkeypatch.setattr(weights, "INDEX_JSON_CAP", 1000)
    with pytest.raises(CheckpointError) as e:
        _load(path)
    assert "cap of 1000 bytes" in _one_line(e.value) and INDEX in str(e.value)


def _hub_snapshot(src: Path, root: Path) -> Path:
    """``src`` laid out like Hugging Face's hub cache: every file of the snapshot is a
    relative symlink into ``../../blobs/``."""
    blobs, snap = root / "blobs", root / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = blobs / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snap


@pytest.mark.parametrize("shards", [1, 2])
def test_symlinked_files_still_load(tmp_path, shards):
    """Symlinks are never resolved to judge a file: the hub cache's point outside the snapshot."""
    src = _ckpt(tmp_path, "src", shards=shards)
    snap = _hub_snapshot(src, tmp_path / "models--org--name")
    assert all((snap / f.name).is_symlink() for f in src.iterdir())
    a, b = _load(src), _load(snap)
    np.testing.assert_array_equal(a.modules[2].experts_w13, b.modules[2].experts_w13)


# -- 3. index entries must name files inside the checkpoint directory -----------------------

def test_an_index_entry_outside_the_directory_is_not_followed(tmp_path):
    path = _ckpt(tmp_path, shards=2)
    index = json.loads((path / INDEX).read_text())
    shard = "model-00001-of-00002.safetensors"
    (tmp_path / "elsewhere").mkdir()
    (path / shard).rename(tmp_path / "elsewhere" / shard)
    index["weight_map"] = {k: f"../elsewhere/{shard}" if f == shard else f for k, f in index["weight_map"].items()}
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        _load(path)
    assert f"'../elsewhere/{shard}' has a '..' component" in _one_line(e.value) and INDEX in str(e.value)


@pytest.mark.parametrize("name,why", [
    ("/tmp/model.safetensors", "is an absolute path"),
    ("\\\\server\\share\\model.safetensors", "is an absolute path"),
    ("C:\\models\\model.safetensors", "names a drive"),
    ("C:model.safetensors", "names a drive"),
    ("sub/../../model.safetensors", "has a '..' component"),
    ("..\\model.safetensors", "has a '..' component"),
    ("model\x00.safetensors", "contains a NUL character"),
])
def test_index_file_names_are_judged_by_name(tmp_path, name, why):
    path = _ckpt(tmp_path, shards=2)
    index = json.loads((path / INDEX).read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        _load(path)
    assert why in _one_line(e.value) and f"weight_map[{key!r}]" in str(e.value)


# -- 4. a config that disagrees with the tensors ---------------------------------------------

_UNUSED = [
    # (config change, the first unused tensor under module 0 in key order, field named in the message)
    ({"n_shared_experts": 0}, "mlp.shared_experts.down_proj.weight", "n_shared_experts = 0"),
    ({"attention_bias": False}, "self_attn.k_proj.bias", "attention_bias = False"),
    ({"use_qk_norm": False}, "self_attn.k_norm.weight", "use_qk_norm = False"),
]


@pytest.mark.parametrize("change,tensor,field", _UNUSED, ids=[next(iter(c)) for c, _, _ in _UNUSED])
def test_a_config_field_switching_off_present_tensors_is_refused(tmp_path, change, tensor, field):
    path = _ckpt(tmp_path)
    _edit_config(path, **change)
    with pytest.raises(CheckpointError) as e:
        _load(path)
    msg = _one_line(e.value)
    assert f"'{P0}{tensor}'" in msg and field in msg and "model.safetensors" in msg
    assert "allow_unused_tensors=True" in msg


@pytest.mark.parametrize("extra,why", [
    (P0 + "self_attn.q_proj.weight_scale_inv", "quantized weight's scale"),
    (P0 + "mlp.experts.3.down_proj.weight_scale_inv", "quantized weight's scale"),
    (P0 + "self_attn.sinks", "config.json has attn_sinks = False"),
    (P0 + "self_attn.sink_bias", "no config field reads it"),
    (P0 + "mlp.gate_proj.weight", "n_routed_experts = 8"),
])
def test_any_unread_tensor_under_a_module_prefix_is_refused(tmp_path, extra, why):
    path = _ckpt(tmp_path)
    _edit_tensors(path, lambda t: t.update({extra: np.ones(4, np.float32)}))
    with pytest.raises(CheckpointError) as e:
        _load(path)
    assert f"{extra!r}" in _one_line(e.value) and why in str(e.value)


def test_unused_tensors_load_when_allowed_and_are_noted(tmp_path):
    clean = _load(_ckpt(tmp_path, "clean"))
    path = _ckpt(tmp_path)
    _edit_config(path, use_qk_norm=False)
    with pytest.raises(TypeError, match="allow_unused_tensors"):
        _load(path, allow_unused_tensors=1)
    w = _load(path, allow_unused_tensors=True)
    assert w.modules[0].q_norm is None
    np.testing.assert_array_equal(w.modules[0].w_qkv, clean.modules[0].w_qkv)
    assert len(w.notes) == CFG.num_modules and "2 unused tensor(s)" in w.notes[0]
    assert f"{P0}self_attn.k_norm.weight" in w.notes[0]


def test_target_layers_are_not_under_any_module_prefix(tmp_path):
    path = _ckpt(tmp_path)
    _edit_tensors(path, lambda t: t.update({
        "model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), np.float32),
        "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv": np.ones(4, np.float32),
        f"model.layers.{CFG.num_hidden_layers + CFG.num_modules}0.enorm.weight": np.ones(4, np.float32),
    }))
    assert _load(path).notes == []


def test_a_key_in_two_files_without_an_index_is_refused(tmp_path):
    path = _ckpt(tmp_path)
    key = P0 + "enorm.weight"
    save_file({key: np.zeros(CFG.hidden_size, np.float32)}, str(path / "model-override.safetensors"))
    with pytest.raises(CheckpointError) as e:
        _load(path)
    msg = _one_line(e.value)
    assert f"{key!r}" in msg and "model-override.safetensors" in msg and "model.safetensors" in msg


def test_disjoint_files_without_an_index_still_load(tmp_path):
    path = _ckpt(tmp_path)
    t = load_file(str(path / "model.safetensors"))
    target = {k: t.pop(k) for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    save_file(t, str(path / "model.safetensors"))
    save_file(target, str(path / "target.safetensors"))
    assert len(_load(path).modules) == CFG.num_modules


# -- 5. numbers: finite and in range -------------------------------------------------------

_BAD_FLOATS = [(name, v) for name in FLOAT_RANGES for v in (math.nan, math.inf, -math.inf, 0.0, -1.0)]


@pytest.mark.parametrize("name,value", _BAD_FLOATS, ids=[f"{n}={v}" for n, v in _BAD_FLOATS])
def test_float_fields_must_be_finite_and_in_range(tmp_path, name, value):
    """Written as JSON's NaN / Infinity literals, which Python's json reads."""
    path = _ckpt(tmp_path)
    d = json.loads((path / "config.json").read_text())
    (d["rope_parameters"] if name == "rope_theta" else d)[name] = value
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        _load(path)
    assert f"field {name!r} must be" in _one_line(e.value) and str(path / "config.json") in str(e.value)


# -- 6. malformed JSON: one error naming the file ------------------------------------------

_DEEP = b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"

_BAD_CONFIG_BODIES = {
    "not-utf8": (b'{"hidden_size": "\xff\xfe"}', "not UTF-8"),
    "deep": (_DEEP, "nested too deeply"),
    "truncated": (b'{"hidden_size": 64', "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "list": (b"[1, 2]", "expected a JSON object, got list"),
    "null": (b"null", "expected a JSON object, got NoneType"),
    "duplicate-key": (b'{"hidden_size": 64, "hidden_size": 4096}', "'hidden_size' appears twice"),
}


@pytest.mark.parametrize("body,msg", list(_BAD_CONFIG_BODIES.values()), ids=list(_BAD_CONFIG_BODIES))
def test_malformed_config_json(tmp_path, body, msg):
    path = _ckpt(tmp_path)
    (path / "config.json").write_bytes(body)
    with pytest.raises(ConfigError) as e:
        _load(path)
    assert msg in _one_line(e.value) and "config.json" in str(e.value)


_KEY = P0 + "enorm.weight"
_BAD_INDEX_BODIES = {
    "weight_map-list": (json.dumps({"weight_map": [_KEY]}).encode(), "got list"),
    "weight_map-null": (b'{"weight_map": null}', "got NoneType"),
    "no-weight_map": (b'{"metadata": {}}', "got NoneType"),
    "top-level-list": (b'[{"weight_map": {}}]', "got a JSON list"),
    "entry-null": (json.dumps({"weight_map": {_KEY: None}}).encode(), f"weight_map[{_KEY!r}]: expected a file name"),
    "entry-number": (json.dumps({"weight_map": {_KEY: 5}}).encode(), "got 5"),
    "entry-empty": (json.dumps({"weight_map": {_KEY: ""}}).encode(), "got ''"),
    "entry-list": (json.dumps({"weight_map": {_KEY: ["model.safetensors"]}}).encode(), "got ['model.safetensors']"),
    "not-utf8": (b'{"weight_map": {"\xff": "x"}}', "not UTF-8"),
    "deep": (_DEEP, "nested too deeply"),
    "duplicate-key": (('{"weight_map": {"%s": "a.safetensors", "%s": "b.safetensors"}}' % (_KEY, _KEY)).encode(),
                      "appears twice"),
}


@pytest.mark.parametrize("body,msg", list(_BAD_INDEX_BODIES.values()), ids=list(_BAD_INDEX_BODIES))
def test_malformed_index(tmp_path, body, msg):
    path = _ckpt(tmp_path, shards=2)
    (path / INDEX).write_bytes(body)
    with pytest.raises(CheckpointError) as e:
        _load(path)
    assert msg in _one_line(e.value) and INDEX in str(e.value)


# -- 7. fields and families that are not implemented ---------------------------------------

_REFUSED = {
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "index_topk": 2048, "use_sliding_window": True,
    "layer_types": ["full_attention", "sliding_attention"], "hybrid_layer_pattern": [0, 1, 1],
    "swiglu_limits": [None, 7.0], "swiglu_limit": 7.0, "attention_sink_bias": True,
    "add_swa_attention_sink_bias": True, "attn_output_gate": True,
    "linear_num_key_heads": 16, "topk_method": "group_limited_greedy",
    "partial_rotary_factors": [0.5, 1.0], "mlp_bias": True,
    # another family's name for a quantity we read, disagreeing with ours
    "num_experts": 512, "num_local_experts": 9, "moe_num_experts": 16, "rotary_dim": 16,
    "shared_expert_intermediate_size": 512, "num_mtp_layers": 1, "moe_top_k": 4,
}


@pytest.mark.parametrize("name,value", list(_REFUSED.items()), ids=list(_REFUSED))
def test_fields_that_change_the_maths_are_refused_by_name(tmp_path, name, value):
    path = _ckpt(tmp_path)
    _edit_config(path, **{name: value})
    with pytest.raises(ConfigError) as e:
        _load(path)
    assert f"field {name!r}" in _one_line(e.value) and str(path / "config.json") in str(e.value)


_SWITCHED_OFF = {
    "quantization_config": None, "sliding_window": None, "use_sliding_window": False,
    "layer_types": ["full_attention"] * 3, "swiglu_limits": [None, None], "topk_method": "noaux_tc",
    "attention_value_scale": 1.0, "mlp_bias": False, "attn_output_gate": False, "kv_lora_rank": None,
    "num_experts": CFG.n_routed_experts, "rotary_dim": CFG.rotary_dim, "num_mtp_layers": CFG.num_modules,
    "shared_expert_intermediate_size": CFG.shared_intermediate_size, "hybrid_layer_pattern": [0, 0],
}


@pytest.mark.parametrize("name,value", list(_SWITCHED_OFF.items()), ids=list(_SWITCHED_OFF))
def test_the_same_fields_switched_off_or_agreeing_load(name, value):
    assert MtpConfig.from_dict(dict(CFG.to_dict(), **{name: value})) == CFG


def test_block_fields_of_the_spec_layout_are_read(tmp_path):
    """v_head_dim and sliding_window are canonical-layout fields now (mtpkern/block.py): a value
    the tensors disagree with is refused naming the tensor and both shapes."""
    assert MtpConfig.from_dict(dict(CFG.to_dict(), sliding_window=64)).block(1).sliding_window == 64
    assert MtpConfig.from_dict(dict(CFG.to_dict(), sliding_window=64, use_sliding_window=True)).sliding_window == 64
    path = _ckpt(tmp_path)
    _edit_config(path, v_head_dim=2 * CFG.head_dim)
    with pytest.raises(CheckpointError, match=r"v_proj.weight.*expected shape \[64, 64\], got \[32, 64\]"):
        _load(path)


def test_a_window_that_is_switched_off_loads():
    """Qwen2-style: a window size beside use_sliding_window: false."""
    d = dict(CFG.to_dict(), sliding_window=4096, use_sliding_window=False)
    assert MtpConfig.from_dict(d) == CFG


@pytest.mark.parametrize("change,msg", [
    ({"model_type": "kimi_k2"}, "model_type 'kimi_k2' is not supported; supported: glm4_moe (Glm4MoeForCausalLM), mimo (MiMoForCausalLM), mimo_v2_flash"),
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' is not supported"),
    ({"model_type": 4}, "model_type 4 is not supported"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "architecture 'DeepseekV2ForCausalLM' is not supported; supported: glm4_moe"),
    ({"architectures": ["Step3p5ForCausalLM"], "model_type": "glm4_moe"},
     "architecture 'Step3p5ForCausalLM' is a step3p5 model, but model_type is 'glm4_moe'"),
    ({"architectures": "Glm4MoeForCausalLM"}, "field 'architectures' expected a list of names"),
    ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}, None),
    ({"architectures": [], "model_type": "glm4_moe"}, None),
])
def test_model_types_and_architectures(change, msg):
    d = dict(CFG.to_dict(), **change)
    if msg is None:
        assert MtpConfig.from_dict(d) == dataclasses.replace(CFG, family="glm4_moe")
        return
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_dict(d)
    assert msg in _one_line(e.value)


@pytest.mark.parametrize("rope,msg", [
    ({"full_attention": {"rope_type": "default", "rope_theta": 5e6}}, "rope_parameters.full_attention is not supported"),
    ({"rope_type": "default", "factor": 2.0}, "rope_parameters.factor is not supported"),
    ({"rope_type": "longrope", "rope_theta": 1e4}, "rope_parameters.rope_type 'longrope' is not supported"),
    ({"rope_type": "yarn", "rope_theta": 1e4}, "rope_parameters.factor is required by rope_type 'yarn'"),
    ({"rope_type": ["default"]}, "rope_type ['default'] is not supported"),
    ({"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5, "_top": {"rope_theta": 1e4}},
     "rope_parameters.rope_theta (500000.0) disagrees with the top-level rope_theta (10000.0)"),
])
def test_rope_other_than_the_default_is_refused(rope, msg):
    rope = dict(rope)
    top = rope.pop("_top", {})
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_dict(dict(CFG.to_dict(), rope_parameters=rope, **top))
    assert msg in _one_line(e.value)


def test_a_config_without_model_type_is_read_with_mtpkerns_defaults(tmp_path):
    """The documented decision (docs/checkpoints.md): hand-written and synthetic configs name no
    family; they are read in the canonical layout with MtpConfig's defaults."""
    path = _ckpt(tmp_path)
    assert "model_type" not in json.loads((path / "config.json").read_text())
    assert len(_load(path).modules) == CFG.num_modules


def test_from_pretrained_passes_the_opt_in(tmp_path):
    from mtpkern import MultiModuleMtpHead

    path = _ckpt(tmp_path)
    _edit_config(path, use_qk_norm=False)
    with pytest.raises(CheckpointError, match="allow_unused_tensors=True"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    with pytest.raises(TypeError, match="allow_unused_tensors: expected a bool"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy", allow_unused_tensors="yes")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", allow_unused_tensors=True)
    assert prop.weights.notes and prop.modules[0].w.q_norm is None


# -- found by the audit: values inside every bound that still break, and unnamed errors ------

@pytest.mark.parametrize("field,value", [("rope_theta", 5e-324), ("rope_theta", 0.5), ("rope_theta", 1e13),
                                         ("routed_scaling_factor", 1e308), ("routed_scaling_factor", 1e4)])
def test_finite_values_that_poison_the_maths_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"field '{field}' must be"):
        MtpConfig.from_dict(dict(CFG.to_dict(), **{field: value}, rope_parameters=None))


@pytest.mark.parametrize("scaling,match", [({"rope_type": "yarn", "factor": 40}, "rope_type 'default' disagrees with "
                                                                                "rope_scaling.rope_type 'yarn'"),
                                           ({"type": "linear", "factor": 2.0}, "rope_scaling.rope_type 'linear' is "
                                                                               "not supported")])
def test_a_scaling_beside_rope_parameters_is_not_ignored(scaling, match):
    d = dict(CFG.to_dict(), rope_scaling=scaling)               # to_dict writes rope_parameters: default
    with pytest.raises(ConfigError, match=match):
        MtpConfig.from_dict(d)
    d = dict(CFG.to_dict(), rope_scaling={"rope_type": "default", "rope_theta": 5.0})
    with pytest.raises(ConfigError, match="disagrees with rope_scaling.rope_theta"):
        MtpConfig.from_dict(d)


def test_an_integer_too_long_to_convert_is_one_config_error(tmp_path):
    text = json.dumps(CFG.to_dict()).replace('"hidden_size": 64', '"hidden_size": 1' + "0" * 5000)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_json(tmp_path / "config.json")
    assert str(tmp_path / "config.json") in _one_line(e.value) and "not valid JSON" in str(e.value)


def test_a_pool_that_cannot_fit_is_refused_naming_num_blocks(tmp_path):
    """Each field within its bound, the product enormous: 1024 KV heads of 1024 dims."""
    from mtpkern import MultiModuleMtpHead

    big = dataclasses.replace(CFG, hidden_size=8, num_attention_heads=1024, num_key_value_heads=1024,
                              head_dim=1024, num_nextn_predict_layers=1, n_routed_experts=0, intermediate_size=8,
                              attention_bias=False, use_qk_norm=False)
    path = write_synthetic_checkpoint(tmp_path, big, dtype="float32")
    with pytest.raises(ValueError, match=r"num_blocks: the KV pools would take .* GiB .* pass a smaller num_blocks"):
        MultiModuleMtpHead.from_pretrained(path, backend="numpy")
    prop = MultiModuleMtpHead.from_pretrained(path, backend="numpy", num_blocks=2, block_size=1)
    assert prop.memory().kv_pools == 2 * 1 * 1024 * 2048 * 4


def test_pool_arguments_past_int32_name_themselves(tmp_path):
    from mtpkern import MultiModuleMtpHead

    path = _ckpt(tmp_path)
    for kw in (dict(num_blocks=2**64), dict(block_size=2**64), dict(num_blocks=2**20, block_size=2**20)):
        with pytest.raises(ValueError, match="num_blocks, block_size: expected num_blocks \\* block_size <="):
            MultiModuleMtpHead.from_pretrained(path, backend="numpy", **kw)


def test_checkpoint_paths_are_named_plainly(tmp_path):
    from mtpkern import MultiModuleMtpHead

    path = _ckpt(tmp_path)
    with pytest.raises(CheckpointError, match="is a file; expected the directory that holds it"):
        MultiModuleMtpHead.from_pretrained(path / "config.json", backend="numpy")
    (path / "model.safetensors").rename(path / "real.bin")
    os.symlink(path / "gone.safetensors", path / "model.safetensors")
    with pytest.raises(CheckpointError, match="a symlink to nothing"):
        load_weights(path, CFG, get_backend("numpy"))
