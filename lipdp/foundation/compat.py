"""Which Keras lipdp runs on: the one place where lipdp deals with Keras versions.

lipdp's handle on Keras is the ``keras`` package (``import keras``), whatever its major
version:

* **Keras 3** (TensorFlow >= 2.16, which requires it; ``tf.keras`` is then the same
  package) with the TensorFlow backend: the main stack. Importing ``keras`` before or after
  ``lipdp`` makes no difference, and lipdp sets no environment variable.
* **Keras 2**: TensorFlow 2.15's own ``keras`` 2.15 (the same classes as its ``tf.keras``).
  The same code runs on it; the few places where the two APIs differ ask :func:`keras_3`.

With ``TF_USE_LEGACY_KERAS=1`` and TensorFlow >= 2.16, ``tf.keras`` is tf-keras, a Keras 2
package distinct from ``keras``: its layers are refused by :func:`refuse_foreign_layers`.

Keras 3 with the **JAX backend** runs the clipped family only (:mod:`lipdp.clipped.jax`,
what :func:`lipdp.make_private` returns there; accounting, ledger and callbacks are shared);
every TensorFlow program of lipdp (the clipless family, the TensorFlow clipped models, the
``tf.data`` pipelines) refuses it in one line naming ``KERAS_BACKEND=tensorflow``
(:func:`require_supported_keras`). Another backend (PyTorch) is refused the same way.

This module does not import TensorFlow at import time (``lipdp --help`` and
:mod:`lipdp.accounting` stay TensorFlow-free); :func:`require_supported_keras` is called by
the modules that build models, once TensorFlow is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
import warnings

#: The first TensorFlow release whose ``tf.keras`` is Keras 3 by default.
KERAS_3_DEFAULT_SINCE = (2, 16)
#: The environment variable that routes ``tf.keras`` to ``tf-keras`` (TensorFlow >= 2.15);
#: lipdp never sets it.
LEGACY_KERAS_FLAG = "TF_USE_LEGACY_KERAS"
#: The Keras 3 backend lipdp's TensorFlow programs run on (every family, every feature).
SUPPORTED_BACKEND = "tensorflow"
#: The Keras 3 backend of :mod:`lipdp.clipped.jax` (the clipped family's JAX step).
JAX_BACKEND = "jax"
#: The distributions that install the ``tensorflow`` package.
_TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tf-nightly",
    "tf-nightly-cpu",
)


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def tensorflow_version() -> tuple[int, int] | None:
    """``(major, minor)`` of TensorFlow: the imported one, else the installed one (from its
    package metadata, without importing it); ``None`` if neither is known."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(getattr(tf, "__version__", None), str):
        return _major_minor(tf.__version__)
    for name in _TENSORFLOW_DISTRIBUTIONS:
        try:
            return _major_minor(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _keras_package(tf) -> str:
    """``"keras"`` or ``"tf_keras"``: the package behind ``tf.keras`` (resolves it)."""
    return tf.keras.Model.__module__.split(".")[0]


def loaded_keras_version(tf) -> str:
    """The version of the Keras package behind ``tf.keras`` (resolves ``tf.keras``):
    ``keras`` 2.15 on TensorFlow 2.15, ``tf_keras`` with the flag, ``keras`` 3 without."""
    return str(getattr(sys.modules[_keras_package(tf)], "__version__", "?"))


@functools.cache
def keras_3() -> bool:
    """Whether lipdp's Keras, the ``keras`` package, is Keras 3 (imports it)."""
    import keras

    return keras.__version__.split(".")[0] == "3"


def step_without_autograph(step):
    """``step`` (a TensorFlow training step) marked not to be converted by autograph on
    Keras 3, unchanged on Keras 2.

    Why: Keras 3 runs its steps without autograph (its step functions are
    ``do_not_convert``), and lipdp's step is written with explicit ``tf.cond`` and
    ``tf.while_loop``. A custom loop that calls ``model.train_step`` inside its own
    ``tf.function`` (autograph on by default) made autograph convert every function of the
    step, recursively: 40 of the 46 seconds of a two-replica ``strategy.run(
    model.train_step)`` trace. Marked, it traces as Keras 3's ``fit`` does. Keras 2's
    ``fit`` converts the step and, through it, the ``call`` of user layers written with
    Python control flow on tensors (``tf.keras`` layers rely on it): left as it is."""
    if not keras_3():
        return step
    import tensorflow as tf

    return tf.autograph.experimental.do_not_convert(step)


def keras_backend() -> str:
    """The backend Keras runs on: ``keras.backend.backend()`` on Keras 3, ``"tensorflow"``
    on Keras 2 (imports keras)."""
    import keras

    return keras.backend.backend() if keras_3() else SUPPORTED_BACKEND


def keras_problem(backend: str = SUPPORTED_BACKEND) -> str | None:
    """Why lipdp's programs for ``backend`` (TensorFlow by default; :data:`JAX_BACKEND` for
    :mod:`lipdp.clipped.jax`) cannot run on this Keras, or ``None`` (imports keras)."""
    import keras

    current = keras_backend()
    if current == backend:
        return None
    if backend == SUPPORTED_BACKEND:
        return (
            f"Keras {keras.__version__} runs on the {current} backend while lipdp's training "
            f"steps are TensorFlow programs. Fix: set KERAS_BACKEND={SUPPORTED_BACKEND} before "
            "importing keras"
        )
    return (
        f"Keras {keras.__version__} runs on the {current} backend while lipdp.clipped.jax's "
        f"steps are JAX programs. Fix: set KERAS_BACKEND={backend} before importing keras "
        "(on TensorFlow, lipdp.clipped.model trains the same models)"
    )


def refuse_foreign_layers(layers) -> None:
    """Refuse layers that are not the ``keras`` package's (one line naming the fix): with
    ``TF_USE_LEGACY_KERAS=1`` and TensorFlow >= 2.16, ``tf.keras`` is tf-keras, a Keras 2
    whose layers Keras 3 cannot train."""
    import keras

    for layer in layers:
        if isinstance(layer, keras.layers.Layer):
            continue
        package = type(layer).__module__.split(".")[0]
        if package in ("tf_keras", "keras"):
            raise TypeError(
                f"Layer {getattr(layer, 'name', layer)!r} is a {package} {type(layer).__name__} "
                f"while lipdp runs on the keras package (Keras {keras.__version__}): build the "
                "model with `import keras` (with TF_USE_LEGACY_KERAS=1, tf.keras is tf-keras)."
            )


def require_supported_keras(backend: str = SUPPORTED_BACKEND) -> None:
    """Raise a one-line :class:`ImportError` naming the fix if lipdp's programs for
    ``backend`` cannot run on this Keras (:func:`keras_problem`)."""
    problem = keras_problem(backend)
    if problem is not None:
        raise ImportError(f"lipdp cannot run here: {problem}.")


# ------------------------------------------------------------- where the APIs differ
def declared_batch_shape(layer) -> tuple | None:
    """The batch input shape ``(None, ...)`` a layer was declared with -- an ``InputLayer``'s,
    or the ``input_shape=`` given to a first layer --, or ``None``."""
    if keras_3():
        shape = getattr(layer, "batch_shape", None)  # an InputLayer
        if shape is None and getattr(layer, "_input_shape_arg", None) is not None:
            shape = (None, *layer._input_shape_arg)  # noqa: SLF001  (Keras 3 keeps it here)
    else:
        shape = getattr(layer, "_batch_input_shape", None)
    return None if shape is None else tuple(shape)


def input_layer(shape, dtype=None):
    """A Keras ``InputLayer`` for inputs of shape ``shape`` (without the batch) and
    ``dtype`` (default: the float type)."""
    import keras

    if keras_3():
        return keras.layers.InputLayer(shape=tuple(shape), dtype=dtype)
    return keras.layers.InputLayer(input_shape=tuple(shape), dtype=dtype)


def as_layer(item):
    """``item``, or the ``InputLayer`` behind a ``keras.Input(...)`` tensor (Keras models
    take such a tensor in a list of layers; on both stacks its history's first entry is
    the ``InputLayer``)."""
    history = getattr(item, "_keras_history", None)
    if history is not None and not hasattr(item, "call"):
        import keras

        operation = history[0]
        if isinstance(operation, keras.layers.InputLayer):
            return operation
    return item


class Reduction:
    """The names of Keras' loss reductions (Keras 2's ``tf.keras.losses.Reduction``, which
    Keras 3 replaced by the same strings; Keras 3 has no ``"auto"``)."""

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"


@contextlib.contextmanager
def input_shape_accepted():
    """Around ``keras.layers.Layer.__init__(..., input_shape=...)``: silence Keras 3's
    warning against ``input_shape``. Keras 3 still honours it (a sequential model's first
    layer declares the input shape with it), and lipdp's first layers take it by design
    (the original package's API)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Do not pass an `input_shape`")
        yield


def symbolic_call(fn, *args):
    """Keras 3: ``fn(*args)`` on symbolic inputs (``keras.KerasTensor``), traced without
    data; the symbolic outputs. Unbuilt layers called by ``fn`` are built. (Keras 3's
    ``Layer.compute_output_spec`` does this unless the layer defines
    ``compute_output_shape``, which a model then cannot define with it.)"""
    from keras.src import backend

    return backend.compute_output_spec(fn, *args)


# ------------------------------------------------------------ functional graphs
def is_graph_model(layer) -> bool:
    """A built functional model (:func:`is_functional` with its inputs)."""
    return is_functional(layer) and bool(layer.inputs)


def graph_nodes(model):
    """``(layer, input tensors, output tensors)`` for every node of a functional model's
    graph but its inputs' (Keras 2's nodes name the layer ``layer``, Keras 3's
    ``operation``)."""
    for nodes in model._nodes_by_depth.values():  # noqa: SLF001 - both Keras' graph
        for node in nodes:
            if node.is_input:
                continue
            if keras_3():
                yield node.operation, list(node.input_tensors), list(node.outputs)
            else:
                yield node.layer, list(node.keras_inputs), tf_nest_flatten(node.outputs)


def reference_inputs(model, x) -> list:
    """The tensors of ``x`` in the order of ``model.inputs``, matched as the model's own
    call matches them (by name for a dict)."""
    if keras_3():
        return list(model._standardize_inputs(x))  # noqa: SLF001
    return list(model._flatten_to_reference_inputs(x))  # noqa: SLF001


def tf_nest_flatten(structure) -> list:
    import tensorflow as tf

    return tf.nest.flatten(structure)


def flatten(structure) -> list:
    """The leaves of a nest of arrays on any backend: ``keras.tree.flatten`` on Keras 3
    (no TensorFlow under JAX), ``tf.nest.flatten`` on Keras 2 (which has no
    ``keras.tree``)."""
    if keras_3():
        import keras

        return keras.tree.flatten(structure)
    return tf_nest_flatten(structure)


def op_name_scope(name):
    """Keras 3: a TensorFlow name scope ``name`` for the ops of layers a model calls itself
    (its forward loop in a training step or a symbolic build, not through the model's
    ``__call__``). Why: Keras 3 opens each layer's TensorFlow name scope, which at the
    root of a graph may not start with ``_`` -- the default name of a layer whose class is
    private (``_Penalty`` -> ``__penalty``) -- while inside a model's scope it may (as in a
    Keras call). Op names only (variable paths are Keras' own); Keras 2: no scope."""
    if keras_3():
        import tensorflow as tf

        return tf.name_scope(name)
    return contextlib.nullcontext()


def frozen_batch_norm_in_inference_mode(layer) -> bool:
    """Whether the batch normalisation ``layer``, frozen (``trainable = False``), runs in
    inference mode even when called with ``training=True`` (moving statistics, not
    updated; documented by Keras). Keras 2: its v2 class does (``_USE_V2_BEHAVIOR``), the
    v1 class keeps batch statistics. Keras 3 has one class (``tf.compat.v1.keras``'s is
    the same), whose call uses batch statistics only when ``training and trainable``."""
    if layer.trainable:
        return False
    if keras_3():
        import keras

        return isinstance(layer, keras.layers.BatchNormalization)
    return bool(getattr(layer, "_USE_V2_BEHAVIOR", False))


def conformed_to_model_input(model, h):
    """``h`` conformed to the ``Input`` of a graph model (a ``Sequential`` built with an
    input shape, or a functional model) as the model's own call does first: cast to the
    input's dtype, a trailing axis of size 1 squeezed or added. ``h`` as it is for a
    ``Sequential`` never built as a graph. Keras 2 does it in
    ``_conform_to_reference_input``; Keras 3 in its functional graph's
    ``_standardize_inputs`` (a ``Sequential`` keeps that graph in ``_functional``)."""
    if keras_3():
        import keras

        graph = model._functional if isinstance(model, keras.Sequential) else model  # noqa: SLF001
        if graph is None or not hasattr(graph, "_standardize_inputs"):
            return h
        (conformed,) = graph._standardize_inputs(h)  # noqa: SLF001
        return conformed
    if not model.inputs:
        return h
    return model._conform_to_reference_input(h, ref_input=model.inputs[0])  # noqa: SLF001


def keras_global_seed_generator():
    """Keras 3: the ``keras.random.SeedGenerator`` Keras' random ops draw from when called
    without a seed (created on first use: ``None`` before); Keras 2: ``None`` (its
    unseeded random ops use TensorFlow's op seeds). Not public API in Keras 3."""
    if not keras_3():
        return None
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    return global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)


