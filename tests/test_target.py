"""The reference target (mtpkern/target.py) and the real speculative loop (mtpkern/loop.py).

- the target's hiddens and greedy tokens against a float64 NumPy GLM-4.5 decoder stack written
  here from the raw tensors (transformers' models/glm4_moe/modeling_glm4_moe.py, step by step);
- decode == prefill of the longer prompt; verify accepts exactly the drafts that match the
  greedy continuation, and leaves the KV a fresh prefill of the accepted tokens has;
- lossless: ``speculative_generate`` == ``greedy_generate`` token for token, both KV modes,
  numpy and cpu (and the target on the emulated cuda backend), with the synthetic drafter, a
  perfect one (acceptance 1) and a random one (acceptance near 0);
- a loop that skips ``after_verify`` or the catch-up: what catches it.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from mtpkern import KvCacheFull, MultiModuleMtpHead, ReferenceTarget, StateError, write_synthetic_checkpoint
from mtpkern.config import tiny_config
from mtpkern.errors import CheckpointError, ConfigError
from mtpkern.loop import Decisions, greedy_generate, speculative_generate
from mtpkern.weights import load_target_weights, read_tensors

#: a GLM-4.5-shaped target: layer 0 dense, layer 1 MoE (8 experts, top 2 in 2 of 4 groups,
#: a shared expert), q/k/v biases, q/k norms, half of each head rotated; 3 MTP modules
CFG = tiny_config(family="glm4_moe", num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=48)
PROMPTS = [[5, 17, 250, 3, 99, 42], [7], [300, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("target"), CFG, seed=5, target_layers=True)


@pytest.fixture(scope="module")
def targets(ckpt):
    return {}


def target_on(ckpt, targets, backend):
    if backend not in targets:
        targets[backend] = ReferenceTarget.from_pretrained(ckpt, backend=backend, block_size=4, num_blocks=128)
    return targets[backend]


# -- the float64 reference --------------------------------------------------------------

def _rms(x, w, eps):       # Glm4MoeRMSNorm
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, rd, theta):
    """apply_rotary_pos_emb on the first ``rd`` dims (Glm4MoeRotaryEmbedding, rotate_half)."""
    inv = 1.0 / theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    f = pos[:, None] * inv[None, :]                                   # [n, rd/2]
    cos, sin = np.cos(np.concatenate([f, f], -1)), np.sin(np.concatenate([f, f], -1))
    r, rest = x[..., :rd], x[..., rd:]
    half = np.concatenate([-r[..., rd // 2:], r[..., :rd // 2]], -1)
    return np.concatenate([r * cos[:, None] + half * sin[:, None], rest], -1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp(x, p, t):        # Glm4MoeMLP
    return (_silu(x @ t[p + "gate_proj.weight"].T) * (x @ t[p + "up_proj.weight"].T)) @ t[p + "down_proj.weight"].T


def _moe(x, p, t, cfg):
    """Glm4MoeMoE: Glm4MoeTopkRouter (sigmoid, bias for the choice only, group-limited top-k)."""
    E, K, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
    scores = 1.0 / (1.0 + np.exp(-(x @ t[p + "gate.weight"].T)))          # [n, E]
    choice = scores + t[p + "gate.e_score_correction_bias"]
    groups = np.sort(choice.reshape(-1, G, E // G), -1)[..., -2:].sum(-1)  # [n, G]: top-2 sum
    keep = np.argsort(-groups, -1, kind="stable")[:, :cfg.topk_group]
    mask = np.zeros_like(groups, bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(np.repeat(mask, E // G, -1), choice, 0.0)           # masked_fill(..., 0.0)
    idx = np.argsort(-choice, -1, kind="stable")[:, :K]
    w = np.take_along_axis(scores, idx, -1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        for e, we in zip(idx[i], w[i]):
            out[i] += we * _mlp(x[i:i + 1], p + f"experts.{e}.", t)[0]
    return out + (_mlp(x, p + "shared_experts.", t) if cfg.n_shared_experts else 0.0)


def reference(t, cfg, tokens):
    """Glm4MoeModel + lm_head over ``tokens`` from position 0, float64: (hiddens after
    model.norm [n, H], logits [n, V])."""
    n = len(tokens)
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rd, eps = int(D * cfg.partial_rotary_factor), cfg.rms_norm_eps
    pos = np.arange(n, dtype=np.float64)
    x = t["model.embed_tokens.weight"][tokens]
    for layer in range(cfg.num_hidden_layers):                     # Glm4MoeDecoderLayer
        p = f"model.layers.{layer}."
        a = _rms(x, t[p + "input_layernorm.weight"], eps)
        q, k, v = ((a @ t[p + f"self_attn.{c}_proj.weight"].T + t.get(p + f"self_attn.{c}_proj.bias", 0.0))
                   .reshape(n, -1, D) for c in "qkv")
        if cfg.use_qk_norm:
            q, k = (_rms(z, t[p + f"self_attn.{c}_norm.weight"], eps) for z, c in ((q, "q"), (k, "k")))
        q, k = _rope(q, pos, rd, cfg.rope_theta), _rope(k, pos, rd, cfg.rope_theta)
        k, v = np.repeat(k, Hq // Hkv, 1), np.repeat(v, Hq // Hkv, 1)   # repeat_kv
        s = np.einsum("qhd,khd->hqk", q, k) * D ** -0.5 + np.triu(np.full((n, n), -np.inf), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, Hq * D)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        f = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        moe = cfg.n_routed_experts and layer >= cfg.first_k_dense_replace
        x = x + (_moe(f, p + "mlp.", t, cfg) if moe else _mlp(f, p + "mlp.", t))
    h = _rms(x, t["model.norm.weight"], eps)
    return h, h @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def raw(ckpt):
    return {k: np.asarray(v, np.float64) for k, v in read_tensors(ckpt).items()}


# -- the target against the reference ----------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_target_matches_float64_reference(ckpt, targets, raw, backend):
    tgt = target_on(ckpt, targets, backend)
    tokens = PROMPTS[0] + PROMPTS[2]
    seq = tgt.alloc_seq()
    out = tgt.prefill(seq, tokens)
    tgt.free_seq(seq)
    h, logits = reference(raw, CFG, tokens)
    np.testing.assert_allclose(out.hiddens, h, rtol=2e-4, atol=2e-4)
    top2 = np.sort(logits, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-2                          # rows whose argmax no rounding flips
    assert clear.sum() >= len(tokens) - 1
    np.testing.assert_array_equal(out.greedy[clear], logits.argmax(-1)[clear])
    assert out.next_token == out.greedy[-1]
    # negative control: the reference without the MoE layer's shared expert is far from the target
    t2 = dict(raw, **{k: 0 * v for k, v in raw.items() if ".1.mlp.shared_experts.down" in k})
    assert np.abs(reference(t2, CFG, tokens)[0] - out.hiddens).max() > 1e-2


@pytest.mark.parametrize("over", [
    dict(use_qk_norm=False, attention_bias=False, n_shared_experts=0, first_k_dense_replace=0),
    dict(n_routed_experts=0, num_hidden_layers=3)], ids=["all-moe-no-qk-norm", "all-dense"])
def test_other_layer_forms_match_the_reference(tmp_path, over):
    cfg = tiny_config(**{**dict(family="glm4_moe", num_hidden_layers=2, intermediate_size=40), **over})
    ckpt = write_synthetic_checkpoint(tmp_path, cfg, seed=9, target_layers=True, dtype="float32")
    raw = {k: np.asarray(v, np.float64) for k, v in read_tensors(ckpt).items()}
    kinds = ["gate_proj" if f"model.layers.{i}.mlp.gate_proj.weight" in raw else "experts"
             for i in range(cfg.num_hidden_layers)]
    assert kinds == ["gate_proj" if not cfg.target_block(i).moe else "experts" for i in range(cfg.num_hidden_layers)]
    assert set(kinds) == ({"experts"} if cfg.n_routed_experts else {"gate_proj"})
    tgt = ReferenceTarget.from_pretrained(ckpt, backend="numpy", block_size=4, num_blocks=16)
    seq = tgt.alloc_seq()
    tokens = PROMPTS[2]
    np.testing.assert_allclose(tgt.prefill(seq, tokens).hiddens, reference(raw, cfg, tokens)[0], rtol=2e-4, atol=2e-4)


def test_packed_experts_load_as_per_expert_ones(tmp_path, ckpt, targets):
    """A target layer's routed experts as transformers' packed pair (gate_up_proj [E, 2I, H], each
    expert's gate rows over its up rows; down_proj [E, H, I]) run as the per-expert tensors do."""
    import shutil

    from safetensors.numpy import save_file

    t, p, E = read_tensors(ckpt), "model.layers.1.mlp.experts.", CFG.n_routed_experts
    ex = {n: np.stack([t.pop(f"{p}{e}.{n}_proj.weight") for e in range(E)]) for n in ("gate", "up", "down")}
    t[p + "gate_up_proj"] = np.concatenate([ex["gate"], ex["up"]], axis=1)
    t[p + "down_proj"] = ex["down"]
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    packed = ReferenceTarget.from_pretrained(tmp_path, backend="numpy", block_size=4, num_blocks=16)
    flat = target_on(ckpt, targets, "numpy")
    outs = []
    for tgt in (packed, flat):
        seq = tgt.alloc_seq()
        outs.append(tgt.prefill(seq, PROMPTS[2]).hiddens)
        tgt.free_seq(seq)
    np.testing.assert_array_equal(outs[0], outs[1])
    t[p + "gate_up_proj"] = np.concatenate([ex["up"], ex["gate"]], axis=1)     # negative control: up over gate
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    swapped = ReferenceTarget.from_pretrained(tmp_path, backend="numpy", block_size=4, num_blocks=16)
    seq = swapped.alloc_seq()
    assert np.abs(swapped.prefill(seq, PROMPTS[2]).hiddens - outs[1]).max() > 1e-3


def test_target_block_needs_a_dense_width():
    with pytest.raises(ConfigError, match="'intermediate_size' must be > 0 for the dense target layer 0"):
        tiny_config(family="glm4_moe", first_k_dense_replace=1).target_block(0)
    with pytest.raises(ValueError, match="layer: expected 0 <= layer < num_hidden_layers = 2, got 2"):
        CFG.target_block(2)
    assert not CFG.target_block(0).moe and CFG.target_block(1).moe


def test_decode_equals_prefill_of_the_longer_prompt(ckpt, targets):
    tgt = target_on(ckpt, targets, "numpy")
    tokens = PROMPTS[2]
    whole, seq = tgt.alloc_seq(), tgt.alloc_seq()
    full = tgt.prefill(whole, tokens)
    steps = [tgt.prefill(seq, tokens[:4])]
    steps += [tgt.decode(seq, t) for t in tokens[4:]]
    np.testing.assert_allclose(np.concatenate([s.hiddens for s in steps]), full.hiddens, rtol=1e-5, atol=1e-5)
    assert [int(g) for s in steps for g in s.greedy] == full.greedy.tolist()
    assert seq.tokens == whole.tokens == tokens
    np.testing.assert_allclose(_kv(tgt, seq), _kv(tgt, whole), rtol=1e-5, atol=1e-6)
    for s in (whole, seq):
        tgt.free_seq(s)
    assert tgt.kv_blocks_in_use() == [0, 0]


def _kv(tgt, seq):
    """Every layer's K and V rows of ``seq`` in row order, FP32 on the host: [L, 2, rows, Hkv, D]."""
    out = []
    for layer, kv in zip(tgt.layers, seq.kv):
        pool, be = layer.pool, tgt.backend
        r = np.arange(kv.rows)
        blk = np.asarray(kv.blocks, np.int64)[r // pool.block_size]
        out.append([be.kv_to_host(c)[blk, r % pool.block_size] for c in (pool.k, pool.v)])
    return np.array(out)


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 3])
def test_verify_accepts_the_greedy_prefix_and_trims_the_rest(ckpt, targets, wrong_at):
    tgt = target_on(ckpt, targets, "numpy")
    prompt, k = PROMPTS[0], 4
    g = greedy_generate(tgt, prompt, k + 2).tokens                   # t_P = g[0], then g[1 ..]
    drafts = list(g[1:k + 1])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % CFG.vocab_size
    seq = tgt.alloc_seq()
    first = tgt.prefill(seq, prompt)
    assert first.next_token == g[0]
    v = tgt.verify(seq, g[0], drafts)
    a = k if wrong_at is None else wrong_at
    assert v.num_accepted == a
    assert v.bonus == g[a + 1]
    assert v.hiddens.shape == (a + 1, CFG.hidden_size)
    # the KV holds prompt, t_P, d_0 .. d_{a-1}: as a fresh prefill of them leaves it
    fresh = tgt.alloc_seq()
    ref = tgt.prefill(fresh, prompt + g[:a + 1])
    assert seq.tokens == fresh.tokens
    np.testing.assert_allclose(_kv(tgt, seq), _kv(tgt, fresh), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v.hiddens, ref.hiddens[len(prompt):], rtol=1e-5, atol=1e-5)
    assert [len(kv.blocks) for kv in seq.kv] == [len(kv.blocks) for kv in fresh.kv]   # the trimmed blocks went back
    # the next step continues from there: decode the bonus as the fresh sequence does
    assert tgt.decode(seq, v.bonus).next_token == tgt.decode(fresh, v.bonus).next_token
    for s in (seq, fresh):
        tgt.free_seq(s)
    assert tgt.kv_blocks_in_use() == [0, 0]


