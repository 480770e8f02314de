"""Chapter 7's measurement: speculative decoding against K and temperature, timed against plain
decoding (``speculative_sweep``). The acceptance rate a draft model would get on real text,
without generating, is ``decoding.speculative.teacher_forced_acceptance``; the pictures are in
``viz.decoding``.
"""

from __future__ import annotations

from ..core.generate import generate
from ..core.model import Transformer
from ..core.sampling import SamplingParams
from ..decoding.common import merged
from ..decoding.speculative import speculative_generate
from .decoding import greedy_tokens, time_methods, tokens_and_stats


def speculative_sweep(
    target: Transformer,
    draft: Transformer,
    prompts: list[list[int]],
    new_tokens: int,
    ks=(1, 2, 3, 4, 6, 8),
    temperatures=(0.0,),
    repeats: int = 1,
    seed: int = 0,
) -> list[dict]:
    """Speculative decoding for each (K, temperature) against plain decoding at the same
    temperature, timed interleaved on the same prompts: one row per pair, the fastest of the
    repeats (other work on the machine only ever adds time)."""
    rows = []
    for temp in temperatures:
        sampling = SamplingParams(temperature=temp, seed=seed)

        def plain(p, t=temp):
            return greedy_tokens(generate(target, p, new_tokens, temperature=t, seed=seed, eos_token_id=None))

        def speculative(p, k, s=sampling):
            return tokens_and_stats(speculative_generate(target, draft, p, new_tokens, k, s, eos_token_id=None))

        spec = {k: (lambda p, k=k: speculative(p, k)) for k in ks}
        timed = time_methods({"plain": plain, **spec}, prompts, repeats, target.device)
        base = min(timed["plain"]["seconds"])
        for k in ks:
            seconds, stats = min(timed[k]["seconds"]), merged(timed[k]["stats"])
            rows.append(
                {
                    "k": k,
                    "temperature": temp,
                    "speedup": base / seconds,
                    "tokens_per_s": len(prompts) * new_tokens / seconds,
                    "tokens_per_target_forward": stats.tokens_per_target_forward,
                    "alpha": stats.acceptance_rate,  # per position
                    "fraction_kept": stats.fraction_kept,
                    "mean_accepted_length": stats.mean_accepted_length,
                    "acceptance_rates": stats.acceptance_rates,
                    "reached": stats.reached,  # per position: rounds that got to check it
                    "ms_per_round": 1e3 * seconds / stats.target_forwards,
                    "ms_per_plain_token": 1e3 * base / (len(prompts) * new_tokens),
                }
            )
    return rows
