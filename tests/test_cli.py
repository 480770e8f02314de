"""The command line (``python -m minillm``) and the generation benchmarks, on a tiny random model
saved with its own tiny tokenizer, so that nothing here needs the bundled models."""

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import minillm
from minillm.bench import generation as bench
from minillm.cli.common import CliError
from minillm.cli.figures import report_figures
from minillm.cli.main import build_parser, main
from minillm.compression import quantize
from minillm.compression.saving import save_quantized
from minillm.core.config import PRESETS
from minillm.core.tokenizer import Tokenizer
from minillm.measure import report
from tests.conftest import tiny_config, tiny_model

REPO = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
SENTENCES = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i)\n",
]


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on three sentences: any text encodes, into a few hundred ids."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOT], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)])
    return Tokenizer(tok, bos_token=EOT, eos_token=EOT)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tokenizer = tiny_tokenizer()
    model = tiny_model(vocab_size=tokenizer.vocab_size, max_seq_len=256, bos_token_id=0)  # no EOS: never stops
    return minillm.save_pretrained(model, tmp_path_factory.mktemp("tiny") / "tiny-cli", tokenizer)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv) -> (exit status, stdout, stderr), argparse's own exits included."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def run_python(code_or_args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], cwd=REPO, capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# The CLI


def test_help_lists_every_command():
    proc = run_python(["-m", "minillm", "--help"])
    assert proc.returncode == 0, proc.stderr
    for command in ("generate", "serve", "bench", "models", "corpus", "train"):
        assert f"    {command} " in proc.stdout, f"{command} missing from --help:\n{proc.stdout}"


