"""Model zoo: the architectures of the command line, the tutorials and the benchmarks.

Each builder returns the **list of DP layers** of one architecture, starting with
:class:`~lipdp.clipless.layers.DP_BoundedInput`, so that it can be inspected or extended before
the model is made:

    from lipdp.clipless import layers
    from lipdp.recipes import zoo
    from lipdp.clipless.model import DP_Sequential, DPParameters

    dp_layers = zoo.strided_cnn(metadata)           # input shape, bound, classes
    dp_layers.append(layers.DP_ClipGradient(0.3))     # clip the loss gradient
    model = DP_Sequential(dp_layers, dp_parameters=params, dataset_metadata=metadata)

:func:`build_model` does the last step for an architecture chosen by name in
:data:`ZOO`: ``zoo.build_model("strided_cnn", metadata, params, clip=0.3)``.

Every builder takes the same three inputs, either from a ``metadata``
(:class:`~lipdp.foundation.metadata.DatasetMetadata`: ``input_shape``, ``nb_classes`` and
``max_norm``, the public bound on the norm of one example) or as keyword arguments
``input_shape``, ``upper_bound`` and ``nb_classes``, which take precedence.

Why each network is Lipschitz, in the notation of :mod:`lipdp.clipless.layers.base` (``X`` a
bound on the norm of one example's input of a layer, ``G`` on its cotangent): the
input is clipped to the public bound ``B`` (a projection onto a ball, 1-Lipschitz);
every dense and convolution kernel is kept at spectral norm at most 1 by projection
after each step (``X -> X``, ``G -> G``, kernel gradient at most ``X * G``); GroupSort,
reshapes and permutations only move coordinates (norm-preserving); L2-norm pooling
over disjoint windows and centering are 1-Lipschitz; a bias ball of radius ``beta``
adds ``sqrt(m) * beta`` to the output bound; ``"1-lip-add"`` residual blocks around
1-Lipschitz branches are 1-Lipschitz. The bounds that calibrate the noise are those
the layers themselves propagate; the builders only choose the layers.
"""

from __future__ import annotations

from lipdp.clipless import layers
from lipdp.clipless.model import DP_Sequential
from lipdp.foundation import validation


# ------------------------------------------------------------------------------ inputs
def _inputs(metadata, input_shape, upper_bound, nb_classes):
    """``(input_shape, upper_bound, nb_classes)``: explicit values, else the metadata's."""
    if metadata is not None:
        input_shape = metadata.input_shape if input_shape is None else input_shape
        upper_bound = metadata.max_norm if upper_bound is None else upper_bound
        nb_classes = metadata.nb_classes if nb_classes is None else nb_classes
    missing = [
        name
        for name, value in [
            ("input_shape", input_shape),
            ("upper_bound", upper_bound),
            ("nb_classes", nb_classes),
        ]
        if value is None
    ]
    if missing:
        raise ValueError(
            f"missing {', '.join(missing)}: pass them, or a metadata that has them "
            "(a metadata's upper bound is its max_norm)."
        )
    # The bound is a privacy parameter: refuse anything DP_BoundedInput could not enforce.
    upper_bound = validation.positive("upper_bound", upper_bound)
    return (
        tuple(int(d) for d in input_shape),
        upper_bound,
        validation.count("nb_classes", nb_classes, 1),
    )


def _bounded_input(input_shape, upper_bound):
    return layers.DP_BoundedInput(input_shape=input_shape, upper_bound=upper_bound)


def _image(input_shape, builder):
    if len(input_shape) != 3:
        raise ValueError(f"{builder} needs images (height, width, channels), got {input_shape}.")
    return input_shape


