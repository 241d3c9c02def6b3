"""lipdp.accounting.gdp: the GDP central-limit accountant, against tensorflow-privacy's
implementation of the same formulas and hand-checked properties; flagged as approximate."""

import logging
import math

import pytest

from lipdp.accounting import SubsampledGaussian
from lipdp.accounting.gdp import GDPAccountant, delta_of, epsilon_of, mu_of
from lipdp.accounting.registry import get_accountant, is_approximate
from tests.reference_helpers import requires_tensorflow_privacy


@requires_tensorflow_privacy
@pytest.mark.parametrize(
    "sigma,batch,n,epochs,delta",
    [(1.1, 256, 60000, 15, 1e-5), (0.8, 512, 50000, 60, 1e-5), (2.0, 64, 455, 30, 1 / 569)],
)
def test_epsilon_matches_tensorflow_privacy(sigma, batch, n, epochs, delta):
    """tensorflow-privacy's gdp_accountant (Bu et al.'s code): same mu, same epsilon."""
    from tensorflow_privacy.privacy.analysis import gdp_accountant as reference

    steps = int(math.ceil(epochs * n / batch))  # tf-privacy's T = epochs * n / batch
    mechanism = SubsampledGaussian(sigma, batch / n)
    assert mu_of(mechanism, steps) == pytest.approx(
        reference.compute_mu_poisson(epochs, sigma, n, batch), rel=1e-2
    )
    ours = GDPAccountant().epsilon([(mechanism, steps)], delta)
    theirs = reference.compute_eps_poisson(steps * batch / n, sigma, n, batch, delta)
    assert ours == pytest.approx(theirs, rel=1e-4)


def test_delta_curve_inverts_and_composition_is_in_quadrature():
    for mu in (0.1, 0.5, 1.0, 3.0):
        for delta in (1e-3, 1e-5, 1e-8):
            epsilon = epsilon_of(mu, delta)
            assert delta_of(epsilon, mu) == pytest.approx(delta, rel=1e-6)
    a, b = SubsampledGaussian(1.0, 0.01), SubsampledGaussian(2.0, 0.02)
    accountant = GDPAccountant()
    assert accountant.mu([(a, 100), (b, 300)]) == pytest.approx(
        math.hypot(mu_of(a, 100), mu_of(b, 300))
    )


@requires_tensorflow_privacy
def test_mu_to_epsilon_matches_tensorflow_privacy():
    """The mu -> epsilon conversion against tensorflow-privacy's (Bu et al.'s code)."""
    from tensorflow_privacy.privacy.analysis import gdp_accountant as reference

    for mu in (0.3, 1.0, 2.5):
        assert epsilon_of(mu, 1e-5) == pytest.approx(reference.eps_from_mu(mu, 1e-5), rel=1e-5)


def test_is_flagged_approximate_and_refuses_laplace():
    from lipdp.accounting import Laplace

    assert is_approximate("gdp") and not is_approximate("rdp") and not is_approximate("pld")
    assert get_accountant("gdp").name == "gdp"
    with pytest.raises(ValueError, match="subsampled Gaussians only"):
        GDPAccountant().epsilon([(Laplace(0.1), 3)], 1e-5)


def test_report_and_callback_say_it_is_not_a_guarantee(caplog):
    from lipdp.core.callbacks import DP_Accountant
    from lipdp.core.report import privacy_report
    from tests.cases import build

    model, x, y = build([], (12,), batch=4)
    report = str(privacy_report(model, epochs=2, accountant="gdp"))
    assert "APPROXIMATE EPSILON" in report
    assert "APPROXIMATE EPSILON" not in str(privacy_report(model, epochs=2))
    callback = DP_Accountant(accountant="gdp")
    callback.set_model(model)
    callback.set_params({"steps": model.dataset_metadata.nb_steps_per_epochs})
    with caplog.at_level(logging.WARNING, logger="lipdp.core.callbacks"):
        callback.on_train_begin()
    assert any("not a proven upper bound" in r.message for r in caplog.records)
