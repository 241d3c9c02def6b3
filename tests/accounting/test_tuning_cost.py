"""lipdp.accounting.tuning_cost (issue 15): the privacy cost of a random hyper-parameter search
(Papernot & Steinke), against dp-accounting's implementation, a hand-derived case and
Monte Carlo draws of the law."""

import dataclasses
import math

import numpy as np
import pytest
from dp_accounting import dp_event as events
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

from lipdp.accounting import calibrate_noise_multiplier
from lipdp.accounting.mechanisms import SubsampledGaussian
from lipdp.accounting.plan import PrivacyPlan
from lipdp.accounting.registry import get_accountant
from lipdp.accounting.tuning_cost import RandomSearch, truncated_negative_binomial_mean
from lipdp.core.private_model import DPParameters
from lipdp.core.report import privacy_report
from tests.clipped.test_model import _model

SHAPES = [0.0, 0.5, 1.0, 3.0]


def test_search_refuses_bad_laws_and_round_trips():
    for bad in (dict(mean=0.5), dict(mean=10, shape=-1), dict(mean=float("inf"))):
        with pytest.raises(ValueError):
            RandomSearch(**bad)
    search = RandomSearch(12.0, 0.5)
    assert RandomSearch.coerce(search.to_config()) == search
    params = DPParameters("global", 1.0, 1e-5, hyperparameter_search={"mean": 5})
    assert DPParameters(**params.to_config()) == params
    with pytest.raises(TypeError):
        RandomSearch.coerce(5)


@pytest.mark.parametrize("shape", SHAPES)
def test_gamma_of_the_mean_matches_dp_accounting_and_the_draws(shape):
    """gamma from the mean = dp-accounting's inversion; the law's mean at that gamma is the
    mean; 40 000 seeded draws average to it (within 4 standard errors) and are >= 1."""
    for mean in (2.0, 10.0, 100.0):
        search = RandomSearch(mean, shape)
        theirs = dpa_rdp._gamma_truncated_negative_binomial(shape, mean)
        assert search.gamma == pytest.approx(theirs, rel=1e-7)
        assert truncated_negative_binomial_mean(search.gamma, shape) == pytest.approx(mean)
    search = RandomSearch(10.0, shape)
    rng = np.random.default_rng(1)
    draws = np.array([search.sample(rng) for _ in range(40_000)])
    assert draws.min() >= 1
    assert abs(draws.mean() - 10.0) < 4 * draws.std() / np.sqrt(len(draws))


def test_geometric_draws_follow_the_geometric_law():
    search = RandomSearch(4.0, 1.0)
    rng = np.random.default_rng(2)
    draws = np.array([search.sample(rng) for _ in range(40_000)])
    for k in (1, 2, 3, 5):
        expected = (1 - 0.25) ** (k - 1) * 0.25
        assert np.mean(draws == k) == pytest.approx(expected, abs=4 * math.sqrt(expected / 40_000))


@pytest.mark.parametrize("shape", SHAPES)
def test_search_rdp_equals_dp_accounting(shape, rng):
    """Theorem 2 on the same (orders, one-run RDP) input as dp-accounting's own
    implementation: equal to float precision (random increasing curves and a Gaussian)."""
    orders = np.array([1.1, 1.5, 2, 2.5, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256.0])
    curves = [orders / (2 * 1.3**2), np.cumsum(rng.uniform(0.01, 0.3, size=len(orders)))]
    for rdp in curves:
        for mean in (1.5, 10.0, 300.0):
            ours = RandomSearch(mean, shape).rdp(orders, rdp)
            theirs = dpa_rdp._compute_rdp_repeat_and_select(orders, rdp, mean, shape)
            np.testing.assert_allclose(ours, theirs, rtol=1e-7)


def test_search_rdp_of_a_gaussian_matches_the_hand_derivation():
    """Gaussian mechanism, RDP a * lambda with a = 1 / (2 sigma^2); geometric law (eta = 1,
    E[K] = 1/gamma, b = log(1/gamma)): min_mu [(1 - 1/mu) a mu + b / mu] = 2 sqrt(ab) - a at
    mu = sqrt(b/a), so eps'(lambda) = a lambda + 4 sqrt(ab) - 2a + b / (lambda - 1). The
    grid minimum is at least that, and within the grid's resolution of it."""
    sigma, mean = 2.0, 20.0
    a, b = 1 / (2 * sigma**2), math.log(mean)
    orders = np.linspace(1.01, 60.0, 6000)
    ours = RandomSearch(mean, 1.0).rdp(orders, a * orders)
    hand = a * orders + 4 * math.sqrt(a * b) - 2 * a + b / (orders - 1)
    # the monotone envelope can only lower the hand curve where it increases later
    assert np.all(ours >= np.minimum.accumulate(hand[::-1])[::-1] - 1e-12)
    assert np.all(ours <= hand + 1e-4)


def test_plan_epsilon_includes_the_search_and_bounds_dp_accounting():
    """A plan with a search: epsilon above the run's own, never below dp-accounting's
    RepeatAndSelectDpEvent (whose subsampled-Gaussian RDP is tighter at fractional orders)
    and within 10 % of it; the PLD accountant is refused with the fix."""
    delta, sigma, q, steps = 1e-5, 1.1, 0.02, 400
    search = RandomSearch(10.0, 1.0)
    plan = PrivacyPlan.for_training(
        noise_multipliers=sigma, sampling_rate=q, steps_per_epoch=steps, delta=delta
    )
    searched = dataclasses.replace(plan, search=search)
    alone, total = plan.epsilon(1), searched.epsilon(1)
    event = events.SelfComposedDpEvent(
        events.PoissonSampledDpEvent(q, events.GaussianDpEvent(sigma)), steps
    )
    accountant = dpa_rdp.RdpAccountant()
    accountant.compose(events.RepeatAndSelectDpEvent(event, 10.0, 1.0))
    reference = accountant.get_epsilon(delta)
    assert total > 1.5 * alone
    assert reference * (1 - 1e-6) <= total <= 1.1 * reference
    with pytest.raises(ValueError, match="accountant='rdp'"):
        searched.epsilon(1, "pld")
    assert get_accountant("rdp").epsilon(plan.terms(1), delta) == alone


