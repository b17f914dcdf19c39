"""The command line: demo (both KV modes, batch), info, errors as one line, help, progress."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpkern import ConfigError
from mtpkern.backends import cuda_available
from mtpkern.cli import build_parser, main
from mtpkern.progress import Progress, WarmUpReport


def run(*args, env=None, check=True):
    return subprocess.run([sys.executable, "-m", "mtpkern", *args], check=check, capture_output=True, text=True,
                          env=env)


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """The synthetic checkpoints under tmp_path, in this process and in subprocesses."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return dict(os.environ)


def _consistent(fig: dict) -> None:
    """The demo's acceptance figures are what its verifier decided, and nothing else."""
    off, acc, n = fig["offered_at"], fig["accepted_at"], fig["verifies"]
    assert n >= 1 and off[0] == n and all(0 <= a <= o for a, o in zip(acc, off))
    assert fig["acceptance_per_position"] == [round(a / o, 4) for a, o in zip(acc, off)]
    assert fig["tokens_per_verify"] == round(1 + sum(acc) / n, 4)


def test_demo_prints_figures(tmp_path):
    out = tmp_path / "demo.json"
    r = run("demo", "--backend", "numpy", "--max-new-tokens", "12", "--repeats", "1", "--json", str(out))
    for needle in ("lossless: yes", "acceptance/position", "tokens per verify", "tokens/s greedy",
                   "tokens/s speculative", "speedup", "from the verifier's decisions", "held out",
                   "stdlib-glm-tiny", "chain: postnorm", "Hq / Hkv query / key-value heads", "generated (12 tokens"):
        assert needle in r.stdout, needle
    fig = json.loads(out.read_text())
    assert fig["lossless"] is True and fig["kv_mode"] == "exact" and fig["chain"] == "postnorm"
    assert len(fig["tokens"]) == 12 and fig["text"] == bytes(fig["tokens"]).decode("utf-8", "replace")
    assert len(fig["offered_at"]) == 3 and fig["greedy_tokens_per_s"] > 0 and fig["speculative_tokens_per_s"] > 0
    _consistent(fig)
    r = run("demo", "--backend", "numpy", "--max-new-tokens", "9", "--repeats", "1", "--kv-mode", "draft",
            "--num-drafts", "2", "--prompt", "def f(x):\n    return", "--json", str(out))
    fig = json.loads(out.read_text())
    assert fig["lossless"] is True and fig["kv_mode"] == "draft" and len(fig["offered_at"]) == 2
    assert fig["prompt"] == "def f(x):\n    return" and "--prompt" in r.stdout
    _consistent(fig)


def test_demo_says_num_drafts_is_clamped(capsys):
    assert main(["demo", "--backend", "numpy", "--steps", "2", "--repeats", "1", "--num-drafts", "7"]) == 0
    out = capsys.readouterr().out
    assert "--num-drafts 7 is more than the M=3 modules" in out and "k=3" in out


