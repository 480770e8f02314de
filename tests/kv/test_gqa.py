"""Converting MHA to GQA (mean-pooled K/V heads), and the options of uptraining."""

import pytest
import torch

from minillm.kv.gqa import Uptraining, check_kv_heads, gqa_heads, to_gqa, uptrain_curves
from tests.conftest import tiny_model


def test_gqa_conversion_is_exact_when_the_pooled_heads_are_already_equal():
    model = tiny_model(seed=1, n_heads=4, n_kv_heads=4)
    hd, H = model.config.head_dim, 4
    with torch.no_grad():
        for layer in model.layers:
            w = layer.self_attn.qkv_proj.weight  # rows: q (H*hd), k (H*hd), v (H*hd)
            for part in (1, 2):  # make K/V heads 0=1 and 2=3: pooling pairs loses nothing
                heads = w[part * H * hd : (part + 1) * H * hd].view(H, hd, -1)
                heads[1], heads[3] = heads[0], heads[2]
    x = torch.randint(0, 97, (2, 20))
    gqa = to_gqa(model, 2)
    assert gqa.config.n_kv_heads == 2 and gqa.num_params() < model.num_params()
    torch.testing.assert_close(gqa(x), model(x), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(to_gqa(model, 4)(x), model(x))


def test_gqa_conversion_of_distinct_heads_changes_the_model_and_checks_its_input():
    model = tiny_model(seed=2, n_heads=4, n_kv_heads=4)
    x = torch.randint(0, 97, (1, 12))
    assert not torch.allclose(to_gqa(model, 1)(x), model(x), atol=1e-3)
    with pytest.raises(ValueError, match="must divide"):
        to_gqa(model, 3)


def test_gqa_heads_picks_a_divisor_near_a_quarter():
    assert [gqa_heads(h) for h in (32, 9, 8, 15, 7, 4, 2)] == [8, 3, 2, 3, 1, 2, 1]


@pytest.mark.parametrize(
    "field, value",
    [("steps", 0), ("seq_len", -1), ("batch_size", 1.5), ("steps", True), ("eval_every", 0), ("lr", 0.0)],
)
def test_uptraining_options_are_checked_on_construction(field, value):
    with pytest.raises(ValueError, match=field):
        Uptraining(**{field: value})


def test_uptraining_makes_the_training_config():
    tc = Uptraining(steps=40, eval_every=10).train_config()
    assert (tc.steps, tc.batch_size, tc.seq_len, tc.lr, tc.warmup, tc.eval_every) == (40, 8, 128, 5e-4, 4, 10)
    assert Uptraining(steps=5).train_config().eval_every == 5  # once, at the end, by default


def test_head_counts_that_do_not_divide_are_refused_before_any_training():
    model = tiny_model(n_heads=4, n_kv_heads=4)
    check_kv_heads(2, model.config)
    with pytest.raises(ValueError, match="must divide"):
        check_kv_heads(0, model.config)
    with pytest.raises(ValueError, match="must divide the model's 4 K/V heads, got 3"):
        uptrain_curves(model, [2, 3], Uptraining(steps=1), torch.zeros(10, dtype=torch.long), progress=False)
