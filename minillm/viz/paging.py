"""Chapter 6's drawing: block tables pointing into the pool of a paged KV cache (PagedAttention,
Kwon et al., 2023), shared blocks outlined with their reference counts."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import ConnectionPatch, Rectangle

from ..core.config import ceil_div
from ..kv.paged import BlockManager
from .style import WIDTH_IN, finish


def plot_block_tables(
    manager: BlockManager, lengths: dict[int, int], names: dict[int, str] | None = None, title: str = ""
):
    """Each sequence's logical blocks (left) pointing through its block table to physical blocks
    of the pool (right). A block's shading shows how full it is; a block shared by several
    sequences (prefix cache, fork) is outlined, with its reference count."""
    names = names or {s: f"sequence {s}" for s in lengths}
    bs, n = manager.block_size, manager.allocator.num_blocks
    refs = manager.allocator.ref_counts
    seqs = list(lengths)
    width = max(len(manager.table(s)) for s in seqs)
    cols = 8
    size = (WIDTH_IN, 1.3 + 0.6 * max(len(seqs), ceil_div(n, cols)))
    fig, (left, right) = plt.subplots(1, 2, figsize=size, gridspec_kw={"width_ratios": [width + 4.2, cols]})
    fill: dict[int, int] = {}
    colors = {s: f"C{i}" for i, s in enumerate(seqs)}
    owner: dict[int, int] = {}
    for row, s in enumerate(seqs):
        y = len(seqs) - 1 - row
        left.text(-0.2, y + 0.4, names[s], ha="right", va="center", fontsize=8)
        for j, block in enumerate(manager.table(s)):
            used = min(bs, max(0, lengths[s] - j * bs))
            fill[block] = max(fill.get(block, 0), used)
            owner.setdefault(block, s)
            left.add_patch(Rectangle((j, y), 0.9, 0.8, facecolor=colors[s], alpha=0.25 + 0.75 * used / bs))
            left.text(j + 0.45, y + 0.4, f"{j}", ha="center", va="center", fontsize=8)
            r, c = divmod(block, cols)
            arrow = {"color": colors[s], "alpha": 0.5, "lw": 0.8, "arrowstyle": "->"}
            con = ConnectionPatch((j + 0.9, y + 0.4), (c, -r + 0.4), "data", "data", axesA=left, axesB=right, **arrow)
            fig.add_artist(con)
    for block in range(n):
        r, c = divmod(block, cols)
        used = fill.get(block, 0)
        shared = refs[block] > 1
        face = colors[owner[block]] if block in owner else "white"
        alpha = 0.25 + 0.75 * used / bs if used else 1
        edge = {"edgecolor": "black", "lw": 2} if shared else {"edgecolor": "lightgray", "lw": 0.8}
        right.add_patch(Rectangle((c, -r), 0.9, 0.8, facecolor=face, alpha=alpha, **edge))
        label = f"{block}" + (f"\nref {refs[block]}" if shared else "")
        right.text(c + 0.45, -r + 0.4, label, ha="center", va="center", fontsize=7)
    left.set(xlim=(-4.2, width), ylim=(-0.3, len(seqs)))
    left.set_title("block tables\n(logical blocks, in order)", fontsize=10)
    rows = ceil_div(n, cols)
    right.set(
        xlim=(-0.1, cols),
        ylim=(-rows + 0.7, 0.9),
    )
    right.set_title(f"physical pool: {n} blocks of {bs} tokens\n(shade: how full; outlined: shared)", fontsize=10)
    for ax in (left, right):
        ax.axis("off")
    fig.suptitle(title)
    return finish(fig)
