"""Chapter 1's sampling figure: what each panel draws matches what the setting samples from."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from minillm.core.sampling import SamplingParams, probabilities  # noqa: E402
from minillm.viz.sampling import sampling_grid  # noqa: E402

LOGITS = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, 0.0])
LABELS = [f"t{i}" for i in range(6)]
SETTINGS = [
    {"temperature": 0},
    {"temperature": 1.0},
    {"temperature": 1.0, "top_k": 2},
    {"temperature": 1.0, "top_p": 0.5},
]


def test_filled_bars_are_the_sampled_distribution_and_hollow_bars_the_removed_tokens():
    fig = sampling_grid(LOGITS, LABELS, SETTINGS, title="t")
    for i, (ax, kw) in enumerate(zip(fig.axes, SETTINGS)):
        probs = probabilities(LOGITS, SamplingParams(**kw))
        hollow, filled = ax.containers  # two barh calls per panel
        assert [round(b.get_width(), 6) for b in filled] == [round(float(p), 6) for p in probs]
        removed = [i for i, b in enumerate(hollow) if b.get_width() > 0]
        assert removed == [i for i, p in enumerate(probs) if p == 0]
        kept = int((probs > 0).sum())
        assert ax.get_title().endswith(f"{kept} token{'' if kept == 1 else 's'} kept")
        if i % 3 == 0:  # the rows share their token axis: its labels show in the first column
            assert [t.get_text() for t in ax.get_yticklabels()] == LABELS
        assert all(t.get_rotation() == 0 for t in ax.get_yticklabels())
    assert fig.axes[0].get_title() == "greedy: 1 token kept"
    plt.close(fig)
