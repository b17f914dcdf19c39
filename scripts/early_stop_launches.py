"""Launch counts of an early-stopping propose (eager) against the planned chain step, on the
emulated kernels (docs/cuda.md, "Early stop and the planned step"): no GPU, no timings.

    python3 scripts/early_stop_launches.py [draft|exact ...]

The tiny MoE config (M = 3, H 64, V 301) in blocks of 16, one sequence with a 21-token prompt.
Per propose of k = 3: the eager path with ``min_confidence`` 1.0 (drafting stops after the
first draft) and 0.0 (never stops: 3 drafts), its kernel launches (the emulator's count) and
``from_host`` / ``to_host`` calls; the planned step without an early stop and with
``min_confidence`` 1.0 / 0.0 (every module runs in the graph, the stop applied after it on the
host), each shape captured by its first call and replayed by its second, as the fake CUDA runtime
records it: graph nodes, H2D / D2H copies. Needs the CUDA emulator of tests/cuda_emu (a C++ compiler).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]     # run from a checkout; the emulator lives in tests/

import numpy as np  # noqa: E402

from tree_launches import counting_emulator  # noqa: E402

from mtpkern import MultiModuleMtpHead, write_synthetic_checkpoint  # noqa: E402
from mtpkern.config import tiny_config  # noqa: E402


def main(modes: list[str]) -> None:
    cfg = tiny_config()
    H, V = cfg.hidden_size, cfg.vocab_size
    ckpt = write_synthetic_checkpoint(Path(tempfile.mkdtemp()), cfg, seed=7)
    with counting_emulator() as (emu, rt, be, xfer):
        for mode in modes:
            make = lambda **kw: MultiModuleMtpHead.from_pretrained(  # noqa: E731
                ckpt, backend=be, kv_mode=mode, block_size=16, num_blocks=64, **kw)
            eager, graph = make(cuda_graphs=False), make()
            rng = np.random.default_rng(0)
            toks, hid = rng.integers(0, V, 21).tolist(), rng.standard_normal((21, H)).astype(np.float32)
            s0, s1 = eager.alloc_state(), graph.alloc_state()
            eager.prefill_drafter(toks, hid, s0)
            graph.prefill_drafter(toks, hid, s1)
            for thr in (1.0, 0.0):                   # 1.0: the first draft stops it; 0.0: never
                t, h = int(rng.integers(0, V)), rng.standard_normal(H).astype(np.float32)
                k0, x0 = sum(emu.launches.values()), dict(xfer)
                d = eager.propose(t, h, s0.next_position, 3, s0, min_confidence=thr)
                k1, x1 = sum(emu.launches.values()), dict(xfer)
                eager.after_verify(0, s0)
                print(f"{mode}: eager, min_confidence {thr}: {len(d)} drafts, {k1 - k0} kernels, "
                      f"{x1['h2d'] - x0['h2d']} H2D, {x1['d2h'] - x0['d2h']} D2H")
            # the first call of a shape captures, the next ones replay (1.0 and 0.0: one shape)
            for thr, i in ((None, 0), (None, 1), (1.0, 0), (1.0, 1), (0.0, 1)):
                m0 = dict(rt.memcpys)
                k0 = sum(emu.launches.values())
                t, h = int(rng.integers(0, V)), rng.standard_normal(H).astype(np.float32)
                d = graph.propose(t, h, s1.next_position, 3, s1, min_confidence=thr)
                k1 = sum(emu.launches.values())
                m1 = dict(rt.memcpys)
                graph.after_verify(0, s1)
                plan = next(reversed(graph.step_runner.plans.values()))
                nodes = sum(len(g.launches) for g in plan.graph)
                print(f"{mode}: planned, min_confidence {thr} ({'capture' if i == 0 else 'replay'}): {len(d)} drafts, "
                      f"{k1 - k0} host-side kernel launches, {nodes} graph nodes, "
                      f"{m1.get('h2d', 0) - m0.get('h2d', 0)} H2D, {m1.get('d2h', 0) - m0.get('d2h', 0)} D2H")
            print(f"{mode}: planned step counts {dict(graph.step_runner.counts)}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["draft", "exact"])
