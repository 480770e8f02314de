"""The compiled decode path (``core.compiled``): the static cache gives the eager cache's logits,
a compiled forward gives the eager one's greedy tokens in generate and in every draft-and-verify
decoder, and the fast acceptance rules equal the reference ones. Compiling takes seconds on a
CPU, so only a one-layer model is compiled here, a few widths in all."""

import pytest
import torch

from minillm.core.compiled import CachedForward, CompiledForward, compiled_forward_for, static_length
from minillm.core.generate import generate
from minillm.decoding.lookahead import LookaheadConfig, LookaheadDecoder, lookahead_generate
from minillm.decoding.medusa import MedusaOptions, medusa_generate
from minillm.decoding.prompt_lookup import prompt_lookup_generate
from minillm.decoding.speculative import accept_draft_tokens, greedy_accept, speculative_generate

from ..conftest import tiny_model
from ..decoding.test_medusa import random_heads

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]


def one_layer(seed: int = 0):
    return tiny_model(seed=seed, n_layers=1)


@torch.inference_mode()
def test_static_cache_gives_the_contiguous_caches_logits():
    """Eagerly (no width compiled), the static cache's masked whole-buffer reads equal the
    contiguous cache's: a prompt, single steps, a rollback, a tree and keep_slots."""
    model = tiny_model()
    eager, static = CachedForward(model, 1, 64), CompiledForward(model, 1, 64, widths=())
    ids = torch.tensor([PROMPT])
    torch.testing.assert_close(static(ids), eager(ids))
    for token in (5, 9, 11):
        step = torch.tensor([[token]])
        torch.testing.assert_close(static(step), eager(step))
    static.truncate(len(PROMPT) + 1)
    eager.truncate(len(PROMPT) + 1)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    start = eager.length
    positions = torch.tensor([[start, start + 1, start + 1]])
    branch = torch.tensor([[7, 8, 9]])
    torch.testing.assert_close(static(branch, positions, tree), eager(branch, positions, tree))
    for fwd in (static, eager):
        fwd.keep_slots(start, [start, start + 2])
    assert static.length == eager.length == start + 2
    step = torch.tensor([[4]])
    torch.testing.assert_close(static(step), eager(step))


def test_generate_compiled_gives_eagers_tokens_and_reports_compile_time():
    model = one_layer()
    eager = generate(model, PROMPT, 20, eos_token_id=None)
    first = generate(model, PROMPT, 20, eos_token_id=None, compile=True)
    again = generate(model, PROMPT[:-3], 24, eos_token_id=None, compile=True)  # the same slot bucket
    assert first.tokens.tolist() == eager.tokens.tolist()
    assert again.tokens.tolist() == generate(model, PROMPT[:-3], 24, eos_token_id=None).tokens.tolist()
    assert first.compile_time > 0 and again.compile_time == 0  # compiled once, kept on the model
    assert first.ttft < first.compile_time  # the compile is not in the timings
    rows = [PROMPT, PROMPT[:7]]  # left padding: rows at different positions, one graph
    assert (
        generate(model, rows, 12, eos_token_id=None, compile=True).tokens.tolist()
        == generate(model, rows, 12, eos_token_id=None).tokens.tolist()
    )


def test_two_compiled_models_keep_their_own_graphs():
    """The guards are skipped after compiling (they only tell the graphs apart): two models'
    compiled forwards must still each run their own weights."""
    a, b = one_layer(seed=1), one_layer(seed=2)
    with torch.inference_mode():
        fa, fb = compiled_forward_for(a, 1, 40), compiled_forward_for(b, 1, 40)
        fa.warmup(1)
        fb.warmup(1)
        ids = torch.tensor([PROMPT])
        fa(ids), fb(ids)
        step = torch.tensor([[6]])
        out_a, out_b = fa(step), fb(step)
        ea, eb = CachedForward(a, 1, 40), CachedForward(b, 1, 40)
        ea(ids), eb(ids)
        torch.testing.assert_close(out_a, ea(step), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out_b, eb(step), rtol=1e-4, atol=1e-4)


