"""Keras callbacks: the privacy budget while training, and parameter averaging."""

from __future__ import annotations

import logging

import keras

from lipdp.accounting.budget import get_eps_delta
from lipdp.accounting.registry import get_accountant, is_approximate
from lipdp.foundation import validation

logger = logging.getLogger(__name__)


class DP_Accountant(keras.callbacks.Callback):
    """Reports ``(epsilon, delta)`` after every epoch and can enforce a budget.

    ``epsilon`` and ``delta`` are written into the epoch ``logs``, so the Keras
    progress bar, ``History``, ``CSVLogger`` and ``TensorBoard`` show them (put this
    callback *before* loggers in the callbacks list: Keras calls them in order; the
    progress bar and History always come last).

    Args:
        log_fn: what receives ``{"epoch", "epsilon", "delta"}`` after each epoch: a
            callable (e.g. an experiment tracker's ``log``), or, as in the original
            ``deel.lipdp``, ``"logging"`` (this module's logger, level INFO),
            ``"wandb"`` (``wandb.log``; wandb is optional, imported only then) or
            ``"all"`` (both). Default ``None``: the logs only (the original's default
            ``"all"`` needed wandb).
        epsilon_budget: if set, training stops (``model.stop_training``) at the end of
            the last epoch whose ``epsilon`` stays within the budget, *before* an epoch
            that would exceed it, with a WARNING saying so (epochs done, epsilon spent,
            the budget; :attr:`stopped_by_budget`); if even the first epoch would exceed
            it, ``fit`` raises ``ValueError`` before any step is taken.
        accountant: ``"rdp"`` (default, as the original package) or ``"pld"``.

    Epochs are counted from the model's first training step: a model trained by
    several ``fit`` calls, reloaded, or recompiled keeps its count (``model.noisy_steps``,
    converted by :meth:`lipdp.foundation.metadata.DatasetMetadata.epochs_for_steps`: a partial epoch
    counts as a whole one). ``epsilon`` is that of the model's privacy plan
    (:meth:`lipdp.clipless.model.DP_Model.privacy_plan`), the plan ``get_eps_delta`` and
    ``get_max_epochs`` read before training: the composition of what the model released
    (its privacy ledger, :mod:`lipdp.core.ledger`, priced as it ran, whatever changed since)
    and of what the current configuration still has to release to complete the epoch.
    It never decreases from one epoch to the next.
    """

    def __init__(self, log_fn=None, epsilon_budget=None, accountant="rdp"):
        super().__init__()
        if epsilon_budget is not None:
            epsilon_budget = validation.positive("epsilon_budget", epsilon_budget)
        self.log_fn = _log_function(log_fn)
        self.epsilon_budget = epsilon_budget
        #: ``(epochs done, epsilon spent)`` when the budget stopped training, else None.
        self.stopped_by_budget = None
        get_accountant(accountant)  # an unknown name is refused now, not after epoch 1
        self.accountant = accountant

    def _epsilon(self, epochs: int) -> tuple[float, float]:
        return get_eps_delta(self.model, epochs, accountant=self.accountant)

    def _epochs_done(self) -> int:
        return epochs_trained(self.model)

    def on_train_begin(self, logs=None):
        self.stopped_by_budget = None
        metadata = self.model.dataset_metadata
        _warn_once_about_shuffling(metadata)
        if is_approximate(self.accountant):
            logger.warning(
                "accountant %r is a central-limit approximation: the epsilon in the logs "
                "(and any budget enforced with it) is not a proven upper bound.",
                self.accountant,
            )
        steps = (self.params or {}).get("steps")
        if steps is not None and steps != metadata.nb_steps_per_epochs:
            raise ValueError(
                f"fit runs {steps} steps per epoch but dataset_metadata.nb_steps_per_epochs "
                f"is {metadata.nb_steps_per_epochs}: the accountant would count the wrong "
                "number of steps. Make the data pipeline and the metadata agree."
            )
        if self.epsilon_budget is not None:
            next_epsilon, _ = self._epsilon(self._epochs_done() + 1)
            if next_epsilon > self.epsilon_budget:
                raise ValueError(
                    f"One more epoch would reach epsilon = {next_epsilon:.4g} > budget "
                    f"{self.epsilon_budget:g}. Increase the noise multiplier, reduce the "
                    "batch size, or raise the budget."
                )

    def on_epoch_end(self, epoch, logs=None):
        epochs = self._epochs_done()
        epsilon, delta = self._epsilon(epochs)
        if logs is not None:
            logs["epsilon"] = epsilon
            logs["delta"] = delta
        logger.info("epoch %d: (epsilon = %.5g, delta = %g)-DP", epochs, epsilon, delta)
        if self.log_fn is not None:
            self.log_fn({"epoch": epochs, "epsilon": epsilon, "delta": delta})
        if self.epsilon_budget is not None:
            next_epsilon, _ = self._epsilon(epochs + 1)
            if next_epsilon > self.epsilon_budget:
                self.model.stop_training = True
                planned = (self.params or {}).get("epochs")
                if planned is not None and epoch + 1 >= planned:
                    return  # the last epoch of fit: the budget ends nothing
                self.stopped_by_budget = (epochs, epsilon)
                logger.warning(
                    "the privacy budget ended training after epoch %d%s: epsilon = %.4g "
                    "spent, and epoch %d would reach %.4g > the budget %g.",
                    epochs,
                    "" if planned is None else f" ({epoch + 1} of the {planned} of this fit)",
                    epsilon,
                    epochs + 1,
                    next_epsilon,
                    self.epsilon_budget,
                )


