r"""One call that makes a model private: :func:`make_private`.

The classes (:class:`~lipdp.clipless.model.DP_Sequential`,
:class:`~lipdp.clipped.model.DPSGD_Sequential`)
take five configuration objects for full control. :func:`make_private` takes the
numbers a user knows -- the target ``(epsilon, delta)``, the epochs, the batch size and
the size of the private training set -- and returns a model of the right family whose
noise multiplier is the smallest that meets the target (as Opacus'
``make_private_with_epsilon`` and jax-privacy's ``make_private``):

.. code-block:: python

    model = lipdp.make_private(
        [keras.layers.Dense(64, activation="relu", input_shape=(64,)),
         keras.layers.Dense(10)],
        epsilon=3.0, delta=1e-5, epochs=10, batch_size=128, dataset_size=len(x),
    )
    model.compile(optimizer="adam",
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    model.fit(lipdp.private_batches(model, x, y), epochs=10)

How ``sigma`` is found: the model is built with ``sigma = 1``, then
:func:`lipdp.accounting.calibrate_noise_multiplier` rescales the model's own privacy plan
(every Gaussian of a step, per-layer coefficients kept; the sampling rate ``q = b / N``
and ``epochs * floor(N / b)`` steps) to the smallest ``sigma`` whose ``epsilon`` after
``epochs`` epochs is at most the target. The plan is the one ``fit`` records in the
model's privacy ledger, so the ``epsilon`` reported after ``epochs`` epochs is the
target (up to the bisection's tolerance, from below).

**Backends.** Under Keras 3's JAX backend (``KERAS_BACKEND=jax``) the clipped family is
:class:`~lipdp.clipped.jax.model.DPSGD_JaxModel` (the same accounting; flat, automatic or
global clipping, ``"global"`` noise) and :func:`private_batches` gives padded numpy
Poisson batches (:class:`~lipdp.core.jax.batches.PoissonBatches`); the clipless family is
``DP_Sequential`` on its JAX trainer (:class:`~lipdp.clipless.jax.trainer.CliplessJaxTrainer`:
the layers and losses ported to ``jax.jit``, global or per-layer noise; the others refused
with the way out). The TensorFlow modules of the steps are imported only on that backend.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import keras

from lipdp.accounting import calibrate_noise_multiplier
from lipdp.clipped.clipping import CLIPPING_MODES, Clipping
from lipdp.core.parameters import DPParameters
from lipdp.foundation import compat, validation
from lipdp.foundation.metadata import DatasetMetadata

logger = logging.getLogger(__name__)

#: ``method`` values: the two families, or ``"auto"`` (clipless when every layer is one of
#: lipdp's DP layers, clipped DP-SGD otherwise).
METHODS = ("auto", "clipless", "clipped")


def make_private(
    model_or_layers,
    *,
    epsilon,
    delta,
    epochs,
    batch_size,
    dataset_size,
    method="auto",
    clip_norm=1.0,
    clipping="flat",
    noise="global",
    input_bound=None,
    sampling="poisson",
    accountant="rdp",
    allow_large_delta=False,
    **model_options,
):
    """A private model meeting ``(epsilon, delta)`` after ``epochs`` epochs (module doc).

    Args:
        model_or_layers: a list of Keras layers (the first with an ``input_shape``, or an
            ``InputLayer``), a ``keras.Sequential`` (its layers are used, which then
            train in place), or any other Keras model, nested as one layer (the clipped
            family only): functional, of several inputs (TensorFlow backend: feed one
            array per input, a dict or a tuple, to :func:`private_batches`), subclassed
            (built: called once on a batch, or ``build``). A model already private is
            refused: it is trained as it is.
        epsilon, delta: the target; ``epsilon`` of the whole training.
        epochs: the number of epochs the budget is planned for.
        batch_size: the (expected, under Poisson sampling) batch size ``b``.
        dataset_size: ``N``, the number of private training records.
        method: ``"clipless"`` (Lipschitz DP layers, :mod:`lipdp.clipless.model`), ``"clipped"``
            (ordinary Keras layers, :mod:`lipdp.clipped.model`), or ``"auto"``.
        clip_norm, clipping: the clipped family's radius ``R`` and mode
            (:data:`lipdp.clipped.model.CLIPPING_MODES`); refused for the clipless family.
        noise: ``"global"`` or ``"per-layer"`` (``noisify_strategy``).
        input_bound: clipless only: the public bound on an input's norm, for a
            :class:`~lipdp.clipless.layers.DP_BoundedInput` put in front when the layers do not
            start with one.
        sampling: ``"poisson"`` (what the accountant analyses; feed
            :func:`private_batches`) or ``"shuffle"``.
        accountant: ``"rdp"``, ``"pld"`` or ``"gdp"``, for the calibration.
        allow_large_delta: keep a ``delta >= 1/dataset_size`` (refused otherwise: such a
            ``delta`` is met by a mechanism that publishes one record at random,
            :func:`lipdp.foundation.validation.delta_for_dataset`); logged as a warning.
        **model_options: passed to the model class (``gradient_method``, ``ascent``,
            ``row_isolation`` -- each example's loss computed on its own, forward and
            backward, :mod:`lipdp.core.isolation`; the JAX step always does --,
            ``physical_batch_size`` -- the step computed ``P`` rows at a time and the
            logical batch noised once, for logical batches larger than memory, same
            epsilon --, ...).

    Returns:
        A ``DP_Sequential`` or ``DPSGD_Sequential`` (a ``DPSGD_JaxModel`` wrapping the
        model on the JAX backend), not compiled (``compile`` it as any Keras model; the
        clipless family needs a loss of :mod:`lipdp.clipless.losses`).
    """
    method = validation.choice("method", method, METHODS)
    epochs = validation.count("epochs", epochs, minimum=1)
    epsilon = validation.positive("epsilon", epsilon)
    dataset_size = validation.count("dataset_size", dataset_size, minimum=1)
    delta = validation.delta_for_dataset(delta, dataset_size, allow_large=allow_large_delta)
    jax = compat.keras_backend() == compat.JAX_BACKEND
    if jax and _jax_family(model_or_layers, method) == "clipped":
        model = _jax_model(
            model_or_layers, method, delta, batch_size, dataset_size, clip_norm, clipping,
            noise, input_bound, sampling, model_options,
        )  # fmt: skip
        return _calibrated(model, epsilon, delta, epochs, accountant, "clipped")
    from lipdp.clipless.model import DP_Model, DP_Sequential

    _refuse_private(model_or_layers, DP_Model)
    if not jax:
        from lipdp.core.private_model import PrivateModel

        _refuse_private(model_or_layers, PrivateModel)
    layers = _layers_of(model_or_layers)
    method = _family(method, layers)
    input_shape = _input_shape(layers)
    metadata = DatasetMetadata(
        input_shape=input_shape,
        nb_classes=_output_units(layers, input_shape),
        nb_samples_train=validation.count("dataset_size", dataset_size, minimum=1),
        batch_size=validation.count("batch_size", batch_size, minimum=1),
        sampling=sampling,
    )
    parameters = DPParameters(noise, 1.0, validation.probability("delta", delta))
    if method == "clipless":  # DP_Sequential: the TensorFlow or the JAX trainer
        _refuse_clipping_options(clip_norm, clipping)
        model = DP_Sequential(
            _bounded(layers, input_bound, metadata.input_shape),
            dp_parameters=parameters,
            dataset_metadata=metadata,
            **model_options,
        )
    else:
        from lipdp.clipped.model import DPSGD_Sequential

        if input_bound is not None:
            raise ValueError("input_bound is for method='clipless'; clipping bounds the rest.")
        clipping = Clipping(validation.choice("clipping", clipping, CLIPPING_MODES), clip_norm)
        model = DPSGD_Sequential(
            layers,
            dp_parameters=parameters,
            clipping=clipping,
            dataset_metadata=metadata,
            **model_options,
        )
        if _several(input_shape) and not model.built:  # no InputLayer declares them
            model.build([(None, *shape) for shape in input_shape])
    return _calibrated(model, epsilon, delta, epochs, accountant, method)


def _calibrated(model, epsilon, delta, epochs, accountant, method):
    """``model`` with the smallest ``sigma`` meeting ``(epsilon, delta)`` (module doc)."""
    sigma = calibrate_noise_multiplier(epsilon, epochs, model=model, accountant=accountant)
    model.dp_parameters = dataclasses.replace(model.dp_parameters, noise_multiplier=sigma)
    metadata = model.dataset_metadata
    logger.info(
        "make_private: %s family, sigma = %.4g for (epsilon, delta) = (%g, %g) after %d "
        "epochs of %d steps (q = %.4g).",
        method, sigma, epsilon, delta, epochs, metadata.nb_steps_per_epochs,
        metadata.sampling_rate,
    )  # fmt: skip
    return model


def private_batches(model, x, y, seed=None):
    """One epoch of Poisson batches of ``(x, y)`` (``x``: for a model of several inputs,
    one array per input, a dict or a list or tuple) at the model's rate ``q = b / N`` and
    steps per epoch (:func:`lipdp.pipeline.poisson_batches`, a ``tf.data.Dataset``; on the
    JAX backend padded numpy batches with a row mask,
    :class:`~lipdp.core.jax.batches.PoissonBatches`); pass it to ``fit`` with
    ``epochs=E`` (fresh draws every epoch). ``seed=None``: drawn from the operating
    system, as amplification by subsampling assumes (rule S8)."""
    return model.private_batches(x, y, seed)


def _jax_model(
    model_or_layers, method, delta, batch_size, dataset_size, clip_norm, clipping, noise,
    input_bound, sampling, model_options,
):  # fmt: skip
    """The clipped family's JAX model (module docstring), not calibrated yet."""
    if input_bound is not None:
        raise ValueError("input_bound is for method='clipless'; clipping bounds the rest.")
    from lipdp.clipped.jax.model import DPSGD_JaxModel

    _refuse_private(model_or_layers, DPSGD_JaxModel)
    if model_options.pop("row_isolation", True) is not True:
        raise ValueError(
            "row_isolation=False is not available on the JAX backend: its step always "
            "computes each example's loss on its own (jax.vmap over the rows)."
        )
    network = _network(model_or_layers)
    input_shape = _model_input_shape(network)
    if _several(input_shape):
        raise ValueError(
            f"Model {network.name!r} has several inputs: the JAX backend trains models of "
            "one input; set KERAS_BACKEND=tensorflow, or concatenate the inputs."
        )
    metadata = DatasetMetadata(
        input_shape=input_shape,
        nb_classes=_classes(_output_shape(network, (None, *input_shape))),
        nb_samples_train=validation.count("dataset_size", dataset_size, minimum=1),
        batch_size=validation.count("batch_size", batch_size, minimum=1),
        sampling=sampling,
    )
    return DPSGD_JaxModel(
        network,
        dp_parameters=DPParameters(noise, 1.0, validation.probability("delta", delta)),
        clipping=Clipping(validation.choice("clipping", clipping, CLIPPING_MODES), clip_norm),
        dataset_metadata=metadata,
        **model_options,
    )


