"""lipdp.accounting.budget: epsilon, epochs and noise of models, from their plans."""

import dataclasses
import math

import pytest

from lipdp.accounting import (
    DPGD_Mechanism,
    calibrate_noise_multiplier,
    epsilon_for_steps,
    get_eps_delta,
    get_max_epochs,
)
from lipdp.clipless import layers
from lipdp.clipless.dynamic import DynamicClippingSpec
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from tests.accounting_helpers import DELTA, PUBLISHED, TUTORIAL_Q, autodp_epsilon, mnist_model


@pytest.mark.smoke
def test_model_reproduces_the_published_tutorial_values():
    model = mnist_model()
    assert model.dataset_metadata.nb_steps_per_epochs == 60
    for epochs, published in PUBLISHED.items():
        epsilon, delta = get_eps_delta(model, epochs)
        assert delta == DELTA
        assert epsilon == pytest.approx(published, abs=1e-4)
    assert get_max_epochs(3.0, model) == 91
    # eps(91) <= 3 < eps(92) <= 3 + atol: the non-safe mode may return 92.
    assert get_max_epochs(3.0, model, safe=False) == 92
    assert get_max_epochs(3.0, model, epochs_max=None) == 91


def test_original_call_forms():
    from lipdp.model import get_eps_delta as model_get_eps_delta
    from lipdp.sensitivity import get_max_epochs as sensitivity_get_max_epochs

    model = mnist_model()
    assert model_get_eps_delta(model, 91) == get_eps_delta(model, 91)
    assert sensitivity_get_max_epochs(3.0, model) == 91
    assert sensitivity_get_max_epochs(3.0, model, epochs_max=None) == 91


def test_per_layer_strategy_composes_to_sigma_eff():
    # Two trainable variables (kernel, bias) with noise 2 * sqrt(2) each are one
    # Gaussian mechanism with sigma_eff = 2: the same epsilon as the global model.
    per_layer = mnist_model("per-layer", nm_coef=math.sqrt(2), bias=True)
    sigmas = per_layer.noise_multipliers()
    assert sigmas == pytest.approx([2 * math.sqrt(2)] * 2)
    global_model = mnist_model()
    for epochs in (1, 91):
        eps_layer, _ = get_eps_delta(per_layer, epochs)
        eps_global, _ = get_eps_delta(global_model, epochs)
        assert eps_layer == pytest.approx(eps_global, rel=1e-9)
        reference = DPGD_Mechanism("per-layer", TUTORIAL_Q, sigmas, epochs * 60, DELTA).epsilon
        assert eps_layer == pytest.approx(reference, rel=1e-6)
    # Not compiled yet: the multipliers are read from the layers' nm_coef.
    uncompiled = mnist_model("per-layer", nm_coef=math.sqrt(2), bias=True, compile=False)
    assert get_eps_delta(uncompiled, 91)[0] == pytest.approx(get_eps_delta(per_layer, 91)[0])
    assert get_max_epochs(3.0, per_layer) == 91


def test_tutorial_table():
    """Printed with ``pytest -s``: the MNIST tutorial configuration under each accountant."""
    from dp_accounting.rdp import RdpAccountant

    from lipdp.accounting import training_dp_event

    model = mnist_model()
    rows = []
    for epochs in (1, 10, 50, 91):
        default = RdpAccountant()
        default.compose(training_dp_event(2.0, TUTORIAL_Q, epochs * 60))
        rdp = get_eps_delta(model, epochs)[0]
        pld = get_eps_delta(model, epochs, accountant="pld")[0]
        rows.append((epochs, rdp, default.get_epsilon(DELTA), pld))
        assert pld < rdp
        assert default.get_epsilon(DELTA) == pytest.approx(rdp, rel=1e-2)
    print("\nMNIST tutorial (sigma=2, b=1000, N=60000, delta=1e-5)")
    print("| epochs | lipdp RDP (= autodp) | dp_accounting RDP | PLD (lipdp) |")
    print("|---|---|---|---|")
    for epochs, rdp, other, pld in rows:
        print(f"| {epochs} | {rdp:.5f} | {other:.5f} | {pld:.5f} |")


# ------------------------------------------------------------ calibration
@pytest.mark.smoke
@pytest.mark.parametrize(
    "target,epochs", [(3.0, 91), (1.0, 10), (8.0, 50)], ids=["tutorial", "strict", "loose"]
)
def test_calibrate_noise_multiplier_round_trips(target, epochs):
    tol = 1e-3
    sigma = calibrate_noise_multiplier(target, epochs, 1000, 60000, DELTA, tol=tol)
    steps = epochs * 60
    assert autodp_epsilon(sigma, TUTORIAL_Q, steps) <= target
    assert autodp_epsilon(sigma - tol, TUTORIAL_Q, steps) > target
    if target == 3.0:
        assert 1.9 < sigma <= 2.0  # eps(2.0, 91 epochs) = 2.98762 < 3


