"""Checks of model inputs and outputs shared by explain(), the metrics, the CLI and exporters.

Each raises :class:`~explain_core.errors.InvalidInputError` (or its subclass
:class:`~explain_core.errors.ModelRunError`) saying what was got, what was expected and what to
do, so that every entry point refuses the same bad input in the same words.
"""

from __future__ import annotations

import itertools
import re
import textwrap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from explain_core.captum_calls import ForwardWithArgs
from explain_core.errors import (
    ExplainError,
    InvalidInputError,
    ModelRunError,
    ModelStateError,
    OutOfMemoryError,
    UnsupportedModelError,
)

__all__ = [
    "check_inputs",
    "check_one_tensor",
    "check_output_finite",
    "check_reference_output_finite",
    "check_scores",
    "clear_model_errors",
    "diagnose_failure",
    "input_gradient",
    "model_error",
    "non_finite_samples",
    "refuse_inference_mode",
    "run_once",
]


def _named_tensors(model: nn.Module, test: Callable[[torch.Tensor], bool]) -> str | None:
    """``'0.weight' and 3 more``: the model's parameters and buffers that pass ``test``."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    names = [name for name, tensor in tensors if test(tensor)]
    if not names:
        return None
    return f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def _refuse_uninitialised(model: nn.Module, caller: str) -> None:
    """Refuse a model with lazy parameters that no forward has given a shape yet."""
    lazy = _named_tensors(model, is_lazy)
    if lazy:
        raise ModelStateError(
            f"the model has uninitialised parameters ({lazy}): a lazy module "
            "(nn.LazyLinear, nn.LazyConv2d, …) gets their shapes from its first forward pass; "
            f"run the model once on an input (model(x)) before {caller}"
        )


# Converted int8 modules (torch.ao.quantization.convert, quantize_dynamic) run kernels without a
# backward: autograd sees a constant. Reference modules are float and differentiable.
_QUANTIZED_MODULES = ("torch.ao.nn.quantized.", "torch.ao.nn.intrinsic.quantized.")
_REFERENCE_MODULES = "torch.ao.nn.quantized.reference."


def _refuse_quantized(model: nn.Module, caller: str) -> None:
    """Refuse a model converted to quantized (int8) kernels, which have no gradient."""
    for name, module in model.named_modules():
        where = type(module).__module__ + "."
        if where.startswith(_QUANTIZED_MODULES) and not where.startswith(_REFERENCE_MODULES):
            raise ModelStateError(
                f"{type(module).__name__} {name or '<root>'!r} is a quantized module (from "
                "torch.ao.quantization.convert or quantize_dynamic): its int8 kernels have no "
                f"backward pass, so no attribution can pass through it. Run {caller} on the "
                "float model, a copy kept before quantizing (copy.deepcopy(model)); the "
                "explanation describes the float network the quantized one approximates"
            )


def check_inputs(
    inputs: Any, model: object = None, *, name: str = "inputs", allow_empty: bool = False
) -> torch.Tensor:
    """A private, detached copy of ``inputs`` if they are a finite batch that fits ``model``.

    The copy keeps the caller's tensor unchanged when the model works in place on its input
    (``torch.relu_(x)``) and turns an inference-mode tensor into one autograd can use; next to
    an attribution it costs nothing.

    Args:
        inputs: The model inputs, ``(batch, ...)``.
        model: The model they are fed to; device and dtype are compared only for an
            ``nn.Module`` (plain callables are taken as they are).
        name: Argument name used in messages.
        allow_empty: Accept a batch of zero samples.

    Raises:
        InvalidInputError: If ``inputs`` is not such a tensor.
    """
    if type(inputs).__name__ == "PackedSequence":
        raise InvalidInputError(
            f"{name} must be one torch.Tensor of shape (batch, ...); got a PackedSequence. Pass "
            "the padded batch (batch, steps, features) and pack it inside forward, with the "
            "lengths as a forward argument: explain_inputs(model, {'x': x, 'lengths': "
            "lengths}, method, target, explained='x'), as docs/recurrent.md shows"
        )
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(inputs, (tuple, list, Mapping)) and any(
        isinstance(i, torch.Tensor) for i in values
    ):
        raise InvalidInputError(
            f"{name} must be one torch.Tensor of shape (batch, ...); got a "
            f"{type(inputs).__name__} of {len(inputs)}. {SEVERAL_INPUTS_ADVICE}"
        )
    if not isinstance(inputs, torch.Tensor):
        raise InvalidInputError(
            f"{name} must be a torch.Tensor of shape (batch, ...); got {type(inputs).__name__}. "
            "Convert NumPy arrays with torch.from_numpy(array).float()"
        )
    if inputs.dim() < 2:
        raise InvalidInputError(
            f"{name} need a batch axis: shape (batch, ...); got {tuple(inputs.shape)}. "
            f"Use {name}[None] for a single sample."
        )
    if not inputs.is_floating_point():
        advice = f"Use {name}.float()."
        if not (inputs.is_complex() or inputs.dtype == torch.bool):
            # Integers are most often token ids, for which .float() would be wrong advice.
            advice = (
                "Token ids carry no gradient: explain the model from its embedding's output "
                "(pass the vectors, as docs/recurrent.md shows for a text classifier) or use "
                "explain_tokens for a model that takes inputs_embeds=; for other integer data "
                f"use {name}.float()."
            )
        raise InvalidInputError(
            f"{name} must be floating point; got dtype {inputs.dtype}. {advice}"
        )
    if inputs.shape[0] == 0 and not allow_empty:
        raise InvalidInputError(
            f"{name} have 0 samples (shape {tuple(inputs.shape)}); pass at least one"
        )
    weight = _first_tensor(model) if isinstance(model, nn.Module) else None
    if weight is not None and weight.device.type == "meta":
        raise InvalidInputError(
            "the model's parameters are on the meta device and hold no values; materialise "
            "them first, e.g. model.to_empty(device='cpu') and then model.load_state_dict(...)"
        )
    if inputs.device.type == "meta":
        raise InvalidInputError(
            f"{name} are meta tensors, which hold no values; pass real data, e.g. "
            f"torch.rand({', '.join(map(str, inputs.shape))})"
        )
    if weight is not None:
        _check_fits_model(inputs, model, weight, name)  # type: ignore[arg-type]
    bad = non_finite_samples(inputs)
    if bad:
        raise InvalidInputError(
            f"{name} contain NaN or infinite values in samples [{bad}]; pass finite values"
        )
    return inputs.detach().clone()


def _first_tensor(model: nn.Module) -> torch.Tensor | None:
    """The model's first parameter (or buffer): where its weights live; ``None`` if none."""
    return next(model.parameters(), next(model.buffers(), None))