def test_bad_calls_are_refused_and_change_nothing(ckpt, targets):
    tgt = target_on(ckpt, targets, "numpy")
    V = CFG.vocab_size
    seq = tgt.alloc_seq()
    with pytest.raises(StateError, match="prefill first"):
        tgt.verify(seq, 1, [2])
    with pytest.raises(ValueError, match=r"tokens\[1\]: token id 301 is outside the vocabulary \[0, 301\)"):
        tgt.prefill(seq, [1, V])
    with pytest.raises(ValueError, match="tokens: expected at least 1 token"):
        tgt.prefill(seq, [])
    tgt.prefill(seq, [1, 2, 3])
    before = (list(seq.tokens), _kv(tgt, seq), tgt.kv_blocks_in_use())
    with pytest.raises(StateError, match="expected an empty sequence for prefill"):
        tgt.prefill(seq, [4])
    with pytest.raises(ValueError, match="drafts"):
        tgt.verify(seq, 1, [2, -1])
    with pytest.raises(TypeError, match="last_token"):
        tgt.verify(seq, True, [2])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tgt.verify(seq, 1, [2] * CFG.max_position_embeddings)
    with pytest.raises(StateError, match="another target's or a copy"):
        tgt.decode(copy.copy(seq), 1)
    with pytest.raises(AttributeError):
        seq.tokens = []
    assert seq.tokens == before[0] and tgt.kv_blocks_in_use() == before[2]
    np.testing.assert_array_equal(_kv(tgt, seq), before[1])
    tgt.free_seq(seq)
    with pytest.raises(StateError, match="a freed one"):
        tgt.decode(seq, 1)