def command_parsers(parser=None, path=()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command of the CLI by its words (``()``, ``("bench",)``, ``("bench", "kv")``, ...)."""
    parser = parser or build_parser()
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= command_parsers(sub, (*path, name))
    return found


def command_paths() -> list[tuple[str, ...]]:
    return list(command_parsers())


BENCHMARKS = {
    "generate",
    "kv",
    "decoding",
    "batching",
    "prefix-cache",
    "compression",
    "disagg",
    "serve",
    "serve-stack",
    "parallel",
    "capstone",
    "peers",
}


def test_the_parser_tree_has_every_command():
    paths = command_paths()
    assert {("generate",), ("serve",), ("bench", "compression"), ("train", "model")} <= set(paths)
    assert len(paths) == len(set(paths))


@pytest.mark.parametrize("path", command_paths(), ids=lambda p: " ".join(p) or "minillm")
def test_every_command_prints_its_help(path, capsys):
    """``--help`` of every command exits 0 with its usage (a stray '%' in a help string, which
    argparse reads as a format, fails here)."""
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_benchmark_takes_threads_json_and_no_save():
    """Every ``bench`` command has --threads, --json and --no-save, and saves as bench_<name>
    (a hyphen of the name an underscore)."""
    benchmarks = {path[1]: p for path, p in command_parsers().items() if len(path) == 2 and path[0] == "bench"}
    assert set(benchmarks) == BENCHMARKS
    for name, parser in benchmarks.items():
        flags = {flag for action in parser._actions for flag in action.option_strings}
        assert {"--threads", "--json", "--no-save"} <= flags, name
        assert parser.get_default("result_name") == f"bench_{name.replace('-', '_')}"
        assert parser.parse_args(["--no-save"]).no_save and not parser.parse_args([]).no_save


def test_a_shared_option_has_one_help_text_wherever_it_appears():
    """Each shared option is written once (``cli.common``): one help text in every command that
    takes it, or one text but for the default (and, for a model, its role in the command)."""
    helps = defaultdict(set)
    for parser in command_parsers().values():
        for action in parser._actions:
            for flag in action.option_strings:
                helps[flag].add(action.help)
    for flag in ("--device", "--threads", "--json", "--no-progress", "--quantize", "--group-size"):
        assert len(helps[flag]) == 1, (flag, helps[flag])
    for flag in (
        "--repeats",
        "--new-tokens",
        "--prompt-len",
        "--slo-ttft",
        "--slo-tpot",
        "--requests",
        "--no-save",
        "--max-batch",
    ):
        assert len({re.sub(r"\(default: .*\)$|bench_\w+|uptrain_gqa", "", h) for h in helps[flag]}) == 1, flag
        assert len(helps[flag]) > 1, f"{flag} is taken by one command only: nothing shared"
    models = helps["--model"] | helps["--target"] | helps["--draft"]
    assert len({re.sub(r"^[^:]*: |\(default: .*\)$", "", h) for h in models}) == 1, models


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """An empty results store in a temporary folder: no test writes into the package's."""
    monkeypatch.setenv("MINILLM_RESULTS", str(tmp_path / "store"))
    return tmp_path / "store"


def test_a_benchmark_saves_its_figures_unless_no_save(store, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(PRESETS, "tiny-mha", tiny_config())
    argv = ["bench", "kv", "--shape", "tiny-mha", "--contexts", "8", "--new-tokens", "2", "--repeats", "1"]
    argv += ["--device", "cpu", "--no-progress"]
    status, out, err = run_main([*argv, "--no-save", "--json", str(tmp_path / "kv.json")], capsys)
    assert status == 0, err
    assert "MHA (baseline)" in out and f"figures written to {tmp_path / 'kv.json'}" in out
    assert not store.exists() and "saved" not in out
    status, out, err = run_main(argv, capsys)
    assert status == 0, err
    hardware = report.hardware_slug("cpu")
    saved = store / hardware / "bench_kv.json"
    assert f"figures saved to {saved}" in out
    figures = json.loads(saved.read_text())
    assert figures["model"].endswith("as MHA") and figures["rows"]
    assert report.load_results("bench_kv") == {hardware: figures}


def test_without_minillm_results_a_benchmark_saves_in_the_current_directory(tmp_path, monkeypatch, capsys):
    """Never into the package (or its source tree), whose saved results the chapters read."""
    monkeypatch.delenv("MINILLM_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(PRESETS, "tiny-mha", tiny_config())
    packaged = set(report.RESULTS_DIR.rglob("*.json"))
    argv = ["bench", "kv", "--shape", "tiny-mha", "--contexts", "8", "--new-tokens", "2", "--repeats", "1"]
    status, out, err = run_main([*argv, "--device", "cpu", "--no-progress"], capsys)
    assert status == 0, err
    saved = tmp_path / "minillm-results" / report.hardware_slug("cpu") / "bench_kv.json"
    assert saved.is_file() and f"figures saved to {saved}" in out
    assert set(report.RESULTS_DIR.rglob("*.json")) == packaged


# Each benchmark's module (``minillm.bench.X``): faking its ``bench_*`` and ``format_*`` functions
# tests each command's own work (its options built and checked, its end) in a second, not the measuring.
BENCH_MODULES = {"generate": "generation", **{name: name.replace("-", "_") for name in BENCHMARKS - {"generate"}}}


def fake_measuring(monkeypatch, benchmark: str) -> dict:
    """Replace what ``bench BENCHMARK`` measures with figures made up here; return them."""
    import importlib

    module = importlib.import_module(f"minillm.bench.{BENCH_MODULES[benchmark]}")
    figures = {"device": "cpu", "benchmark": benchmark}
    for name in dir(module):
        if name.startswith("bench_") and callable(getattr(module, name)):
            monkeypatch.setattr(module, name, lambda *args, **kwargs: dict(figures))
        elif name.startswith("format_") and callable(getattr(module, name)):
            monkeypatch.setattr(module, name, lambda figures: f"the table of bench {figures['benchmark']}")
    return figures


@pytest.mark.parametrize("benchmark", sorted(BENCHMARKS))
def test_every_benchmark_saves_its_figures_through_the_store_unless_no_save(benchmark, store, monkeypatch, capsys):
    figures = fake_measuring(monkeypatch, benchmark)
    argv = ["bench", benchmark, *(["--device", "cpu"] if benchmark == "generate" else [])]
    status, out, err = run_main([*argv, "--no-save"], capsys)
    assert status == 0, err
    assert f"the table of bench {benchmark}" in out and not store.exists()
    status, out, err = run_main(argv, capsys)
    assert status == 0, err
    if benchmark == "generate":  # two measurements, saved together
        figures = {"vs_transformers": figures, "cache_vs_recompute": figures}
    name = f"bench_{benchmark.replace('-', '_')}"
    saved = store / report.hardware_slug("cpu") / f"{name}.json"
    assert f"figures saved to {saved}" in out
    assert report.load_results(name) == {report.hardware_slug("cpu"): figures}


def test_a_quick_parallel_run_is_never_saved(store, monkeypatch, capsys):
    fake_measuring(monkeypatch, "parallel")
    status, out, err = run_main(["bench", "parallel", "--quick", "--ranks", "2"], capsys)
    assert status == 0, err
    assert "the table of bench parallel" in out and "(quick: not saved)" in err
    assert not store.exists() and "saved" not in out


def test_a_benchmark_that_fails_is_one_line_naming_it(store, monkeypatch, capsys):
    import minillm.bench.kv as kv

    def fail(*args, **kwargs):
        raise ValueError("the cache does not fit")

    monkeypatch.setattr(kv, "bench_kv", fail)
    status, out, err = run_main(["bench", "kv", "--device", "cpu"], capsys)
    heading, error = err.strip().splitlines()  # what it measures, then why it stopped
    assert status == 2 and heading.startswith("KV-cache techniques") and "Traceback" not in err
    assert error == "minillm bench: error: bench kv: the cache does not fit"
    assert "saved" not in out and not store.exists()


def test_report_figures_prints_writes_and_saves_once(store, tmp_path, capsys):
    """The end of every benchmark: the text printed, --json written, the store written unless
    --no-save or a run that is not a result (``save=False``: bench parallel --quick); the hardware
    folder from ``device`` when the figures do not name it; a store it cannot write is a CliError
    (one line, status 2), not a traceback."""
    args = argparse.Namespace(json=tmp_path / "out.json", no_save=False, result_name="bench_x")
    figures = {"rows": [1, 2]}
    assert report_figures(args, figures, "the table", save=False) == 0
    out = capsys.readouterr().out
    assert out.startswith("the table\n") and "figures written to" in out and not store.exists()
    assert json.loads(args.json.read_text()) == figures
    args.json = None
    report_figures(args, figures, "the table", device="cpu")
    assert report.load_results("bench_x") == {report.hardware_slug("cpu"): figures}
    args.no_save, args.result_name = True, "bench_y"
    report_figures(args, figures, "the table")
    assert report.load_results("bench_y") == {}
    args.no_save = False
    shutil.rmtree(store)
    store.write_text("a file where the store's folder should be")
    with pytest.raises(CliError, match="figures not written"):
        report_figures(args, figures, "the table")


def test_transformers_is_not_imported_by_the_package():
    code = "import sys, minillm, minillm.bench.generation, minillm.cli.main; print('transformers' in sys.modules)"
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_generate_streams_text_then_timings(checkpoint, capsys):
    argv = [
        "generate",
        "--model",
        str(checkpoint),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
    ]
    status, out, err = run_main(argv, capsys)
    assert status == 0, err
    text, timing = out.rstrip("\n").rsplit("\n", 1)
    assert text.startswith("def add(a, b):") and len(text) > len("def add(a, b):")
    for figure in ("TTFT", "TPOT", "tokens/s", "8 new tokens"):
        assert figure in timing


@pytest.mark.slow
def test_generate_compiled_prints_the_eager_text_and_its_compile_time(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint), "--prompt", "def add(a, b):", "--max-new-tokens", "12"]
    argv += ["--device", "cpu"]
    status, eager, err = run_main(argv, capsys)
    assert status == 0, err
    status, compiled, err = run_main([*argv, "--compile"], capsys)
    assert status == 0, err
    assert compiled.rsplit("\n", 2)[0] == eager.rsplit("\n", 2)[0]  # the same text
    assert "compiled)" in compiled.rstrip().rsplit("\n", 1)[1]
    assert "compile time:" in err and "not counted in the timings" in err
    status, _, err = run_main([*argv, "--compile", "--tensor-parallel", "2"], capsys)
    assert status == 2 and "tensor parallelism with compile is not supported" in err


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_generate_quantized_and_compiled_prints_the_quantized_text(checkpoint, scheme, capsys):
    """The runtime composes quantization and compiled decoding: the same text as the eager
    quantized run (both compute in bf16 on a CPU)."""
    argv = ["generate", "--model", str(checkpoint), "--prompt", "def add(a, b):", "--max-new-tokens", "12"]
    argv += ["--device", "cpu", "--quantize", scheme, "--temperature", "0"]
    status, eager, err = run_main(argv, capsys)
    assert status == 0, err
    status, compiled, err = run_main([*argv, "--compile"], capsys)
    assert status == 0, err
    assert compiled.rsplit("\n", 2)[0] == eager.rsplit("\n", 2)[0]
    assert f"quantized to {scheme}" in err and "compile time:" in err


def test_generate_with_sampling_options(checkpoint, capsys):
    argv = [
        "generate",
        "--model",
        str(checkpoint),
        "--prompt",
        "The quick",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--dtype",
        "bfloat16",
    ]
    first = run_main(argv, capsys)
    second = run_main(argv, capsys)
    assert first[0] == 0, first[2]
    assert "bfloat16" in first[1]
    assert first[1].splitlines()[0] == second[1].splitlines()[0], "a seed should reproduce the text"


def test_generate_quantized_then_from_a_saved_quantized_checkpoint(checkpoint, tmp_path, capsys):
    argv = ["generate", "--model", str(checkpoint), "--prompt", "def add(a, b):", "--max-new-tokens", "6"]
    status, out, err = run_main([*argv, "--device", "cpu", "--quantize", "int4", "--group-size", "16"], capsys)
    assert status == 0, err
    assert "quantized to int4" in err and "MB" in err
    assert "bfloat16" in out.splitlines()[-1]  # a CPU computes a quantized model in bf16 by default
    model, tokenizer = minillm.load(checkpoint, device="cpu", dtype=torch.bfloat16)
    save_quantized(quantize(model, "int8"), tmp_path / "q", tokenizer)
    status, out, err = run_main(
        ["generate", "--model", str(tmp_path / "q"), "--prompt", "def", "--device", "cpu"], capsys
    )
    assert status == 0, err
    assert out.startswith("def") and "new tokens" in out
    status, _, err = run_main(
        ["generate", "--model", str(tmp_path / "q"), "--prompt", "a", "--quantize", "int4"], capsys
    )
    assert_one_line_error(status, err, "already quantized")
    status, _, err = run_main([*argv, "--quantize", "int8", "--group-size", "16"], capsys)
    assert_one_line_error(status, err, "(--group-size) applies to int4 quantization only")
    status, _, err = run_main([*argv, "--quantize", "int4", "--group-size", "15"], capsys)
    assert_one_line_error(status, err, "group_size must be a positive even integer")


def assert_one_line_error(status: int, err: str, *words: str) -> None:
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def test_generate_rejects_negative_temperature(checkpoint, capsys):
    status, out, err = run_main(
        ["generate", "--model", str(checkpoint), "--prompt", "hi", "--temperature", "-1"], capsys
    )
    assert_one_line_error(status, err, "temperature")
    assert out == "", "nothing should be printed before the input is checked"


def test_generate_rejects_unknown_model(capsys):
    status, _, err = run_main(["generate", "--model", "no-such-model", "--prompt", "hi"], capsys)
    assert_one_line_error(status, err, "no-such-model", "bundled model")


def test_generate_rejects_a_prompt_past_the_context(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-new-tokens", "1000"]
    status, out, err = run_main(argv, capsys)
    assert_one_line_error(status, err, "max_seq_len")
    assert out == ""


@pytest.mark.parametrize(
    "breakage, words",
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5]), ["truncated"]),
        (lambda d: (d / "config.json").write_text("{not json"), ["not valid JSON", "line 1"]),
        (lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}'), ["lacks required"]),
    ],
    ids=["truncated-weights", "config-not-json", "config-missing-fields"],
)
def test_a_broken_checkpoint_is_one_line_not_a_traceback(checkpoint, tmp_path, capsys, breakage, words):
    broken = Path(shutil.copytree(checkpoint, tmp_path / "broken"))
    breakage(broken)
    status, out, err = run_main(["generate", "--model", str(broken), "--prompt", "hi"], capsys)
    assert_one_line_error(status, err, str(broken), *words)
    assert "Traceback" not in err and out == ""