def _check_fits_model(
    inputs: torch.Tensor, model: nn.Module, weight: torch.Tensor, name: str
) -> None:
    if inputs.device != weight.device:
        raise InvalidInputError(
            f"{name} are on {inputs.device} but the model's parameters are on {weight.device}; "
            f"move the inputs with x.to('{weight.device}') or the model with "
            f"model.to('{inputs.device}')"
        )
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    # Only a model of one dtype says unambiguously what its inputs must be.
    if len(dtypes) == 1 and inputs.dtype not in dtypes:
        raise _dtype_mismatch(inputs.dtype, next(iter(dtypes)), name)


def _dtype_mismatch(got: torch.dtype, wanted: torch.dtype, name: str) -> ModelRunError:
    return ModelRunError(
        f"{name} are {got} but the model's parameters are {wanted}; convert the inputs with "
        f"x.to({wanted}) or the model with model.to({got})"
    )


def non_finite_samples(tensor: torch.Tensor) -> str:
    """The indices of samples holding NaN or inf, e.g. ``"0, 3"`` (``""`` if all are finite)."""
    finite = torch.isfinite(tensor.detach())
    finite = finite.flatten(1).all(dim=1) if finite.dim() > 1 else finite.reshape(-1)
    if bool(finite.all()):
        return ""
    samples = torch.nonzero(~finite).flatten().tolist()
    return ", ".join(map(str, samples[:10])) + (", ..." if len(samples) > 10 else "")


