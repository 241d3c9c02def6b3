"""Step time on the Keras 3 stack against the Keras 2 stack, measured side by side.

    .venv/bin/python benchmarks/keras_stacks_speed.py [--batches 256 1024] [--rounds 5]
        [--repeats 7] [--threads 1] [--cap 150] [--json out.json]
        [--keras3-python .venv/bin/python] [--keras2-python .venv-keras2/bin/python]
    .venv/bin/python benchmarks/keras_stacks_speed.py --from-json out.json

Results and their reading: benchmarks/README.md, section "Keras 3 against Keras 2".

Three contenders of ``step_speed.py`` on its ``cnn`` network (50 080 parameters): ``keras``
(the unconstrained CNN, plain Keras training), ``lipdp-global`` (Clipless DP-SGD, the
Lipschitz CNN, sigma = 1) and ``dpsgd-ghost`` (lipdp's clipped DP-SGD,
``DPSGD_Sequential`` with ghost norms, on the unconstrained CNN), each on two stacks:

* Keras 3: ``.venv`` (TensorFlow 2.21, keras 3);
* Keras 2: ``.venv-keras2`` (TensorFlow 2.15, keras 2.15, tensorflow-privacy 0.9.0).

One measurement is one subprocess: ``step_speed.py --worker cnn CONTENDER BATCH`` run with
the stack's own python (same script, same network, same synthetic data; see its docstring:
3 warm-up steps, then ``--repeats`` repeats of K steps, median wall and CPU seconds per
step). Every round runs each (stack, contender) once, in an order rotated by one every
round (the stacks alternate in the order, so that the two runs of a contender are
neighbours in time); the load of the shared machine thus hits all alike, and a ratio is the
median over rounds of the per-round ratio (two measurements of the same round).
CPU time (``time.process_time`` of the worker, all threads) does not count the time spent
waiting for a core, so on a loaded machine it is the stabler measure; both are reported.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_SPEED = Path(__file__).resolve().parent / "step_speed.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_speed  # noqa: E402

ARCH = "cnn"
CONTENDERS = ["keras", "lipdp-global", "dpsgd-ghost"]
STACKS = ["keras3", "keras2"]
STACK_LABEL = {"keras3": "Keras 3", "keras2": "Keras 2"}
PACKAGES = ["tensorflow", "keras", "tf-keras", "numpy", "deel-lip", "tensorflow-privacy"]

_VERSIONS_SNIPPET = f"""
import importlib.metadata as m, json, platform
out = {{"python": platform.python_version()}}
for name in {PACKAGES!r}:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def stack_versions(python):
    """Package versions of a stack, read from its metadata (nothing imported)."""
    out = subprocess.run(
        [python, "-c", _VERSIONS_SNIPPET], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def lipdp_state():
    """Commit of the repository and a digest of lipdp's sources (other people edit them:
    the digest at the start and at the end of the run tell whether they changed)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "lipdp"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split("\n")
    return {
        "commit": commit,
        "uncommitted_lipdp_files": len([line for line in dirty if line.strip()]),
        "sources_sha256": sources_digest(),
    }


def sources_digest():
    """Digest of lipdp's ``.py`` files (paths and contents), 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "lipdp").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_worker(python, contender, batch, args):
    """One measurement in its own process; killed (and reported as such) after --cap s."""
    cmd = [python, str(STEP_SPEED), "--worker", ARCH, contender, str(batch)]
    cmd += ["--repeats", str(args.repeats), "--cap", str(args.cap), "--threads", str(args.threads)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        out, err = proc.communicate(timeout=args.cap)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"failure": f"time > {args.cap:g} s", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        result = json.loads(lines[-1][len("RESULT ") :])
        result["wall_s"] = wall
        return result
    tail = [line for line in err.strip().splitlines() if line.strip()][-3:]
    return {
        "failure": "error: " + (" | ".join(tail)[:400] if tail else f"exit {proc.returncode}"),
        "wall_s": wall,
    }


# --------------------------------------------------------------------------- tables
def _ms(seconds):
    return step_speed._ms(seconds)


def _ratio_cell(ratios):
    """Median of per-round ratios, with their range over rounds."""
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}–{max(ratios):.2f})"


