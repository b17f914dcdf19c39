"""Numerics where mtpkern once differed from its references, on every backend.

- the MoE router: a dropped group's experts are never chosen (the references fill them
  with -inf; 0.0 picked one whenever a kept expert's ``s + bias`` was negative): the
  issue's example, and hypothesis cases with negative biases against a float64 router
  written here (sigmoid, softmax and DeepSeek-V4's sqrtsoftplus scores), on numpy, cpu and
  the CUDA kernels in the emulator (tests/cuda_emu);
  against transformers' own router where torch and transformers are installed;
- RMSNorm of a hidden past FP32's sum-of-squares range (|x| from about 1.8e19): every
  backend's ``rmsnorm`` and ``mtp_input`` give the same normalized result at scale 1e20
  (and 3e38) as at scale 1, as the definition does (eps aside);
- the float config ranges: docs/checkpoints.md states the ranges the code enforces, and
  every refusal gives the reason;
- LM heads whose logits could overflow FP32 (the reference drafted where the cpu backend, its
  FP32 sums meeting +inf and -inf, raised NoAllowedToken): refused at load by the bound
  ``hidden_size * max|g| * max|W| < 2^126``, alike on every rank of a sharded head; a hidden
  that overflows inside a module raises NoAllowedToken on every backend.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cuda_emu import emu_backend
from mtpkern import ConfigError, MtpConfig
from mtpkern.backends import get_backend
from mtpkern.errors import NoAllowedToken
from mtpkern.config import FLOAT_RANGE_REASONS, FLOAT_RANGES, tiny_config
from mtpkern.ops.moe import SCORINGS, RouterSpec
from mtpkern.tolerance import assert_close

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def emu():
    yield from emu_backend.installed_emulator()


@pytest.fixture(scope="module", params=["numpy", "cpu", "cuda_emulated"])
def be(request):
    if request.param == "cuda_emulated":
        request.getfixturevalue("emu")
        return emu_backend.backend()
    return get_backend(request.param)


def route(be, logits, bias, spec):
    """The backend's router on exact logits (an identity gate): (ids, weights) on the host."""
    E = logits.shape[1]
    ids, w = be.moe_router(be.from_host(np.ascontiguousarray(logits, np.float32)),
                           be.prepare_weight(np.eye(E, dtype=np.float32)),
                           be.prepare_vector(np.asarray(bias, np.float32)), spec)
    return be.to_host(ids), be.to_host(w)


# -- 1. the router's dropped groups -----------------------------------------------------------------

def scores64(row, scoring: str) -> np.ndarray:
    """One row's router scores in float64: sigmoid, softmax, or DeepSeek-V4's sqrtsoftplus
    (torch's softplus: the logit itself past 20, else log1p(exp(l)))."""
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-row))
    if scoring == "softmax":
        z = np.exp(row - row.max())
        return z / z.sum()
    return np.sqrt(np.where(row > 20, row, np.log1p(np.exp(np.minimum(row, 20)))))


def router64(logits, bias, spec):
    """The router as DeepSeek's inference code defines it, in float64: experts of dropped groups
    are not candidates at all (what -inf amounts to with finite scores). Ties: lowest group, lowest
    expert id. Independent of mtpkern's own router."""
    n, E = logits.shape
    G, gsz = spec.n_group, E // spec.n_group
    ids_out, w_out = [], []
    for row in np.asarray(logits, np.float64):
        s = scores64(row, spec.scoring)
        c = s + np.asarray(bias, np.float64)
        gscore = [sum(sorted(c[g * gsz:(g + 1) * gsz], reverse=True)[:min(2, gsz)]) for g in range(G)]
        kept = sorted(range(G), key=lambda g: (-gscore[g], g))[:spec.topk_group]
        cand = [e for e in range(E) if e // gsz in kept]
        ids = sorted(cand, key=lambda e: (-c[e], e))[:spec.top_k]
        w = s[ids]
        if spec.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        ids_out.append(ids)
        w_out.append(w * spec.routed_scaling_factor)
    return np.array(ids_out, np.int32), np.array(w_out)


def test_router_issue_example(be):
    """4 experts in 2 groups, 1 kept, top-2, every score sigmoid(0) = 0.5: group 0 wins (c = 0.3, -0.4)
    and both its experts are chosen; the 0.0 fill chose expert 2 of the dropped group."""
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)
    ids, w = route(be, np.zeros((1, 4), np.float32), [-0.2, -0.9, -0.8, -0.85], spec)
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [[0.5, 0.5]], rtol=1e-6)