def check_one_tensor(output: Any) -> torch.Tensor:
    """``output`` if the model returned one tensor.

    Raises:
        InvalidInputError: If it returned a tuple, a dict or anything else, with the way out.
    """
    if not isinstance(output, torch.Tensor):
        name = type(output).__name__
        if isinstance(getattr(output, "logits", None), torch.Tensor):
            # A Hugging Face output object: its first field is the loss when labels are given,
            # so model(x)[0] is not the way out; explain_inputs reads .logits by name.
            raise InvalidInputError(
                f"the model returned a {name} (an output object with .logits), not one tensor of "
                "scores; explain it with explain_inputs(model, {'pixel_values': x}, method, "
                "target, explained='pixel_values') (explain_tokens for token ids), which reads "
                ".logits, or wrap it in an nn.Module whose forward returns model(x).logits"
            )
        raise InvalidInputError(
            "the model must return one tensor of scores of shape (batch, n_outputs); it returned "
            f"a {name}; wrap it in an nn.Module whose forward returns one tensor, "
            "e.g. model(x)[0] or model(x)['logits']"
        )
    return output


def check_scores(output: Any, batch: int | None = None) -> torch.Tensor:
    """``output`` if it is one ``(batch, n_outputs)`` tensor of scores.

    Raises:
        InvalidInputError: If the model returned anything else (a tuple, a dict, another shape).
    """
    output = check_one_tensor(output)
    if output.dim() != 2 or (batch is not None and output.shape[0] != batch):
        expected = f"({'batch' if batch is None else batch}, n_outputs)"
        advice = "Wrap it so that it returns one score per class."
        if output.dim() > 2:  # a segmentation map, per-token scores
            advice = (
                "For an output with more axes after the batch (a segmentation map) explain one "
                "position's score: Explainer(model, method).attribute(x, target=(c, i, j)), as "
                "in Captum, or wrap the model so that it returns the scores to explain, e.g. "
                "model(x)[:, :, rows, cols].sum((2, 3)) for a region."
            )
        raise InvalidInputError(
            f"the model must return scores of shape {expected}; got {tuple(output.shape)}. "
            + advice
        )
    return output


def run_once(
    model: Any,
    inputs: torch.Tensor,
    *,
    name: str = "inputs",
    hint: str = "pass inputs shaped like the model's training data",
) -> torch.Tensor:
    """Run ``model`` once on ``inputs`` (no gradients) and return its one, finite output tensor.

    Entry points that trace or loop over data call this first, so that inputs the model cannot
    take end in one clear sentence instead of a traceback from deep inside torch.

    Args:
        model: The model.
        inputs: A batch with the shape of the real inputs (a slice is enough).
        name: Argument name used in messages.
        hint: What the user should do when the model cannot run on the inputs.

    Raises:
        InvalidInputError: For empty inputs, inputs the model raises on (a
            :class:`~explain_core.errors.ModelRunError`), a model that does not return one
            tensor, or NaN/infinite outputs.
    """
    shape = tuple(inputs.shape)
    if inputs.numel() == 0:
        raise InvalidInputError(f"the {name} are empty (shape {shape}); {hint}")
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except ExplainError:
        raise  # the model's own clear message
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        raise model_error(model, inputs, error, name=name, hint=hint) from error
    if not isinstance(outputs, torch.Tensor):
        check_scores(outputs)  # raises, naming what the model returned
    if outputs.is_floating_point() and not bool(torch.isfinite(outputs).all()):
        raise InvalidInputError(
            f"the model's outputs on {name} of shape {shape} contain NaN or infinite values; "
            "check its weights and the inputs' value range"
        )
    return outputs


def check_output_finite(output: torch.Tensor) -> None:
    """Refuse NaN or infinite scores, which have no meaningful attribution.

    Raises:
        InvalidInputError: Naming the samples whose scores are not finite.
    """
    bad = non_finite_samples(output)
    if bad:
        raise InvalidInputError(
            f"the model's output is not finite (NaN or infinite) for samples [{bad}] of "
            f"{len(output)}, so there is nothing meaningful to attribute; check the model's "
            "weights and forward (overflow, division by zero, log of 0) and the inputs' scale"
        )


def check_reference_output_finite(output: torch.Tensor, method: str) -> None:
    """Refuse a reference input (baseline) where the model's output is NaN or infinite.

    A method that attributes the change from the reference's output has nothing to measure
    from there (an all-zero input may be all padding, which a mask turns into NaN).

    Raises:
        InvalidInputError: Naming the samples whose reference output is not finite.
    """
    bad = non_finite_samples(output)
    if bad:
        raise InvalidInputError(
            f"the model's output at the reference input (baselines) is not finite (NaN or "
            f"infinite) for samples [{bad}] of {len(output)}: {method} attributes the change "
            "from that output, which is undefined there; pass baselines= a reference the model "
            "is defined at (an all-zero input, the default, may be all padding to the model)"
        )


