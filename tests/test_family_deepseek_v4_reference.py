"""DeepSeek-V4's MTP layer against an independent float64 model that reads the release.

mtpkern's own oracle (mtpkern.testing.oracle) reads its weights through mtpkern's loader,
after the ``deepseek_v4`` family's load-time folds (the release names renamed, ``e_proj`` and
``h_proj`` joined into ``eh_proj``, each head's rotary-last dims moved first, the unweighted
per-head query norm as ones): a wrong fold is the oracle's too, and it cannot see one. The
model here reads the checkpoint's bytes itself, by the release's own names (``mtp.{m}.e_proj``,
``attn.wq_a``, ``ffn.experts.{e}.w1`` ...), dequantizes FP8 / FP4 itself, takes its
hyperparameters from the release-form config.json it writes (``qk_rope_head_dim``,
``swiglu_limit``, the target's ``rope_scaling`` / ``compress_ratios`` that the MTP layer does
not read), and computes V4's MTP layer in float64 from its formulas, with no code of
mtpkern's: RoPE on the LAST ``qk_rope_head_dim`` dims of each head, the value being the
rotated key, the output's rotary dims turned back, sinks, the window, hyper-connections,
sqrtsoftplus routing and the clamped SwiGLU.

Negative controls (the reference with RoPE on the first dims, with e_proj / h_proj swapped,
without the output's inverse RoPE; without the window, the sinks or the SwiGLU clamp, which
shows the rows reach them) must disagree with mtpkern. The release's config.json has no
``embed_mask_pos0``: the family's default, vLLM's position-0 mask, holds, and the model here
masks as vLLM does (without the mask, module 0's first row disagrees).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.head import RowJob
from mtpkern.tolerance import assert_close

#: the release's features at test size: hidden 64, 4 query heads of 32 with 8 rotary dims, one
#: K = V head, a query latent of 24, 2 output groups of rank 16, a window of 6, 4 streams,
#: 3 modules, 8 experts top-2 and a shared one
V4 = dict(family="deepseek_v4", num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, rope_interleave=True,
          q_lora_rank=24, shared_kv=True, out_rope=True, o_groups=2, o_lora_rank=16, attn_sinks=True,
          attention_bias=False, sliding_window=6, hc_mult=4, scoring_func="sqrtsoftplus", n_group=1, topk_group=1,
          swiglu_clamp=1.5, swiglu_clamp_shared=1.5, swiglu_clamp_gate=True, rms_norm_eps=1e-6)
#: rows of one sequence per module: more than the window of 6, so the window and the sinks matter
ROWS = 9


# -- the checkpoint, read without mtpkern --------------------------------------------------------

#: safetensors dtype -> NumPy dtype. Read from the file's header and bytes here: safetensors'
#: own NumPy reader (0.8) has no type for F8_E4M3 / F8_E8M0 (it asks NumPy for
#: ``np.float8_e4m3fn``, which ml_dtypes does not register there)
_DTYPES = {"F64": np.float64, "F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I8": np.int8, "U8": np.uint8}


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file: an 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the data."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(body[a:b], dtype=_DTYPES[h["dtype"]]).reshape(h["shape"])
    return out


@dataclasses.dataclass
class ReleaseFiles:
    """A release-form checkpoint as its files hold it: every tensor by its stored name (``t``)
    and its config.json (``c``); ``text``: the text model's config (a wrapper's
    ``text_config``, else the config itself). The family references build on it."""
    t: dict
    c: dict

    @property
    def text(self) -> dict:
        return self.c.get("text_config", self.c)

    @classmethod
    def read(cls, path, config: dict | None = None):
        """The tensors of ``path/*.safetensors`` and ``config`` (default: ``path/config.json``)."""
        t = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            t.update(read_safetensors(f))
        return cls(t, json.loads((Path(path) / "config.json").read_text()) if config is None else config)


def e8m0(scale: np.ndarray) -> np.ndarray:
    """E8M0 codes -> 2^(byte - 127)."""
    assert scale.dtype == ml_dtypes.float8_e8m0fnu
    return np.exp2(scale.view(np.uint8).astype(np.float64) - 127)


#: E2M1 codes 0..15
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def weight(t: dict, name: str, block: tuple[int, int]) -> np.ndarray:
    """``name.weight`` in float64: FP8 E4M3 times its E8M0 ``name.scale`` per ``block``;
    packed FP4 (int8 [N, K/2], input 2k in the low nibble) times 2^(scale - 127) per 32
    inputs; else the stored values."""
    w = t[name + ".weight"]
    if w.dtype == np.int8:
        codes = w.view(np.uint8)
        N, K = codes.shape[0], 2 * codes.shape[1]
        v = np.empty((N, K))
        v[:, 0::2], v[:, 1::2] = E2M1[codes & 15], E2M1[codes >> 4]
        return v * np.repeat(e8m0(t[name + ".scale"]), 32, axis=1)[:, :K]
    if w.dtype == ml_dtypes.float8_e4m3fn:
        bn, bk = block
        s = e8m0(t[name + ".scale"])
        return w.astype(np.float64) * np.repeat(np.repeat(s, bn, 0), bk, 1)[:w.shape[0], :w.shape[1]]
    assert name + ".scale" not in t, name
    return w.astype(np.float64)


def release_config(cfg, fp8_block=None) -> dict:
    """config.json as DeepSeek-V4 releases it (its fields, tiny sizes): ``qk_rope_head_dim``,
    ``swiglu_limit``, the target's compressed layers' fields, FP8 with E8M0 scales."""
    R = int(round(cfg.head_dim * cfg.partial_rotary_factor))
    layers, M = cfg.num_hidden_layers, cfg.num_modules
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
        "hc_eps": cfg.hc_eps, "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "hidden_size": cfg.hidden_size, "index_head_dim": 16,
        "index_n_heads": 4, "index_topk": 8, "max_position_embeddings": cfg.max_position_embeddings,
        "moe_intermediate_size": cfg.moe_intermediate_size, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "norm_topk_prob": True,
        "num_attention_heads": cfg.num_attention_heads, "num_experts_per_tok": cfg.num_experts_per_tok,
        "num_hidden_layers": layers, "num_hash_layers": 1, "num_key_value_heads": 1, "num_nextn_predict_layers": M,
        "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank, "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": R, "rms_norm_eps": cfg.rms_norm_eps,
        # the target's compressed layers' YaRN: the MTP layer (a sliding-window one) has plain RoPE
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 256,
                         "type": "yarn"},
        "rope_theta": cfg.rope_theta, "routed_scaling_factor": cfg.routed_scaling_factor,
        "scoring_func": "sqrtsoftplus", "sliding_window": cfg.sliding_window, "swiglu_limit": cfg.swiglu_clamp,
        "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "compress_rope_theta": 160000, "compress_ratios": [0, 4] + [0] * M,
    }
    if fp8_block is not None:
        d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": list(fp8_block)}
    return d


# -- the model ----------------------------------------------------------------------------------

def rms(x: np.ndarray, w, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def rope(x: np.ndarray, pos: np.ndarray, R: int, theta: float, first: bool = False) -> np.ndarray:
    """x [n, h, D], pos [n]: the pairs (x[s + 2i], x[s + 2i + 1]), s = D - R (the last R dims;
    ``first``: s = 0), turned by pos * theta^(-2i / R)."""
    D = x.shape[-1]
    s = 0 if first else D - R
    ang = pos[:, None] * theta ** (-np.arange(0, R, 2) / R)                 # [n, R/2]
    c, si = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    a, b = x[..., s:s + R:2], x[..., s + 1:s + R:2]
    out[..., s:s + R:2] = a * c - b * si
    out[..., s + 1:s + R:2] = a * si + b * c
    return out


class Module:
    """Module ``m`` of the release at ``t`` (tensors by the release's names), config ``c``
    (the release's config.json)."""

    def __init__(self, t: dict, c: dict, m: int):
        blk = tuple(c["quantization_config"]["weight_block_size"]) if "quantization_config" in c else None
        p = f"mtp.{m}."
        self.c, self.m = c, m
        self.W = lambda name: weight(t, p + name, blk)
        self.V = lambda name: t[p + name].astype(np.float64)
        self.embed, self.head = weight(t, "embed", blk), weight(t, "head", blk)

    # hyper-connections: x [n, mult, H]
    def hc_pre(self, Y: np.ndarray, kind: str):
        c, (n, mult, H) = self.c, Y.shape
        eps, heps = c["rms_norm_eps"], c["hc_eps"]
        fn, base, scale = self.V(f"hc_{kind}_fn"), self.V(f"hc_{kind}_base"), self.V(f"hc_{kind}_scale")
        x = Y.reshape(n, mult * H)
        z = x @ fn.T / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)          # [n, (2 + mult) mult]
        pre = sigmoid(z[:, :mult] * scale[0] + base[:mult]) + heps                     # [n, mult]
        post = 2 * sigmoid(z[:, mult:2 * mult] * scale[1] + base[mult:2 * mult])
        logits = z[:, 2 * mult:].reshape(n, mult, mult) * scale[2] + base[2 * mult:].reshape(mult, mult)
        e = np.exp(logits - logits.max(axis=2, keepdims=True))
        C = e / e.sum(axis=2, keepdims=True) + heps                                    # [n, i, j]
        C = C / (C.sum(axis=1, keepdims=True) + heps)
        for _ in range(c["hc_sinkhorn_iters"] - 1):
            C = C / (C.sum(axis=2, keepdims=True) + heps)
            C = C / (C.sum(axis=1, keepdims=True) + heps)
        u = np.einsum("ni,nih->nh", pre, Y)
        return u, post, C

    @staticmethod
    def hc_post(f: np.ndarray, Y: np.ndarray, post: np.ndarray, C: np.ndarray) -> np.ndarray:
        return post[:, :, None] * f[:, None, :] + np.einsum("nij,nih->njh", C, Y)

    def attention(self, a: np.ndarray, pos: np.ndarray, wrong: str | None) -> np.ndarray:
        c, W, V = self.c, self.W, self.V
        eps, D, R, theta = c["rms_norm_eps"], c["head_dim"], c["qk_rope_head_dim"], c["rope_theta"]
        Hq, g, win = c["num_attention_heads"], c["o_groups"], c["sliding_window"]
        if wrong == "no_window":
            win = np.inf
        n = a.shape[0]
        first = wrong == "rope_first"
        qr = rms(a @ W("attn.wq_a").T, V("attn.q_norm.weight"), eps)                   # [n, q_lora]
        q = (qr @ W("attn.wq_b").T).reshape(n, Hq, D)
        q = rms(q, 1.0, eps)                                                           # per head, no weight
        q = rope(q, pos, R, theta, first)
        kv = rms(a @ W("attn.wkv").T, V("attn.kv_norm.weight"), eps)[:, None, :]       # [n, 1, D]
        kv = rope(kv, pos, R, theta, first)[:, 0]                                      # key = value
        sink = V("attn.attn_sink") if wrong != "no_sinks" else np.full(Hq, -np.inf)    # [Hq]
        o = np.empty((n, Hq, D))
        for r in range(n):                       # rows of one sequence: key r sits at pos[r]
            keys = [j for j in range(r + 1) if pos[r] - win < pos[j] <= pos[r]]
            s = q[r] @ kv[keys].T / np.sqrt(D)                                         # [Hq, keys]
            M = np.maximum(s.max(axis=1), sink)
            e = np.exp(s - M[:, None])
            w = e / (e.sum(axis=1) + np.exp(sink - M))[:, None]
            o[r] = w @ kv[keys]
        if wrong != "no_inverse_rope":
            o = rope(o, -pos, R, theta, first)
        wo_a, r_o = W("attn.wo_a"), c["o_lora_rank"]
        hg = Hq // g
        z = np.concatenate([o[:, k * hg:(k + 1) * hg].reshape(n, hg * D) @ wo_a[k * r_o:(k + 1) * r_o].T
                            for k in range(g)], axis=1)                                # [n, g r_o]
        return z @ W("attn.wo_b").T

    def moe(self, b: np.ndarray, wrong: str | None) -> np.ndarray:
        c, W = self.c, self.W
        L, k = c["swiglu_limit"] if wrong != "no_clamp" else np.inf, c["num_experts_per_tok"]

        def swiglu(x, name):
            gate, up = x @ W(name + ".w1").T, x @ W(name + ".w3").T
            h = np.minimum(gate, L)
            return (h * sigmoid(h) * np.clip(up, -L, L)) @ W(name + ".w2").T

        logits = b @ W("ffn.gate").T                                                   # [n, E]
        s = np.sqrt(np.logaddexp(0, logits))                                           # sqrt(softplus)
        pick = s + self.V("ffn.gate.bias")
        out = np.zeros_like(b)
        for r in range(b.shape[0]):
            idx = np.argsort(-pick[r], kind="stable")[:k]
            assert pick[r, idx[-1]] - np.sort(pick[r])[::-1][k] > 1e-6, "a near tie in the top-k"
            w = s[r, idx] / s[r, idx].sum() * c["routed_scaling_factor"]
            for e, we in zip(idx, w):
                out[r] += we * swiglu(b[r:r + 1], f"ffn.experts.{e}")[0]
        return out + swiglu(b, "ffn.shared_experts")

    def forward(self, toks, g: np.ndarray, wrong: str | None = None):
        """Rows ``toks`` [n] of one sequence at positions m + 1, m + 2, ... with the hidden
        ``g`` [n, mult H] -> (y [n, mult H], normed [n, H])."""
        c, W, V = self.c, self.W, self.V
        eps, mult, H = c["rms_norm_eps"], c["hc_mult"], c["hidden_size"]
        n = len(toks)
        pos = np.arange(n) + self.m + 1
        emb = self.embed[toks]                                                        # [n, H]
        if c.get("embed_mask_pos0", True) and wrong != "no_pos0_mask":
            # vLLM (deepseek_v4_mtp.py) zeroes the embedding of the row at its position 0 before
            # enorm: the pair (t_1, h_0), which sits here at position 1 (vLLM numbers a row by its
            # hidden, these rows by their token); the release's config is read with it on
            emb = np.where((pos == 1)[:, None], 0.0, emb)
        e = rms(emb, V("enorm.weight"), eps)                                          # [n, H]
        X = rms(g.astype(np.float64).reshape(n, mult, H), V("hnorm.weight"), eps)     # [n, mult, H]
        pe, ph = W("e_proj"), W("h_proj")
        if wrong == "eh_swapped":
            pe, ph = ph, pe
        Y = (e @ pe.T)[:, None, :] + X @ ph.T                                          # the streams
        u, post, C = self.hc_pre(Y, "attn")
        Y = self.hc_post(self.attention(rms(u, V("attn_norm.weight"), eps), pos, wrong), Y, post, C)
        u, post, C = self.hc_pre(Y, "ffn")
        Y = self.hc_post(self.moe(rms(u, V("ffn_norm.weight"), eps), wrong), Y, post, C)
        x = Y.reshape(n, mult * H)
        z = x @ V("hc_head_fn").T / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)
        pre = sigmoid(z * V("hc_head_scale")[0] + V("hc_head_base")) + c["hc_eps"]
        normed = rms(np.einsum("ni,nih->nh", pre, Y), V("norm.weight"), eps)
        return x, normed


# -- mtpkern against it ---------------------------------------------------------------------------

def _checkpoint(path, quantized: bool):
    cfg = (tiny_config(**V4, weight_quant="fp8", fp8_block=(16, 16), expert_quant="fp4") if quantized
           else tiny_config(**V4))
    path = write_synthetic_checkpoint(path, cfg, seed=3, dtype="bfloat16" if quantized else "float32")
    c = release_config(cfg, (16, 16) if quantized else None)
    (path / "config.json").write_text(json.dumps(c))
    t = read_safetensors(path / "model.safetensors")
    rng = np.random.default_rng(11)
    toks = rng.integers(0, cfg.vocab_size, ROWS)
    g = rng.standard_normal((ROWS, cfg.stream_size)).astype(np.float32)
    return path, c, t, toks, g


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4ref")
    return {"dense": _checkpoint(root / "dense", False), "fp8_fp4": _checkpoint(root / "fp8", True)}


@pytest.fixture(scope="module")
def runs(ckpts):
    """(checkpoint, backend) -> (y, normed) of each module for the checkpoint's rows ``toks``
    on one fresh sequence (keys 0..n-1 at positions m + 1 ...: RowJob's key_to_pos) from its
    hidden ``g``; each loaded and run once."""
    memo = {}

    def get(which: str, backend: str) -> list[tuple[np.ndarray, np.ndarray]]:
        if (which, backend) not in memo:
            path, _, _, toks, g = ckpts[which]
            prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, block_size=4, num_blocks=64)
            out = []
            for m, head in enumerate(prop.modules):
                y, normed = head.forward([RowJob(head.alloc_seq(), np.asarray(toks, np.int32), 0, m + 1, None)], g)
                out.append((prop.backend.to_host(y), prop.backend.to_host(normed)))
            memo[which, backend] = out
        return memo[which, backend]

    return get


def test_the_reader_reads_what_safetensors_reads(ckpts):
    path = ckpts["dense"][0] / "model.safetensors"
    ours, theirs = read_safetensors(path), load_file(str(path))
    assert ours.keys() == theirs.keys() and "mtp.0.e_proj.weight" in ours and "mtp.2.hc_head_fn" in ours
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k], theirs[k]), k


def test_the_quantized_release_is_fp8_and_fp4(ckpts):
    """The FP8 checkpoint holds what the model above dequantizes (not dense values in disguise)."""
    t = ckpts["fp8_fp4"][2]
    assert t["mtp.1.attn.wq_b.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert t["mtp.1.attn.wq_b.scale"].dtype == ml_dtypes.float8_e8m0fnu
    assert t["mtp.1.attn.wq_b.scale"].shape == (128 // 16, 24 // 16 + 1)
    assert t["mtp.1.ffn.experts.5.w2.weight"].dtype == np.int8 and t["mtp.1.ffn.experts.5.w2.weight"].shape == (64, 16)
    assert t["mtp.1.ffn.experts.5.w2.scale"].shape == (64, 1)
    assert len(np.unique(t["mtp.1.attn.wq_b.scale"].view(np.uint8))) > 1       # the scales matter


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("which", ["dense", "fp8_fp4"])
def test_modules_equal_the_float64_release_model(ckpts, runs, which, backend):
    """Every module's streams ``y`` and ``normed`` at float32 tolerance. The FP8 / FP4 weights
    dequantize exactly (a code times a power of two) and mtpkern computes in FP32 over them,
    so the quantized checkpoint needs no looser tolerance than the dense one."""
    _, c, t, toks, g = ckpts[which]
    got = runs(which, backend)
    assert len(got) == c["num_nextn_predict_layers"] == 3
    for m, (y, normed) in enumerate(got):
        want_y, want_n = Module(t, c, m).forward(toks, g)
        assert np.abs(want_y).max() > 0.1 and np.abs(want_n).max() > 0.1
        assert_close(y, want_y, "float32", f"{which} {backend} module {m}: y")
        assert_close(normed, want_n, "float32", f"{which} {backend} module {m}: normed")


@pytest.mark.parametrize("which", ["dense", "fp8_fp4"])
def test_the_position_0_mask_reaches_module_0(ckpts, runs, which):
    """The reference without vLLM's position-0 mask disagrees with module 0 on its first row
    (key 0, position 1: no embedding in it) and agrees with the later modules, whose rows sit
    at positions 2 and up."""
    _, c, t, toks, g = ckpts[which]
    for m, (y, normed) in enumerate(runs(which, "numpy")):
        want_y, _ = Module(t, c, m).forward(toks, g, "no_pos0_mask")
        if m == 0:
            assert not np.allclose(y[0], want_y[0], atol=1e-3), "module 0's first row"
        else:
            assert_close(y, want_y, "float32", f"{which} module {m} without the mask")


@pytest.mark.parametrize("which", ["dense", "fp8_fp4"])
@pytest.mark.parametrize("wrong", ["rope_first", "eh_swapped", "no_inverse_rope", "no_window", "no_sinks", "no_clamp"])
def test_negative_controls_fail(ckpts, runs, which, wrong):
    """The reference with one thing wrong: RoPE on each head's first dims, e_proj / h_proj
    swapped, the output's rotary dims not turned back; and, to show that the rows reach
    them, no window, no sinks, no SwiGLU clamp."""
    _, c, t, toks, g = ckpts[which]
    for m, (y, normed) in enumerate(runs(which, "numpy")):
        want_y, want_n = Module(t, c, m).forward(toks, g, wrong)
        with pytest.raises(AssertionError):
            assert_close(y, want_y, "float32", f"{which} module {m} against the reference {wrong}")
        with pytest.raises(AssertionError):
            assert_close(normed, want_n, "float32", f"{which} module {m} against the reference {wrong}")
