"""bench serve: the server measured from a client over HTTP, beside the engine's own clock for the
same requests. Every request's client-side TTFT includes the engine's (the client sends first and
hears last); the figures carry where they were measured; the printed table fits 88 columns; the
command starts and stops its own server."""

import asyncio
import json

import pytest
from tqdm.auto import tqdm

import minillm
from minillm.bench.serve import (
    ServeBench,
    bench_serve,
    curve_rows,
    format_serve,
    rate_figures,
    workload,
)
from minillm.measure.metrics import SLO, span
from minillm.serving.client import run_coroutine, run_workload
from minillm.serving.http import create_app
from tests.serving.conftest import LiveServer, make_engine, save_tiny_checkpoint
from tests.test_cli import assert_one_line_error, run_main

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

pytest.importorskip("httpx")
SMALL = dict(n_requests=6, prompt_median=8, output_median=6, max_len=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("bench-serve"))


@pytest.fixture(scope="module")
def url(checkpoint):
    model, tokenizer = minillm.load(checkpoint)
    engine = make_engine(model)
    with LiveServer(create_app(engine, "tiny-serve", tokenizer), engine) as url:
        yield url


def test_each_request_is_measured_at_the_client_and_by_the_engine(url):
    options = ServeBench(url=url, rates=(100.0,), **SMALL)
    requests = workload(options, 300, 0, 100.0)
    measured = run_workload(url, "tiny-serve", requests, tqdm(disable=True))
    assert len(measured) == 6
    for m, r in zip(measured, requests):
        assert m.client.output_tokens == m.engine.output_tokens == r.max_tokens  # ignore_eos: the exact length
        assert m.client.ttft >= m.engine.ttft > 0  # the client sends first and hears last
        assert m.client.e2e >= m.engine.e2e
        assert m.send_delay >= 0  # never before its scheduled arrival
    slo = SLO(ttft=sorted(m.client.ttft for m in measured)[3], tpot=1.0)  # some requests within it, some not
    run = rate_figures(100.0, measured, slo)
    client = [m.client for m in measured]
    assert run["seconds"] == span(client) and run["requests_per_s"] == 6 / run["seconds"]
    for side in ("client", "engine"):
        met = sum(slo.met_by(getattr(m, side)) for m in measured)
        assert run[side]["slo_met_pct"] == 100 * met / 6 and run[side]["goodput_rps"] == met / run["seconds"]
    assert 0 < run["client"]["slo_met_pct"] < 100
    late = sorted(1e3 * m.send_delay for m in measured)
    assert run["send_delay_ms"]["p50"] == pytest.approx((late[2] + late[3]) / 2)


def test_bench_serve_figures_at_two_rates(url):
    figures = bench_serve(ServeBench(url=url, rates=(50.0, 200.0), **SMALL))
    assert {"hardware", "threads", "dtype", "model", "date", "load_average_after"} <= set(figures)
    assert figures["model"] == "tiny-serve" and figures["dtype"] == "float32" and figures["threads"] >= 1
    assert [run["rate"] for run in figures["runs"]] == [50.0, 200.0]
    for run in figures["runs"]:
        assert run["requests"] == 6 and run["output_tokens_per_s"] > 0 and run["input_tokens_per_s"] > 0
        for side in ("client", "engine"):
            f = run[side]
            for measure in ("ttft_ms", "tpot_ms", "e2e_ms"):
                assert f[measure]["p50"] <= f[measure]["p90"] <= f[measure]["p99"]
            assert f["goodput_rps"] == pytest.approx(f["slo_met_pct"] / 100 * run["requests"] / run["seconds"])
        assert run["send_delay_ms"]["p99"] >= 0
        assert run["client"]["ttft_ms"]["p50"] >= run["engine"]["ttft_ms"]["p50"] and run["http_ttft_ms_p50"] > 0
    text = format_serve(figures)
    assert max(len(line) for line in text.splitlines()) <= 88, text
    assert "client" in text and "engine" in text and "HTTP adds" in text and "end-to-end" in text
    assert "after schedule" in text  # the client's own lateness
    rows = curve_rows(figures)
    assert {r["policy"] for r in rows} == {"client (HTTP)", "engine"} and len(rows) == 4
    json.dumps(figures)  # saved as JSON


