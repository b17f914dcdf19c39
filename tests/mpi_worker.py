"""One rank of tests/test_comm.py's MPI worlds (run as ``mpirun -n N python tests/mpi_worker.py``).

Every rank checks MpiComm's collectives against what each rank put in, the
vocabulary-parallel argmax and confidences against the single-rank answer over the
whole vocabulary (the NumPy reference's LM head, identity weights: the logits are the
inputs exactly), and then the sharded proposer on the cpu backend: its slice of a
synthetic checkpoint (rank 0 writes it), the call scripts of tests/shard_cases.py in both KV
modes, each rank's log against a single-rank proposer's (drafts, confidences and refusals
identical, its KV the single rank's slice). It writes ``ok`` to ``<argv[1]>/rank<r>`` and
exits 0, or raises (the ranks' stdout would interleave)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shard_cases  # noqa: E402
from comm_cases import local_best, logit_case, reference  # noqa: E402

from mtpkern import MultiModuleMtpHead  # noqa: E402
from mtpkern.comm import MpiComm, check_comm, sharded_argmax, sharded_confidence  # noqa: E402
from mtpkern.config import tiny_config  # noqa: E402
from mtpkern.weights import write_synthetic_checkpoint  # noqa: E402


def collectives(comm: MpiComm) -> None:
    r, R = comm.rank, comm.size
    a = np.full(3, r + 1, np.float32)
    comm.all_reduce(a, "sum")
    assert (a == R * (R + 1) / 2).all(), a
    m = np.array([r, -r, 7], np.int64)
    comm.all_reduce(m, "max")
    assert list(m) == [R - 1, 0, 7], m
    g = np.zeros((R, 2), np.int32)
    comm.all_gather(np.array([r, 10 * r], np.int32), g)
    assert (g == np.array([[q, 10 * q] for q in range(R)])).all(), g
    b = np.full(4, r, np.uint64)
    comm.broadcast(b, R - 1)
    assert (b == R - 1).all(), b
    for bad in (lambda: comm.all_reduce(a, "min"), lambda: comm.all_gather(a, np.zeros((R + 1, 3), np.float32)),
                lambda: comm.broadcast(a, R)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("a bad collective did not raise")


def main() -> None:
    comm = check_comm(MpiComm())
    collectives(comm)
    for seed in range(40):
        x, w, mask = logit_case(np.random.default_rng(seed))
        want_ids, want_conf = reference(x, w, mask)
        V = w.shape[0]
        lo, hi = comm.rank * V // comm.size, (comm.rank + 1) * V // comm.size
        best, ids, sums, has = local_best(x, w, mask, lo, hi)
        got = sharded_argmax(best, ids, comm)
        assert (got == want_ids).all(), (seed, got, want_ids)
        conf = sharded_confidence(best, sums, has, got, comm)
        np.testing.assert_allclose(conf, want_conf, rtol=1e-5, equal_nan=True, err_msg=f"seed {seed}")
    proposers(comm, Path(sys.argv[1]))
    (Path(sys.argv[1]) / f"rank{comm.rank}").write_text("ok")


def proposers(comm: MpiComm, out: Path) -> None:
    """The sharded proposer (cpu backend, one thread a rank) against a single-rank one."""
    ckpt = out / "ckpt"
    if comm.rank == 0:
        write_synthetic_checkpoint(ckpt, tiny_config(), seed=7)
    comm.comm.Barrier()
    kw = dict(backend="cpu", threads=1, block_size=4, num_blocks=160, prefill_chunk=6)
    for kv_mode, seed, conf in (("exact", 1, True), ("draft", 2, False)):
        steps = shard_cases.script(seed)
        want = shard_cases.run_script(MultiModuleMtpHead.from_pretrained(ckpt, kv_mode=kv_mode, **kw), steps, conf)
        prop = MultiModuleMtpHead.from_pretrained(ckpt, kv_mode=kv_mode, comm=comm, **kw)
        assert prop.needs_comm() and prop.shard.rank == comm.rank
        shard_cases.compare(want, shard_cases.run_script(prop, steps, conf), prop)


if __name__ == "__main__":
    main()
