"""Large logical batches in bounded memory (issue 39): peak memory and CPU per logical step.

    .venv/bin/python benchmarks/large_batches.py [--logical 1024 4096 8192]
        [--physical 256 1024] [--extra 8192:512] [--whole 1024] [--rounds 2] [--steps 3]
        [--warmup 1] [--contenders ...] [--cap 900] [--json out.json]
    .venv/bin/python benchmarks/large_batches.py --from-json out.json

Results and their reading: benchmarks/README.md, section "Large logical batches".

**What is measured.** A *logical* batch of ``b`` rows (one noisy update, one step of the
accountant) computed ``P`` rows at a time (the *physical* batch): per-example clipped (or,
Clipless, bounded) gradients summed over the ``b / P`` physical batches, noised once, one
optimizer step. For every cell ``(b, P)`` of the grid (``P < b``) and every contender, one
worker of ``benchmarks/cross_library_speed.py`` (its machinery, its network: the
unconstrained CNN of 50 080 parameters, 28x28x1 inputs, 10 classes; the Clipless rows
train the Lipschitz CNN of the same shapes) runs ``warmup + steps`` logical steps and
reports its peak resident memory (``VmHWM``), the same just before the model is built
(imports and data), and the median CPU time (all threads of the process) and wall time
of its timed logical steps:

* ``lipdp-clipped-tf`` / ``lipdp-clipped-jax``: ``lipdp.make_private(..., method=
  "clipped", physical_batch_size=P)`` on TensorFlow (ghost norms) / on JAX;
* ``lipdp-clipless-tf`` / ``lipdp-clipless-jax``: ``DP_Sequential(...,
  physical_batch_size=P)`` (global noise) on TensorFlow / on JAX;
* ``opacus-ghost`` / ``opacus-hooks``: Opacus' ``make_private`` (fixed batches of ``b``)
  and its ``BatchMemoryManager(max_physical_batch_size=P)``: the optimizer clips and sums
  each physical batch and steps (noise) after the last one;
* ``jax-privacy``: jax-privacy's Keras API with ``batch_size=P`` and
  ``gradient_accumulation_steps=b / P``: ``fit`` runs batches of ``P``, one noisy update
  every ``b / P`` of them;
* the floors ``keras-tf`` / ``keras-jax`` / ``torch``: the plain framework on batches of
  ``P`` (one update per ``P`` rows), on the same data set of ``b`` rows. A floor's CPU per
  logical step is its CPU per batch of ``P`` times ``b / P`` (the same examples, through
  the same network, without privacy).

Every worker trains on a synthetic data set of exactly ``b`` rows (one logical batch), for
as many whole epochs as its steps need, so that the data held (``b`` rows, 25 MB at
``b = 8192``) is the same for every contender of a cell and small next to the step's
memory. Fixed batches everywhere (lipdp ``sampling="shuffle"``, Opacus
``poisson_sampling=False``, jax-privacy's default): the logical batch is exactly ``b``.
Clip norm 1, noise multiplier 1, flat clipping, SGD(0.01).

**The protocol.** One subprocess per (cell, contender, round), 1 intra-op and 1 inter-op
thread each (``cross_library_speed._environment``). A round runs every cell in turn, and
within a cell every contender, in an order rotated by one every round. A memory ratio is
the median over rounds of the per-round ratio of the *increments* (peak minus the peak
before the model), contender over floor of the same cell; a CPU ratio likewise, the
floor's CPU scaled by ``b / P``.

``--extra 8192:512`` adds the cell of the issue's target (peak memory of the clipped step at
``b = 8192, P = 512`` within 1.3x that of plain Keras at ``b = 512``) with the contenders
of ``--extra-contenders``; ``--whole 1024`` adds, at ``b = 1024``, lipdp's whole-batch step
(``physical_batch_size=None``, the step before issue 39) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cross_library_speed as cls  # noqa: E402  (the worker machinery)

PRIVATE = [
    "lipdp-clipped-tf",
    "lipdp-clipless-tf",
    "lipdp-clipped-jax",
    "lipdp-clipless-jax",
    "opacus-ghost",
    "jax-privacy",
]
FLOORS = ["keras-tf", "keras-jax", "torch"]
DEFAULT_CONTENDERS = ["keras-tf", *PRIVATE[:4], "keras-jax", "jax-privacy", "torch", "opacus-ghost"]
EXTRA_CONTENDERS = [
    "keras-tf",
    "lipdp-clipped-tf",
    "lipdp-clipped-tf/no-probe",
    "lipdp-clipless-tf",
    "lipdp-clipless-tf/no-probe",
]
WHOLE_CONTENDERS = ["lipdp-clipped-tf", "lipdp-clipless-tf"]
TARGET = (8192, 512, "lipdp-clipped-tf", "keras-tf", 1.3)  # the must-show ratio


def _cells(args):
    """[(b, P, contenders)]: the grid, the extra cells, then the whole-batch ones (P=None)."""
    cells = [(b, p, args.contenders) for b in args.logical for p in args.physical if p < b]
    for text in args.extra:
        b, p = map(int, text.split(":"))
        cells.append((b, p, args.extra_contenders))
    cells += [(b, None, WHOLE_CONTENDERS) for b in args.whole]
    return cells


def _base(name):
    """``"lipdp-clipped-tf/no-probe"`` -> ``"lipdp-clipped-tf"`` (the worker's contender)."""
    return name.split("/")[0]


def _job_args(b, p, name, args):
    """The worker's settings: a floor runs batches of ``P``; a private contender logical
    batches of ``b`` computed ``P`` rows at a time; both on ``b`` rows of data. A name
    ending in ``/no-probe``: lipdp with ``independence_probe=False``."""
    floor = name in FLOORS
    return argparse.Namespace(
        batch_size=p if floor else b,
        physical_batch_size=None if floor else p,
        rows=b,
        steps=args.steps,
        warmup=args.warmup,
        cap=args.cap,
        no_probe=name.endswith("/no-probe"),
    )


def _measure(saved, args, pythons):
    started = time.perf_counter()
    for rnd in range(args.rounds):
        for b, p, names in _cells(args):
            runnable = [n for n in names if _base(n) not in saved["skipped"]]
            k = rnd % max(len(runnable), 1)
            for name in runnable[k:] + runnable[:k]:
                contender = cls.BY_NAME[_base(name)]
                r = cls.run_worker(
                    pythons[contender.python], contender, _job_args(b, p, name, args)
                )
                r.update(round=rnd, contender=name, logical=b, physical=p)
                saved["results"].append(r)
                status = r.get("failure") or (
                    f"{r['cpu_s']:.2f} s CPU / step, {r['peak_rss_mb']:.0f} MB "
                    f"(+{r['peak_rss_mb'] - r['rss_before_model_mb']:.0f})"
                )
                print(
                    f"[{time.perf_counter() - started:5.0f} s] round {rnd} b={b} P={p} {name}: "
                    f"{status} ({r['wall_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                cls._dump(saved, args)
    saved["total_wall_s"] = time.perf_counter() - started


# --------------------------------------------------------------------------- tables
def _by_round(results, b, p):
    """{round: {contender: result}} of the cell's successful measurements."""
    rounds = {}
    for r in results:
        if "cpu_s" in r and r["logical"] == b and r["physical"] == p:
            rounds.setdefault(r["round"], {})[r["contender"]] = r
    return rounds


def _increment(r):
    return r["peak_rss_mb"] - r["rss_before_model_mb"]


def _logical_cpu(r, b, p):
    """CPU seconds per logical step; a floor's batch of ``P`` rows scaled by ``b / P``."""
    return r["cpu_s"] * (b / p if r["contender"] in FLOORS else 1)


def _logical_wall(r, b, p):
    return r["step_s"] * (b / p if r["contender"] in FLOORS else 1)


def _median(values, fmt):
    values = list(values)
    return fmt.format(statistics.median(values)) if values else "-"


def _ratio(rounds, num, den, value):
    ratios = [value(m[num]) / value(m[den]) for m in rounds.values() if num in m and den in m]
    return statistics.median(ratios) if ratios else None


def _ratio_text(ratio):
    return "-" if ratio is None else f"{ratio:.2f}x"


def cell_rows(saved, b, p, names):
    """Table rows of one cell."""
    rounds = _by_round(saved["results"], b, p)
    rows = []
    for name in names:
        mine = [m[name] for m in rounds.values() if name in m]
        if not mine:
            continue
        backend = cls.BY_NAME[_base(name)].backend
        floor = cls.FLOOR[backend]
        cells = [
            str(b),
            "-" if p is None else str(p),
            name + (f" (b = {p})" if name in FLOORS else ""),
            _median((_logical_cpu(r, b, p or b) for r in mine), "{:.2f}"),
            _median((_logical_wall(r, b, p or b) for r in mine), "{:.2f}"),
            _median((r["peak_rss_mb"] for r in mine), "{:.0f}"),
            _median((_increment(r) for r in mine), "{:.0f}"),
            _ratio_text(None if name == floor else _ratio(rounds, name, floor, _increment)),
            _ratio_text(_ratio(rounds, name, "keras-tf", _increment)),
            _ratio_text(
                None
                if name == floor
                else _ratio(rounds, name, floor, lambda r: _logical_cpu(r, b, p or b))
            ),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def table(saved):
    s = saved["settings"]
    lines = [
        "\n#### CNN (50 080 parameters): logical batch b computed P rows at a time; "
        f"median over {s['rounds']} round(s) of the per-worker medians over "
        f"{s['steps']} timed logical steps\n",
        "| b | P | contender | CPU s / logical step | wall s / logical step | peak RSS MB "
        "| above imports + data MB | memory vs floor (same backend, b = P) "
        "| memory vs keras-tf (b = P) | CPU vs floor x b/P |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    cells = []
    for r in saved["results"]:
        key = (r["logical"], r["physical"])
        if key not in cells:
            cells.append(key)
    order = [c.name for c in cls.CONTENDERS]
    for b, p in cells:
        names = {
            r["contender"] for r in saved["results"] if (r["logical"], r["physical"]) == (b, p)
        }
        names = sorted(names, key=lambda n: (order.index(_base(n)), n))
        lines += cell_rows(saved, b, p, names)
    lines += _target(saved)
    lines += cls._notes(
        {"skipped": saved["skipped"], "results": [_named(r) for r in saved["results"]]}
    )
    return "\n".join(lines)


def _named(r):
    """A result whose ``round`` names its cell too, for ``cross_library_speed._notes``."""
    return {**r, "round": f"{r['round']} (b = {r['logical']}, P = {r['physical']})"}


def _target(saved):
    b, p, num, den, bound = TARGET
    lines = []
    for name in (num, num + "/no-probe"):
        lines += _target_line(saved, b, p, name, den, bound)
    return lines


def _target_line(saved, b, p, num, den, bound):
    rounds = _by_round(saved["results"], b, p)
    increment = _ratio(rounds, num, den, _increment)
    if increment is None:
        return []
    total = _ratio(rounds, num, den, lambda r: r["peak_rss_mb"])
    per_round = [
        f"{_increment(m[num]) / _increment(m[den]):.2f}"
        for m in rounds.values()
        if num in m and den in m
    ]
    verdict = "met" if increment <= bound else "not met"
    return [
        f"\nIssue 39's target: peak memory of {num} at b = {b}, P = {p} over {den} at b = {p}: "
        f"**{increment:.2f}x** above imports and data (per round: {', '.join(per_round)}), "
        f"{total:.2f}x in total resident memory; bound {bound}x: **{verdict}** (on the "
        "increments)."
    ]


def header(saved):
    s = saved["settings"]
    lines = [f"Machine: {saved['machine']}.", f"Date: {saved['date']}."]
    lines.append(f"Command: {saved['command']}")
    for kind, info in saved["pythons"].items():
        versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        lines.append(f"{kind} interpreter ({info['python']}): {versions or 'missing'}.")
    lines.append(f"lipdp: commit {saved['lipdp_commit']}.")
    cells = []
    for r in saved["results"]:
        if (r["logical"], r["physical"]) not in cells:
            cells.append((r["logical"], r["physical"]))
    rounds = len({r["round"] for r in saved["results"]})
    lines.append(
        f"Settings: cells (b, P) measured {cells}; {rounds} of {s['rounds']} round(s) "
        f"measured, {s['warmup']} warm-up + "
        f"{s['steps']} timed logical steps per worker, 1 thread per worker, data of b rows, "
        f"cap {s['cap']:g} s."
    )
    if "total_wall_s" in saved:
        lines.append(f"Total wall time: {saved['total_wall_s']:.0f} s.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logical", type=int, nargs="*", default=[1024, 4096, 8192])
    parser.add_argument("--physical", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--extra", nargs="*", default=["8192:512"], help="more cells b:P")
    parser.add_argument("--extra-contenders", nargs="+", default=EXTRA_CONTENDERS)
    parser.add_argument(
        "--whole", type=int, nargs="*", default=[], help="b's of lipdp's whole-batch step"
    )
    parser.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed logical steps per worker")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first logical steps")
    parser.add_argument("--cap", type=float, default=900.0, help="seconds per worker")
    parser.add_argument("--keras3-python", default=str(cls.ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--torch-python", default=str(cls.ROOT / ".venv-torch" / "bin" / "python"))
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--from-json", default=None, help="reprint the table of a saved run")
    return parser.parse_args()


def main():
    args = _parse()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(header(saved))
        print(table(saved))
        return
    pythons = {"keras3": args.keras3_python, "torch": args.torch_python}
    names = sorted({_base(n) for _, _, ns in _cells(args) for n in ns})
    start_args = argparse.Namespace(
        contenders=names,
        batch_size=None,
        physical_batch_size=None,
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        cap=args.cap,
    )
    saved = cls._start(start_args, pythons)
    python = os.path.relpath(sys.executable, cls.ROOT)
    saved["command"] = " ".join([python, os.path.relpath(__file__, cls.ROOT), *sys.argv[1:]])
    saved["settings"] = {
        "logical": args.logical,
        "physical": args.physical,
        "extra": args.extra,
        "extra_contenders": args.extra_contenders,
        "whole": args.whole,
        "contenders": args.contenders,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "cap": args.cap,
        "threads": 1,
        "cpu_count": os.cpu_count(),
    }
    print(header(saved), flush=True)
    for name, why in saved["skipped"].items():
        print(f"{name}: not available ({why})", flush=True)
    _measure(saved, args, pythons)
    cls._dump(saved, args)
    print(header(saved))
    print(table(saved))


if __name__ == "__main__":
    main()
