"""bench generate's options: checked in a second, before minutes of measuring."""

import pytest

from minillm.bench.generation import GenerationBench
from minillm.core.checkpoints import CheckpointError


def test_the_defaults_fit_the_bundled_target():
    options = GenerationBench()
    assert options.prompt_lens == (64, 256, 512) and options.model == "minillm-target"


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"repeats": 0}, "repeats must be a positive integer"),
        ({"new_tokens": 1}, "new_tokens must be an integer >= 2"),
        ({"prompt_lens": (8, 0)}, r"prompt lengths must be positive integers, got \[64, 8, 0\]"),
        ({"prompt_len": 2.5}, "prompt lengths must be positive integers"),
        ({"prompt_lens": (8, 2000)}, r"prompt lengths \[2000\] \+ new_tokens 128 exceed the context length 1024"),
    ],
)
def test_bad_options_are_named(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationBench(**fields)


def test_a_broken_model_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        GenerationBench(model=str(tmp_path))