# -------------------------------------------------------------------------- builders
def pooled_cnn(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    widths=(16,),
    kernel_size=3,
) -> list:
    """The CNN of ``lipdp train``: convolution, GroupSort and L2-norm pooling blocks.

    Layers: ``DP_BoundedInput(B)``, then for each width ``w``:
    ``DP_QuickSpectralConv2D(w, kernel_size)`` (stride 1, ``"same"`` padding, no bias)
    -> ``DP_GroupSort(2)`` -> ``DP_ScaledL2NormPooling2D(2)``; then ``DP_Flatten`` ->
    ``DP_QuickSpectralDense(nb_classes)``.

    The command line uses ``widths=(16,)`` on digits (the default) and ``(32, 64)`` on
    Fashion-MNIST (:data:`lipdp.recipes.defaults.CNN_WIDTHS`).

    Why it is 1-Lipschitz: the clipped input has norm at most ``B``; each convolution
    has a reshaped kernel of spectral norm at most 1 and is scaled by ``1/sqrt(n)``,
    ``n = kernel_size**2`` the number of patches an input pixel lies in (stride 1), so
    it is 1-Lipschitz (``X -> X``, ``G -> G``, kernel gradient ``X * G``); GroupSort
    permutes coordinates; L2-norm pooling over disjoint 2x2 windows is 1-Lipschitz;
    flattening keeps the norm; the dense kernel has spectral norm at most 1. The
    logits are a 1-Lipschitz function of the input and every kernel's per-example
    gradient is at most ``B * G``.

    Args:
        metadata: gives ``input_shape``, ``max_norm`` (the bound ``B``) and ``nb_classes``.
        input_shape: ``(height, width, channels)``, overrides the metadata's.
        upper_bound: ``B``, the public bound on the norm of one image.
        nb_classes: number of logits.
        widths: channels of the convolution of each block (one block per width).
        kernel_size: side of the square convolution kernels.
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    stack = [_bounded_input(_image(shape, "pooled_cnn"), bound)]
    for width in widths:
        stack += [
            layers.DP_QuickSpectralConv2D(width, kernel_size),
            layers.DP_GroupSort(2),
            layers.DP_ScaledL2NormPooling2D(2),
        ]
    return stack + [layers.DP_Flatten(), layers.DP_QuickSpectralDense(classes)]


def strided_cnn(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    widths=(16, 64),
    clip=None,
    weight_norm_bound=1.0,
    adaptive_norm=False,
    constraint="orthogonal",
) -> list:
    """The CNN of notebook 01: non-overlapping strided convolutions and GroupSort.

    Layers: ``DP_BoundedInput(B)``, then for each width ``w`` (``i = 1, 2, ...``):
    ``DP_QuickSpectralConv2D(w, 2, strides=2, name="conv_<i>")`` -> ``DP_GroupSort(2)``;
    then ``DP_Flatten`` -> ``DP_QuickSpectralDense(nb_classes, name="logits")`` and,
    when ``clip`` is not ``None``, ``DP_ClipGradient(clip)``. No bias. On 28x28
    Fashion-MNIST the default widths go 1 -> 16 -> 64 channels, 28 -> 14 -> 7 pixels.
    The layers are named so that sensitivities read ``conv_1/kernel``, ``logits/kernel``.

    Why it is 1-Lipschitz: the clipped input has norm at most ``B``; a 2x2 convolution
    with stride 2 sees disjoint patches (``n = 1``, no scaling), so with a reshaped
    kernel of spectral norm at most 1 it is 1-Lipschitz, and norm-preserving when its
    kernel is orthogonal with ``w >= 4 * c_in`` (as with the defaults on one-channel
    images): every kernel then sees the full input bound, ``X * G`` with ``X = B``.
    GroupSort permutes coordinates; the dense kernel has spectral norm at most 1.
    ``DP_ClipGradient(C)`` is the identity forward and clips each example's gradient
    with respect to the logits to norm ``C`` backward: ``G = min(L, C)`` for every
    layer, which scales every sensitivity by ``C / L`` when ``C < L``.

    Args:
        metadata: gives ``input_shape``, ``max_norm`` (the bound ``B``) and ``nb_classes``.
        input_shape: ``(height, width, channels)``; height and width are halved by each
            convolution.
        upper_bound: ``B``, the public bound on the norm of one image.
        nb_classes: number of logits.
        widths: channels of the successive convolutions.
        clip: ``C`` of a ``DP_ClipGradient(C)`` after the logits; ``None``: no clipping.
            (Append ``DP_ClipGradient(C, mode="dynamic")`` yourself for a threshold
            that :mod:`lipdp.clipless.dynamic` updates.)
        weight_norm_bound, adaptive_norm, constraint: every kernel's norm ball, as in
            :func:`lip_mlp` (defaults: orthogonal kernels of norm 1, the network above;
            ``adaptive_norm=True, constraint="spectral"``: Lip-DP-SGD).
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    ball = _ball(constraint, weight_norm_bound, adaptive_norm)
    stack = [_bounded_input(_image(shape, "strided_cnn"), bound)]
    for i, width in enumerate(widths, 1):
        stack += [
            layers.DP_QuickSpectralConv2D(width, 2, strides=2, name=f"conv_{i}", **ball),
            layers.DP_GroupSort(2),
        ]
    stack += [layers.DP_Flatten(), layers.DP_QuickSpectralDense(classes, name="logits", **ball)]
    if clip is not None:
        stack.append(layers.DP_ClipGradient(clip))
    return stack


