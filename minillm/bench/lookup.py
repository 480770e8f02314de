"""Chapter 8's measurements: prompt lookup by task. Prompts where the output may copy its input
(rewriting a function, answering again) beside free continuation (``copy_task_prompts``), and
prompt lookup against plain greedy decoding on each, with the share of the output a lookup could
copy (``lookup_by_task``, ``summarize_by_task``). The picture is ``viz.decoding.plot_lookup_by_task``.
"""

from __future__ import annotations

import re
import statistics

from ..core.generate import generate
from ..core.model import Transformer
from ..core.tokenizer import Tokenizer
from ..decoding.prompt_lookup import copyable_fraction, prompt_lookup_generate
from ..training import corpus
from .decoding import greedy_tokens, time_methods, tokens_and_stats


def copy_task_prompts(
    model: Transformer, tokenizer: Tokenizer, n: int = 4, prompt_len: int = 64, new_tokens: int = 64
) -> dict[str, list[list[int]]]:
    """Prompts of three kinds, from the validation split:

    - "free": corpus text to continue (nothing to copy but what the model repeats itself);
    - "rewrite a function": a method's source, then its ``def`` line again, as when asking for an
      edited version (the output may re-quote the body);
    - "regenerate an answer": a corpus prompt, the model's own greedy answer, then the same prompt
      again, as in a chat asked to answer again or revise (the answer is in the prompt).
    """
    free = corpus.corpus_prompts(tokenizer, n, prompt_len)
    rewrite = method_rewrites(tokenizer, n)
    sep = tokenizer.encode("\n\n")
    regenerate = [p + generate(model, p, new_tokens, eos_token_id=None).tokens[0].tolist() + sep + p for p in free]
    return {"free": free, "rewrite a function": rewrite, "regenerate an answer": regenerate}


def method_rewrites(tokenizer: Tokenizer, n: int | None = None) -> list[list[int]]:
    """A method's source from the validation split, then its ``def`` line again: the prompt of a
    request to rewrite it. ``n`` of them spread over the split (None: every one, 66)."""
    text = corpus.load_text("valid")
    methods = [m for m in re.findall(r"\n(    def \w+\(.*?\n)(?=\n    def )", text, re.S) if 200 < len(m) < 700]
    chosen = methods if n is None else methods[:: max(1, len(methods) // n)][:n]
    return [tokenizer.encode(m.rstrip("\n") + "\n\n" + m.split("\n")[0]) for m in chosen]


def lookup_by_task(
    model: Transformer,
    tasks: dict[str, list[list[int]]],
    new_tokens: int,
    k: int = 8,
    max_ngram: int = 3,
    repeats: int = 2,
) -> list[dict]:
    """Prompt lookup against plain greedy decoding, prompt by prompt (timed interleaved): per
    prompt the task, the share of the output a lookup could copy, tokens per forward, speedup."""
    methods = {
        "greedy": lambda p: greedy_tokens(generate(model, p, new_tokens, eos_token_id=None)),
        "lookup": lambda p: tokens_and_stats(
            prompt_lookup_generate(model, p, new_tokens, k=k, max_ngram=max_ngram, eos_token_id=None)
        ),
    }
    rows = []
    for task, prompts in tasks.items():
        for prompt in prompts:
            timed = time_methods(methods, [prompt], repeats, model.device)
            output, stats = timed["lookup"]["tokens"][0], timed["lookup"]["stats"][0]
            seconds = {name: min(t["seconds"]) for name, t in timed.items()}  # the least disturbed run
            rows.append(
                {
                    "task": task,
                    "prompt_len": len(prompt),
                    "copyable": copyable_fraction(prompt, output),
                    "tokens_per_target_forward": stats.tokens_per_target_forward,
                    "speedup": seconds["greedy"] / seconds["lookup"],
                    "tokens_per_s": new_tokens / seconds["lookup"],
                    "greedy_tokens_per_s": new_tokens / seconds["greedy"],
                    "same_greedy_tokens": output == timed["greedy"]["tokens"][0],
                }
            )
    return rows


def summarize_by_task(rows: list[dict]) -> list[dict]:
    """Medians per task of ``lookup_by_task``'s rows."""
    keys = ("copyable", "tokens_per_target_forward", "speedup", "tokens_per_s", "greedy_tokens_per_s")
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        out.append(
            {
                "task": task,
                "prompts": len(mine),
                **{key: statistics.median(r[key] for r in mine) for key in keys},
                "same_greedy_tokens": all(r["same_greedy_tokens"] for r in mine),
            }
        )
    return out
