"""The transformer itself: attention backends, masks, RoPE, GQA, padding, and its errors."""

import math

import pytest
import torch

from minillm import RopeScaling, Transformer, random_model
from minillm.core.attention import attention_mask, attention_reference, attention_sdpa
from minillm.core.checkpoints import from_hf_state_dict, to_hf_state_dict
from minillm.core.model import rope_inv_freq
from tests.conftest import tiny_config, tiny_model


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_sdpa_and_reference_attention_agree(n_kv_heads):
    model = tiny_model(n_kv_heads=n_kv_heads)
    ids = torch.randint(0, 97, (2, 23))
    fast = model(ids)
    slow = model.set_attention_backend("reference")(ids)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_attention_with_explicit_mask_matches_is_causal():
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    pos = torch.arange(9).expand(2, 9)
    mask = attention_mask(pos, pos)
    for attend in (attention_reference, attention_sdpa):
        torch.testing.assert_close(attend(q, k, v, mask), attend(q, k, v, None, causal=True))


@pytest.mark.parametrize("n_kv, T", [(1, 1), (2, 1), (2, 5), (4, 3)])
def test_grouped_query_sdpa_equals_the_reference_with_a_mask(n_kv, T):
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, n_kv, 11, 8), torch.randn(2, n_kv, 11, 8)
    q_pos, k_pos = torch.arange(11 - T, 11).expand(2, T).clone(), torch.arange(11).expand(2, 11).clone()
    k_pos[1, :3] = -1  # a left-padded row
    mask = attention_mask(q_pos, k_pos, window=6)
    torch.testing.assert_close(attention_sdpa(q, k, v, mask), attention_reference(q, k, v, mask))
    last = q[..., -1:, :]  # a decode step: no mask at all
    torch.testing.assert_close(attention_sdpa(last, k, v, None), attention_reference(last, k, v, None))


def test_attention_mask_rules():
    q_pos = torch.tensor([[-1, 0, 1, 2]])
    k_pos = torch.tensor([[-1, 0, 1, 2]])
    m = attention_mask(q_pos, k_pos, window=2)[0, 0]
    assert m[0].all()  # a padding query sees everything (kept finite, never used)
    assert not m[1:, 0].any()  # a padding key is never seen
    assert m[3].tolist() == [False, False, True, True]  # window 2: itself and one back
    assert m[1].tolist() == [False, True, False, False]  # causal: nothing from the future


def test_gqa_equals_mha_with_repeated_key_value_heads():
    gqa = tiny_model(n_kv_heads=2)
    mha = Transformer(tiny_config(n_kv_heads=4)).eval()
    state = to_hf_state_dict(gqa.state_dict(), gqa.config)  # separate q/k/v matrices
    hd = gqa.config.head_dim
    for name, w in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # (Hkv*hd, D) -> (H*hd, D)
            state[name] = w.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(from_hf_state_dict(state, mha.config))
    ids = torch.randint(0, 97, (2, 15))
    torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=1e-5)


def test_stacked_projections_round_trip_through_hugging_face_names():
    model = tiny_model(n_kv_heads=2, qkv_bias=True, o_bias=True, mlp_bias=True)
    hf = to_hf_state_dict(model.state_dict(), model.config)
    assert {"layers.0.self_attn.k_proj.bias", "layers.1.mlp.up_proj.weight"} <= set(hf)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in hf)
    assert hf["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    back = from_hf_state_dict(hf, model.config)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_left_padding_does_not_change_a_sequence():
    model = tiny_model()
    ids = torch.randint(1, 97, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    positions = torch.cat([torch.full((1, 3), -1), torch.arange(10)[None]], dim=1)
    torch.testing.assert_close(model(padded, positions)[:, 3:], model(ids), atol=1e-5, rtol=1e-5)


def test_sliding_window_limits_what_a_token_sees():
    model = tiny_model(sliding_window=4)
    ids = torch.randint(0, 97, (1, 12))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 97
    a, b = model(ids), model(changed)
    assert not torch.allclose(a[0, 3], b[0, 3])  # position 3 still sees position 0
    # two layers of window 4 reach back at most 2 * 3 = 6 positions
    torch.testing.assert_close(a[0, 7:], b[0, 7:])


def test_llama3_rope_scaling_keeps_high_and_stretches_low_frequencies():
    base = tiny_config(dim=256, n_heads=2, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192))
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * math.pi / f0
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any()
    torch.testing.assert_close(f1[high], f0[high])
    torch.testing.assert_close(f1[low], f0[low] / 8)
    mid = ~high & ~low
    assert ((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8)).all()


def test_linear_rope_divides_every_frequency():
    base = tiny_config()
    torch.testing.assert_close(
        rope_inv_freq(base.replace(rope_scaling=RopeScaling("linear", factor=4.0))), rope_inv_freq(base) / 4
    )


def test_errors_name_the_problem():
    model = tiny_model(max_seq_len=16)
    with pytest.raises(ValueError, match="exceeds the context length max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention backend"):
        model.set_attention_backend("cuda-magic")


def test_random_model_matches_its_config_and_tied_head():
    cfg = tiny_config(tie_embeddings=True)
    model = random_model(cfg, dtype=torch.bfloat16, seed=3)
    assert model.num_params() == cfg.num_params()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.dtype == torch.bfloat16 and not model.training
    again = random_model(cfg, dtype=torch.bfloat16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 97)


def test_random_model_from_a_preset_name_on_meta_device():
    model = random_model("SmolLM2-135M", device="meta")
    assert model.config.name == "SmolLM2-135M"
    assert 134e6 < model.num_params() < 136e6
