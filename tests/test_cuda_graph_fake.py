"""The cuda code path of mtpkern.cuda_graph, on the CPU, against a fake CUDA runtime.

A NumPy backend that calls itself "cuda" stands in for CudaBackend: its ops
check every workspace the plan passes against the CUDA launchers' own shape
rules (``attention.plan``, ``lm_head.num_partials``), then compute with the
reference; ``lm_head_argmax`` returns -1 for a row without an allowed token, as
the kernel does. The fake CuPy module gives pinned memory (host bytes),
``memcpyAsync`` (a memmove between the addresses the plan computed), events,
and stream capture with a real graph's semantics: during capture nothing runs,
each launch is recorded with its arguments, and ``Graph.launch`` replays the
recorded launches. A step that read a per-call temporary would replay stale
data and differ from the eager path; the tests require bit-identical results.

What this cannot check: the kernels, CuPy's own behaviour under capture, and
timing. tests/test_gpu.py does, on a device.
"""

from __future__ import annotations

import ctypes
import inspect
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from mtpkern import MultiModuleMtpHead, NoAllowedToken
from mtpkern import cuda_graph
from mtpkern.backends.cuda_launch import _util
from mtpkern.backends.cuda_launch import attention as attn_launch
from mtpkern.backends.cuda_launch import lm_head as lm_launch
from mtpkern.backends.cuda_launch import step as step_launch
from mtpkern.backends.numpy_backend import NumpyBackend
from mtpkern.config import tiny_config
from mtpkern.ops.lm_head import bitmask_allowed, lm_head_logits, masked_argmax
from mtpkern.ops.mlp import gated_rows
from test_planned_step import run_twins

SMS = 132


class FakeRuntime:
    """Streams, events, pinned memory, memcpy, capture."""

    def __init__(self):
        self.recording: list | None = None
        self.memcpys = {"h2d": 0, "d2h": 0}
        stream = SimpleNamespace(ptr=0, synchronize=lambda: None, __enter__=None)
        self.stream = stream
        rt = self

        class Stream:
            ptr = 12345

            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

            def begin_capture(self):
                rt.recording = []

            def end_capture(self):
                rec, rt.recording = rt.recording, None
                return Graph(rec)

            def synchronize(self):
                pass

        class Graph:
            def __init__(self, launches):
                self.launches = launches

            def upload(self, stream):
                pass

            def launch(self, stream=None):
                assert rt.recording is None
                for f in self.launches:
                    f()

        class Event:
            def __init__(self, **kw):
                pass

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        def memcpy(dst, src, nbytes, kind, stream):
            assert rt.recording is None, "a memcpy inside the captured step"
            self.memcpys["h2d" if kind == 1 else "d2h"] += 1
            ctypes.memmove(dst, src, nbytes)

        self.cupy = SimpleNamespace(
            zeros=np.zeros,
            cuda=SimpleNamespace(
                alloc_pinned_memory=lambda n: bytearray(n), get_current_stream=lambda: stream,
                Stream=Stream, Event=Event,
                runtime=SimpleNamespace(memcpyAsync=memcpy, memcpyHostToDevice=1, memcpyDeviceToHost=2)))

    def launch(self, fn, *args, returns=None, **kw):
        """Run now, or record for the graph while capturing: nothing runs during capture, and
        the launch hands back its output buffers (``returns``), as a CUDA launcher does."""
        if self.recording is not None:
            self.recording.append(partial(fn, *args, **kw))
            return returns
        return fn(*args, **kw)


def _expect(name, a, shape, dtype=np.float32):
    assert a is not None, f"{name}: workspace missing"
    assert isinstance(a, np.ndarray) and a.shape == tuple(shape) and a.dtype == dtype and a.flags.c_contiguous, \
        f"{name}: expected {tuple(shape)} {np.dtype(dtype)}, got {getattr(a, 'shape', None)} {getattr(a, 'dtype', None)}"


