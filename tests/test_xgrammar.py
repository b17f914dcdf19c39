"""Grammar masks that xgrammar itself fills (``GrammarMatcher.fill_next_token_bitmask``),
driving ``propose`` through the callable form: a JSON-schema grammar over a small
vocabulary xgrammar builds offline, a matcher advanced over the verified tokens, each
draft's mask filled after the drafts before it (accepted, then rolled back). Every draft
must be accepted by the matcher. Optional (``pip install 'mtpkern[grammar]'``: xgrammar and
torch); skipped without them. The recipe: docs/api.md, "Grammars with xgrammar"."""

from __future__ import annotations

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'mtpkern[grammar]')")

from conftest import rand_hiddens  # noqa: E402

from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint  # noqa: E402
from mtpkern.config import tiny_config  # noqa: E402

#: JSON pieces (punctuation, every lowercase letter and digit, a few longer tokens), then
#: filler tokens the grammar never allows, to V = 301 (the tiny config's vocabulary)
PIECES = (["{", "}", "[", "]", ":", ",", " ", '"', "-", "."] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
          + [str(d) for d in range(10)] + ["true", "false", "null", '"name"', '"id"', '"ok"', "12", "ab"])
SCHEMA = ('{"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, '
          '"ok": {"type": "boolean"}}, "required": ["id", "name"]}')
EOS = 0


def vocabulary(V: int) -> list[str]:
    return ["</s>"] + PIECES + [f"\\u{0x4e00 + i:04x}#{i}" for i in range(V - 1 - len(PIECES))]


def matcher_and_masks(V: int):
    info = xgr.TokenizerInfo(vocabulary(V), vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA)
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=8)
    buf = xgr.allocate_token_bitmask(1, info.vocab_size)

    eos_only = np.zeros(buf.shape[1], np.int32)
    eos_only[EOS >> 5] = 1 << (EOS & 31)

    def mask(i: int, drafts: list[int]):
        """Draft i's mask: the matcher after the verified tokens and ``drafts`` (drafts 0..i-1);
        after a drafted end of text, only the end of text again (an engine stops there)."""
        if EOS in drafts:
            return eos_only
        for d in drafts:
            assert matcher.accept_token(d), f"draft {d} rejected by the grammar"
        matcher.fill_next_token_bitmask(buf)
        if drafts:
            matcher.rollback(len(drafts))
        return buf.numpy()[0].astype(np.int32)

    return matcher, mask


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("mode", ["exact", "draft"])
def test_every_draft_is_accepted_by_the_grammar(tmp_path, backend, mode):
    cfg = tiny_config()
    path = write_synthetic_checkpoint(tmp_path, cfg, seed=3)
    prop = MultiModuleMtpHead.from_pretrained(path, backend=backend, kv_mode=mode, block_size=4, num_blocks=96)
    matcher, mask = matcher_and_masks(cfg.vocab_size)
    rng = np.random.default_rng(0)
    H = cfg.hidden_size
    prompt = rng.integers(0, cfg.vocab_size, 6).tolist()        # the prompt is not JSON: the output is
    st = prop.alloc_state()
    prop.prefill_drafter(prompt, rand_hiddens(rng, len(prompt), H), st)
    P, last, out, drafted = len(prompt), 1, [], 0                # the target's first token: "{" (id 1)
    assert matcher.accept_token(last)
    out.append(last)
    for _ in range(12):
        if matcher.is_terminated():
            break
        conf: list = []
        drafts = prop.propose(last, rand_hiddens(rng, 1, H)[0], P, 3, st, grammar_bitmask=mask, out_conf=conf)
        drafted += len(drafts)
        live = drafts[:drafts.index(EOS) + 1] if EOS in drafts else drafts     # up to the end of text
        assert all(d == EOS for d in drafts[len(live):])
        for j, d in enumerate(live):                            # each draft is a token the grammar allows
            assert matcher.accept_token(d), f"draft {j} = {d} ({vocabulary(cfg.vocab_size)[d]!r}) rejected"
        matcher.rollback(len(live))
        assert all(0 < c <= 1.0 + 1e-6 for c in conf)
        a = int(rng.integers(0, len(live) + 1))                 # the "target" accepts a prefix
        prop.after_verify(a, st)
        prop.catchup_drafter(drafts[:a], rand_hiddens(rng, a, H), st)
        for d in drafts[:a]:
            assert matcher.accept_token(d)
        out += drafts[:a]
        if matcher.is_terminated():
            break
        # the target's own next token: the lowest id the grammar allows (deterministic)
        bm = mask(0, [])
        allowed = [j for j in range(cfg.vocab_size) if (bm[j >> 5] >> (j & 31)) & 1]
        last = allowed[0]
        assert matcher.accept_token(last)
        out.append(last)
        P += 1 + a
    prop.check_invariants()
    assert drafted >= 12
    text = "".join(vocabulary(cfg.vocab_size)[t] for t in out if t != EOS)
    assert text.startswith("{") and '"id"' in text, text       # the schema's required key came out