def test_a_full_pool_changes_nothing(ckpt):
    tgt = ReferenceTarget.from_pretrained(ckpt, backend="numpy", block_size=4, num_blocks=3)
    seq = tgt.alloc_seq()
    tgt.prefill(seq, [1, 2, 3, 4, 5, 6, 7, 8, 9])                 # 3 blocks of 4: the pool is full but one row
    before = (list(seq.tokens), _kv(tgt, seq), tgt.kv_blocks_in_use())
    with pytest.raises(KvCacheFull):
        tgt.verify(seq, 10, [11, 12, 13, 14])
    assert seq.tokens == before[0] and tgt.kv_blocks_in_use() == before[2]
    np.testing.assert_array_equal(_kv(tgt, seq), before[1])
    assert tgt.verify(seq, 10, [11, 12]).hiddens.shape[0] >= 1      # room for 3 more rows: it runs


def test_other_families_and_missing_layers_are_refused(tmp_path, ckpt):
    from mtpkern.backends import get_backend

    other = write_synthetic_checkpoint(tmp_path / "canonical", tiny_config(num_hidden_layers=1), seed=1)
    with pytest.raises(ConfigError, match="glm4_moe only, got 'the canonical layout'"):
        ReferenceTarget.from_pretrained(other, backend="numpy")
    with pytest.raises(ConfigError, match="target_layers: .*glm4_moe only"):
        write_synthetic_checkpoint(tmp_path / "x", tiny_config(), target_layers=True)
    bare = write_synthetic_checkpoint(tmp_path / "bare", CFG, seed=1)             # MTP modules only
    with pytest.raises(CheckpointError, match=r"'model.layers.0.input_layernorm.weight': missing"):
        load_target_weights(bare, CFG, get_backend("numpy"))
    # the drafter loads a checkpoint with target layers as it loads one without
    assert MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", num_blocks=8).num_modules == 3


