"""lipdp.recipes.runs and run_evaluation on their own: the run configurations (validation
in one line, serialisation), the pieces of a run, and ``lipdp train`` reproduced without
the command line."""

import dataclasses
import json
import math

import numpy as np
import pytest

from lipdp.accounting.budget import get_eps_delta
from lipdp.data import sources
from lipdp.recipes import defaults, run_evaluation, runs

BAD_RECIPES = [
    (dict(dataset="mnist"), "dataset must be one of"),
    (dict(method="clipping"), "method must be one of"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(noise_multiplier=-1.0), "noise_multiplier must be > 0"),
    (dict(delta=2.0), "delta must be < 1.0"),
    (dict(optimizer="rmsprop"), "optimizer must be one of"),
    (dict(momentum=1.0), "momentum must be < 1.0"),
    (dict(momentum=0.9), r"momentum \(--momentum\) applies to optimizer sgd only"),
    (dict(clip_norm=2.0), r"clip_norm \(--clip-norm\) applies to method dp-sgd only"),
    (dict(bam=0.1), r"bam \(--bam\) applies to method dp-sgd only"),
    (dict(method="dp-sgd", gradient_clip=0.5), r"gradient_clip \(--gradient-clip\) applies to the"),
    (
        dict(method="dp-sgd", weight_norm_bound=2.0),
        r"weight_norm_bound \(--weight-norm-bound\) app",
    ),
    (dict(method="dp-sgd", group_norm=4), r"group_norm \(--group-norm\) applies to the clipless"),
    (dict(group_norm_alpha=0.5), r"group_norm_alpha \(--group-norm-alpha\) does not apply to the"),
    (dict(method="dp-sgd", clipping="global"), "clipping='global' needs clip_threshold"),
    (
        dict(method="dp-sgd", clip_threshold=5.0),
        r"clip_threshold \(--clip-threshold\) applies to cl",
    ),
    (dict(method="dp-sgd", bam=0.1, dp_sat=0.1), "bam and dp_sat are two ascent steps"),
    (dict(dataset="breast_cancer", scattering=True), "scattering needs images; breast_cancer"),
    (dict(non_private=True, noise_multiplier=1.0), "non_private=True is a noiseless reference"),
    (dict(trades=2.0), r"trades \(--trades\) applies to method dp-sgd only"),
    (dict(method="dp-sgd", trades=2.0), r"trades \(--trades\) needs adversarial_radius"),
    (dict(adversarial_radius=0.1, trades=2.0), r"trades \(--trades\) applies to method dp-sgd"),
    (dict(adversarial_steps=3), r"adversarial_steps \(--adversarial-steps\) needs adversarial_r"),
    (
        dict(method="dp-sgd", adversarial_radius=0.1, trades=2.0, adversarial_mix=0.5),
        r"adversarial_mix \(--adversarial-mix\) does not apply with trades",
    ),
]

BAD_RUNS = [
    (dict(epsilon=0.0), "epsilon must be > 0"),
    (dict(epochs=0), "epochs must be an integer >= 1"),
    (dict(accountant="moments"), "accountant must be one of"),
    (dict(averaging=1.0), "averaging must be < 1.0"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(data_dir="/tmp"), "data_dir applies to dataset='fashion_mnist' only"),
    (dict(model="digits"), "model must be a ModelRecipe or its config dict"),
]


def _one_line_error(make, match):
    with pytest.raises((ValueError, TypeError), match=match) as error:
        make()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("settings, match", BAD_RECIPES, ids=lambda v: str(v)[:60])
def test_a_bad_model_recipe_is_a_one_line_error(settings, match):
    _one_line_error(lambda: runs.ModelRecipe(**settings), match)


@pytest.mark.parametrize("settings, match", BAD_RUNS, ids=lambda v: str(v)[:60])
def test_a_bad_run_is_a_one_line_error(settings, match):
    _one_line_error(lambda: runs.RunConfig(**settings), match)


def test_a_bad_evaluation_is_a_one_line_error():
    E = run_evaluation.EvaluationConfig
    _one_line_error(lambda: E(radii=(-0.1,)), "radius must be >= 0")
    _one_line_error(lambda: E(radii=()), "radii must hold at least one radius")
    _one_line_error(lambda: E(attack_norms=("l1",)), "attack norm must be one of")
    _one_line_error(lambda: E(bins=0), "bins must be an integer >= 1")


