"""lipdp.core.adversarial (issue 14): PGD adversarial training in both families, against
independent per-example computations, adversarial searches on the bounds, and the
privacy accounting."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from lipdp.accounting import get_eps_delta
from lipdp.clipped.model import Clipping
from lipdp.core.adversarial import PGD, matching_l2_radius, softmax_kl
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.report import privacy_report
from lipdp.evaluation import robustness
from lipdp.foundation.variables import variable_key
from tests import cases
from tests.clipped.test_model import BATCH, _batch, _model
from tests.marks import thorough
from tests.soundness import TOLERANCE

# ------------------------------------------------------------------------- the attack


def test_pgd_refuses_bad_settings_and_round_trips():
    for bad in (
        dict(radius=0.0),
        dict(radius=1.0, norm="l1"),
        dict(radius=1.0, steps=0),
        dict(radius=1.0, mix=0.0),
        dict(radius=1.0, mix=1.5),
        dict(radius=1.0, step_size=-1.0),
        dict(radius=1.0, clip_values=(1.0, 0.0)),
    ):
        with pytest.raises(ValueError):
            PGD(**bad)
    pgd = PGD(0.3, "linf", steps=7, step_size=0.05, random_start=False, mix=0.5, clip_values=(0, 1))
    assert PGD.coerce(pgd.to_config()) == pgd
    assert PGD(1.0, steps=10).alpha == pytest.approx(0.25)
    with pytest.raises(TypeError):
        PGD.coerce("pgd")


def _linear_row_losses(w, y):
    """Row losses of a linear 2-class model with logits (w.x, -w.x): cross-entropy."""
    logits_fn = lambda x: tf.stack([tf.linalg.matvec(x, w), -tf.linalg.matvec(x, w)], 1)  # noqa: E731
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    return lambda x: loss(y, logits_fn(x))


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_training_attack_stays_in_the_ball_and_the_box(norm, rng):
    """Every adversarial point is within the radius (norm of the ball) and the box, with
    and without random start; on a linear model the attack from x reaches the optimum:
    the ball's farthest point along the loss gradient (-r w/||w|| or -r sign(w) for
    class 0)."""
    d, n, r = 10, 16, 0.2
    w = tf.constant(rng.normal(size=(d,)).astype("float32"))
    x = rng.uniform(0.3, 0.7, size=(n, d)).astype("float32")
    y = tf.zeros(n, tf.int32)
    for start in (True, False):
        pgd = PGD(r, norm, steps=20, clip_values=(0.0, 1.0), random_start=start)
        x_adv = pgd.perturb(_linear_row_losses(w, y), x).numpy()
        moved = x_adv - x
        sizes = np.abs(moved).max(1) if norm == "linf" else np.linalg.norm(moved, axis=1)
        assert np.all(sizes <= r * (1 + 1e-5))
        assert np.all((x_adv >= 0) & (x_adv <= 1))
    direction = w.numpy() / np.linalg.norm(w) if norm == "l2" else np.sign(w.numpy())
    np.testing.assert_allclose(moved, np.tile(-r * direction, (n, 1)), atol=1e-5)
    # Data outside its declared range: the ball still holds (the box cannot).
    outside = x + 2.0
    moved = (
        PGD(r, norm, steps=5, clip_values=(0.0, 1.0))
        .perturb(_linear_row_losses(w, y), outside)
        .numpy()
        - outside
    )
    sizes = np.abs(moved).max(1) if norm == "linf" else np.linalg.norm(moved, axis=1)
    assert np.all(sizes <= r * (1 + 1e-5)) and np.all(sizes > 0.5 * r)


def test_attack_of_a_row_does_not_depend_on_the_other_rows(rng):
    """The adversarial version of row i is the same whether the row is attacked within a
    batch, alone, or next to different rows (without random start: deterministic) — the
    per-example transformation the privacy argument rests on; clipless CNN and clipped
    dense net."""
    clipless, xc, yc = cases.COMPOSITION_CASES["CNN+ClipGradient(tail)"]()
    clipped = _model()
    xd, yd = _batch(rng)
    for model, x, y in ((clipless, xc, yc), (clipped, xd, yd)):
        model.adversarial = PGD(1.0, steps=5, random_start=False)
        together = model.adversarial_examples(x, y).numpy()
        alone = [model.adversarial_examples(x[i : i + 1], y[i : i + 1]).numpy() for i in range(2)]
        np.testing.assert_allclose(np.concatenate(alone), together[:2], rtol=1e-5, atol=1e-6)
        others = np.concatenate([x[:1], 5.0 * x[1:][::-1]])
        shuffled = model.adversarial_examples(others, np.concatenate([y[:1], y[1:][::-1]]))
        np.testing.assert_allclose(shuffled.numpy()[0], together[0], rtol=1e-5, atol=1e-6)
        assert np.linalg.norm(together - x) > 0.5  # the attack moved the rows


def test_training_attack_has_teeth(trained, digits):
    """On the trained digits CNN, PGD (l2, radius 1, 10 steps) raises every example's loss,
    by far more than a random point of the same ball, and flips many decisions."""
    model = trained[0]
    x, y = digits.x_test[:200], np.eye(10, dtype="float32")[digits.y_test[:200]]

    def row_losses(inputs):
        return model.per_example_losses(y, model(inputs, training=False))

    clean = row_losses(x).numpy()
    attacked = row_losses(PGD(1.0, steps=10, random_start=False).perturb(row_losses, x)).numpy()
    noise = np.random.default_rng(0).normal(size=x.shape).astype("float32")
    on_sphere = x + noise / np.linalg.norm(noise.reshape(len(x), -1), axis=1)[:, None, None, None]
    random = row_losses(on_sphere).numpy()
    assert np.all(attacked > clean)
    assert np.mean(attacked - clean) > 5 * np.mean(np.abs(random - clean))
    flipped = model(PGD(1.0, steps=10).perturb(row_losses, x)).numpy().argmax(1)
    assert np.mean(flipped != digits.y_test[:200]) > np.mean(
        model(x).numpy().argmax(1) != digits.y_test[:200]
    )


# --------------------------------------------------------------- clipless soundness
def _row_jacobians(model, x, x_adv, y):
    # A persistent tape and a row loop instead of pfor: pfor traces a new function at every
    # call in eager mode, which costs more than the few backward passes of a small batch.
    with tf.GradientTape(persistent=True) as tape:
        rows, _ = model.adversarial_loss_rows(x, x_adv, y)
    return tape.jacobian(rows, model.trainable_variables, experimental_use_pfor=False)


def _adversarial_ratios(model, x, x_adv, y, jacobians=None):
    """``max_i n ||d row_i / d v|| / B_v`` per variable, through the model's own
    adversarial loss (two passes, weighted, with their cotangent clipping);
    ``jacobians``: :func:`_row_jacobians` of these arguments, if already computed."""
    bounds = {variable_key(e.variable): e.bound for e in model.bounds().variables}
    n = model.loss_normalizer
    jacobians = _row_jacobians(model, x, x_adv, y) if jacobians is None else jacobians
    ratios = {}
    for v, jac in zip(model.trainable_variables, jacobians):
        norms = tf.norm(tf.reshape(jac, (jac.shape[0], -1)), axis=1)
        ratios[v.name] = float(tf.reduce_max(norms)) * n / float(bounds[variable_key(v)])
    return ratios


def _ratio_objective(model, x, x_adv, y):
    bounds = {variable_key(e.variable): e.bound for e in model.bounds().variables}
    n = model.loss_normalizer
    total = 0.0
    for i in range(x.shape[0]):
        with tf.GradientTape() as inner:
            row = model.adversarial_loss_rows(x[i : i + 1], x_adv[i : i + 1], y[i : i + 1])[0][0]
        grads = inner.gradient(row, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            total += tf.reduce_sum(tf.square(n * g)) / bounds[variable_key(v)] ** 2
    return total


_SLOW = pytest.mark.slow
SEARCH_CASES = [
    pytest.param("ClipGradient(tail)", 0.5, marks=thorough),  # 7-12 s each
    pytest.param("CNN+ClipGradient(tail)", 0.5, marks=thorough),
    ("DenseNet(4 layers, biases)", 1.0),
    pytest.param("ClipGradient(tail)", 1.0, marks=_SLOW),
    pytest.param("CNN+ClipGradient(tail)", 1.0, marks=_SLOW),
    pytest.param("DenseNet(4 layers, biases)", 0.5, marks=_SLOW),
    pytest.param("Residual(1-lip-add)", 0.5, marks=_SLOW),
    pytest.param("Ball:SpectralDense(spectral,adaptive)", 0.5, marks=_SLOW),
    pytest.param("Zoo:strided_cnn(clip)", 0.5, marks=_SLOW),
]


@pytest.mark.parametrize("case, mix", SEARCH_CASES)
def test_clipless_bounds_hold_for_adversarial_training_under_search(case, mix):
    """Per-example gradient of the adversarial training loss / declared bound <= 1 when
    the clean input, its adversarial partner (any point: the search moves it freely) and
    the weights (projected back) are pushed by gradient ascent to maximise the ratio.
    The cases with DP_ClipGradient check that each pass is clipped at its share of C."""
    model, x, y = cases.ALL_CASES[case]()
    model.adversarial = PGD(1.0, steps=3, mix=mix)
    x = tf.Variable(x)
    x_adv = tf.Variable(model.adversarial_examples(x, y))
    # The Jacobians of the current variables (inputs and weights), traced once: the eager
    # tape.jacobian traced its pfor loop again at each of the 9 calls (~60 % of the test).
    jacobians = tf.function(lambda: _row_jacobians(model, x, x_adv, y))

    def ratios():
        return _adversarial_ratios(model, x, x_adv, y, jacobians=jacobians())

    worst = 0.0
    for _ in range(8):
        worst = max(worst, max(ratios().values()))
        targets = [x, x_adv, *model.trainable_variables]
        with tf.GradientTape() as tape:
            objective = _ratio_objective(model, x, x_adv, y)
        for target, g in zip(targets, tape.gradient(objective, targets)):
            if g is not None:
                target.assign_add(0.3 * (tf.norm(target) + 1e-6) * g / (tf.norm(g) + 1e-12))
        model.project()
    worst = max(worst, max(ratios().values()))
    assert worst <= 1 + TOLERANCE
    assert worst > 0.3  # the search reaches the bound's order: the check is not vacuous


def test_mixed_passes_share_the_cotangent_clip():
    """With DP_ClipGradient(C) clipping hard and mix = 0.5, the clean and the adversarial
    pass of a row are clipped at C/2 each (measured at the clip layer's input, the logits
    here): their sum stays within C, where clipping each pass at C would give 2C."""
    model, x, y = cases.LAYER_CASES["ClipGradient(tail)"]()
    model.adversarial = PGD(0.5, steps=2, mix=0.5)
    clip = float(model.dp_layers[-1].clip_value.numpy())
    x_adv = model.adversarial_examples(x, y)
    n = model.loss_normalizer
    logits_in = []

    def watch(index, h):
        if index == len(model.dp_layers) - 2:
            tape.watch(h)
            logits_in.append(h)
        return h

    with tf.GradientTape(persistent=True) as tape:
        rows = []
        for inputs, weight in ((x, 0.5), (x_adv, 0.5)):
            out = model.forward(inputs, training=True, observe=watch, loss_weight=weight)
            rows.append(weight * model.per_example_losses(y, out) / n)
        total = tf.reduce_sum(rows[0] + rows[1])
    parts = [n * tf.norm(tape.gradient(total, h), axis=1) for h in logits_in]
    assert np.all(parts[0].numpy() <= 0.5 * clip * (1 + 1e-5))
    assert np.all(parts[1].numpy() <= 0.5 * clip * (1 + 1e-5))
    assert np.max(parts[0].numpy()) > 0.45 * clip  # clipping is active on this case


# ----------------------------------------------------------------- clipped family
def _naive_pgd_l2(model, xi, yi, radius, steps):
    """PGD of one row, one GradientTape per step, in numpy (no lipdp attack code)."""
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    delta = np.zeros_like(xi)
    alpha = 2.5 * radius / steps
    for _ in range(steps):
        point = tf.constant(xi + delta)
        with tf.GradientTape() as tape:
            tape.watch(point)
            loss = loss_fn(yi[None], model(point[None], training=False))
        g = tape.gradient(loss, point).numpy()
        delta = delta + alpha * g / max(np.linalg.norm(g), 1e-12)
        delta *= min(1.0, radius / max(np.linalg.norm(delta), 1e-12))
    return xi + delta


def _clipped_gradient(model, xi, yi, clip):
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(yi[None], model(xi[None]))
    grads = [g.numpy().astype("float64") for g in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(g**2) for g in grads))
    return [g * min(1.0, clip / norm) for g in grads]


@pytest.mark.parametrize("method", ["ghost", "jacobian"])
def test_clipped_adversarial_sum_equals_a_naive_loop(method, rng):
    """mix = 0.5: sum_i (0.5 clip(g(x_i)) + 0.5 clip(g(x'_i))) with x'_i from a per-row
    numpy PGD equals the model's clipped sum; mix = 1: the adversarial rows only."""
    clip, radius, steps = 0.5, 1.5, 4
    for mix in (0.5, 1.0):
        model = _model(clip=clip, method=method)
        model.adversarial = PGD(radius, steps=steps, random_start=False, mix=mix)
        x, y = _batch(rng)
        summed, _, _ = model.clipped_gradient_sum(x, y)
        expected = [np.zeros(v.shape) for v in model.trainable_variables]
        for xi, yi in zip(x, y):
            x_adv = _naive_pgd_l2(model, xi, yi, radius, steps)
            parts = [(1 - mix, xi), (mix, x_adv)] if mix < 1 else [(1.0, x_adv)]
            for weight, point in parts:
                grads = _clipped_gradient(model, point, yi, clip)
                expected = [e + weight * g for e, g in zip(expected, grads)]
        for got, want in zip(summed, expected):
            np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("clipping", [Clipping("flat", 0.2), Clipping("automatic", 0.2)])
def test_one_row_of_clipped_adversarial_training_moves_the_sum_by_at_most_r(clipping, rng):
    """With mix = 0.5, one row's contribution (sum with it minus sum without it) stays
    within R while its input is pushed to large gradients."""
    model = _model(clip=clipping)
    model.adversarial = PGD(2.0, steps=3, mix=0.5, random_start=False)  # the other rows fixed
    clipped_sum = tf.function(model.clipped_gradient_sum)
    x, y = _batch(rng, scale=1.0)
    worst = 0.0
    for scale in (1.0, 3.0, 10.0, 30.0):
        row = scale * x[:1]
        with_row, _, _ = clipped_sum(np.concatenate([row, x[1:]]), y)
        without, _, _ = clipped_sum(x[1:], y[1:])
        change = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(with_row, without)))
        worst = max(worst, change)
        assert change <= 0.2 * (1 + ROUNDOFF_SLACK)
    assert worst > 0.15


# ----------------------------------------------------------- privacy and training
def test_adversarial_training_changes_neither_noise_nor_epsilon(rng):
    """Same sensitivities, noise levels, epsilon and privacy report with and without the
    attack; training runs (fit), counts a NaN row as non-finite and keeps weights finite."""
    plain = _model(sigma=1.0, n=64)
    attacked = _model(sigma=1.0, n=64)
    attacked.adversarial = PGD(0.5, "linf", steps=3, mix=0.5)
    assert [d for _, d in plain.sensitivities()] == [d for _, d in attacked.sensitivities()]
    x, y = _batch(rng, n=64)
    x[3] = np.nan
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    for model in (plain, attacked):
        history = model.fit(batches, epochs=2, verbose=0)
        assert history.history["non_finite_examples"][-1] == 1
        assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert get_eps_delta(plain, 2) == get_eps_delta(attacked, 2)
    plain_report, attacked_report = privacy_report(plain), privacy_report(attacked)
    assert attacked_report.epsilon == plain_report.epsilon
    assert attacked_report.sensitivities == plain_report.sensitivities
    assert [n for n in attacked_report.notes if "adversarial" not in n] == plain_report.notes
    assert "adversarial training (PGD linf radius 0.5" in str(attacked_report)


def test_clipless_adversarial_training_learns_and_reloads(tmp_path, rng):
    """A clipless model trains with PGD (the loss goes down) and its .keras reload keeps
    the attack's configuration."""
    model, x, y = cases.LAYER_CASES["ClipGradient(tail)"]()
    model.adversarial = PGD(0.3, steps=3, mix=0.5)
    before = model.evaluate(x, y, verbose=0)
    xs, ys = np.repeat(x, 4, axis=0), np.repeat(y, 4, axis=0)
    # Little noise, so that 5 epochs on 16 rows show learning (the plan is not at stake);
    # the 16 rows are the declared training set.
    model.dp_parameters = dataclasses.replace(model.dp_parameters, noise_multiplier=1e-3)
    model.dataset_metadata = dataclasses.replace(model.dataset_metadata, nb_samples_train=16)
    model.fit(xs, ys, batch_size=4, epochs=5, verbose=0)
    assert model.evaluate(x, y, verbose=0) < before
    path = str(tmp_path / "adv.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert loaded.adversarial == model.adversarial


# --------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_pgd_robust_accuracy_equals_the_exact_one_on_a_linear_model(norm, rng):
    """For a linear 2-class model, an example is robust at radius r iff it is correct and
    its margin |w.x| exceeds r ||w||_2 (l2) or r ||w||_1 (linf); PGD finds every other."""
    d, n = 8, 200
    w = rng.normal(size=(d, 1)).astype("float32")
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, use_bias=False, input_shape=(d,))])
    model.layers[0].set_weights([w])
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ w[:, 0] > 0).astype(int)
    y[:20] = 1 - y[:20]  # some misclassified examples
    dual = np.linalg.norm(w) if norm == "l2" else np.abs(w).sum()
    for r in (0.1, 0.5, 1.0):
        margin = np.abs(x @ w[:, 0])
        exact = np.mean((y == (x @ w[:, 0] > 0)) & (margin > r * dual * (1 + 1e-4)))
        got = robustness.robust_accuracy(model, x, y, [0.0, r], norm, steps=10)
        assert got[1] == pytest.approx(exact, abs=1.5 / n)
        assert got[0] == pytest.approx(0.9)