class FakeCudaBackend(NumpyBackend):
    """The reference ops behind the CUDA launchers' keyword interface."""

    name = "cuda"

    def __init__(self, rt: FakeRuntime):
        self.rt = rt
        self.ws_seen: set[str] = set()

    def _run(self, op, *args, **kw):
        returns = (kw.get("ids"), kw.get("weights")) if op == "moe_router" else kw.get("out")
        return self.rt.launch(getattr(NumpyBackend, op), *args, returns=returns, **kw)

    def rmsnorm(self, x, w, eps, *, out=None):
        return self._run("rmsnorm", x, w, eps, out=out)

    def linear(self, x, w, bias=None, residual=None, *, out=None, norm=None):
        return self._run("linear", x, w, bias, residual, out=out, norm=norm)

    def qk_norm_rope_kv_write(self, qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w, eps, inv_freq,
                              positions, k_cache, v_cache, slots, *, out=None):
        return self._run("qk_norm_rope_kv_write", qkv, num_q_heads, num_kv_heads, q_norm_w, k_norm_w, eps,
                         inv_freq, positions, k_cache, v_cache, slots, out=out)

    def lm_head_logits(self, x, w, *, out=None):
        return self._run("lm_head_logits", x, w, out=out)

    def map_ids(self, table, ids, out=None):
        return self.rt.launch(NumpyBackend.map_ids, self, table, ids, out=out, returns=out)

    def mtp_input(self, embed, tokens, g, enorm_w, hnorm_w, eh_w, eps, *, out=None, xcat=None, zero_embed=None):
        if xcat is not None:
            _expect("xcat", xcat, (tokens.shape[0], 2 * embed.shape[1]))
            self.ws_seen.add("xcat")
        return self._run("mtp_input", embed, tokens, g, enorm_w, hnorm_w, eh_w, eps, out=out, zero_embed=zero_embed)

    def paged_attention(self, q, k_cache, v_cache, block_tables, row_seq, row_len, scale, *, row_start=None,
                        sinks=None, out=None, part_o=None, part_ml=None):
        n, Hq, D = q.shape
        NB, BS, Hkv, Dv = v_cache.shape
        if out is not None:                  # a planned step: the launcher's own partition rule
            p = attn_launch.plan(Hq // Hkv, D, block_tables.shape[1] * BS, work=n * Hkv, target_blocks=2 * SMS,
                                 Dv=Dv)
            if p.num_parts > 1:
                _expect("part_o", part_o, (n, Hq, p.num_parts, Dv))
                _expect("part_ml", part_ml, (n, Hq, p.num_parts, 2))
                self.ws_seen.add("part_o")
            else:
                assert part_o is None and part_ml is None
        return self._run("paged_attention", q, k_cache, v_cache, block_tables, row_seq, row_len, scale,
                         row_start=row_start, sinks=sinks, out=out)

    def mla_latent_write(self, kv_a, kv_a_norm_w, eps, inv_freq, positions, latent_cache, slots, *, q=None,
                         interleave=False, rope_scale=1.0, out=None):
        return self._run("mla_latent_write", kv_a, kv_a_norm_w, eps, inv_freq, positions, latent_cache, slots, q=q,
                         interleave=interleave, rope_scale=rope_scale, out=out)

    def dsa_key_write(self, k, k_norm_w, k_norm_b, eps, inv_freq, positions, index_cache, slots, *, q=None,
                      interleave=False, rope_scale=1.0, out=None):
        return self._run("dsa_key_write", k, k_norm_w, k_norm_b, eps, inv_freq, positions, index_cache, slots, q=q,
                         interleave=interleave, rope_scale=rope_scale, out=out)

    def dsa_select(self, q, weights, index_cache, block_tables, row_seq, row_len, topk, scale, *, row_start=None,
                   out=None, scores=None):
        from mtpkern.backends.cuda_launch import dsa as dsa_launch

        if out is not None:                  # a planned step: the launcher's own workspace rule
            want = dsa_launch.workspace_shapes(q.shape[0], block_tables.shape[1] * index_cache.shape[1], topk)
            if want:
                _expect("scores", scores, want["scores"])
                self.ws_seen.add("dsa scores")
            else:
                assert scores is None
        return self._run("dsa_select", q, weights, index_cache, block_tables, row_seq, row_len, topk, scale,
                         row_start=row_start, out=out)

    def mla_attention_absorbed(self, q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len, scale, *,
                               row_start=None, index=None, out=None, **ws):
        from mtpkern.backends.cuda_launch import mla as mla_launch

        n, Hq = q.shape[0], q.shape[1]
        NB, BS, W = latent_cache.shape
        L = w_uk.shape[2]
        if out is not None:                  # a planned step: the launcher's own workspace rule
            walk = mla_launch.max_rows(block_tables.shape[1] * BS, index)
            p = mla_launch.plan(Hq, L, W - L, walk, n, target_blocks=2 * SMS,
                                smem_max=227 * 1024, kv_itemsize=np.dtype(latent_cache.dtype).itemsize)
            want = mla_launch.workspace_shapes(n, Hq, L, W - L, p.num_parts)
            assert set(ws) == set(want), (sorted(ws), sorted(want))
            for key, shape in want.items():
                _expect(key, ws[key], shape)
                self.ws_seen.add(f"mla {key}")
        return self._run("mla_attention_absorbed", q, w_uk, w_uv, latent_cache, block_tables, row_seq, row_len,
                         scale, row_start=row_start, index=index, out=out)

    def sigmoid_gate(self, x, gate, residual=None, *, out=None):
        return self._run("sigmoid_gate", x, gate, residual, out=out)

    def moe_router(self, x, gate_w, bias, spec, *, ids=None, weights=None, logits=None, ticket=None, norm=None):
        if logits is not None:
            _expect("logits", logits, (x.shape[0], gate_w.shape[0]))
            self.ws_seen.add("logits")
        if ticket is not None:
            _expect("ticket", ticket, (1,), np.uint32)
            assert ticket[0] == 0
            self.ws_seen.add("router ticket")
        return self._run("moe_router", x, gate_w, bias, spec, ids=ids, weights=weights, norm=norm)

    def moe_experts(self, x, ids, weights, w13, w2, residual=None, *, out=None, act=None, partial=None,
                    limit=None, norm=None, **act_kw):
        """``act_kw``: the activation's keywords (activation, clamp_gate, situ_*), passed on."""
        activation = act_kw.get("activation", "swiglu")
        if act is not None:                  # the launcher's rule: act [n K, I] (relu2: w13 holds up alone)
            nK = ids.shape[0] * ids.shape[1]
            _expect("act", act, (nK, w13.shape[1] // gated_rows(activation)))
            _expect("partial", partial, (nK, x.shape[1]))     # LatentMoE: Lt wide
            self.ws_seen.add(("moe act" if residual is not None else "latent moe act")     # latent: no residual
                             + (" relu2" if activation == "relu2" else ""))
        return self._run("moe_experts", x, ids, weights, w13, w2, residual, out=out, limit=limit, norm=norm,
                         **act_kw)

    def swiglu_mlp(self, x, w13, w2, residual=None, *, out=None, act=None, limit=None, norm=None, **act_kw):
        activation = act_kw.get("activation", "swiglu")
        if act is not None:
            _expect("act", act, (x.shape[0], w13.shape[0] // gated_rows(activation)))
            self.ws_seen.add("mlp act" + (" relu2" if activation == "relu2" else ""))
        return self._run("swiglu_mlp", x, w13, w2, residual, out=out, limit=limit, norm=norm, **act_kw)

    def lm_head_argmax(self, x, w, bitmask=None, *, out=None, part_v=None, part_i=None, part_s=None, conf=None,
                       id_map=None, check=True, best=None, sum_exp=None):
        n, P = x.shape[0], lm_launch.num_partials(w.shape[0], SMS)
        if best is not None or sum_exp is not None:      # a vocabulary shard's partial result (the reference's)
            if sum_exp is not None and out is not None:  # planned: the launcher's workspaces all given
                assert conf is not None and part_s is not None, "sum_exp= rides on the confidence's pass"
            _expect("best", best, (n,))
            self.ws_seen.add("lm shard")
            return self.rt.launch(NumpyBackend.lm_head_argmax, x, w, bitmask, out=out, conf=conf, id_map=id_map,
                                  best=best, sum_exp=sum_exp, returns=out)
        if part_s is not None and conf is None:
            raise ValueError("part_s: the confidence workspace is used only with conf=; got part_s without conf")
        if conf is not None:                 # the launcher's rule: conf [n] FP32, written in place
            _expect("conf", conf, (n,))
        if out is not None:
            _expect("part_v", part_v, (n, P))
            _expect("part_i", part_i, (n, P), np.int32)
            if conf is not None:
                _expect("part_s", part_s, (n, P))
                self.ws_seen.add("lm conf")
            assert check is False, "a captured argmax must not read the ids back"
            self.ws_seen.add("lm parts")

        if id_map is not None:                # a draft vocabulary: ids through it, in the graph
            _expect("id_map", id_map, (w.shape[0],), np.int32)
            self.ws_seen.add("lm id_map")

        def kernel(x, w, bitmask, out, conf):
            """-1 (and conf NaN) for a row without an allowed token, as lm_head_argmax_partial/final do."""
            logits = lm_head_logits(x, w)
            ids = np.empty(x.shape[0], np.int32)
            for r in range(x.shape[0]):
                mask = None if bitmask is None else bitmask[r:r + 1]
                try:
                    ids[r] = masked_argmax(logits[r:r + 1], mask)[0]
                except NoAllowedToken:
                    ids[r] = -1
                if conf is not None:
                    conf[r] = np.nan if ids[r] < 0 else draft_confidence(x[r:r + 1], w, mask, logits[r])
            if check:
                lm_launch.raise_if_no_allowed(ids, w.shape[0])
            if id_map is not None:
                ids = np.where(ids >= 0, id_map[np.maximum(ids, 0)], -1).astype(np.int32)
            if out is None:
                return ids
            out[...] = ids
            return out

        return self.rt.launch(kernel, x, w, bitmask, out, conf, returns=out)


    def lm_head_topk(self, x, w, bitmask=None, k=1, *, id_map=None, out=None, probs=None, logits=None,
                     check=True):
        if out is not None:                  # a planned tree step: every buffer given, nothing read back
            n = x.shape[0]
            _expect("out", out, (n, k), np.int32)
            _expect("probs", probs, (n, k))
            _expect("logits", logits, (n, w.shape[0]))
            assert check is False, "a captured top-c must not read the ids back"
            self.ws_seen.add("lm topk")
        return self.rt.launch(NumpyBackend.lm_head_topk, x, w, bitmask, k, id_map=id_map, out=out, probs=probs,
                              logits=logits, check=check, returns=(out, probs))


def draft_confidence(x, w, bitmask, logits) -> float:
    """conf of one row [1, H] that has an allowed token: the NumPy backend's ``conf=`` when it
    has one, else the float64 softmax of the reference logits [V] over the allowed, non-NaN
    tokens at their maximum (exp(l - l_max) = 1 where l == l_max: an infinite maximum is shared
    by the tokens tied with it, as the kernels' online log-sum-exp)."""
    if "conf" in inspect.signature(NumpyBackend.lm_head_argmax).parameters:
        c = np.full(1, np.nan, np.float32)
        NumpyBackend.lm_head_argmax(x, w, bitmask, conf=c)
        return float(c[0])
    ok = ~np.isnan(logits)
    if bitmask is not None:
        ok &= bitmask_allowed(bitmask, logits.shape[0])[0]
    lr = logits[ok].astype(np.float64)
    top = lr.max()
    with np.errstate(invalid="ignore"):
        return float(1.0 / np.where(lr == top, 1.0, np.exp(lr - top)).sum())


@pytest.fixture
def fake_cuda(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(cuda_graph, "_cupy", lambda: rt.cupy)
    monkeypatch.setattr(_util, "sm_count", lambda: SMS)
    monkeypatch.setattr(_util, "smem_optin", lambda: 227 * 1024)
    monkeypatch.setattr(step_launch, "copy_segments",
                        lambda table: rt.launch(cuda_graph.host_copy_segments, table, [(0, 2**63)]))
    return rt


def _twins(ckpt, mode, rt, **kw):
    eager = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=mode, block_size=4,
                                               num_blocks=160, **kw)
    graph = MultiModuleMtpHead.from_pretrained(ckpt, backend=FakeCudaBackend(rt), kv_mode=mode, block_size=4,
                                               num_blocks=160, **kw)
    assert graph.step_runner is not None and graph.step_runner.capture      # cuda_graphs=True by default
    return eager, graph


def test_fake_lm_head_argmax_conf(fake_cuda):
    """The fake's conf= (which the planned step will pass with part_s): the launcher's shape
    rules, conf in (0, 1] against the softmax of the logits, 1 for a one-token mask, NaN and -1
    for a row without a token, and a captured launch writes conf only on replay."""
    be = FakeCudaBackend(fake_cuda)
    rng = np.random.default_rng(0)
    n, V, H = 3, 130, 16
    x, w = rng.standard_normal((n, H)).astype(np.float32), rng.standard_normal((V, H)).astype(np.float32)
    P = lm_launch.num_partials(V, SMS)
    mask = np.full((n, 5), -1, np.int32)
    mask[1] = 0
    mask[1, 2] = 1 << 9                                   # token 73 only
    mask[2] = 0                                           # nothing
    ws = dict(part_v=np.zeros((n, P), np.float32), part_i=np.zeros((n, P), np.int32),
              part_s=np.zeros((n, P), np.float32))
    out, conf = np.zeros(n, np.int32), np.zeros(n, np.float32)
    be.lm_head_argmax(x, w, mask, out=out, conf=conf, check=False, **ws)
    logits = lm_head_logits(x, w).astype(np.float64)
    assert out[0] == np.argmax(logits[0]) and np.isclose(conf[0], 1 / np.exp(logits[0] - logits[0].max()).sum())
    assert out[1] == 73 and conf[1] == 1.0
    assert out[2] == -1 and np.isnan(conf[2])
    assert "lm conf" in be.ws_seen
    with pytest.raises(AssertionError, match="part_s"):
        be.lm_head_argmax(x, w, mask, out=out, conf=conf, check=False, **{**ws, "part_s": None})
    with pytest.raises(AssertionError, match="conf"):
        be.lm_head_argmax(x, w, mask, conf=np.zeros(n + 1, np.float32), check=False)
    with pytest.raises(ValueError, match="part_s"):
        be.lm_head_argmax(x, w, mask, part_s=ws["part_s"], check=False)
    fake_cuda.recording = []                              # captured: nothing runs until replay
    conf[:] = 7.0
    be.lm_head_argmax(x, w, mask, out=out, conf=conf, check=False, **ws)
    assert (conf == 7.0).all()
    for f in fake_cuda.recording:
        f()
    fake_cuda.recording = None
    assert conf[1] == 1.0 and np.isnan(conf[2])


@pytest.mark.parametrize("mode", ["exact", "draft"])
@pytest.mark.parametrize("chain", ["prenorm", "postnorm"])
def test_captured_step_replays_like_eager(fake_cuda, tiny_ckpt, tiny_cfg, mode, chain):
    eager, graph = _twins(tiny_ckpt, mode, fake_cuda, chain=chain)
    rounds = [(k, [0.0, 1.0, 0.5], [None]) for k in (1, 2, 3, 3, 2, 1, 3)]
    rounds += [(3, [1.0], ["one", None]), (3, [0.0], ["one", None]), (2, [0.5], ["rows"]),
               (3, [0.0], ["none_allowed"]), (3, [1.0], [None]), (2, [1.0], ["callable"])]
    counts = run_twins(eager, graph, tiny_cfg, 4, [7, 12, 30], rounds)
    assert counts["captured"] >= 4 and counts["replayed"] >= 4, counts
    assert fake_cuda.memcpys["h2d"] == fake_cuda.memcpys["d2h"] == counts["executed"] + counts["replayed"]
    ws = {"xcat", "logits", "router ticket", "moe act", "mlp act", "lm parts"}
    assert ws <= graph.backend.ws_seen, ws - graph.backend.ws_seen


def test_captured_step_long_context_splits_attention(fake_cuda, tiny_ckpt, tiny_cfg):
    """A context long enough for several attention partitions: part_o / part_ml are planned."""
    eager, graph = _twins(tiny_ckpt, "exact", fake_cuda)
    counts = run_twins(eager, graph, tiny_cfg, 8, [300, 5], [(3, [0.0], [None])] * 3 + [(1, [1.0], [None])])
    assert counts["replayed"] >= 2
    assert "part_o" in graph.backend.ws_seen


def test_captured_dense_checkpoint(fake_cuda, tiny_ckpt_dense):
    from mtpkern.config import MtpConfig

    cfg = MtpConfig.from_json(tiny_ckpt_dense / "config.json")
    eager, graph = _twins(tiny_ckpt_dense, "exact", fake_cuda)
    counts = run_twins(eager, graph, cfg, 2, [6, 9], [(2, [0.0], [None])] * 3 + [(1, [1.0], [None])])
    assert counts["replayed"] >= 2 and "mlp act" in graph.backend.ws_seen


def test_captured_mla_checkpoint(fake_cuda, mla_ckpt, mla_cfg):
    """MLA modules in the captured step: the latent write's roped query and the absorbed
    attention's workspaces (q_full, o_lat; the split-KV partials at a long context) planned
    as the launcher's rule says."""
    eager, graph = _twins(mla_ckpt, "exact", fake_cuda)
    counts = run_twins(eager, graph, mla_cfg, 3, [7, 300], [(3, [0.0], [None])] * 3 + [(2, [1.0], [None])])
    assert counts["replayed"] >= 2
    assert {"mla q_full", "mla o_lat", "mla part_o", "mla part_ml"} <= graph.backend.ws_seen, graph.backend.ws_seen


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_gated_nope_mla_checkpoint(fake_cuda, tmp_path, mode):
    """Kimi K3's gated MLA without RoPE (tests/test_blocks.py's mla_gated) in the captured step:
    kv_a | g_proj's output in the plan's kv_a rows, the latent write reading its first L + R
    columns, the gate's columns (exact mode: moved with the last rows into the pick) through
    sigmoid_gate into ``o``; replays equal eager and no propose falls back."""
    import test_blocks
    from mtpkern import write_synthetic_checkpoint

    cfg = test_blocks.feature_config("mla_gated")
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=13, dtype="float32")
    eager, graph = _twins(ckpt, mode, fake_cuda)
    counts = run_twins(eager, graph, cfg, 3, [7, 40], [(3, [0.0], [None])] * 3 + [(2, [1.0], [None])])
    assert counts["replayed"] >= 2 and not any(v for c, v in counts.items() if c.startswith("fallback")), counts


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_dsa_checkpoint(fake_cuda, dsa_ckpt, dsa_cfg, mode):
    """DSA's indexer in the captured step: its key write and lists recorded and replayed (the
    lists' scores workspace planned as dsa_select's launcher says), the absorbed attention's
    workspaces sized for the lists' width; no propose falls back."""
    eager, graph = _twins(dsa_ckpt, mode, fake_cuda)
    counts = run_twins(eager, graph, dsa_cfg, 4, [9, 30], [(3, [0.0], [None])] * 3 + [(2, [1.0], [None])])
    assert counts["replayed"] >= 2 and not any(v for c, v in counts.items() if c.startswith("fallback")), counts
    assert {"dsa scores", "mla q_full"} <= graph.backend.ws_seen, graph.backend.ws_seen


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_step_with_confidences(fake_cuda, tiny_ckpt, tiny_cfg, mode):
    """out_conf on every propose: the captured step passes conf / part_s to the LM head (the
    launcher's shape rule) and replays the eager path's confidences; two D2H copies a call."""
    eager, graph = _twins(tiny_ckpt, mode, fake_cuda)
    counts = run_twins(eager, graph, tiny_cfg, 6, [7, 12], [(3, [0.0], [None])] * 4 + [(2, [1.0], ["one"])],
                       conf=True)
    assert counts["replayed"] >= 2 and "lm conf" in graph.backend.ws_seen
    assert fake_cuda.memcpys["d2h"] == 2 * (counts["executed"] + counts["replayed"])


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_step_with_a_draft_vocabulary(fake_cuda, tiny_ckpt, tiny_cfg, mode):
    """A draft vocabulary in the captured step: the LM heads' id_map maps rows to target ids in
    the graph (the next module reads target tokens), masks staged in the subset's bits."""
    ids = np.random.default_rng(2).permutation(301)[:150]
    eager = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend="numpy", kv_mode=mode, block_size=4,
                                               num_blocks=160, draft_vocab=ids)
    graph = MultiModuleMtpHead.from_pretrained(tiny_ckpt, backend=FakeCudaBackend(fake_cuda), kv_mode=mode,
                                               block_size=4, num_blocks=160, draft_vocab=ids)
    counts = run_twins(eager, graph, tiny_cfg, 9, [7, 12], [(3, [0.0], [None])] * 3 + [(3, [1.0], ["one"])] * 2,
                       conf=True)
    assert counts["replayed"] >= 2 and "lm id_map" in graph.backend.ws_seen


class CapturedComm:
    """A rank's communicator with NCCL's capture semantics on the fake runtime: a collective
    made while the stream captures is recorded into the graph and runs on every replay, in
    order with the kernels around it (a world of threads underneath)."""

    def __init__(self, comm, rt):
        self.comm, self.rt, self.rank, self.size = comm, rt, comm.rank, comm.size
        self.recorded = 0

    def _call(self, name, *args):
        if self.rt.recording is not None:
            self.recorded += 1
        self.rt.launch(getattr(self.comm, name), *args)

    def all_reduce(self, buf, op):
        self._call("all_reduce", buf, op)

    def all_gather(self, send, recv):
        self._call("all_gather", send, recv)

    def broadcast(self, buf, root):
        self._call("broadcast", buf, root)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_sharded_step(monkeypatch, tiny_ckpt, mode):
    """A sharded head's planned step captured and replayed (two ranks as threads, each with
    its own fake runtime): the o_proj / FFN all-reduces recorded inside the graphs, each
    draft's LM-head reduction run between them; call for call the single-rank reference's
    drafts, confidences, trees and KV slices (tests/shard_cases.py)."""
    check_captured_sharded(monkeypatch, tiny_ckpt, mode)


def check_captured_sharded(monkeypatch, ckpt, mode: str, experts: str = "ep") -> None:
    """The body of test_captured_sharded_step, for any checkpoint."""
    import threading

    import shard_cases
    from comm_cases import ThreadWorld

    rts: dict = {}

    def current():
        return rts[threading.get_ident()]

    monkeypatch.setattr(cuda_graph, "_cupy", lambda: current().cupy)
    monkeypatch.setattr(_util, "sm_count", lambda: SMS)
    monkeypatch.setattr(_util, "smem_optin", lambda: 227 * 1024)
    monkeypatch.setattr(step_launch, "copy_segments",
                        lambda table: current().launch(cuda_graph.host_copy_segments, table, [(0, 2**63)]))
    kw = dict(kv_mode=mode, block_size=4, num_blocks=160, prefill_chunk=6)
    steps = shard_cases.script(44, length=14)     # three propose rounds of one shape: plans replay
    want = shard_cases.run_script(MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", **kw), steps, True)

    def rank(comm):
        rt = rts[threading.get_ident()] = FakeRuntime()
        cc = CapturedComm(comm, rt)
        prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=FakeCudaBackend(rt), comm=cc, experts=experts, **kw)
        assert prop.step_runner is not None and prop.step_runner.capture
        log = shard_cases.run_script(prop, steps, True)
        counts = prop.step_runner.counts
        assert counts["captured"] > 0 and counts["replayed"] > 0, counts
        assert cc.recorded > 0 and "lm shard" in prop.backend.ws_seen
        return prop, log

    for prop, log in ThreadWorld(2).run(rank):
        shard_cases.compare(want, log, prop)


@pytest.mark.parametrize("norm", [False, True])
def test_captured_latent_moe_with_situ(fake_cuda, tmp_path, norm):
    """LatentMoE (fc1_latent_proj, experts of width Lt, with or without the latent norm fused into
    fc2_latent_proj) and SiTU MLPs in the captured step: its latent rows, sum and Lt-wide
    experts workspace planned; replays give the eager step's drafts bit for bit."""
    from mtpkern import write_synthetic_checkpoint
    from mtpkern.config import tiny_config

    cfg = tiny_config(mlp_act="situ", situ_beta=2.0, situ_linear_beta=4.0, num_nextn_predict_layers=2,
                      moe_latent_size=24, moe_latent_norm=norm)
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=9, dtype="float32")
    eager, graph = _twins(ckpt, "exact", fake_cuda)
    counts = run_twins(eager, graph, cfg, 5, [7, 12], [(2, [0.0], [None])] * 3 + [(1, [1.0], [None])])
    assert counts["replayed"] >= 2, counts
    assert {"latent moe act", "moe act"} & graph.backend.ws_seen == {"latent moe act"}, graph.backend.ws_seen


# -- Nemotron-3's block and the FP4 / FP8 containers in the planned step -------------------------

def _no_fallback(counts) -> None:
    """Plans ran and replayed; no propose fell back to the eager path."""
    assert counts["replayed"] >= 1, dict(counts)
    assert not {c for c, v in counts.items() if v and c.startswith("fallback")}, dict(counts)


def _nemotron(tmp_path, modules: int):
    """Nemotron-3's tiny block (tests/test_family_nemotron_h.py's NEMO: NoPE GQA, relu2 routed experts
    and a relu2 shared expert): the release's one "*E" step in its layout and config (``modules``
    1), or the same block in ``modules`` modules of the canonical layout -> (checkpoint, config)."""
    import dataclasses
    import json

    import test_family_nemotron_h
    from mtpkern import MtpConfig, write_synthetic_checkpoint

    nemo = test_family_nemotron_h.NEMO
    cfg = nemo if modules == 1 else dataclasses.replace(nemo, family="", num_nextn_predict_layers=modules)
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=13, dtype="float32")
    if modules == 1:
        (path / "config.json").write_text(json.dumps(test_family_nemotron_h.release_config(cfg)))
    read = MtpConfig.from_json(path / "config.json")
    assert read.block(0).mlp_act == "relu2" and read.block(0).nope and read.num_modules == modules
    return path, read


