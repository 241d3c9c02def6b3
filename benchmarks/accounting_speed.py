"""Speed of the privacy accounting: straightforward autodp vs lipdp's cached accountants.

    .venv/bin/python benchmarks/accounting_speed.py [--epochs 100] [--epsilon-max 3.0]

MNIST tutorial configuration of the original package: global noise, sigma = 2, batch
1000, N = 60 000 (60 steps per epoch), delta = 1e-5. Measured side by side in one run:

(a) epsilon after each epoch for ``--epochs`` epochs (what the ``DP_Accountant`` callback
    does): a fresh autodp ``DPGD_Mechanism`` per call (the original package's way) vs
    ``lipdp.accounting.get_eps_delta`` (cached one-step RDP curve); mean ms per call after
    the first, and the first call;
(b) ``get_max_epochs(--epsilon-max)``: the original package's bisection with a fresh
    autodp mechanism per probe vs ``lipdp.sensitivity.get_max_epochs`` (cold caches, and
    warm);
(c) epsilon after 91 epochs with RDP vs PLD, and the cost of the PLD (lipdp's cached
    PLD accountant, and ``dp_accounting``'s ``PLDAccountant`` on the same events).

Prints a markdown table. Timings are wall-clock on whatever machine runs it.
"""

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from dp_accounting.pld import PLDAccountant as DpAccountingPLD  # noqa: E402

from lipdp import accounting  # noqa: E402
from lipdp.accounting import DPGD_Mechanism, get_eps_delta, training_dp_event  # noqa: E402
from lipdp.clipless import layers
from lipdp.clipless.model import DP_Sequential, DPParameters  # noqa: E402
from lipdp.foundation.metadata import DatasetMetadata  # noqa: E402
from lipdp.sensitivity import get_max_epochs  # noqa: E402

SIGMA, BATCH, N, DELTA = 2.0, 1000, 60000, 1e-5


def make_model():
    metadata = DatasetMetadata(
        input_shape=(28, 28, 1), nb_classes=10, nb_samples_train=N, batch_size=BATCH
    )
    return DP_Sequential(
        [
            layers.DP_BoundedInput(input_shape=(28, 28, 1), upper_bound=1.0),
            layers.DP_Flatten(),
            layers.DP_QuickSpectralDense(10),
        ],
        dp_parameters=DPParameters("global", SIGMA, DELTA),
        dataset_metadata=metadata,
    )


def clear_lipdp_caches():
    accounting.clear_caches()


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def autodp_epsilon(epochs, steps_per_epoch, q):
    with np.errstate(invalid="ignore", divide="ignore"):
        return DPGD_Mechanism("global", q, SIGMA, epochs * steps_per_epoch, DELTA).epsilon


