r"""The privacy plan: every mechanism a training run releases, declared before it starts.

Rule S11: ``epsilon`` computed before training (planning, calibration) equals the
``epsilon`` reported after it, because both read the *same* plan. A plan lists
:class:`~lipdp.accounting.mechanisms.Release`\ s -- the noisy gradient steps and every
data-dependent release such as the dynamic-clipping updates -- each with its count as a
function of the number of epochs. :meth:`PrivacyPlan.epsilon` composes them with an
accountant of :mod:`lipdp.accounting.registry`; :meth:`PrivacyPlan.max_epochs` inverts it.

A DP model builds its plan with ``model.privacy_plan()`` from what the user declared (noise
multipliers, dataset metadata, ``DPParameters.dynamic_clipping``); a mechanism that was not
declared is refused there, never silently left out. ``get_eps_delta``,
``get_max_epochs``, ``calibrate_noise_multiplier`` (:mod:`lipdp.accounting.budget`),
``DP_Accountant`` and ``privacy_report`` all go through it.

Assumptions (rule S7): add/remove-one neighbouring relation; the gradient steps are
Poisson subsamples of rate ``q = b / N`` (shuffled fixed-size batches are *accounted as*
Poisson samples; the privacy report says so).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lipdp.accounting.mechanisms import (
    Release,
    SubsampledGaussian,
    effective_noise_multiplier,
    noise_multiplier_list,
)
from lipdp.accounting.registry import get_accountant
from lipdp.accounting.tuning_cost import RandomSearch, search_epsilon
from lipdp.foundation import validation
from lipdp.foundation.config import Config

logger = logging.getLogger(__name__)

GRADIENT_STEPS = "noisy gradient steps"

#: Upper end of the search of ``max_epochs(..., epochs_max=None)``.
EPOCHS_SEARCH_LIMIT = 2**24


@dataclass(frozen=True)
class PrivacyPlan(Config):
    """The mechanisms of a training run and the ``delta`` of its guarantee.

    Attributes:
        releases: every :class:`~lipdp.accounting.mechanisms.Release` of the run.
        delta: the ``delta`` of the ``(epsilon, delta)`` guarantee.
        noise_multipliers: the multipliers of the Gaussians of one step (one per trainable
            variable for the ``"per-layer"`` strategy), for reports.
        noise_multiplier: the user's ``sigma`` they derive from (``sigma * nm_coef``).
        non_private: a reference run without noise (``epsilon = inf`` after any step).
        search: a :class:`~lipdp.accounting.tuning_cost.RandomSearch`: the run is the one
            selected by a private hyper-parameter search of that many runs, each of these
            releases; ``epsilon`` is the search's (RDP accountant only).
        spent: ``((mechanism, count), ...)``: what the model has already released (its
            :class:`~lipdp.core.ledger.PrivacyLedger`; ``None`` for steps without noise).
        spent_counts: ``((label, count), ...)``: the releases already made, per label.
        steps_done: the gradient steps this model has taken (``None``: those of
            ``spent_counts``); the remaining steps of ``E`` epochs are counted from it.
            (They differ when the ledger also holds the steps of another model that
            trained the same layers.)
        spent_searches: hyper-parameter searches some recorded step ran under: the
            epsilon is that of the most costly of them and ``search``.

    **Past and future.** ``epsilon(E)`` is the guarantee of the model once it has trained
    ``E`` epochs *in total*: the releases already made (``spent``), priced as they ran,
    composed with the releases the current configuration still has to make to reach
    ``E`` epochs -- ``max(0, count(E) - spent)`` of each release, ``count(E)`` counted
    from the first step (for gradient steps ``E x steps_per_epoch``). A fresh model
    (nothing spent) gets the usual plan; a trained model never less than what it spent,
    whatever changed since (rule S10).
    """

    releases: tuple
    delta: float
    noise_multipliers: tuple = ()
    noise_multiplier: float | None = None
    non_private: bool = False
    notes: tuple = field(default_factory=tuple)
    search: RandomSearch | None = None
    spent: tuple = ()
    spent_counts: tuple = ()
    steps_done: int | None = None
    spent_searches: tuple = ()

    def __post_init__(self):
        self._set("search", RandomSearch.coerce(self.search))
        self._set("delta", validation.delta(self.delta))
        self._set("releases", tuple(self.releases))
        self._set("noise_multipliers", tuple(self.noise_multipliers))
        self._set("spent", tuple((m, int(c)) for m, c in self.spent if c))
        self._set("spent_counts", tuple(dict(self.spent_counts).items()))
        self._set("spent_searches", tuple(self.spent_searches))

    # ------------------------------------------------------------------- building
    @classmethod
    def for_training(
        cls,
        *,
        noise_multipliers,
        sampling_rate,
        steps_per_epoch,
        delta,
        other_releases=(),
        non_private=False,
        noise_multiplier=None,
        search=None,
        ledger=None,
        steps_done=None,
    ) -> PrivacyPlan:
        """The plan of DP-SGD: ``steps_per_epoch`` subsampled Gaussian steps per epoch
        (``sigma_eff`` of :func:`~lipdp.accounting.mechanisms.effective_noise_multiplier`
        of ``noise_multipliers``, rate ``sampling_rate``) and ``other_releases``.
        ``noise_multiplier``: the ``sigma`` the multipliers are proportional to (default:
        the single multiplier). ``search``: the :class:`RandomSearch` the run was selected
        by, if any. ``ledger``: the :class:`~lipdp.core.ledger.PrivacyLedger` of what the model
        has already released (class docstring); ``steps_done``: the steps the model has
        taken itself."""
        steps_per_epoch = validation.count("steps_per_epoch", steps_per_epoch, 1)
        rate = validation.probability("sampling_rate", sampling_rate)
        spent = {}
        if ledger is not None:
            spent = {
                "spent": ledger.terms(),
                "spent_counts": tuple(ledger.counts_by_label().items()),
                "spent_searches": ledger.searches(),
                "steps_done": steps_done,
            }
        if non_private:
            return cls((), delta, (), non_private=True, **spent)
        sigmas = noise_multiplier_list(noise_multipliers)
        step = SubsampledGaussian(effective_noise_multiplier(sigmas), rate)
        steps = Release(step, GRADIENT_STEPS, per_epoch=steps_per_epoch)
        if noise_multiplier is None:
            if len(sigmas) != 1:
                raise ValueError("noise_multiplier is needed with several noise multipliers.")
            noise_multiplier = sigmas[0]
        sigma = validation.positive("noise_multiplier", noise_multiplier)
        releases = (steps, *other_releases)
        return cls(releases, delta, tuple(sigmas), sigma, search=search, **spent)

    def with_noise_multiplier(self, sigma: float) -> PrivacyPlan:
        """The same plan with the user's ``sigma`` replaced (every multiplier of the
        gradient steps rescaled, ``nm_coef`` ratios kept): what calibration searches."""
        sigma = validation.positive("sigma", sigma)
        if self.non_private or self.noise_multiplier is None:
            raise ValueError("this plan has no noise multiplier to change (non-private).")
        factor = sigma / self.noise_multiplier
        releases = tuple(
            replace(
                r,
                mechanism=replace(
                    r.mechanism, noise_multiplier=factor * r.mechanism.noise_multiplier
                ),
            )
            if r.label == GRADIENT_STEPS
            else r
            for r in self.releases
        )
        sigmas = tuple(factor * s for s in self.noise_multipliers)
        return replace(self, releases=releases, noise_multipliers=sigmas, noise_multiplier=sigma)

    # ----------------------------------------------------------------- accounting
    def future_count(self, release: Release, epochs: int) -> int:
        """Runs of ``release`` still to come before ``epochs`` epochs in total (class
        docstring)."""
        done = dict(self.spent_counts).get(release.label, 0)
        if release.label == GRADIENT_STEPS and self.steps_done is not None:
            done = self.steps_done
        return max(0, release.count(epochs) - done)

    def terms(self, epochs: int) -> tuple:
        """``((mechanism, count), ...)`` of the model after ``epochs`` epochs in total:
        what it spent and what is still to come; equal mechanisms merged (running one
        mechanism ``a`` then ``b`` times is running it ``a + b`` times)."""
        epochs = validation.count("epochs", epochs)
        counts = dict(self.spent)
        for release in self.releases:
            n = self.future_count(release, epochs)
            if n:
                counts[release.mechanism] = counts.get(release.mechanism, 0) + n
        return tuple(counts.items())

    def epsilon(self, epochs: int, accountant="rdp") -> float:
        """``epsilon`` after ``epochs`` epochs in total (class docstring; 0 for a model
        that has released nothing and trains none; ``inf`` once a step without noise
        is run)."""
        epochs = validation.count("epochs", epochs)
        engine = get_accountant(accountant)
        if self.non_private and epochs:
            return math.inf
        terms = self.terms(epochs)
        if not terms:
            return 0.0
        if any(mechanism is None for mechanism, _ in terms):
            return math.inf
        searches = set(self.spent_searches) | ({self.search} if self.search else set())
        if searches:
            if getattr(engine, "name", None) != "rdp":
                raise ValueError(
                    f"The cost of a hyper-parameter search is computed in RDP (Papernot & "
                    f"Steinke); accountant={accountant!r} cannot account for it: use "
                    "accountant='rdp'."
                )
            # Steps that ran under several declared searches: the most costly one.
            return max(search_epsilon(terms, self.delta, search) for search in searches)
        return float(engine.epsilon(terms, self.delta))

    def steps(self, epochs: int) -> int:
        """Gradient steps of the model after ``epochs`` epochs in total (spent and to
        come)."""
        done = dict(self.spent_counts).get(GRADIENT_STEPS, 0)
        if self.steps_done is not None:
            done = max(done, self.steps_done)
        steps = [r for r in self.releases if r.label == GRADIENT_STEPS]
        future = sum(self.future_count(r, epochs) for r in steps)
        return done + future

    def max_epochs(
        self, epsilon_max, epochs_max=1024, safe=True, atol=1e-2, accountant="rdp"
    ) -> int:
        """Largest number of epochs whose ``epsilon`` stays within ``epsilon_max``.

        With ``e*`` the largest ``e`` in ``[1, epochs_max]`` with
        ``epsilon(e) <= epsilon_max``: ``safe=True`` returns ``e*`` (never over budget);
        ``safe=False`` returns ``e* + 1`` if ``epsilon(e* + 1) <= epsilon_max + atol``
        (the non-safe mode of the original package, which may exceed the budget by
        ``atol``). ``epochs_max=None`` searches without an upper end (doubling). If
        ``epsilon(epochs_max) <= epsilon_max`` the answer is ``epochs_max`` (a warning
        says the budget allows more). ``epsilon`` is non-decreasing in the number of
        epochs (more compositions of the same mechanisms), so bisection is exact.

        Raises:
            ValueError: a non-private plan, or a budget that one epoch already exceeds
                (the original package returned 0 epochs there; an error names the fix).
        """
        epsilon_max = validation.positive("epsilon_max", epsilon_max)
        atol = validation.non_negative("atol", atol)
        if self.non_private:
            raise ValueError(
                "The model is non_private (no noise): its epsilon is infinite, no number of "
                "epochs fits in a finite budget."
            )

        def epsilon(epochs):
            return self.epsilon(epochs, accountant)

        first = epsilon(1)
        if first > epsilon_max:
            if not safe and first <= epsilon_max + atol:
                return 1
            spent = " (with what the model has already released)" if self.spent else ""
            raise ValueError(
                f"One epoch already costs epsilon={first:.5g}{spent} > epsilon_max="
                f"{epsilon_max:g} ({self.describe_short()}). Use a larger noise multiplier, a "
                "smaller batch size or a larger budget."
            )
        if epochs_max is None:
            epochs_max = _first_over_budget(epsilon, epsilon_max)
        epochs_max = validation.count("epochs_max", epochs_max, 1)
        last = epsilon(epochs_max)
        if last <= epsilon_max:
            logger.warning(
                "epsilon after epochs_max=%d epochs is %.5g <= epsilon_max=%g: returning "
                "epochs_max; raise epochs_max to use the whole budget.",
                epochs_max,
                last,
                epsilon_max,
            )
            return epochs_max
        low = _bisect(epsilon, epsilon_max, 1, epochs_max)
        high = low + 1
        if not safe and epsilon(high) <= epsilon_max + atol:
            return high
        return low

    # -------------------------------------------------------------------- reports
    def describe(self, epochs: int) -> list[dict]:
        """One dict per release of the current configuration: label, mechanism, count
        after ``epochs`` epochs in total (spent under any mechanism and to come)."""
        spent = dict(self.spent_counts)
        return [
            {
                "release": r.label,
                "mechanism": r.mechanism.describe(),
                "count": spent.get(r.label, 0) + self.future_count(r, epochs),
            }
            for r in self.releases
        ]

    def describe_short(self) -> str:
        parts = [f"delta={self.delta:g}"]
        for r in self.releases:
            parts.append(f"{r.label}: {r.mechanism.describe()}")
        if self.search is not None:
            parts.append(self.search.describe())
        return "; ".join(parts)


def _first_over_budget(epsilon: Callable[[int], float], epsilon_max: float) -> int:
    """Smallest power of two whose ``epsilon`` exceeds the budget."""
    epochs = 1
    while epsilon(epochs) <= epsilon_max:
        epochs *= 2
        if epochs > EPOCHS_SEARCH_LIMIT:
            raise ValueError(
                f"epsilon stays <= {epsilon_max:g} for {EPOCHS_SEARCH_LIMIT} epochs; pass a "
                "finite epochs_max."
            )
    return epochs


def _bisect(epsilon, epsilon_max, low, high) -> int:
    """Largest ``e`` in ``[low, high)`` with ``epsilon(e) <= epsilon_max``, given
    ``epsilon(low) <= epsilon_max < epsilon(high)``."""
    while high - low > 1:
        middle = (low + high) // 2
        if epsilon(middle) <= epsilon_max:
            low = middle
        else:
            high = middle
    return low


def dp_event(terms):
    """``terms`` as one ``dp_accounting`` event (for ``dp_accounting``'s own accountants):
    ``ComposedDpEvent([SelfComposedDpEvent(mechanism, count), ...])``."""
    from dp_accounting import dp_event as events

    return events.ComposedDpEvent(
        [events.SelfComposedDpEvent(m.dp_event(), c) for m, c in terms if c > 0]
    )


__all__ = ["GRADIENT_STEPS", "PrivacyPlan", "dp_event"]