def test_usage_errors_are_one_line_with_status_2(capsys):
    status, _, err = run_main(["generate", "--prompt", "hi", "--temperature", "abc"], capsys)
    assert_one_line_error(status, err, "--temperature")


def test_models_lists_presets_with_sizes(capsys):
    status, out, _ = run_main(["models"], capsys)
    assert status == 0
    assert "Llama-3-8B" in out and "8.03B" in out
    assert "SmolLM2-135M" in out and "134.5M" in out


# ---------------------------------------------------------------------------------------------
# The benchmarks


def test_bench_vs_transformers_on_a_tiny_model(checkpoint):
    pytest.importorskip("transformers")
    result = bench.bench_vs_transformers(str(checkpoint), prompt_len=12, new_tokens=6, repeats=2)
    for key in ("hardware", "dtype", "model", "batch_size", "repeats", "speedup", "decode_speedup"):
        assert key in result
    assert (result["model"], result["dtype"], result["batch_size"], result["repeats"]) == ("tiny-cli", "float32", 1, 2)
    for side in ("minillm", "transformers"):
        assert result[side]["tokens_per_s"] > 0 and result[side]["decode_tokens_per_s"] > 0
    assert result["same_greedy_tokens"] is True, f"first mismatch at {result['first_mismatch']}"
    assert result["prompt_source"].startswith("corpus text")
    assert "minillm" in bench.format_vs_transformers(result)