# exact logits and dyadic biases, mostly negative (a kept c below 0 is what told the rules apart)
_LOGITS = [-3.0, -2.25, -1.5, -0.75, 0.0, 0.5, 1.0, 1.25, 2.0, 2.5]
_BIASES = [-2.0, -1.25, -1.0, -0.875, -0.75, -0.5, -0.3125, -0.125, 0.0, 0.25]


def _near_ties(logits, bias, spec, gap=1e-5) -> bool:
    """Values the ranking compares that differ by less than FP32 rounding can decide, unless they
    come from the same (logit, bias), which every backend computes to the same bits."""
    E, G = logits.shape[0], spec.n_group
    gsz = E // G
    l64 = logits.astype(np.float64)
    c = scores64(l64, spec.scoring) + bias.astype(np.float64)
    key = list(zip(logits.tolist(), bias.tolist()))
    if any(key[a] != key[b] and abs(c[a] - c[b]) < gap for a in range(E) for b in range(a + 1, E)):
        return True
    tops = [sorted(range(g * gsz, (g + 1) * gsz), key=lambda e: -c[e])[:min(2, gsz)] for g in range(G)]
    gkey = [sorted(key[e] for e in t) for t in tops]
    gs = [sum(c[e] for e in t) for t in tops]
    return any(gkey[a] != gkey[b] and abs(gs[a] - gs[b]) < 10 * gap for a in range(G) for b in range(a + 1, G))


@st.composite
def router_cases(draw):
    G = draw(st.sampled_from([2, 3, 4, 8]))
    gsz = draw(st.sampled_from([1, 2, 3, 4]))
    E = G * gsz
    topk_group = draw(st.integers(1, G - 1))            # some group is always dropped
    spec = RouterSpec(top_k=draw(st.integers(1, topk_group * gsz)), n_group=G, topk_group=topk_group,
                      routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), norm_topk_prob=draw(st.booleans()),
                      scoring=draw(st.sampled_from(SCORINGS)))
    n = draw(st.integers(1, 6))
    logits = np.array(draw(st.lists(st.sampled_from(_LOGITS), min_size=n * E, max_size=n * E)),
                      np.float32).reshape(n, E)
    bias = np.array(draw(st.lists(st.sampled_from(_BIASES), min_size=E, max_size=E)), np.float32)
    return spec, logits, bias