# -- the loop -----------------------------------------------------------------------------

class PerfectDrafter:
    """A proposer that drafts the target's greedy continuation (computed ahead): every draft is
    accepted. It checks the loop's calls: a propose must follow the last one's after_verify and
    the accepted drafts' catch-up, each at the position and with the tokens it expects."""

    def __init__(self, config, continuation, prompt_len):
        self.config, self.cont, self.n = config, continuation, prompt_len
        self.freed = 0

    def alloc_state(self):
        return {"P": None, "drafts": None, "owed": []}

    def prefill_drafter(self, tokens, hiddens, st):
        assert len(tokens) == len(hiddens) == self.n
        st["P"] = self.n

    def propose(self, t, h, P, k, st):
        assert st["drafts"] is None and not st["owed"], "propose before after_verify / catch-up"
        assert P == st["P"] and t == self.cont[P - self.n]
        st["drafts"] = self.cont[P - self.n + 1:P - self.n + 1 + k]
        return list(st["drafts"])

    def after_verify(self, a, st):
        st["owed"], st["drafts"] = st["drafts"][:a], None
        st["P"] += a + 1

    def catchup_drafter(self, tokens, hiddens, st):
        assert list(tokens) == st["owed"] and len(hiddens) == len(tokens)
        st["owed"] = []

    def free_state(self, st):
        self.freed += 1