def test_compiled_decoders_give_greedy_tokens():
    """Speculative (target width K+1, draft widths 1 and 2), prompt lookup (proposals padded to K),
    lookahead (candidates padded to G) and Medusa (one tree): compiled == eager == generate."""
    target, draft = one_layer(seed=0), one_layer(seed=3)
    want = generate(target, PROMPT, 24, eos_token_id=None).tokens[0].tolist()
    runs = {
        "speculative": lambda c: speculative_generate(target, draft, PROMPT, 24, k=3, eos_token_id=None, compile=c),
        "prompt lookup": lambda c: prompt_lookup_generate(target, PROMPT, 24, k=3, eos_token_id=None, compile=c),
        "lookahead": lambda c: lookahead_generate(
            target, PROMPT, 24, LookaheadConfig(window=2, ngram=3, max_candidates=2), eos_token_id=None, compile=c
        ),
        "medusa": lambda c: medusa_generate(
            target, random_heads(), PROMPT, 24, MedusaOptions((2, 1)), eos_token_id=None, compile=c
        ),
    }
    for name, run in runs.items():
        eager, compiled = run(False), run(True)
        assert eager.tokens[0].tolist() == want, name
        assert compiled.tokens[0].tolist() == want, name
        assert repr(compiled.stats) == repr(eager.stats), name  # the padding is never counted
        assert eager.compile_time == 0, name
        # the compiled forwards are kept on the model: prompt lookup's K+1 = 4 reuses speculative's
        assert (compiled.compile_time > 0) == (name != "prompt lookup"), name
        assert run(True).compile_time == 0, name
        assert 0 < compiled.forward_seconds <= compiled.total_time, name


def test_greedy_accept_equals_the_rejection_rule_on_one_hots():
    gen = torch.Generator().manual_seed(0)
    V = 11
    for _ in range(200):
        K = int(torch.randint(1, 6, (1,), generator=gen))
        logits = torch.randn(K + 1, V, generator=gen)
        best = logits.argmax(-1)
        draft = torch.where(torch.rand(K, generator=gen) < 0.7, best[:K], torch.randint(0, V, (K,), generator=gen))
        p = torch.nn.functional.one_hot(best, V).float()
        q = torch.nn.functional.one_hot(draft, V).float()
        assert greedy_accept(logits, draft) == accept_draft_tokens(p, q, draft, gen)


def test_lookahead_verify_equals_the_reference_loop():
    config = LookaheadConfig(window=3, ngram=4, max_candidates=4)
    decoder = LookaheadDecoder(tiny_model(), config, PROMPT, CachedForward(tiny_model(), 1, 8))
    gen = torch.Generator().manual_seed(0)
    T = config.tokens_per_forward()
    for _ in range(300):
        best = torch.randint(0, 4, (T,), generator=gen)  # a small alphabet: many partial matches
        n = int(torch.randint(0, 5, (1,), generator=gen))
        candidates = [tuple(torch.randint(0, 4, (3,), generator=gen).tolist()) for _ in range(n)]
        assert decoder.verify(candidates, best) == decoder.verify_reference(candidates, best)


def test_bad_compile_requests_name_the_problem():
    model = tiny_model()
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(model, PROMPT, 4, use_cache=False, compile=True)
    with pytest.raises(ValueError, match="drop the cache argument"):
        generate(model, PROMPT, 4, compile=True, cache=CachedForward(model, 1, 32).cache)
    with pytest.raises(ValueError, match="exceeds the context length"):
        CompiledForward(model, 1, model.config.max_seq_len + 1)


def test_static_length_buckets():
    assert static_length(10, 1024) == 256
    assert static_length(300, 1024) == 512
    assert static_length(900, 1000) == 1000
    assert static_length(1000, 1000) == 1000


