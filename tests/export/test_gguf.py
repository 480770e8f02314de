"""GGUF export (minillm.export.gguf): written, read back with gguf's own reader, every tensor,
the metadata and the tokenizer compared; the Q/K permutation against minillm's rotary; the
command's errors; and, where llama_cpp is importable, llama.cpp's greedy tokens against ours."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from minillm.cli.main import main
from minillm.core.checkpoints import BUNDLED_DIR, to_hf_state_dict
from minillm.core.model import apply_rope, rope_cos_sin, rope_inv_freq
from minillm.core.tokenizer import Tokenizer
from minillm.export.gguf import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    ExportError,
    apply_rope_interleaved,
    dequantize_q4_0,
    dequantize_q8_0,
    export_gguf,
    permute_for_interleaved_rope,
    quantize_q4_0,
    quantize_q8_0,
    unpermute_from_interleaved_rope,
)
from tests.conftest import tiny_model

gguf = pytest.importorskip("gguf")

TARGET = BUNDLED_DIR / "minillm-target"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TARGET)  # byte-level BPE, 4096 tokens, <|endoftext|> = 0


def small_model(**overrides):
    """Tiny and random, with the bundled tokenizer's vocabulary and GQA (4 query heads, 2 kv heads)."""
    return tiny_model(**{"vocab_size": 4096, "bos_token_id": 0, "eos_token_id": 0, **overrides})


def read(path):
    reader = gguf.GGUFReader(str(path))
    return {t.name: t for t in reader.tensors}, reader.fields


def field(fields, key):
    return fields[key].contents()


def expected_tensors(model) -> dict[str, np.ndarray]:
    """The HF-layout weights under llama.cpp's names, un-permuted (what the file must hold)."""
    hf = {k: v.detach().float().numpy() for k, v in to_hf_state_dict(model.state_dict(), model.config).items()}
    out = {"token_embd.weight": hf["embed_tokens.weight"], "output_norm.weight": hf["norm.weight"]}
    if not model.config.tie_embeddings:
        out["output.weight"] = hf["lm_head.weight"]
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(model.config.n_layers):
        for hf_name, name in names.items():
            out[f"blk.{i}.{name}.weight"] = hf[f"layers.{i}.{hf_name}.weight"]
    return out


def unpermuted(name: str, array: np.ndarray, config) -> np.ndarray:
    heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}.get(name.split(".")[-2])
    if heads is None:
        return array
    return unpermute_from_interleaved_rope(torch.from_numpy(np.array(array)), heads).numpy()


# ---------------------------------------------------------------------------------------------
# The rope permutation