def test_bench_cache_vs_recompute_on_a_tiny_model(checkpoint):
    result = bench.bench_cache_vs_recompute(str(checkpoint), prompt_lens=(8, 32), new_tokens=6, repeats=2)
    assert {"hardware", "dtype", "model", "batch_size", "repeats"} <= set(result)
    assert [row["prompt_len"] for row in result["rows"]] == [8, 32]
    for row in result["rows"]:
        assert row["cache_tokens_per_s"] > 0 and row["recompute_tokens_per_s"] > 0 and row["speedup"] > 0
        assert row["same_greedy_tokens"] is True
    assert "recompute" in bench.format_cache_vs_recompute(result)


def test_bench_rejects_prompts_past_the_context(checkpoint):
    with pytest.raises(ValueError, match="max_seq_len"):
        bench.bench_cache_vs_recompute(str(checkpoint), prompt_lens=(300,), new_tokens=6, repeats=1)


def test_missing_transformers_gives_the_install_command(checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match="pip install transformers"):
        bench.bench_vs_transformers(str(checkpoint), prompt_len=8, new_tokens=4, repeats=1)


def test_bench_cli_prints_measurements_writes_json_and_saves(checkpoint, store, tmp_path, capsys):
    pytest.importorskip("transformers")
    out_file = tmp_path / "figures" / "generate.json"
    argv = [
        "bench",
        "generate",
        "--model",
        str(checkpoint),
        "--repeats",
        "1",
        "--new-tokens",
        "3",
        "--prompt-len",
        "8",
        "--prompt-lens",
        "8",
        "--device",
        "cpu",
        "--json",
        str(out_file),
        "--threads",
        "1",
    ]
    status, out, err = run_main(argv, capsys)
    assert status == 0, err
    assert "goal" not in out.lower() and "MET" not in out  # measurements, not our internal targets
    assert "speedup" in out and "1 thread" in err  # the header names the thread count
    figures = json.loads(out_file.read_text())
    assert set(figures) == {"vs_transformers", "cache_vs_recompute"}
    assert figures["vs_transformers"]["threads"] == 1
    # the figures name no device at the top: the store's folder is the benchmark's device
    assert report.load_results("bench_generate") == {report.hardware_slug("cpu"): figures}