def refuse_inference_mode(caller: str, model: nn.Module | None = None) -> None:
    """Refuse a call inside ``torch.inference_mode()``, or a model made inside it.

    Either way no gradient can be computed: autograd cannot save inference tensors (a
    ``model``'s parameters or buffers created or loaded under ``torch.inference_mode()``) for
    the backward pass, and torch's own error says nothing about where they came from.

    Args:
        caller: The entry point named in the message, e.g. ``"explain()"``.
        model: The model to check, if any.

    A lazy module not run yet (``nn.LazyLinear``) is refused first: its parameters have no
    shape, and reading them raises torch's own error.

    Raises:
        InvalidInputError: If inference mode is enabled.
        ModelStateError: If ``model`` holds inference tensors, uninitialised parameters or
            quantized (int8) modules.
    """
    if torch.is_inference_mode_enabled():
        raise InvalidInputError(
            f"{caller} was called inside torch.inference_mode(), where no gradients can be "
            "computed; call it outside torch.inference_mode() (torch.no_grad() is fine)"
        )
    if not isinstance(model, nn.Module):  # none given, or not a model: refused elsewhere
        return
    _refuse_uninitialised(model, caller)
    _refuse_quantized(model, caller)
    made_there = _named_tensors(model, torch.Tensor.is_inference)
    if made_there:
        raise ModelStateError(
            f"the model holds inference tensors ({made_there}): it was created or "
            "loaded inside torch.inference_mode(), and autograd cannot save such tensors "
            f"for the backward pass {caller} needs; explain a copy made outside it "
            "(copy.deepcopy(model)), or create or load the model outside "
            "torch.inference_mode() (torch.no_grad() serves inference as well)"
        )


# Activation checkpointing recomputes parts of forward during backward (torch.utils.checkpoint):
# the reentrant kind refuses input gradients, and modified-gradient rules change what the
# recomputation saves. An explanation of a model in eval mode needs no checkpointing.
CHECKPOINT_ADVICE = (
    "activation checkpointing (torch.utils.checkpoint), which recomputes forward during "
    "backward and cannot be explained: turn it off while explaining (a Hugging Face model: "
    "model.gradient_checkpointing_disable(); torchvision's DenseNet, which checkpoints "
    "whenever its input requires grad: set memory_efficient = False on its _DenseLayer "
    "modules; your own code: call the module directly when not training)"
)


CUT_PATH = (
    "the model's output does not depend differentiably on its input: a torch.no_grad() block "
    "(or .detach(), .data) in forward cuts the path {signal} must travel back along (remove it "
    "from forward), or the output does not depend on the input at all"
)


def input_gradient(
    score: torch.Tensor,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor | None = None,
    **options: bool,
) -> torch.Tensor:
    """``torch.autograd.grad(score, inputs, grad_outputs, **options)``'s one gradient.

    ``options``: ``torch.autograd.grad``'s ``create_graph`` and ``is_grads_batched``.

    Raises:
        UnsupportedModelError: If ``forward`` cut the path from ``inputs`` to ``score`` (torch
            says only that a tensor was not used in the graph).
    """
    if score.requires_grad:
        (gradient,) = torch.autograd.grad(score, inputs, grad_outputs, allow_unused=True, **options)
        if gradient is not None:
            return gradient
    raise UnsupportedModelError(CUT_PATH.format(signal="the gradient"))


_CUDNN_RNN_IN_EVAL = "cudnn RNN backward can only be called in training mode"
_CUDNN_RNN_ADVICE = (
    "the model's nn.LSTM/nn.GRU/nn.RNN runs on cuDNN, whose kernels compute no gradient in eval "
    "mode (a torch limitation), so gradient methods cannot run on it here; wrap the call in "
    "`with torch.backends.cudnn.flags(enabled=False):` (torch then computes the layer without "
    "cuDNN, exactly), run it on the CPU, or explain with an LRP method (the relevance engine "
    "computes the layer's cells itself)"
)
"""What to do where torch's cuDNN RNN kernels refuse a backward pass in eval mode."""


# What a forward raises on inputs it cannot take: torch's own errors, ValueError from norm layers
# on bad ranks, AssertionError from a torch.export'ed module's guards (and the model's asserts),
# TypeError from a forward that takes more arguments than the one input.
_FORWARD_ERRORS = (RuntimeError, ValueError, AssertionError, IndexError, TypeError)

