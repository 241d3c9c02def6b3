"""The losses and inputs tests/clipless/jax/test_losses_jax.py compares across backends
(imported by the JAX test and by the TensorFlow subprocess, ``tensorflow_losses.py``)."""

import numpy as np

K = 5

#: ``(tag, class name in lipdp.clipless.losses, keyword arguments)``: every loss, with and
#: without ``nb_classes`` where it changes ``get_L()``.
LOSS_CASES = [
    ("tcce", "DP_TauCategoricalCrossentropy", {"tau": 2.0}),
    ("tcce_hot", "DP_TauCategoricalCrossentropy", {"tau": 40.0}),
    ("tbce", "DP_TauBCE", {"tau": 3.0}),
    ("hinge", "DP_MulticlassHinge", {"min_margin": 0.5}),
    ("hinge_k", "DP_MulticlassHinge", {"nb_classes": K}),
    ("kr", "DP_MulticlassKR", {}),
    ("kr_k", "DP_MulticlassKR", {"nb_classes": K}),
    ("hkr", "DP_MulticlassHKR", {"alpha": 5.0, "min_margin": 0.3}),
    ("hkr_k", "DP_MulticlassHKR", {"nb_classes": K}),
    ("kcos", "DP_KCosineSimilarity", {"K": 2.0}),
    ("kcos_small", "DP_KCosineSimilarity", {"K": 0.1}),
    ("mae", "DP_MeanAbsoluteError", {}),
]


def inputs(seed=0):
    """``{name: (y_true, y_pred)}``: random rows and adversarial ones (logits of 1e30 and
    -1e30, exact ties, zeros; labels zero, two-hot, negative, out of [0, 1], NaN, infinite,
    -0.0 against 0.0, +-1 encoded, uniform, 1e30), and rank-3 predictions."""
    rng = np.random.default_rng(seed)
    rows = 24
    z = (rng.normal(size=(rows, K)) * rng.choice([0.01, 1.0, 30.0], size=(rows, 1))).astype(
        np.float32
    )
    y = np.eye(K, dtype=np.float32)[rng.integers(0, K, size=rows)]
    y[16:] = rng.uniform(-2, 2, size=(rows - 16, K))  # arbitrary real labels
    za, ya = z[:16].copy(), y[:16].copy()
    za[1] = 1e30
    za[2] = [1e30, -1e30, 0, 0, 5]
    za[3] = 0.0
    za[4] = [2, 2, 2, -1, -1]
    za[5] = [-1e30, 1e30, -1e30, 1e30, 0]
    za[6] = [-1e35, 1e35, 0, 1, -1]
    ya[6] = 0.0
    ya[7] = [1, 1, 0, 0, 0]
    ya[8] = [-1, 3, 0.5, 0, 0]
    ya[9, 0] = np.nan
    ya[10, 2] = np.inf
    ya[11] = [-0.0, 0.0, -1, -1, -1]
    ya[12] = [-1, 1, -1, -1, -1]
    ya[13] = 0.2
    za[13] = [2, 0, 0, 0, 0]  # on the sphere ||z|| = K of DP_KCosineSimilarity(K=2)
    ya[14] = 1e30
    ya[15, 1] = -np.inf
    z3 = rng.normal(size=(4, 3, K)).astype(np.float32)
    y3 = np.eye(K, dtype=np.float32)[rng.integers(0, K, size=(4, 3))]
    y3[0, 1, 0] = np.nan
    return {"random": (y, z), "adversarial": (ya, za), "rank3": (y3, z3)}