def only_minillm(monkeypatch) -> None:
    """The peers read as not installed, whether or not they are here: the rows are then minillm's."""
    from minillm.bench import peers

    monkeypatch.setattr(peers, "missing_peer", lambda e: None if e == "minillm" else "not installed: pip install x")


@pytest.mark.slow
def test_bench_generate_puts_the_peers_fp32_rows_beside_its_own(checkpoint, capsys, monkeypatch, tmp_path):
    """``--peers``: bench peers' fp32 rows of the same checkpoint, token count and repeats after
    generate's tables, in the saved figures too; a peer that is not installed says so."""
    only_minillm(monkeypatch)
    out_file = tmp_path / "figures.json"
    argv = ["bench", "generate", "--model", str(checkpoint), "--repeats", "2", "--new-tokens", "4"]
    argv += ["--prompt-len", "8", "--prompt-lens", "8", "--device", "cpu", "--threads", "1", "--peers"]
    status, out, err = run_main([*argv, "--no-save", "--json", str(out_file)], capsys)
    assert status == 0, err
    assert "not installed: pip install x" in out and "beside llama.cpp and torchao (fp32)" in err
    peers = json.loads(out_file.read_text())["peers"]
    rows = {(r["engine"], r["format"]): r for r in peers["rows"]}
    assert set(rows) == {("minillm", "fp32"), ("llama.cpp", "F32")}
    assert rows["minillm", "fp32"]["tokens_per_s"] > 0 and len(rows["minillm", "fp32"]["tokens_per_s_runs"]) == 2
    assert peers["new_tokens"] == 4 and peers["prompt_len"] == 8 and not peers["compile"]