def _jax_family(model_or_layers, method) -> str:
    """The family on the JAX backend: ``method``, or for ``"auto"`` clipless when the layers
    (a list or a ``Sequential``) are all lipdp DP layers, else clipped (any other model)."""
    if method != "auto":
        return method
    if not isinstance(model_or_layers, (list, tuple, keras.Sequential)):
        return "clipped"
    if "lipdp.clipless.layers.base" not in sys.modules:
        return "clipped"  # no DP layer exists in this process (and TensorFlow stays unloaded)
    return _family(method, _layers_of(model_or_layers))


def _network(model_or_layers):
    """A built Keras model: the model given, or a ``Sequential`` of the layers given."""
    if isinstance(model_or_layers, keras.Model):
        network = model_or_layers
    elif isinstance(model_or_layers, (list, tuple)) and model_or_layers:
        network = keras.Sequential(list(model_or_layers))
    else:
        raise TypeError(
            "make_private takes a list of Keras layers or a Keras model, got "
            f"{type(model_or_layers).__name__}."
        )
    if not network.built:
        raise ValueError(
            f"Model {network.name!r} has no input shape: start it with "
            "keras.Input(shape=...) (or give the first layer an InputLayer), or call it once "
            "on a batch of inputs."
        )
    return network


def _classes(output_shape) -> int:
    units = tuple(output_shape)[-1]
    if units is None:
        raise ValueError("The model's output has no static last dimension (its classes).")
    return int(units)


