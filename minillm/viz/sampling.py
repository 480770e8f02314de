"""Chapter 1's pictures of sampling: how temperature, top-k and top-p reshape one distribution."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch

from ..core.config import ceil_div
from ..core.sampling import SamplingParams, probabilities
from .style import WIDTH_IN, finish


def sampling_grid(logits: torch.Tensor, labels: Sequence[str], settings: Sequence[dict], title: str = ""):
    """Small multiples: the next-token distribution under each sampling setting.

    ``settings`` are SamplingParams keyword dicts, e.g. ``{"temperature": 0.5, "top_p": 0.9}``.
    Tokens read down the left edge, most likely first; a filled bar is what the setting samples
    from, a hollow bar the probability a token had at that temperature before top-k or top-p
    removed it (greedy: at temperature 1)."""
    cols = min(3, len(settings))
    rows = ceil_div(len(settings), cols)
    height = 0.8 + 0.17 * len(labels)
    fig, axes = plt.subplots(rows, cols, figsize=(WIDTH_IN, height * rows + 0.3), sharey=True, squeeze=False)
    y = list(range(len(labels)))
    for ax, kw in zip(axes.flat, settings):
        probs = probabilities(logits.float(), SamplingParams(**kw))
        before = probabilities(logits.float(), SamplingParams(temperature=kw.get("temperature") or 1.0))
        removed = torch.where(probs > 0, 0.0, before)
        ax.barh(y, removed.tolist(), color="none", edgecolor="0.55", linewidth=0.8)
        ax.barh(y, probs.tolist(), color="tab:blue")
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xlim(0, 1.02)
        kept = int((probs > 0).sum())
        ax.set_title(f"{describe(kw)}: {kept} token{'' if kept == 1 else 's'} kept", fontsize=9)
    axes[0, 0].invert_yaxis()  # shared: the most likely token on top in every panel
    for ax in axes.flat[len(settings) :]:
        ax.axis("off")
    for ax in axes[-1, :]:
        ax.set_xlabel("probability")
    fig.suptitle(title)
    return finish(fig)


def describe(kw: dict) -> str:
    if kw.get("temperature", 0) == 0:
        return "greedy"
    parts = [f"T={kw['temperature']:g}"]
    parts += [f"top-k={kw['top_k']}"] if kw.get("top_k") else []
    parts += [f"top-p={kw['top_p']:g}"] if kw.get("top_p") else []
    return ", ".join(parts)


def interactive_sampling(logits: torch.Tensor, labels: Sequence[str]):
    """Sliders for temperature, top-k and top-p over one distribution (needs ipywidgets and a
    live kernel; the rendered book shows the static small multiples instead)."""
    import ipywidgets as widgets

    def show(temperature: float, top_k: int, top_p: float):
        kw = {"temperature": temperature, "top_k": top_k or None, "top_p": top_p}
        fig = sampling_grid(logits, labels, [kw])
        plt.show(fig)

    return widgets.interact(
        show,
        temperature=widgets.FloatSlider(value=1.0, min=0.0, max=3.0, step=0.05),
        top_k=widgets.IntSlider(value=0, min=0, max=len(labels), description="top_k (0=off)"),
        top_p=widgets.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05),
    )
