r"""Private hyper-parameter search: a random number of runs, the best one released.

Tuning on the private data is itself a release: the chosen configuration and the model
trained with it depend on every run of the search. :func:`private_random_search` runs the
search of Papernot & Steinke (ICLR 2022) whose cost the privacy plan accounts for
(:mod:`lipdp.accounting.tuning_cost`):

1. draw the number of runs ``K`` from the public law of a
   :class:`~lipdp.accounting.tuning_cost.RandomSearch` (random, independent of the data);
2. for each run, draw a configuration from ``sample(rng)`` — a fixed distribution, the
   same for every run (adaptive samplers that learn from earlier scores are outside the
   theorem) — and train it with ``train(config) -> (model, score)``;
3. keep the run with the best score; its ``DPParameters`` gain
   ``hyperparameter_search=search``, so that its ``get_eps_delta``, ``DP_Accountant`` and
   ``privacy_report`` state the epsilon of the whole search.

The guarantee needs every run to be the same mechanism: each run's releases (its plan
over the epochs it trained) are compared with the first run's, and a run that differs is
refused (the selected run's own plan then bounds every run). The score is part of each
run's output: compute it from public (or stand-in) validation data — a score read off
the private data without noise is a release the plan does not count. The other runs'
models, their scores and ``K`` are not part of the release (:class:`SearchResult` keeps
them for the data owner, like the training logs).

:func:`optuna_random_search` runs the same search with the configurations drawn by
Optuna's ``RandomSampler`` (search spaces written with ``trial.suggest_*``); adaptive
samplers are refused.

The alternative with no privacy cost: tune on public or stand-in data and train once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from lipdp.accounting.tuning_cost import RandomSearch

logger = logging.getLogger(__name__)


@dataclass
class SearchResult:
    """The selected run of a :func:`private_random_search`.

    Attributes:
        model: the selected model (its ``dp_parameters`` declare the search).
        config: its configuration; ``score``: its score.
        runs: ``K``, the number of runs drawn. ``scores``: every run's ``(config,
            score)``. Neither is part of the private release (module docstring).
    """

    model: object
    config: object
    score: float
    runs: int
    scores: list = field(default_factory=list)


def private_random_search(
    train, sample, search: RandomSearch, rng: np.random.Generator | None = None
) -> SearchResult:
    """Run a private random search (module docstring) and return the selected run.

    Args:
        train: ``config -> (model, score)``: builds and trains one lipdp model (either
            family) with that configuration; higher scores are better.
        sample: ``rng -> config``: draws a configuration (the same law for every run).
        search: the law of the number of runs.
        rng: numpy generator for ``K`` and the configurations (default: fresh entropy; a
            seeded generator makes the search reproducible, the privacy noise of each run
            stays unseeded).
    """
    search = RandomSearch.coerce(search)
    if search is None:
        raise ValueError("search must be a RandomSearch (the law of the number of runs).")
    rng = np.random.default_rng() if rng is None else rng
    runs = search.sample(rng)
    logger.info("private random search: %d run(s) (%s)", runs, search.describe())
    best, first, scores = None, None, []
    for index in range(runs):
        config = sample(rng)
        model, score = train(config)
        run = _run_terms(model)
        first = run if first is None else first
        _check_same_mechanism(first, run, index)
        score = float(score)
        scores.append((config, score))
        if best is None or _better(score, best[2]):
            best = (model, config, score)
    model, config, score = best
    model.dp_parameters = dataclasses.replace(model.dp_parameters, hyperparameter_search=search)
    return SearchResult(model, config, score, runs, scores)


def optuna_random_search(
    objective, search: RandomSearch, rng: np.random.Generator | None = None, study=None
) -> SearchResult:
    """:func:`private_random_search` with the configurations drawn by Optuna.

    ``objective(trial) -> (model, score)`` declares its search space with Optuna's
    ``trial.suggest_*`` calls (conditional spaces included) and trains one lipdp model.
    Every trial is asked from a study whose sampler is Optuna's ``RandomSampler``: each
    configuration is drawn from the same fixed law, independently of earlier scores,
    which is what the theorem behind the accounting needs. Adaptive samplers (TPE, CMA-ES,
    GP) choose the next configuration from earlier scores computed on the private data:
    they are refused. Scores are told to the study, so that its dashboards and
    ``study.trials`` work as usual; ``SearchResult.config`` is the selected trial's
    ``params``.

    Args:
        objective: ``trial -> (model, score)``.
        search: the law of the number of runs ``K``.
        rng: numpy generator for ``K`` and for the sampler's seed (default: fresh entropy).
        study: an Optuna study to ask the trials from (``direction="maximize"``, a
            ``RandomSampler``); default: a new in-memory one.
    """
    try:
        import optuna
    except ImportError as error:
        raise ImportError("optuna_random_search needs Optuna: `pip install optuna`.") from error
    rng = np.random.default_rng() if rng is None else rng
    if study is None:
        seed = int(rng.integers(2**31))
        study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed)
        )
    _check_study(study, optuna)

    def sample(_generator):
        return study.ask()

    def train(trial):
        model, score = objective(trial)
        study.tell(trial, float(score))
        return model, score

    result = private_random_search(train, sample, search, rng)
    result.config = result.config.params
    result.scores = [(trial.params, score) for trial, score in result.scores]
    return result


def _check_study(study, optuna) -> None:
    sampler = study.sampler
    if type(sampler) is not optuna.samplers.RandomSampler:
        raise ValueError(
            f"the study samples with {type(sampler).__name__}, which picks configurations "
            "from earlier scores: the private search's accounting needs configurations "
            "drawn from a fixed law. Create the study with "
            "sampler=optuna.samplers.RandomSampler()."
        )
    if study.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise ValueError(
            "the study must maximise the score (direction='maximize'): the search keeps "
            "the run with the highest score."
        )


def _better(score, best) -> bool:
    """A finite score beats a non-finite one (a diverged run) and any lower score."""
    if not math.isfinite(best):
        return math.isfinite(score)
    return math.isfinite(score) and score > best


def _run_terms(model):
    """``(plan, terms)`` of a trained run: its mechanisms and their counts over the epochs
    it began."""
    from lipdp.core.callbacks import epochs_trained

    plan = model.privacy_plan()
    return plan, plan.terms(epochs_trained(model))


def _check_same_mechanism(first, run, index) -> None:
    """Run ``index`` must release exactly what the first run released (same mechanisms,
    same counts, same delta): the search's epsilon is computed from the selected run's
    own plan, which must then bound every run."""
    (first_plan, first_terms), (plan, terms) = first, run
    if plan.non_private or first_plan.non_private or plan.delta != first_plan.delta:
        raise ValueError(
            f"run {index} of the search is non-private or has another delta: every run must "
            "be the same DP mechanism."
        )
    if set(terms) != set(first_terms):
        raise ValueError(
            f"run {index} of the search released {_describe(terms)}, the first run "
            f"{_describe(first_terms)}: the search's accounting needs every run to be the "
            "same mechanism. Keep the noise multiplier, the batch size, the data size and "
            "the number of epochs fixed across configurations."
        )


def _describe(terms) -> str:
    return "; ".join(f"{m.describe()} x {c}" for m, c in terms) or "nothing"


__all__ = ["RandomSearch", "SearchResult", "optuna_random_search", "private_random_search"]
