"""Chapter 1's pictures of sampling: how temperature, top-k and top-p reshape one distribution."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch

from ..core.config import ceil_div
from ..core.sampling import SamplingParams, probabilities


def sampling_grid(logits: torch.Tensor, labels: Sequence[str], settings: Sequence[dict], title: str = ""):
    """Small multiples: the next-token distribution under each sampling setting.

    ``settings`` are SamplingParams keyword dicts, e.g. ``{"temperature": 0.5, "top_p": 0.9}``."""

    cols = min(3, len(settings))
    rows = ceil_div(len(settings), cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.6 * rows), sharey=True, squeeze=False)
    for ax, kw in zip(axes.flat, settings):
        probs = probabilities(logits.float(), SamplingParams(**kw))
        kept = probs > 0
        ax.bar(range(len(labels)), probs, color=["tab:blue" if k else "lightgray" for k in kept])
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        ax.set_title(describe(kw) + f" ({int(kept.sum())} tokens kept)", fontsize=9)
    for ax in axes.flat[len(settings) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("probability")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


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
