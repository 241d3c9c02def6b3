"""Model-level planning: ``epsilon`` of a model, epochs within a budget, noise calibration.

Every function here reads a :class:`~lipdp.accounting.plan.PrivacyPlan`: a model's own
(``model.privacy_plan()``) or one built from the numbers given. Nothing here reads model
attributes: a model is anything with a ``privacy_plan()`` method.
"""

from __future__ import annotations

import logging

from lipdp.accounting.mechanisms import Release, release_from_config
from lipdp.accounting.plan import PrivacyPlan
from lipdp.accounting.registry import get_accountant
from lipdp.foundation import validation
from lipdp.foundation.metadata import steps_per_epoch

logger = logging.getLogger(__name__)


def privacy_plan_of(model) -> PrivacyPlan:
    """``model.privacy_plan()``, or a plan passed as is."""
    if isinstance(model, PrivacyPlan):
        return model
    plan = getattr(model, "privacy_plan", None)
    if not callable(plan):
        raise TypeError(
            f"{type(model).__name__} has no privacy_plan(): pass a lipdp DP model "
            "(lipdp.clipless.model.DP_Model / DP_Sequential) or a lipdp.accounting.PrivacyPlan."
        )
    return plan()


def get_eps_delta(model, epochs, accountant="rdp"):
    """``(epsilon, delta)`` of a model (or a plan) after ``epochs`` full epochs.

    Every release of the model's privacy plan is composed: ``epochs *
    nb_steps_per_epochs`` gradient steps at rate ``b / N`` with the noise multipliers of
    ``model.dp_parameters``, and the declared dynamic-clipping updates.
    ``epochs == 0`` gives ``epsilon = 0``; a ``non_private`` model gives ``inf``.

    Args:
        model: a :class:`lipdp.clipless.model.DP_Model` (or a :class:`PrivacyPlan`).
        epochs: number of epochs (integer >= 0).
        accountant: a name of :mod:`lipdp.accounting.registry` (``"rdp"``: autodp's
            numbers, fast; ``"pld"``: tighter).
    """
    epochs = validation.count("epochs", epochs)
    plan = privacy_plan_of(model)
    return plan.epsilon(epochs, accountant), plan.delta


def get_max_epochs(epsilon_max, model, epochs_max=1024, safe=True, atol=1e-2, accountant="rdp"):
    """Largest number of epochs whose ``epsilon`` stays within ``epsilon_max``.

    See :meth:`lipdp.accounting.plan.PrivacyPlan.max_epochs` (``safe``, ``atol``,
    ``epochs_max=None`` for an unbounded search). Unlike the original package, a budget
    that even one epoch exceeds raises ``ValueError`` (the original returned 0 epochs,
    and training for 0 epochs silently does nothing).

    Args:
        epsilon_max: the privacy budget (> 0).
        model: a :class:`lipdp.clipless.model.DP_Model` with ``dataset_metadata`` (or a plan).
        epochs_max: upper end of the search (integer >= 1, or ``None``).
        safe: never exceed the budget (default) or allow ``atol`` more.
        atol: tolerance of ``safe=False`` (>= 0).
        accountant: ``"rdp"`` or ``"pld"`` (or another registered name).
    """
    plan = privacy_plan_of(model)
    return plan.max_epochs(epsilon_max, epochs_max, safe=safe, atol=atol, accountant=accountant)


def calibrate_noise_multiplier(
    target_epsilon,
    epochs,
    batch_size=None,
    nb_samples=None,
    delta=None,
    accountant="rdp",
    tol=1e-3,
    sigma_bounds=(0.1, 1000.0),
    dynamic_clipping=None,
    model=None,
    search=None,
):
    """Smallest noise multiplier whose ``epsilon`` after ``epochs`` epochs is ``<= target``.

    The analogue of Opacus's ``make_private_with_epsilon``. Either from numbers
    (``batch_size``, ``nb_samples``, ``delta``: steps per epoch
    ``nb_samples // batch_size`` as :func:`lipdp.foundation.metadata.steps_per_epoch`, rate
    ``batch_size / nb_samples``, plus the ``dynamic_clipping`` releases, a legacy config
    dict or a :class:`~lipdp.clipless.dynamic.DynamicClippingSpec` for one dynamic clip layer), or
    from ``model=``: the model's own plan with its noise multiplier(s) rescaled (the
    ``"per-layer"`` coefficients kept), dynamic clipping and a declared hyper-parameter
    search included. ``search``: a :class:`~lipdp.accounting.tuning_cost.RandomSearch` (numbers
    only): the target is then the epsilon of the whole search. ``epsilon`` decreases
    with ``sigma``: the search brackets the answer by doubling/halving from ``sigma = 1``
    within ``sigma_bounds``, then bisects until the bracket is narrower than ``tol``.

    Returns:
        ``sigma`` with ``epsilon(sigma) <= target_epsilon`` and
        ``epsilon(sigma - tol) > target_epsilon``; if even ``sigma_bounds[0]`` meets the
        target, ``sigma_bounds[0]`` (with a logged warning).

    Raises:
        ValueError: invalid arguments, or the target is unreachable for
            ``sigma <= sigma_bounds[1]`` (the message gives the ``epsilon`` reached there).
    """
    target = validation.positive("target_epsilon", target_epsilon)
    epochs = validation.count("epochs", epochs, minimum=1)
    get_accountant(accountant)
    tol = validation.positive("tol", tol)
    sigma_min = validation.positive("sigma_bounds[0]", sigma_bounds[0])
    sigma_max = validation.real("sigma_bounds[1]", sigma_bounds[1], low=sigma_min)
    if model is not None and search is not None:
        raise ValueError(
            "search= is for the numbers form; a model declares its search in "
            "DPParameters(hyperparameter_search=...)."
        )
    plan_for = _plan_family(model, batch_size, nb_samples, delta, dynamic_clipping, search)

    def epsilon(sigma):
        return plan_for(sigma).epsilon(epochs, accountant)

    def unreachable():
        plan = plan_for(sigma_max)
        return ValueError(
            f"target_epsilon={target:g} is unreachable: even sigma={sigma_max:g} gives "
            f"epsilon={epsilon(sigma_max):.5g} after {epochs} epochs ({plan.steps(epochs)} "
            f"steps; {plan.describe_short()}). Raise the target, train fewer epochs, use a "
            "smaller batch or a larger sigma_bounds[1]."
        )

    return _smallest_sigma(epsilon, target, sigma_min, sigma_max, tol, unreachable)


