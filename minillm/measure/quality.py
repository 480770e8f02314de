"""What a cache (or any change to a model) costs in quality: the loss and perplexity of text fed
through it, chunk by chunk, so that a cache's evictions, windows or quantization show up as a
change in perplexity (chapter 5; the compression chapter measures its models the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..core.cache import Cache
from ..core.generate import generate
from ..core.model import Transformer


@torch.inference_mode()
def streaming_loss(
    model: Transformer, ids: torch.Tensor, cache: Cache | None = None, chunk: int | None = None
) -> float:
    """Mean next-token loss (nats) of ``ids`` (N,) fed ``chunk`` tokens at a time through ``cache``.

    Without a cache the whole text is one forward (full attention). With one, every chunk
    sees only what the cache kept, so evictions and quantization cost what they cost.
    """
    ids = ids.to(model.device)[None]  # (1, N)
    chunk = chunk or ids.shape[1]
    total, n = 0.0, ids.shape[1] - 1
    for s in range(0, n, chunk):
        logits = model(ids[:, s : min(s + chunk, n)], cache=cache)  # (1, c, V)
        target = ids[:, s + 1 : s + 1 + logits.shape[1]]
        total += F.cross_entropy(logits[0].float(), target[0], reduction="sum").item()
    return total / n


def mean_perplexity(
    model: Transformer,
    segments: Sequence[torch.Tensor],
    make_cache: Callable[[Transformer], Cache] | None = None,
    chunk: int | None = None,
) -> float:
    """exp(mean loss) over text segments, a fresh cache from ``make_cache(model)`` for each."""
    losses = [streaming_loss(model, seg, make_cache(model) if make_cache else None, chunk) for seg in segments]
    return math.exp(sum(losses) / len(losses))


# ---------------------------------------------------------------------------------------------
# What a compressed model costs against the model it came from (chapter 12)


def text_windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """(N,) token ids -> (n, seq_len + 1) non-overlapping windows (inputs and their next tokens)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    n = (len(ids) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"{len(ids)} tokens do not fill one window of {seq_len} + 1")
    starts = torch.arange(n) * seq_len
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


@torch.inference_mode()
def perplexity(
    model: Transformer, ids: torch.Tensor, seq_len: int = 256, max_windows: int | None = None, batch_size: int = 8
) -> float:
    """exp(mean next-token loss) over non-overlapping windows of held-out ``ids`` (N,)."""
    windows = text_windows(ids, seq_len, max_windows).to(model.device)
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(batch[:, :-1])  # (b, T, V)
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


@torch.inference_mode()
def logit_difference(model: Transformer, reference: Transformer, ids: torch.Tensor) -> dict[str, float]:
    """Max and mean |logit difference| of two models on the same input ids (B, T), in fp32, and
    the fraction of positions where their argmax (greedy next token) agrees."""
    ids = ids.to(reference.device)
    a = model(ids.to(model.device)).float().to(reference.device)
    b = reference(ids).float()
    diff = (a - b).abs()
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


@torch.inference_mode()
def continuation_agreement(
    model: Transformer, reference: Transformer, prompts: Sequence[Sequence[int]], new_tokens: int = 64
) -> float:
    """Fraction of the reference's own greedy continuations that ``model`` predicts too.

    The reference generates ``new_tokens`` greedily after each prompt; both models then read
    prompt + continuation and ``model``'s argmax is compared with the reference's token at each
    generated position (teacher forcing: one early disagreement does not decide the rest)."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens!r}")
    prompts = [list(p) for p in prompts]
    continuations = generate(reference, prompts, new_tokens, eos_token_id=None).tokens.tolist()  # (B, n)
    agree = total = 0
    for prompt, continuation in zip(prompts, continuations):
        seq = torch.tensor([prompt + continuation], device=reference.device)  # (1, P + n)
        guess = model(seq[:, :-1].to(model.device)).argmax(-1)[0, len(prompt) - 1 :].to(seq.device)
        agree += (guess == seq[0, len(prompt) :]).sum().item()
        total += new_tokens
    return agree / total


@torch.inference_mode()
def layer_output_errors(
    model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor, names: Sequence[str]
) -> dict[str, float]:
    """||y - y_ref|| / ||y_ref|| of the outputs of the named modules (e.g. "layers.2.mlp.down_proj")
    when both models read the same ids: each layer's error with all the error upstream of it."""
    outputs: dict[str, dict[str, torch.Tensor]] = {"model": {}, "reference": {}}
    for which, m in (("model", model), ("reference", reference)):
        hooks = []
        for name in names:

            def keep(module, args, out, name=name, which=which):
                outputs[which][name] = out.detach().float()

            hooks.append(m.get_submodule(name).register_forward_hook(keep))
        try:
            m(ids.to(m.device if hasattr(m, "device") else ids.device))
        finally:
            for h in hooks:
                h.remove()
    return {
        name: ((outputs["model"][name] - outputs["reference"][name]).norm() / outputs["reference"][name].norm()).item()
        for name in names
    }