ROUNDS = [(3, [1.0], [None]), (2, [0.5], ["rows"]), (3, [0.0], [None]), (1, [1.0], ["one"]), (3, [0.5], [None])]


@pytest.mark.parametrize("modules", [1, 3])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_nemotron_block(fake_cuda, tmp_path, modules, mode):
    """Nemotron-3's block in the captured step (the release's one step; three modules of it, whose
    chained rows the segment copies move): the eager NumPy path's drafts and state, the relu2
    experts' and shared expert's act workspaces [rows, I] (the up rows alone, not 2I), every
    propose planned. Negative control: in exact mode a prompt shorter than the modules (P < M)
    falls back, counted, so the no-fallback check above can fail."""
    ckpt, cfg = _nemotron(tmp_path, modules)
    eager, graph = _twins(ckpt, mode, fake_cuda, chain="postnorm")
    counts = run_twins(eager, graph, cfg, 7, [7, 12], ROUNDS)
    _no_fallback(counts)
    assert counts["executed"] + counts["replayed"] == len(ROUNDS), dict(counts)
    assert {"moe act relu2", "mlp act relu2"} <= graph.backend.ws_seen, graph.backend.ws_seen
    assert "moe act" not in graph.backend.ws_seen          # no SwiGLU-shaped workspace was checked
    if modules > 1 and mode == "exact":
        counts = run_twins(eager, graph, cfg, 8, [1], [(3, [1.0], [None]), (3, [1.0], [None])])
        assert counts["fallback_short"] >= 1, dict(counts)


