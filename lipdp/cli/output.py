"""What ``lipdp`` prints: the line that states a run, the ``--quiet`` epoch lines and the
lines of ``lipdp evaluate``'s report. Text only: the numbers come from the recipes
(:mod:`lipdp.recipes.runs`, :mod:`lipdp.recipes.run_evaluation`)."""

from __future__ import annotations

import math
import time


def run_line(verb, prepared, replicas=None) -> str:
    """``lipdp train: digits, 1536 training examples, batch 512, method lipdp (...), adam
    0.01, noise multiplier 6.0, global noise, budget (epsilon = 3.0, delta = 1e-05) -> 46
    epochs``."""
    run, epochs = prepared.run, prepared.epochs
    recipe = run.model.resolved()
    devices = f", {replicas} replicas" if replicas else ""
    if recipe.physical_batch_size is not None:
        devices += f" computed {recipe.physical_batch_size} rows at a time"
    return (
        f"lipdp {verb}: {recipe.dataset}, {len(prepared.x_train)} training examples, batch "
        f"{recipe.batch_size}{devices}, method {recipe.method} ({method_detail(recipe)}), "
        f"{optimizer_detail(recipe)}, noise multiplier {recipe.noise_multiplier}, "
        f"{recipe.strategy} noise, budget "
        f"(epsilon = {run.epsilon}, delta = {recipe.delta}) -> {epochs} "
        f"epoch{'' if epochs == 1 else 's'}"
    )


def optimizer_detail(recipe) -> str:
    """``adam 0.01`` or ``sgd 16 (momentum 0.9)``: the optimiser and its learning rate."""
    detail = f"{recipe.optimizer} {recipe.learning_rate:g}"
    return detail + (f" (momentum {recipe.momentum:g})" if recipe.momentum else "")


def method_detail(recipe) -> str:
    """The method's settings: clipping (dp-sgd) or kernel balls (clipless), and the PGD of
    adversarial training."""
    from lipdp.recipes.model_factory import adversarial

    detail = _family_detail(recipe)
    attack = adversarial(recipe)
    return detail if attack is None else f"{detail}; adversarial {attack.describe()}"


def _family_detail(recipe) -> str:
    if recipe.method == "dp-sgd":
        detail = f"{recipe.clipping} clipping, R = {recipe.clip_norm:g}"
        if recipe.clipping == "global":
            detail += f", Z = {recipe.clip_threshold:g}"
        if recipe.bam is not None:
            detail += f", BAM lambda = {recipe.bam:g}"
        if recipe.dp_sat is not None:
            detail += f", DP-SAT rho = {recipe.dp_sat:g}"
        return detail
    network = "scattering + linear head" if recipe.scattering else "Lipschitz network"
    detail = f"{network}, weight norm bound {recipe.weight_norm_bound:g}, tau {recipe.tau:g}"
    if recipe.gradient_clip is not None and recipe.gradient_clip != math.inf:
        detail += f", logit gradients clipped at {recipe.gradient_clip:g}"
    return detail


def epoch_lines(epochs):
    """``--quiet`` progress: a Keras callback printing one line per epoch with epsilon,
    and after the second epoch (the first includes the compilation) an estimate of the
    time left."""
    import keras  # here, not at the top: the command silences TensorFlow's start-up lines
    # (lipdp.cli.commands) before the first import of TensorFlow

    class EpochLines(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()
            self.first = None

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            elapsed = time.perf_counter() - self.start
            line = (
                f"epoch {epoch + 1}/{epochs}: loss {logs.get('loss', float('nan')):.4f}, "
                f"accuracy {logs.get('accuracy', float('nan')):.4f}, "
                f"epsilon {logs.get('epsilon', float('nan')):.4f} ({elapsed:.1f} s)"
            )
            if epoch == 0:
                self.first = elapsed
            elif epoch == 1 and epochs > 2:
                left = (elapsed - self.first) * (epochs - 2)
                line += f"; about {left:.0f} s to go"
            print(line, flush=True)

    return EpochLines()


def evaluation_lines(results, config) -> list:
    """``lipdp evaluate``'s report after the privacy report: test accuracy, certificates,
    robustness table, calibration, membership inference."""
    lines = [f"test accuracy: {results.accuracy:.4f} ({results.test_examples} examples)"]
    if results.lipschitz is not None:
        lines.append(
            f"Lipschitz constant w.r.t. the raw input (from the layers): {results.lipschitz:.6g}"
        )
        lines.append(
            f"certified l2 radius in raw input units ({_CERTIFICATES[results.certificate]}): "
            f"median {results.median_radius:.4g} over the correctly classified test examples"
        )
        lines.append("certified accuracy (l2 radius: accuracy):")
        for radius, value in zip(config.radii, results.certified):
            lines.append(f"  {radius:g}: {value:.4f}")
    else:
        lines.append("certified accuracy: none (a clipped DP-SGD network has no Lipschitz bound)")
    if results.robustness is not None:
        lines += robustness_table(results, config)
    calibration = results.calibration
    lines.append(
        f"calibration ({config.bins} bins): ECE {calibration.ece:.4f}, MCE "
        f"{calibration.mce:.4f}, NLL {calibration.nll:.4f}"
    )
    lines.append(_membership_line(results.membership))
    return lines


#: How ``lipdp evaluate`` names each certificate (:func:`lipdp.evaluation.model_certified_radius`).
_CERTIFICATES = {
    "global": "margin / (sqrt 2 L)",
    "local": "local certificate: the group normalisation's slope on the ball around each "
    "example instead of its worst case 1/alpha",
}


def robustness_table(results, config) -> list:
    """The ``--attack-*`` table: accuracy under PGD (and certified, for Lipschitz models)
    at each radius."""
    curves = results.robustness
    columns = [key for key in curves if key != "radii"]
    lines = [
        f"robustness ({results.attacked} test examples; PGD {config.attack_steps} steps, "
        f"{config.attack_restarts} restart(s): an upper bound on robust accuracy; certified: "
        "a lower bound; linf certificates from the l2 ball containing the linf ball):",
        "  radius | " + " | ".join(c.replace("_", " ") for c in columns),
    ]
    for i, radius in enumerate(curves["radii"]):
        values = " | ".join(f"{curves[c][i]:.4f}" for c in columns)
        lines.append(f"  {radius:g} | {values}")
    return lines


def _membership_line(mia) -> str:
    summary = mia.summary()
    return (
        f"membership inference (train vs test, empirical): AUROC "
        f"{summary['mia_auc_entire_dataset']:.4f} (loss threshold "
        f"{mia.result('loss threshold').auroc:.4f}, logistic regression "
        f"{mia.result('logistic regression').auroc:.4f}), advantage "
        f"{summary['mia_adv_entire_dataset']:.4f}"
    )