# ------------------------------------------------------------------------------ helpers
def _refuse_private(model_or_layers, private_class) -> None:
    """Refuse a model that is already private (``private_class``: lipdp's private models
    on this backend): it has its noise multiplier and its privacy ledger; wrapping it in
    another private model would train it by a step that is not its own."""
    if isinstance(model_or_layers, private_class):
        raise ValueError(
            f"Model {model_or_layers.name!r} is already private "
            f"({type(model_or_layers).__name__}): compile and fit it as it is, or call "
            "make_private on the layers or the model it was made from."
        )


def _model_input_shape(model):
    """One example's input shape of a Keras model (no batch axis); for a model of several
    inputs, a tuple of them (the order of ``model.inputs``, or of the list a subclassed
    model was built for). A functional model declares it; a subclassed model knows it
    once built (by a call, or ``build``)."""
    if compat.is_graph_model(model):
        shapes = [tuple(t.shape)[1:] for t in model.inputs]
    else:
        shape = compat.build_input_shape(model)
        if shape is None:
            raise ValueError(
                f"Model {model.name!r} has no input shape (a subclassed model learns it when "
                "built): call it once on a batch of inputs, or model.build((None, ...)), "
                "before make_private."
            )
        # One shape starts with its batch axis (a number or None), a list of them with a
        # shape (a tuple; Keras 2: a TensorShape).
        several = not isinstance(tuple(shape)[0], (int, type(None)))
        shapes = [tuple(s)[1:] for s in shape] if several else [tuple(shape)[1:]]
    return shapes[0] if len(shapes) == 1 else tuple(shapes)


