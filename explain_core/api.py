"""The entry points users call: :func:`explain`, :class:`Explainer` and a Quantus adapter."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.attribution import Attribution
from explain_core.errors import InvalidInputError
from explain_core.model_guard import ModelGuard, require_eval_mode
from explain_core.plugin_manager import get_registry
from explain_core.targets import TargetLike, normalize_target


class ModelRunError(InvalidInputError, RuntimeError):
    """Inputs (or a model) on which the model's forward pass fails, explained in one sentence.

    Also a ``RuntimeError``, the type torch raised before it was explained, so that code catching
    that keeps working; torch's error is chained as the cause.
    """


def explain(
    model: nn.Module,
    inputs: torch.Tensor,
    method: str,
    target: TargetLike = None,
    *,
    baselines: torch.Tensor | float | None = None,
    **options: Any,
) -> Attribution:
    """Explain ``model`` at ``inputs`` with a registered method.

    The model must be in eval mode. It is left exactly as it was: outputs, parameters, buffers,
    hooks and attributes, also when the method raises.

    Args:
        model: Any ``nn.Module`` returning ``(batch, n_outputs)`` scores.
        inputs: ``(batch, ...)`` floating-point inputs on the model's device.
        method: Registered method name, e.g. ``"gradient"``; see ``explain plugins``.
        target: Output to explain: ``None`` (predicted class), one int, or one int per sample.
        baselines: Reference input(s) for methods that use them (a tensor broadcastable to
            ``inputs``, or a number).
        **options: Method options, e.g. ``steps=20``.

    Returns:
        The attribution with method name, targets, outputs and delta.

    Raises:
        UnknownMethodError: If no plugin registers ``method`` (closest names are suggested).
        InvalidInputError: For inputs, targets, baselines or options that do not fit, inputs the
            model cannot run on, a model that does not return one finite ``(batch, n_outputs)``
            tensor, or a call inside ``torch.inference_mode()``.
        ModelStateError: If the model is in training mode.
    """
    if not isinstance(method, str):
        raise InvalidInputError(
            f"method must be a registered name such as 'gradient'; got {type(method).__name__}. "
            "Call explain(model, inputs, method, target)."
        )
    if not isinstance(model, nn.Module):
        raise InvalidInputError(
            f"model must be a torch.nn.Module; got {type(model).__name__}, so wrap it in an "
            "nn.Module whose forward calls it"
        )
    if torch.is_inference_mode_enabled():
        raise InvalidInputError(
            "explain() was called inside torch.inference_mode(), where no gradients can be "
            "computed; call it outside torch.inference_mode() (torch.no_grad() is fine)"
        )
    spec = get_registry()[method]
    engine = spec.create(**options)
    inputs = _check_inputs(inputs, model)
    reference = _check_baselines(baselines, inputs, method, engine.uses_baselines)
    target_tensor = normalize_target(target, inputs.shape[0], inputs.device)
    require_eval_mode(model)
    with ModelGuard(model):
        try:
            result = engine.attribute(model, inputs, target_tensor, reference)
        except RuntimeError as error:
            # Diagnose only after a failure, so that a valid call costs no extra forward pass;
            # inside the guard, so that the probe leaves no trace on the model either.
            clear = _diagnose_failure(model, inputs, error)
            if clear is None:
                raise
            raise clear from error
    _check_output_finite(result.output)
    return Attribution(
        attribution=result.attribution,
        method=method,
        target=result.target,
        output=result.output,
        delta=result.delta,
        extras=result.extras,
    )


class Explainer:
    """A Captum-style explainer: ``Explainer(model, "gradient").attribute(inputs, target=...)``.

    Code written for Captum attribution classes (and tools calling them, such as the Quantus
    metrics toolkit) can use any registered method through this class.

    Args:
        model: The model to explain (the ``forward_func`` in Captum's terms).
        method: Registered method name.
        **options: Method options, fixed for every call.
    """

    def __init__(self, model: nn.Module, method: str, **options: Any) -> None:
        get_registry()[method].create(**options)  # fail early on unknown names and options
        self.model = model
        self.method = method
        self.options = options

    def attribute(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor],
        target: TargetLike = None,
        baselines: torch.Tensor | float | tuple[torch.Tensor] | None = None,
        *,
        return_convergence_delta: bool = False,
        additional_forward_args: Any = None,
    ) -> Any:
        """Attribute like Captum: returns a tensor shaped like ``inputs`` (and the delta).

        Args:
            inputs: A tensor, or a 1-tuple holding one (returned as a 1-tuple too).
            target: ``None``, one int, or one int per sample.
            baselines: Reference input for methods that use one.
            return_convergence_delta: Also return the per-sample delta.
            additional_forward_args: Not supported; must be ``None``.

        Returns:
            The attribution, or ``(attribution, delta)`` when ``return_convergence_delta``.

        Raises:
            InvalidInputError: If the delta is requested but the method defines none, or
                ``additional_forward_args`` is given.
        """
        if additional_forward_args is not None:
            raise InvalidInputError(
                "additional_forward_args is not supported; wrap the model in a module whose "
                "forward takes only the inputs"
            )
        as_tuple = isinstance(inputs, tuple)
        tensor = _single_tensor(inputs, "inputs")
        if isinstance(baselines, tuple):
            baselines = _single_tensor(baselines, "baselines")
        result = explain(
            self.model, tensor, self.method, target, baselines=baselines, **self.options
        )
        attribution = (result.attribution,) if as_tuple else result.attribution
        if not return_convergence_delta:
            return attribution
        if result.delta is None:
            raise InvalidInputError(f"method {self.method!r} defines no convergence delta")
        return attribution, result.delta

    def explain(
        self, inputs: torch.Tensor, target: TargetLike = None, **kwargs: Any
    ) -> Attribution:
        """Like :func:`explain` with this explainer's model, method and options."""
        return explain(self.model, inputs, self.method, target, **self.options, **kwargs)


def quantus_explain(
    model: nn.Module,
    inputs: np.ndarray | torch.Tensor,
    targets: np.ndarray | torch.Tensor | int,
    *,
    method: str,
    device: str | torch.device | None = None,
    **options: Any,
) -> np.ndarray:
    """An ``explain_func`` for the Quantus metrics toolkit (NumPy in, NumPy out).

    Pass it as ``explain_func=quantus_explain`` with
    ``explain_func_kwargs={"method": "gradient"}``.
    """
    device = torch.device(device) if device is not None else _model_device(model)
    x = torch.as_tensor(np.asarray(inputs), dtype=torch.float32, device=device)
    result = explain(model, x, method, np.asarray(targets), **options)
    return result.attribution.detach().cpu().numpy()


def _single_tensor(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, tuple):
        if len(value) != 1:
            raise InvalidInputError(
                f"{what} must be one tensor (or a 1-tuple); got a tuple of {len(value)}. Models "
                "with several inputs are not supported yet: wrap them in a single-input module."
            )
        value = value[0]
    return value


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _model_tensor(model: nn.Module) -> torch.Tensor | None:
    """The model's first parameter (or buffer): where its weights live; ``None`` if it has none."""
    return next(model.parameters(), next(model.buffers(), None))


def _check_inputs(inputs: Any, model: nn.Module) -> torch.Tensor:
    """Validate ``inputs`` and return a private copy of them.

    The copy keeps the caller's tensor unchanged when the model works in place on its input
    (``torch.relu_(x)``), and turns an inference-mode tensor into one autograd can use; next to
    an attribution it costs nothing.
    """
    if not isinstance(inputs, torch.Tensor):
        raise InvalidInputError(
            f"inputs must be a torch.Tensor of shape (batch, ...); got {type(inputs).__name__}"
        )
    if inputs.dim() < 2:
        raise InvalidInputError(
            f"inputs need a batch axis: shape (batch, ...); got {tuple(inputs.shape)}. "
            "Use inputs[None] for a single sample."
        )
    if inputs.shape[0] == 0:
        raise InvalidInputError(
            f"inputs have 0 samples (shape {tuple(inputs.shape)}); pass at least one"
        )
    if not inputs.is_floating_point():
        raise InvalidInputError(f"inputs must be floating point; got dtype {inputs.dtype}")
    weight = _model_tensor(model)
    if weight is not None and weight.device.type == "meta":
        raise InvalidInputError(
            "the model's parameters are on the meta device and hold no values; materialise "
            "them first, e.g. model.to_empty(device='cpu') and then model.load_state_dict(...)"
        )
    if inputs.device.type == "meta":
        raise InvalidInputError(
            "inputs are meta tensors, which hold no values; pass real data, e.g. "
            f"torch.rand({', '.join(map(str, inputs.shape))})"
        )
    if weight is not None and inputs.device != weight.device:
        raise InvalidInputError(
            f"inputs are on {inputs.device} but the model's parameters are on {weight.device}; "
            f"move the inputs with x.to('{weight.device}') or the model with "
            f"model.to('{inputs.device}')"
        )
    bad = _non_finite_samples(inputs)
    if bad:
        raise InvalidInputError(
            f"inputs contain NaN or infinite values in samples [{bad}]; pass finite values"
        )
    return inputs.detach().clone()


def _check_baselines(
    baselines: torch.Tensor | float | None, inputs: torch.Tensor, method: str, used: bool
) -> torch.Tensor | None:
    if baselines is None:
        return None
    if not used:
        raise InvalidInputError(f"method {method!r} takes no baselines; leave baselines=None")
    if isinstance(baselines, torch.Tensor) and baselines.device.type == "meta":
        raise InvalidInputError("baselines are meta tensors, which hold no values; pass real data")
    try:
        reference = torch.as_tensor(baselines, dtype=inputs.dtype, device=inputs.device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidInputError(
            f"baselines must be a tensor broadcastable to the inputs' shape {tuple(inputs.shape)} "
            f"or a number; got {type(baselines).__name__}"
        ) from error
    try:
        reference = torch.broadcast_to(reference, inputs.shape)
    except RuntimeError:
        raise InvalidInputError(
            f"baselines of shape {tuple(reference.shape)} do not broadcast to the inputs' shape "
            f"{tuple(inputs.shape)}"
        ) from None
    if not torch.isfinite(reference).all():
        raise InvalidInputError("baselines contain NaN or infinite values; pass finite values")
    # A full copy, never a view of the caller's tensor: the model may work on it in place.
    return reference.detach().clone()


def _diagnose_failure(
    model: nn.Module, inputs: torch.Tensor, error: RuntimeError
) -> ModelRunError | None:
    """A clear error for a method that failed with a raw torch error, or ``None`` to re-raise.

    The methods call the model themselves, so its first forward pass cannot be wrapped here.
    Instead, only after a failure, one sample is run through the plain model: if that fails too,
    the inputs do not fit the model (shape, dtype); if the model wrote into that sample, it works
    in place on its input, which autograd refuses; otherwise the error is the method's or the
    model's own and is re-raised unchanged.
    """
    if isinstance(error, torch.cuda.OutOfMemoryError):  # a batch too large, not a mismatch
        return None
    probe = inputs[:1].clone()
    try:
        with torch.no_grad():
            model(probe)
    except RuntimeError:
        return _input_mismatch(model, inputs, str(error))
    if probe._version > 0 and "in-place" in str(error):  # a fresh clone's version is 0
        return ModelRunError(
            "the model modifies its input in place (e.g. nn.ReLU(inplace=True) or torch.relu_ "
            "as its first operation), which gradient-based attribution cannot differentiate; "
            "make that first operation out of place (inplace=False)"
        )
    return None


def _input_mismatch(model: nn.Module, inputs: torch.Tensor, message: str) -> ModelRunError:
    """Why the model cannot run on ``inputs``: a dtype it does not share, else their shape."""
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if dtypes and str(inputs.dtype) not in dtypes:
        # torch's own message ("Input type (c10::Half) and bias type (float)...") stays chained.
        return ModelRunError(
            f"inputs are {inputs.dtype} but the model's parameters are {', '.join(dtypes)}; "
            f"convert the inputs with x.to({dtypes[0]}) or the model with model.to({inputs.dtype})"
        )
    first = (message.strip().splitlines() or ["RuntimeError"])[0]
    return ModelRunError(
        f"the model cannot run on inputs of shape {tuple(inputs.shape)}: {first}; pass inputs "
        "shaped like the model's training data"
    )


def _check_output_finite(output: torch.Tensor) -> None:
    # A NaN or infinite score has no meaningful attribution; without this check the methods
    # return NaN maps and deltas silently.
    bad = _non_finite_samples(output)
    if bad:
        raise InvalidInputError(
            f"the model's output is not finite (NaN or infinite) for samples [{bad}] of "
            f"{len(output)}, so there is nothing meaningful to attribute; check the model's "
            "weights and forward (overflow, division by zero, log of 0) and the inputs' scale"
        )


def _non_finite_samples(tensor: torch.Tensor) -> str:
    """The indices of samples holding NaN or inf, e.g. ``"0, 3"`` (``""`` if all are finite)."""
    finite = torch.isfinite(tensor.detach())
    finite = finite.flatten(1).all(dim=1) if finite.dim() > 1 else finite.reshape(-1)
    if bool(finite.all()):
        return ""
    samples = torch.nonzero(~finite).flatten().tolist()
    return ", ".join(map(str, samples[:10])) + (", ..." if len(samples) > 10 else "")