def test_settings_at_their_defaults_are_never_refused():
    """A setting that does not apply is refused only when it differs from its default:
    every method and data set takes the defaults of the others' settings."""
    for dataset in defaults.DATASETS:
        for method in defaults.METHODS:
            runs.ModelRecipe(dataset=dataset, method=method)


def test_configurations_round_trip_through_plain_dicts():
    recipe = runs.ModelRecipe(
        dataset="breast_cancer",
        method="dp-sgd",
        batch_size=32,
        clipping="global",
        clip_threshold=5,
        bam=0.1,
        optimizer="sgd",
        momentum=0.9,
        adversarial_radius=0.1,
        trades=2,
    )
    run = runs.RunConfig(recipe, epsilon=1, epochs=2, accountant="pld", averaging=0.99)
    config = json.loads(json.dumps(run.to_config()))  # plain values only
    assert config["model"]["clip_threshold"] == 5.0 and config["epochs"] == 2
    assert runs.RunConfig.from_config(config) == run
    assert runs.RunConfig.coerce(config) == run
    evaluation = run_evaluation.EvaluationConfig(radii=(0, 0.5), attack_norms=("l2", "linf"))
    plain = json.loads(json.dumps(evaluation.to_config()))
    assert run_evaluation.EvaluationConfig.from_config(plain) == evaluation


def test_resolved_takes_the_defaults_of_the_data_set_and_the_network():
    for dataset, default in defaults.DEFAULTS.items():
        network = defaults.CLIPLESS_NETWORKS[dataset]
        clipless = defaults.CLIPLESS_DEFAULTS[dataset, network]
        recipe = runs.ModelRecipe(dataset=dataset).resolved()
        assert recipe.batch_size == (clipless.batch_size or default.batch_size)
        assert recipe.noise_multiplier == (clipless.noise_multiplier or default.noise_multiplier)
        assert recipe.learning_rate == clipless.learning_rate
        assert recipe.scattering == (network == "scattering")
        assert recipe.gradient_clip == clipless.gradient_clip
        assert recipe.tau == clipless.tau
        assert recipe.optimizer == clipless.optimizer
        assert recipe.momentum == (clipless.momentum if clipless.optimizer == "sgd" else None)
        assert recipe.weight_norm_bound == clipless.weight_norm_bound
        assert recipe.resolved() == recipe  # idempotent
        clipped = runs.ModelRecipe(dataset=dataset, method="dp-sgd").resolved()
        assert clipped.learning_rate == default.learning_rate
        assert (clipped.batch_size, clipped.noise_multiplier) == default[:2]
        assert clipped.scattering is False and clipped.tau is None
        assert clipped.gradient_clip is None and clipped.weight_norm_bound is None
        assert clipped.optimizer == "adam" and clipped.momentum is None
    given = runs.ModelRecipe(
        batch_size=100,
        noise_multiplier=3,
        learning_rate=0.5,
        scattering=False,
        gradient_clip=2.0,
        tau=5.0,
        optimizer="sgd",
        momentum=0.5,
        weight_norm_bound=2.0,
    )
    assert given.resolved() == given