@settings(max_examples=60, deadline=None)
@given(case=router_cases())
def test_router_against_float64_reference(be, case):
    spec, logits, bias = case
    assume(not any(_near_ties(row, bias, spec) for row in logits))
    ids, w = route(be, logits, bias, spec)
    ids64, w64 = router64(logits, bias, spec)
    np.testing.assert_array_equal(ids, ids64)
    np.testing.assert_allclose(w, w64, rtol=2e-6, atol=1e-7)
    G, gsz = spec.n_group, logits.shape[1] // spec.n_group
    for row in ids:                                      # never more groups than kept
        assert len({int(e) // gsz for e in row}) <= spec.topk_group


def test_sqrtsoftplus_router_past_the_softplus_threshold(be):
    """DeepSeek-V4's scores where torch's softplus switches to the logit itself (20), far past
    it and deep in the negatives (softplus ~ exp(l)): ids as the float64 router, weights to FP32
    rounding; a NaN row ranks its experts by id and fills every slot."""
    spec = RouterSpec(top_k=4, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                      scoring="sqrtsoftplus")
    logits = np.array([[19.75, 20.5, 1e4, -30.0, 3.0, -8.0, 20.0, 0.25],
                       [-40.0, -30.0, -20.0, -12.0, -9.0, -60.0, -15.0, -25.0]], np.float32)
    bias = [0.0, -0.5, -95.0, 0.0, 2.5, 0.0, -0.25, 0.0]
    ids, w = route(be, logits, bias, spec)
    ids64, w64 = router64(logits, bias, spec)
    np.testing.assert_array_equal(ids, ids64)
    np.testing.assert_allclose(w, w64, rtol=2e-6, atol=1e-30)
    assert ids[0].tolist() == [2, 0, 4, 6]                   # c = 100 - 95, 4.44, 1.75 + 2.5, 4.47 - 0.25
    nan_row = logits.copy()
    nan_row[0, 2] = np.nan                                   # through the identity gate: every logit NaN
    with np.errstate(invalid="ignore"):
        ids_n, w_n = route(be, nan_row, bias, spec)
    assert ids_n[0].tolist() == [0, 1, 2, 3] and np.isnan(w_n[0]).all()    # NaN ties: by id, every slot
    np.testing.assert_array_equal(ids_n[1], ids[1])


def test_router_against_transformers():
    """transformers' DeepSeek-V3 router (the class Glm4Moe, Glm4MoeLite and GlmMoeDsa inherit)
    on random weights with negative correction biases; skipped without torch and transformers, and
    for a transformers older than its -inf fix (huggingface/transformers#45441)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    def hf_route(x, gate_w, bias, spec):
        cfg = DeepseekV3Config(hidden_size=x.shape[1], n_routed_experts=gate_w.shape[0],
                               num_experts_per_tok=spec.top_k, n_group=spec.n_group, topk_group=spec.topk_group,
                               routed_scaling_factor=spec.routed_scaling_factor,
                               norm_topk_prob=spec.norm_topk_prob, moe_intermediate_size=4, n_shared_experts=1,
                               num_local_experts=gate_w.shape[0])
        moe = m.DeepseekV3MoE(cfg)
        with torch.no_grad():
            moe.gate.weight.copy_(torch.from_numpy(gate_w))
            moe.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
            out = moe.gate(torch.from_numpy(x))
            if isinstance(out, torch.Tensor):                # 5.x: the gate gives logits, the MoE routes
                ids, w = moe.route_tokens_to_experts(out)
            elif len(out) == 3:
                _, w, ids = out
            else:
                ids, w = out
        ids, w = ids.numpy(), w.float().numpy()
        order = np.argsort(ids, axis=1)                  # torch.topk(sorted=False): compare as sets
        return np.take_along_axis(ids, order, 1), np.take_along_axis(w, order, 1)

    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)
    ids, _ = hf_route(np.zeros((1, 4), np.float32), np.zeros((4, 4), np.float32),
                      np.array([-0.2, -0.9, -0.8, -0.85], np.float32), spec)
    if ids.tolist() == [[0, 2]]:
        pytest.skip("this transformers fills dropped groups with 0.0 (before huggingface/transformers#45441)")
    ref = get_backend("numpy")
    rng = np.random.default_rng(0)
    for G, tg, K, E in [(2, 1, 2, 8), (4, 2, 4, 16), (8, 4, 8, 64)]:
        spec = RouterSpec(top_k=K, n_group=G, topk_group=tg, routed_scaling_factor=2.5, norm_topk_prob=True)
        x = rng.standard_normal((16, 32)).astype(np.float32)
        gate_w = (rng.standard_normal((E, 32)) * 0.2).astype(np.float32)
        bias = (-rng.random(E) * 1.5).astype(np.float32)    # down to -1.5: many kept c below 0
        ids, w = ref.moe_router(x, gate_w, bias, spec)
        order = np.argsort(ids, axis=1)
        hf_ids, hf_w = hf_route(x, gate_w, bias, spec)
        np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), hf_ids)
        np.testing.assert_allclose(np.take_along_axis(w, order, 1), hf_w, rtol=1e-5)


# -- 2. the argmax of rows with infinite and NaN logits ----------------------------------------------

_SPECIAL = [1.0, -1.0, 2.0, np.inf, -np.inf, np.nan]


def test_lm_head_argmax_rule_for_special_logits(be):
    """Every row of 4 logits drawn from {1, -1, 2, +inf, -inf, NaN} (exact: H = 1, x = 1), with
    confidences: +inf wins, -inf is a candidate that loses to any number, NaN never wins, ties go
    to the lowest id, a row of NaN only raises NoAllowedToken naming it; the same on every backend
    (the rule of mtpkern.ops.lm_head, checked here against its statement, not the reference)."""
    import itertools
    rows = np.array(list(itertools.product(_SPECIAL, repeat=4)), np.float32)      # [1296, 4]
    w = rows.T.copy()[:, :, None]                                                # per row: w [4, 1]
    nan_only = np.isnan(rows).all(axis=1)
    x = np.ones((1, 1), np.float32)
    for r in range(rows.shape[0]):
        logits = rows[r]
        conf = np.zeros(1, np.float32)
        if nan_only[r]:
            with pytest.raises(NoAllowedToken):
                be.lm_head_argmax(be.from_host(x), be.prepare_weight(w[:, r]), None, conf=conf)
            continue
        ids = be.to_host(be.lm_head_argmax(be.from_host(x), be.prepare_weight(w[:, r]), None, conf=conf))
        cand = [j for j in range(4) if not np.isnan(logits[j])]
        best = max(cand, key=lambda j: (logits[j], -j))
        assert ids.tolist() == [best], (logits, ids)
        top = logits[best]
        terms = [1.0 if logits[j] == top else float(np.exp(np.float64(logits[j]) - top)) for j in cand]
        np.testing.assert_allclose(be.to_host(conf), [1.0 / sum(terms)], rtol=1e-6, err_msg=str(logits))


# -- 3. RMSNorm of huge hiddens ------------------------------------------------------------------

_SCALES = [1e20, 2.0 ** 100, 3e38 / 8]          # the last: |x| up to about 3e38 with these rows


@pytest.mark.parametrize("scale", _SCALES)
@pytest.mark.parametrize("H", [64, 200])          # 200: not a multiple of the kernels' vector width
def test_rmsnorm_is_scale_invariant(be, H, scale):
    rng = np.random.default_rng(H)
    x = rng.standard_normal((3, H)).astype(np.float32)
    x[1] *= 1e-3                                     # rows of different sizes in one call
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    base = be.to_host(be.rmsnorm(be.from_host(x), be.prepare_vector(w), 1e-6))
    big = be.to_host(be.rmsnorm(be.from_host((x * scale).astype(np.float32)), be.prepare_vector(w), 1e-6))
    assert np.isfinite(big).all()
    # eps (1e-6) weighs on the unscaled rows only: relative 1e-6 / mean(x^2) (1 for row 1)
    assert_close(big[[0, 2]], base[[0, 2]], "float32", "rmsnorm of x * scale against x")
    np.testing.assert_allclose(big[1], base[1] * np.sqrt((np.mean(x[1].astype(np.float64) ** 2) + 1e-6)
                                                         / np.mean(x[1].astype(np.float64) ** 2)), rtol=1e-4)


def test_rmsnorm_below_the_bound_is_unchanged(be):
    """Rows below 2^56 take the plain path: the result of the reference's formula, bit for bit on
    numpy; NaN and infinities behave as before (a NaN row stays NaN, an infinity makes NaN)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 96)) * 1e16).astype(np.float32)
    x[2, 5], x[3, 7] = np.nan, np.inf
    w = np.ones(96, np.float32)
    got = be.to_host(be.rmsnorm(be.from_host(x), be.prepare_vector(w), 1e-5))
    with np.errstate(invalid="ignore"):
        want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5))
    assert_close(got[:2], want[:2], "float32", "rmsnorm below 2^56")
    assert np.isnan(got[2]).all() and np.isnan(got[3, 7])


