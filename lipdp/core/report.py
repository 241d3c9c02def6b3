"""What a privacy guarantee rests on, in one object (rule S7)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lipdp.accounting.plan import GRADIENT_STEPS
from lipdp.accounting.registry import is_approximate
from lipdp.core.callbacks import epochs_trained
from lipdp.core.noise import reproducible_noise_seed
from lipdp.foundation import validation

NEIGHBOURING = "add/remove one example"

_SAMPLING = {
    "shuffle": (
        "NOT A PROVEN GUARANTEE for how this model was trained: epsilon is computed for "
        "Poisson subsampling with rate q = b/N, but training used shuffled fixed-size "
        "batches (as the original lip-dp), and the Poisson analysis can under-state the "
        "privacy loss of shuffling (Chua et al., ICML 2024). For a proven guarantee train "
        "with DatasetMetadata(sampling='poisson') and lipdp.pipeline.poisson_batches (the "
        "default of lipdp train)."
    ),
    "poisson": "Poisson subsampling with rate q = b/N, exactly as trained (variable batch sizes).",
}


@dataclass
class PrivacyReport:
    epsilon: float
    delta: float
    accountant: str
    neighbouring_relation: str
    sampling: str
    sampling_assumption: str
    noise_strategy: str
    noise_multipliers: list
    sensitivities: dict
    steps: int
    epochs: int
    batch_size: int
    nb_samples_train: int
    dynamic_clipping: list | None = None
    notes: list = field(default_factory=list)
    #: What the model has released so far, one line per mechanism (its privacy ledger,
    #: :mod:`lipdp.core.ledger`).
    released: list = field(default_factory=list)

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.nb_samples_train

    def __str__(self) -> str:
        lines = [
            f"(epsilon = {self.epsilon:.4f}, delta = {self.delta:g})-DP "
            f"[{self.accountant.upper()} accountant, {self.neighbouring_relation}]",
            f"  steps: {self.steps} ({self.epochs} epoch{'' if self.epochs == 1 else 's'}, "
            f"batch {self.batch_size}, "
            f"N = {self.nb_samples_train}, q = {self.sampling_rate:.4g})",
            f"  sampling: {self.sampling_assumption}",
            f"  noise: {self.noise_strategy}, multipliers "
            + ", ".join(f"{s:.4g}" for s in self.noise_multipliers),
            "  sensitivities of the averaged gradient:",
        ]
        lines += [f"    {name}: {value:.4g}" for name, value in self.sensitivities.items()]
        for release in self.dynamic_clipping or []:
            lines.append(
                f"  composed: {release['release']}, {release['count']} x {release['mechanism']}"
            )
        if self.released:
            lines.append("  released so far (privacy ledger):")
            lines += [f"    {line}" for line in self.released]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def privacy_report(model, epochs: int | None = None, accountant: str = "rdp") -> PrivacyReport:
    """The guarantee of ``epochs`` epochs of training ``model`` and its assumptions.

    ``epochs=None``: the epochs the model has begun
    (:func:`lipdp.core.callbacks.epochs_trained`).
    ``epochs`` counts epochs in total: what the model released so far (its privacy
    ledger) is priced as it ran, the rest with the current configuration
    (:class:`~lipdp.accounting.plan.PrivacyPlan`). Every number comes from the model's
    privacy plan, bound pass and noise rule, the same objects training and
    ``get_eps_delta`` use.
    """

    if epochs is None:
        epochs = epochs_trained(model)
    epochs = validation.count("epochs", epochs)
    plan = model.privacy_plan()
    metadata = model.dataset_metadata
    notes = list(metadata.notes)
    if metadata.multiplicity:
        notes.append(
            f"augmentation multiplicity {metadata.multiplicity}: each example contributes "
            "the mean loss of its augmented copies (the sensitivity is per original example)."
        )
    if model.dp_parameters.non_private:
        notes.append("non-private reference run: no noise, no guarantee.")
    if getattr(model, "row_isolation", False):
        notes.append(
            "row isolation: in training every layer lipdp does not own, its activation and "
            "the loss run on one example at a time, forward and backward, and state kept "
            "between examples is refused (lipdp.core.isolation): no example's loss depends "
            "on another's by construction (rule S2), without the batch-independence probe."
        )
    elif not getattr(model, "independence_probe", True):
        notes.append(
            "batch-independence probe skipped (independence_probe=False): that no layer or "
            "loss mixes the examples of a batch (rule S2) rests on the structural walk "
            "(no trainable BatchNormalization or declared coupling layer at any depth) and "
            "on the user's word, not on the numerical check."
        )
    if any(getattr(layer, "adaptive_norm", False) for layer in model._flatten_layers()):  # noqa: SLF001
        notes.append(
            "norm-adaptive bounds (Lip-DP-SGD): the sensitivities above are those of the "
            "current weights; every step's noise followed the weights of that step, a "
            "function of earlier released iterates (post-processing, no privacy cost)."
        )
    if plan.search is not None:
        notes.append(
            f"hyper-parameter search included: this run was selected by a "
            f"{plan.search.describe()} (Papernot & Steinke, Theorem 2); valid if K was drawn "
            "from that law, every run had these parameters (or fewer steps) and only the "
            "selected run is released."
        )
    adversarial = getattr(model, "adversarial", None)
    if adversarial is not None:
        notes.append(
            f"adversarial training ({adversarial.describe()}): each example's adversarial "
            "version is computed from that example and the current (released) weights, a "
            "per-example transformation; sensitivities and epsilon are those of clean "
            "training (lipdp.core.adversarial)."
        )
    if is_approximate(accountant):
        notes.append(
            f"APPROXIMATE EPSILON: the {accountant!r} accountant is a central-limit "
            "approximation (Gaussian DP), not an upper bound; it can under-state the privacy "
            "loss. Use accountant='rdp' or 'pld' for a guarantee."
        )
    seed = reproducible_noise_seed()
    if seed is not None:
        notes.append(
            f"REPRODUCIBLE NOISE (lipdp.core.noise.use_reproducible_noise({seed})): anyone who "
            "knows the seed can regenerate the noise; for debugging only, not a private release."
        )
    elif model.privacy_ledger.reproducible():
        notes.append(
            "REPRODUCIBLE NOISE: some of this model's steps drew their noise from a seeded "
            "generator (lipdp.core.noise.use_reproducible_noise; see the ledger lines): anyone "
            "who knows the seed can regenerate it; not a private release."
        )
    searches = [s for s in plan.spent_searches if s != plan.search]
    if searches:
        notes.append(
            "hyper-parameter search recorded in the ledger (no longer declared): epsilon "
            "includes the most costly of " + ", ".join(s.describe() for s in searches) + "."
        )
    releases = [r for r in plan.describe(epochs) if r["release"] != GRADIENT_STEPS]
    return PrivacyReport(
        epsilon=plan.epsilon(epochs, accountant),
        delta=plan.delta,
        accountant=accountant,
        neighbouring_relation=NEIGHBOURING,
        sampling=metadata.sampling,
        sampling_assumption=_SAMPLING[metadata.sampling],
        noise_strategy=model.dp_parameters.noisify_strategy,
        noise_multipliers=list(plan.noise_multipliers),
        sensitivities={entry.key: float(delta) for entry, delta in model.sensitivities()},
        steps=plan.steps(epochs),
        epochs=epochs,
        batch_size=metadata.batch_size,
        nb_samples_train=metadata.nb_samples_train,
        dynamic_clipping=releases or None,
        notes=notes,
        released=model.privacy_ledger.describe(),
    )
