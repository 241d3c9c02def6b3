"""``lipdp train`` and ``lipdp evaluate``: arguments -> recipe -> the recipes' results,
printed. :func:`main` is the console script (``lipdp = lipdp.cli:main``)."""

from __future__ import annotations

import logging
import os
import sys
import time

from lipdp.cli import arguments, devices, output
from lipdp.foundation import native_logs
from lipdp.recipes import run_evaluation, runs

logger = logging.getLogger("lipdp.cli")

#: The exit status of a run stopped by Ctrl-C (128 + SIGINT, the shell's convention).
INTERRUPTED = 130


class Interrupted(Exception):
    """Ctrl-C during training: the one line that says where the run stopped."""


def _prepared_run(args, verb):
    """The run of ``args``, built and stated (``lipdp train: ...``), not yet trained.

    Checked first, in the flags' words: the settings the run needs (which the recipe
    would refuse too, in its fields' words), the devices of ``--mirrored`` and the
    divisibility of the batch by them, before any data is read; an explicit
    ``--data-dir`` that holds no data set (never a silent fall-back to another copy);
    ``--delta`` against ``1/N`` (:func:`lipdp.foundation.validation.delta_for_dataset`);
    the batch size against the data, and the rows ``--sampling shuffle`` drops (a
    warning).
    """
    arguments.refuse_missing_settings(args)
    strategy = devices.distribution_strategy(args.mirrored)  # (refuses more than the cores)
    arguments.refuse_indivisible_batch(args)
    _refuse_data_dir_without_data(args)
    data = runs.load_data(args.dataset, args.data_dir, data_dir_name="--data-dir")
    n = len(data.x_train)
    runs.checked_delta(
        args.delta,
        n,
        allow_large=args.allow_large_delta,
        name="--delta",
        force="--allow-large-delta",
    )
    batch_size = arguments.batch_size(args)
    if batch_size > n:
        raise ValueError(f"--batch-size {batch_size} exceeds the {n} training examples.")
    _warn_about_dropped_rows(args, batch_size, n)
    prepared = runs.prepare(arguments.run_config(args), data, strategy)
    print(output.run_line(verb, prepared, args.mirrored))
    return prepared


def _refuse_data_dir_without_data(args) -> None:
    """``--data-dir DIR`` is the user's choice of copy: when ``DIR`` holds no data set the
    loader would go on to its other places (the Keras cache, the system's copy), silently
    training on data the user did not point at. Refused instead."""
    if args.data_dir is None or runs.data_dir_holds(args.dataset, args.data_dir):
        return
    raise ValueError(
        f"--data-dir {args.data_dir!r} holds no {args.dataset} "
        f"({runs.dataset_files(args.dataset)}): give the directory that holds them, or "
        "drop --data-dir to use the places lipdp looks in by default."
    )


def _warn_about_dropped_rows(args, batch_size, n) -> None:
    """``--sampling shuffle`` trains on whole batches only (rule S5): the remainder of
    ``N / b`` is dropped every epoch. Said with the numbers and the fix."""
    dropped = n % batch_size
    if args.sampling != "shuffle" or dropped == 0:
        return
    divisor = max(d for d in range(1, batch_size + 1) if n % d == 0)
    logger.warning(
        "--sampling shuffle --batch-size %d trains on %d of the %d training examples (the "
        "%d left over make no whole batch and are never used): use --batch-size %d (it "
        "divides %d), or --sampling poisson (every example).",
        batch_size,
        n - dropped,
        n,
        dropped,
        divisor,
        n,
    )


def _train(args, verb):
    """Build, state and train the run of ``args``. Returns ``(prepared run, seconds)``.

    Ctrl-C during training raises :class:`Interrupted` with the line that says where it
    stopped and the epsilon spent (after saving the partial model with ``--save``); a
    training the budget ended early is said on stdout (and logged at WARNING by
    ``DP_Accountant``)."""
    prepared = _prepared_run(args, verb)
    callbacks = [output.epoch_lines(prepared.epochs)] if args.quiet else []
    start = time.perf_counter()
    try:
        runs.fit(prepared, callbacks, verbose=0 if args.quiet else 1)
    except KeyboardInterrupt:
        raise Interrupted(_interrupted_line(args, prepared)) from None
    seconds = time.perf_counter() - start
    line = _budget_stop_line(args, prepared)
    if line:
        print(line)
    return prepared, seconds


def _budget_stop_line(args, prepared):
    """``stopped by the privacy budget after 46 of 500 epochs: ...``, or ``None`` when
    every planned epoch ran."""
    from lipdp.core.callbacks import epochs_trained
    from lipdp.core.report import privacy_report

    done = epochs_trained(prepared.model)
    if done >= prepared.epochs:
        return None
    epsilon = privacy_report(prepared.model, accountant=args.accountant).epsilon
    return (
        f"stopped by the privacy budget after {done} of {prepared.epochs} epochs: epsilon = "
        f"{epsilon:.4f} spent of the budget {args.epsilon:g} (one more epoch would exceed it)"
    )


