"""What every way of generating returns, written once: the new token ids of each sequence and
the time making them took.

``generate`` returns a ``GenerationResult`` (a batch, with the time of each decode step), the
decoders of Part III a ``DecodingResult`` (one sequence, with its acceptance statistics), the
serving engine a ``RequestOutput`` per request (with its timeline on the engine's clock). Each
adds its own details; all of them answer ``token_lists()``, ``total_time`` (seconds from the call,
or the request's arrival, to its last token; compiling excluded), ``compile_time``,
``num_tokens`` and ``tokens_per_s`` by the same names, so that a chapter or a benchmark compares
them without knowing which made them.
"""

from __future__ import annotations


class TimedTokens:
    """The base of the three result types: subclasses give ``token_lists()`` and ``total_time``."""

    compile_time: float = 0.0  # seconds compiling before the timer started (``compile=True``)
    total_time: float

    def token_lists(self) -> list[list[int]]:
        """The new token ids of each sequence, without padding."""
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:
        """New tokens of all sequences together."""
        return sum(len(tokens) for tokens in self.token_lists())

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of ``total_time`` (prefill included), all sequences together;
        nan when no time passed."""
        return self.num_tokens / self.total_time if self.total_time > 0 else float("nan")
