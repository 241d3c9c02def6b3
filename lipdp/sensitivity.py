"""Privacy budget planning: how many epochs fit in a given ``epsilon``.

``epsilon`` is a non-decreasing function of the number of epochs (more compositions of
the same mechanisms), so the largest number of epochs under a budget is found by
bisection. Each evaluation uses the cached accountant of :mod:`lipdp.accounting` (the
one-step RDP curve is computed once per ``(sigma_eff, q)``), so a search over
``1..1024`` epochs costs about ten sub-millisecond evaluations after the first.
"""

from __future__ import annotations

import logging
import math

from lipdp.accounting import _check_count, _check_real, _epsilon_after, _model_accounting

logger = logging.getLogger(__name__)

__all__ = ["get_max_epochs"]


def get_max_epochs(epsilon_max, model, epochs_max=1024, safe=True, atol=1e-2, accountant="rdp"):
    """Largest number of epochs whose ``epsilon`` stays within ``epsilon_max``.

    With ``eps(e)`` the ``epsilon`` of :func:`lipdp.accounting.get_eps_delta` after ``e``
    epochs and ``e*`` the largest ``e`` in ``[1, epochs_max]`` with
    ``eps(e) <= epsilon_max``:

    * ``safe=True`` returns ``e*``: training for the returned number of epochs never
      exceeds the budget.
    * ``safe=False`` returns ``e* + 1`` if ``eps(e* + 1) <= epsilon_max + atol`` (and
      ``e* < epochs_max``), else ``e*``: it may exceed the budget by at most ``atol``,
      like the non-safe mode of the original package (which returned the first epoch
      count reaching the budget).

    If ``eps(epochs_max) <= epsilon_max``, ``epochs_max`` is returned and a warning is
    logged (the budget would allow more epochs).

    Args:
        epsilon_max: the privacy budget (> 0).
        model: a :class:`lipdp.model.DP_Model` with ``dataset_metadata``.
        epochs_max: upper end of the search (integer >= 1).
        safe: see above.
        atol: tolerance of ``safe=False`` (>= 0).
        accountant: ``"rdp"`` (autodp's numbers) or ``"pld"``.

    Raises:
        ValueError: invalid arguments, a non-private model, or a budget that one epoch
            already exceeds (the message gives ``epsilon`` of one epoch).
    """
    epsilon_max = _check_real("epsilon_max", epsilon_max, low=0.0)
    epochs_max = _check_count("epochs_max", epochs_max, minimum=1)
    atol = _check_real("atol", atol, low=0.0, low_open=False)
    acc, steps_per_epoch, dynamic, delta = _model_accounting(model, accountant)
    if acc is None:
        raise ValueError(
            "The model is non_private (no noise): its epsilon is infinite, no number of "
            "epochs fits in a finite budget."
        )

    def epsilon(epochs):
        return _epsilon_after(acc, steps_per_epoch, dynamic, epochs)

    first = epsilon(1)
    if first > epsilon_max:
        if not safe and first <= epsilon_max + atol:
            return 1
        rate = model.dataset_metadata.sampling_rate
        raise ValueError(
            f"One epoch already costs epsilon={first:.5g} > epsilon_max={epsilon_max:g} "
            f"(delta={delta:g}, {steps_per_epoch} steps per epoch, sampling rate "
            f"q={rate:.4g}, noise multiplier "
            f"{model.dp_parameters.noise_multiplier:g}). Use a larger noise multiplier, a "
            "smaller batch size or a larger budget."
        )
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
    low, high = 1, epochs_max  # eps(low) <= epsilon_max < eps(high)
    while high - low > 1:
        mid = (low + high) // 2
        if epsilon(mid) <= epsilon_max:
            low = mid
        else:
            high = mid
    logger.debug(
        "get_max_epochs: eps(%d)=%.6g <= %g < eps(%d)=%.6g",
        low,
        epsilon(low),
        epsilon_max,
        high,
        epsilon(high),
    )
    if not safe and math.isfinite(epsilon(high)) and epsilon(high) <= epsilon_max + atol:
        return high
    return low