@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_captured_sharded_nemotron_step(monkeypatch, tmp_path, experts):
    """Nemotron-3's step sharded over two ranks in the captured step: the relu2 workspaces sized
    from the rank's own slices (the shared expert's 32 of 64 up rows; with experts by slice,
    each expert's 16 of 32), the all-reduces in the graphs; call for call one rank's."""
    check_captured_sharded(monkeypatch, _nemotron(tmp_path, 1)[0], "exact", experts)


#: container checkpoints (tests/test_quant_containers.py): NVFP4 attention, experts and router; MXFP8
#: (E8M0 scales per 32) for every projection
CONTAINERS = {"nvfp4": {"proj": "nvfp4", "mlp.gate.": "nvfp4"}, "mxfp8": {"proj": "mxfp8"}}


@pytest.mark.parametrize("fmt", sorted(CONTAINERS))
def test_captured_container_checkpoint(fake_cuda, tmp_path, fmt):
    """A compressed-tensors NVFP4 / MXFP8 checkpoint in the captured step: the plan's workspaces
    sized from the loaded weights, the eager path's drafts and state in both KV modes, none
    falling back (the kernels' packed forms: test_container_planned_on_the_kernels)."""
    from test_quant_containers import container

    ckpt, _ = container(tmp_path, tiny_config(), CONTAINERS[fmt])
    for mode in ("exact", "draft"):
        eager, graph = _twins(ckpt, mode, fake_cuda)
        _no_fallback(run_twins(eager, graph, tiny_config(), 3, [6, 9], ROUNDS[:4]))


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_nemotron_planned_on_the_kernels(emulator, tmp_path, mode):
    """Nemotron-3's release step on the emulated kernels: the captured step (relu2 experts through
    moe_expert_kernel's relu2 pass, the dense relu2 shared expert, NoPE attention) replays what
    the same backend computes eagerly, drafts and KV bit for bit; every propose planned."""
    import test_gpu
    from cuda_emu import emu_backend

    ckpt, cfg = _nemotron(tmp_path, 1)
    graph, _ = test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend("float32"), mode, 2,
                                                        prompts=(2, 20), block_size=4, num_blocks=64)
    _no_fallback(graph.step_runner.counts)


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_container_planned_on_the_kernels(emulator, tmp_path, mode):
    """A container mixing NVFP4 (attention, routed experts: CudaNvFp4's row records) and MXFP8
    (the shared expert, eh_proj: E8M0 per 32) on the emulated kernels: the captured step replays
    the eager one bit for bit, every propose planned."""
    import dataclasses

    import test_gpu
    from cuda_emu import emu_backend
    from mtpkern.backends.cuda_launch._util import CudaNvFp4
    from test_quant_containers import container

    cfg = tiny_config(num_nextn_predict_layers=2)
    ckpt, _ = container(tmp_path, cfg, {"self_attn": "nvfp4", "mlp.experts": "nvfp4", "shared_experts": "mxfp8",
                                        "eh_proj": "mxfp8"})
    graph, _ = test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend("float32"), mode, 2,
                                                        prompts=(2, 20), block_size=4, num_blocks=64)
    _no_fallback(graph.step_runner.counts)
    held = {f.name for m in graph.weights.modules for f in dataclasses.fields(m)
            if isinstance(getattr(m, f.name), CudaNvFp4)}
    assert {"w_qkv", "experts_w13"} <= held, held


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_captured_qwen3_5_checkpoint(fake_cuda, tmp_path, mode):
    """Qwen3.5 / 3.6-MoE's step (tests/test_family_qwen3_5.py's MOE2: the element-wise output gate
    interleaved in q_proj, a sigmoid-gated shared expert, softmax routing, experts packed as
    gate_up_proj, zero-centred norms; two modules) in the captured step: the eager NumPy path's
    drafts and state, the gate's workspaces, none falling back."""
    import test_family_qwen3_5
    from mtpkern import MtpConfig

    cfg = test_family_qwen3_5.MOE2
    ckpt = test_family_qwen3_5._ckpt(tmp_path / "q35", cfg, packed=True, seed=9)
    assert MtpConfig.from_json(ckpt / "config.json") == cfg
    eager, graph = _twins(ckpt, mode, fake_cuda)                  # the family's chain: postnorm
    assert graph.chain == "postnorm"
    _no_fallback(run_twins(eager, graph, cfg, 5, [7, 12], ROUNDS))
    assert {"logits", "router ticket", "moe act", "mlp act"} <= graph.backend.ws_seen, graph.backend.ws_seen


@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_qwen3_5_planned_on_the_kernels(emulator, tmp_path, mode):
    """Qwen3.5 / 3.6-MoE's two packed-expert modules on the emulated kernels: the captured step
    (the output gate, the gated shared expert) replays the eager one bit for bit, none falling back."""
    import test_family_qwen3_5
    import test_gpu
    from cuda_emu import emu_backend

    cfg = test_family_qwen3_5.MOE2
    ckpt = test_family_qwen3_5._ckpt(tmp_path / "q35", cfg, packed=True, seed=9)
    graph, _ = test_gpu.check_graph_replay_equals_eager(ckpt, cfg, emu_backend.backend("float32"), mode, 2,
                                                        prompts=(2, 20), block_size=4, num_blocks=64)
    _no_fallback(graph.step_runner.counts)
