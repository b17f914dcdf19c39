"""Tiny calls of the kernel families, for ``Backend.warm_up``; and what a loaded model needs.

A JIT backend compiles a kernel per argument type (dtype, rank, layout), not per
shape, so a call on inputs of a few elements compiles (or loads from the disk
cache) what a real propose will run. The calls use the types the head and the
proposer pass: FP32 activations, int32 indices (int64 token ids inside
``mtp_input``), weights through ``prepare_weight``, FP32 vectors through
``prepare_vector``, optional bias / residual / bitmask / window / sinks both given
and absent. The embedding table stays BF16 / FP32 (FP8 ones are refused). Only the
``Backend`` interface is used: any backend can run them.

Which families, and which weight kinds of each (``bfloat16``, ``float32``, ``fp8``),
is a ``KernelNeeds``: everything by default (what ``mtpkern kernels --cpu`` and
``bench`` build), or what one loaded checkpoint runs (``KernelNeeds.of``): a BF16 MoE
checkpoint without MLA or an output gate compiles neither the FP32 nor the FP8 GEMV
variants, nor the latent attention, nor DSA's indexer, nor the gate, nor the
hyper-connections' ops (docs/cpu.md, "Compilation and cache").
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..ops.moe import RouterSpec
from ..ops.rope_kv import inv_freq
from .base import Backend

#: tiny shapes: H hidden, Hq/Hkv heads, D head dim, V vocab, E experts (2 groups), I expert width
H, HQ, HKV, D, V, E, I = 16, 2, 1, 8, 40, 4, 8
#: rows per call and blocks of the paged KV (block size BS)
N, NB, BS = 2, 4, 4
#: the LM head again at NA rows of HA columns: where the cpu backend screens a BF16 head's
#: vocabulary on AMX tiles at that many rows (``backends/cpu.py``, ``AMX_MIN_ROWS``), that kernel
NA, HA = 4, 32

#: the kernel families, the cheapest to compile first (the order of ``family_calls``)
FAMILIES = ("rmsnorm", "moe_router", "qk_norm_rope_kv_write", "rope_heads", "paged_attention", "mla", "dsa",
            "dsa_pools", "hc", "sigmoid_gate", "linear", "mtp_input", "swiglu_mlp", "moe_experts", "lm_head")
#: the kinds of a prepared weight (``weight_kind``); an embedding table is never FP8 or FP4
WEIGHT_KINDS = ("bfloat16", "float32", "fp8", "fp4")
#: the quantized kinds (``fp8=False`` leaves them out)
_QUANTIZED_KINDS = ("fp8", "fp4")
#: families without weights of their own (their kinds are empty)
_UNWEIGHTED = frozenset({"rmsnorm", "qk_norm_rope_kv_write", "rope_heads", "paged_attention",
                         "dsa", "dsa_pools", "hc", "sigmoid_gate"})


def weight_kind(w: Any) -> str:
    """``bfloat16``, ``float32``, ``fp8`` or ``fp4``: the kind of a weight as ``prepare_weight``
    returns it (any backend: BF16 bits as uint16 or ``bfloat16``, FP32, an FP8 / FP4 weight object)."""
    if type(w).__name__.endswith("Fp8"):                 # CpuFp8, CudaFp8
        return "fp8"
    if type(w).__name__.endswith("Fp4"):                 # CpuFp4, CudaFp4
        return "fp4"
    name = getattr(getattr(w, "dtype", None), "name", None)
    if name in ("uint16", "bfloat16"):
        return "bfloat16"
    if name == "float32":
        return "float32"
    raise TypeError(f"w: expected a prepared weight (BF16 bits, bfloat16, float32 or FP8), got "
                    f"{type(w).__name__}" + (f" of dtype {name}" if name else ""))


def _kind_set(family: str, kinds: Iterable) -> frozenset:
    kinds = frozenset(kinds)
    if family == "mtp_input":           # (embedding table, eh_proj) pairs
        ok = all(isinstance(k, tuple) and len(k) == 2 and k[0] in WEIGHT_KINDS[:2] and k[1] in WEIGHT_KINDS
                 for k in kinds)
        want = "(embed, eh_proj) pairs of kinds, embed bfloat16 or float32"
    elif family in _UNWEIGHTED:
        ok, want = not kinds, "no weight kinds"
    else:
        ok = all(k in (WEIGHT_KINDS[:2] if family == "mla" else WEIGHT_KINDS) for k in kinds)
        want = f"kinds among {list(WEIGHT_KINDS[:2] if family == 'mla' else WEIGHT_KINDS)}"
    if not ok:
        raise ValueError(f"needs[{family!r}]: expected {want}, got {sorted(kinds, key=str)}")
    return kinds


class KernelNeeds:
    """The kernel families a model runs, and for each the kinds of weights it passes them.

    ``kinds``: family name (``FAMILIES``) -> a set of weight kinds (``WEIGHT_KINDS``;
    ``mtp_input``: (embedding table, eh_proj) pairs of kinds; families without weights:
    an empty set). A family absent from it is not run."""

    def __init__(self, kinds: Mapping[str, Iterable]):
        if not isinstance(kinds, Mapping):
            raise TypeError(f"kinds: expected a mapping of family -> weight kinds, got {type(kinds).__name__}")
        unknown = sorted(set(kinds) - set(FAMILIES), key=str)
        if unknown:
            raise ValueError(f"kinds: expected families among {list(FAMILIES)}, got {unknown}")
        self.kinds: dict[str, frozenset] = {f: _kind_set(f, kinds[f]) for f in FAMILIES if f in kinds}

    @classmethod
    def everything(cls, fp8: bool = True) -> "KernelNeeds":
        """Every family with every weight kind (FP8 ones unless ``fp8=False``)."""
        w = WEIGHT_KINDS if fp8 else WEIGHT_KINDS[:2]
        return cls({f: () if f in _UNWEIGHTED else
                    [(e, k) for e in WEIGHT_KINDS[:2] for k in w] if f == "mtp_input" else
                    WEIGHT_KINDS[:2] if f == "mla" else w for f in FAMILIES})

    @classmethod
    def of(cls, model: Any) -> "KernelNeeds":
        """What a loaded model runs: ``model`` a ``MultiModuleMtpHead`` (its ``weights``) or
        ``MtpWeights``. Read from each module's block (MLA or GQA, output gate, MoE), the
        config's hyper-connections (``hc_mult`` > 1) and the kinds of its prepared weights, as
        ``MtpHead``'s forward calls them."""
        from ..weights import MtpWeights

        weights = model if isinstance(model, MtpWeights) else getattr(model, "weights", None)
        if not isinstance(weights, MtpWeights):
            raise TypeError(f"model: expected a MultiModuleMtpHead or MtpWeights, got {type(model).__name__}")
        cfg = weights.config
        need: dict[str, set] = {"rmsnorm": set()}

        def add(family: str, *ws: Any) -> None:
            kinds = need.setdefault(family, set())
            kinds.update(weight_kind(w) for w in ws if w is not None)

        for m, w in enumerate(weights.modules):
            b = cfg.block(m)
            need.setdefault("mtp_input", set()).add((weight_kind(w.embed), weight_kind(w.eh_proj)))
            add("linear", w.w_qkv, w.w_o)
            if cfg.hc_mult > 1:              # the streams' collapses: their fn (FP32) through linear, then hc
                add("hc")
                add("linear", *(hc[0] for hc in (w.hc_attn, w.hc_ffn, w.hc_head)))
            if b.mla:
                add("linear", w.mla_kv_a, w.mla_q_a)
                add("mla", w.mla_uk)
                if b.dsa:
                    add("dsa")
                if b.kpool:                  # GLM-5.3's pooled indexer: a selection kernel of its own
                    add("dsa_pools")
            else:
                add("qk_norm_rope_kv_write")     # shared_kv: v_is_k, an argument of the same kernel
                add("paged_attention")
                if b.out_rope:               # the output's rotary dims turned back (DeepSeek-V4)
                    add("rope_heads")
            if b.gate_size:                  # an output gate (GQA's from q|k|v, MLA's from kv_a | g_proj)
                add("sigmoid_gate")
            if b.moe and w.gate_w is not None:
                add("moe_router", w.gate_w)
                add("moe_experts", w.experts_w13)
                if w.latent_fc1 is not None:     # LatentMoE's projections (their norm: rmsnorm / fused)
                    add("linear", w.latent_fc1, w.latent_fc2)
                if w.shared_w13 is not None:
                    add("swiglu_mlp", w.shared_w13)
                if w.shared_gate is not None:
                    add("linear", w.shared_gate)
                    add("sigmoid_gate")
            else:
                add("swiglu_mlp", w.mlp_w13)
            add("lm_head", w.head)
        return cls(need)

    def __contains__(self, family: str) -> bool:
        return family in self.kinds

    def describe(self) -> str:
        """One line: each family and its kinds."""
        def kind(k):
            return "/".join(k) if isinstance(k, tuple) else k
        return ", ".join(f + (f" [{', '.join(sorted(map(kind, ks)))}]" if ks else "") for f, ks in self.kinds.items())

    def without_fp8(self) -> "KernelNeeds":
        """The same without the quantized (FP8, FP4) weight kinds."""
        return KernelNeeds({f: [k for k in ks if not set(_QUANTIZED_KINDS) & set(k if isinstance(k, tuple) else (k,))]
                            for f, ks in self.kinds.items()})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelNeeds) and self.kinds == other.kinds

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KernelNeeds({self.describe()})"