def set_keras_global_seed_generator(generator) -> None:
    """Keras 3: make ``generator`` (or ``None``: a new one on next use) the generator of
    :func:`keras_global_seed_generator`; Keras 2: nothing."""
    if keras_3():
        from keras.src.backend.common import global_state
        from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

        global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)


def is_functional(layer) -> bool:
    """Whether ``layer`` is a functional model (a graph of layers, subclasses included):
    Keras 2 flags it ``_is_graph_network`` (a ``Sequential`` built with an input shape
    too), Keras 3 makes it a ``Functional`` (a ``Sequential`` only holds one)."""
    if keras_3():
        from keras.src.models.functional import Functional

        return isinstance(layer, Functional)
    return bool(getattr(layer, "_is_graph_network", False))


def build_input_shape(layer):
    """The input shape ``layer`` was built for (with the batch axis; Keras 2 may give a
    ``tf.TensorShape``), or ``None``: Keras 2 records it in ``_build_input_shape``, Keras
    3 the arguments of ``build`` in ``_build_shapes_dict``."""
    if keras_3():
        shapes = getattr(layer, "_build_shapes_dict", None) or {}
        return next(iter(shapes.values())) if len(shapes) == 1 else None
    return getattr(layer, "_build_input_shape", None)


def clone_model(model, clone_function):
    """``keras.models.clone_model(model, clone_function=clone_function)``. Keras 3 replays
    a functional model's calls with the keyword arguments each node recorded, ``mask=None``
    included for a layer whose call takes a mask (a batch normalisation): a replacement
    whose call takes none (a group normalisation) is called without it, as a Keras call
    would call it."""
    import keras

    if not keras_3() or not is_functional(model):
        return keras.models.clone_model(model, clone_function=clone_function)

    def call(layer, *args, **kwargs):
        if not getattr(layer, "_call_has_mask_arg", True):
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    return keras.models.clone_model(model, clone_function=clone_function, call_function=call)