SEVERAL_INPUTS_ADVICE = (
    "For a model whose forward takes several inputs, explain one of them with "
    "explain_inputs(model, {'x': x, 'mask': mask}, method, target, explained='x') (named as "
    "in its forward; the others go with every call as given), or wrap the model in an "
    "nn.Module whose forward(x) calls it with the others"
)
"""How to explain a model with several inputs (explain() passes one tensor)."""

# Python's words for a call that lacks an argument of the function's signature.
_MISSING_ARGUMENT = re.compile(r"missing \d+ required (positional|keyword-only) argument")


def diagnose_failure(
    model: nn.Module,
    inputs: torch.Tensor,
    error: Exception,
    references: torch.Tensor | None = None,
) -> ModelRunError | None:
    """A clear error for a method that failed with a raw torch error, or ``None`` to re-raise.

    The methods call the model themselves, so its first forward pass cannot be wrapped. Instead,
    only after a failure, one sample is run through the plain model: if that fails too, the
    inputs do not fit the model (or the model raises on any input); if the model wrote into that
    sample, it works in place on its input, which autograd refuses; if it runs on the batch but
    not on one sample, or not on one row more than the batch, its forward depends on the batch
    size, which the methods' own batches (a one-sample trace, path points, references) meet;
    otherwise the error is the method's or the model's own. With ``references`` (the reference
    inputs a method runs the model on, broadcastable to ``inputs``), a model that raises on
    them is named too. Run it inside the model guard, so that the probes leave no trace on the
    model.
    """
    if is_out_of_memory(error):  # a batch too large, not a mismatch
        return None
    if "torch.utils.checkpoint" in str(error):
        return ModelRunError(f"the model uses {CHECKPOINT_ADVICE}")
    if _CUDNN_RNN_IN_EVAL in str(error):
        return ModelRunError(_CUDNN_RNN_ADVICE)
    probe = inputs[:1].clone()
    try:
        with torch.no_grad():
            model(probe)
    except _FORWARD_ERRORS as failure:
        if inputs.shape[0] > 1 and _rows_or_error(model, inputs) == inputs.shape[0]:
            happened = f"it raised {_first_line(failure)}"
            return _batch_size_dependent(inputs.shape[0], 1, happened, model)
        return model_error(model, inputs, error)
    if references is not None:
        try:
            with torch.no_grad():
                model(references.expand_as(inputs)[:1].clone())
        except _FORWARD_ERRORS as failure:
            return ModelRunError(
                f"the model runs on the inputs but raised {_first_line(failure)} on the "
                "reference input (baselines; all zeros unless given), where the method runs it "
                "too; pass baselines= an input the model runs on (a forward that takes the "
                "non-zero steps of a sequence as its length finds none in an all-zero one)"
            )
    if inputs.shape[0] > 1:  # one row per sample, else axis 0 is no batch axis
        try:
            with torch.no_grad():
                check_output_rows(model(inputs.clone()), inputs)
        except ModelRunError as clear:
            return clear
        except _FORWARD_ERRORS:
            pass  # the whole batch fails where one sample runs: the method's own error follows
    # Methods also run batches of their own sizes (path points, noisy copies, references): does
    # the model run on one row more than it was given?
    larger = torch.cat([inputs, inputs[:1]])
    rows = _rows_or_error(model, larger)
    if isinstance(rows, str) or (rows is not None and rows != larger.shape[0]):
        happened = rows if isinstance(rows, str) else f"it returned {rows} row(s)"
        return _batch_size_dependent(inputs.shape[0], larger.shape[0], happened, model)
    if probe._version > 0 and "in-place" in str(error):  # a fresh clone's version is 0
        return ModelRunError(
            "the model modifies its input in place (e.g. nn.ReLU(inplace=True) or torch.relu_ "
            "as its first operation), which gradient-based attribution cannot differentiate; "
            "make that first operation out of place (inplace=False)"
        )
    return None


def _rows_or_error(model: nn.Module, inputs: torch.Tensor) -> int | str | None:
    """The rows of ``model``'s output on ``inputs``, or what it raised (``"it raised …"``).

    ``None`` where that says nothing about the batch: out of memory, or no tensor returned.
    """
    try:
        with torch.no_grad():
            output = model(inputs.clone())
    except (*_FORWARD_ERRORS, MemoryError) as error:
        return None if is_out_of_memory(error) else f"it raised {_first_line(error)}"
    return output.shape[0] if isinstance(output, torch.Tensor) and output.dim() else None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}({lines[0] if lines else ''!r})"


