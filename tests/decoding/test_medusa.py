"""Medusa: the tree (each node attends exactly to its ancestors), greedy parity with ``generate``,
typical acceptance, the heads (zero init, save/load, targets, training), and the bundled heads."""

import pytest
import torch

from minillm import KVCache, generate, load
from minillm.cli.main import main
from minillm.core.checkpoints import BUNDLED_DIR
from minillm.core.sampling import SamplingParams
from minillm.decoding.medusa import (
    HEADS_FILE,
    MedusaHeads,
    MedusaOptions,
    MedusaTree,
    greedy_accepts,
    longest_accepted_path,
    medusa_generate,
    typical_accepts,
)
from minillm.decoding.medusa_train import (
    MedusaTrainConfig,
    fit_heads,
    head_targets,
    head_topk_accuracy,
    shifted_targets,
)
from tests.conftest import tiny_model
from tests.decoding.test_speculative import MarkovModel, random_prompt

SPARSE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


def random_heads(dim: int = 32, n_heads: int = 4, seed: int = 0, std: float = 0.3) -> MedusaHeads:
    """Untrained heads with random weights, so that candidates vary and some are right."""
    heads = MedusaHeads(dim, n_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, std, generator=gen)
    return heads.eval()


def greedy(model, prompt, n, **kw) -> list[int]:
    return generate(model, prompt, n, **kw).tokens[0].tolist()


# --- the tree -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [MedusaTree.product((3, 2, 2)), MedusaTree(SPARSE), MedusaTree.product((1,))])
def test_tree_mask_is_exactly_the_ancestors(tree):
    """Node i sees node j iff j's path is a prefix of i's (the root's path is empty)."""
    mask = tree.attention_mask()
    for i, pi in enumerate(tree.paths):
        for j, pj in enumerate(tree.paths):
            assert bool(mask[i, j]) == (pi[: len(pj)] == pj), (pi, pj)


def test_tree_forward_equals_each_path_run_alone():
    """Through the model: each node's logits under the tree mask and tree positions are those of
    its own path run after the prefix without the rest of the tree."""
    model, tree = tiny_model(), MedusaTree(SPARSE)
    prefix = random_prompt(7, 0)
    tokens = torch.randint(0, 97, (len(tree),), generator=torch.Generator().manual_seed(1))
    cache = KVCache.for_model(model, 1, 64)
    model(torch.tensor([prefix]), cache=cache)
    logits = model(tokens[None], (len(prefix) + tree.depths)[None], cache, tree_mask=tree.attention_mask())[0]
    for i in range(len(tree)):
        path = [j for j in range(len(tree)) if tree.paths[i][: len(tree.paths[j])] == tree.paths[j]]
        alone = model(torch.tensor([prefix + tokens[path].tolist()]))[0, -1]
        torch.testing.assert_close(logits[i], alone, atol=1e-5, rtol=1e-5)


def test_product_tree_sizes_and_depths():
    tree = MedusaTree.product((4, 3, 2))
    assert len(tree) == 1 + 4 + 12 + 24
    assert tree.depth == 3 and tree.top_k == [4, 3, 2]
    assert tree.depths.tolist() == [0] + [1] * 4 + [2] * 12 + [3] * 24
    assert all(tree.parents[i] < i for i in range(1, len(tree)))


def test_tree_tokens_come_from_each_heads_top_k():
    tree = MedusaTree(SPARSE)
    head_logits = torch.tensor([[0.0, 3, 2, 1, -1], [5, 0, 4, 0, 0], [0, 0, 0, 9, 0], [0, 0, 0, 0, 7]])
    tokens = tree.tokens(42, head_logits).tolist()
    by_path = dict(zip(tree.paths, tokens))
    assert by_path[()] == 42
    assert [by_path[(0,)], by_path[(1,)], by_path[(2,)]] == [1, 2, 3]  # head 1's top 3
    assert by_path[(0, 0)] == 0 and by_path[(0, 1)] == 2 and by_path[(1, 0)] == 0  # head 2's top 2
    assert by_path[(0, 1, 0)] == 3 and by_path[(0, 0, 0, 0)] == 4


