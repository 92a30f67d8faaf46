"""Pictures of masks: the package's only matplotlib import (loaded when a picture is drawn).

:func:`plot_mask` backs :meth:`flashrange.RangeMask.plot`.
"""

from __future__ import annotations

import torch

__all__ = ["plot_mask", "mask_image", "PLOT_PIXELS"]

# A picture is at most this many pixels on a side; larger masks are averaged.
PLOT_PIXELS = 512


def mask_image(mask, Tq: int, Tk: int):
    """Float ``(rows, cols)`` image and whether it is exact.

    Exact cover counts when the mask is small; otherwise one sampled query
    row per pixel row and the covered fraction of each pixel column's keys.
    """
    if Tq * Tk <= PLOT_PIXELS * PLOT_PIXELS and max(Tq, Tk) <= 4 * PLOT_PIXELS:
        return mask.coverage(Tq, Tk).float().cpu(), True
    rows = min(Tq, PLOT_PIXELS)
    cols = min(Tk, PLOT_PIXELS)
    img = torch.zeros(rows, cols, dtype=torch.float64)
    sample = (torch.arange(rows, dtype=torch.float64) + 0.5) * Tq / rows
    sample = sample.long().clamp(max=max(Tq - 1, 0))
    edges = torch.round(torch.arange(cols + 1, dtype=torch.float64) * Tk / cols).long()
    width = (edges[1:] - edges[:-1]).clamp(min=1).double()
    qs, qe, ks, ke, alpha, beta = mask.row_spans()
    for s in range(qs.numel()):
        on = (sample >= qs[s]) & (sample < qe[s]) & (sample < Tq)
        if not bool(on.any()):
            continue
        i = sample[on]
        lo = torch.clamp(torch.maximum(ks[s], i + alpha[s]), 0, Tk)
        hi = torch.clamp(torch.minimum(ke[s], i + beta[s]), 0, Tk)
        hi = torch.maximum(hi, lo)
        # Keys of [lo, hi) below each edge: clamp(edge - lo, 0, hi - lo).
        below = torch.minimum((edges[None, :] - lo[:, None]).clamp(min=0), (hi - lo)[:, None])
        img[on] += (below[:, 1:] - below[:, :-1]).double() / width
    return img.float(), False


def plot_mask(mask, path, Tq: int, Tk: int, title=None, outline=True):
    """Write a PNG of ``mask`` (a :class:`flashrange.RangeMask`) over ``Tq x Tk`` to ``path``; return ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise ImportError("RangeMask.plot needs matplotlib: pip install matplotlib") from e
    img, exact = mask_image(mask, Tq, Tk)
    fig = Figure(figsize=(5, 5 * max(Tq, 1) / max(Tk, 1) if Tk else 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    vmax = max(1.0, float(img.max())) if img.numel() else 1.0
    ax.imshow(
        img.numpy(), cmap="Blues", vmin=0.0, vmax=vmax, interpolation="nearest",
        extent=(0, Tk, Tq, 0), aspect="auto",
    )
    if outline:
        qs, qe, ks, ke, _, _ = mask.row_spans()
        live = (qe > qs).nonzero().flatten().tolist()
        if len(live) <= 256:
            for s in live:
                ax.add_patch(Rectangle(
                    (int(ks[s]), int(qs[s])), int(ke[s] - ks[s]), int(qe[s] - qs[s]),
                    fill=False, edgecolor="tab:orange", linewidth=1.0,
                ))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    note = "" if exact else " (averaged)"
    stats = f"{mask.num_slices} slices, {mask.area()} cells, {Tq}x{Tk}{note}"
    ax.set_title(stats if title is None else f"{title}\n{stats}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path