def is_variable(value) -> bool:
    """Whether ``value`` is a model variable: a ``keras.Variable`` on Keras 3 (which wraps a
    ``tf.Variable`` but is not one), a ``tf.Variable`` on Keras 2."""
    import tensorflow as tf

    if keras_3():
        import keras

        return isinstance(value, (keras.Variable, tf.Variable))
    return isinstance(value, tf.Variable)


def tape_variable(variable):
    """The object a ``tf.GradientTape`` watches when ``variable`` is read (what
    ``tape.watched_variables()`` returns): a Keras 3 variable's backing ``tf.Variable``
    (its ``value`` outside an autocast scope), the variable itself on Keras 2."""
    if keras_3():
        import keras

        if isinstance(variable, keras.Variable):
            return variable.value
    return variable


def variable_path(variable) -> str:
    """How lipdp names a variable in a message: Keras 3's ``path`` (``"dense/kernel"``;
    its ``name`` is only ``"kernel"``), Keras 2's ``name`` (``"dense/kernel:0"``)."""
    return str(getattr(variable, "path", None) or variable.name)


def batch_input_shape_config(layer) -> dict:
    """``{"batch_input_shape": (None, ...)}`` for a layer declared with ``input_shape=``, else
    ``{}``: for the ``get_config`` of a first layer. Keras 2's base configuration already
    holds this entry; Keras 3's drops the declared shape (a saved first layer would come back
    without it), so lipdp's input layers write it there, the same entry as on Keras 2."""
    if not keras_3():
        return {}
    shape = declared_batch_shape(layer)
    return {} if shape is None else {"batch_input_shape": shape}