def test_permuted_weights_under_the_interleaved_rope_equal_rotate_half_on_hf_weights():
    """llama.cpp rotates adjacent pairs (2i, 2i+1); HF's Llama rotates (i, i + hd/2). Rotating
    the permuted projections the adjacent way gives the HF rotation with the head dimensions
    reordered the same way, so q . k (the attention score) is unchanged."""
    torch.manual_seed(0)
    config = small_model().config
    H, Hkv, hd, D, T = config.n_heads, config.n_kv_heads, config.head_dim, config.dim, 7
    x = torch.randn(1, T, D)
    wq, wk = torch.randn(H * hd, D), torch.randn(Hkv * hd, D)
    positions = torch.arange(T)
    inv_freq = rope_inv_freq(config)
    cos, sin = rope_cos_sin(positions[None], inv_freq, torch.float32)

    def heads(w, n):  # (1, T, D) @ (n*hd, D)^T -> (1, n, T, hd)
        return (x @ w.T).view(1, T, n, hd).transpose(1, 2)

    q_hf, k_hf = apply_rope(heads(wq, H), cos, sin), apply_rope(heads(wk, Hkv), cos, sin)
    q_gg = apply_rope_interleaved(heads(permute_for_interleaved_rope(wq, H), H), positions, inv_freq)
    k_gg = apply_rope_interleaved(heads(permute_for_interleaved_rope(wk, Hkv), Hkv), positions, inv_freq)
    order = permute_for_interleaved_rope(torch.arange(hd)[:, None].float(), 1).long().flatten()
    assert order.tolist()[:4] == [0, hd // 2, 1, hd // 2 + 1]
    torch.testing.assert_close(q_gg, q_hf[..., order], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_gg, k_hf[..., order], rtol=1e-5, atol=1e-5)
    scores_hf = q_hf @ k_hf.repeat_interleave(H // Hkv, 1).transpose(-1, -2)
    scores_gg = q_gg @ k_gg.repeat_interleave(H // Hkv, 1).transpose(-1, -2)
    torch.testing.assert_close(scores_gg, scores_hf, rtol=1e-4, atol=1e-4)
    w = torch.randn(H * hd, D)
    assert torch.equal(unpermute_from_interleaved_rope(permute_for_interleaved_rope(w, H), H), w)


# ---------------------------------------------------------------------------------------------
# Q8_0


def test_q8_0_matches_ggml_reference_and_rounds_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[1, :32] = 0  # an all-zero block: scale 0, codes 0
    raw = quantize_q8_0(w)
    assert raw.shape == (6, 3 * 34) and raw.dtype == np.uint8
    np.testing.assert_array_equal(raw, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
    back = dequantize_q8_0(raw)
    np.testing.assert_array_equal(back, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    assert np.all(back[1, :32] == 0)
    within_half_a_step(w, back)


def test_q4_0_matches_ggml_reference_and_keeps_each_blocks_peak():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 128)).astype(np.float32)
    w[2, 32:64] = 0  # an all-zero block
    w[3, :32] = np.abs(w[3, :32])  # a block of one sign: its peak is positive, d negative
    raw = quantize_q4_0(w)
    assert raw.shape == (5, 4 * 18) and raw.dtype == np.uint8
    np.testing.assert_array_equal(raw, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))
    back = dequantize_q4_0(raw)
    np.testing.assert_array_equal(back, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0))
    within_q4_0_steps(w, back)
    blocks, got = w.reshape(5, -1, 32), back.reshape(5, -1, 32)
    peak = np.abs(blocks).max(-1, keepdims=True)
    np.testing.assert_allclose(np.abs(got).max(-1, keepdims=True), peak, rtol=2**-10)  # the peak: exact (fp16)
    assert np.all(back[2, 32:64] == 0)


def within_q4_0_steps(w: np.ndarray, back: np.ndarray) -> None:
    """Q4_0's codes span [-8 d, 7 d] from the peak's side (d = |peak| / 8): a weight inside is
    within half a step, one beyond 7 d (the other side's largest) within one step."""
    blocks, got = w.reshape(w.shape[0], -1, 32), back.reshape(w.shape[0], -1, 32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], axis=-1)
    d = np.abs(peak) / 8
    error = np.abs(got - blocks)
    inside = blocks * np.sign(peak) >= -7 * d  # on the peak's side, or within 7 d on the other
    slack = d * 8 * 2**-11 + 1e-6  # the step stored as fp16
    assert np.all(error[inside] <= (0.5 * d + slack).repeat(32, -1)[inside])
    assert np.all(error <= d + slack)


def within_half_a_step(w: np.ndarray, back: np.ndarray) -> None:
    """Each weight within half of its block's step d = max|w| / 127 (the step stored as fp16: its
    rounding, relative 2^-11, moves a code of at most 127 by 127 * 2^-11 steps more)."""
    blocks = w.reshape(w.shape[0], -1, 32)
    step = np.abs(blocks).max(-1, keepdims=True) / 127
    error = np.abs(back.reshape(blocks.shape) - blocks)
    assert np.all(error <= step * (0.5 + 127 * 2**-11) + 1e-12)


# ---------------------------------------------------------------------------------------------
# Writing and reading back


@pytest.mark.parametrize("tied", [False, True])
def test_f32_holds_every_tensor_exactly_after_unpermuting(tmp_path, tokenizer, tied):
    model = small_model(tie_embeddings=tied)
    result = export_gguf(model, tokenizer, tmp_path / "m.gguf", "f32")
    tensors, fields = read(result.path)
    expected = expected_tensors(model)
    assert set(tensors) == set(expected)
    assert ("output.weight" in tensors) == (not tied)
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert list(t.shape) == list(reversed(want.shape)), name  # ggml lists the innermost dimension first
        np.testing.assert_array_equal(unpermuted(name, t.data.reshape(want.shape), model.config), want, err_msg=name)
    assert not result.requantized and result.tensors == len(expected)
    assert field(fields, "general.file_type") == 0


def test_f16_is_within_fp16_rounding_and_keeps_norms_f32(tmp_path, tokenizer):
    model = small_model()
    tensors, fields = read(export_gguf(model, tokenizer, tmp_path / "m.gguf", "f16").path)
    for name, want in expected_tensors(model).items():
        t = tensors[name]
        got = unpermuted(name, t.data.reshape(want.shape), model.config)
        if want.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(got, want)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            np.testing.assert_array_equal(got, want.astype(np.float16))
    assert field(fields, "general.file_type") == 1