def test_the_command_starts_its_own_server_and_writes_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(checkpoint), "--requests", "4", "--rate", "100", "--prompt-median"]
    argv += ["8", "--output-median", "4", "--no-progress", "--no-save", "--json", str(out), "--threads", "1"]
    status, stdout, err = run_main(argv, capsys)
    assert status == 0, err
    table = stdout.split("figures written to")[0]
    assert "TTFT" in table and "p90" in table and max(len(line) for line in table.splitlines()) <= 88
    figures = json.loads(out.read_text())
    assert figures["threads"] == 1 and figures["runs"][0]["requests"] == 4 and figures["url"] is None


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"rates": ()}, "rates must be positive"),
        ({"rates": (0.0,)}, "rates must be positive"),
        ({"n_requests": 0}, "n_requests must be a positive integer"),
        ({"url": "localhost:8000"}, "url must start with http://"),
        ({"threads": 0}, "threads must be a positive integer"),
    ],
)
def test_options_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        ServeBench(**fields)


def test_a_bad_rate_on_the_command_line_is_one_line(capsys):
    status, out, err = run_main(["bench", "serve", "--rate", "-1", "--no-save"], capsys)
    assert_one_line_error(status, err, "rates must be positive")
    assert out == ""


def test_run_coroutine_works_inside_a_running_event_loop():
    """A notebook's cell runs inside an event loop, where asyncio.run refuses to start."""

    async def answer():
        return 42

    async def cell():
        return run_coroutine(answer())

    assert run_coroutine(answer()) == 42
    assert asyncio.run(cell()) == 42


def test_what_http_adds_is_never_printed_as_a_signed_zero():
    from minillm.bench.serve import _added

    assert _added(0.004, "TPOT") == _added(-0.004, "TPOT") == "under 0.01 ms TPOT"
    assert _added(0.02, "TPOT") == "+0.02 ms TPOT" and _added(-0.25, "TPOT") == "-0.25 ms TPOT"


# --- bench serve-stack: each technique's server, then all, swept -------------------------------


def test_edit_prompts_follow_a_random_token_of_their_own():
    from minillm.bench.serve import edit_prompts

    edits = edit_prompts("minillm-draft")
    options = ServeBench(model="minillm-draft", n_requests=8, prompts="edits", max_len=96)
    requests = workload(options, 4096, run=1, rate=4.0, edits=edits)
    for i, r in enumerate(requests):
        body = edits[(8 + i) % len(edits)]
        assert r.prompt[1:] == body[-(96 - r.max_tokens - 1) :] and len(r.prompt) + r.max_tokens <= 96
    assert len({r.prompt[0] for r in requests}) > 1  # their own first token: no shared prefix


def test_serve_stack_rows_against_the_baseline(capsys, tmp_path):
    from minillm.bench.serve_stack import STACK, ServeStackBench, bench_serve_stack, format_serve_stack

    stack = (STACK[0], ("prompt lookup K=2", ("--prompt-lookup", "2")))
    options = ServeStackBench(
        model="minillm-draft", stack=stack, rates=(4.0, 50.0), n_requests=4, output_median=8, max_len=128
    )
    figures = bench_serve_stack(options)
    rows = figures["rows"]
    assert [r["config"] for r in rows] == ["eager fp32", "prompt lookup K=2"] and rows[0]["vs_eager"] == 1.0
    for r, c in zip(rows, figures["configs"]):
        runs = c["figures"]["runs"]
        assert r["best_goodput_rps"] == max(run["client"]["goodput_rps"] for run in runs)
        assert c["figures"]["workload"]["server_flags"] == [*c["flags"], "--max-model-len", "128"]
    table = format_serve_stack(figures)
    assert "prompt lookup K=2" in table and max(len(line) for line in table.splitlines()) <= 88
    json.dumps(figures)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--only", "no such thing"], ["--only names no configuration"]),
        (["--prompts", "edits", "--rate", "0"], ["rates must be positive"]),
    ],
)
def test_serve_stack_refuses_bad_options_in_one_line(argv, words, capsys):
    status, _, err = run_main(["bench", "serve-stack", *argv, "--no-save"], capsys)
    assert_one_line_error(status, err, *words)