def test_compiled_generation_needs_no_autograd_so_its_static_caches_never_do():
    """generate(compile=True) runs under inference mode: were it not, the cache's buffers would
    take requires_grad from the keys written into them, and the next call would recompile into a
    training graph several times slower (which a misplaced decorator once caused)."""
    model = one_layer(seed=5)
    modes = []
    record = lambda token: modes.append(torch.is_inference_mode_enabled())  # noqa: E731
    first = generate(model, PROMPT, 8, eos_token_id=None, compile=True, on_token=record)
    for _ in range(3):
        again = generate(model, PROMPT, 8, eos_token_id=None, compile=True, on_token=record)
        assert again.compile_time == 0 and again.token_lists() == first.token_lists()
    assert len(modes) == 4 * 8 and all(modes)
    for fwd in model.__dict__["_compiled_forwards"].values():
        assert not any(t.requires_grad for t in (*fwd.cache.k, *fwd.cache.v))


def test_a_small_model_autotunes_its_matrix_products_and_keeps_eagers_tokens(monkeypatch):
    """On the CPU minillm-target (24 MB of weights) compiles with Inductor's GEMM autotuning and
    a C++ caller of its kernels, as a user gets it; a large model gets neither; the tokens are
    eager's either way."""
    import minillm
    from minillm.core import compiled as compiled_module

    monkeypatch.setenv("MINILLM_AUTOTUNE", "1")
    monkeypatch.setenv("MINILLM_CPP_WRAPPER", "1")
    seen = []
    real = compiled_module.compiling
    monkeypatch.setattr(compiled_module, "compiling", lambda d, w=None: seen.append(w) or real(d, w))
    model, tok = minillm.load("minillm-target", device="cpu")
    prompt = tok.encode("def read_config(path):")
    eager = minillm.generate(model, prompt, 16, eos_token_id=None)
    fast = minillm.generate(model, prompt, 16, eos_token_id=None, compile=True)
    assert torch.equal(eager.tokens, fast.tokens)
    assert seen and all(w == compiled_module.weight_bytes(model) <= compiled_module.AUTOTUNE_BYTES for w in seen)
    with real(torch.device("cpu"), int(compiled_module.AUTOTUNE_BYTES) + 1):
        assert torch._inductor.config.freezing
        assert not torch._inductor.config.max_autotune and not torch._inductor.config.cpp_wrapper
    with real(torch.device("cpu"), 1000):
        assert torch._inductor.config.max_autotune
    monkeypatch.setenv("MINILLM_AUTOTUNE", "0")
    with real(torch.device("cpu"), 1000):
        assert not torch._inductor.config.max_autotune and torch._inductor.config.cpp_wrapper
    monkeypatch.setenv("MINILLM_CPP_WRAPPER", "0")
    with real(torch.device("cpu"), 1000):
        assert not torch._inductor.config.cpp_wrapper


@pytest.mark.parametrize("scheme", ["int4", "w8a8"])
def test_a_cpp_caller_keeps_eagers_tokens_through_the_c_kernels(monkeypatch, scheme):
    """A quantized model's compiled step calls minillm's C kernels (custom ops) between Inductor's
    own: with the graph's caller in C++ the tokens are still eager's (int4 in bf16, W8A8 fp32)."""
    import minillm
    from minillm.runtime import RuntimeOptions, load_model

    monkeypatch.setenv("MINILLM_CPP_WRAPPER", "1")
    options = RuntimeOptions(quantize=scheme, group_size=32 if scheme == "int4" else None, device="cpu")
    model, tok = load_model("minillm-target", options)
    prompt = tok.encode("def read_config(path):")
    eager = minillm.generate(model, prompt, 12, eos_token_id=None)
    fast = minillm.generate(model, prompt, 12, eos_token_id=None, compile=True)
    assert torch.equal(eager.tokens, fast.tokens)