def tabular_mlp(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    width=64,
    depth=2,
    bias=1.0,
) -> list:
    """The dense network of notebook 03 (ADBench shuttle): dense, bias, GroupSort blocks.

    Layers: ``DP_BoundedInput(B)``, then ``depth`` blocks (``i = 1 .. depth``)
    ``DP_QuickSpectralDense(width, name="dense_<i>")`` ->
    ``DP_AddBias(norm_max=bias, name="bias_<i>")`` -> ``DP_GroupSort(2,
    name="groupsort_<i>")``, then ``DP_QuickSpectralDense(nb_classes, name="logits")``
    (no bias on the logits). ``bias=None`` leaves the biases out.

    Why it is Lipschitz: the clipped input has norm at most ``B``; each dense kernel
    has spectral norm at most 1 (``X -> X``, ``G -> G``, kernel gradient ``X * G``);
    adding a bias is a translation, 1-Lipschitz, whose vector stays in a ball of
    radius ``bias`` (projection after each step): the output bound grows by ``bias``
    per block (``X -> X + bias``) and the bias gradient is at most ``G``; GroupSort
    permutes coordinates. The network is 1-Lipschitz in its input; the dense layer of
    block ``i`` sees inputs of norm at most ``B + (i - 1) * bias``.

    Args:
        metadata: gives ``input_shape``, ``max_norm`` (the bound ``B``) and ``nb_classes``.
        input_shape: ``(features,)``.
        upper_bound: ``B``, the public bound on the norm of one row.
        nb_classes: number of logits.
        width: units of every hidden dense layer (even, for GroupSort(2)).
        depth: number of hidden blocks.
        bias: radius of every bias ball; ``None``: no bias.
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    stack = [_bounded_input(shape, bound)]
    for i in range(1, depth + 1):
        stack.append(layers.DP_QuickSpectralDense(width, name=f"dense_{i}"))
        if bias is not None:
            stack.append(layers.DP_AddBias(norm_max=bias, name=f"bias_{i}"))
        stack.append(layers.DP_GroupSort(2, name=f"groupsort_{i}"))
    return stack + [layers.DP_QuickSpectralDense(classes, name="logits")]


def resnet(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    merge_policy="1-lip-add",
    blocks=3,
    width=16,
) -> list:
    """The residual network of notebook 02.

    Layers: ``DP_BoundedInput(B)`` -> ``DP_QuickSpectralConv2D(width, 3)`` ->
    ``DP_GroupSort(2)``; then ``blocks`` residual blocks
    ``make_residuals(merge_policy, [conv(width, 3), GroupSort(2), conv(width, 3),
    GroupSort(2)])`` (split, the four layers on the second path, merge); then
    ``DP_ScaledL2NormPooling2D(2)`` -> ``DP_Flatten`` -> ``DP_QuickSpectralDense(nb_classes)``.

    Why it is Lipschitz: every layer outside the blocks and every branch layer is
    1-Lipschitz (clipped input of norm at most ``B``; 3x3 stride-1 convolutions with
    kernels of spectral norm at most 1 scaled by ``1/3``; GroupSort; L2-norm pooling;
    a dense kernel of spectral norm at most 1). A block merges the skip path ``x`` and
    the branch ``f(x)``: ``"1-lip-add"`` computes ``(x + f(x)) / 2``, 1-Lipschitz, so
    depth costs nothing (``X -> X``, ``G -> G``, branch kernels ``X * G / 2``);
    ``"add"`` computes ``x + f(x)``, 2-Lipschitz, so the bounds double at every block
    and a kernel's sensitivity grows like ``2**blocks`` (the layers propagate this).

    Args:
        metadata: gives ``input_shape``, ``max_norm`` (the bound ``B``) and ``nb_classes``.
        input_shape: ``(height, width, channels)``.
        upper_bound: ``B``, the public bound on the norm of one image.
        nb_classes: number of logits.
        merge_policy: ``"1-lip-add"`` or ``"add"``
            (:class:`~lipdp.clipless.layers.DP_MergeResidual`).
        blocks: number of residual blocks.
        width: channels of every convolution.
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    stack = [
        _bounded_input(_image(shape, "resnet"), bound),
        layers.DP_QuickSpectralConv2D(width, 3),
        layers.DP_GroupSort(2),
    ]
    for _ in range(blocks):
        branch = [
            layers.DP_QuickSpectralConv2D(width, 3),
            layers.DP_GroupSort(2),
            layers.DP_QuickSpectralConv2D(width, 3),
            layers.DP_GroupSort(2),
        ]
        stack += layers.make_residuals(merge_policy, branch)
    return stack + [
        layers.DP_ScaledL2NormPooling2D(2),
        layers.DP_Flatten(),
        layers.DP_QuickSpectralDense(classes),
    ]