def autodp_max_epochs(epsilon_max, steps_per_epoch, q, epochs_max=1024):
    """The original package's search: integer bisection, a fresh autodp mechanism per probe."""
    calls = 0

    def fun(epoch):
        nonlocal calls
        if epoch == 0:
            return 0.0
        calls += 1
        return autodp_epsilon(epoch, steps_per_epoch, q)

    low, high = 0, epochs_max
    while high - low > 1:
        mid = (low + high) // 2
        if fun(mid) < epsilon_max:
            low = mid
        else:
            high = mid
    assert fun(low) <= epsilon_max  # the final "safe" check of the original
    return low, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=100, help="epochs of part (a)")
    parser.add_argument("--epsilon-max", type=float, default=3.0, help="budget of part (b)")
    args = parser.parse_args()

    model = make_model()
    steps = model.dataset_metadata.nb_steps_per_epochs
    q = model.dataset_metadata.sampling_rate
    epochs = range(1, args.epochs + 1)

    # (a) per-epoch epsilon
    autodp_times, autodp_values = [], []
    for e in epochs:
        value, seconds = timed(autodp_epsilon, e, steps, q)
        autodp_values.append(value)
        autodp_times.append(seconds)
    clear_lipdp_caches()
    lipdp_times, lipdp_values = [], []
    for e in epochs:
        (value, _), seconds = timed(get_eps_delta, model, e)
        lipdp_values.append(value)
        lipdp_times.append(seconds)
    worst = max(abs(a - b) / a for a, b in zip(autodp_values, lipdp_values))

    # (b) get_max_epochs
    (autodp_max, calls), autodp_search = timed(autodp_max_epochs, args.epsilon_max, steps, q)
    clear_lipdp_caches()
    lipdp_max, lipdp_cold = timed(get_max_epochs, args.epsilon_max, model)
    accounting.clear_caches(results_only=True)  # keep the one-step curve, forget the epsilons
    _, lipdp_curve_cached = timed(get_max_epochs, args.epsilon_max, model)
    _, lipdp_warm = timed(get_max_epochs, args.epsilon_max, model)
    assert lipdp_max == autodp_max, (lipdp_max, autodp_max)

    # (c) RDP vs PLD after 91 epochs
    rdp_91 = get_eps_delta(model, 91)[0]
    clear_lipdp_caches()
    (pld_91, _), pld_cold = timed(get_eps_delta, model, 91, accountant="pld")
    (_, _), pld_next = timed(get_eps_delta, model, 92, accountant="pld")
    reference = DpAccountingPLD(
        value_discretization_interval=accounting.PLD_VALUE_DISCRETIZATION_INTERVAL
    )
    start = time.perf_counter()
    reference.compose(training_dp_event(SIGMA, q, 91 * steps))
    pld_reference = reference.get_epsilon(DELTA)
    pld_reference_time = time.perf_counter() - start

    def ms(seconds):
        return f"{1e3 * seconds:.3g} ms"

    a_mean = statistics.mean(autodp_times[1:])
    l_mean = statistics.mean(lipdp_times[1:])
    print(
        f"\nMNIST tutorial configuration: sigma={SIGMA}, b={BATCH}, N={N}, delta={DELTA} "
        f"({steps} steps/epoch). Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs.\n"
    )
    print("| measurement | autodp, fresh mechanism per call | lipdp | ratio |")
    print("| --- | --- | --- | --- |")
    print(
        f"| (a) epsilon after each of {args.epochs} epochs: mean per call after the first "
        f"| {ms(a_mean)} | {ms(l_mean)} | {a_mean / l_mean:.0f}x |"
    )
    print(
        f"| (a) first call (lipdp builds the one-step RDP curve) | {ms(autodp_times[0])} "
        f"| {ms(lipdp_times[0])} | {autodp_times[0] / lipdp_times[0]:.1f}x |"
    )
    print(
        f"| (a) all {args.epochs} calls | {ms(sum(autodp_times))} | {ms(sum(lipdp_times))} "
        f"| {sum(autodp_times) / sum(lipdp_times):.0f}x |"
    )
    print(
        f"| (b) get_max_epochs({args.epsilon_max:g}) = {lipdp_max}, cold caches "
        f"({calls} autodp probes) | {ms(autodp_search)} | {ms(lipdp_cold)} "
        f"| {autodp_search / lipdp_cold:.0f}x |"
    )
    print(
        f"| (b) get_max_epochs({args.epsilon_max:g}), one-step curve cached | "
        f"{ms(autodp_search)} | {ms(lipdp_curve_cached)} "
        f"| {autodp_search / lipdp_curve_cached:.0f}x |"
    )
    print(
        f"| (b) get_max_epochs({args.epsilon_max:g}), epsilons cached too | "
        f"{ms(autodp_search)} | {ms(lipdp_warm)} | {autodp_search / lipdp_warm:.0f}x |"
    )
    print(
        f"\nMax relative difference of the {args.epochs} epsilons, lipdp vs autodp: {worst:.1e}.\n"
    )
    print("| after 91 epochs | epsilon | time |")
    print("| --- | --- | --- |")
    print(f"| RDP (autodp numbers) | {rdp_91:.5f} | (part a) |")
    print(
        f"| PLD, lipdp (interval {accounting.PLD_VALUE_DISCRETIZATION_INTERVAL:g}), cold "
        f"| {pld_91:.5f} | {ms(pld_cold)} |"
    )
    print(f"| PLD, lipdp, next epoch (one-step PLD cached) | - | {ms(pld_next)} |")
    print(
        f"| PLD, dp_accounting PLDAccountant on the same events | {pld_reference:.5f} "
        f"| {ms(pld_reference_time)} |"
    )
    print(f"\nPLD / RDP = {pld_91 / rdp_91:.4f}")


if __name__ == "__main__":
    main()
