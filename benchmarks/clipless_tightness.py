"""How tight are the clipless bounds? The tightness report of the zoo networks, before and
after a short private training.

    .venv/bin/python benchmarks/clipless_tightness.py [--epochs 10] [--out FILE]

For each network, :func:`lipdp.clipless.tightness.tightness_report` on the whole training
set at initialisation and after ``--epochs`` epochs of Clipless DP-SGD (Poisson batches,
``DP_Accountant``, :func:`lipdp.recipes.runs.fit`):

* ``pooled_cnn``: the CNN of ``lipdp train`` on digits before issue 29, built by the run
  recipe (:func:`lipdp.recipes.runs.build_model` with ``--no-scattering --gradient-clip
  none --learning-rate 0.02``: input bound 5, tau 8, b = 512, sigma = 6);
* ``pooled_cnn_clip``: the same CNN as ``lipdp train --no-scattering`` builds it since
  (logit gradients clipped at 0.3, Adam(0.01));
* ``scattering_net``: the network of ``lipdp train`` on digits since issue 29 (scattering
  features, group normalisation, a linear head; logit gradients clipped at 0.3, tau 2,
  Adam(0.01));
* ``strided_cnn``: notebook 01's network, widths (16, 64), logit gradient clipped at 0.3,
  tau 64, Adam(5e-3), on digits (the notebook runs it on Fashion-MNIST);
* ``resnet``: notebook 02's residual network, 3 "1-lip-add" blocks of width 16, tau 8,
  Adam(5e-3), on digits;
* ``tabular_mlp``: notebook 03's dense network, width 64, depth 2, bias balls of radius 1,
  tau 8, on breast cancer (input bound sqrt(30), b = 64, sigma = 2, Adam(0.01)).

Prints every report, then a Markdown table of ``max / B_v`` and ``mean / B_v`` per
variable before and after, and writes everything as JSON (default
``benchmarks/results/clipless_tightness.json``). About three minutes on 2 cores.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from common import machine_description  # noqa: E402

from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DP_Sequential  # noqa: E402
from lipdp.clipless.tightness import tightness_report  # noqa: E402
from lipdp.recipes import runs, zoo  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: name -> (run recipe options, builder options, tau, learning rate); builder options None:
#: the command line's own model for that recipe.
NETWORKS = {
    "pooled_cnn": (
        dict(scattering=False, gradient_clip=math.inf, learning_rate=0.02),
        None,
        None,
        None,
    ),
    "pooled_cnn_clip": (dict(scattering=False), None, None, None),
    "scattering_net": ({}, None, None, None),
    "strided_cnn": (dict(scattering=False), dict(widths=(16, 64), clip=0.3), 64.0, 5e-3),
    "resnet": (
        dict(scattering=False),
        dict(merge_policy="1-lip-add", blocks=3, width=16),
        8.0,
        5e-3,
    ),
    "tabular_mlp": (
        dict(dataset="breast_cancer"),
        dict(width=64, depth=2, bias=1.0),
        8.0,
        None,
    ),
}


def _dataset(name) -> str:
    return runs.ModelRecipe(**NETWORKS[name][0]).dataset


def build(name, data):
    """``(compiled model, x_train, y_train)`` of network ``name`` (module docstring)."""
    recipe_options, options, tau, rate = NETWORKS[name]
    recipe = runs.ModelRecipe(**recipe_options)
    metadata = runs.run_metadata(recipe, data)
    x, y = runs.training_arrays(metadata, data)
    if options is None:  # the command line's model, exactly
        return runs.build_model(recipe, metadata), x, y
    model = DP_Sequential(
        zoo.ZOO[name](metadata, **options),
        dp_parameters=runs.dp_parameters(recipe),
        dataset_metadata=metadata,
    )
    optimizer = runs.optimizer(recipe) if rate is None else keras.optimizers.Adam(rate)
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=tau),
        optimizer=optimizer,
        metrics=["accuracy"],
    )
    return model, x, y


def measure(name, epochs, data):
    runs.set_seed(0)
    model, x, y = build(name, data)
    start = time.perf_counter()
    before = tightness_report(model, x, y)
    report_seconds = time.perf_counter() - start
    run = runs.RunConfig(model=runs.ModelRecipe(**NETWORKS[name][0]), epochs=epochs)
    start = time.perf_counter()
    history = runs.fit(runs.PreparedRun(run, data, model, x, y, epochs))
    train_seconds = time.perf_counter() - start
    after = tightness_report(model, x, y)
    test = runs.metrics_on_test_set(model, data)
    for title, report in (("before training", before), (f"after {epochs} epochs", after)):
        print(f"\n=== {name}, {title} ===\n{report.format()}")
    return {
        "network": name,
        "dataset": _dataset(name),
        "parameters": int(model.count_params()),
        "examples": before.examples,
        "epochs": epochs,
        "epsilon": float(history.history["epsilon"][-1]),
        "test_accuracy": float(test["accuracy"]),
        "report_seconds": report_seconds,
        "train_seconds": train_seconds,
        "before": before.as_dict(),
        "after": after.as_dict(),
    }


def summary_table(results) -> str:
    """Markdown: ``max / B_v`` and ``mean / B_v`` of every variable, before and after."""
    lines = [
        "| network | variable | B_v | max/B before | mean/B before | max/B after | mean/B after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        before = [r for r in result["before"]["rows"] if r["quantity"] == "gradient"]
        after = [r for r in result["after"]["rows"] if r["quantity"] == "gradient"]
        for b, a in zip(before, after):
            lines.append(
                f"| {result['network']} | `{b['name']}` | {b['bound']:.3g} | "
                f"{b['max_ratio']:.3f} | {b['mean_ratio']:.3f} | "
                f"{a['max_ratio']:.3f} | {a['mean_ratio']:.3f} |"
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--out", type=Path, default=RESULTS / "clipless_tightness.json")
    args = parser.parse_args()
    data = {name: runs.load_data(name) for name in ("digits", "breast_cancer")}
    results = [measure(n, args.epochs, data[_dataset(n)]) for n in args.networks]
    print(f"\n{machine_description()}\n")
    print(summary_table(results))
    for r in results:
        print(
            f"{r['network']}: {r['parameters']} parameters, report on {r['examples']} examples "
            f"in {r['report_seconds']:.1f} s; {r['epochs']} epochs in {r['train_seconds']:.1f} s, "
            f"epsilon {r['epsilon']:.3f}, test accuracy {r['test_accuracy']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": machine_description(), "results": results}, indent=1)
    )
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