class RandomDrafter(PerfectDrafter):
    """Random drafts (a corrupted drafter): greedy verification must stay lossless."""

    def __init__(self, config, seed):
        super().__init__(config, None, None)
        self.rng = np.random.default_rng(seed)

    def prefill_drafter(self, tokens, hiddens, st):
        st["P"] = len(tokens)

    def propose(self, t, h, P, k, st):
        assert st["drafts"] is None and not st["owed"]
        st["drafts"] = [int(d) for d in self.rng.integers(0, self.config.vocab_size, k)]
        return list(st["drafts"])


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_speculative_generate_is_lossless(ckpt, targets, backend, kv_mode):
    tgt = target_on(ckpt, targets, backend)
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend=backend, kv_mode=kv_mode, block_size=4, num_blocks=64)
    for prompt in PROMPTS:
        want = greedy_generate(tgt, prompt, 9).tokens
        got = speculative_generate(tgt, prop, prompt, 9, 3)
        assert got.tokens == want
        d = got.decisions
        # the prefill's token, then a + 1 tokens a verify
        assert d.offered_at[:3] == [d.verifies] * 3 and 1 + sum(d.accepted) + d.verifies >= 9
    assert prop.kv_blocks_in_use() == [0, 0, 0] and tgt.kv_blocks_in_use() == [0, 0]
    prop.check_invariants()


