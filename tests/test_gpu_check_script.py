"""scripts/gpu_check.sh without a GPU: the script runs here with a stand-in ``python``
(``$PYTHON``) whose probe, pytest or benchmark can be replaced, and its output folder is
held to the device tool's contract (at most 8 files, none more than 2 folders down, plain
names, each under 16 MiB); the summary says which steps ran, passed, failed or timed out;
a benchmark killed at its time limit leaves the rows it measured; pytest-timeout is used
when the probe finds it and left out, saying so, when not; the script starts one python
process per step. One test runs the real probe, pytest and benchmark on this machine
(every gpu-marked test skips, the benchmark stops at ``import cupy``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BENCH = ROOT / "benchmarks" / "gpu_bench.py"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")

#: the stand-in python: logs the first two arguments of each call, then hands the probe, the
#: pytest run or the benchmark to a replacement when one is set, else to the real python
_FAKE_PY = r"""#!/usr/bin/env bash
printf '%s\n' "$(printf '%s %s' "${1:-}" "${2:-}" | head -n 1)" >> "$FAKE_CALLS"
if [ "${1:-}" = "-c" ] && [ -n "${FAKE_PROBE:-}" ]; then printf '%s\n' "$FAKE_PROBE"; exit "${FAKE_PROBE_RC:-0}"; fi
if [ "${1:-} ${2:-}" = "-m pytest" ] && [ -n "${FAKE_PYTEST:-}" ]; then shift 2; exec "$REAL_PY" "$FAKE_PYTEST" "$@"; fi
if [ "${1:-}" = "benchmarks/gpu_bench.py" ] && [ -n "${FAKE_BENCH:-}" ]; then shift; exec "$REAL_PY" "$FAKE_BENCH" "$@"; fi
if [ "${1:-}" = "scripts/gpu_smoke.py" ] && [ -n "${FAKE_SMOKE_RC:-}" ]; then
  echo "[gpu_smoke +   1.5s] family norm: 3 kernels built and loaded in 1.2 s"
  echo "[gpu_smoke +   2.0s] exact: propose 0 in 3.1 ms: cuda [[1, 2, 3]], numpy [[1, 2, 3]]"
  exit "$FAKE_SMOKE_RC"
fi
exec "$REAL_PY" "$@"
"""

#: a pytest stand-in: records its arguments, prints a verbose run; FAKE_PYTEST_HANG leaves a
#: test running (no result on its line) until the step's limit stops it
_PYTEST = r"""
import os, sys, time
open(os.environ["FAKE_PYTEST_ARGV"], "w").write("\n".join(sys.argv[1:] + ["ENV MTPKERN_PRINT_FAILURES="
                                                 + os.environ.get("MTPKERN_PRINT_FAILURES", "")]))
print("============================= test session starts ==============================", flush=True)
for line in ("tests/test_backend_parity.py::test_fast_backend_matches_reference[exact-prenorm-cuda] PASSED",
             "tests/test_gpu.py::test_cuda_matches_numpy_reference[mid-exact-bfloat16] FAILED",
             "tests/test_ops_backends.py::test_rmsnorm[cuda-1-17] PASSED",
             "tests/test_ops_backends.py::test_linear[cuda-19-8] PASSED",
             "tests/test_ops_backends.py::test_fp8_refusals[cuda] SKIPPED (no fp8 here)"):
    print(line, flush=True)
if os.environ.get("FAKE_PYTEST_HANG"):
    print("tests/test_backend_parity.py::test_fast_backend_matches_reference[exact-prenorm-cuda] FAILED")
    print("---- failure of tests/test_backend_parity.py::test_fast_backend_matches_reference[exact-prenorm-cuda] "
          "(call), printed as it happened ----")
    print("    assert d_fast == d_ref")
    print("E   assert [[300, 238, 239]] == [[300, 238, 81]]")
    print("E     At index 0 diff")
    print("tests/test_gpu.py::test_graph_replay_equals_eager[1-draft] ", end="", flush=True)
    time.sleep(600)