def test_calibrate_with_pld():
    tol = 1e-2
    sigma = calibrate_noise_multiplier(3.0, 91, 1000, 60000, DELTA, accountant="pld", tol=tol)
    assert epsilon_for_steps(sigma, TUTORIAL_Q, 91 * 60, DELTA, "pld") <= 3.0
    assert epsilon_for_steps(sigma - tol, TUTORIAL_Q, 91 * 60, DELTA, "pld") > 3.0
    assert sigma < calibrate_noise_multiplier(3.0, 91, 1000, 60000, DELTA, tol=tol)


def test_calibrate_from_a_model_keeps_its_releases():
    model = mnist_model("per-layer", sigma=1.0, nm_coef=math.sqrt(2), bias=True)
    from_model = calibrate_noise_multiplier(3.0, 91, model=model, tol=1e-4)
    from_numbers = calibrate_noise_multiplier(3.0, 91, 1000, 60000, DELTA, tol=1e-4)
    # sigma_eff = sigma: the per-layer model needs the same sigma as the global numbers.
    assert from_model == pytest.approx(from_numbers, abs=2e-4)
    spec = DynamicClippingSpec("laplace", epsilon=0.05)
    dynamic = mnist_model(tail=[layers.DP_ClipGradient(1.0, mode="dynamic")], dynamic=spec)
    numbers = calibrate_noise_multiplier(3.0, 20, 1000, 60000, DELTA, dynamic_clipping=spec)
    assert calibrate_noise_multiplier(3.0, 20, model=dynamic) == pytest.approx(numbers, abs=1e-3)
    assert numbers > calibrate_noise_multiplier(3.0, 20, 1000, 60000, DELTA)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"epochs": 0}, "epochs"),
        ({"epochs": -3}, "epochs"),
        ({"batch_size": 70000}, "larger than the data set"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"accountant": "zcdp"}, "accountant"),
        ({"target_epsilon": 0.1, "epochs": 100, "sigma_bounds": (0.5, 4.0)}, "unreachable"),
        ({"dynamic_clipping": "laplace"}, "dynamic_clipping"),
    ],
)
def test_calibrate_rejects_bad_input(kwargs, match):
    args = {
        "target_epsilon": 3.0,
        "epochs": 10,
        "batch_size": 1000,
        "nb_samples": 60000,
        "delta": DELTA,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        calibrate_noise_multiplier(**args)


# ------------------------------------------------------------------ errors
def test_zero_epochs_and_non_private():
    model = mnist_model()
    assert get_eps_delta(model, 0) == (0.0, DELTA)
    reference = DP_Sequential(
        [layers.DP_BoundedInput(input_shape=(4,), upper_bound=1.0), layers.DP_Flatten()],
        dp_parameters=DPParameters("global", 0.0, DELTA, non_private=True),
        dataset_metadata=DatasetMetadata(input_shape=(4,), nb_classes=4, nb_samples_train=100),
    )
    assert get_eps_delta(reference, 3) == (math.inf, DELTA)
    with pytest.raises(ValueError, match="non_private"):
        get_max_epochs(3.0, reference)


def test_get_eps_delta_rejects_bad_input():
    model = mnist_model()
    with pytest.raises(ValueError, match="epochs"):
        get_eps_delta(model, -1)
    with pytest.raises(ValueError, match="epochs"):
        get_eps_delta(model, 2.5)
    with pytest.raises(ValueError, match="accountant"):
        get_eps_delta(model, 3, accountant="moments")
    with pytest.raises(TypeError, match="privacy_plan"):
        get_eps_delta(object(), 3)
    # What a plan reads cannot be changed after the model is built.
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.dataset_metadata.batch_size = 70000
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.dp_parameters.delta = 1.0
    metadata_free = DP_Sequential(
        [layers.DP_BoundedInput(input_shape=(4,), upper_bound=1.0), layers.DP_Flatten()],
        dp_parameters=DPParameters("global", 1.0, DELTA),
    )
    with pytest.raises(ValueError, match="dataset_metadata"):
        get_eps_delta(metadata_free, 3)


def test_get_max_epochs_errors_and_limits():
    model = mnist_model()
    eps_one = get_eps_delta(model, 1)[0]
    with pytest.raises(ValueError, match=r"One epoch already costs epsilon=0\.\d+") as error:
        get_max_epochs(0.1, model)
    assert "larger noise multiplier" in str(error.value)
    assert "smaller batch size" in str(error.value)
    # Non-safe mode tolerates one epoch just above the budget.
    assert get_max_epochs(eps_one - 1e-3, model, safe=False, atol=1e-2) == 1
    with pytest.raises(ValueError, match="epsilon_max"):
        get_max_epochs(-1.0, model)
    with pytest.raises(ValueError, match="epochs_max"):
        get_max_epochs(3.0, model, epochs_max=0)
    assert get_max_epochs(3.0, model, epochs_max=50) == 50
    assert get_max_epochs(3.0, model, epochs_max=91) == 91
    assert get_max_epochs(3.0, model, epochs_max=92) == 91