def _by_round(results, batch):
    """{round: {(stack, contender): result}} of the successful measurements."""
    rounds = {}
    for r in results:
        if r["batch"] == batch and "step_s" in r:
            rounds.setdefault(r["round"], {})[(r["stack"], r["contender"])] = r
    return rounds


def _per_round_ratios(rounds, num, den, field):
    return [m[num][field] / m[den][field] for m in rounds.values() if num in m and den in m]


def tables(results, batches):
    lines = []
    for batch in batches:
        rounds = _by_round(results, batch)
        n_rounds = len({r["round"] for r in results if r["batch"] == batch})
        lines.append(
            f"\n#### {ARCH}, b = {batch}: median ms per step over {n_rounds} "
            f"round{'s' * (n_rounds != 1)} "
            "(Keras 3 / Keras 2: median of per-round ratios, range over rounds)\n"
        )
        lines.append(
            "| contender | Keras 2 CPU | Keras 3 CPU | Keras 3 / Keras 2, CPU "
            "| Keras 2 wall | Keras 3 wall | Keras 3 / Keras 2, wall |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for c in CONTENDERS:
            cells = [c]
            for field in ("cpu_s", "step_s"):
                for stack in ("keras2", "keras3"):
                    values = [m[(stack, c)][field] for m in rounds.values() if (stack, c) in m]
                    cells.append(_ms(statistics.median(values)) if values else "-")
                cells.append(
                    _ratio_cell(_per_round_ratios(rounds, ("keras3", c), ("keras2", c), field))
                )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(
            f"\n#### {ARCH}, b = {batch}: within each stack, ratio to `keras` "
            "(median of per-round ratios, range over rounds)\n"
        )
        lines.append("| ratio | Keras 2, CPU | Keras 3, CPU | Keras 2, wall | Keras 3, wall |")
        lines.append("| --- | --- | --- | --- | --- |")
        for c in CONTENDERS[1:]:
            cells = [f"{c} / keras"]
            for field in ("cpu_s", "step_s"):
                for stack in ("keras2", "keras3"):
                    cells.append(
                        _ratio_cell(_per_round_ratios(rounds, (stack, c), (stack, "keras"), field))
                    )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append(
            f"\n#### {ARCH}, b = {batch}: first step (trace, and XLA compilation of "
            "lipdp's GroupSort), s, median over rounds\n"
        )
        lines.append("| contender | Keras 2 | Keras 3 |")
        lines.append("| --- | --- | --- |")
        for c in CONTENDERS:
            cells = [c]
            for stack in ("keras2", "keras3"):
                values = [m[(stack, c)]["first_step_s"] for m in rounds.values() if (stack, c) in m]
                cells.append(f"{statistics.median(values):.1f}" if values else "-")
            lines.append("| " + " | ".join(cells) + " |")
    failures = [r for r in results if "failure" in r]
    if failures:
        lines.append("\nFailed measurements:\n")
        lines += [
            f"* round {r['round']}, {r['stack']} {r['contender']} b={r['batch']}: {r['failure']}"
            for r in failures
        ]
    loads = [x for r in results for x in r.get("loadavg", [])]
    if loads:
        lines.append(
            f"\nLoad average (1 min) seen by the workers: {min(loads):.1f}–{max(loads):.1f} "
            f"(median {statistics.median(loads):.1f}) on {os.cpu_count()} cores."
        )
    return "\n".join(lines)


def header(saved):
    lines = [f"Machine: {saved['machine']}.", f"Date: {saved['date']}."]
    lines.append(f"Command: {saved['command']}")
    for stack in STACKS:
        info = saved["stacks"][stack]
        versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v is not None)
        lines.append(f"{STACK_LABEL[stack]} stack ({info['python']}): {versions}.")
    start, end = saved["lipdp_start"], saved.get("lipdp_end") or {}
    line = (
        f"lipdp: commit {start['commit']}, {start['uncommitted_lipdp_files']} uncommitted "
        f"file(s) under lipdp/, sources digest {start['sources_sha256']} at the start"
    )
    if end:
        same = end["sources_sha256"] == start["sources_sha256"]
        line += ", " + ("unchanged at the end" if same else f"CHANGED to {end['sources_sha256']}")
        line += f" (commit {end['commit']} at the end)"
    lines.append(line + ".")
    seen = {r["lipdp_sources_sha256"] for r in saved["results"] if "lipdp_sources_sha256" in r}
    if len(seen) > 1:
        lines.append(
            f"WARNING: the workers ran {len(seen)} different versions of lipdp's sources "
            "(see lipdp_sources_sha256 in the raw results)."
        )
    settings = saved["settings"]
    lines.append(
        f"Settings: {settings['rounds']} round(s), {settings['repeats']} repeats per worker, "
        f"{settings['threads']} TF thread(s) per worker, cap {settings['cap']:g} s per worker."
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7, help="repeats per worker")
    parser.add_argument("--threads", type=int, default=1, help="TF threads per worker")
    parser.add_argument("--cap", type=float, default=150.0, help="seconds per worker")
    parser.add_argument("--keras3-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--keras2-python", default=str(ROOT / ".venv-keras2" / "bin" / "python"))
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--from-json", default=None, help="reprint the tables of a saved run")
    args = parser.parse_args()

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(header(saved))
        print(tables(saved["results"], saved["settings"]["batches"]))
        return

    pythons = {"keras3": args.keras3_python, "keras2": args.keras2_python}
    saved = {
        "machine": step_speed.machine_description().rsplit(", TF ", 1)[0],
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "command": " ".join(
            [
                os.path.relpath(sys.executable, ROOT)
                if sys.executable.startswith(str(ROOT))
                else sys.executable,
                os.path.relpath(__file__, ROOT),
                *sys.argv[1:],
            ]
        ),
        "settings": {
            "arch": ARCH,
            "batches": args.batches,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "threads": args.threads,
            "cap": args.cap,
            "contenders": CONTENDERS,
        },
        "stacks": {
            s: {"python": os.path.relpath(p, ROOT), "versions": stack_versions(p)}
            for s, p in pythons.items()
        },
        "lipdp_start": lipdp_state(),
        "results": [],
    }
    print(header(saved), flush=True)

    def dump():
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(saved, indent=1))

    started = time.perf_counter()
    # Stacks alternate: the two measurements of a contender are neighbours in time.
    base = [(s, c) for c in CONTENDERS for s in STACKS]
    for rnd in range(args.rounds):
        for batch in args.batches:
            k = rnd % len(base)
            for position, (stack, contender) in enumerate(base[k:] + base[:k]):
                launched = datetime.datetime.now().isoformat(timespec="seconds")
                digest = sources_digest()  # what this worker imports (read at its start)
                r = run_worker(pythons[stack], contender, batch, args)
                r.update(
                    round=rnd,
                    position=position,
                    stack=stack,
                    contender=contender,
                    batch=batch,
                    launched=launched,
                    lipdp_sources_sha256=digest,
                )
                saved["results"].append(r)
                status = r.get("failure") or (
                    f"{1e3 * r['step_s']:.0f} ms wall, {1e3 * r['cpu_s']:.0f} ms CPU per step"
                )
                print(
                    f"[{time.perf_counter() - started:5.0f} s] round {rnd} b={batch} "
                    f"{stack} {contender}: {status} ({r['wall_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                dump()
    saved["lipdp_end"] = lipdp_state()
    saved["total_wall_s"] = time.perf_counter() - started
    dump()
    # The header again: the end state of lipdp's sources is known only now.
    print("\n" + header(saved))
    print(tables(saved["results"], args.batches))
    print(f"\nTotal wall time: {saved['total_wall_s']:.0f} s")


if __name__ == "__main__":
    main()