def accept_batch_input_shape(kwargs: dict) -> dict:
    """``kwargs`` of a first layer's ``__init__`` with Keras 2's ``batch_input_shape`` (the
    configuration entry of :func:`batch_input_shape_config`) turned into ``input_shape`` on
    Keras 3, whose ``Layer`` refuses the former; unchanged on Keras 2."""
    if keras_3() and "batch_input_shape" in kwargs:
        kwargs = dict(kwargs)
        shape = kwargs.pop("batch_input_shape")
        if shape is not None and kwargs.get("input_shape") is None:
            kwargs["input_shape"] = tuple(shape[1:])
    return kwargs


def replay_compile_config(model, config) -> None:
    """``model.compile_from_config(config)`` for a model whose ``compile`` adds checks.

    Keras (2.13+ and 3) skips ``compile()`` when loading a model that overrides it; lipdp's
    models only add checks there, so the stored configuration is replayed through it, and
    the optimizer is built for the loaded weights."""
    import keras

    model.compile(**keras.saving.deserialize_keras_object(config))
    if model.built and isinstance(model.optimizer, keras.optimizers.Optimizer):
        model.optimizer.build(model.trainable_variables)


def first_replica_spec(dataset):
    """The element spec of one replica's batches of a ``tf.distribute`` ``dataset``: the
    first replica's spec where the dataset's spec is per replica, the spec itself elsewhere.

    Why: Keras 3 (3.15, TensorFlow backend), at the start of ``fit`` and ``evaluate`` under a
    strategy, builds the model's state on symbolic inputs shaped like the first batch, which
    it *draws* from the dataset and averages elementwise over the replicas
    (``strategy.reduce("MEAN", batch, axis=None)``). Parts of different row counts -- a
    Poisson batch split between the replicas, a partial last batch -- fail there ("Inputs
    to operation AddN of type AddN must have the same size and shape") before any step;
    and the drawn batch is thrown away, so a pipeline that re-draws its randomness at every
    iteration (Poisson batches) starts training on its second draw. The spec has the shapes
    and dtypes the symbolic build needs, and draws nothing."""
    import tensorflow as tf
    from tensorflow.python.distribute.values import PerReplicaSpec  # no public name

    def local(spec):
        return spec._value_specs[0] if isinstance(spec, PerReplicaSpec) else spec  # noqa: SLF001

    return tf.nest.map_structure(local, dataset.element_spec)