def _interrupted_line(args, prepared, after_training=False) -> str:
    """Where a run stopped by Ctrl-C stopped, the epsilon it spent (the epochs begun, a
    partial one counted whole: the accountant's own rule) and, with ``--save``, where the
    partial model was saved (``after_training``: stopped in the test evaluation, the
    trained model saved)."""
    from lipdp.core.callbacks import epochs_trained, noisy_steps_taken
    from lipdp.core.report import privacy_report

    model = prepared.model
    steps = noisy_steps_taken(model)
    if steps == 0:
        return "interrupted before the first training step: nothing released, no privacy spent"
    per_epoch = model.dataset_metadata.nb_steps_per_epochs
    epoch, step = divmod(steps, per_epoch)
    if step == 0:
        epoch, step = epoch - 1, per_epoch
    report = privacy_report(model, accountant=args.accountant)
    where = (
        "in the test evaluation, after training"
        if after_training
        else f"at epoch {epoch + 1}/{prepared.epochs}, step {step}/{per_epoch}"
    )
    line = (
        f"interrupted {where}: "
        f"epsilon = {report.epsilon:.4f} spent (delta = {report.delta:g}, "
        f"{epochs_trained(model)} epoch(s) begun)"
    )
    if args.save:
        model.save(args.save)
        kept = "trained" if after_training else "partial"
        return f"{line}; {kept} model saved to {args.save}"
    return f"{line}; nothing saved (--save PATH keeps the partial model)"


def train_command(args) -> int:
    """``lipdp train``: the run stated, trained, its privacy report and test accuracy
    (``--save``: the model saved with its ledger)."""
    from lipdp.core.report import privacy_report

    prepared, seconds = _train(args, "train")
    model, data = prepared.model, prepared.data
    try:
        accuracy = runs.metrics_on_test_set(model, data)["accuracy"]
    except KeyboardInterrupt:  # the training is done: its epsilon and model are not lost
        raise Interrupted(_interrupted_line(args, prepared, after_training=True)) from None
    print()
    print(privacy_report(model, accountant=args.accountant))
    print(f"test accuracy: {accuracy:.4f} ({len(data.x_test)} examples, {seconds:.1f} s training)")
    if args.save:
        _save(model, args.save)
    return 0


def _save(model, path) -> None:
    """The ``.keras`` file keeps the privacy ledger: ``evaluate --model`` reports the same
    epsilon."""
    model.save(path)
    print(f"saved to {path}")


def _refuse_other_data(model, data, args) -> None:
    """A saved model evaluated on a data set of other inputs or classes fails deep inside
    Keras with a long traceback: one line instead, before any evaluation."""
    shape, classes = run_evaluation.input_signature(model)
    data_shape = tuple(data.x_train.shape[1:])
    if shape == data_shape and classes == data.nb_classes:
        return
    raise ValueError(
        f"--model {args.model!r} takes inputs of shape {shape} in {classes} classes, but "
        f"--dataset {args.dataset} has inputs of shape {data_shape} in {data.nb_classes} "
        "classes: give the --dataset the model was trained on."
    )


def _saved_model(args):
    """``(model, data, x_train, y_train)`` of ``evaluate --model PATH``."""
    runs.set_seed(args.seed)
    data = runs.load_data(args.dataset, args.data_dir)
    try:
        model = run_evaluation.load_private_model(args.model)
    except ValueError as error:
        raise ValueError(f"--model: {error}") from None
    _refuse_other_data(model, data, args)
    print(f"lipdp evaluate: {args.model} on {args.dataset}")
    return (model, data, *run_evaluation.saved_training_arrays(model, data))


def evaluate_command(args) -> int:
    """``lipdp evaluate``: the privacy report and the evaluations of lipdp.evaluation.

    Membership inference reads the training data: it is an empirical audit for the
    data owner, not part of the DP release.
    """
    if args.model is not None:
        model, data, x_train, y_train = _saved_model(args)
    else:
        prepared, _ = _train(args, "evaluate")
        model, data = prepared.model, prepared.data
        x_train, y_train = prepared.x_train, prepared.y_train
        if args.save:
            _save(model, args.save)
    print()
    report = run_evaluation.privacy_report_of(model, args.accountant)
    if report is None:
        print("privacy report: unavailable (the model has no optimizer state or metadata)")
    else:
        print(report)
    print()
    config = arguments.evaluation_config(args)
    results = run_evaluation.evaluate_model(model, data, x_train, y_train, config)
    print("\n".join(output.evaluation_lines(results, config)))
    return 0


#: The function of each subcommand.
COMMANDS = {"train": train_command, "evaluate": evaluate_command}


def main(argv=None) -> int:
    """The ``lipdp`` command on ``argv`` (default: ``sys.argv[1:]``). Returns the exit
    status: 0, or 2 after a one-line error on stderr (a bad value exits with 2 from the
    parser)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = arguments.make_parser().parse_args(argv)
    with native_logs.discarded():  # TensorFlow's C++ start-up lines
        try:
            arguments.refuse_inapplicable_options(args, arguments.explicit_options(argv))
            return COMMANDS[args.command](args)
        except (ValueError, FileNotFoundError) as error:
            print(f"lipdp {args.command}: error: {error}", file=sys.stderr)
            return 2
        except Interrupted as stop:
            print(f"lipdp {args.command}: {stop}", file=sys.stderr)
            return INTERRUPTED
        except KeyboardInterrupt:
            print(f"lipdp {args.command}: interrupted", file=sys.stderr)
            return INTERRUPTED