print("=========================== short test summary info ============================")
print("FAILED tests/test_gpu.py::test_cuda_matches_numpy_reference[mid-exact-bfloat16] - AssertionError: drafts differ")
print("=============== 1 failed, 3 passed, 1 skipped in 12.34s ===============")
sys.exit(1)
"""

#: a benchmark stand-in on the real Recorder: FAKE_BENCH_ROWS kernel rows, 0.1 s apart
#: (0: until it is killed), then a propose row beside the torch peer and the end record
_BENCH = r"""
import importlib.util, os, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_bench", os.environ["BENCH_PATH"])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
out = Path(sys.argv[sys.argv.index("--out") + 1])
rec = bench.Recorder(out)
rec.meta(argv=sys.argv[1:], device="Fake H200 (L2 60 MiB)", config="glm", **{"copy_GB/s": 4000.0})
n = int(os.environ.get("FAKE_BENCH_ROWS", "0"))
i = 0
while n == 0 or i < n:
    rec.row("kernel", {"op": f"linear_{i}", "rows": 1, "context": 0, "bytes": 1e8, "median_us": 30.0, "p20_us": 29.0,
                       "p80_us": 31.0, "runs": 20, "GB/s": 3333.0, "of_copy": 0.83, "timed": "graph"})
    print("row", i, flush=True)
    i += 1
    time.sleep(float(os.environ.get("FAKE_BENCH_SLEEP", "0.1")))
rec.row("propose", {"kv_mode": "draft", "context": 512, "batch": 1, "k": 3, "eager_median_us": 2000.0,
                    "graph_median_us": 1000.0, "graph_speedup": 2.0, "floor_us": 700.0, "graph_x_floor": 1.43,
                    "torch_median_us": 9000.0, "speedup_vs_torch": 9.0})
rec.note("torch", "torch 2.11 eager on cuda:0")
rec.close(0)
"""

#: an ncu stand-in: records its arguments, prints a few lines of a profile report
_NCU = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$FAKE_NCU_ARGV"
echo "==PROF== Connected to process 1"
echo "  paged_attention_kernel<__nv_bfloat16, 4>(...) (8, 1, 64)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0"
echo "    Duration                         us        97.31"
echo "    Achieved Occupancy                %        21.40"
echo "    No Eligible                       %        91.02"
"""

_PROBE_WITH_TIMEOUT = "python: 3.12.3 /opt/torch/bin/python3\ncupy: 14.2.0; 1 device(s): NVIDIA H200\npytest-timeout: 2.4.0"
_PROBE_WITHOUT = "python: 3.12.3 /opt/torch/bin/python3\ncupy: 14.2.0; 1 device(s): NVIDIA H200\n" \
                 "pytest-timeout: absent (ModuleNotFoundError: No module named 'pytest_timeout')"


@pytest.fixture
def fake(tmp_path):
    """(run, calls file): run(args, **env) runs the script into tmp_path/out with the stand-in
    python and returns (CompletedProcess, out folder)."""
    d = tmp_path / "fake"
    d.mkdir()
    py = d / "python"
    py.write_text(_FAKE_PY)
    py.chmod(0o755)
    (d / "pytest_standin.py").write_text(_PYTEST)
    (d / "bench_standin.py").write_text(_BENCH)
    calls = d / "calls.txt"
    (d / "ncu_bin").mkdir()
    (d / "ncu_bin" / "ncu").write_text(_NCU)
    (d / "ncu_bin" / "ncu").chmod(0o755)

    def run(args=(), timeout=120, ncu=True, **env):
        out = tmp_path / "out"
        e = {**os.environ, "PYTHON": str(py), "REAL_PY": sys.executable, "FAKE_CALLS": str(calls),
             "BENCH_PATH": str(BENCH), "FAKE_PYTEST_ARGV": str(d / "pytest_argv.txt"), "TMPDIR": str(tmp_path),
             "FAKE_NCU_ARGV": str(d / "ncu_argv.txt")}
        if ncu:
            e["PATH"] = f"{d / 'ncu_bin'}:{e['PATH']}"
        e.pop("OUT", None)
        e.update({k: str(v) for k, v in env.items()})
        cp = subprocess.run(["bash", str(SCRIPT), *args, str(out)], env=e, capture_output=True, text=True,
                            timeout=timeout)
        return cp, out

    run.dir = d
    run.calls = calls
    return run