def test_model_report_and_calibration_include_the_search():
    """DPParameters(hyperparameter_search=...): the model's epsilon and report include it,
    and calibrating sigma for the whole search gives a larger sigma than for one run."""
    model = _model(sigma=1.0)
    alone = privacy_report(model, epochs=3)
    model.dp_parameters = dataclasses.replace(
        model.dp_parameters, hyperparameter_search=RandomSearch(8.0)
    )
    searched = privacy_report(model, epochs=3)
    assert searched.epsilon > alone.epsilon
    assert "hyper-parameter search included" in str(searched)
    assert "E[K] = 8" in str(searched)
    one = calibrate_noise_multiplier(3.0, 5, 256, 60_000, 1e-5)
    whole = calibrate_noise_multiplier(3.0, 5, 256, 60_000, 1e-5, search=RandomSearch(8.0))
    assert whole > one
    plan = PrivacyPlan.for_training(
        noise_multipliers=whole,
        sampling_rate=256 / 60_000,
        steps_per_epoch=60_000 // 256,
        delta=1e-5,
        search=RandomSearch(8.0),
    )
    assert plan.epsilon(5) <= 3.0
    assert plan.terms(5) == ((SubsampledGaussian(whole, 256 / 60_000), 5 * (60_000 // 256)),)


# ------------------------------------------------------------------ the search driver
def _trained(sigma, lr, rng):
    """A small clipped model trained for one epoch (8 steps) on random data."""
    from tests.clipped.test_model import _batch

    model = _model(sigma=sigma, n=64, lr=lr)
    x, y = _batch(rng, n=64)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


def test_private_random_search_selects_the_best_run_and_declares_the_search(rng):
    """K comes from the law (the same seeded draw), every run is trained, the best score
    wins, and the selected model's epsilon and report are those of the whole search."""
    from lipdp.accounting import get_eps_delta
    from lipdp.recipes.tuning import private_random_search

    search = RandomSearch(3.0)
    expected_runs = search.sample(np.random.default_rng(5))
    rates = [0.01, 0.1, 0.5, 1.0]

    def sample(generator):
        return float(generator.choice(rates))

    def train(lr):
        return _trained(1.0, lr, rng), -abs(lr - 0.1)  # a public score: closest to 0.1

    result = private_random_search(train, sample, search, np.random.default_rng(5))
    assert result.runs == expected_runs == len(result.scores)
    assert result.score == max(score for _, score in result.scores)
    assert result.config == max(result.scores, key=lambda item: item[1])[0]
    assert result.model.dp_parameters.hyperparameter_search == search
    alone = _trained(1.0, 0.1, rng)
    assert get_eps_delta(result.model, 1)[0] > get_eps_delta(alone, 1)[0]
    assert "hyper-parameter search included" in str(privacy_report(result.model))


def test_private_random_search_refuses_runs_of_another_mechanism(rng):
    """A configuration that changes the noise multiplier is another mechanism: refused."""
    from lipdp.recipes.tuning import private_random_search

    sigmas = iter([1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])

    def train(_):
        return _trained(next(sigmas), 0.1, rng), 0.0

    search = RandomSearch(50.0)
    assert search.sample(np.random.default_rng(0)) >= 2  # the second run happens
    with pytest.raises(ValueError, match="same mechanism"):
        private_random_search(train, lambda g: None, search, np.random.default_rng(0))


def test_optuna_random_search_asks_optuna_and_declares_the_search(rng):
    """Optuna's RandomSampler draws the configurations (suggest_* calls), K comes from the
    law, every score is told to the study, the selected model declares the search."""
    optuna = pytest.importorskip("optuna")
    from lipdp.recipes.tuning import optuna_random_search

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    search = RandomSearch(3.0)
    expected_runs = search.sample(np.random.default_rng(5))

    def objective(trial):
        lr = trial.suggest_categorical("lr", [0.01, 0.1, 0.5, 1.0])
        return _trained(1.0, lr, rng), -abs(lr - 0.1)

    result = optuna_random_search(objective, search, np.random.default_rng(5), study=study)
    assert result.runs == expected_runs == len(study.trials)
    assert [t.value for t in study.trials] == [score for _, score in result.scores]
    assert result.config == study.best_trial.params
    assert result.score == study.best_value
    assert result.model.dp_parameters.hyperparameter_search == search


def test_optuna_random_search_refuses_adaptive_samplers_and_minimisation():
    optuna = pytest.importorskip("optuna")
    from lipdp.recipes.tuning import optuna_random_search

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    adaptive = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler())
    with pytest.raises(ValueError, match="RandomSampler"):
        optuna_random_search(lambda t: None, RandomSearch(2.0), study=adaptive)
    minimising = optuna.create_study(sampler=optuna.samplers.RandomSampler())
    with pytest.raises(ValueError, match="maximize"):
        optuna_random_search(lambda t: None, RandomSearch(2.0), study=minimising)
