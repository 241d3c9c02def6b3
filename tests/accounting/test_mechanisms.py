"""lipdp.accounting.mechanisms and lipdp.accounting.reference: mechanisms, release counts,
legacy configurations, and the autodp reference mechanism."""

import math

import numpy as np
import pytest
from autodp import mechanism_zoo, transformer_zoo

from lipdp.accounting import (
    DPGD_Mechanism,
    Laplace,
    Release,
    SubsampledGaussian,
    autodp_epsilon,
    effective_noise_multiplier,
    epsilon_for_steps,
    release_from_config,
)
from tests.accounting_helpers import DELTA, TUTORIAL_Q


def test_effective_noise_multiplier():
    # Two Gaussians of 2 sqrt(2) on disjoint coordinates are one Gaussian of 2.
    assert effective_noise_multiplier([2 * math.sqrt(2)] * 2) == pytest.approx(2.0, rel=1e-15)
    assert effective_noise_multiplier(3.0) == 3.0
    sigmas = [1.5, 3.0, 4.0]
    assert effective_noise_multiplier(sigmas) == pytest.approx(sum(s**-2 for s in sigmas) ** -0.5)
    with pytest.raises(ValueError, match="empty"):
        effective_noise_multiplier([])
    with pytest.raises(ValueError, match="noise multiplier"):
        effective_noise_multiplier([1.0, -2.0])


def test_release_counts():
    step = SubsampledGaussian(1.0, 0.1)
    assert Release(step, "steps", per_epoch=60).count(7) == 420
    # Rounds every 3 epochs, 2 releases each: epochs // 3 rounds.
    clipping = Release(Laplace(0.5), "clip", per_round=2, patience=3)
    assert [clipping.count(e) for e in range(7)] == [0, 0, 0, 2, 2, 2, 4]
    assert Release(Laplace(0.5), "fixed", fixed=5).count(100) == 5
    with pytest.raises(ValueError, match="patience"):
        Release(Laplace(0.5), "clip", per_round=1, patience=0)
    with pytest.raises(ValueError, match="epochs"):
        clipping.count(-1)