@pytest.mark.slow
def test_bench_compression_puts_the_peers_quantized_rows_beside_its_own(capsys, monkeypatch, tmp_path):
    """``bench compression --peers``: the int8 and int4 rows of bench peers on the same random shape."""
    only_minillm(monkeypatch)
    monkeypatch.setitem(PRESETS, "tiny-peers", tiny_config(vocab_size=4096, name="tiny-peers"))
    out_file = tmp_path / "figures.json"
    argv = ["bench", "compression", "--shape", "tiny-peers", "--no-speed", "--no-quality", "--peers"]
    argv += ["--new-tokens", "4", "--context", "32", "--repeats", "1", "--threads", "1", "--no-save"]
    argv += ["--json", str(out_file)]
    status, out, err = run_main(argv, capsys)
    assert status == 0, err
    peers = json.loads(out_file.read_text())["peers"]
    assert {r["group"] for r in peers["rows"]} == {"int8", "int4"} and peers["compile"] and peers["prompt_len"] == 32
    assert all(r["tokens_per_s"] > 0 for r in peers["rows"] if r["engine"] == "minillm")
    assert "random tiny-peers" in out and "not installed: pip install x" in out


def test_bench_generate_and_compression_refuse_peers_off_the_cpu_before_measuring(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["bench", "generate", "--model", str(checkpoint), "--device", "cuda", "--peers", "--no-save"]
    argv += ["--prompt-lens", "8", "--new-tokens", "4"]
    status, out, err = run_main(argv, capsys)
    assert status != 0 and "--peers measures on the CPU" in err and "pass --device cpu" in err
    argv = ["bench", "compression", "--device", "cuda", "--peers", "--no-save"]
    status, out, err = run_main(argv, capsys)
    assert status != 0 and "--peers measures on the CPU" in err
    argv = ["bench", "compression", "--device", "cpu", "--peers", "--new-tokens", "1", "--no-save"]
    status, out, err = run_main(argv, capsys)
    assert status != 0 and "new_tokens must be at least 2" in err


def test_bench_cli_checks_prompt_lengths_before_measuring(checkpoint, capsys):
    argv = ["bench", "generate", "--model", str(checkpoint), "--prompt-lens", "8", "300", "--new-tokens", "4"]
    status, out, err = run_main(argv, capsys)
    assert_one_line_error(status, err, "300", "context")
    assert out == ""


def test_threads_option_and_environment(checkpoint, capsys, monkeypatch):
    """--threads sets PyTorch's CPU threads and the timing line names them; MINILLM_THREADS is
    the default; a bad count is one line with status 2."""
    before = torch.get_num_threads()
    try:
        argv = ["generate", "--model", str(checkpoint), "--prompt", "hi", "--max-new-tokens", "3", "--threads", "1"]
        status, out, _ = run_main(argv, capsys)
        assert status == 0 and torch.get_num_threads() == 1 and "1 thread)" in out.splitlines()[-1]
        monkeypatch.setenv("MINILLM_THREADS", "2")
        status, out, _ = run_main(argv[:-2], capsys)
        assert status == 0 and torch.get_num_threads() == 2 and "2 threads)" in out.splitlines()[-1]
        status, _, err = run_main([*argv[:-1], "0"], capsys)
        assert_one_line_error(status, err, "threads must be a positive integer")
        for benchmark in ("generate", "kv", "decoding", "batching", "serve"):
            status, out, _ = run_main(["bench", benchmark, "--help"], capsys)
            assert status == 0 and "--threads" in out
    finally:
        torch.set_num_threads(before)


def test_format_table_aligns_columns():
    rows = [{"name": "a", "tokens/s": 12.345}, {"name": "longer", "tokens/s": 1234.5}]
    lines = bench.format_table(rows, title="T").splitlines()
    assert lines[0] == "T"
    assert lines[1].split() == ["name", "tokens/s"]
    assert lines[3] == "a          12.35" and lines[4] == "longer   1,234.5"
    assert len({len(line) for line in lines[1:]}) == 1, "every row should be as wide as the header"