@pytest.mark.parametrize("scale", _SCALES[:2])
def test_mtp_input_is_scale_invariant_in_the_hidden(be, scale):
    rng = np.random.default_rng(3)
    V, H, n = 20, 64, 2
    embed = rng.standard_normal((V, H)).astype(np.float32)
    eh = (rng.standard_normal((H, 2 * H)) * H ** -0.5).astype(np.float32)
    ew, hw = (1 + 0.1 * rng.standard_normal((2, H))).astype(np.float32)
    tokens = np.array([3, 11], np.int32)
    g = rng.standard_normal((n, H)).astype(np.float32)

    def run(hidden):
        return be.to_host(be.mtp_input(be.prepare_weight(embed), be.from_host(tokens), be.from_host(hidden),
                                       be.prepare_vector(ew), be.prepare_vector(hw), be.prepare_weight(eh), 1e-6))
    big = run((g * scale).astype(np.float32))
    assert np.isfinite(big).all()
    assert_close(big, run(g), "float32", "mtp_input with the hidden times scale")


# -- 4. the float config ranges -------------------------------------------------------------------

def _config_with(name, value) -> dict:
    d = tiny_config().to_dict()
    if name == "rope_theta":
        d["rope_parameters"]["rope_theta"] = value
    else:
        d[name] = value
    return d