def _batch_size_dependent(
    samples: int, other: int, happened: str, model: nn.Module
) -> ModelRunError:
    """The error for a model that returns one row per sample only for some batch sizes."""
    ran = f"the model runs on this batch of {samples} sample(s) but not on a batch of {other}"
    sizes = (
        "the method runs the model on batches of other sizes (one sample to trace it, or path "
        "points, noisy copies or references stacked along axis 0)"
    )
    listed = _listed_forward_arguments(model, samples)
    if listed:
        kind = type(model.extra_args[listed[0]]).__name__
        return ModelRunError(
            f"{ran} ({happened}), and additional_forward_args[{listed[0]}] is a {kind} of "
            f"{samples} values: {sizes}, and only a tensor argument with one row per sample "
            "follows each sample there, as in Captum: pass it as a tensor (torch.tensor(...))"
        )
    exported = (
        " (a torch.export'ed module checks the batch size it was exported with: export it with "
        "a dynamic batch axis, dynamic_shapes={'x': {0: torch.export.Dim('batch')}})"
        if "Guard failed" in happened
        else ""
    )
    return ModelRunError(
        f"{ran} ({happened}): its forward depends on the batch size (e.g. x.view({samples}, -1), "
        f"or a tensor of {samples} row(s) built into it), while {sizes}. Take sizes from the "
        "input instead (x.view(x.shape[0], -1) or x.flatten(1)), and pass a tensor of one "
        "row per sample (sequence lengths, a mask) as a forward argument, where it follows "
        "each sample (explain_inputs(model, {'x': x, 'lengths': lengths}, method, target, "
        "explained='x'), or Explainer(model, method).attribute(x, target, "
        "additional_forward_args=lengths)); a method with an "
        "internal_batch_size option runs one copy of the batch per pass with "
        f"internal_batch_size={samples}{exported}"
    )


def _listed_forward_arguments(model: nn.Module, samples: int) -> list[int]:
    """Positions of the forward arguments given as a list or tuple of one value per sample."""
    if not isinstance(model, ForwardWithArgs):
        return []
    return [
        position
        for position, arg in enumerate(model.extra_args)
        if isinstance(arg, (list, tuple)) and len(arg) == samples
    ]


def check_output_rows(output: Any, inputs: torch.Tensor, given: torch.Tensor | None = None) -> None:
    """Refuse a model output with another number of rows than ``inputs`` has samples.

    Axis 0 is the batch axis: one image without it, shaped ``(C, H, W)``, reads as ``C``
    samples, and a model that broadcasts (a normalisation with ``(1, C, 1, 1)`` buffers) returns
    one row for them — the inputs' fault, not the method's.

    Raises:
        ModelRunError: Naming the shapes and ``x.unsqueeze(0)``.
    """
    if not isinstance(output, torch.Tensor) or output.dim() == 0:
        return
    rows, samples = output.shape[0], inputs.shape[0]
    if rows != samples:
        shape = tuple(inputs.shape)
        elsewhere = (  # (steps, batch, features): an RNN with batch_first=False
            "; if the batch is axis 1 (an RNN with batch_first=False reads (steps, batch, "
            "features)), move it first and let a wrapper's forward move it back "
            "(x.movedim(0, 1))"
            if inputs.dim() == 3 and shape[1] == rows > 1
            else ""
        )
        raise ModelRunError(
            f"the model returned {rows} output row(s) for {samples} samples along axis 0 (the "
            f"batch axis) of inputs shaped {shape}; if they are one sample, pass x.unsqueeze(0), "
            f"of shape {(1, *shape)}{elsewhere}: a model must return one row per sample"
        )


@contextmanager
def clear_model_errors(
    model: nn.Module, inputs: torch.Tensor, references: torch.Tensor | None = None
) -> Iterator[None]:
    """Turn a raw torch error raised inside the block into :func:`diagnose_failure`'s message.

    For entry points that, like :func:`~explain_core.explain`, run a method on the model: a
    valid call costs nothing extra. Use it inside the model guard. Errors that already explain
    themselves (:class:`~explain_core.errors.ExplainError`) pass unchanged. ``references``: the
    reference inputs the method runs the model on, if any.
    """
    try:
        yield
    except ExplainError:
        raise
    except _FORWARD_ERRORS as error:
        clear = diagnose_failure(model, inputs, error, references)
        if clear is None:
            raise
        raise clear from error


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (torch on an accelerator or the CPU, Python)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    # the CPU allocator raises a plain RuntimeError
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


