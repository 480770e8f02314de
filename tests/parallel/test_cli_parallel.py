"""``python -m minillm generate --tensor-parallel N / --pipeline-parallel N``, spawned by the command
itself and under torchrun: the printed text is byte-for-byte the single process's, and bad input
is refused on one line, with status 2, before any process starts.

The parallel runs are real subprocesses (the command spawns its ranks, torchrun its workers),
started all at once in one module fixture to share the two cores' time; the reference texts and
the refusals run in this process (``main``), with ``launch`` replaced by a trap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import minillm
from minillm.cli.generate import rank_failure
from minillm.parallel import launch as launching
from minillm.parallel.cli_ranks import until_eos
from minillm.parallel.launch import RankError
from tests.conftest import tiny_model
from tests.test_cli import run_main

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
GENERATE = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--device", "cpu"]
SAMPLED = ["--temperature", "0.8", "--seed", "1"]


def commands() -> dict[str, list[str]]:
    module = [sys.executable, "-m", "minillm"]
    torchrun = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    torchrun += ["--rdzv-endpoint", "127.0.0.1:0", "-m", "minillm"]
    return {
        "tp": [*module, *GENERATE, "--tensor-parallel", "2"],
        "tp_sampled": [*module, *GENERATE, *SAMPLED, "--tensor-parallel", "2"],
        "pp": [*module, *GENERATE, "--pipeline-parallel", "2"],
        "torchrun": [*torchrun, *GENERATE, "--tensor-parallel", "2"],
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, str, str]]:
    """Every parallel command, run at once: name -> (status, stdout, stderr)."""
    env = {
        **os.environ,
        "MINILLM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    procs = {
        name: subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in commands().items()
    }
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=150)
            out[name] = (proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return out


def split(stdout: str) -> tuple[str, list[str]]:
    """stdout -> (the text: everything before the first timing line; the timing lines)."""
    timing = [line for line in stdout.splitlines() if line.startswith("TTFT ")]
    cut = stdout.find("\nTTFT ")
    return (stdout[: cut + 1] if cut >= 0 else stdout), timing


REFERENCES: dict[tuple[str, ...], str] = {}


def reference(capsys, *extra: str) -> str:
    """The single process's text (run here, once per option set)."""
    if extra not in REFERENCES:
        status, out, err = run_main([*GENERATE, *extra], capsys)
        assert status == 0, err
        text, timing = split(out)
        assert len(timing) == 1 and "24 new tokens" in timing[0]
        assert text.startswith("def fibonacci(n):") and len(text) > len("def fibonacci(n):") + 20
        REFERENCES[extra] = text
    return REFERENCES[extra]


def test_tensor_parallel_prints_the_single_process_text(runs, capsys):
    status, out, err = runs["tp"]
    assert status == 0, err
    text, timing = split(out)
    assert text == reference(capsys)
    assert len(timing) == 1 and timing[0].endswith("tensor-parallel 2 ranks)") and "24 new tokens" in timing[0]


def test_tensor_parallel_samples_the_single_process_text(runs, capsys):
    status, out, err = runs["tp_sampled"]
    assert status == 0, err
    sampled = reference(capsys, *SAMPLED)
    assert sampled != reference(capsys)  # sampling did change the text
    assert split(out)[0] == sampled


def test_pipeline_parallel_prints_the_single_process_text(runs, capsys):
    status, out, err = runs["pp"]
    assert status == 0, err
    text, timing = split(out)
    assert text == reference(capsys)
    assert len(timing) == 1 and timing[0].endswith("pipeline-parallel 2 stages)") and "24 new tokens" in timing[0]


def test_torchrun_prints_the_text_once(runs, capsys):
    status, out, err = runs["torchrun"]
    assert status == 0, err
    text, timing = split(out)
    assert text == reference(capsys)
    assert len(timing) == 1 and "tensor-parallel 2 ranks" in timing[0]


def test_rank_failure_keeps_the_rank_and_the_cause():
    message = (
        'rank 1 of 2 failed:\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "ValueError: bad shard\n\nthen: rank 0: RuntimeError: Connection closed by peer"
    )
    assert rank_failure(RankError(message)) == "rank 1 of 2 failed: ValueError: bad shard"
    assert (
        rank_failure(RankError("rank(s) [1] of 2 still running after 5 s"))
        == "rank(s) [1] of 2 still running after 5 s"
    )


# ---------------------------------------------------------------------------------------------
# Refused before any process starts


@pytest.fixture
def no_spawn(monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(launching, "launch", trap)
    monkeypatch.setattr(launching, "init_from_env", trap)


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory) -> Path:
    model = tiny_model(n_layers=2, n_heads=4, n_kv_heads=2)
    return minillm.save_pretrained(model, tmp_path_factory.mktemp("bare") / "bare")


BAD = {
    "heads": (["--tensor-parallel", "3"], "8 query heads cannot be split over 3"),
    "stages": (["--pipeline-parallel", "7"], "6 layers cannot be split over 7"),
    "zero tp": (["--tensor-parallel", "0"], "--tensor-parallel must be a positive"),
    "negative pp": (["--pipeline-parallel", "-1"], "--pipeline-parallel must be a positive"),
    "both": (["--tensor-parallel", "2", "--pipeline-parallel", "2"], "together are not supported"),
    "quantize": (
        ["--tensor-parallel", "2", "--quantize", "int8"],
        "tensor parallelism with quantized weights is not supported",
    ),
    "sampling pp": (["--pipeline-parallel", "2", "--temperature", "0.5"], "greedily only"),
    "too long": (["--tensor-parallel", "2", "--max-new-tokens", "100000"], "context"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_status_2(case, no_spawn, capsys):
    extra, expected = BAD[case]
    status, out, err = run_main([*GENERATE, *extra], capsys)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("minillm generate: error: ") and expected in err, err


def test_a_model_without_tokenizer_is_refused(no_tokenizer, no_spawn, capsys):
    status, out, err = run_main([*GENERATE, "--model", str(no_tokenizer), "--tensor-parallel", "2"], capsys)
    assert status == 2 and err.count("\n") == 1 and "no tokenizer.json" in err, err


def test_torchrun_world_size_must_match(no_spawn, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    status, out, err = run_main([*GENERATE, "--tensor-parallel", "2"], capsys)
    assert status == 2 and err.count("\n") == 1 and "torchrun started 4 processes but --tensor-parallel is 2" in err


def test_help_lists_both_flags(capsys):
    status, out, _ = run_main(["generate", "--help"], capsys)
    assert status == 0
    assert "--tensor-parallel N" in out and "--pipeline-parallel N" in out


def test_pipeline_text_stops_after_the_first_eos():
    eos = minillm.load("minillm-target")[0].config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    assert until_eos([5, 9, eos, 7, eos], "minillm-target") == [5, 9, eos]
    assert until_eos([5, 9, 7], "minillm-target") == [5, 9, 7]