@pytest.mark.parametrize("name,value,shown", [("rope_theta", 0.5, "(1, 1e+12]"),
                                              ("routed_scaling_factor", 2000.0, "(0, 1000]")])
def test_float_range_refusal_names_range_and_reason(name, value, shown):
    with pytest.raises(ConfigError) as e:
        MtpConfig.from_dict(_config_with(name, value))
    msg = str(e.value)
    assert f"field {name!r} must be in {shown}, got {value:g}" in msg
    assert FLOAT_RANGE_REASONS[name] in msg


def test_float_ranges_each_have_a_reason():
    assert set(FLOAT_RANGE_REASONS) == set(FLOAT_RANGES)


@pytest.mark.parametrize("name", ["rms_norm_eps", "rope_theta", "partial_rotary_factor", "routed_scaling_factor",
                                  "attention_value_scale"])
def test_checkpoints_doc_states_the_enforced_range(name):
    """docs/checkpoints.md gives each range as the code enforces it (it once said ``> 0`` for
    rope_theta and routed_scaling_factor, which the code refuses at 0.5 and 2000)."""
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    lo, hi = FLOAT_RANGES[name]
    found = re.findall(rf"`{name}` in \(([^,]+), ([^\]]+)\]", text)
    assert found, f"docs/checkpoints.md states no range for {name}"
    for a, b in found:
        assert (float(a), float(b)) == (lo, hi), f"docs/checkpoints.md: {name} in ({a}, {b}], code: ({lo}, {hi}]"
    if name in ("rope_theta", "routed_scaling_factor"):
        assert not re.search(rf"`{name}`[^.]*> 0", text)
    # in range: loads
    ok = {"rms_norm_eps": 1e-6, "rope_theta": 2.0, "partial_rotary_factor": 1.0, "routed_scaling_factor": 1000.0,
          "attention_value_scale": 0.5}[name]
    MtpConfig.from_dict(_config_with(name, ok))
    assert math.isfinite(ok)


# -- 5. logits that could overflow FP32: refused at load -------------------------------------------

