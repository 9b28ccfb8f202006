"""The entry points users call: :func:`explain`, :class:`Explainer` and a Quantus adapter."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.attribution import Attribution
from explain_core.captum_calls import (
    ForwardWithArgs,
    SampleGroup,
    batch_axis_advice,
    check_signature,
    flat_targets,
    forward_args,
    group_samples,
    has_tuple_targets,
)
from explain_core.eager import eager_mode, uncompiled
from explain_core.errors import InvalidInputError, ModelRunError, ModelStateError, NumericalError
from explain_core.model_guard import ModelGuard, RefuseTrainingCalls, require_eval_mode
from explain_core.plugin_manager import get_registry
from explain_core.registry import (
    Method,
    MethodError,
    MethodSpec,
    check_method_result,
    third_party_errors,
)
from explain_core.targets import TargetLike, normalize_target
from explain_core.validation import (
    check_inputs,
    check_output_finite,
    check_output_rows,
    clear_model_errors,
    memory_errors,
    non_finite_samples,
    refuse_inference_mode,
)

__all__ = [
    "Explainer",
    "explain",
    "quantus_explain",
]


def explain(
    model: nn.Module,
    inputs: torch.Tensor,
    method: str,
    target: TargetLike = None,
    *,
    baselines: torch.Tensor | float | None = None,
    allow_training: bool = False,
    **options: Any,
) -> Attribution:
    """Explain ``model`` at ``inputs`` with a registered method.

    The model must be in eval mode. It is left exactly as it was: outputs, parameters (with
    their ``.grad`` and ``requires_grad``), buffers (BatchNorm's running statistics too), hooks
    and attributes, also when the method raises; parameter values changed in place are reported,
    not undone. A ``torch.compile``'d model (or submodule) runs eagerly during attribution, with
    the same weights. What the method returns is checked: the attribution has the inputs' shape
    (every built-in method returns that shape), and all returned tensors come back detached.

    Args:
        model: Any ``nn.Module`` returning ``(batch, n_outputs)`` scores.
        inputs: ``(batch, ...)`` floating-point inputs on the model's device.
        method: Registered method name, e.g. ``"gradient"``; see ``explain plugins``.
        target: Output to explain: ``None`` (predicted class), one int, or one int per sample.
        baselines: Reference input(s) for methods that use them (a tensor broadcastable to
            ``inputs``, or a number).
        allow_training: Explain a model whose forward runs dropout (or batch statistics) in
            training mode, through calls such as ``F.dropout(h, p, self.training)``; refused
            by default for the built-in methods, since the map would change from call to call
            (a third-party method may use training mode on purpose, e.g. Monte-Carlo dropout).
            BatchNorm and Dropout modules in training mode are refused either way.
        **options: Method options, e.g. ``steps=20``.

    Returns:
        The attribution with method name, targets, outputs and delta.

    Raises:
        UnknownMethodError: If no plugin registers ``method`` (closest names are suggested).
        InvalidInputError: For inputs, targets, baselines or options that do not fit, inputs the
            model cannot run on, a model that does not return one finite ``(batch, n_outputs)``
            tensor, or a call inside ``torch.inference_mode()``. A model whose forward raises
            on the inputs gets a :class:`~explain_core.errors.ModelRunError` that blames their
            shape only for a shape error, with the model's error chained.
        NumericalError: If a built-in method's map is NaN or infinite for finite outputs (its
            backward overflowed in the dtype used).
        OutOfMemoryError: If the attribution runs out of memory (on the CPU or an
            accelerator), naming the batch size and the method's option that bounds memory.
        ModelStateError: If the model is in training mode, or its parameters change in place
            during the call (found, named and not undone; see ``ModelGuard``): by its forward, or
            by a third-party method; or its outputs depend on tensors its forward stores on the
            model (state carried from call to call).
        MethodError: If the method's factory builds no ``Method``, it returns no valid
            ``MethodResult`` (a wrong type or shape, non-integer targets), or a third-party
            method raises (its error chained), naming the method and its plugin.
    """
    if not isinstance(method, str):
        raise InvalidInputError(
            f"method must be a registered name such as 'gradient'; got {type(method).__name__}. "
            "Call explain(model, inputs, method, target)."
        )
    _require_module(model)
    refuse_inference_mode("explain()", model)
    spec = get_registry()[method]
    engine = spec.create(**options)
    model = uncompiled(model)
    inputs = check_inputs(inputs, model)
    reference = _check_baselines(baselines, inputs, method, engine.uses_baselines)
    target_tensor = normalize_target(target, inputs.shape[0], inputs.device)
    require_eval_mode(model)
    # Diagnose only after a failure, so that a valid call costs no extra forward pass; inside
    # the guard, so that the probe leaves no trace on the model either (its buffers included).
    with (
        # Built-in methods never write to the model: their guard only reads it, so other
        # threads may use the model meanwhile. Third-party methods may, so theirs restores it.
        ModelGuard(model, during=_third_party_call(spec), restore=not spec.builtin) as guard,
        eager_mode(),
        third_party_errors(
            spec,
            "the error comes from the method or from the model's forward it called (the "
            "chained traceback says where, --debug on the command line)",
        ),
        clear_model_errors(model, inputs, _references(reference, inputs, engine)),
        # Third-party methods may run the model in training mode on purpose (Monte-Carlo
        # dropout); their guard restores the model afterwards.
        RefuseTrainingCalls() if spec.builtin and not allow_training else contextlib.nullcontext(),
        memory_errors(inputs.shape[0], method, engine),
    ):
        returned = engine.attribute(model, inputs, target_tensor, reference)
    check_output_rows(getattr(returned, "output", None), inputs)
    result = check_method_result(returned, inputs, spec.label)
    check_output_finite(result.output)
    if guard.stored_tensors:  # did the passes read them?
        _refuse_state_kept_on_the_model(model, inputs, result.output, guard.stored_tensors)
    bad = non_finite_samples(result.attribution)
    if bad and not spec.builtin:  # the model's outputs are finite: the NaN/Inf are the method's
        raise MethodError(
            f"{spec.label} returned NaN or infinite attributions for finite model outputs; "
            "report it to the plugin's authors"
        )
    if bad:  # a built-in method's backward overflowed, or divided by ~0, in this dtype
        raise NumericalError(
            f"{method!r} gave NaN or infinite attributions for samples [{bad}] of "
            f"{len(result.attribution)} although the model's outputs are finite: its backward "
            f"pass overflowed in {result.attribution.dtype}; explain in float64 "
            "(model.double() and inputs.double()) or choose another method"
        )
    return Attribution(
        attribution=result.attribution,
        method=method,
        target=result.target,
        output=result.output,
        delta=result.delta,
        extras=result.extras,
    )


def _refuse_state_kept_on_the_model(
    model: nn.Module, inputs: torch.Tensor, output: torch.Tensor, attributes: list[str]
) -> None:
    """Refuse a model whose outputs depend on tensors its forward stores on the model.

    Run once more from the state the attribution left: a model that only writes that state
    (the last hidden state, kept for the caller) returns the same outputs, one that reads it (a
    state carried from call to call) computed the attribution's passes each from the state the
    last one left.

    Raises:
        ModelStateError: If the outputs differ (or that forward fails).
    """
    names = ", ".join(attributes[:3]) + (" …" if len(attributes) > 3 else "")
    message = (
        f"the model's forward stores tensors on the model ({names}) and its outputs depend on "
        "them: an attribution runs forward several times (a trace, path points, references), "
        "each from the state the last one left, so the map would explain other calls than "
        "yours. Pass the state as a forward argument (explain_inputs(model, {'x': x, 'state': "
        "state}, method, target, explained='x')) and return the new one instead of storing it"
    )
    try:
        with ModelGuard(model), torch.no_grad():
            again = model(inputs)
    except Exception as error:  # the state the passes left may be what fails
        raise ModelStateError(message) from error
    if isinstance(again, torch.Tensor) and again.shape == output.shape:
        scale = float(again.abs().max()) if again.numel() else 0.0
        if torch.allclose(again.to(output), output, rtol=1e-4, atol=1e-5 * (1 + scale)):
            return
    raise ModelStateError(message)


def _third_party_call(spec: MethodSpec) -> str | None:
    """The call for the guard's message; ``None`` for built-ins, which never write weights."""
    return None if spec.builtin else f"explain(..., {spec.name!r}) (plugin {spec.plugin!r})"


