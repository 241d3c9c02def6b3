"""The ``lipdp`` command: arguments -> recipe -> printing.

``lipdp train`` trains a Lipschitz CNN under a privacy budget and prints the privacy
report and the test accuracy. With no option it uses scikit-learn's digits (bundled)
and (epsilon, delta) = (3, 1e-5); the number of epochs is the largest one that stays
within the budget (``get_max_epochs``) unless ``--epochs`` is given. ``--save PATH``
writes the trained model as ``.keras`` (with its privacy ledger).

``lipdp evaluate`` trains the same model (or loads a saved one with ``--model PATH``)
and prints the privacy report, the test accuracy, the certified accuracy at a few
radii, the accuracy under a PGD attack at the same radii, the calibration errors and
the AUROC of membership-inference attacks (see :mod:`lipdp.evaluation`).

``--adversarial-radius R`` (with ``--adversarial-norm``, ``--adversarial-steps``,
``--adversarial-mix``) trains on PGD adversarial examples (:mod:`lipdp.core.adversarial`).

Errors are one line on stderr and exit status 2: a bad value, and a flag the user typed
that the run would ignore (another method's, clipping's or optimiser's flag, a training
flag with ``evaluate --model``; :mod:`lipdp.cli.arguments`). Among them: ``--delta`` at
or above ``1/N`` (unless ``--allow-large-delta``: ``delta`` is the probability the
guarantee fails, and a mechanism releasing one record at random meets ``delta = 1/N``), a
``--data-dir`` that does not hold the data set (no fall-back to another copy), a
``--model`` that is not a Keras file, a ``--batch-size`` not divisible by ``--mirrored``.

Said, not silent: training ended early by the privacy budget (a line with the epochs
done, the epsilon spent and the budget), the rows ``--sampling shuffle`` never uses (a
warning with the batch size that keeps them). Ctrl-C prints one line on stderr -- the
epoch and step reached, the epsilon spent, where ``--save`` saved the partial model --
and exits with status 130.

The command holds no model, data or training code: :mod:`lipdp.cli.arguments` turns the
options into a :class:`~lipdp.recipes.recipe_config.RunConfig` (each option sets the recipe
field of the same name; which applies to which method is decided by
:mod:`lipdp.recipes.method_settings`), :mod:`lipdp.recipes.model_factory`,
:mod:`lipdp.recipes.runs` and :mod:`lipdp.recipes.run_evaluation` build, train and measure,
:mod:`lipdp.cli.output` words the results and :mod:`lipdp.cli.commands` prints them. A
benchmark or a test that needs "the CLI's model" builds it from the recipes.
"""

from lipdp.cli.commands import main

__all__ = ["main"]