#: The original ``deel.lipdp``'s names of ``DP_Accountant``'s ``log_fn``.
LOG_FUNCTIONS = ("logging", "wandb", "all")


def _log_function(log_fn):
    """``log_fn`` of :class:`DP_Accountant` as a callable (or ``None``): a callable as
    given, or one of :data:`LOG_FUNCTIONS`."""
    if log_fn is None or callable(log_fn):
        return log_fn
    if log_fn not in LOG_FUNCTIONS:
        raise ValueError(
            f"log_fn must be a callable or one of {', '.join(map(repr, LOG_FUNCTIONS))}, "
            f"got {log_fn!r}."
        )

    def log_info(values):
        logger.info("%s", values)

    if log_fn == "logging":
        return log_info
    try:
        import wandb
    except ImportError:
        raise ImportError(
            f"log_fn={log_fn!r} needs wandb, which is not installed: pip install wandb, "
            "or use log_fn='logging'."
        ) from None
    if log_fn == "wandb":
        return wandb.log

    def log_both(values):
        wandb.log(values)
        log_info(values)

    return log_both


_SHUFFLE_WARNED = []


def _warn_once_about_shuffling(metadata) -> None:
    """Rule S7: shuffled fixed-size batches are accounted as Poisson samples, which is not
    a proven guarantee; say it once per process."""
    if metadata.sampling == "shuffle" and not _SHUFFLE_WARNED:
        _SHUFFLE_WARNED.append(True)
        logger.warning(
            "training with shuffled fixed-size batches: the reported epsilon assumes Poisson "
            "sampling and is not a proven guarantee for shuffling. Use "
            "DatasetMetadata(sampling='poisson') with lipdp.pipeline.poisson_batches "
            "(the lipdp command: --sampling poisson)."
        )


def noisy_steps_taken(model) -> int:
    """Noisy steps ``model`` has taken: its ``noisy_steps`` variable (saved with the model,
    kept across optimizers), or its optimizer's step count for other models."""
    steps = getattr(model, "noisy_steps", None)
    if steps is None:
        optimizer = getattr(model, "optimizer", None)
        steps = None if optimizer is None else optimizer.iterations
    return 0 if steps is None else int(steps.numpy())


def epochs_trained(model) -> int:
    """Epochs begun by ``model`` (:func:`noisy_steps_taken`, a partial epoch counts)."""
    return model.dataset_metadata.epochs_for_steps(noisy_steps_taken(model))


class ParameterAveraging(keras.callbacks.Callback):
    r"""Exponential moving average of the weights, swapped in when training ends.

    After every training step (once the weights are projected) each trainable variable's
    average is updated, ``a <- d a + (1 - d) w`` (``d = decay``; the first step sets
    ``a = w``), and at the end of ``fit`` the averages replace the weights. Evaluating
    the average of the iterates is one of the regularisations Lip-DP-SGD borrows from
    De et al. (2022).

    **Privacy**: free. The averages are a function of the released (noisy, projected)
    iterates only: post-processing. **Bounds**: every constraint set of lipdp is convex
    or inside a convex ball its bounds are proven for (spectral and Frobenius balls,
    bias balls; orthogonal matrices times ``C`` lie in the spectral ball of radius
    ``C``), so an average of feasible iterates keeps the bounds -- the averaged model's
    certified radii and any further training stay sound. The averaged weights are not
    re-projected (that would undo the averaging of orthogonal kernels).

    Keras's own ``optimizer(use_ema=True)`` is not used: it averages inside
    ``apply_gradients``, before lipdp projects the weights, so its averages could leave
    the constraint sets.

    With ``compile(steps_per_execution=k)`` Keras calls the callback once per ``k`` steps,
    so the average is over every ``k``-th iterate.

    Args:
        decay: ``d`` in ``[0, 1)``; ``0.999`` averages over about the last 1000 steps.
        swap_on_end: replace the weights by the averages when ``fit`` ends (default);
            ``False`` keeps them in :attr:`averages` (see :meth:`assign_averages`).
    """

    def __init__(self, decay=0.999, swap_on_end=True):
        super().__init__()
        self.decay = validation.real("decay", decay, low=0.0, high=1.0, low_open=False)
        self.swap_on_end = bool(swap_on_end)
        self.averages = None

    def on_train_begin(self, logs=None):
        if self.averages is None:
            import tensorflow as tf

            self.averages = [
                tf.Variable(v, trainable=False, name="average")
                for v in self.model.trainable_variables
            ]
            self._fresh = True

    def on_train_batch_end(self, batch, logs=None):
        decay = 0.0 if self._fresh else self.decay
        self._fresh = False
        for average, variable in zip(self.averages, self.model.trainable_variables):
            average.assign(decay * average + (1.0 - decay) * variable)

    def on_train_end(self, logs=None):
        if self.swap_on_end:
            self.assign_averages()

    def assign_averages(self) -> None:
        """Write the averages into the model's trainable variables."""
        if self.averages is None:
            raise ValueError("ParameterAveraging has no averages yet: train with it first.")
        for average, variable in zip(self.averages, self.model.trainable_variables):
            variable.assign(average)