def family_calls(be: Backend, fp8: bool = True,
                 needs: KernelNeeds | None = None) -> list[tuple[str, Callable[[], object]]]:
    """(family name, call) for every family ``needs`` names (default: all), the cheapest to
    compile first; each call runs the family with the weight kinds ``needs`` gives it (FP8
    ones only while ``fp8``)."""
    import ml_dtypes

    from ..quant import Fp4Weight, Fp8Weight

    needs = KernelNeeds.everything(fp8) if needs is None else needs if fp8 else needs.without_fp8()
    if not isinstance(needs, KernelNeeds):
        raise TypeError(f"needs: expected a KernelNeeds or None, got {type(needs).__name__}")
    rng = np.random.default_rng(0)
    host = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}

    def weights(kinds, *shape):                            # one matrix per kind, in prepare_weight's form
        out = []
        for kind in WEIGHT_KINDS:
            if kind not in kinds:
                continue
            w = rng.standard_normal(shape).astype(np.float32)
            w = (Fp8Weight.quantize(w, (128, 128)) if kind == "fp8" else Fp4Weight.quantize(w) if kind == "fp4"
                 else (w / np.sqrt(shape[-1])).astype(host[kind]))
            out.append(be.prepare_weight(w))
        return out

    def act(*shape):
        return be.from_host(rng.standard_normal(shape).astype(np.float32))

    def vec(k):
        return be.prepare_vector(np.ones(k, np.float32))

    def idx(a):
        return be.from_host(np.asarray(a, np.int32))

    x = act(N, H)
    kc, vc = be.empty_keys(NB, BS, HKV, D), be.empty_kv(NB, BS, HKV, D)
    # an FP8 KV backend's caches: codes and their scale planes (its write and attention kernels)
    skw = ({"k_scale": be.empty_kv_scales(NB, BS, HKV), "v_scale": be.empty_kv_scales(NB, BS, HKV)}
           if be.kv_fp8 else {})
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    ids, wts = idx([[0, 1], [2, 3]]), act(N, 2)                # [N, top_k] routing of each row
    bitmask = idx(np.full((N, -(-V // 32)), -1))
    kinds = needs.kinds

    def mtp_input():
        for embed_kind, eh_kind in sorted(kinds["mtp_input"]):
            [embed], [eh] = weights({embed_kind}, V, H), weights({eh_kind}, H, 2 * H)
            be.mtp_input(embed, idx([1, 2]), x, vec(H), vec(H), eh, 1e-5)

    def linear():
        for w in weights(kinds["linear"], (HQ + 2 * HKV) * D, H):
            be.linear(x, w)
            be.linear(x, w, vec(w.shape[0]), act(N, w.shape[0]))

    def rope_kv():
        be.qk_norm_rope_kv_write(act(N, (HQ + 2 * HKV) * D), HQ, HKV, vec(D), vec(D), 1e-5,
                                 be.from_host(inv_freq(D // 2, 10000.0)), idx([3, 4]), kc, vc, idx([3, 4]), **skw)
        be.qk_norm_rope_kv_write(act(N, (HQ + 2 * HKV) * D), HQ, HKV, None, None, 1e-5,
                                 be.from_host(inv_freq(D, 10000.0)), idx([5, 6]), kc, vc, idx([5, 6]), **skw)

    def rotate_heads():                                        # out_rope: the inverse rotation
        be.rope_heads(act(N, HQ, D), idx([3, 4]), be.from_host(inv_freq(D // 2, 10000.0)), interleave=True,
                      inverse=True)

    def attention():
        tables = idx([[0, 1], [2, 3]])
        be.paged_attention(act(N, HQ, D), kc, vc, tables, idx([0, 1]), idx([5, 7]), D ** -0.5, **skw)
        # a sliding window and sinks (gpt-oss / MiMo-V2 / Step-3.5 modules)
        be.paged_attention(act(N, HQ, D), kc, vc, tables, idx([0, 1]), idx([5, 7]), D ** -0.5,
                           row_start=idx([2, 0]), sinks=vec(HQ), **skw)

    def mla():
        L, R, P = 16, 8, 8                                         # the latent attention (mtpkern.ops.mla)
        cache = be.empty_latent_kv(NB, BS, L + R)
        for interleave in (False, True):
            q = be.mla_latent_write(act(N, L + R), vec(L), 1e-6, be.from_host(inv_freq(R, 10000.0)), idx([1, 2]),
                                    cache, idx([1, 2]), q=act(N, HQ, P + R), interleave=interleave)
        for uk, uv in zip(weights(kinds["mla"], HQ, P, L), weights(kinds["mla"], HQ, 8, L)):
            be.mla_attention_absorbed(q, uk, uv, cache, idx([[0, 1], [2, 3]]), idx([0, 1]), idx([5, 7]), 0.25)
            be.mla_attention_absorbed(q, uk, uv, cache, idx([[0, 1], [2, 3]]), idx([0, 1]), idx([5, 7]), 0.25,
                                      row_start=idx([2, 0]))

    def dsa():
        Di, R, Hi = 16, 8, 2                                       # the indexer (mtpkern.ops.dsa)
        icache = be.empty_latent_kv(NB, BS, Di)
        for interleave in (False, True):
            iq = be.dsa_key_write(act(N, Di), vec(Di), vec(Di), 1e-6, be.from_host(inv_freq(R, 10000.0)),
                                  idx([1, 2]), icache, idx([1, 2]), q=act(N, Hi, Di), interleave=interleave)
        tables, row_seq, row_len = idx([[0, 1], [2, 3]]), idx([0, 1]), idx([5, 7])
        be.dsa_select(iq, act(N, Hi), icache, tables, row_seq, row_len, 3, 0.25)          # both rows scored
        index = be.dsa_select(iq, act(N, Hi), icache, tables, row_seq, row_len, 4, 0.25, row_start=idx([2, 0]))
        # the attention over the listed rows (the dense one when every row lists all it sees)
        L, R, P = 16, 8, 8
        cache = be.empty_latent_kv(NB, BS, L + R)
        for uk, uv in zip(weights(kinds.get("mla") or {"bfloat16"}, HQ, P, L),
                          weights(kinds.get("mla") or {"bfloat16"}, HQ, 8, L)):
            be.mla_attention_absorbed(act(N, HQ, P + R), uk, uv, cache, tables, row_seq, row_len, 0.25,
                                      row_start=idx([2, 0]), index=index)

    def dsa_pools():
        Di, P = 8, 2                                               # pools of 2 rows (mtpkern.ops.dsa, "Pools")
        icache = be.empty_latent_kv(NB, BS, 2 * Di)                # [key | gate scores]
        iq = be.dsa_key_write(act(N, Di), vec(Di), vec(Di), 1e-6, be.from_host(inv_freq(0, 10000.0)), idx([1, 2]),
                              icache, idx([1, 2]), q=act(N, 2, Di), gate=act(N, Di))
        be.dsa_select(iq, act(N, 2), icache, idx([[0, 1], [2, 3]]), idx([0, 1]), idx([5, 7]), P, 0.25, kpool=P,
                      ape=act(P, Di), tail=True)                   # 2 and 3 pools, 1 picked: both rows scored

    def hyper_connections():
        m = 2                                                      # streams (mtpkern.ops.hc)
        X = act(N, m * H)
        u, post, comb = be.hc_pre(X, act(N, (2 + m) * m), vec((2 + m) * m), vec(3), 1e-6, 20)
        be.hc_post(u, X, post, comb)
        be.hc_head(X, act(N, m), vec(m), vec(1), 1e-6)

    def gate():
        y = act(N, HQ * D)
        be.sigmoid_gate(y, act(N, HQ), y)                          # head-wise, with the residual
        be.sigmoid_gate(y, act(N, HQ * D), out=y)                  # element-wise, in place

    def router():
        for gate_w in weights(kinds["moe_router"], E, H):
            be.moe_router(x, gate_w, vec(E), spec)

    def experts():
        k = kinds["moe_experts"]
        for w13, w2 in zip(weights(k, E, 2 * I, H), weights(k, E, H, I)):
            be.moe_experts(x, ids, wts, w13, w2, x)
            be.moe_experts(x, ids, wts, w13, w2)

    def mlp():
        k = kinds["swiglu_mlp"]
        for w13, w2 in zip(weights(k, 2 * I, H), weights(k, H, I)):
            be.swiglu_mlp(x, w13, w2, x)

    def lm_head():
        for w in weights(kinds["lm_head"], V, H):
            be.lm_head_argmax(x, w)
            be.lm_head_argmax(x, w, bitmask)
            be.lm_head_argmax(x, w, conf=act(N))               # the confidences' own path
            be.lm_head_logits(x, w)
        for w in weights(kinds["lm_head"] & {"bfloat16"}, V, HA):
            be.lm_head_argmax(act(NA, HA), w)

    calls = {"rmsnorm": lambda: be.rmsnorm(x, vec(H), 1e-5), "moe_router": router, "qk_norm_rope_kv_write": rope_kv,
             "paged_attention": attention, "mla": mla, "dsa": dsa, "dsa_pools": dsa_pools,
             "hc": hyper_connections,
             "sigmoid_gate": gate, "linear": linear,
             "mtp_input": mtp_input, "swiglu_mlp": mlp, "moe_experts": experts, "lm_head": lm_head,
             "rope_heads": rotate_heads}
    # a weighted family with no kinds left (FP8 only, fp8=False) has nothing to run
    return [(f, calls[f]) for f in FAMILIES if f in kinds and (f in _UNWEIGHTED or kinds[f])]