def test_acceptance_comes_from_the_verifier(ckpt, targets):
    tgt = target_on(ckpt, targets, "numpy")
    prompt, n_new, k = PROMPTS[0], 13, 3
    want = greedy_generate(tgt, prompt, n_new + k + 1).tokens
    perfect = speculative_generate(tgt, PerfectDrafter(CFG, want, len(prompt)), prompt, n_new, k)
    assert perfect.tokens == want[:n_new]
    d = perfect.decisions
    assert d.accepted == [k] * d.verifies and d.verifies == -(-(n_new - 1) // (k + 1))
    assert [d.acceptance_rate(j) for j in range(k)] == [1.0] * k and d.tokens_per_verify == k + 1
    rnd = speculative_generate(tgt, RandomDrafter(CFG, 0), prompt, n_new, k)   # corrupted drafts: still lossless
    assert rnd.tokens == want[:n_new]
    assert rnd.decisions.mean_accepted <= 0.2                       # chance: about 1 / 301 a draft


class Skipping:
    """The proposer as a loop that skips one of its calls sees it."""

    def __init__(self, prop, skip):
        self.prop, self.skip = prop, skip

    def __getattr__(self, name):
        if name == self.skip:
            return lambda *a, **k: None
        return getattr(self.prop, name)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_a_loop_that_skips_after_verify_or_the_catchup_is_caught(ckpt, targets, kv_mode):
    tgt = target_on(ckpt, targets, "numpy")
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=kv_mode, block_size=4, num_blocks=64)
    prompt = PROMPTS[0]
    want = greedy_generate(tgt, prompt, 16).tokens
    with pytest.raises(StateError, match="after_verify"):          # either mode: propose refuses a drafted state
        speculative_generate(tgt, Skipping(prop, "after_verify"), prompt, 8, 3)
    perfect = PerfectDrafter(CFG, want, len(prompt))
    with pytest.raises(AssertionError, match="catch-up"):
        speculative_generate(tgt, Skipping(perfect, "catchup_drafter"), prompt, 8, 3)
    # the real drafter: exact mode refuses a propose before the accepted drafts have their
    # hiddens; draft mode does not check (docs/api.md, "Partial catch-ups"), so there the
    # output stays lossless (the target decides) and only the drafter's rows show it.
    # A synthetic drafter accepts nothing, so force acceptances: the drafts of a perfect one.
    class Forced(Skipping):
        def propose(self, t, h, P, k, st):
            self.prop.propose(t, h, P, k, st)
            return want[P - len(prompt) + 1:P - len(prompt) + 1 + k]

    if kv_mode == "exact":
        with pytest.raises(StateError, match="hidden"):
            speculative_generate(tgt, Forced(prop, "catchup_drafter"), prompt, 8, 3)
    else:
        rows = {}

        class Watch(Forced):
            def free_state(self, st):
                rows[self.skip] = st.rows_per_module()[0]
                self.prop.free_state(st)

        for skip in ("catchup_drafter", None):
            assert speculative_generate(tgt, Watch(prop, skip), prompt, 8, 3).tokens == want[:8]
        assert rows["catchup_drafter"] < rows[None]
    assert prop.kv_blocks_in_use() == [0, 0, 0] and tgt.kv_blocks_in_use() == [0, 0]



def test_draft_mode_without_the_catchup(ckpt, targets):
    """``catchup=False``: lossless, and module 0 holds one row per propose instead of the
    accepted drafts' rows too (forced acceptances: the synthetic drafter's drafts rarely are);
    refused in exact mode, where the later modules read the catch-up's rows."""
    tgt = target_on(ckpt, targets, "numpy")
    prompt = PROMPTS[0]
    want = greedy_generate(tgt, prompt, 16).tokens
    rows, verifies = {}, {}

    class Watch:
        def __init__(self, prop):
            self.prop = prop

        def __getattr__(self, name):
            return getattr(self.prop, name)

        def propose(self, t, h, P, k, st):
            self.prop.propose(t, h, P, k, st)
            return want[P - len(prompt) + 1:P - len(prompt) + 1 + k]

        def free_state(self, st):
            rows[self.on] = st.rows_per_module()[0]
            self.prop.free_state(st)

    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode="draft", block_size=4, num_blocks=64)
    for on in (True, False):
        w = Watch(prop)
        w.on = on
        out = speculative_generate(tgt, w, prompt, 12, 3, catchup=on)
        assert out.tokens == want[:12]
        verifies[on] = out.decisions.verifies
        # forced drafts all match: 3 accepted a verify
        assert out.decisions.accepted[:-1] == [3] * (verifies[on] - 1)
    for real in (True, False):                     # the real drafts: lossless either way
        assert speculative_generate(tgt, prop, prompt, 12, 3, catchup=real).tokens == want[:12]
    # the prefill's n - 1 rows (pairs (t_{i+1}, h_i)), then one per propose; the catch-up adds the accepted drafts'
    assert rows[False] == len(prompt) - 1 + verifies[False] < rows[True]
    assert prop.kv_blocks_in_use() == [0, 0, 0]
    exact = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode="exact", block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="catchup: expected True .* 'exact'"):
        speculative_generate(tgt, exact, prompt, 4, 3, catchup=False)
    with pytest.raises(TypeError, match="catchup: expected a bool"):
        speculative_generate(tgt, prop, prompt, 4, 3, catchup=1)
    assert tgt.kv_blocks_in_use() == [0, 0] and exact.kv_blocks_in_use() == [0, 0, 0]



