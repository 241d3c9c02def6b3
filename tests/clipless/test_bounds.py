"""lipdp.clipless.bounds: the one bound pass, against hand-derived values and exact computations."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.bounds import ROUNDOFF_SLACK, bound_pass, parameterized_variables
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.evaluation.robustness import lipschitz_constant
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.cases import build

SQRT2 = math.sqrt(2.0)


def hand_network(clip=0.5):
    """X0 = 3 -> Dense(16) -> AddBias(1) -> GroupSort -> Dense(4) -> clip at ``clip``."""
    model, _, _ = build(
        [
            L.DP_QuickSpectralDense(16, name="d1"),
            L.DP_AddBias(1.0, name="b1"),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(5, name="d2"),
            L.DP_ClipGradient(clip),
        ],
        (12,),
    )
    return model


def test_hand_derived_bounds():
    """Every entry of the pass, derived on paper from the layer docstrings.

    Forward: X = 3 (clipped input), 3 after the dense layer, 3 + 1 after the bias,
    unchanged by GroupSort, the second dense layer and the clip layer.
    Backward from L = sqrt(2) (tau cross-entropy): the clip layer passes min(L, 0.5);
    dense layers and the bias pass G unchanged. Gradient bounds: dense X * G, bias
    sqrt(positions) * G = G.
    """
    model = hand_network(clip=0.5)
    bounds = model.bounds()
    assert bounds.input_bounds == [None, 3.0, 3.0, 4.0, 4.0, 4.0]
    assert bounds.output_bound == 4.0
    g_out = [float(g) for g in bounds.output_cotangent_bounds]
    assert g_out == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.5, SQRT2])
    g_in = [float(g) for g in bounds.input_cotangent_bounds]
    assert g_in == pytest.approx([0.5] * 6)
    per_variable = {e.key: float(e.bound) for e in bounds.variables}
    assert per_variable == pytest.approx({"d1/kernel": 1.5, "b1/bias": 0.5, "d2/kernel": 2.0})
    assert bounds.lipschitz == 1.0
    deltas = {e.key: float(d) for e, d in bounds.sensitivities(4)}
    # (the clip value is a float32 variable: 0.5 is exact, the product is float32)
    assert deltas["d2/kernel"] == pytest.approx(2.0 * (1 + ROUNDOFF_SLACK) / 4, rel=1e-7)


def test_clip_value_is_read_in_graph_and_does_not_change_the_lipschitz_constant():
    model = hand_network(clip=0.01)
    clip = model.dp_layers[-1]
    assert float(model.bounds().output_cotangent_bounds[3]) == pytest.approx(0.01)
    clip.clip_value.assign(0.2)
    assert float(model.bounds().output_cotangent_bounds[3]) == pytest.approx(0.2)
    # As a function the clip layer is the identity: the Lipschitz constant is 1, not 0.2.
    assert bound_pass(model.dp_layers).lipschitz == 1.0


def _linear_residual_model(policy):
    metadata = DatasetMetadata(input_shape=(6,), nb_classes=6, nb_samples_train=64, batch_size=8)
    stack = [L.DP_BoundedInput(input_shape=(6,), upper_bound=1.0)]
    stack += L.make_residuals(policy, [L.DP_QuickSpectralDense(6)])
    stack += L.make_residuals(policy, [L.DP_QuickSpectralDense(6, constraint="spectral")])
    return DP_Sequential(
        stack, dp_parameters=DPParameters("global", 1.0, 1e-5), dataset_metadata=metadata
    )


@pytest.mark.parametrize("policy,declared", [("add", 4.0), ("1-lip-add", 1.0)])
def test_residual_lipschitz_constant_bounds_the_exact_operator_norm(policy, declared):
    """Two linear residual blocks: the network is the matrix ``s(I + W2) s(I + W1)``
    (``s`` the merge scale); its exact spectral norm never exceeds the declared bound."""
    model = _linear_residual_model(policy)
    bounds = bound_pass(model.dp_layers)
    assert bounds.lipschitz == pytest.approx(declared)
    assert lipschitz_constant(model) == pytest.approx(declared)
    # The forward bound on the output norm follows the same merges: X0 * declared.
    assert bounds.output_bound == pytest.approx(declared)
    x = tf.constant(np.eye(6, dtype="float32") * 0.1)  # inside the input ball: linear map
    matrix = model(x).numpy() / 0.1
    exact = np.linalg.svd(matrix, compute_uv=False)[0]
    assert exact <= declared * (1 + 1e-5)
    assert exact > 0.3 * declared  # not vacuous


def test_residual_cotangents_are_pairs_and_add_up():
    """Layers: input, split, wrapped, merge, split, wrapped, merge. From L = sqrt(2), each
    "add" merge copies G to both paths and each split adds them: 2 sqrt(2) between the
    blocks, 4 sqrt(2) at the input of the first split."""
    model = _linear_residual_model("add")
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    bounds = model.bounds()
    assert bounds.output_cotangent_bounds[5] == pytest.approx((SQRT2, SQRT2))
    assert bounds.input_cotangent_bounds[4] == pytest.approx(2 * SQRT2)
    assert bounds.output_cotangent_bounds[2] == pytest.approx((2 * SQRT2, 2 * SQRT2))
    assert bounds.input_cotangent_bounds[1] == pytest.approx(4 * SQRT2)
    # Parameter bounds on the transformed path: X * G with X = 1 then 2 (after "add").
    assert [float(e.bound) for e in bounds.variables] == pytest.approx([2 * SQRT2, 2 * SQRT2])


def test_variables_are_complete_and_ordered():
    model = hand_network()
    owned = [v for _, v in parameterized_variables(model.dp_layers)]
    assert [e.variable for e in model.bounds().variables] == owned
    assert {variable_key(v) for v in owned} == {variable_key(v) for v in model.trainable_variables}
    model.dp_layers[1].trainable = False  # a frozen layer has no bound and gets no noise
    assert len(parameterized_variables(model.dp_layers)) == 2


class _WrongCount(L.DP_QuickSpectralDense):
    def backpropagate_params(self, input_bound, gradient_bound):
        return [1.0, 2.0]


def test_errors():
    # Named: Keras 3 refuses the name '__wrong_count' derived from the class in a graph.
    model, _, _ = build([L.DP_Flatten(), _WrongCount(5, name="wrong_count")], (12,))
    with pytest.raises(RuntimeError, match="2 bounds for 1 trainable"):
        model.bounds()
    split_only = [L.DP_BoundedInput(input_shape=(4,), upper_bound=1.0), L.DP_SplitResidual()]
    with pytest.raises(ValueError, match="inside a residual block"):
        bound_pass(split_only)
    with pytest.raises(ValueError, match="without the loss"):
        bound_pass(hand_network().dp_layers).sensitivities(4)