def test_q8_0_dequantizes_within_half_a_step_of_each_block(tmp_path, tokenizer):
    model = small_model()
    tensors, fields = read(export_gguf(model, tokenizer, tmp_path / "m.gguf", "q8_0").path)
    for name, want in expected_tensors(model).items():
        t = tensors[name]
        if want.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
        back = unpermuted(name, dequantize_q8_0(np.array(t.data)), model.config)
        within_half_a_step(want, back)
    assert field(fields, "general.file_type") == 7


def test_q4_0_files_hold_q4_0_blocks_and_a_q8_0_output(tmp_path, tokenizer):
    model = small_model()
    tensors, fields = read(export_gguf(model, tokenizer, tmp_path / "m.gguf", "q4_0").path)
    T = gguf.GGMLQuantizationType
    for name, want in expected_tensors(model).items():
        t = tensors[name]
        if want.ndim == 1:
            assert t.tensor_type == T.F32
            continue
        assert t.tensor_type == (T.Q8_0 if name == "output.weight" else T.Q4_0), name
        decode = dequantize_q8_0 if name == "output.weight" else dequantize_q4_0
        back = unpermuted(name, decode(np.array(t.data)), model.config)
        (within_half_a_step if name == "output.weight" else within_q4_0_steps)(want, back)
    assert field(fields, "general.file_type") == 2