@contextmanager
def memory_errors(samples: int, method: str, engine: Any) -> Iterator[None]:
    """Turn running out of memory inside the block into one error saying what bounds memory.

    Args:
        samples: The batch size explained.
        method: The method's name.
        engine: The configured method; its ``memory_option`` (if any) bounds the rows per pass.
    """
    option = engine.memory_option
    value = getattr(engine, option) if option is not None else None
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        first = re.sub(r"^\[enforce fail[^\]]*\][^.]*\.\s*", "", first)  # the CPU allocator's
        fewer = (
            f"explain fewer samples per call (e.g. {samples // 2} at a time)"
            if samples > 1
            else "use smaller inputs or a device with more memory (one sample does not fit)"
        )
        advice = (
            f"lower {option} (now {value}), the rows each forward pass evaluates, or {fewer}"
            if option is not None
            else fewer
        )
        raise OutOfMemoryError(
            f"out of memory explaining a batch of {samples} samples with {method!r} "
            f"({textwrap.shorten(first, 200, placeholder=' …')}); {advice}"
        ) from error


# Words in torch's messages about inputs that do not fit a layer ("mat1 and mat2 shapes cannot
# be multiplied", "expected input[2, 2, 8, 8] to have 1 channels", "size of tensor a (5) must
# match", "Dimension out of range"); an error without them is not blamed on the inputs' shape.
_SHAPE_ERROR = re.compile(
    r"shape|size|dimension|channel|mat1|mat2|\bdims?\b|\dD input", re.IGNORECASE
)
# torch's norm layers: "expected 4D input (got 3D input)", i.e. one sample without its batch axis
_DIMS_EXPECTED = re.compile(r"expected (?P<expected>\d)D input \(got (?P<got>\d)D input\)")


def model_error(
    model: Any,
    inputs: torch.Tensor,
    error: BaseException,
    *,
    name: str = "inputs",
    hint: str = "pass inputs shaped like the model's training data",
) -> ModelRunError:
    """Why ``model`` raised ``error`` on ``inputs``: a dtype it lacks, their shape, or its own.

    Only an error that reads like a shape mismatch is blamed on the inputs' shape (with
    ``hint``); any other error is reported as the model's own, so that a user does not reshape
    valid inputs to fix a bug in their forward. Raise the result ``from error``.
    """
    dtypes = (
        sorted({p.dtype for p in model.parameters() if p.is_floating_point()}, key=str)
        if isinstance(model, nn.Module)
        else []
    )
    if dtypes and inputs.dtype not in dtypes:
        return _dtype_mismatch(inputs.dtype, dtypes[0], name)
    shape = tuple(inputs.shape)
    message = str(error).strip()
    first = (message.splitlines() or [type(error).__name__])[0]
    dims = _DIMS_EXPECTED.search(message)
    if dims and int(dims["got"]) == int(dims["expected"]) - 1:
        return ModelRunError(
            f"the model cannot run on {name} of shape {shape}: {first}; they lack the batch "
            f"axis: for one sample pass x.unsqueeze(0), of shape {(1, *shape)}"
        )
    if isinstance(error, TypeError) and _MISSING_ARGUMENT.search(message):
        return ModelRunError(
            f"the model's forward needs more than the one input it was called with: "
            f"{type(error).__name__}({first!r}). {SEVERAL_INPUTS_ADVICE}"
        )
    if isinstance(error, IndexError):  # a wrong index in forward, or inputs too small for it
        return ModelRunError(
            f"the model's forward raised IndexError({first!r}) on {name} of shape {shape}: an "
            "index it takes is out of range for these inputs or for a tensor it computes from "
            "them; see the chained traceback for where its forward raised it"
        )
    if _SHAPE_ERROR.search(message):
        return ModelRunError(f"the model cannot run on {name} of shape {shape}: {first}; {hint}")
    return ModelRunError(
        f"the model's forward raised {type(error).__name__}({first!r}) on {name} of shape "
        f"{shape}; this is the model's own error, not a shape mismatch: see the chained "
        "traceback for where its forward raised it"
    )