def replica_loss(loss):
    """A replica's mean loss from Keras 3's ``compute_loss`` under a strategy of ``R``
    replicas, which divides it by ``R`` (so that the replicas' gradients sum to the
    gradient of the global mean): ``R`` times it. Keras 2's tracker updates itself
    (unchanged)."""
    if not keras_3():
        return loss
    import tensorflow as tf

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss * replicas if replicas > 1 else loss


class _TensorFlowArrayOps:
    """The part of ``keras.ops`` lipdp's backend-neutral maths uses, on TensorFlow's ops:
    what :func:`array_ops` returns on Keras 2 (which has no ``keras.ops``). Same names,
    arguments and results as ``keras.ops`` on the TensorFlow backend (each function is the
    TensorFlow op ``keras.ops`` itself calls there), so a formula gives the same numbers on
    Keras 2 and Keras 3. Add a function here when the shared maths needs a new one."""

    @staticmethod
    def _tf():
        import tensorflow as tf

        return tf

    def cast(self, x, dtype):
        return self._tf().cast(x, dtype)

    def convert_to_tensor(self, x, dtype=None):
        return self._tf().convert_to_tensor(x, dtype)

    def shape(self, x):
        """Static sizes where known, dynamic ones (scalar tensors) elsewhere (as
        ``keras.ops.shape`` on the TensorFlow backend)."""
        tf = self._tf()
        x = tf.convert_to_tensor(x)
        dynamic = tf.shape(x)
        return tuple(d if d is not None else dynamic[i] for i, d in enumerate(x.shape))

    def reshape(self, x, new_shape):
        return self._tf().reshape(x, new_shape)

    def maximum(self, x1, x2):
        return self._tf().maximum(x1, x2)

    def minimum(self, x1, x2):
        return self._tf().minimum(x1, x2)

    def where(self, condition, x1, x2):
        return self._tf().where(condition, x1, x2)

    def zeros_like(self, x, dtype=None):
        return self._tf().zeros_like(x, dtype)

    def ones_like(self, x, dtype=None):
        return self._tf().ones_like(x, dtype)

    def abs(self, x):
        return self._tf().abs(x)

    def sqrt(self, x):
        return self._tf().sqrt(x)

    def square(self, x):
        return self._tf().square(x)

    def isfinite(self, x):
        return self._tf().math.is_finite(x)

    def isnan(self, x):
        return self._tf().math.is_nan(x)

    def sum(self, x, axis=None, keepdims=False):
        return self._tf().reduce_sum(x, axis=axis, keepdims=keepdims)

    def max(self, x, axis=None, keepdims=False):
        return self._tf().reduce_max(x, axis=axis, keepdims=keepdims)

    def min(self, x, axis=None, keepdims=False):
        return self._tf().reduce_min(x, axis=axis, keepdims=keepdims)

    def einsum(self, subscripts, *operands):
        return self._tf().einsum(subscripts, *operands)

    def matmul(self, x1, x2):
        return self._tf().matmul(x1, x2)

    def stack(self, x, axis=0):
        return self._tf().stack(x, axis=axis)

    def concatenate(self, xs, axis=0):
        return self._tf().concat(xs, axis=axis)

    def mean(self, x, axis=None, keepdims=False):
        return self._tf().reduce_mean(x, axis=axis, keepdims=keepdims)

    # The clipless family's layers, projections and losses (issue 38 item 5).
    def tensordot(self, x1, x2, axes=2):
        return self._tf().tensordot(x1, x2, axes=axes)

    def transpose(self, x, axes=None):
        return self._tf().transpose(x, perm=axes)

    def pad(self, x, pad_width, mode="constant", constant_values=None):
        return self._tf().pad(x, pad_width, mode=mode.upper(), constant_values=constant_values or 0)

    def conv(self, inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
        # 2-D, channels last (tf.nn.convolution's op; its own wrapper on TF 2.15 leaves the
        # data_format attribute unset, which the second-order gradient then reads)
        return self._tf().nn.conv2d(inputs, kernel, strides, padding.upper())

    def average_pool(self, inputs, pool_size, strides=None, padding="valid", data_format=None):
        strides = pool_size if strides is None else strides
        return self._tf().nn.avg_pool(inputs, pool_size, strides, padding.upper())

    def fft2(self, x):
        spectrum = self._tf().signal.fft2d(self._tf().complex(*x))
        return self._tf().math.real(spectrum), self._tf().math.imag(spectrum)

    def ifft2(self, x):
        real, imag = self.fft2((x[0], -x[1]))  # keras.ops.ifft2's formula on TensorFlow
        size = self._tf().cast(self._tf().shape(x[0])[-2] * self._tf().shape(x[0])[-1], real.dtype)
        return real / size, -imag / size

    def sort(self, x, axis=-1):
        return self._tf().sort(x, axis=axis)

    def svd(self, x, full_matrices=True, compute_uv=True):
        if compute_uv:
            raise NotImplementedError("the Keras 2 shim computes singular values only")
        return self._tf().linalg.svd(x, full_matrices=full_matrices, compute_uv=False)

    def stop_gradient(self, x):
        return self._tf().stop_gradient(x)

    def rsqrt(self, x):
        return self._tf().math.rsqrt(x)

    def exp(self, x):
        return self._tf().exp(x)

    def log1p(self, x):
        return self._tf().math.log1p(x)

    def relu(self, x):
        return self._tf().nn.relu(x)

    def log_softmax(self, x, axis=-1):
        return self._tf().nn.log_softmax(x, axis=axis)

    def clip(self, x, x_min, x_max):
        return self._tf().clip_by_value(x, x_min, x_max)

    def all(self, x, axis=None, keepdims=False):
        return self._tf().reduce_all(self._tf().cast(x, "bool"), axis=axis, keepdims=keepdims)

    def ones(self, shape, dtype=None):
        return self._tf().ones(shape, dtype=dtype or "float32")

    def argmax(self, x, axis=None, keepdims=False):
        if keepdims:
            raise NotImplementedError("the Keras 2 shim's argmax has no keepdims")
        return self._tf().argmax(x, axis=axis, output_type=self._tf().int32)

    def one_hot(self, x, num_classes, axis=-1, dtype=None):
        return self._tf().one_hot(x, num_classes, axis=axis, dtype=dtype or "float32")


_TENSORFLOW_ARRAY_OPS = _TensorFlowArrayOps()


def array_ops():
    """The array namespace of lipdp's backend-neutral maths (the clipping rule
    :meth:`lipdp.clipped.clipping.Clipping.factors`, the ghost rules' shared formulas):
    ``keras.ops`` on Keras 3, whatever its backend (it takes TensorFlow tensors under the
    TensorFlow backend and JAX arrays under the JAX backend, and runs the backend's own op:
    ``tf.maximum``, ``jnp.maximum``, ...); on Keras 2, which has no ``keras.ops``, a shim of
    the same names on TensorFlow's ops (:class:`_TensorFlowArrayOps`: the subset lipdp
    uses). Write such maths as ``ops = compat.array_ops()`` then ``ops.maximum(...)``; the
    dtypes it computes in are the inputs' (float64 squared norms on TensorFlow, float32 on
    JAX): a formula's precision argument is the caller's."""
    if keras_3():
        import keras

        return keras.ops
    return _TENSORFLOW_ARRAY_OPS