def test_the_batched_loop_is_lossless_per_sequence(ckpt, targets):
    """``speculative_generate_batch``: each sequence's tokens are its greedy ones, its decisions
    are the verifier's (forced perfect drafts: all accepted; the synthetic drafter's: near
    chance), the policy is asked once per batch step with the batch's decisions so far, and
    every sequence and state is freed."""
    from mtpkern.loop import speculative_generate_batch

    tgt = target_on(ckpt, targets, "numpy")
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode="exact", block_size=4, num_blocks=64)
    prompts, n = PROMPTS[:2], 9
    want = [greedy_generate(tgt, p, n + 4).tokens for p in prompts]
    got = speculative_generate_batch(tgt, prop, prompts, n, 3)
    assert [g.tokens for g in got] == [w[:n] for w in want]
    assert all(g.decisions.offered == [3] * g.decisions.verifies for g in got)

    class Forced:
        def __init__(self, prop):
            self.prop = prop

        def __getattr__(self, name):
            return getattr(self.prop, name)

        def propose_batch(self, ts, hs, Ps, k, sts):
            self.prop.propose_batch(ts, hs, Ps, k, sts)
            return [want[i][P - len(prompts[i]) + 1:P - len(prompts[i]) + 1 + k] for i, P in enumerate(Ps)]

    seen = []

    def policy(dec):
        seen.append(dec.verifies)
        return 2 if len(seen) % 2 else 0            # drafts and decode steps in turn
    # forced drafts need draft mode: exact mode checks the catch-up's tokens against its own drafts
    dprop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode="draft", block_size=4, num_blocks=64)
    forced = speculative_generate_batch(tgt, Forced(dprop), prompts, n, policy)
    assert [g.tokens for g in forced] == [w[:n] for w in want]
    for g in forced:                                  # perfect drafts: all accepted, decode steps offer none
        assert g.decisions.accepted == g.decisions.offered and set(g.decisions.offered) == {0, 2}
    assert seen == [2 * i for i in range(len(seen))]  # both sequences live every step (same length)
    assert sum(g.decisions.verifies for g in forced) < sum(g.decisions.verifies for g in got)
    with pytest.raises(ValueError, match="prompts: expected a non-empty list"):
        speculative_generate_batch(tgt, prop, [], n, 3)
    assert prop.kv_blocks_in_use() == dprop.kv_blocks_in_use() == [0, 0, 0] and tgt.kv_blocks_in_use() == [0, 0]


def test_decisions_record():
    d = Decisions()
    d.record(3, 2)
    d.record(1, 0)
    assert (d.offered_at, d.accepted_at, d.verifies) == ([2, 1, 1], [1, 1, 0], 2)
    assert d.acceptance_rate(0) == 0.5 and d.acceptance_rate(5) == 0.0 and d.tokens_per_verify == 2.0
    with pytest.raises(ValueError, match="num_accepted: expected 0 <= a <= 1, got 2"):
        d.record(1, 2)


# -- the target's ops on the emulated cuda backend ------------------------------------------

@pytest.fixture(scope="module")
def emu():
    from cuda_emu import emu_backend

    yield from emu_backend.installed_emulator()