def test_rows_that_are_not_whole_q8_0_blocks_fall_back_to_f16(tmp_path, tokenizer):
    model = small_model(ffn_dim=48)  # ffn_down's rows are 48 long: not a multiple of 32
    tensors, _ = read(export_gguf(model, tokenizer, tmp_path / "m.gguf", "q8_0").path)
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_metadata_and_tokenizer(tmp_path, tokenizer):
    model = small_model(vocab_size=4100, max_seq_len=96)  # 4 embedding rows beyond the tokenizer
    c = model.config
    _, fields = read(export_gguf(model, tokenizer, tmp_path / "m.gguf", "f32").path)
    assert field(fields, "general.architecture") == "llama"
    expected = {
        "llama.context_length": 96,
        "llama.embedding_length": c.dim,
        "llama.block_count": c.n_layers,
        "llama.feed_forward_length": c.ffn_dim,
        "llama.attention.head_count": c.n_heads,
        "llama.attention.head_count_kv": c.n_kv_heads,
        "llama.rope.dimension_count": c.head_dim,
        "llama.rope.freq_base": c.rope_theta,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",  # llama.cpp refuses "gpt2" here: unknown pre-tokenizer type
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": tokenizer.chat_template,
    }
    assert {k: field(fields, k) for k in expected} == expected
    assert field(fields, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(c.norm_eps)
    tokens, types = field(fields, "tokenizer.ggml.tokens"), field(fields, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 4100
    vocab = {i: t for t, i in json.loads((TARGET / "tokenizer.json").read_text())["model"]["vocab"].items()}
    assert tokens[:4096] == [vocab[i] for i in range(4096)]
    assert types[0] == TOKEN_CONTROL and set(types[1:4096]) == {TOKEN_NORMAL} and set(types[4096:]) == {TOKEN_UNUSED}
    merges = field(fields, "tokenizer.ggml.merges")
    assert len(merges) == 3839 and merges[0] == "Ġ Ġ"


def test_a_quantized_model_is_written_from_its_dequantized_weights(tmp_path, tokenizer):
    from minillm.compression import quantize

    model = quantize(small_model(), "int8")
    qkv = model.layers[0].self_attn.qkv_proj.dequantized_weight()
    result = export_gguf(model, tokenizer, tmp_path / "m.gguf", "f32")
    assert result.requantized and "dequantized" in result.summary()
    tensors, _ = read(result.path)
    q = unpermuted("blk.0.attn_q.weight", tensors["blk.0.attn_q.weight"].data, model.config)
    np.testing.assert_array_equal(q, qkv[: model.config.dim].numpy())


def test_scaled_rope_is_written_as_llama_cpp_reads_it(tmp_path, tokenizer):
    """Linear scaling as two keys; Llama 3.1's bands as rope_freqs, the divisor of each pair's frequency."""
    model = small_model(rope_scaling={"rope_type": "linear", "factor": 4.0})
    tensors, fields = read(export_gguf(model, tokenizer, tmp_path / "linear.gguf").path)
    assert field(fields, "llama.rope.scaling.type") == "linear"
    assert field(fields, "llama.rope.scaling.factor") == 4.0
    assert "rope_freqs.weight" not in tensors
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}
    model = small_model(rope_theta=500000.0, rope_scaling=scaling)
    tensors, _ = read(export_gguf(model, tokenizer, tmp_path / "llama3.gguf").path)
    default = rope_inv_freq(small_model(rope_theta=500000.0).config)
    factors = torch.from_numpy(np.array(tensors["rope_freqs.weight"].data))
    torch.testing.assert_close(default / factors, rope_inv_freq(model.config))
    assert factors.min() == 1.0 and factors.max() == 8.0  # short wavelengths kept, long ones stretched


def test_what_llama_cannot_express_is_refused(tmp_path, tokenizer):
    with pytest.raises(ExportError, match="biases"):
        export_gguf(small_model(qkv_bias=True), tokenizer, tmp_path / "m.gguf")
    with pytest.raises(ExportError, match="sliding window"):
        export_gguf(small_model(sliding_window=16), tokenizer, tmp_path / "m.gguf")
    with pytest.raises(ExportError, match="it is a directory"):
        export_gguf(small_model(), tokenizer, tmp_path)
    with pytest.raises(ExportError, match="one of f32, f16, q8_0, q4_0"):
        export_gguf(small_model(), tokenizer, tmp_path / "m.gguf", "q3_k")
    with pytest.raises(ExportError, match="beyond the model's 97 embeddings"):
        export_gguf(tiny_model(), tokenizer, tmp_path / "m.gguf")


# ---------------------------------------------------------------------------------------------
# The command


def run_main(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def test_the_command_writes_a_bundled_model(tmp_path, capsys):
    out_path = tmp_path / "target.gguf"
    status, out, err = run_main(["export", "gguf", "minillm-target", str(out_path), "--type", "q8_0"], capsys)
    assert status == 0, err
    assert "Q8_0" in out and str(out_path) in out
    tensors, _ = read(out_path)
    assert len(tensors) == 2 + 9 * 6  # tied: no output.weight


def test_the_command_exports_a_saved_quantized_model_and_says_so(tmp_path, tokenizer, capsys):
    from minillm.compression import quantize
    from minillm.compression.saving import save_quantized

    save_quantized(quantize(small_model(), "int4", 16), tmp_path / "int4", tokenizer)
    status, out, err = run_main(["export", "gguf", str(tmp_path / "int4"), str(tmp_path / "m.gguf")], capsys)
    assert status == 0, err
    assert "from the dequantized weights of a minillm-quantized model" in out


def test_the_command_explains_bad_input(tmp_path, capsys, monkeypatch):
    status, _, err = run_main(["export", "gguf", "minillm-target", str(tmp_path / "m.gguf"), "--type", "q4"], capsys)
    assert status == 2 and "invalid choice: 'q4'" in err
    status, _, err = run_main(["export", "gguf", str(tmp_path / "nothing"), str(tmp_path / "m.gguf")], capsys)
    assert status == 2 and "no checkpoint directory" in err
    status, _, err = run_main(["export", "gguf", "minillm-target", str(tmp_path / "no" / "m.gguf")], capsys)
    assert status == 2 and "no directory" in err
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    status, _, err = run_main(["export", "gguf", "minillm-target", str(tmp_path / "m.gguf")], capsys)
    assert status == 2 and "pip install gguf" in err


# ---------------------------------------------------------------------------------------------
# llama.cpp itself, where it is installed


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["f32", "q8_0", "q4_0"])
def test_llama_cpp_decodes_the_greedy_tokens_minillm_does(tmp_path, file_type):
    llama_cpp = pytest.importorskip("llama_cpp")
    import minillm

    model, tokenizer = minillm.load("minillm-target", device="cpu", dtype=torch.float32)
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", file_type).path
    prompt = "def fibonacci(n):"
    ids = tokenizer.encode(prompt)
    ours = minillm.generate(model, ids, max_new_tokens=32, eos_token_id=None).tokens[0].tolist()
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert llm.tokenize(prompt.encode(), add_bos=True, special=False) == ids  # the same tokenizer
    theirs = llama_cpp_greedy(llama_cpp, path, ids, 32)
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    assert agree == 32 if file_type == "f32" else agree >= {"q8_0": 8, "q4_0": 2}[file_type], (ours, theirs)


def llama_cpp_greedy(llama_cpp, path, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, from llama.cpp (0.3.x keeps the logits only with logits_all)."""
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    llm.eval(ids)
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens


@pytest.mark.slow
def test_llama_cpp_runs_a_gqa_model_with_llama3_rope_as_minillm_does(tmp_path, tokenizer):
    """K's permutation over the kv heads only, and rope_freqs for Llama 3.1's scaled bands."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from minillm import generate

    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}
    model = small_model(n_heads=4, n_kv_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    path = export_gguf(model, tokenizer, tmp_path / "gqa.gguf", "f32").path
    ids = tokenizer.encode("def fibonacci(n):")
    ours = generate(model, ids, max_new_tokens=48, eos_token_id=None).tokens[0].tolist()
    assert llama_cpp_greedy(llama_cpp, path, ids, 48) == ours