def test_fashion_mnist_networks_take_their_own_defaults():
    scattering = runs.ModelRecipe(dataset="fashion_mnist").resolved()
    published = (8192, 4.05, "sgd", 0.9, 16.0, 16.0, 1.0)  # Tramer & Boneh's recipe
    assert (
        scattering.batch_size,
        scattering.noise_multiplier,
        scattering.optimizer,
        scattering.momentum,
        scattering.learning_rate,
        scattering.weight_norm_bound,
        scattering.tau,
    ) == published
    assert scattering.gradient_clip == pytest.approx(0.1 / 63)
    cnn = runs.ModelRecipe(dataset="fashion_mnist", scattering=False).resolved()
    assert (cnn.batch_size, cnn.noise_multiplier, cnn.optimizer, cnn.learning_rate) == (
        2048,
        2.0,
        "adam",
        0.01,
    )
    assert cnn.momentum is None and cnn.gradient_clip is None and cnn.tau == 8.0
    # SGD asked for on a network whose default is Adam: no momentum unless given.
    assert runs.ModelRecipe(optimizer="sgd").resolved().momentum == 0.0
    assert runs.ModelRecipe(optimizer="sgd").resolved().learning_rate == 0.01  # Adam's rate
    # Adam on a network whose rate is an SGD rate: Adam's must be given.
    with pytest.raises(ValueError, match="learning_rate: the default 16 is for optimizer 'sgd'"):
        runs.ModelRecipe(dataset="fashion_mnist", optimizer="adam").resolved()
    adam = runs.ModelRecipe(dataset="fashion_mnist", optimizer="adam", learning_rate=0.001)
    assert adam.resolved().momentum is None
    with pytest.raises(ValueError, match=r"momentum \(--momentum\) applies to optimizer sgd only"):
        runs.ModelRecipe(momentum=0.5)
    runs.ModelRecipe(dataset="fashion_mnist", momentum=0.5)  # its network's SGD


def test_breast_cancer_takes_a_linear_head_unless_a_group_norm_needs_a_hidden_layer():
    name, options = runs.architecture(runs.ModelRecipe(dataset="breast_cancer"))
    assert (name, options["depth"]) == ("lip_mlp", 0)
    assert defaults.CLIPLESS_DEFAULTS["breast_cancer", "mlp"].hidden_layers == 0
    grouped = runs.ModelRecipe(dataset="breast_cancer", group_norm=4)
    assert runs.architecture(grouped)[1]["depth"] == 1
    metadata = runs.run_metadata(
        runs.ModelRecipe(dataset="breast_cancer"), sources.load_breast_cancer()
    )
    model = runs.build_model(runs.ModelRecipe(dataset="breast_cancer"), metadata)
    kernels = [v for v in model.trainable_variables if "kernel" in v.name]
    assert [tuple(k.shape) for k in kernels] == [(30, 2)]  # one linear layer
    assert type(model.dp_layers[-1]).__name__ == "DP_ClipGradient"


def test_the_temperature_follows_the_network_and_clipping_can_be_turned_off():
    assert runs.ModelRecipe(scattering=False).resolved().tau == 8.0
    assert runs.ModelRecipe(scattering=True).resolved().tau == 2.0
    off = runs.ModelRecipe(gradient_clip=math.inf).resolved()
    assert off.gradient_clip == math.inf
    with pytest.raises(ValueError, match="tau"):
        runs.ModelRecipe(method="dp-sgd", tau=2.0)
    with pytest.raises(ValueError, match="tau"):
        runs.ModelRecipe(tau=-1.0)
    reference = runs.ModelRecipe(non_private=True)
    assert runs.dp_parameters(reference).noise_multiplier == 0.0
    assert runs.dp_parameters(reference).non_private


@pytest.mark.parametrize(
    "settings, name",
    [
        (dict(), "scattering_net"),
        (dict(scattering=False), "pooled_cnn"),
        (dict(dataset="fashion_mnist"), "scattering_net"),
        (dict(dataset="fashion_mnist", scattering=False), "pooled_cnn"),
        (dict(weight_norm_bound=2.0, scattering=False), "lip_convnet"),
        (dict(method="lip-dp-sgd", scattering=False), "lip_convnet"),
        (dict(group_norm=4, scattering=False), "lip_convnet"),
        (dict(dataset="breast_cancer"), "lip_mlp"),
        (dict(scattering=True), "scattering_net"),
    ],
)
def test_the_architecture_follows_the_recipe(settings, name):
    assert runs.architecture(runs.ModelRecipe(**settings))[0] == name


def test_the_library_objects_of_a_recipe():
    from lipdp.clipped.model import Clipping, SharpnessAscent

    recipe = runs.ModelRecipe(
        dataset="breast_cancer",
        method="dp-sgd",
        clipping="global",
        clip_norm=0.5,
        clip_threshold=4,
        dp_sat=0.2,
        adversarial_radius=0.1,
        adversarial_norm="linf",
    )
    assert runs.clipping(recipe) == Clipping("global", 0.5, threshold=4.0)
    assert runs.ascent(recipe) == SharpnessAscent("dp-sat", 0.2)
    attack = runs.adversarial(recipe)
    assert attack.norm == "linf" and attack.clip_values == defaults.FEATURE_RANGES["breast_cancer"]
    clipless = runs.ModelRecipe()
    assert runs.clipping(clipless) is None and runs.ascent(clipless) is None
    assert runs.adversarial(clipless) is None


