"""The timing harness and the report helpers every benchmark shares."""

import json
import time

import pytest

from minillm.measure import report, timing


def test_interleaved_takes_turns_alternating_the_order_after_the_warmup():
    calls = []
    contenders = {name: (lambda n=name: calls.append(n) or n) for name in ("a", "b", "c")}
    timings = timing.interleaved(contenders, repeats=3, warmup=1)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert all(len(t.seconds) == 3 and t.values == [name] * 3 for name, t in timings.items())


def test_after_runs_outside_the_timed_region():
    def slow_reset(name):
        time.sleep(0.05)

    t = timing.interleaved({"x": lambda: None}, repeats=2, warmup=0, after=slow_reset)["x"]
    assert t.fastest < 0.04 and t.median <= max(t.seconds)


def test_median_and_fastest():
    t = timing.Timing(seconds=[0.3, 0.1, 0.2])
    assert t.median == 0.2 and t.fastest == 0.1 and t.median_ms == pytest.approx(200.0)


def test_repeat_times_what_it_is_given():
    t = timing.repeat(lambda: time.sleep(0.01), repeats=3, warmup=0)
    assert len(t.seconds) == 3 and t.fastest >= 0.009


@pytest.mark.parametrize("repeats, warmup", [(0, 1), (2.0, 1), (True, 1), (3, -1)])
def test_bad_counts_are_named(repeats, warmup):
    with pytest.raises(ValueError, match="repeats|warmup"):
        timing.interleaved({"x": lambda: None}, repeats=repeats, warmup=warmup)


def test_nothing_to_time():
    with pytest.raises(ValueError, match="no contenders"):
        timing.interleaved({}, repeats=1)


def test_provenance_names_the_hardware_threads_load_and_date():
    record = report.finish_provenance(report.provenance("cpu", model="m", dtype="torch.float32", batch=2))
    expected = {"hardware", "device", "threads", "torch", "date", "load_average_before", "load_average_after"}
    assert expected <= set(record)
    assert record["model"] == "m" and record["dtype"] == "float32" and record["batch"] == 2
    assert "m" in report.describe(record) and "float32" in report.describe(record)


def test_results_store_round_trip(tmp_path):
    figures = {"device": "cpu", "value": 1.5}
    path = report.save_result("bench_x", figures, hardware="cpu-test-2core", results_dir=tmp_path)
    assert path == tmp_path / "cpu-test-2core" / "bench_x.json"
    assert json.loads(path.read_text())["value"] == 1.5
    assert report.load_results("bench_x", tmp_path) == {"cpu-test-2core": {"device": "cpu", "value": 1.5}}
    assert report.load_results("nothing", tmp_path) == {}
    with pytest.raises(ValueError, match="plain file stem"):
        report.result_path("../x", "cpu")


def test_slugs():
    assert report.gpu_slug("NVIDIA H200") == "h200" and report.gpu_slug("Tesla T4") == "t4"
    assert report.hardware_slug("cpu").startswith("cpu-") and report.hardware_slug("cpu").endswith("core")


def test_format_table_aligns_numbers_right_and_text_left():
    text = report.format_table([{"name": "a", "x": 1.5}, {"name": "bb", "x": 123.4}], title="T")
    assert text.splitlines() == ["T", "name      x", "----  -----", "a      1.50", "bb    123.4"]
