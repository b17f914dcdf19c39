"""Launch counts of eager vs planned draft trees on the emulated kernels (docs/cuda.md, "Draft
trees in the planned step"): no GPU, no timings.

    python3 scripts/tree_launches.py [draft|exact ...]

The tiny MoE config (M = 3, H 64, V 301) in blocks of 16, prompts of 21-27 tokens (so that
the trees' lines copy partial blocks on write), batches of 1 and 3, widths (1, 1, 1),
(2, 1, 1), (4, 2, 1) and (4, 2, 1) again. Per tree: the eager path's kernel launches (the
emulator's count) and its ``from_host`` / ``to_host`` calls; the planned step's host-side
kernel launches (its first call of a shape runs them, then records them into the graph),
the graph's nodes, the fake runtime's H2D / D2H copies and the runner's counts. Needs the
CUDA emulator of tests/cuda_emu (a C++ compiler).
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]     # run from a checkout; the emulator lives in tests/

import numpy as np  # noqa: E402

from cuda_emu import emu_backend  # noqa: E402
from test_cuda_graph_fake import FakeRuntime  # noqa: E402

from mtpkern import MultiModuleMtpHead, cuda_graph, write_synthetic_checkpoint  # noqa: E402
from mtpkern.config import tiny_config  # noqa: E402

WIDTHS = [(1, 1, 1), (2, 1, 1), (4, 2, 1), (4, 2, 1)]


@contextmanager
def counting_emulator():
    """The emulated kernels with CUDA graphs through the fake runtime, and the backend's
    ``from_host`` / ``to_host`` calls counted: yields (emulator, fake runtime, backend, counts)."""
    lib = emu_backend.build(asan=False, contract=emu_backend.contract_requested())
    with emu_backend.Emulator(lib).installed() as emu:
        rt = FakeRuntime()
        cuda_graph._cupy = lambda: rt.cupy            # graphs through the fake runtime
        emu.capture = lambda: rt.recording
        be = emu_backend.backend()
        xfer = {"h2d": 0, "d2h": 0}
        from_host, to_host = be.from_host, be.to_host

        def counted(f, kind):
            def call(*a, **kw):
                xfer[kind] += 1
                return f(*a, **kw)
            return call

        be.from_host, be.to_host = counted(from_host, "h2d"), counted(to_host, "d2h")
        yield emu, rt, be, xfer


def main(modes: list[str]) -> None:
    cfg = tiny_config()
    H, V = cfg.hidden_size, cfg.vocab_size
    ckpt = write_synthetic_checkpoint(Path(tempfile.mkdtemp()), cfg, seed=7)
    with counting_emulator() as (emu, rt, be, xfer):
        for mode in modes:
            for B in (1, 3):
                make = lambda **kw: MultiModuleMtpHead.from_pretrained(  # noqa: E731
                    ckpt, backend=be, kv_mode=mode, block_size=16, num_blocks=64, **kw)
                eager, graph = make(cuda_graphs=False), make()
                rng = np.random.default_rng(0)
                s0, s1 = [], []
                for i in range(B):
                    n = 21 + 3 * i
                    toks, hid = rng.integers(0, V, n).tolist(), rng.standard_normal((n, H)).astype(np.float32)
                    for p, out in ((eager, s0), (graph, s1)):
                        st = p.alloc_state()
                        p.prefill_drafter(toks, hid, st)
                        out.append(st)
                for ws in WIDTHS:
                    toks, hs = rng.integers(0, V, B).tolist(), rng.standard_normal((B, H)).astype(np.float32)
                    Ps = [st.next_position for st in s0]
                    k0, x0 = sum(emu.launches.values()), dict(xfer)
                    t0 = eager.propose_tree_batch(toks, hs, Ps, s0, widths=list(ws))
                    k1, x1, m1, c1 = sum(emu.launches.values()), dict(xfer), dict(rt.memcpys), dict(
                        graph.step_runner.counts)
                    t1 = graph.propose_tree_batch(toks, hs, Ps, s1, widths=list(ws))
                    k2, m2, c2 = sum(emu.launches.values()), dict(rt.memcpys), dict(graph.step_runner.counts)
                    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(t0, t1))
                    plan = next(reversed(graph.step_runner.plans.values()))
                    nodes = sum(len(g.launches) for g in plan.graph)
                    ran = {k: v - c1.get(k, 0) for k, v in c2.items() if v != c1.get(k, 0)}
                    print(f"{mode} B={B} widths={ws} ({len(t0[0])} nodes): eager {k1 - k0} kernels, "
                          f"{x1['h2d'] - x0['h2d']} H2D, {x1['d2h'] - x0['d2h']} D2H; planned {k2 - k1} host-side "
                          f"kernel launches, {nodes} graph nodes, {m2['h2d'] - m1['h2d']} H2D, "
                          f"{m2['d2h'] - m1['d2h']} D2H; {ran}")
                    for p, ss in ((eager, s0), (graph, s1)):
                        p.after_verify_tree_batch([[] for _ in ss], ss)


if __name__ == "__main__":
    main(sys.argv[1:] or ["draft", "exact"])