@pytest.mark.parametrize("paths, match", [([], "non-empty"), ([(0,), (1, 0)], "prefix"), ([(0,), (-1,)], "non-neg")])
def test_bad_trees_raise(paths, match):
    with pytest.raises(ValueError, match=match):
        MedusaTree(paths)


def test_longest_accepted_path_needs_every_ancestor():
    tree = MedusaTree([(0,), (1,), (0, 0), (1, 0), (1, 0, 0)])  # nodes 0..5 in that order after the root
    accepts = torch.tensor([True, False, True, True, True, True])
    assert longest_accepted_path(accepts, tree) == [0, 2, 4, 5]
    accepts[2] = False  # node (1,) rejected: its whole subtree goes with it
    assert longest_accepted_path(accepts, tree) == [0]


def test_greedy_and_typical_acceptance_rules():
    tree = MedusaTree([(0,), (1,)])
    tokens = torch.tensor([9, 2, 3])
    logits = torch.full((3, 5), -10.0)
    logits[0, 3] = 10.0  # the root's argmax is 3
    assert greedy_accepts(tokens, logits, tree).tolist() == [True, False, True]
    params = SamplingParams(temperature=1.0)
    assert typical_accepts(tokens, logits, tree, params, epsilon=0.09, delta=0.3).tolist() == [True, False, True]
    flat = torch.zeros(3, 5)  # uniform: p = 0.2 for every token, entropy log 5
    assert typical_accepts(tokens, flat, tree, params, 0.09, 0.3).tolist() == [True, True, True]
    assert typical_accepts(tokens, flat, tree, params, 0.5, 10.0).tolist() == [True, False, False]


# --- decoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [(3, 2, 2), (1, 1, 1, 1), SPARSE])
def test_greedy_equals_generate(tree):
    model, heads = tiny_model(seed=0), random_heads()
    tree = MedusaTree(tree) if isinstance(tree, list) else tree
    for seed in range(6):
        prompt = random_prompt(1 + 4 * seed, 300 + seed)
        result = medusa_generate(model, heads, prompt, 30, MedusaOptions(tree), eos_token_id=None)
        assert result.tokens[0].tolist() == greedy(model, prompt, 30, eos_token_id=None), seed


def test_stops_at_eos_like_generate():
    prompt = random_prompt(5, 11)
    eos = greedy(tiny_model(), prompt, 30, eos_token_id=None)[9]
    model = tiny_model(eos_token_id=eos)
    expected = greedy(model, prompt, 30)
    assert expected[-1] == eos
    assert medusa_generate(model, random_heads(), prompt, 30, MedusaOptions((3, 2))).tokens[0].tolist() == expected


class CycleModel(MarkovModel):
    """Token a is followed by a + 1 (mod V); its "hidden state" is the one-hot of its input token."""

    def __init__(self, vocab: int = 9):
        cycle = torch.eye(vocab).roll(1, dims=1) * 5
        super().__init__(cycle.expand(128, vocab, vocab) + torch.randn(128, vocab, vocab) * 0.1)
        self.lm_head = None

    def forward(self, input_ids, positions=None, cache=None, last_only=False, return_hidden=False, **_):
        logits = super().forward(input_ids, positions, cache, last_only)
        hidden = torch.nn.functional.one_hot(input_ids[:, -logits.shape[1] :], self.config.vocab_size).float()
        return (logits, hidden) if return_hidden else logits


class OracleHeads(MedusaHeads):
    """Head k names the token k + 1 after the next one: always right for ``CycleModel``."""

    def forward(self, hidden, lm_head, n=None):
        V = hidden.shape[-1]
        return torch.stack(
            [
                torch.nn.functional.one_hot((hidden.argmax(-1) + 1 + k) % V, V).float()
                for k in range(1, (n or self.n_heads) + 1)
            ]
        )


