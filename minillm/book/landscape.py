"""The inference-framework landscape: which of this book's techniques the serving engines ship.

Every chapter built one technique by hand. Production engines bundle dozens of them, and choosing
an engine is mostly choosing which bundle, on which hardware, for how many users. The comparison
is data (``book.frameworks``: ``FRAMEWORKS``, ``FEATURES``, and the sourced ``SUPPORT`` cell of
each pair), so chapter 16 can print it and the tests can check it; this module prints it
(``landscape_table``, ``landscape_markdown``, ``pick_guide_markdown``) and holds what hosted
providers charge for latency-tolerant (batch) work and how long it may take (``BATCH_APIS``).

Why batch is cheaper is chapter 2's cost model, ``cost_per_million_tokens(dollars_per_hour,
tokens_per_s)``: the machine costs the same per hour either way, but an online deployment held to a
latency SLO can only count its goodput (chapter 13: the batch it may run is capped by the SLO),
while a batch job runs the batch as large as memory allows. ``online_vs_batch_cost`` turns two
measured throughputs into the two prices and their ratio, to set beside the providers' published
discounts.

The facts were read from the providers' and projects' own documentation (accessed 2026-12); they
move fast, so each is a dated claim with its source, not a specification.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minillm.measure.metrics import cost_per_million_tokens
from minillm.measure.report import PAGE_WIDTH, format_table, wrap_line

from .frameworks import ALSO_PICKED, FEATURES, FRAMEWORKS, NOT_DOCUMENTED, SUPPORT


@dataclass(frozen=True)
class BatchApi:
    """A hosted provider's latency-tolerant tier: the published price relative to the standard
    (online) price, the published turnaround, and the pages that say so."""

    provider: str
    product: str
    price_ratio: float  # batch price / standard price, as published
    discount: str
    turnaround: str
    cites: tuple[str, ...]


BATCH_APIS: tuple[BatchApi, ...] = (
    BatchApi(
        "OpenAI",
        "Batch API",
        0.5,
        "50% off the synchronous APIs",
        "within 24 hours; work left at expiry is cancelled, finished work returned",
        ("openai_batch_faq",),
    ),
    BatchApi(
        "Anthropic",
        "Message Batches API",
        0.5,
        "50% off the standard price",
        "most batches in under 1 hour; a batch expires 24 hours after creation",
        ("anthropic_batch", "anthropic_batch_api_ref"),
    ),
    BatchApi(
        "Google",
        "Gemini API Batch Mode",
        0.5,
        "50% off the standard rate",
        "within 24 hours",
        ("gemini_batch_blog", "gemini_optimization"),
    ),
    BatchApi(
        "Google",
        "Gemini API Flex tier (synchronous)",
        0.5,
        "50% off, best effort (may be shed)",
        "minutes (1 to 15 minute target)",
        ("gemini_optimization",),
    ),
    BatchApi(
        "Google Cloud",
        "Vertex AI batch inference (Gemini)",
        0.5,
        "50% off real-time inference",
        NOT_DOCUMENTED + " in the page read",
        ("vertex_batch",),
    ),
)


def cited_keys() -> set[str]:
    """Every bibliography key this module cites."""
    keys = {k for fw in FRAMEWORKS + ALSO_PICKED for k in fw.cites}
    keys |= {k for cell in SUPPORT.values() for k in cell.cites}
    return keys | {k for api in BATCH_APIS for k in api.cites}


def chapters_named() -> set[int]:
    return {f.chapter for f in FEATURES}


def _cite(keys: tuple[str, ...]) -> str:
    return f" {{cite}}`{','.join(keys)}`" if keys else ""


FLAG = re.compile(r"(?<![\w`-])(--[a-z][\w-]*)")


def _md(text: str) -> str:
    """A cell as Markdown: pipes escaped, command-line flags in code spans (as prose, Markdown's
    smart quotes would turn their ``--`` into an en dash, and a copied flag would fail)."""
    return FLAG.sub(r"`\1`", text.replace("|", "\\|"))


def landscape_table(width: int = PAGE_WIDTH) -> str:
    """The feature x framework table as plain text within ``width`` columns: two tables of three
    frameworks each, cells abbreviated, then a legend. Citations are in ``landscape_markdown``."""
    halves = (FRAMEWORKS[:3], FRAMEWORKS[3:])
    parts = []
    for half in halves:
        rows = [
            {"feature": f"{f.short} (ch.{f.chapter})", **{fw.name: SUPPORT[f.key, fw.name].brief for fw in half}}
            for f in FEATURES
        ]
        columns = {"feature": "technique (chapter)", **{fw.name: fw.name for fw in half}}
        parts.append(format_table(rows, columns, width=width))
    legend = (
        "n.d. = not documented in the pages read (not proof of absence); partial, legacy only, "
        "example only, experimental: see the Markdown table; ? = unclear from the docs."
    )
    return "\n\n".join(parts) + "\n\n" + "\n".join(wrap_line(legend, width))


def landscape_markdown() -> str:
    """The feature x framework table in Markdown, each cell with its MyST citations."""
    names = [fw.name for fw in FRAMEWORKS]
    lines = [
        "| Technique | Chapter | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 2),
    ]
    for f in FEATURES:
        cells = [_md(SUPPORT[f.key, n].value) + _cite(SUPPORT[f.key, n].cites) for n in names]
        lines.append(f"| {_md(f.name)} | ch. {f.chapter} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pick_guide_markdown() -> str:
    """One line per framework (the charted six, then MLX LM and LMDeploy): what it is, its status,
    and when to pick it, with citations."""
    return "\n".join(
        f"- **{fw.name}**, {fw.kind}. {fw.summary} *When to pick it:* {fw.pick_when}{_cite(fw.cites)}"
        for fw in FRAMEWORKS + ALSO_PICKED
    )


def batch_api_markdown() -> str:
    """The published batch (latency-tolerant) tiers as a Markdown table with citations."""
    lines = [
        "| Provider | Product | Price vs online | Turnaround |",
        "|---|---|---|---|",
    ]
    for api in BATCH_APIS:
        lines.append(
            f"| {_md(api.provider)} | {_md(api.product)} | {_md(api.discount)} (x{api.price_ratio:g})"
            f"{_cite(api.cites)} | {_md(api.turnaround)} |"
        )
    return "\n".join(lines)


def online_vs_batch_cost(dollars_per_hour: float, online_tokens_per_s: float, batch_tokens_per_s: float) -> dict:
    """$ per 1M tokens for the same machine run online (its goodput under a latency SLO) and as a
    batch job (its full throughput), and the batch-to-online price ratio, comparable with
    ``BatchApi.price_ratio``.

        >>> online_vs_batch_cost(2.0, 1000, 4000)["batch_to_online"]
        0.25
    """
    for name, value in (
        ("dollars_per_hour", dollars_per_hour),
        ("online_tokens_per_s", online_tokens_per_s),
        ("batch_tokens_per_s", batch_tokens_per_s),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    online = cost_per_million_tokens(dollars_per_hour, online_tokens_per_s)
    batch = cost_per_million_tokens(dollars_per_hour, batch_tokens_per_s)
    return {
        "online_cost_per_m": online,
        "batch_cost_per_m": batch,
        "batch_to_online": batch / online,
        "discount": 1 - batch / online,
    }
