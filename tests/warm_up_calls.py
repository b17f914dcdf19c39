"""The call sequence the warm-up tests run after a warm-up (tests/test_warm_up_threads.py in
process, tests/test_warm_up_needs.py in a fresh one): every argument type the head and the
proposer pass (prefill, propose, catch-up, a masked batch) must find its kernel in place."""

from __future__ import annotations

import numpy as np


def every_call(prop, rng) -> None:
    H, V = prop.config.stream_size, prop.config.vocab_size     # the hidden a target hands over
    sts = [prop.alloc_state() for _ in range(3)]
    for st in sts:
        prop.prefill_drafter(rng.integers(0, V, 9), rng.standard_normal((9, H)).astype(np.float32), st)
    d = prop.propose(5, rng.standard_normal(H).astype(np.float32), 9, 3, sts[0])
    prop.after_verify(2, sts[0])
    prop.catchup_drafter(d[:2], rng.standard_normal((2, H)).astype(np.float32), sts[0])
    mask = np.full(-(-V // 32), -1, np.int32)
    prop.propose_batch([1, 2], rng.standard_normal((2, H)).astype(np.float32), [9, 9], 3, sts[1:],
                       grammar_bitmasks=[mask, None])
