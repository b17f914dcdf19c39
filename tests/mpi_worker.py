"""One rank of tests/test_comm.py's MPI worlds (run as ``mpirun -n N python tests/mpi_worker.py``).

Every rank checks MpiComm's collectives against what each rank put in, the
vocabulary-parallel argmax and confidences against the single-rank answer over the
whole vocabulary (the NumPy reference's LM head, identity weights: the logits are the
inputs exactly), and then the sharded proposer on the cpu backend: its slice of a
synthetic checkpoint (rank 0 writes it), the call scripts of tests/shard_cases.py in both KV
modes, each rank's log against a single-rank proposer's (drafts, confidences and refusals
identical, its KV the single rank's slice), and the proposer state machine of
mtpkern.testing (derandomized, so every rank draws the same calls and meets the others in
the same collectives; its exact-mode oracle compares every draft with a from-scratch
forward of the whole checkpoint). It writes ``ok`` to ``<argv[1]>/rank<r>`` and
exits 0, or raises (the ranks' stdout would interleave). ``mpi_worker.py DIR refusals`` runs
only tests/shard_cases.py's refusal cases (``refusals``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shard_cases  # noqa: E402
from comm_cases import local_best, logit_case, reference  # noqa: E402

from mtpkern import MultiModuleMtpHead  # noqa: E402
from mtpkern.comm import MpiComm, check_comm, sharded_argmax, sharded_confidence  # noqa: E402
from mtpkern.config import tiny_config  # noqa: E402
from mtpkern.testing import reference_weights  # noqa: E402
from mtpkern.testing.machine import proposer_machine  # noqa: E402
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


def refusals(comm: MpiComm, out: Path) -> None:
    """tests/shard_cases.py's refusal cases on the cpu backend in both KV modes: the last rank
    refuses, fails mid-draft or calls otherwise; this rank's log goes to ``refusals<rank>.json``
    (tests/test_comm.py compares the ranks' logs)."""
    import json

    ckpt = out / "ckpt"
    if comm.rank == 0:
        write_synthetic_checkpoint(ckpt, tiny_config(), seed=7)
    comm.comm.Barrier()
    logs = {}
    for kv_mode in ("exact", "draft"):
        prop = MultiModuleMtpHead.from_pretrained(ckpt, backend="cpu", threads=1, kv_mode=kv_mode, comm=comm,
                                                  block_size=4, num_blocks=160, prefill_chunk=6)
        logs[kv_mode] = shard_cases.refusal_cases(prop, comm.rank, comm.size)
    (out / f"refusals{comm.rank}.json").write_text(json.dumps(logs))


def main() -> None:
    comm = check_comm(MpiComm())
    if sys.argv[2:] == ["refusals"]:
        refusals(comm, Path(sys.argv[1]))
        return
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
    state_machine(comm, Path(sys.argv[1]) / "ckpt")
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



def state_machine(comm: MpiComm, ckpt: Path) -> None:
    """mtpkern.testing's proposer machine over this rank of a sharded head, in both KV modes."""
    from hypothesis import HealthCheck, settings

    weights = reference_weights(ckpt)
    for kv_mode in ("exact", "draft"):
        def make(kv_mode=kv_mode):
            return MultiModuleMtpHead.from_pretrained(ckpt, backend="cpu", threads=1, kv_mode=kv_mode, comm=comm,
                                                      block_size=4, num_blocks=28, prefill_chunk=5)

        machine = proposer_machine(make, weights)
        few = comm.size > 2                  # 4 ranks on this machine's 2 cores spin against each other
        machine.TestCase.settings = settings(max_examples=4 if few else 15, stateful_step_count=40, deadline=None,
                                             derandomize=True,
                                             database=None, print_blob=False,
                                             suppress_health_check=list(HealthCheck))
        machine.TestCase().runTest()
        calls = sum(machine.steps.values())
        assert calls >= (60 if few else 200) and machine.steps["propose_batch"] > 0, dict(machine.steps)
        if os.environ.get("MTPKERN_MPI_VERBOSE"):
            print(f"rank {comm.rank} {kv_mode}: {dict(machine.steps)}", flush=True)


if __name__ == "__main__":
    main()