def test_demo_cpu_threads(capsys, tmp_path):
    out = tmp_path / "demo.json"
    assert main(["demo", "--steps", "2", "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["threads"] == 1 and "1 thread)" in fig["backend"] and fig["lossless"] is True


def test_demo_runs_another_checkpoint_with_target_layers(tmp_path, capsys):
    """--ckpt: a synthetic glm4_moe checkpoint with random target layers (no training.json:
    the family's chain; no prompts.json: --prompt is needed)."""
    from mtpkern import write_synthetic_checkpoint
    from mtpkern.config import tiny_config

    cfg = tiny_config(family="glm4_moe", num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=48)
    ckpt = write_synthetic_checkpoint(tmp_path / "ck", cfg, seed=5, target_layers=True)
    assert main(["demo", "--backend", "numpy", "--ckpt", str(ckpt), "--steps", "6", "--repeats", "1"]) == 2
    assert "--prompt: expected a prompt" in capsys.readouterr().err
    out = tmp_path / "demo.json"
    assert main(["demo", "--backend", "numpy", "--ckpt", str(ckpt), "--steps", "6", "--repeats", "1",
                 "--prompt", "abc", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert fig["lossless"] is True and fig["chain"] == "prenorm" and len(fig["tokens"]) == 6
    _consistent(fig)


def test_docs_synthetic_checkpoint_example_runs(tmp_path, capsys):
    """The paste-able example of docs/cli.md, as written (into tmp_path, not /tmp)."""
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    example = next(b for b in blocks if "write_synthetic_checkpoint" in b)
    exec(compile(example.replace("/tmp/mtp-tiny", str(tmp_path / "mtp-tiny")), "docs/cli.md", "exec"), {})
    assert "[0, 0]" not in capsys.readouterr().out          # blocks in use while the state lives
    assert main(["info", str(tmp_path / "mtp-tiny")]) == 0


def test_info(tiny_ckpt):
    r = run("info", str(tiny_ckpt))
    assert "module 2: model.layers.4.*" in r.stdout and "target lm_head.weight: [301, 64] BF16" in r.stdout


# -- errors: one line, no traceback, exit status 2 -------------------------------------------------

def _error_cases(tmp_path: Path, config_json: str = "{}") -> dict[str, list[str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a checkpoint")
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_config = tmp_path / "bad-config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"hidden_size": "big"}')
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(config_json)       # a valid config, no safetensors
    return {
        "nonexistent": ["info", str(tmp_path / "nonexistent")],
        "a file": ["info", str(a_file)],
        "no config.json": ["info", str(empty)],
        "bad config.json": ["info", str(bad_config)],
        "no safetensors": ["info", str(no_weights)],
        "max-new-tokens 0": ["demo", "--max-new-tokens", "0"],
        "steps -1": ["demo", "--steps", "-1"],
        "num-drafts x": ["demo", "--num-drafts", "x"],
        "empty prompt": ["demo", "--backend", "numpy", "--prompt", ""],
        "threads 0": ["demo", "--threads", "0"],
        "threads too many": ["demo", "--threads", "4096"],
        "threads on numpy": ["demo", "--backend", "numpy", "--threads", "1"],
        "acceptance min-confidence 2": ["acceptance", "--backend", "numpy", "--min-confidence", "2"],
        "demo --ckpt file": ["demo", "--ckpt", str(a_file)],
        "bench contexts 0": ["bench", "--contexts", "0"],
        "bench kv-modes": ["bench", "--kv-modes", "draft,fast"],
        "bench runs 0": ["bench", "--runs", "0"],
        "bench plot without propose": ["bench", "--no-propose", "--plot", str(tmp_path / "p.png")],
        "unknown command": ["frobnicate"],
        "no command": [],
    }


ERROR_NAMES = ["nonexistent", "a file", "no config.json", "bad config.json", "no safetensors", "max-new-tokens 0",
               "steps -1", "num-drafts x", "empty prompt", "acceptance min-confidence 2", "threads 0",
               "threads too many", "threads on numpy",
               "demo --ckpt file", "bench contexts 0", "bench kv-modes", "bench runs 0",
               "bench plot without propose", "unknown command",
               "no command"]


def _assert_one_line_error(rc: int, err: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpkern: error: "), err


@pytest.mark.parametrize("case", ERROR_NAMES)
def test_error_is_one_line_in_process(case, tmp_path, cache_env, capsys, tiny_ckpt):
    cases = _error_cases(tmp_path, (tiny_ckpt / "config.json").read_text())
    assert sorted(cases) == sorted(ERROR_NAMES)
    rc = main(cases[case])
    _assert_one_line_error(rc, capsys.readouterr().err)


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is usable here")
def test_cuda_without_cupy_names_the_extra(tmp_path, cache_env, capsys):
    rc = main(["demo", "--backend", "cuda"])
    err = capsys.readouterr().err
    _assert_one_line_error(rc, err)
    assert "mtpkern[cuda12]" in err
    assert not (tmp_path / "cache").exists()        # refused before loading anything


def test_errors_name_what_is_wrong(tmp_path, cache_env, capsys):
    cases = _error_cases(tmp_path)
    want = {"nonexistent": "does not exist", "a file": "which is a file",
            "max-new-tokens 0": "argument --max-new-tokens", "empty prompt": "--prompt: expected a non-empty",
            "threads on numpy": "only the cpu backend", "no config.json": "has none"}
    for case, needle in want.items():
        main(cases[case])
        assert needle in capsys.readouterr().err, case


@pytest.mark.parametrize("case", ["nonexistent", "a file", "max-new-tokens 0", "bad config.json"])
def test_error_is_one_line_as_a_command(case, tmp_path, cache_env):
    r = run(*_error_cases(tmp_path)[case], env=cache_env, check=False)
    _assert_one_line_error(r.returncode, r.stderr)


def test_debug_shows_the_traceback(tmp_path, cache_env):
    bad = _error_cases(tmp_path)["bad config.json"]
    with pytest.raises(ConfigError):
        main(["--debug", *bad])
    with pytest.raises(ConfigError):
        main([*bad, "--debug"])
    r = run("--debug", *bad, env=cache_env, check=False)
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr


# -- help ----------------------------------------------------------------------------------------------

def _parsers():
    top = build_parser("mtpkern")
    sub = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    return [("", top)] + sorted(sub.choices.items())


@pytest.mark.parametrize("name", ["", "demo", "info", "bench", "acceptance"])
def test_help_lists_every_option_with_its_default(name):
    parser = dict(_parsers())[name]
    text = " ".join(parser.format_help().split()).split(" options: ", 1)[1]
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options
    # each option's entry in the help: from its first option string to the next option's
    # one option string: "--x ..."; several: "-v, --verbose" or "--max-new-tokens N, --steps N"
    starts = sorted((text.index(a.option_strings[0] + " ") if len(a.option_strings) == 1 else
                     re.search(re.escape(a.option_strings[0]) + r"( \S+)?,", text).start(), a) for a in options)
    for (start, a), (end, _) in zip(starts, starts[1:] + [(len(text), None)]):
        assert a.help, a.option_strings
        assert "(default: " in text[start:end], text[start:end]


def test_help_says_what_mtpkern_is(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mtpkern ")
    assert "speculative decoding" in out and "multi-module MTP" in out


def test_console_forms_call_themselves_by_their_name():
    r = run("--help")
    assert r.stdout.startswith("usage: python -m mtpkern ")
    r = run("bench", "--help")
    assert r.stdout.startswith("usage: python -m mtpkern bench ")
    script = Path(sys.executable).parent / "mtpkern"
    if not script.exists():
        script = shutil.which("mtpkern")
    if script is None:
        pytest.skip("the mtpkern console script is not installed (pip install -e .)")
    r = subprocess.run([str(script), "demo", "--help"], capture_output=True, text=True, check=True)
    assert r.stdout.startswith("usage: mtpkern demo ")


# -- progress ----------------------------------------------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_no_carriage_return_off_a_terminal():
    pipe, tty = io.StringIO(), _Tty()
    for stream, lines in ((pipe, False), (tty, False)):
        bar = Progress(3, "demo", stream=stream, after=0.0, lines=lines)
        for i in range(1, 4):
            bar.update(i)
        bar.close()
    assert pipe.getvalue() == ""                   # the demo's bar: nothing off a terminal
    assert "\r" in tty.getvalue()
    logged = io.StringIO()
    bar = Progress(3, "kernels", stream=logged, after=0.0, lines=True)
    for i in range(1, 4):
        bar.update(i, f"family {i}")
    bar.close()
    assert "\r" not in logged.getvalue() and logged.getvalue().count("\n") == 3


def test_warm_up_report_speaks_only_when_compiling():
    quiet = io.StringIO()
    report = WarmUpReport(quiet)                    # every family loaded from the cache: no compile
    for i in range(4):
        report(i, 3, f"f{i}")
    report.close()
    assert quiet.getvalue() == "" and not report.compiled
    loud = io.StringIO()
    report = WarmUpReport(loud)
    for i, name in enumerate(["a", "b", "c", ""]):
        report(i, 3, name)
        if i == 0:
            report.compiling()                      # family "a" compiles (a Numba compile event)
    report.close()
    text = loud.getvalue()
    assert report.compiled and text.startswith("compiling kernels (first run only")
    assert "\r" not in text and "next: b" in text and "kernels ready" in text


def test_demo_stderr_has_no_carriage_return(cache_env):
    r = run("demo", "--steps", "3", "--repeats", "1", env=cache_env)
    assert "\r" not in r.stderr


@pytest.mark.parametrize("kind", ["fifo", "dir", "dangling"])
def test_info_says_what_config_json_is(tmp_path, kind, capsys):
    from mtpkern.cli import main

    cfg = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(cfg)
    elif kind == "dir":
        cfg.mkdir()
    else:
        os.symlink(tmp_path / "gone.json", cfg)
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    want = {"fifo": "not a regular file", "dir": "a directory", "dangling": "a symlink to nothing"}[kind]
    assert err.startswith("mtpkern: error:") and want in err and err.count("\n") == 1


@pytest.mark.parametrize("path,msg", [("", "expected a file path, got ''"),
                                      ("/nonexistent/x.json", "does not exist"), (".", "which is a directory")])
def test_output_paths_are_refused_before_the_run(path, msg, capsys):
    from mtpkern.cli import main

    assert main(["demo", "--json", path, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_a_closed_pipe_is_not_an_error(tmp_path):
    r = subprocess.run(f"{sys.executable} -m mtpkern demo --steps 30 --backend numpy | head -1", shell=True,
                       capture_output=True, text=True, timeout=300)
    assert "Broken pipe" not in r.stderr and "Traceback" not in r.stderr


# -- info checks every tensor's header against the config ------------------------------------------

def _edited_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint ``src`` whose tensors went through ``edit(dict)``."""
    from safetensors.numpy import save_file

    from mtpkern.weights import read_tensors

    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1
    tensors = read_tensors(dst)
    edit(tensors)
    save_file(tensors, str(files[0]))
    return dst


def test_info_refuses_a_checkpoint_missing_a_tensor(tiny_ckpt, tmp_path, capsys):
    """Exit 2 naming every tensor the loader would refuse, read from the headers alone."""
    import numpy as np

    def edit(t):
        del t["model.layers.3.mlp.experts.1.up_proj.weight"]                     # missing
        t["model.layers.2.eh_proj.weight"] = t["model.layers.2.eh_proj.weight"][:, :100]   # wrong shape
        t["model.layers.4.enorm.weight"] = t["model.layers.4.enorm.weight"].astype(np.float16)  # wrong dtype
    bad = _edited_copy(tiny_ckpt, tmp_path / "bad", edit)
    assert main(["info", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert "3 problem(s)" in out
    assert "'model.layers.3.mlp.experts.1.up_proj.weight' is missing" in out
    assert "'model.layers.2.eh_proj.weight'" in out and "expected shape [64, 128], got [64, 100]" in out
    assert "'model.layers.4.enorm.weight'" in out and "expected dtype BF16 or F32, got F16" in out
    assert err.startswith("mtpkern: error: ") and err.count("\n") == 1 and "3 problem(s)" in err


def test_info_refuses_a_missing_target_head(tiny_ckpt, tmp_path, capsys):
    def edit(t):
        del t["lm_head.weight"]
    bad = _edited_copy(tiny_ckpt, tmp_path / "nohead", edit)
    assert main(["info", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "module 0 LM head: none of the tensors" in out and "'lm_head.weight'" in out


def test_info_passes_a_whole_checkpoint(tiny_ckpt, capsys):
    assert main(["info", str(tiny_ckpt)]) == 0
    assert "every tensor the modules read is present" in capsys.readouterr().out
