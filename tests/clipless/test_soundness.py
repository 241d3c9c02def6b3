"""Rule S1: per-example gradient norms never exceed the declared bounds.

Every layer, every loss and a few compositions (``tests/cases.py``) are checked
on random batches whose inputs overshoot the input bound, then after gradient
ascent on the inputs and the weights (projected back after each step) that
tries to maximise gradient-norm / bound. The worst ratios are printed
(``pytest -s``) and must stay <= 1 + 1e-5; they must also be far from 0 so that
a check which measures nothing would not pass.
"""

import pytest
import tensorflow as tf

from tests.cases import ALL_CASES, NORM_BALL_MATRIX
from tests.marks import representatives
from tests.soundness import TOLERANCE, adversarial_search, measure


def _with_ties(x):
    """Half the coordinates zeroed, the others rounded to multiples of 0.5."""
    x = tf.convert_to_tensor(x)
    keep = tf.cast(tf.random.stateless_uniform(tf.shape(x), seed=(0, 1)) < 0.5, x.dtype)
    return tf.round(2.0 * x) / 2.0 * keep


#: Compositions with the same layers and structure as a zoo case (the CLI CNN, the tabular
#: MLP): checked by the long searches of ``make test-slow`` only, to keep the default
#: suite short.
COVERED_BY_ZOO = {"CNN(conv-groupsort-l2pool-dense)", "DenseNet(4 layers, biases)"}
#: Norm-ball cases whose layers, norms and modes another default case searches already
#: (``Ball:GroupNormalization(dense,adaptive)`` holds a spectral and a Frobenius ball
#: dense layer; the conv fixed case holds a fixed ball): ``make test-slow`` only.
COVERED_BY_OTHER_BALLS = {
    "Ball:SpectralDense(spectral,adaptive)",
    "Ball:QuickFrobeniusDense(frobenius,adaptive)",
    "Ball:SpectralDense(spectral,fixed)",
    # lip_mlp = the GN dense case + tabular_mlp's bias; lip_convnet = the GN conv case +
    # the Frobenius conv case + pooled_cnn's pooling.
    "Zoo:lip_mlp(groupnorm,bias)",
    "Zoo:lip_convnet(frobenius)",
    # resnet(1-lip-add) = the Residual(1-lip-add) / ResidualConvBlock cases stacked behind
    # pooled_cnn's layers (resnet(add), whose bounds double per block, stays).
    "Zoo:resnet(1-lip-add)",
}


#: The cases of the smoke subset (``pytest -m smoke``): a dense and a
#: strided conv layer, max-pooling (ties), a loss, a norm ball with group normalisation and a
#: zoo CNN.
SMOKE_CASES = {
    "QuickSpectralDense(orthogonal)",
    "QuickSpectralConv2D(valid,stride2)",
    "MaxPool2D",
    "TauCategoricalCrossentropy",
    "Ball:GroupNormalization(dense,adaptive)",
    "Zoo:pooled_cnn",
    "Matrix:DP_SpectralConv2D(spectral)",
}


#: The default run's cases (tests/marks.py): the zoo's convolutional networks (strided,
#: pooled and residual convolutions, gradient clipping), a softmax and a cosine loss, a norm
#: ball of each shape (adaptive dense with group normalisation, fixed convolution),
#: max-pooling (ties) and the scattering front end. The other cases run in the thorough
#: tier.
DEFAULT_CASES = {
    "Zoo:pooled_cnn",
    "Zoo:resnet(add)",
    "Zoo:strided_cnn(clip)",
    "TauCategoricalCrossentropy",
    "KCosineSimilarity(K=0.3)",
    "Ball:GroupNormalization(dense,adaptive)",
    "Ball:SpectralConv2D(orthogonal,fixed)",
    "MaxPool2D",
    "ScatteringTransform(reflect,J1)+conv",
}


@pytest.mark.parametrize(
    "case",
    representatives(
        sorted(set(ALL_CASES) - COVERED_BY_ZOO - COVERED_BY_OTHER_BALLS),
        default=DEFAULT_CASES,
        smoke=SMOKE_CASES & set(ALL_CASES),
    ),
)
def test_bounds_hold_on_random_and_adversarial_inputs(case):
    model, x, y = ALL_CASES[case]()
    random_ratios = measure(model, x, y)
    random_ratios.assert_sound()
    # Ties (blank regions, repeated values) hit non-differentiable points of GroupSort,
    # max-pooling, ReLU: the gradient autodiff picks there must respect the bounds too.
    measure(model, _with_ties(x), y).assert_sound()
    worst = adversarial_search(model, x, y, steps=2)  # test-slow: 25 steps, 2 more seeds
    worst.assert_sound()
    print(
        f"\nS1 {case}: random {random_ratios.worst_gradient:.4f} "
        f"adversarial {worst.worst_gradient:.4f} activation {worst.activation:.4f} "
        f"cotangent {worst.cotangent:.4f}"
    )
    # Not vacuous: gradients are measured and the bound is within two orders of magnitude.
    assert worst.worst_gradient > 0.01
    assert worst.worst_gradient <= 1 + TOLERANCE


@pytest.mark.parametrize(
    "case",
    representatives(
        sorted(NORM_BALL_MATRIX),
        default=NORM_BALL_MATRIX,
        smoke=SMOKE_CASES & set(NORM_BALL_MATRIX),
    ),
)
def test_every_constrained_layer_and_ball_norm_on_random_inputs(case):
    """Lip-DP-SGD: every constrained layer x {spectral, Frobenius} ball, radii 2.5 / 0.6
    (dense) or 1.7 / 0.8 / 1.3 (conv), bounds from the current weights."""
    model, x, y = NORM_BALL_MATRIX[case]()
    ratios = measure(model, x, y)
    ratios.assert_sound()
    assert ratios.worst_gradient > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted({**ALL_CASES, **NORM_BALL_MATRIX}))
@pytest.mark.parametrize("seed", [1, 2])
def test_bounds_hold_under_long_adversarial_search(case, seed):
    tf.keras.utils.set_random_seed(seed)  # other initial weights than the fast test
    model, x, y = {**ALL_CASES, **NORM_BALL_MATRIX}[case]()
    worst = adversarial_search(model, x, y, steps=25, step_size=0.2)
    print(f"\nS1 long search {case} seed {seed}: {worst.worst_gradient:.4f}")
    worst.assert_sound()