def _scaled_checkpoint(path, factor, rows=slice(None), key="lm_head.weight", cfg=None, **kw):
    """The tiny checkpoint (FP32) at ``path`` with ``key``'s ``rows`` times ``factor`` (clipped to
    FP32's range)."""
    from safetensors.numpy import load_file, save_file

    from mtpkern import write_synthetic_checkpoint

    write_synthetic_checkpoint(path, cfg or tiny_config(), seed=7, dtype="float32", **kw)
    t = load_file(path / "model.safetensors")
    a = t[key].astype(np.float64)
    a[rows] *= factor
    t[key] = np.clip(a, -3.4e38, 3.4e38).astype(np.float32)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _one_token_mask(k, V):
    mask = np.zeros((V + 31) // 32, np.uint32)
    mask[k >> 5] = np.uint32(1) << np.uint32(k & 31)
    return mask.view(np.int32)


@pytest.fixture(scope="module")
def overflowing_head(tmp_path_factory):
    """An LM head x 1.5e38: in FP32 some of its logits' partial sums overflow, in orders that
    differ between the backends."""
    return _scaled_checkpoint(tmp_path_factory.mktemp("overflowing_head"), 1.5e38)


def _draft_or_error(be, path, k):
    """The one draft a mask allowing only token ``k`` gives on ``be`` (or the error's name)."""
    from mtpkern import MultiModuleMtpHead

    cfg = tiny_config()
    try:
        prop = MultiModuleMtpHead.from_pretrained(path, backend=be, kv_mode="exact", block_size=4, num_blocks=64)
        prop.step_runner = None
        rng = np.random.default_rng(0)
        st = prop.alloc_state()
        prop.prefill_drafter(rng.integers(0, cfg.vocab_size, 5).tolist(),
                             rng.standard_normal((5, cfg.hidden_size)).astype(np.float32), st)
        with np.errstate(over="ignore", invalid="ignore"):
            return prop.propose(3, rng.standard_normal(cfg.hidden_size).astype(np.float32), 5, 1, st,
                                grammar_bitmask=_one_token_mask(k, cfg.vocab_size))
    except Exception as e:
        return type(e).__name__


def test_overflowing_head_gives_one_answer_on_every_backend(be, overflowing_head):
    """The issue's case: with the LM head of ``overflowing_head`` and a mask allowing token 1
    only, the reference (exact sums) drafted 1 where the cpu backend (FP32 sums, one of which
    met +inf and -inf: NaN) raised NoAllowedToken. Now no backend loads it, so all agree."""
    got = {name: _draft_or_error(b, overflowing_head, 1) for name, b in (("numpy", "numpy"), ("this", be))}
    assert got == {"numpy": "CheckpointError", "this": "CheckpointError"}, got


def test_overflowing_head_refusal_names_tensors_bound_and_value(overflowing_head):
    from mtpkern import MultiModuleMtpHead
    from mtpkern.weights import LOGIT_BOUND

    with pytest.raises(ValueError) as e:
        MultiModuleMtpHead.from_pretrained(overflowing_head, backend="numpy")
    msg = str(e.value)
    assert "module 0: its final norm 'model.layers.2.shared_head.norm.weight'" in msg, msg
    assert "LM head 'lm_head.weight'" in msg
    from safetensors.numpy import load_file

    w = np.abs(load_file(overflowing_head / "model.safetensors")["lm_head.weight"]).max()
    assert f"max|W| = 64 * " in msg and f"{float(w):.6g}" in msg, msg
    assert f"expected below {LOGIT_BOUND:.6g} (2^126" in msg


def test_logit_bound_is_the_checkpoints_own(tmp_path):
    """The refusal is the bound itself: a head scaled to just below ``LOGIT_BOUND`` loads, 2%
    more is refused."""
    from safetensors.numpy import load_file

    from mtpkern.weights import LOGIT_BOUND, load_weights

    cfg = tiny_config()
    base = load_file(_scaled_checkpoint(tmp_path / "base", 1.0) / "model.safetensors")
    gmax = max(np.abs(base[f"model.layers.{cfg.layer_index(m)}.shared_head.norm.weight"]).max()
               for m in range(cfg.num_modules))
    wmax = np.abs(base["lm_head.weight"]).max()
    edge = LOGIT_BOUND / (cfg.hidden_size * float(gmax) * float(wmax))
    below = _scaled_checkpoint(tmp_path / "below", edge * 0.99)
    load_weights(below, cfg, get_backend("numpy"))
    above = _scaled_checkpoint(tmp_path / "above", edge * 1.01)
    with pytest.raises(ValueError, match="could give logits that overflow FP32"):
        load_weights(above, cfg, get_backend("numpy"))


def test_logit_bound_worst_case_is_finite(be):
    """The bound is reached: ``y = rmsnorm(h) * g`` with every |h_i| equal, ``g`` = max|g|
    everywhere and a head row ``max|W| * sign(h)`` gives ``H * max|g| * max|W|``; just below
    ``LOGIT_BOUND`` that logit is finite (the largest) on every backend, and so is every
    partial sum of the row."""
    from mtpkern.weights import LOGIT_BOUND

    H = 64
    rng = np.random.default_rng(3)
    sign = np.where(rng.random(H) < 0.5, -1.0, 1.0).astype(np.float32)
    gmax = np.float32(3.0)
    wmax = np.float32(LOGIT_BOUND / (H * 3.0) * (1 - 2.0 ** -20))
    h = (sign * np.float32(5.0))[None, :]
    w = np.stack([wmax * sign, -wmax * sign, wmax * np.ones(H, np.float32)]).astype(np.float32)
    y = be.rmsnorm(be.from_host(h), be.prepare_vector(np.full(H, gmax, np.float32)), 1e-6)
    conf = np.zeros(1, np.float32)
    ids = be.to_host(be.lm_head_argmax(y, be.prepare_weight(w), None, conf=conf))
    assert ids.tolist() == [0]
    assert be.to_host(conf)[0] == 1.0                # the others are far below: exp(-inf-ish) = 0
    top = float(np.dot(be.to_host(y)[0].astype(np.float64), w[0].astype(np.float64)))
    assert math.isfinite(top) and abs(top) < LOGIT_BOUND


def test_own_heads_are_bounded_each(tmp_path):
    """Modules with their own heads: the module whose head overflows is the one named."""
    from mtpkern.weights import load_weights

    cfg = tiny_config()
    key = f"model.layers.{cfg.layer_index(1)}.shared_head.head.weight"
    path = _scaled_checkpoint(tmp_path, 1.5e38, key=key, own_head=True)
    with pytest.raises(ValueError) as e:
        load_weights(path, cfg, get_backend("numpy"))
    assert f"module 1: its final norm 'model.layers.{cfg.layer_index(1)}.shared_head.norm.weight'" in str(e.value)
    assert f"LM head {key!r}" in str(e.value)


@pytest.mark.parametrize("factor", [1.5e38, np.nan])
def test_sharded_heads_refuse_alike(tmp_path, factor):
    """A vocabulary shard: rows only rank 1 holds overflow (or are NaN); both ranks refuse, with
    the same message: the bound is taken over the whole tensor as stored, not the rank's rows
    (before, rank 0 loaded and rank 1 loaded (overflow) or refused alone (NaN))."""
    from mtpkern.shard import Shard
    from mtpkern.weights import load_weights

    cfg = tiny_config()
    lo, _ = Shard(1, 2).vocab(cfg.vocab_size)
    path = _scaled_checkpoint(tmp_path, factor, rows=slice(lo + 8, lo + 9))
    msgs = []
    for r in range(2):
        with pytest.raises(ValueError) as e:
            load_weights(path, cfg, get_backend("numpy"), shard=Shard(r, 2))
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "'lm_head.weight'" in msgs[0], msgs


@pytest.mark.parametrize("dtype,store", [("BF16", np.uint16), ("F32", np.uint32)])
def test_abs_max_bits(dtype, store):
    """max |w| from the raw bits, chunked: signs, subnormals, infinities and NaN."""
    import ml_dtypes

    from mtpkern.weights import abs_max_bits

    np_dtype = ml_dtypes.bfloat16 if dtype == "BF16" else np.float32
    rng = np.random.default_rng(0)
    vals = (rng.standard_normal(1000) * 1e30).astype(np_dtype)
    vals[17] = np_dtype(-3e38)
    bits = vals.view(store)
    assert abs_max_bits(bits, dtype, chunk=7) == float(np.abs(vals.astype(np.float64)).max()) == float(np_dtype(3e38))
    assert abs_max_bits(np.array([1e-40, -2e-41], np_dtype).view(store), dtype) == float(np_dtype(1e-40))
    assert abs_max_bits(np.zeros(0, store), dtype) == 0.0
    vals[500] = -np.inf
    assert abs_max_bits(vals.view(store), dtype, chunk=64) == math.inf
    vals[3] = np.nan
    assert math.isnan(abs_max_bits(vals.view(store), dtype, chunk=64))


def test_non_finite_hidden_inside_a_module_raises_on_every_backend(be, tmp_path):
    """A hidden that overflows inside a module (down_proj x 3e38: the MLP's output is +-inf):
    its final norm gives NaN on every element the infinity reaches, every logit is NaN, and every
    backend raises NoAllowedToken, at the same draft position as the reference (docs/api.md)."""
    from mtpkern import MultiModuleMtpHead

    cfg = tiny_config(n_routed_experts=0, intermediate_size=48, attention_bias=False, use_qk_norm=False,
                      partial_rotary_factor=1.0, num_nextn_predict_layers=2)
    key = f"model.layers.{cfg.layer_index(0)}.mlp.down_proj.weight"
    path = _scaled_checkpoint(tmp_path, 3e38, key=key, cfg=cfg)
    H, V = cfg.hidden_size, cfg.vocab_size
    props = [MultiModuleMtpHead.from_pretrained(path, backend=b, kv_mode="exact", block_size=4, num_blocks=64)
             for b in ("numpy", be)]
    for seed in range(3):
        got = []
        for prop in props:
            prop.step_runner = None
            rng = np.random.default_rng(seed)
            st = prop.alloc_state()
            with np.errstate(over="ignore", invalid="ignore"):
                prop.prefill_drafter(rng.integers(0, V, 5).tolist(), rng.standard_normal((5, H)).astype(np.float32), st)
                with pytest.raises(NoAllowedToken, match="every logit is NaN") as e:
                    prop.propose(3, rng.standard_normal(H).astype(np.float32), 5, 2, st)
            got.append(e.value.draft)
        assert got[0] == got[1], (seed, got)