def _plan_family(model, batch_size, nb_samples, delta, dynamic_clipping, search=None):
    """``sigma -> PrivacyPlan`` for the calibration search."""
    if model is not None:
        return privacy_plan_of(model).with_noise_multiplier
    batch_size = validation.count("batch_size", batch_size, minimum=1)
    nb_samples = validation.count("nb_samples", nb_samples, minimum=1)
    if batch_size > nb_samples:
        raise ValueError(
            f"batch_size ({batch_size}) is larger than the data set ({nb_samples} examples)."
        )
    delta = validation.delta(delta)
    rate = batch_size / nb_samples
    others = _dynamic_releases(dynamic_clipping, rate)
    per_epoch = steps_per_epoch(nb_samples, batch_size)

    def plan_for(sigma):
        return PrivacyPlan.for_training(
            noise_multipliers=sigma,
            sampling_rate=rate,
            steps_per_epoch=per_epoch,
            delta=delta,
            other_releases=others,
            search=search,
        )

    return plan_for


def _dynamic_releases(dynamic_clipping, sampling_rate) -> tuple:
    if dynamic_clipping is None:
        return ()
    if isinstance(dynamic_clipping, dict):
        release = release_from_config(dynamic_clipping, sampling_rate)
        return () if release is None else (release,)
    to_release = getattr(dynamic_clipping, "release", None)
    if not callable(to_release):
        raise ValueError(
            "dynamic_clipping must be None, a config dict or a DynamicClippingSpec, got "
            f"{dynamic_clipping!r}."
        )
    release = to_release(nb_layers=1, training_sampling_rate=sampling_rate)
    return (release,) if isinstance(release, Release) else ()


def _smallest_sigma(epsilon, target, sigma_min, sigma_max, tol, unreachable) -> float:
    """Bracket ``epsilon(lo) > target >= epsilon(hi)``, then bisect to ``tol``."""
    hi = min(max(1.0, sigma_min), sigma_max)
    if epsilon(hi) <= target:
        while True:
            if hi <= sigma_min:
                logger.warning(
                    "sigma_bounds[0]=%g already gives epsilon <= %g: returning it (the "
                    "smallest noise multiplier searched).",
                    sigma_min,
                    target,
                )
                return sigma_min
            lo = max(hi / 2.0, sigma_min)
            if epsilon(lo) > target:
                break
            hi = lo
    else:
        lo = hi
        while True:
            if lo >= sigma_max:
                raise unreachable()
            hi = min(2.0 * lo, sigma_max)
            if epsilon(hi) <= target:
                break
            lo = hi
    while hi - lo > tol:
        middle = 0.5 * (lo + hi)
        if epsilon(middle) <= target:
            hi = middle
        else:
            lo = middle
    return hi


def steps_terms(noise_multipliers, sampling_rate, num_steps, dynamic_clipping=None) -> tuple:
    """The terms of ``num_steps`` DP-SGD steps (and a legacy dynamic-clipping config)."""
    num_steps = validation.count("num_steps", num_steps)
    plan = PrivacyPlan.for_training(
        noise_multipliers=noise_multipliers,
        sampling_rate=sampling_rate,
        steps_per_epoch=max(num_steps, 1),
        delta=0.5,  # unused: terms do not depend on delta
        other_releases=_dynamic_releases(dynamic_clipping, sampling_rate),
        noise_multiplier=1.0,
    )
    step = plan.releases[0]
    terms = [(step.mechanism, num_steps)] + [(r.mechanism, r.fixed) for r in plan.releases[1:]]
    return tuple((m, c) for m, c in terms if c > 0)


def epsilon_for_steps(
    noise_multipliers, sampling_rate, num_steps, delta, accountant="rdp", dynamic_clipping=None
) -> float:
    """``epsilon`` of ``num_steps`` DP-SGD steps (``sigma_eff`` of the multipliers, rate
    ``sampling_rate``) composed with a legacy dynamic-clipping config: the accountants'
    numbers without a model or a plan."""
    terms = steps_terms(noise_multipliers, sampling_rate, num_steps, dynamic_clipping)
    delta = validation.delta(delta)
    return float(get_accountant(accountant).epsilon(terms, delta)) if terms else 0.0


def training_dp_event(noise_multiplier, sampling_rate, num_steps, dynamic_clipping=None):
    """The run as a ``dp_accounting`` event (for ``dp_accounting``'s own accountants)."""
    from lipdp.accounting.plan import dp_event

    return dp_event(steps_terms(noise_multiplier, sampling_rate, num_steps, dynamic_clipping))


__all__ = [
    "calibrate_noise_multiplier",
    "epsilon_for_steps",
    "get_eps_delta",
    "get_max_epochs",
    "privacy_plan_of",
    "steps_terms",
    "training_dp_event",
]