def test_oracle_heads_are_accepted_at_every_level():
    model, heads = CycleModel(), OracleHeads(9, 3)
    result = medusa_generate(model, heads, [0, 1], 33, MedusaOptions((2, 2, 2)), eos_token_id=None)
    assert result.tokens[0].tolist() == [(2 + i) % 9 for i in range(33)]
    assert result.stats.acceptance_rates == [1.0, 1.0, 1.0]
    assert result.stats.target_forwards == 9  # the prefill's token, then 8 forwards of 4 tokens


def test_typical_acceptance_samples_and_accepts_more_with_a_low_threshold():
    model, heads = tiny_model(seed=0, std=0.05), random_heads(std=0.05)  # flat distributions
    prompt = random_prompt(6, 2)
    sampling = SamplingParams(temperature=1.0, seed=0)
    strict = MedusaOptions((3, 2), "typical", sampling, epsilon=1.0, delta=1e9)
    strict = medusa_generate(model, heads, prompt, 40, strict, eos_token_id=None)
    assert strict.stats.tokens_per_target_forward == 1.0  # threshold 1: nothing is ever accepted
    loose = medusa_generate(
        model, heads, prompt, 40, MedusaOptions((3, 2), "typical", sampling, epsilon=0.0, delta=0.0), eos_token_id=None
    )
    assert loose.stats.acceptance_rates == [1.0, 1.0]  # threshold 0: the first path always passes
    assert loose.stats.target_forwards == 14  # the prefill's token, then 13 forwards of 3
    assert loose.tokens.shape == (1, 40)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(acceptance="exact"), "acceptance"),
        (dict(acceptance="typical"), "temperature"),
        (dict(sampling=0.7), "sampling"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(delta=-1.0), "delta"),
        (dict(tree=(0, 2)), "paths"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MedusaOptions(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(options=MedusaOptions((2, 2, 2, 2, 2))), "heads"),
        (dict(input_ids=[[1, 2], [3, 4]]), "batch size 1"),
        (dict(max_new_tokens=120), "max_seq_len"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(input_ids=[1, 2, 3], max_new_tokens=10, options=MedusaOptions((3, 2))) | kwargs
    with pytest.raises(ValueError, match=match):
        medusa_generate(tiny_model(), random_heads(), **args)


@pytest.mark.parametrize("field", ["n_heads", "n_sequences", "prompt_len", "new_tokens", "steps", "batch_size", "lr"])
def test_bad_train_config_names_the_field(field):
    with pytest.raises(ValueError, match=field):
        MedusaTrainConfig(**{field: 0})


# --- the heads ----------------------------------------------------------------------------------


def test_untrained_heads_predict_what_the_lm_head_does():
    model = tiny_model()
    heads = MedusaHeads(32, 3)
    logits, hidden = model(torch.tensor([[1, 2, 3]]), return_hidden=True)
    out = heads(hidden, model.lm_head)  # (3, 1, 3, V)
    assert out.shape == (3, 1, 3, 97)
    torch.testing.assert_close(out, logits.expand(3, -1, -1, -1))
    assert heads.num_params() == 3 * (32 * 32 + 32)
    torch.testing.assert_close(heads(hidden, model.lm_head, n=2), out[:2])  # only the heads asked for


def test_head_targets_are_shifted_and_skip_the_prompt():
    seqs = torch.arange(10)[None]  # tokens 0..9
    targets = head_targets(seqs, n_heads=2, prompt_len=4)
    # head 1 at t predicts t + 2; targets on the prompt (positions < 4) are ignored
    assert targets[0, 0].tolist() == [-100, -100, 4, 5, 6, 7, 8, 9, -100, -100]
    assert targets[1, 0].tolist() == [-100, 4, 5, 6, 7, 8, 9, -100, -100, -100]


def test_training_lowers_the_loss_and_save_load_round_trips(tmp_path):
    model = tiny_model()
    seqs = torch.randint(0, 97, (16, 24), generator=torch.Generator().manual_seed(0))
    seqs[:, 8:] = seqs[:, :8].repeat(1, 2)  # learnable: the second half repeats the first
    heads = MedusaHeads(32, 2)
    losses = fit_heads(model, heads, seqs, MedusaTrainConfig(n_heads=2, prompt_len=8, steps=40, lr=1e-2))
    assert sum(losses[-5:]) < sum(losses[:5]) - 0.5
    heads.save(tmp_path, {"note": "test"})
    loaded = MedusaHeads.load(tmp_path)
    hidden = torch.randn(2, 5, 32)
    torch.testing.assert_close(loaded(hidden, model.lm_head), heads(hidden, model.lm_head))


def test_loading_heads_from_a_directory_without_them_raises(tmp_path):
    with pytest.raises(ValueError, match="no Medusa heads"):
        MedusaHeads.load(tmp_path)


def test_bundled_heads_are_lossless_and_accepted():
    assert (BUNDLED_DIR / "minillm-target" / HEADS_FILE).is_file()
    model, tokenizer = load("minillm-target", device="cpu")
    heads = MedusaHeads.load("minillm-target")
    prompt = tokenizer.encode("def read_config(path):\n    with open(path) as f:")
    result = medusa_generate(model, heads, prompt, 40, eos_token_id=None)
    assert result.tokens[0].tolist() == greedy(model, prompt, 40, eos_token_id=None)
    assert result.stats.tokens_per_target_forward > 1.3  # trained heads are right often enough to matter


def test_cli_train_medusa_writes_heads_that_load(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the command takes 2; test workers share the CPU
    argv = ["train", "medusa", "--heads", "2", "--steps", "2", "--sequences", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    heads = MedusaHeads.load(tmp_path)
    assert heads.n_heads == 2
    assert main(["train", "medusa", "--steps", "0"]) == 2


# --- looking at the heads and the tree (chapter 9) ----------------------------------------------


def test_trace_records_the_tree_and_the_accepted_path():
    model, heads, tree = tiny_model(), random_heads(), MedusaTree.product((3, 2))
    trace = []
    result = medusa_generate(model, heads, random_prompt(6, 4), 20, MedusaOptions(tree), eos_token_id=None, trace=trace)
    assert len(trace) == result.stats.target_forwards - 1  # the prefill makes the first token
    for step in trace:
        assert len(step["tokens"]) == len(tree) and step["path"][0] == 0
        assert step["emitted"][:-1] == [step["tokens"][i] for i in step["path"][1:]]
    assert [t for s in trace for t in s["emitted"]] == result.tokens[0, 1:].tolist()


def test_head_topk_accuracy_of_oracle_and_untrained_heads():
    model = tiny_model()
    seqs = torch.tensor([greedy(model, p, 12, eos_token_id=None) for p in ([1, 2, 3], [5, 6, 7])])
    seqs = torch.cat([torch.tensor([[1, 2, 3], [5, 6, 7]]), seqs], dim=1)  # prompt + the model's greedy text
    acc = head_topk_accuracy(model, MedusaHeads(32, 2), seqs, prompt_len=3, ks=(1, 5))
    assert acc[1][0] == 1.0 and acc[5][0] == 1.0  # the LM head against its own greedy tokens
    assert all(0 <= a <= b <= 1 for a, b in zip(acc[1], acc[5]))  # top-5 contains top-1
    assert len(acc[1]) == 3


def test_shifted_targets_match_head_targets():
    seqs = torch.arange(12).view(2, 6)
    targets = head_targets(seqs, 3, prompt_len=2)
    for k in range(1, 4):
        assert torch.equal(shifted_targets(seqs, 1 + k, 2), targets[k - 1])
    assert shifted_targets(seqs, 1, 2)[0].tolist() == [-100, 2, 3, 4, 5, -100]