def test_target_on_the_emulated_cuda_backend(ckpt, targets, emu):
    """The CUDA kernels (run by tests/cuda_emu) for the target's layers: the hiddens of the
    numpy target to FP32 rounding, and the loop lossless against them (a short run: every
    launch is emulated)."""
    from cuda_emu import emu_backend

    tgt = ReferenceTarget.from_pretrained(ckpt, backend=emu_backend.backend("float32"), block_size=4, num_blocks=16)
    ref = target_on(ckpt, targets, "numpy")
    prompt = PROMPTS[0]
    seq, rseq = tgt.alloc_seq(), ref.alloc_seq()
    got, want = tgt.prefill(seq, prompt), ref.prefill(rseq, prompt)
    np.testing.assert_allclose(got.hiddens, want.hiddens, rtol=1e-4, atol=1e-4)
    assert got.greedy.tolist() == want.greedy.tolist()
    tgt.free_seq(seq)
    ref.free_seq(rseq)
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode="exact", block_size=4, num_blocks=16)
    greedy = greedy_generate(ref, prompt, 5).tokens
    assert greedy_generate(tgt, prompt, 5).tokens == greedy
    assert speculative_generate(tgt, prop, prompt, 5, 3).tokens == greedy
    assert tgt.kv_blocks_in_use() == [0, 0]


# -- trees, a K policy, early stop ------------------------------------------------------------

def _tree(root_token, tokens, parents):
    from mtpkern.tree import DraftTree

    parents = np.array(parents, np.int32)
    depths = np.zeros(len(parents), np.int32)
    for i, p in enumerate(parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    n = len(tokens)
    return DraftTree(0, root_token, np.array(tokens, np.int32), parents, depths, np.ones(n, np.float32),
                     np.zeros(n, np.float32))


def test_verify_tree_takes_the_branch_the_target_would(ckpt, targets):
    from mtpkern.loop import verify_tree

    tgt = target_on(ckpt, targets, "numpy")
    prompt = PROMPTS[0]
    want = greedy_generate(tgt, prompt, 5).tokens               # t_P, then the greedy continuation
    wrong = [(w + 1) % CFG.vocab_size for w in want]
    # depth 0: [wrong, right]; under right: [wrong, right]; under that: [wrong] only
    tree = _tree(want[0], [wrong[1], want[1], wrong[2], want[2], wrong[3]], [-1, -1, 1, 1, 3])
    seq = tgt.alloc_seq()
    first = tgt.prefill(seq, prompt)
    v = verify_tree(tgt, seq, first.next_token, tree)
    assert v.path == [1, 3] and v.bonus == want[3] and v.forwards == 3
    assert seq.tokens == prompt + want[:3] and v.hiddens.shape == (3, CFG.hidden_size)
    tgt.free_seq(seq)
    seq = tgt.alloc_seq()                                        # nothing matches: no node accepted
    tgt.prefill(seq, prompt)
    v = verify_tree(tgt, seq, first.next_token, _tree(want[0], [wrong[1], wrong[1] + 1], [-1, -1]))
    assert v.path == [] and v.bonus == want[1] and seq.tokens == prompt + want[:1]
    tgt.free_seq(seq)


@pytest.mark.parametrize("kv_mode", ["exact", "draft"])
def test_trees_a_k_policy_and_early_stop_are_lossless(ckpt, targets, kv_mode):
    from mtpkern.loop import tree_generate

    tgt = target_on(ckpt, targets, "numpy")
    prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="numpy", kv_mode=kv_mode, block_size=4, num_blocks=128)
    prompt = PROMPTS[0]
    want = greedy_generate(tgt, prompt, 9).tokens
    tree = tree_generate(tgt, prop, prompt, 9, [2, 2, 1])
    assert tree.tokens == want and tree.decisions.offered_at[:3] == [tree.decisions.verifies] * 3
    asked = []
    ks = speculative_generate(tgt, prop, prompt, 9, lambda d: asked.append(d.verifies) or [0, 2, 3][d.verifies % 3])
    assert ks.tokens == want and ks.decisions.offered[:3] == [0, 2, 3] and asked[:3] == [0, 1, 2]
    early = speculative_generate(tgt, prop, prompt, 9, 3, min_confidence=1.0)      # stops after one draft
    assert early.tokens == want and set(early.decisions.offered) == {1}
    assert prop.kv_blocks_in_use() == [0, 0, 0] and tgt.kv_blocks_in_use() == [0, 0]
    prop.check_invariants()