def _several(input_shape) -> bool:
    """Is ``input_shape`` (of one example) that of several inputs, a tuple of shapes?"""
    return bool(input_shape) and all(isinstance(s, tuple) for s in input_shape)


def _layers_of(model_or_layers) -> list:
    if isinstance(model_or_layers, keras.Sequential):
        layers = list(model_or_layers.layers)
        if model_or_layers.built and not _is_input_layer(layers[0]):
            # A built Sequential's InputLayer is not in .layers: put its shape back.
            layers.insert(0, compat.input_layer(model_or_layers.input_shape[1:]))
        return layers
    if isinstance(model_or_layers, keras.Model):
        shape = _model_input_shape(model_or_layers)
        if _several(shape):
            return [model_or_layers]  # reads the inputs itself: the model's first layer
        return [compat.input_layer(shape), model_or_layers]
    if isinstance(model_or_layers, (list, tuple)) and model_or_layers:
        return [compat.as_layer(item) for item in model_or_layers]
    raise TypeError(
        "make_private takes a list of Keras layers or a Keras model, got "
        f"{type(model_or_layers).__name__}."
    )


def _family(method, layers) -> str:
    if method != "auto":
        return method
    from lipdp.clipless.layers.base import DPLayer

    dp = [isinstance(layer, DPLayer) for layer in layers if not _is_input_layer(layer)]
    if all(dp):
        return "clipless"
    if any(dp):
        raise ValueError(
            "The layers mix lipdp DP layers and ordinary Keras layers: pass method='clipless' "
            "(DP layers only) or method='clipped' (ordinary layers)."
        )
    return "clipped"


def _input_shape(layers) -> tuple:
    """One example's input shape (a tuple of shapes when the first layer is a model of
    several inputs)."""
    first = layers[0]
    if isinstance(first, keras.Model) and not isinstance(first, keras.Sequential):
        shape = _model_input_shape(first)
        if _several(shape):
            return shape
    shape = compat.declared_batch_shape(first)
    if shape is None:
        raise ValueError(
            f"The first layer ({first.name}) has no input shape: give it input_shape=... "
            "or start with keras.layers.InputLayer(input_shape=...)."
        )
    return tuple(shape[1:])


def _is_input_layer(layer) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def _output_units(layers, input_shape) -> int:
    """The last dimension of the output (the classes), layer by layer from one example's
    ``input_shape``."""
    if _several(input_shape):
        shape = [(None, *s) for s in input_shape]
    else:
        shape = (None, *input_shape)
    for layer in layers:
        if not _is_input_layer(layer):
            shape = _output_shape(layer, shape)
    units = shape[-1]
    if units is None:
        raise ValueError("The model's output has no static last dimension (its classes).")
    return int(units)


def _output_shape(layer, shape) -> tuple:
    """``layer``'s output shape (batch axis included) for inputs of ``shape``: a graph
    model's own (Keras 2 cannot recompute every layer's from one input:
    ``MultiHeadAttention`` needs its two); on Keras 3 a subclassed model's from a symbolic
    call (Keras 3 gives models no ``compute_output_shape``); else the layer's."""
    if compat.is_graph_model(layer):
        return tuple(layer.outputs[0].shape)
    if compat.keras_3() and isinstance(layer, keras.Model):
        inputs = keras.tree.map_shape_structure(lambda s: keras.KerasTensor(tuple(s)), shape)
        return tuple(compat.symbolic_call(layer, inputs).shape)
    if compat.keras_backend() == compat.JAX_BACKEND:  # tuples (no TensorFlow on JAX)
        return tuple(layer.compute_output_shape(shape))
    import tensorflow as tf

    return tuple(tf.TensorShape(layer.compute_output_shape(tf.TensorShape(shape))))


def _bounded(layers, input_bound, input_shape) -> list:
    from lipdp.clipless.layers import DP_BoundedInput

    if isinstance(layers[0], DP_BoundedInput):
        return layers
    if input_bound is None:
        raise ValueError(
            "The clipless family needs a public bound on the inputs' norm: pass "
            "input_bound=..., or start the layers with lipdp.clipless.layers.DP_BoundedInput."
        )
    layers = [layer for layer in layers if not _is_input_layer(layer)]
    bound = DP_BoundedInput(input_shape=input_shape, upper_bound=float(input_bound))
    return [bound, *layers]


def _refuse_clipping_options(clip_norm, clipping) -> None:
    if clip_norm != 1.0 or clipping != "flat":
        raise ValueError(
            "clip_norm and clipping are for method='clipped': the clipless family bounds "
            "each gradient through its Lipschitz layers, without clipping."
        )


__all__ = ["METHODS", "make_private", "private_batches"]
