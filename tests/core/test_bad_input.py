"""Bad input never escapes as a raw exception from deep inside a dependency: broken checkpoints
become one CheckpointError naming the file and the problem, malformed configs a ValueError naming
the field, and prompts that are not token ids a ValueError saying what was given and expected.
The property tests throw random malformed configs and prompts at them."""

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minillm
from minillm import ModelConfig
from minillm.core.checkpoints import BUNDLED_DIR, CheckpointError
from minillm.core.hf_config import config_from_hf
from minillm.core.prompts import token_rows
from minillm.core.sampling import SamplingParams
from minillm.decoding.lookahead import lookahead_generate
from minillm.decoding.medusa import MedusaHeads, medusa_generate
from minillm.decoding.prompt_lookup import prompt_lookup_generate
from minillm.decoding.speculative import speculative_generate
from tests.conftest import tiny_model

DRAFT = BUNDLED_DIR / "minillm-draft"
VALID_HF = json.loads((DRAFT / "config.json").read_text())


@pytest.fixture
def checkpoint(tmp_path):
    """A copy of the bundled draft model to break."""
    return shutil.copytree(DRAFT, tmp_path / "draft")


def rewrite_config(path, **changes):
    cfg = {**json.loads((path / "config.json").read_text()), **changes}
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not ...}))


# --- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1_000_000, 5])
def test_a_truncated_safetensors_file_is_named(checkpoint, size):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:size])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        minillm.load(checkpoint, device="cpu")


def test_garbage_in_a_safetensors_file_is_named(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64 + b"not tensors" * 100)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        minillm.load(checkpoint, device="cpu")


def test_config_that_is_not_json_names_the_file_line_and_column(checkpoint):
    (checkpoint / "config.json").write_text('{"vocab_size": 4096,\n  "hidden_size": }')
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON: .* line 2, column 18"):
        minillm.load(checkpoint, device="cpu")


def test_config_that_is_a_list_is_refused(checkpoint):
    (checkpoint / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        minillm.load(checkpoint, device="cpu")


def test_generation_config_that_is_not_json_is_named(checkpoint):
    (checkpoint / "generation_config.json").write_text("{eos: 1}")
    with pytest.raises(CheckpointError, match=r"generation_config\.json is not valid JSON"):
        minillm.load(checkpoint, device="cpu")


def test_a_corrupt_tokenizer_is_named(checkpoint):
    (checkpoint / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json cannot be read as a tokenizer"):
        minillm.load(checkpoint, device="cpu")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_size": ...}, "lacks required field hidden_size"),
        ({"num_attention_heads": ..., "vocab_size": ...}, "lacks required fields vocab_size, num_attention_heads"),
        ({"num_attention_heads": 0}, r"num_attention_heads \(ModelConfig.n_heads\) must be a positive integer, got 0"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads \(ModelConfig.n_kv_heads\) must be a positive integer"),
        ({"vocab_size": "4096"}, r"vocab_size must be a positive integer, got '4096' \(str\)"),
        (
            {"num_hidden_layers": 2.5},
            r"num_hidden_layers \(ModelConfig.n_layers\) must be a positive integer, got 2.5",
        ),
        ({"rms_norm_eps": -1}, r"rms_norm_eps \(ModelConfig.norm_eps\) must be a positive number"),
        ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be bool, got 'yes'"),
        ({"architectures": "LlamaForCausalLM"}, "architectures must be list"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, "rope_theta must be a positive number"),
        ({"hidden_size": 100, "num_attention_heads": 3, "head_dim": None}, r"dim \(100\) is not divisible by n_heads"),
        ({"bos_token_id": -1}, r"bos_token_id must be None or a non-negative id"),
        ({"eos_token_id": [0, 99999]}, None),  # generation_config.json's eos wins: checked below
        ({"max_position_embeddings": 0}, r"max_position_embeddings \(ModelConfig.max_seq_len\) must be a positive"),
    ],
)
def test_config_fields_are_checked_and_named(checkpoint, changes, match):
    rewrite_config(checkpoint, **changes)
    if match is None:
        (checkpoint / "generation_config.json").write_text('{"eos_token_id": [0, 99999]}')
        match = r"eos_token_id\[1\] must be None or an id in \[0, 4096\)"
    with pytest.raises(CheckpointError, match=match) as info:
        minillm.load(checkpoint, device="cpu")
    assert str(checkpoint) in str(info.value)


def test_model_config_validates_types_before_arithmetic():
    with pytest.raises(ValueError, match=r"ModelConfig.n_heads must be a positive integer, got 0"):
        ModelConfig(n_heads=0)
    with pytest.raises(ValueError, match=r"ModelConfig.dim must be a positive integer, got '256' \(str\)"):
        ModelConfig(dim="256")
    with pytest.raises(ValueError, match="ModelConfig.qkv_bias must be true or false"):
        ModelConfig(qkv_bias=1)
    with pytest.raises(ValueError, match="RopeScaling.factor must be a positive number"):
        ModelConfig(rope_scaling={"rope_type": "linear", "factor": "2"})
    with pytest.raises(ValueError, match="rope_scaling: .*unexpected keyword"):
        ModelConfig(rope_scaling={"rope_type": "linear", "stretch": 2.0})


FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drop=st.sets(st.sampled_from(sorted(VALID_HF)), max_size=3),
    changes=st.dictionaries(st.sampled_from(sorted(VALID_HF) + ["rope_scaling", "head_dim"]), FIELD_VALUES, max_size=4),
)
def test_random_malformed_configs_give_only_checkpoint_errors(drop, changes):
    """Random fields missing, mistyped or out of range: either a valid config, or CheckpointError."""
    cfg = {k: v for k, v in VALID_HF.items() if k not in drop} | changes
    try:
        config = config_from_hf(cfg)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(config, ModelConfig) and config.n_heads % config.n_kv_heads == 0


