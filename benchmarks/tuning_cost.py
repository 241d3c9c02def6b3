"""The privacy cost of a private hyper-parameter search (Papernot & Steinke), in numbers.

    .venv/bin/python benchmarks/tuning_cost.py [--out benchmarks/data/tuning_cost.txt]

For the Fashion-MNIST training runs of ``fmnist_utility.py`` (N = 60 000, batch 2 000,
so q = 1/30 and 30 steps per epoch), two tables from lipdp's accountants:

1. the epsilon of a random search (``lipdp.accounting.tuning_cost.RandomSearch``: E[K] runs on
   average, geometric, logarithmic or truncated-negative-binomial law) whose runs each
   cost epsilon_run = 1 / 3 / 8 alone (the noise multiplier calibrated for the run);
2. the noise multiplier a run needs so that the *whole search* stays within epsilon = 1 /
   3 / 8, next to the one a single run needs: the price of honest tuning in noise.

Also the naive alternative: K runs composed (``K`` fixed, every run released), at the
same mean. Pure accounting: seconds; no data is read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lipdp.accounting import calibrate_noise_multiplier
from lipdp.accounting.plan import PrivacyPlan
from lipdp.accounting.tuning_cost import RandomSearch

N, BATCH, EPOCHS, DELTA = 60_000, 2_000, 15, 1e-5
EPSILONS = (1.0, 3.0, 8.0)
MEANS = (5.0, 10.0, 20.0)
SHAPES = {"logarithmic (eta 0)": 0.0, "TNB eta 0.5": 0.5, "geometric (eta 1)": 1.0}


def plan(sigma, search=None, runs=1):
    """The plan of ``EPOCHS`` epochs at ``sigma`` (``runs`` fixed runs composed)."""
    base = PrivacyPlan.for_training(
        noise_multipliers=sigma,
        sampling_rate=BATCH / N,
        steps_per_epoch=N // BATCH,
        delta=DELTA,
        search=search,
    )
    return base, EPOCHS * runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "data" / "tuning_cost.txt"
    )
    args = parser.parse_args()
    start = time.time()
    lines = [
        f"Fashion-MNIST runs: N = {N}, batch {BATCH} (q = {BATCH / N:.4f}), {EPOCHS} epochs "
        f"({EPOCHS * (N // BATCH)} steps), delta = {DELTA:g}; RDP accountant.",
        "",
        "1. epsilon of the whole search when one run costs epsilon_run:",
        "",
        "| epsilon_run (sigma) | law | "
        + " | ".join(f"E[K] = {m:g}" for m in MEANS)
        + " | "
        + " | ".join(f"{m:g} runs composed" for m in MEANS)
        + " |",
        "| --- | --- | " + " | ".join("---" for _ in range(2 * len(MEANS))) + " |",
    ]
    for eps in EPSILONS:
        sigma = calibrate_noise_multiplier(eps, EPOCHS, BATCH, N, DELTA)
        alone, _ = plan(sigma)
        composed = [alone.epsilon(int(EPOCHS * m)) for m in MEANS]
        for law, shape in SHAPES.items():
            searched = [plan(sigma, RandomSearch(m, shape))[0].epsilon(EPOCHS) for m in MEANS]
            lines.append(
                f"| {alone.epsilon(EPOCHS):.3f} ({sigma:.3f}) | {law} | "
                + " | ".join(f"{e:.2f}" for e in searched)
                + " | "
                + " | ".join(f"{e:.2f}" for e in composed)
                + " |"
            )
    lines += [
        "",
        "2. noise multiplier for a budget: one run vs the whole search (geometric law):",
        "",
        "| budget epsilon | one run | " + " | ".join(f"search E[K] = {m:g}" for m in MEANS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in MEANS) + " |",
    ]
    for eps in EPSILONS:
        one = calibrate_noise_multiplier(eps, EPOCHS, BATCH, N, DELTA)
        searched = [
            calibrate_noise_multiplier(eps, EPOCHS, BATCH, N, DELTA, search=RandomSearch(m))
            for m in MEANS
        ]
        lines.append(
            f"| {eps:g} | {one:.3f} | "
            + " | ".join(f"{s:.3f} (x{s / one:.2f})" for s in searched)
            + " |"
        )
    lines += ["", f"Computed in {time.time() - start:.1f} s."]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