def _contract(out: Path) -> list[str]:
    """The device tool's rules for what comes back; the names of the files."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3, rel                          # OUT/a/b/file at most
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert p.stat().st_size < 16 << 20, rel
    return sorted(str(p.relative_to(out)) for p in files)


def _step(summary: str, name: str) -> str:
    m = re.search(rf"^{name} +\S+ +\S+  (.*)$", summary, re.M)
    assert m, summary
    return m.group(1)


def test_a_full_run_keeps_the_contract_and_says_what_ran(fake):
    cp, out = fake(FAKE_PROBE=_PROBE_WITH_TIMEOUT, FAKE_PYTEST=fake.dir / "pytest_standin.py",
                   FAKE_BENCH=fake.dir / "bench_standin.py", FAKE_BENCH_ROWS=3, FAKE_SMOKE_RC=0)
    assert cp.returncode == 1, cp.stdout + cp.stderr            # a test failed
    assert _contract(out) == ["bench.log", "gpu_bench.jsonl", "gpu_bench.md", "gpu_check.log", "profile.log",
                              "smoke.log", "summary.txt", "tests.log"]
    s = (out / "summary.txt").read_text()
    assert _step(s, "probe") == "passed" and _step(s, "smoke") == "passed" and _step(s, "profile") == "passed"
    assert "    Duration                         us        97.31" in s and "No Eligible" in s   # the profile's lines
    ncu_argv = (fake.dir / "ncu_argv.txt").read_text().splitlines()
    assert ncu_argv[:2] == ["--clock-control", "none"] and "scripts/gpu_attention_probe.py" in ncu_argv
    assert "WarpStateStats" in ncu_argv and ncu_argv[ncu_argv.index("-k") + 1] == "regex:paged_attention"
    assert _step(s, "tests") == "failed (rc 1)" and _step(s, "bench") == "passed"
    assert "  +1.5s family norm: 3 kernels built and loaded in 1.2 s" in s       # the smoke's lines
    assert "  +2.0s exact: propose 0 in 3.1 ms: cuda [[1, 2, 3]], numpy [[1, 2, 3]]" in s
    assert "tests: 3 passed, 1 failed, 0 errors, 1 skipped (pytest: 1 failed, 3 passed, 1 skipped in 12.34s)" in s
    assert "op tests (tests/test_ops_backends.py, cuda cases): 2 passed, 0 failed; other gpu-marked tests: " \
           "1 passed, 1 failed" in s
    assert "  FAILED tests/test_gpu.py::test_cuda_matches_numpy_reference[mid-exact-bfloat16] - AssertionError" in s
    assert "bench: 3 kernel rows, 1 propose rows (1 beside the torch peer), 0 error(s); end record: rc 0" in s
    assert "| draft | 512 | 1 | 3 | 2000 | 1000 | 2.00x | 700 | 1.43 | 9000 | 9.00x |" in s   # the propose table
    assert "pytest-timeout: 2.4.0" in s and "per-test timeout: 90 s a test (pytest-timeout 2.4.0)" in s
    # the clocks, idle and after the last step (nvidia-smi's answer, or why there is none)
    assert re.search(r"^  clocks at the probe \(idle\): .*; reasons: ", s, re.M)
    assert re.search(r"clocks after the last step: .*; reasons: ", (out / "gpu_check.log").read_text())
    # one python process per step: the probe, the smoke, one pytest for every gpu-marked test, the benchmark
    assert fake.calls.read_text().splitlines() == ["-c import importlib", "scripts/gpu_smoke.py --watchdog-s",
                                                   "-m pytest", "benchmarks/gpu_bench.py --out"]
    assert "python processes started: 5" in s
    argv = (fake.dir / "pytest_argv.txt").read_text().splitlines()
    assert "--timeout=90" in argv and "faulthandler_timeout=80" in argv and argv[-2] == "tests/" and argv[argv.index("-m") + 1] == "gpu"
    assert "--continue-on-collection-errors" in argv and "--hypothesis-profile=device" in argv
    assert "ENV MTPKERN_PRINT_FAILURES=1" in argv
    assert cp.stdout.rstrip().endswith(s.rstrip())               # the summary closes the output


def test_without_pytest_timeout_the_tests_run_without_it_and_say_so(fake):
    cp, out = fake(["--steps", "tests", "--test-timeout", "45"], FAKE_PROBE=_PROBE_WITHOUT,
                   FAKE_PYTEST=fake.dir / "pytest_standin.py")
    argv = (fake.dir / "pytest_argv.txt").read_text().splitlines()
    assert not any(a.startswith("--timeout") for a in argv)
    assert "no:timeout" in argv and "faulthandler_timeout=45" in argv
    s = (out / "summary.txt").read_text()
    assert "per-test timeout: none: pytest-timeout is not importable" in s
    assert _step(s, "bench") == "left out (--steps)"
    assert _contract(out) == ["gpu_check.log", "summary.txt", "tests.log"]


def test_a_step_past_its_limit_is_stopped_and_named(fake):
    """A test that hangs: the step stops at its limit, the summary names the test that was
    running, and the benchmark after it still runs."""
    cp, out = fake(["--steps", "tests,bench", "--limit", "tests=3"], FAKE_PROBE=_PROBE_WITH_TIMEOUT,
                   FAKE_PYTEST=fake.dir / "pytest_standin.py", FAKE_PYTEST_HANG=1, FAKE_BENCH=fake.dir / "bench_standin.py", FAKE_BENCH_ROWS=1)
    s = (out / "summary.txt").read_text()
    assert _step(s, "tests").startswith("timed out (stopped at its 3s limit, rc 124)")
    assert "pytest: no final line: the run was cut short" in s
    assert "running when the step ended: tests/test_gpu.py::test_graph_replay_equals_eager[1-draft]" in s
    # the failure printed when its test ended, though the run never reached its summary
    assert "  failed: tests/test_backend_parity.py::test_fast_backend_matches_reference[exact-prenorm-cuda] (call): " \
           "E   assert [[300, 238, 239]] == [[300, 238, 81]]" in s
    assert _step(s, "bench") == "passed" and cp.returncode == 1
    assert "TIMEOUT: tests stopped at its 3s limit" in (out / "tests.log").read_text()


def test_a_benchmark_killed_at_its_limit_keeps_its_rows(fake):
    """The benchmark never ends by itself; killed at its limit, every row it reported is in
    gpu_bench.jsonl and gpu_bench.md, and the summary counts them."""
    cp, out = fake(["--steps", "bench", "--limit", "bench=3"], FAKE_PROBE=_PROBE_WITH_TIMEOUT,
                   FAKE_BENCH=fake.dir / "bench_standin.py", FAKE_BENCH_ROWS=0)
    s = (out / "summary.txt").read_text()
    assert _step(s, "bench").startswith("timed out (stopped at its 3s limit")
    reported = [int(x.split()[1]) for x in (out / "bench.log").read_text().splitlines() if x.startswith("row ")]
    assert len(reported) >= 5                                     # 0.1 s apart for 3 s
    rows = [json.loads(x) for x in (out / "gpu_bench.jsonl").read_text().splitlines()]
    kernels = [r["op"] for r in rows if r["kind"] == "kernel"]
    assert kernels[:len(reported)] == [f"linear_{i}" for i in reported]
    md = (out / "gpu_bench.md").read_text()
    assert all(f"| linear_{i} | 1 |" in md for i in reported)
    assert f"bench: {len(kernels)} kernel rows, 0 propose rows" in s and "no end record (killed before it)" in s
    assert _contract(out) == ["bench.log", "gpu_bench.jsonl", "gpu_bench.md", "gpu_check.log", "summary.txt"]


def test_steps_run_in_the_order_given(fake):
    cp, out = fake(["--steps", "bench,tests"], FAKE_PROBE=_PROBE_WITH_TIMEOUT, FAKE_PYTEST=fake.dir / "pytest_standin.py",
                   FAKE_BENCH=fake.dir / "bench_standin.py", FAKE_BENCH_ROWS=1)
    assert fake.calls.read_text().splitlines() == ["-c import importlib", "benchmarks/gpu_bench.py --out", "-m pytest"]
    log = (out / "gpu_check.log").read_text()
    assert log.index("start bench") < log.index("start tests")


def test_files_over_the_size_limit_are_gzipped_in_place(fake):
    cp, out = fake(["--steps", "bench"], FAKE_PROBE=_PROBE_WITH_TIMEOUT, FAKE_BENCH=fake.dir / "bench_standin.py",
                   FAKE_BENCH_ROWS=40, FAKE_BENCH_SLEEP=0, GPU_CHECK_MAX_BYTES=2000)
    names = _contract(out)
    assert "gpu_bench.jsonl.gz" in names and "gpu_bench.jsonl" not in names and "summary.txt" in names
    s = (out / "summary.txt").read_text()
    assert "bench: 40 kernel rows, 1 propose rows" in s                 # counted before the gzip
    assert "gzipped (over 2000 bytes) after the summary above was written: " in s and "gpu_bench.jsonl.gz" in s


@pytest.mark.parametrize("args, message", [
    (["--limit", "tests=400"], "add up to 720 s, over the 470 s"),
    (["--limit", "lint=3"], "--limit: expected a step of probe, smoke, profile, tests, bench, got 'lint'"),
    (["--limit", "=3"], "--limit: expected a step of probe, smoke, profile, tests, bench, got ''"),
    (["--limit", "bench=0"], "--limit: expected a whole number of seconds >= 1 for bench, got '0'"),
    (["--steps", "tests,docs"], "--steps: expected names among smoke, profile, tests, bench, got 'docs'"),
    (["--test-timeout", "x"], "--test-timeout: expected a whole number of seconds"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
])
def test_bad_options_are_refused_before_anything_runs(fake, args, message):
    cp, out = fake(args)
    assert cp.returncode == 2 and message in cp.stderr
    assert not out.exists() and not fake.calls.exists()


def test_the_default_limits_add_up_under_eight_minutes():
    text = SCRIPT.read_text()
    limits = dict(re.findall(r"\[(probe|smoke|profile|tests|bench)\]=(\d+)",
                             text.split("declare -A LIMIT=", 1)[1].split("\n")[0]))
    grace = int(re.search(r"^KILL_AFTER=(\d+)$", text, re.M).group(1))
    assert set(limits) == {"probe", "smoke", "profile", "tests", "bench"}
    assert sum(int(v) + grace for v in limits.values()) <= 470 < 480


def test_the_real_steps_on_this_machine(fake, tmp_path):
    """The real probe, smoke (it fails at ``import cupy``, or at the missing device), pytest
    (every gpu-marked test of tests/test_gpu.py skips without a device) and benchmark (it stops
    at ``import cupy``, or at the missing device)."""
    cp, out = fake(["--tests", "tests/test_gpu.py"], timeout=300)
    s = (out / "summary.txt").read_text()
    assert re.search(r"^  python: \d+\.\d+", s, re.M) and re.search(r"^  pytest-timeout: ", s, re.M)
    assert _step(s, "tests") == "passed"
    m = re.search(r"^tests: (\d+) passed, 0 failed, 0 errors, (\d+) skipped \(pytest: .* in [\d.]+s\)$", s, re.M)
    assert m and int(m.group(2)) >= 10, s
    assert _step(s, "bench") == "failed (rc 1)" and "bench: 0 kernel rows" in s and "  error: " in s
    assert _step(s, "smoke") == "failed (rc 1)" and "phase build FAILED" in (out / "smoke.log").read_text()
    assert _step(s, "profile") == "passed"                       # the ncu stand-in
    assert "python processes started: 5" in s
    assert fake.calls.read_text().splitlines() == ["-c import importlib", "scripts/gpu_smoke.py --watchdog-s",
                                                   "-m pytest", "benchmarks/gpu_bench.py --out"]
    _contract(out)


def test_the_smoke_synchronises_the_device(monkeypatch):
    """scripts/gpu_smoke.py's sync on cuda is one device synchronise (a stand-in cupy here)."""
    import importlib.util
    import types

    calls = []
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: calls.append(1)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    smoke.sync("cuda")
    smoke.sync("cpu")
    assert calls == [1]


def test_without_ncu_the_profile_step_fails_and_the_rest_runs(fake):
    cp, out = fake(["--steps", "profile,bench"], ncu=False, FAKE_PROBE=_PROBE_WITH_TIMEOUT,
                   FAKE_BENCH=fake.dir / "bench_standin.py", FAKE_BENCH_ROWS=1,
                   PATH="/usr/bin:/bin")
    s = (out / "summary.txt").read_text()
    assert _step(s, "profile") == "failed (ncu not found)" and _step(s, "bench") == "passed"
    assert "ncu not found" in (out / "profile.log").read_text() and cp.returncode == 1