def _captum_entry_point(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` behind a wrapper, as Captum's ``log_usage`` decorator leaves its methods.

    Captum's ``NoiseTunnel`` calls ``attribution_method.attribute.__wrapped__`` (to skip its
    usage logging), so an attribution class that ``NoiseTunnel`` wraps needs that attribute.
    """

    @functools.wraps(function)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return entry_point


class Explainer:
    """A Captum-style explainer: ``Explainer(model, "gradient").attribute(inputs, target=...)``.

    Code written for Captum attribution classes can use any registered method through this
    class: Captum's ``NoiseTunnel`` wraps it, ``captum.metrics`` (``infidelity``,
    ``sensitivity_max``) and the Quantus toolkit call it, and ``attribute`` takes Captum's
    keywords and target forms. Like Captum's ``Attribution`` it has ``forward_func`` (the
    model), :meth:`has_convergence_delta` and :attr:`multiplies_by_inputs`.

    Args:
        model: The model to explain (the ``forward_func`` in Captum's terms).
        method: Registered method name.
        **options: Method options, fixed for every call (Captum's ``n_steps`` and
            ``internal_batch_size`` may override ``steps`` and ``internal_batch_size`` per call).

    Raises:
        UnknownMethodError: If no plugin registers ``method``.
        InvalidInputError: For options the method does not take.
    """

    def __init__(self, model: nn.Module, method: str, **options: Any) -> None:
        self._spec = get_registry()[method]
        self._engine = self._spec.create(**options)  # fail early on unknown names and options
        self.model = model
        self.forward_func = model  # Captum's name: NoiseTunnel and captum.metrics read it
        self.method = method
        self.options = options

    def has_convergence_delta(self) -> bool:
        """Whether :meth:`attribute` can return a convergence delta (Captum's method)."""
        return bool(self._engine.convergence_delta)

    @property
    def multiplies_by_inputs(self) -> bool:
        """Whether the attribution is a product with the input (or input − baseline).

        Captum's property: ``True`` for "global" attributions such as Input×Gradient,
        Integrated Gradients, DeepLIFT and LRP, ``False`` for the gradient.
        """
        return bool(self._engine.multiplies_by_inputs)

    @_captum_entry_point
    def attribute(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor],
        *positional: Any,
        target: Any = None,
        baselines: torch.Tensor | float | tuple[torch.Tensor] | None = None,
        additional_forward_args: Any = None,
        n_steps: int | None = None,
        method: str | None = None,
        internal_batch_size: int | None = None,
        return_convergence_delta: bool = False,
    ) -> Any:
        """Attribute like Captum: returns a tensor shaped like ``inputs`` (and the delta).

        Only ``inputs`` and ``target`` are taken by position: Captum's classes differ there
        (``IntegratedGradients`` and ``DeepLift`` take baselines second).

        Args:
            inputs: A tensor, or a 1-tuple holding one (returned as a 1-tuple too).
            target: Captum's forms: ``None`` (the predicted class), an int or 1-element tensor
                for every sample, a list or 1-D tensor of one int per sample, or for models
                whose output has more axes after the batch one tuple of indices into them (for
                every sample) or a list of one tuple per sample.
            *positional: The target, if not given by keyword; anything more is refused.
            baselines: Reference input for methods that use one (a tensor broadcastable to the
                inputs, one row per sample, or a number; a 1-tuple of those).
            additional_forward_args: Further arguments of the model's forward after the
                input: one argument or a tuple of them. As in Captum, a tensor among them
                holds one row per sample, which goes with every copy of that sample the method
                feeds to the model; other values are passed unchanged.
            n_steps: Captum's name of the ``steps`` option (path methods).
            method: Captum's Integrated Gradients quadrature; accepted when it is the rule the
                method integrates with (``"riemann_middle"`` for ``integrated_gradients``).
            internal_batch_size: The ``internal_batch_size`` option (rows per forward pass).
            return_convergence_delta: Also return the per-sample delta.

        Returns:
            The attribution, or ``(attribution, delta)`` when ``return_convergence_delta``. The
            delta follows Captum's sign: summed attribution minus the explained output (or
            output gain ``f(inputs) − f(baselines)``), i.e. ``−Attribution.delta``.

        Raises:
            InvalidInputError: If the delta is requested but the method defines none, a
                Captum keyword maps to no option of the method, or the target or forward
                arguments do not fit the inputs; and as :func:`explain` does.
        """
        _require_module(self.model)
        captum_order = (
            "Captum's IntegratedGradients and DeepLift take baselines second: here write "
            "attribute(x, target=..., baselines=...)"
        )
        if len(positional) > 1 or (positional and target is not None):
            raise InvalidInputError(
                "Explainer.attribute takes inputs and target by position and the rest by "
                f"keyword; got {len(positional)} positional argument(s) after the inputs"
                f"{' and target= as well' if target is not None else ''}. {captum_order}"
            )
        if positional:
            target = positional[0]
        floating = isinstance(target, float) or (
            isinstance(target, torch.Tensor) and target.is_floating_point()
        )
        if floating and self._engine.uses_baselines:
            raise InvalidInputError(
                f"target must be a class index; got a {type(target).__name__} of floating "
                f"point values. {captum_order}"
            )
        if return_convergence_delta and not self.has_convergence_delta():
            raise InvalidInputError(
                f"method {self.method!r} defines no convergence delta (has_convergence_delta() "
                "is False); leave return_convergence_delta=False"
            )
        options = self._call_options(n_steps, method, internal_batch_size)
        as_tuple = isinstance(inputs, tuple)
        tensor = _single_tensor(inputs, "inputs")
        if isinstance(baselines, tuple):
            baselines = _single_tensor(baselines, "baselines")
        if baselines is not None and not isinstance(baselines, (torch.Tensor, int, float)):
            baselines = _as_tensor(baselines, "baselines")  # NumPy, nested lists: rows to group
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or len(tensor) == 0:
            check_inputs(tensor, self.model)  # explain()'s error for what is no batch
        batch = tensor.shape[0]
        args = forward_args(additional_forward_args, batch)
        if args and isinstance(self.model, nn.Module):
            check_signature(uncompiled(self.model), args)
        groups = group_samples(args, batch, tensor.device)
        flatten = has_tuple_targets(target)
        if flatten and self._engine.contrasts_outputs:
            raise InvalidInputError(
                f"{self.method!r} contrasts the explained output with the model's other outputs; "
                "with a tuple target those are every other entry of the output map (all pixels "
                "and classes). Return the outputs to contrast from a wrapper, e.g. the classes at "
                "the pixel (forward: return model(x)[:, :, i, j]), and give the class as the "
                "target"
            )
        if flatten:
            target = flat_targets(target, batch, lambda: self._output_shape(tensor, groups[0]))
        if not args and not flatten:
            attribution, delta = self._explain(self.model, tensor, target, baselines, options)
        else:
            try:
                attribution, delta = self._explain_groups(
                    tensor, groups, target, baselines, options, flatten
                )
            except ModelRunError as error:
                advice = "".join(
                    f" additional_forward_args[{position}] of shape {tuple(arg.shape)} was cut "
                    f"to one row per sample on axis 0{batch_axis_advice(arg, batch)}."
                    for position, arg in enumerate(args)
                    if batch_axis_advice(arg, batch)
                )
                if not advice:
                    raise
                raise ModelRunError(f"{error}.{advice}") from error
        attribution_out = (attribution,) if as_tuple else attribution
        if not return_convergence_delta:
            return attribution_out
        # Captum's compute_convergence_delta is Σ attribution − (f(x) − f(baseline)); explain()
        # reports what is left unexplained, the opposite sign. Callers of this class expect
        # Captum's.
        return attribution_out, -delta

    def explain(
        self, inputs: torch.Tensor, target: TargetLike = None, **kwargs: Any
    ) -> Attribution:
        """Like :func:`explain` with this explainer's model, method and options."""
        return explain(self.model, inputs, self.method, target, **self.options, **kwargs)

    def _call_options(
        self, n_steps: int | None, method: str | None, internal_batch_size: int | None
    ) -> dict[str, Any]:
        """This explainer's options with Captum's per-call keywords mapped onto them."""
        options = dict(self.options)
        known = self._spec.options()
        for captum_name, ours, value in (
            ("n_steps", "steps", n_steps),
            ("internal_batch_size", "internal_batch_size", internal_batch_size),
        ):
            if value is None:
                continue
            if ours not in known:
                raise InvalidInputError(
                    f"{captum_name}= sets the option {ours!r}, which method {self.method!r} does "
                    f"not have; its options: {', '.join(known) or 'none'}"
                )
            options[ours] = value
        if method is not None:
            rule = self._engine.quadrature
            if rule is None:
                raise InvalidInputError(
                    f"method={method!r} is Captum's quadrature of a path integral; method "
                    f"{self.method!r} integrates no path (pass the method's name to "
                    "Explainer(model, name), not to attribute())"
                )
            if method != rule:
                raise InvalidInputError(
                    f"method {self.method!r} integrates with Captum's {rule!r} rule only; got "
                    f"method={method!r}: pass method={rule!r} or leave it out, and raise n_steps "
                    "for accuracy"
                )
        return options

    def _explain(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        target: Any,
        baselines: Any,
        options: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Captum's NoiseTunnel calls attribute() under torch.no_grad(); the methods need
        # autograd, as Captum's own do.
        with torch.enable_grad():
            result = explain(model, inputs, self.method, target, baselines=baselines, **options)
        if self.has_convergence_delta() and result.delta is None:
            raise MethodError(
                f"{self._spec.label} declares a convergence delta but returned none; report it "
                "to the plugin's authors"
            )
        return result.attribution, result.delta

    def _explain_groups(
        self,
        inputs: torch.Tensor,
        groups: list[SampleGroup],
        target: Any,
        baselines: Any,
        options: dict[str, Any],
        flatten: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One explain() per group of samples sharing their forward arguments."""
        batch = inputs.shape[0]
        model = uncompiled(self.model)
        per_sample_target = normalize_target(target, batch, inputs.device)
        per_sample_baselines = (
            isinstance(baselines, torch.Tensor)
            and baselines.dim() == inputs.dim()
            and baselines.shape[0] == batch
        )
        attribution = torch.empty_like(inputs)
        delta = None
        for group in groups:
            rows = group.rows
            attribution_part, delta_part = self._explain(
                ForwardWithArgs(model, group.args, flatten),
                inputs[rows],
                None if per_sample_target is None else per_sample_target[rows],
                baselines[rows.to(baselines.device)] if per_sample_baselines else baselines,
                options,
            )
            attribution[rows] = attribution_part
            if delta_part is not None:
                if delta is None:
                    delta = delta_part.new_empty(batch)
                delta[rows] = delta_part
        return attribution, delta

    def _output_shape(self, inputs: torch.Tensor, group: SampleGroup) -> torch.Size:
        """The model's output shape after the batch axis, from one sample (for tuple targets)."""
        model = uncompiled(self.model)  # a module: attribute() checked
        refuse_inference_mode("Explainer.attribute()", model)
        require_eval_mode(model)  # before the probe: a BatchNorm in training mode would update
        forward = ForwardWithArgs(model, group.args, flatten=False)
        probe = check_inputs(inputs[:1], model)
        with ModelGuard(model), eager_mode(), clear_model_errors(forward, probe), torch.no_grad():
            output = forward(probe)
        if not isinstance(output, torch.Tensor) or output.dim() < 2:
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
            raise InvalidInputError(
                "a tuple target indexes the axes of the model's output after the batch; the "
                f"model returned {type(output).__name__}"
                + (f" of shape {shape}" if shape is not None else "")
                + ": give an int target instead"
            )
        return output.shape[1:]


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
    ``explain_func_kwargs={"method": "gradient"}`` (further keys are the method's options).
    The inputs are converted to the dtype of the model's floating-point parameters (float32 for
    a model without any), since Quantus hands over NumPy arrays of its own dtype that its user
    cannot choose per call. Quantus' faithfulness, robustness, randomisation and localisation
    metrics call it with the model (or its randomised copy), a batch and targets.

    Args:
        model: The model Quantus passes.
        inputs: ``(batch, ...)`` inputs.
        targets: One int, or one int per sample.
        method: Registered method name.
        device: Where to explain (Quantus passes ``device`` through); the model's by default.
        **options: Method options.

    Returns:
        The attribution, shaped like ``inputs``.
    """
    device = torch.device(device) if device is not None else _model_device(model)
    x = torch.as_tensor(np.asarray(inputs), dtype=_model_dtype(model), device=device)
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


def _require_module(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise InvalidInputError(
            f"model must be a torch.nn.Module; got {type(model).__name__}, so wrap it in an "
            "nn.Module whose forward calls it"
        )


def _as_tensor(value: Any, what: str) -> torch.Tensor:
    """``value`` (a NumPy array, nested lists) as a tensor, to pick rows from."""
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError):
        raise InvalidInputError(
            f"{what} must be a tensor, a number or an array of numbers; got {type(value).__name__}"
        ) from None


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter, else float32."""
    if isinstance(model, nn.Module):
        for parameter in model.parameters():
            if parameter.is_floating_point():
                return parameter.dtype
    return torch.float32


def _references(
    reference: torch.Tensor | None, inputs: torch.Tensor, engine: Method
) -> torch.Tensor | None:
    """The reference inputs the method runs the model on: the baselines, zeros by default."""
    if not engine.uses_baselines:
        return None
    return reference if reference is not None else torch.zeros_like(inputs[:1])


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
