"""minillm.book.notebook: the notebook context (scale, threads) and the saved results it reads."""

import json

import pytest
import torch

from minillm.book.notebook import saved_results, setup


def test_setup_honours_scale_and_threads_from_the_environment(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("MINILLM_SCALE", "tiny")
        monkeypatch.setenv("MINILLM_THREADS", "1")
        ctx = setup(device="cpu", quiet=True)
        assert ctx.scale == "tiny" and torch.get_num_threads() == 1
        assert ctx.pick(tiny=1, small=2) == 1
        monkeypatch.setenv("MINILLM_THREADS", "zero")
        with pytest.raises(ValueError, match="MINILLM_THREADS"):
            setup(device="cpu", quiet=True)
    finally:
        torch.set_num_threads(before)


def test_saved_results_are_read_by_hardware_folder(tmp_path):
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "bench_kv.json").write_text(json.dumps({"rows": [1]}))
    (tmp_path / "cpu").mkdir()
    assert saved_results("bench_kv", tmp_path) == {"h200": {"rows": [1]}}
    assert saved_results("missing", tmp_path) == {}