def test_mechanisms_validate_and_are_hashable():
    assert SubsampledGaussian(2.0, 0.5) == SubsampledGaussian(2, 0.5)
    assert len({SubsampledGaussian(2.0, 0.5), SubsampledGaussian(2.0, 0.5), Laplace(1.0)}) == 2
    with pytest.raises(ValueError, match="sampling_rate"):
        SubsampledGaussian(1.0, 0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        SubsampledGaussian(0.0, 0.1)
    with pytest.raises(ValueError, match="epsilon"):
        Laplace(-1.0)


def test_release_from_config():
    assert release_from_config(None, 0.1) is None
    assert release_from_config({"mode": "fixed"}, 0.1) is None
    assert release_from_config({"mode": "laplace", "epsilon": 1.0, "num_updates": 0}, 0.1) is None
    laplace = release_from_config({"mode": "laplace", "epsilon": 0.5, "num_updates": 4}, 0.1)
    assert laplace.mechanism == Laplace(0.5) and laplace.count(10) == 4
    quantiles = release_from_config(
        {"mode": "quantiles", "noise_multiplier": 3, "num_updates": 2}, 0.1
    )
    assert quantiles.mechanism == SubsampledGaussian(3.0, 0.1)
    for config, match in [
        ({"mode": "svt", "num_updates": 1}, "mode"),
        ({"mode": "laplace", "num_updates": 1}, "epsilon"),
        ({"mode": "laplace", "epsilon": 1.0}, "num_updates"),
        ({"mode": "quantiles", "num_updates": 1}, "noise_multiplier"),
        ("laplace", "dict"),
    ]:
        with pytest.raises(ValueError, match=match):
            release_from_config(config, 0.1)


def test_laplace_composes_like_an_independent_autodp_composition():
    sigma, q, steps, eps_update, updates = 2.0, TUTORIAL_Q, 600, 0.05, 10
    config = {"mode": "laplace", "epsilon": eps_update, "num_updates": updates}
    # Independent autodp composition, written out here.
    subsampled = transformer_zoo.AmplificationBySampling(PoissonSampling=True)(
        mechanism_zoo.GaussianMechanism(sigma=sigma), q, improved_bound_flag=True
    )
    laplace = mechanism_zoo.PureDP_Mechanism(eps=eps_update)
    expected = transformer_zoo.Composition()([subsampled, laplace], [steps, updates])
    with np.errstate(invalid="ignore"):  # autodp's Brent search divides 0 by 0
        expected = expected.get_approxDP(DELTA)

    without = epsilon_for_steps(sigma, q, steps, DELTA)
    with_dynamic = epsilon_for_steps(sigma, q, steps, DELTA, dynamic_clipping=config)
    assert with_dynamic > without
    assert with_dynamic == pytest.approx(expected, rel=1e-6)
    mechanism = DPGD_Mechanism("global", q, sigma, steps, DELTA, dynamic_clipping=config)
    assert mechanism.epsilon == pytest.approx(expected, rel=1e-9)
    terms = [(SubsampledGaussian(sigma, q), steps), (Laplace(eps_update), updates)]
    assert autodp_epsilon(terms, DELTA) == pytest.approx(expected, rel=1e-9)


def test_quantile_updates_compose_like_autodp():
    config = {"mode": "quantiles", "noise_multiplier": 4.0, "num_updates": 20}
    reference = DPGD_Mechanism("global", 0.01, 1.0, 1000, DELTA, dynamic_clipping=config)
    fast = epsilon_for_steps(1.0, 0.01, 1000, DELTA, dynamic_clipping=config)
    assert fast == pytest.approx(reference.epsilon, rel=1e-6)
    plain = epsilon_for_steps(1.0, 0.01, 1000, DELTA)
    assert fast > plain
    # A "fixed" config and zero updates cost nothing.
    assert epsilon_for_steps(1.0, 0.01, 1000, DELTA, dynamic_clipping={"mode": "fixed"}) == plain
    zero = {**config, "num_updates": 0}
    assert epsilon_for_steps(1.0, 0.01, 1000, DELTA, dynamic_clipping=zero) == plain


def test_zero_steps_cost_nothing():
    assert DPGD_Mechanism("global", 0.1, 1.0, 0, DELTA).epsilon == 0.0
    assert epsilon_for_steps(1.0, 0.1, 0, DELTA) == 0.0
    assert epsilon_for_steps(1.0, 0.1, 0, DELTA, accountant="pld") == 0.0
    assert autodp_epsilon([], DELTA) == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "local"}, "mode"),
        ({"prob": 0.0}, "prob"),
        ({"prob": 1.5}, "prob"),
        ({"noise_multipliers": -1.0}, "noise multiplier"),
        ({"noise_multipliers": [1.0, 2.0]}, "global"),
        ({"mode": "per-layer", "noise_multipliers": []}, "empty"),
        ({"num_grad_steps": -1}, "num_grad_steps"),
        ({"num_grad_steps": 1.5}, "num_grad_steps"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"dynamic_clipping": {"mode": "svt", "num_updates": 1}}, "mode"),
        ({"dynamic_clipping": {"mode": "laplace", "num_updates": 1}}, "epsilon"),
        ({"dynamic_clipping": {"mode": "laplace", "epsilon": 1.0}}, "num_updates"),
    ],
)
def test_dpgd_mechanism_rejects_bad_input(kwargs, match):
    args = {"mode": "global", "prob": 0.1, "noise_multipliers": 1.0, "num_grad_steps": 10}
    args["delta"] = DELTA
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DPGD_Mechanism(**args)


def test_epsilon_for_steps_rejects_bad_input():
    with pytest.raises(ValueError, match="delta"):
        epsilon_for_steps(1.0, 0.1, 10, 1.0)
    with pytest.raises(ValueError, match="sampling_rate"):
        epsilon_for_steps(1.0, 0.0, 10, DELTA)
    with pytest.raises(ValueError, match="noise multiplier"):
        epsilon_for_steps(0.0, 0.1, 10, DELTA)
    with pytest.raises(ValueError, match="num_steps"):
        epsilon_for_steps(1.0, 0.1, -1, DELTA)
    with pytest.raises(ValueError, match="accountant"):
        epsilon_for_steps(1.0, 0.1, 10, DELTA, accountant="moments")