# --- prompts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "input_ids, match",
    [
        ([1.5, 2.7], r"holds float 1\.5, not an int"),
        ("Rain fell", r"text .*encode it with the tokenizer first"),
        (["Rain", "fell"], r"holds str 'Rain', not an int"),
        ([["Rain"], [1]], r"holds str 'Rain'"),
        (torch.tensor([1.0, 2.0]), r"integer tensor, got dtype torch\.float32"),
        (np.array([1.0, 2.0]), r"integer array, got dtype float64"),
        (torch.tensor([True, False]), r"integer tensor, got dtype torch\.bool"),
        ([True, False], r"holds bool True, not an int"),
        ([[1, 2], [3.0]], r"prompt 1 holds float 3\.0"),
        ([1, [2, 3]], "mixes ids and rows"),
        ([[None]], "prompt 0 holds NoneType None"),
        ([[]], "at least one token"),
        (torch.zeros(0, dtype=torch.long), "at least one token"),
        (None, "expected token ids|must be token ids"),
        (42, "must be token ids"),
        ([1, 10_000], r"token ids must be in the vocabulary \[0, 97\): prompt 0 holds id 10000"),
        ([[-1, 3]], r"prompt 0 holds id -1"),
    ],
)
def test_generate_names_what_was_given_and_what_is_expected(input_ids, match):
    with pytest.raises(ValueError, match=match):
        minillm.generate(tiny_model(), input_ids, 3)


@pytest.mark.parametrize(
    "input_ids, rows",
    [
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ((4, 5), [[4, 5]]),
        (torch.tensor([1, 2]), [[1, 2]]),
        (torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), [[1, 2], [3, 4]]),
        (np.array([[7, 8]]), [[7, 8]]),
        ([np.int64(3), np.int32(4)], [[3, 4]]),
    ],
)
def test_every_accepted_form_gives_the_same_rows(input_ids, rows):
    assert token_rows(input_ids) == rows


PROMPTS = st.recursive(
    st.one_of(st.integers(-3, 200), st.floats(), st.text(max_size=4), st.booleans(), st.none()),
    lambda children: st.lists(children, max_size=4),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(prompt=PROMPTS)
def test_random_malformed_prompts_give_only_value_errors(prompt):
    model = tiny_model()
    try:
        result = minillm.generate(model, prompt, 2)
    except ValueError as e:
        assert str(e)
        return
    rows = token_rows(prompt)  # it was valid: every row is ints within the vocabulary
    assert all(0 <= t < model.config.vocab_size for row in rows for t in row)
    assert result.tokens.shape[0] == len(rows)


@pytest.mark.parametrize("input_ids", [[1.5, 2.7], "Rain fell", torch.tensor([1.0, 2.0]), [[]]])
def test_every_decoder_checks_its_prompt_as_generate_does(input_ids):
    model = tiny_model()
    decoders = [
        lambda: speculative_generate(model, tiny_model(seed=1), input_ids, 3, 2, SamplingParams()),
        lambda: prompt_lookup_generate(model, input_ids, 3),
        lambda: lookahead_generate(model, input_ids, 3),
    ]
    for decode in decoders:
        with pytest.raises(ValueError, match="not an int|text|integer tensor|at least one token"):
            decode()


@pytest.mark.parametrize(
    "input_ids, rows",
    [
        ([torch.tensor(1), torch.tensor(2)], [[1, 2]]),
        ([np.array(3), np.int64(4)], [[3, 4]]),
        ([torch.tensor([1, 2]), torch.tensor([3])], [[1, 2], [3]]),
    ],
)
def test_zero_dim_tensors_and_arrays_count_as_ids(input_ids, rows):
    assert token_rows(input_ids) == rows


@pytest.mark.parametrize(
    "input_ids, match",
    [
        (np.array(["a", "b"]), "integer array, got text"),
        ([torch.tensor(1.5)], "holds Tensor"),
        ([torch.ones(2, 2, dtype=torch.long)], r"one row of ids, got shape \(2, 2\)"),
    ],
)
def test_arrays_of_the_wrong_kind_are_named(input_ids, match):
    with pytest.raises(ValueError, match=match):
        token_rows(input_ids)


@pytest.mark.parametrize(
    "eos, match", [(2.5, "non-negative token ids, got 2.5"), ([1.5], "got 1.5"), (True, "got True")]
)
def test_eos_token_ids_are_checked(eos, match):
    with pytest.raises(ValueError, match=match):
        minillm.generate(tiny_model(), [1, 2], 3, eos_token_id=eos)


def test_medusa_checks_its_prompt_too():
    model = tiny_model()
    heads = MedusaHeads(model.config.dim, 2)
    with pytest.raises(ValueError, match="encode it with the tokenizer"):
        medusa_generate(model, heads, "Rain fell", 3)