def test_certified_accuracy_never_exceeds_pgd_accuracy(trained, digits, tmp_path):
    """Certified accuracy (a lower bound on robust accuracy) <= PGD accuracy (an upper
    bound) at every l2 radius; linf curves too; the plot is written."""
    model = trained[0]
    x, y = digits.x_test[:150], digits.y_test[:150]
    radii = [0.0, 0.1, 0.3, 0.6]
    curves = robustness.robustness_curves(model, x, y, radii, steps=10, restarts=2)
    assert set(curves) == {"radii", "pgd_l2", "pgd_linf", "certified_l2", "certified_linf"}
    assert np.all(np.array(curves["certified_l2"]) <= np.array(curves["pgd_l2"]) + 1e-12)
    assert np.all(np.array(curves["certified_linf"]) <= np.array(curves["pgd_linf"]) + 1e-12)
    assert curves["pgd_l2"][0] == curves["certified_l2"][0]  # clean accuracy at r = 0
    assert curves["pgd_l2"][-1] < curves["pgd_l2"][0]  # the attack lowers accuracy
    assert matching_l2_radius(0.1, 64) == pytest.approx(0.8)
    ax = robustness.plot_robustness_curves(curves, label="digits")
    ax.figure.savefig(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000


# ------------------------------------------------------------------------ TRADES
def _trades_reference(model, x, x_adv, y, beta, clip):
    """One GradientTape per example on CE(f(x_i)) + beta KL(p(x_i) || p(x'_i)), clipped to
    ``clip``, summed (numpy softmax and KL: no lipdp code)."""
    total = [np.zeros(v.shape) for v in model.trainable_variables]
    for xi, ai, yi in zip(x, x_adv, y):
        with tf.GradientTape() as tape:
            clean, adv = model(xi[None]), model(ai[None])
            log_p, log_q = tf.nn.log_softmax(clean), tf.nn.log_softmax(adv)
            ce = -tf.reduce_sum(yi[None] * log_p)
            kl = tf.reduce_sum(tf.exp(log_p) * (log_p - log_q))
            loss = ce + beta * kl
        grads = [
            g.numpy().astype("float64") for g in tape.gradient(loss, model.trainable_variables)
        ]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        total = [t + min(1.0, clip / norm) * g for t, g in zip(total, grads)]
    return total


def test_trades_sum_equals_a_naive_loop_and_stays_within_r(rng):
    """Clipped TRADES: the model's clipped sum equals a per-example loop over the coupled
    loss (adversarial points fixed), and one example's contribution stays within R as its
    input grows."""
    clip, beta = 0.3, 6.0
    model = _model(clip=clip, method="jacobian")
    model.adversarial = PGD(0.5, steps=3, trades_beta=beta)
    x, y = _batch(rng)
    x_adv = x + rng.normal(scale=0.3, size=x.shape).astype("float32")
    model.adversarial_examples = lambda inputs, labels: inputs + (x_adv - x)[: len(inputs)]
    summed, _, _ = model.clipped_gradient_sum(x, y)
    expected = _trades_reference(model, x, x_adv, y, beta, clip)
    for got, want in zip(summed, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-6)
    worst = 0.0
    for scale in (1.0, 10.0, 100.0):
        row = scale * x[:1]
        with_row, _, _ = model.clipped_gradient_sum(np.concatenate([row, x[1:]]), y)
        without = _trades_reference(model, x[1:], x_adv[1:], y[1:], beta, clip)
        change = np.sqrt(sum(np.sum((a.numpy() - b) ** 2) for a, b in zip(with_row, without)))
        worst = max(worst, change)
        assert change <= clip * (1 + 1e-4)
    assert worst > 0.25


def test_trades_attack_ascends_the_kl_and_is_refused_where_unbounded(rng):
    """The TRADES attack raises KL(p(x) || p(x')) above that of a random point of the same
    ball; clipless models, ghost norms and a fixed start are refused with the fix."""
    model = _model(method="jacobian")
    model.adversarial = PGD(1.0, steps=10, trades_beta=1.0)
    x, y = _batch(rng, n=64)
    clean = model(x)
    attacked = model.adversarial_examples(x, y)
    noise = rng.normal(size=x.shape).astype("float32")
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    assert np.mean(softmax_kl(clean, model(attacked))) > 3 * np.mean(
        softmax_kl(clean, model(x + noise))
    )
    clipless, _, _ = cases.LAYER_CASES["ClipGradient(tail)"]()
    with pytest.raises(ValueError, match="no bound"):
        clipless.adversarial = PGD(0.5, trades_beta=1.0)
    with pytest.raises(ValueError, match="gradient_method='jacobian'"):
        _model().adversarial = PGD(0.5, trades_beta=1.0)
    with pytest.raises(ValueError, match="random_start=True"):
        PGD(0.5, trades_beta=1.0, random_start=False)