def test_the_metadata_of_a_run():
    data = sources.load_digits()
    poisson = runs.run_metadata(runs.ModelRecipe(batch_size=500), data)
    assert poisson.nb_samples_train == 1536 and poisson.max_norm == defaults.INPUT_BOUNDS["digits"]
    shuffle = runs.run_metadata(runs.ModelRecipe(batch_size=500, sampling="shuffle"), data)
    assert shuffle.nb_samples_train == 1500  # whole batches only (rule S5)
    x, y = runs.training_arrays(shuffle, data)
    assert len(x) == len(y) == 1500 and y.shape == (1500, 10) and y.dtype == np.float32
    _one_line_error(
        lambda: runs.run_metadata(runs.ModelRecipe(batch_size=2000), data),
        "batch_size 2000 exceeds the 1536 training examples",
    )


def test_prepare_takes_the_most_epochs_within_the_budget():
    prepared = runs.prepare(runs.RunConfig(epsilon=3.0))
    model, epochs = prepared.model, prepared.epochs
    assert model.dataset_metadata.batch_size == 512 and len(prepared.x_train) == 1536
    assert get_eps_delta(model, epochs)[0] <= 3.0 < get_eps_delta(model, epochs + 1)[0]


def test_one_epoch_on_digits_logs_the_model_s_epsilon_and_prints_nothing(capsys):
    """``train`` is ``lipdp train`` without the printing; the epsilon ``DP_Accountant`` logs
    is the model's own ``get_eps_delta``. The evaluation of ``lipdp evaluate`` on it."""
    data = sources.load_digits()
    model, history, metrics = runs.train(runs.RunConfig(epochs=1), data)
    assert capsys.readouterr().out == ""
    assert len(history.history["epsilon"]) == 1
    assert history.history["epsilon"][-1] == get_eps_delta(model, 1)[0]
    assert 0.0 <= metrics["accuracy"] <= 1.0 and np.isfinite(metrics["loss"])

    config = run_evaluation.EvaluationConfig(radii=(0.0, 0.1), attack_steps=2, attack_examples=20)
    x_train, y_train = runs.training_arrays(model.dataset_metadata, data)
    results = run_evaluation.evaluate_model(model, data, x_train, y_train, config)
    assert results.accuracy == pytest.approx(metrics["accuracy"], abs=1e-6)
    assert results.lipschitz > 0 and len(results.certified) == 2
    assert results.certified[0] == pytest.approx(results.accuracy)  # radius 0: correct ones
    assert results.attacked == 20 and set(results.robustness) == {
        "radii",
        "pgd_l2",
        "certified_l2",
    }
    assert run_evaluation.privacy_report_of(model).epsilon == pytest.approx(
        history.history["epsilon"][-1]
    )


def test_a_recipe_is_frozen():
    recipe = runs.ModelRecipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.method = "dp-sgd"


#: The public names of lipdp.recipes.runs before its split (issue 38).
RUNS_NAMES_BEFORE_THE_SPLIT = [
    "ModelRecipe", "RunConfig", "PreparedRun", "TrainedRun", "set_seed", "load_data",
    "one_hot", "run_metadata", "training_arrays", "dp_parameters", "optimizer", "clipping",
    "ascent", "adversarial", "architecture", "keras_layers", "build_model",
    "model_and_arrays", "prepare", "feature_head", "training_callbacks", "fit",
    "metrics_on_test_set", "train",
]  # fmt: skip


def test_the_names_of_runs_before_the_split_still_import_from_it():
    """``from lipdp.recipes.runs import build_model`` (benchmarks, tutorials, users) names
    the object of the module that defines it now."""
    from lipdp.recipes import model_factory, recipe_config

    assert sorted(runs.__all__) == sorted(RUNS_NAMES_BEFORE_THE_SPLIT)
    for module in (recipe_config, model_factory):
        for name in module.__all__:
            assert getattr(runs, name) is getattr(module, name), name