def _patches(shape, patch_size) -> list:
    """Layers cutting an image into ``T`` tokens of ``patch_size**2 * channels`` pixels.

    ``(H, W, c) -> (H/P, P, W/P, P*c)`` is the same memory order (a reshape), the permute
    brings the two patch axes together, the last reshape flattens each patch.
    """
    height, width, channels = shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"patch_size {patch_size} must divide the image size {shape[:2]}.")
    rows, cols = height // patch_size, width // patch_size
    return [
        layers.DP_Reshape((rows, patch_size, cols, patch_size * channels)),
        layers.DP_Permute((1, 3, 2, 4)),
        layers.DP_Reshape((rows * cols, patch_size * patch_size * channels)),
    ]


def _mixer_block(tokens, channels, token_hidden, channel_hidden) -> list:
    token_mixing = layers.make_residuals(
        "1-lip-add",
        [
            layers.DP_LayerCentering(),
            layers.DP_Permute((2, 1)),  # (T, C) -> (C, T): the dense layers mix tokens
            layers.DP_QuickSpectralDense(token_hidden),
            layers.DP_GroupSort(2),
            layers.DP_QuickSpectralDense(tokens),
            layers.DP_Permute((2, 1)),  # back to (T, C)
        ],
    )
    channel_mixing = layers.make_residuals(
        "1-lip-add",
        [
            layers.DP_LayerCentering(),
            layers.DP_QuickSpectralDense(channel_hidden),
            layers.DP_GroupSort(2),
            layers.DP_QuickSpectralDense(channels),
        ],
    )
    return token_mixing + channel_mixing


