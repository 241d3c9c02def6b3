"""Regenerate the figures of the documentation (committed next to this script).

    .venv/bin/python docs/figures/make_figures.py

* ``bound_propagation.svg`` -- the two passes of bounds of Clipless DP-SGD on a
  small convolutional network (a diagram; no computation);
* ``epsilon_vs_epochs.svg`` -- epsilon after each epoch for three noise
  multipliers, computed with lipdp's RDP accountant in the configuration of the
  original package's MNIST tutorial (N = 60 000, batch 1 000, delta = 1e-5).

The output is deterministic (fixed SVG ids, no date), so re-running the script
changes the files only if the figures change.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent
SVG_METADATA = {"Date": None, "Creator": "docs/figures/make_figures.py"}

plt.rcParams.update(
    {
        "svg.hashsalt": "lipdp-docs",
        "svg.fonttype": "path",  # glyphs as paths: renders identically everywhere, offline
        "font.size": 10,
    }
)

BLUE = "#3f51b5"
ORANGE = "#e65100"
GREEN = "#2e7d32"
GREY = "#546e7a"


def _box(ax, x, y, w, h, title, subtitle, params=False):
    face = "#e8eaf6" if params else "#f5f5f5"
    edge = BLUE if params else GREY
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2, y - h / 2),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=face,
            edgecolor=edge,
            linewidth=1.4,
        )
    )
    ax.text(x, y + 0.14, title, ha="center", va="center", fontsize=8.6, weight="bold")
    ax.text(x, y - 0.3, subtitle, ha="center", va="center", fontsize=9, color="#333333")


def _arrow(ax, x0, y0, x1, y1, color, lw=1.5):
    ax.add_patch(
        FancyArrowPatch(
            (x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=11, color=color, linewidth=lw
        )
    )


def bound_propagation(path: Path) -> None:
    # (title, subtitle, has parameters, forward bound after it, backward bound before it)
    layers = [
        ("DP_Bounded-\nInput", r"clip $\|x\| \leq B$", False, r"$X_0 = B$", None),
        ("DP_Spectral-\nConv2D", r"$\theta_1$", True, r"$X_1 = X_0$", r"$G$"),
        ("DP_Group-\nSort", "GNP", False, r"$X_2 = X_1$", r"$G$"),
        ("L2-norm pool,\nflatten", "GNP", False, r"$X_3 = X_2$", r"$G$"),
        ("DP_Spectral-\nDense", r"$\theta_2$", True, r"$X_4 = X_3$", r"$G$"),
        ("loss", r"$L$ = get_L()", False, None, r"$G = L$"),
    ]
    fig, ax = plt.subplots(figsize=(8.8, 3.5))
    step, w, h = 1.5, 1.3, 1.0
    xs = [0.69 + step * i for i in range(len(layers))]
    ax.set_xlim(0.0, xs[-1] + 0.69)
    ax.set_ylim(-2.05, 1.62)
    ax.axis("off")

    ax.text(
        0.04,
        1.42,
        r"forward:  $X_d$ = propagate_inputs($X_{d-1}$), bound on $\|$output of layer $d\|$",
        fontsize=9.5,
        color=BLUE,
    )
    for i, (title, subtitle, params, _, _) in enumerate(layers):
        _box(ax, xs[i], 0.0, w, h, title, subtitle, params)
    for i in range(len(layers) - 1):
        left, right, mid = xs[i] + w / 2, xs[i + 1] - w / 2, (xs[i] + xs[i + 1]) / 2
        _arrow(ax, left, 0.2, right, 0.2, BLUE)
        _arrow(ax, right, -0.2, left, -0.2, ORANGE)
        ax.text(mid, 0.84, layers[i][3], ha="center", fontsize=9.5, color=BLUE)
        _arrow(ax, mid - 0.3, 0.72, mid + 0.3, 0.72, BLUE)
        ax.text(mid, -0.98, layers[i + 1][4], ha="center", fontsize=9.5, color=ORANGE)
        _arrow(ax, mid + 0.3, -0.69, mid - 0.3, -0.69, ORANGE)
    for i, label in ((1, r"$\Delta_1$"), (4, r"$\Delta_2$")):
        _arrow(ax, xs[i], -h / 2 - 0.02, xs[i], -0.82, GREEN, lw=1.3)
        ax.text(xs[i], -1.07, label, ha="center", fontsize=10.5, color=GREEN)
    ax.text(
        0.04,
        -1.5,
        r"backward:  $G$ $\leftarrow$ backpropagate_inputs($X$, $G$), bound on one example's "
        r"$\|\partial \ell / \partial$input$\|$",
        fontsize=9.5,
        color=ORANGE,
    )
    ax.text(
        0.04,
        -1.9,
        r"sensitivity:  $\Delta_d$ = backpropagate_params($X_{d-1}$, $G$)$\,(1 + 10^{-5})\,/\,b$;"
        r"  here $\Delta_1 = \Delta_2 = B L\,(1 + 10^{-5}) / b$",
        fontsize=9.5,
        color=GREEN,
    )
    fig.savefig(path, format="svg", bbox_inches="tight", metadata=SVG_METADATA)
    plt.close(fig)


def epsilon_vs_epochs(path: Path) -> None:
    from lipdp.accounting import PrivacyPlan

    n, batch, delta = 60_000, 1_000, 1e-5
    steps_per_epoch = n // batch
    epochs = list(range(1, 201))
    fig, ax = plt.subplots(figsize=(6.4, 3.9))
    for sigma, color in ((1.0, ORANGE), (2.0, BLUE), (4.0, GREEN)):
        plan = PrivacyPlan.for_training(
            noise_multipliers=sigma,
            sampling_rate=batch / n,
            steps_per_epoch=steps_per_epoch,
            delta=delta,
        )
        eps = [plan.epsilon(e) for e in epochs]
        ax.plot(epochs, eps, color=color, label=rf"$\sigma$ = {sigma:g}")
    budget_epochs = 91  # get_max_epochs(3.0, ...) for sigma = 2 (tests/accounting/test_plan.py)
    ax.axhline(3.0, color=GREY, linestyle="--", linewidth=1)
    ax.axvline(budget_epochs, color=GREY, linestyle=":", linewidth=1)
    ax.annotate(
        r"$\sigma = 2$: at most 91 epochs within $\varepsilon = 3$",
        xy=(budget_epochs, 3.0),
        xytext=(98, 0.35),
        fontsize=8.5,
        arrowprops={"arrowstyle": "->", "color": GREY},
    )
    ax.set_xlabel("epochs (60 steps each)")
    ax.set_ylabel(r"$\varepsilon$  ($\delta = 10^{-5}$)")
    ax.set_title(r"RDP accountant, $N$ = 60 000, batch 1 000 ($q$ = 1/60)", fontsize=10)
    ax.set_ylim(0, 8)
    ax.set_xlim(0, 200)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata=SVG_METADATA)
    plt.close(fig)


def main() -> None:
    bound_propagation(HERE / "bound_propagation.svg")
    epsilon_vs_epochs(HERE / "epsilon_vs_epochs.svg")
    for name in ("bound_propagation.svg", "epsilon_vs_epochs.svg"):
        print(HERE / name)


if __name__ == "__main__":
    main()