def mlp_mixer(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    patch_size=2,
    channels=32,
    depth=1,
    token_hidden=None,
    channel_hidden=None,
) -> list:
    """The Lipschitz MLP-Mixer of notebook 02 (Tolstikhin et al., 2021).

    The image ``(H, W, c)`` is cut into ``T = (H / P) * (W / P)`` tokens of
    ``P * P * c`` pixels (``P = patch_size``) by ``DP_Reshape``, ``DP_Permute``,
    ``DP_Reshape``; ``DP_QuickSpectralDense(channels)`` embeds every token; then
    ``depth`` mixer blocks, each two ``"1-lip-add"`` residual blocks:

    * token mixing: ``DP_LayerCentering`` -> ``DP_Permute((2, 1))`` ->
      ``DP_QuickSpectralDense(token_hidden)`` -> ``DP_GroupSort(2)`` ->
      ``DP_QuickSpectralDense(T)`` -> ``DP_Permute((2, 1))``;
    * channel mixing: ``DP_LayerCentering`` -> ``DP_QuickSpectralDense(channel_hidden)``
      -> ``DP_GroupSort(2)`` -> ``DP_QuickSpectralDense(channels)``;

    then ``DP_Flatten`` -> ``DP_QuickSpectralDense(nb_classes)``. On 8x8 digits with
    the defaults: 16 tokens of 4 pixels, 32 channels, one block (notebook 02).

    Why it is 1-Lipschitz: reshapes and permutations only move coordinates; a dense
    kernel of spectral norm at most 1 applied to every token is 1-Lipschitz on the
    whole example and its gradient ``sum_t x_t g_t^T`` is at most ``X * G``
    (Cauchy-Schwarz); ``DP_LayerCentering`` subtracts each example's own mean, an
    orthogonal projection (no batch statistics, no division by a data-dependent
    scale); GroupSort permutes; each ``"1-lip-add"`` block ``(x + f(x)) / 2`` around a
    1-Lipschitz branch is 1-Lipschitz.

    Args:
        metadata: gives ``input_shape``, ``max_norm`` (the bound ``B``) and ``nb_classes``.
        input_shape: ``(height, width, channels)``, both sides divisible by ``patch_size``.
        upper_bound: ``B``, the public bound on the norm of one image.
        nb_classes: number of logits.
        patch_size: side ``P`` of the square patches; it sets the number of tokens ``T``.
        channels: width of the token embedding.
        depth: number of mixer blocks.
        token_hidden: hidden width of the token-mixing MLP (default ``2 * T``).
        channel_hidden: hidden width of the channel-mixing MLP (default ``2 * channels``).
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    patching = _patches(_image(shape, "mlp_mixer"), patch_size)
    tokens = (shape[0] // patch_size) * (shape[1] // patch_size)
    token_hidden = 2 * tokens if token_hidden is None else token_hidden
    channel_hidden = 2 * channels if channel_hidden is None else channel_hidden
    stack = [_bounded_input(shape, bound), *patching, layers.DP_QuickSpectralDense(channels)]
    for _ in range(depth):
        stack += _mixer_block(tokens, channels, token_hidden, channel_hidden)
    return stack + [layers.DP_Flatten(), layers.DP_QuickSpectralDense(classes)]


def _ball(constraint, weight_norm_bound, adaptive_norm) -> dict:
    """Constraint options of a constrained layer (:mod:`lipdp.clipless.layers.constrained`)."""
    return dict(
        constraint=constraint, weight_norm_bound=weight_norm_bound, adaptive_norm=adaptive_norm
    )


def _activation(name, index):
    if name == "relu":
        return layers.DP_ReLU(name=f"relu_{index}")
    if name == "groupsort":
        return layers.DP_GroupSort(2, name=f"groupsort_{index}")
    raise ValueError(f"activation must be 'relu' or 'groupsort', got {name!r}.")


def _group_norm(groups, alpha, index) -> list:
    if groups is None:
        return []
    return [layers.DP_GroupNormalization(groups, alpha, name=f"groupnorm_{index}")]


def lip_mlp(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    width=32,
    depth=1,
    weight_norm_bound=1.0,
    adaptive_norm=True,
    constraint="spectral",
    group_norm=None,
    alpha=1.0,
    bias=None,
    activation="relu",
) -> list:
    """Lip-DP-SGD's tabular MLP (Barczewski & Ramon, Table 4: 2 layers, cross-entropy).

    Layers: ``DP_BoundedInput(B)``, then ``depth`` blocks ``DP_QuickSpectralDense(width)``
    -> [``DP_AddBias(bias)``] -> [``DP_GroupNormalization(group_norm, alpha)``] ->
    activation; then ``DP_QuickSpectralDense(nb_classes, name="logits")``. Every kernel
    lives in a ball of radius ``C = weight_norm_bound`` (``constraint``: ``"spectral"``
    or ``"frobenius"``; ``"orthogonal"`` pins the norm at ``C``) and, with
    ``adaptive_norm=True`` (Lip-DP-SGD), the bounds use each kernel's current norm
    ``c_k = min(C, ||W_k||)``; ``adaptive_norm=False`` is Fix-Lip-DP-SGD (norms taken
    at ``C``).

    Why it is Lipschitz: the clipped input has norm at most ``B``; a kernel of norm at
    most ``c_k`` maps ``X -> c_k X`` and ``G -> c_k G`` (kernel gradient ``X G``); a bias
    ball adds ``bias`` to the output bound; group normalisation is ``1/alpha``-Lipschitz
    with output norm at most ``sqrt(width)``; ReLU and GroupSort are 1-Lipschitz and map
    0 to 0. The network is ``prod_k c_k`` (times ``1/alpha`` per group normalisation)
    Lipschitz.

    Args:
        metadata: gives ``input_shape``, ``max_norm`` (the bound ``B``) and ``nb_classes``.
        input_shape, upper_bound, nb_classes: override the metadata's.
        width: units of every hidden layer.
        depth: number of hidden blocks (the paper's MLP has one: two dense layers).
        weight_norm_bound: ``C``, the radius of every kernel's ball.
        adaptive_norm: bounds from the current norms (Lip-DP-SGD) or from ``C``.
        constraint: the ball's norm, ``"spectral"`` or ``"frobenius"`` (or ``"orthogonal"``).
        group_norm: number of groups of a group normalisation after each hidden dense
            layer; ``None``: none.
        alpha: the floor of the group normalisation's divisor.
        bias: radius of a bias ball after each hidden dense layer; ``None``: no bias.
        activation: ``"relu"`` (the paper's) or ``"groupsort"``.
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    ball = _ball(constraint, weight_norm_bound, adaptive_norm)
    stack = [_bounded_input(shape, bound)]
    for i in range(1, depth + 1):
        stack.append(layers.DP_QuickSpectralDense(width, name=f"dense_{i}", **ball))
        if bias is not None:
            stack.append(layers.DP_AddBias(norm_max=bias, name=f"bias_{i}"))
        stack += _group_norm(group_norm, alpha, i)
        stack.append(_activation(activation, i))
    return stack + [layers.DP_QuickSpectralDense(classes, name="logits", **ball)]


def lip_convnet(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    widths=(32, 64),
    dense=128,
    weight_norm_bound=1.0,
    adaptive_norm=True,
    constraint="spectral",
    group_norm=None,
    alpha=1.0,
    activation="groupsort",
) -> list:
    """Lip-DP-SGD's image ConvNet (Table 4: 4 layers, cross-entropy), as norm-ball layers.

    Layers: ``DP_BoundedInput(B)``; for each width ``w``: ``DP_QuickSpectralConv2D(w, 3)``
    -> [``DP_GroupNormalization(group_norm, alpha)``] -> activation ->
    ``DP_ScaledL2NormPooling2D(2)``; then ``DP_Flatten`` ->
    ``DP_QuickSpectralDense(dense)`` -> activation -> ``DP_QuickSpectralDense(nb_classes)``
    (``dense=None`` leaves the hidden dense layer out). Kernels in balls of radius
    ``weight_norm_bound`` as in :func:`lip_mlp`; the convolutions carry the
    ``1/sqrt(kh kw)`` factor that makes ``||M||_2`` bound their operator norm
    (:mod:`lipdp.clipless.layers.convolution`). Pooling the 2x2 windows by their L2 norm is
    1-Lipschitz (the paper's network uses max-pooling, also 1-Lipschitz; L2 pooling
    keeps more of the gradient).

    Args: as :func:`lip_mlp`, with ``widths`` the channels of the convolution blocks and
    ``dense`` the units of the hidden dense layer.
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    ball = _ball(constraint, weight_norm_bound, adaptive_norm)
    stack = [_bounded_input(_image(shape, "lip_convnet"), bound)]
    for i, width in enumerate(widths, 1):
        stack.append(layers.DP_QuickSpectralConv2D(width, 3, name=f"conv_{i}", **ball))
        stack += _group_norm(group_norm, alpha, i)
        stack += [_activation(activation, i), layers.DP_ScaledL2NormPooling2D(2)]
    stack.append(layers.DP_Flatten())
    if dense is not None:
        stack += [
            layers.DP_QuickSpectralDense(dense, name="dense", **ball),
            _activation(activation, len(widths) + 1),
        ]
    return stack + [layers.DP_QuickSpectralDense(classes, name="logits", **ball)]


#: Floor of the group normalisation after the scattering transform: its coefficients are
#: small (0.2 x the image norm, spread over thousands of values), and every group should be
#: scaled to unit variance so that every example reaches the output bound ``sqrt(N)``.
SCATTERING_ALPHA = 1e-4


def scattering_net(
    metadata=None,
    *,
    input_shape=None,
    upper_bound=None,
    nb_classes=None,
    J=2,
    L=8,
    padding="zeros",
    groups=27,
    alpha=SCATTERING_ALPHA,
    widths=(),
    weight_norm_bound=1.0,
    adaptive_norm=False,
    constraint="spectral",
) -> list:
    """Scattering features and a Lipschitz head (Tramer & Boneh, ICLR 2021, as a DP model).

    Layers: ``DP_BoundedInput(B)`` -> ``DP_ScatteringTransform(J, L, padding)`` (no
    weights; ``(h / 2^J, w / 2^J, c K)`` with ``K = 81`` for ``J = 2``, ``L = 8``) ->
    ``DP_GroupNormalization(groups, alpha)`` (per example, no statistics of the data); for
    each width ``w``: ``DP_QuickSpectralConv2D(w, 3)`` -> ``DP_GroupSort(2)``; then
    ``DP_Flatten`` -> ``DP_QuickSpectralDense(nb_classes)``. ``widths=()`` is the linear
    head (Tramer & Boneh's "ScatterNet + linear").

    Why it is Lipschitz: the scattering transform is ``Lip``-Lipschitz with ``Lip``
    certified from its filters (0.255 for 28 x 28 images with zero padding, 0.493 with
    Kymatio's reflection; :mod:`lipdp.clipless.wavelets`) and maps 0 to 0; group normalisation is
    ``1/alpha``-Lipschitz with outputs of norm at most ``sqrt(N)`` whatever the input, so
    the head's input bound is ``min(Lip B / alpha, sqrt(N))``, nearly reached by every
    example (each group of a non-blank image is scaled to unit variance) — the gradient
    bounds of the head are tight; kernels in balls of radius ``weight_norm_bound`` as in
    :func:`lip_mlp`.

    Args:
        metadata, input_shape, upper_bound, nb_classes: as the other builders (images).
        J, L, padding: of the scattering transform.
        groups: groups of the normalisation (must divide ``c K``; 27 for 81 channels);
            ``None``: no normalisation.
        alpha: floor of its divisor (default :data:`SCATTERING_ALPHA`).
        widths: channels of the convolution blocks of the head (``()``: linear head).
        weight_norm_bound, adaptive_norm, constraint: the kernels' balls.
    """
    shape, bound, classes = _inputs(metadata, input_shape, upper_bound, nb_classes)
    ball = _ball(constraint, weight_norm_bound, adaptive_norm)
    stack = [
        _bounded_input(_image(shape, "scattering_net"), bound),
        layers.DP_ScatteringTransform(J=J, L=L, padding=padding, name="scattering"),
    ]
    stack += _group_norm(groups, alpha, 0)
    for i, width in enumerate(widths, 1):
        stack += [
            layers.DP_QuickSpectralConv2D(width, 3, name=f"conv_{i}", **ball),
            _activation("groupsort", i),
        ]
    return stack + [
        layers.DP_Flatten(),
        layers.DP_QuickSpectralDense(classes, name="logits", **ball),
    ]


#: The builders by name, for the command line, the benchmarks and :func:`build_model`.
ZOO = {
    "pooled_cnn": pooled_cnn,
    "strided_cnn": strided_cnn,
    "tabular_mlp": tabular_mlp,
    "resnet": resnet,
    "mlp_mixer": mlp_mixer,
    "lip_mlp": lip_mlp,
    "lip_convnet": lip_convnet,
    "scattering_net": scattering_net,
}


def build_model(architecture, metadata, dp_parameters, **options) -> DP_Sequential:
    """``DP_Sequential`` of the zoo architecture named ``architecture`` for ``metadata``.

    Equivalent to ``DP_Sequential(ZOO[architecture](metadata, **options),
    dp_parameters=dp_parameters, dataset_metadata=metadata)``. Call the builder
    yourself to change the layer list first.

    Args:
        architecture: a key of :data:`ZOO`.
        metadata: the training set's :class:`~lipdp.foundation.metadata.DatasetMetadata` (input
            shape, classes and, unless ``upper_bound`` is among the options, the bound
            ``max_norm``).
        dp_parameters: a :class:`~lipdp.clipless.model.DPParameters`.
        **options: keyword arguments of the builder (widths, clip, depth...).
    """
    if architecture not in ZOO:
        raise ValueError(f"unknown architecture {architecture!r}; the zoo has {sorted(ZOO)}.")
    return DP_Sequential(
        ZOO[architecture](metadata, **options),
        dp_parameters=dp_parameters,
        dataset_metadata=metadata,
    )
