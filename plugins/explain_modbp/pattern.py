"""PatternNet and PatternAttribution (Kindermans et al. 2018) with patterns fitted from data.

For each affine layer (a Linear/Conv merged with its BatchNorm) and output ``j`` with weights
``w_j``, the pattern is ``a_j = cov[x, y_j] / (w_jᵀ cov[x, y_j])`` where ``y_j = w_jᵀx + b_j``;
for a linear layer this is the paper's Eq. 9, ``cov[h] w / (wᵀ cov[h] w)``. Estimators:

- ``"linear"`` (``S_a``): covariances over all samples (and positions, for convolutions);
- ``"two_component"`` (``S_{a+-}``): for layers followed by a ReLU, covariances over the samples
  with ``y_j > 0`` only (the positive regime, the only one a ReLU passes on); the linear pattern
  for the other layers (e.g. the output layer).

Statistics are streamed over a DataLoader (or any iterable of batches) in float64: the sums
``Σ x⊗y``, ``Σ x``, ``Σ y`` and counts, each computed as one weight-gradient convolution per batch
(no unfolding of patches). Backwards, ReLUs and pooling pass the gradient and each layer's
weights are replaced: PatternNet ``r_l = A_lᵀ r_{l+1}`` (the signal), PatternAttribution
``r_l = (W_l ⊙ A_l)ᵀ r_{l+1}``. Patterns save to and load from safetensors files that record the
architecture, so patterns of a different model are refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from explain_core.affine import BATCHNORM_TYPES, LINEAR_TYPES, AffineLayer
from explain_core.eager import eager_mode, uncompiled
from explain_core.engine import Composite, ForwardPass, ModifiedBackprop
from explain_core.errors import InvalidInputError, UnsupportedModelError
from explain_core.interfaces.relevance import AffineRule, RuleCall, safe_divide
from explain_core.model_guard import require_eval_mode
from explain_core.registry import Method, MethodResult, MethodSpec
from explain_core.targets import select_target
from explain_core.validation import check_inputs
from explain_modbp.composites import gradient_composite
from explain_modbp.errors import PatternMismatchError
from explain_modbp.methods import one_hot

Estimator = Literal["linear", "two_component"]
FORMAT = "explain-modbp-patterns/1"


@dataclass
class _Moments:
    """Streaming sums for one layer, over all outputs and over the positive regime."""

    xy: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    n: torch.Tensor
    xy_pos: torch.Tensor
    x_pos: torch.Tensor
    y_pos: torch.Tensor
    n_pos: torch.Tensor
    weight: torch.Tensor
    kind: str

    @classmethod
    def zeros(cls, layer: AffineLayer) -> _Moments:
        weight = layer.weight.detach().double()
        out = weight.shape[0]
        z = weight.new_zeros
        return cls(z(weight.shape), z(weight.shape), z(out), z(out), z(weight.shape),
                   z(weight.shape), z(out), z(out), weight, layer.kind)  # fmt: skip

    def add(self, layer: AffineLayer, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        double = dataclasses.replace(layer, weight=self.weight, bias=None)
        positive = (y > 0).double()
        ones = torch.ones_like(y)
        self.xy += double.correlate(x, y)
        self.x += double.correlate(x, ones)
        self.y += _channel_sum(layer, y)
        self.n += _channel_sum(layer, ones)
        self.xy_pos += double.correlate(x, y * positive)
        self.x_pos += double.correlate(x, positive)
        self.y_pos += _channel_sum(layer, y * positive)
        self.n_pos += _channel_sum(layer, positive)

    def pattern(self, positive: bool) -> torch.Tensor:
        xy, x, y, n = (
            (self.xy_pos, self.x_pos, self.y_pos, self.n_pos)
            if positive
            else (self.xy, self.x, self.y, self.n)
        )
        shape = (-1,) + (1,) * (self.weight.dim() - 1)
        count = n.clamp(min=1).reshape(shape)
        covariance = xy / count - (x / count) * (y.reshape(shape) / count)
        if self.weight.dim() == 1:
            scale = self.weight * covariance
        else:
            scale = (self.weight * covariance).flatten(1).sum(1)
        return safe_divide(covariance, scale.reshape(shape))


def _channel_sum(layer: AffineLayer, t: torch.Tensor) -> torch.Tensor:
    if layer.kind == "linear":
        return t.reshape(-1, t.shape[-1]).sum(0)
    return t.sum([d for d in range(t.dim()) if d != 1])


@dataclass
class Patterns:
    """Fitted patterns, one per affine layer, shaped like its (merged) weight.

    Attributes:
        patterns: Layer name → pattern.
        estimator: ``"linear"`` or ``"two_component"``.
        layers: Layer name → ``[module type, weight shape]`` of the model they were fitted on.
        samples: Number of samples seen.
    """

    patterns: dict[str, torch.Tensor]
    estimator: str
    layers: dict[str, list[Any]] = field(default_factory=dict)
    samples: int = 0

    def save(self, path: str | Path) -> None:
        """Write a safetensors file (tensors plus the architecture as metadata)."""
        from safetensors.torch import save_file

        metadata = {
            "format": FORMAT,
            "estimator": self.estimator,
            "layers": json.dumps(self.layers),
            "samples": str(self.samples),
        }
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.patterns.items()}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> Patterns:
        """Read patterns written by :meth:`save`.

        Raises:
            InvalidInputError: If the file is missing or holds no patterns.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise InvalidInputError(f"no patterns file at {str(path)!r}; fit and save them first")
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        except Exception as error:
            raise InvalidInputError(f"{str(path)!r} is not a safetensors file: {error}") from None
        if metadata.get("format") != FORMAT:
            raise InvalidInputError(
                f"{str(path)!r} holds no explain-modbp patterns (format "
                f"{metadata.get('format')!r}, expected {FORMAT!r})"
            )
        return cls(
            tensors,
            metadata["estimator"],
            json.loads(metadata["layers"]),
            int(metadata.get("samples", 0)),
        )


def _batches(data: Any, batch_size: int) -> Iterable[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield from data.split(batch_size)
        return
    for batch in data:
        if isinstance(batch, (tuple, list)):
            batch = batch[0]
        if isinstance(batch, dict):
            raise InvalidInputError(
                "pattern fitting needs batches of tensors or (inputs, …) tuples"
            )
        yield batch


def fit_patterns(
    model: nn.Module,
    data: torch.Tensor | Iterable[Any],
    *,
    estimator: Estimator = "two_component",
    max_batches: int | None = None,
    batch_size: int = 256,
) -> Patterns:
    """Estimate the patterns of every affine layer from data.

    Args:
        model: The model, in eval mode (it is left unchanged).
        data: A tensor of inputs, or an iterable (e.g. a DataLoader) of input tensors or of
            ``(inputs, labels, …)`` tuples.
        estimator: ``"two_component"`` (positive regime for layers followed by a ReLU) or
            ``"linear"``.
        max_batches: Stop after this many batches.
        batch_size: Batch size when ``data`` is a tensor.

    Raises:
        InvalidInputError: For an unknown estimator, empty data, or a batch that is not a
            finite floating-point tensor on the model's device.
        ModelRunError: For a batch of another dtype than the model's.
    """
    if estimator not in ("linear", "two_component"):
        raise InvalidInputError(f"estimator must be 'linear' or 'two_component'; got {estimator!r}")
    model = uncompiled(model)  # a torch.compile wrapper: the module it runs, as explain() does
    require_eval_mode(model)
    _refuse_recurrent(model)
    engine = ModifiedBackprop(gradient_composite("fit_patterns"), record=True)
    moments: dict[str, _Moments] = {}
    dtypes: dict[str, torch.dtype] = {}
    plan = None
    samples = 0
    for index, batch in enumerate(_batches(data, batch_size)):
        if max_batches is not None and index >= max_batches:
            break
        batch = check_inputs(batch, model, name="pattern data")  # dtype, device, finite
        with torch.no_grad(), eager_mode():  # compiled submodules run as their eager selves
            forward = engine.forward(model, batch, grad=False)
        for name, record in forward.records.items():
            layer = record.call.layer
            assert layer is not None
            if layer.kind == "conv_transpose":
                raise UnsupportedModelError(
                    f"module {name!r} ({type(model.get_submodule(name)).__name__}) is a "
                    "transposed convolution, for which PatternNet's patterns are not defined "
                    "(Kindermans et al. estimate them for dense and convolutional layers); "
                    "explain this model with an LRP preset or a gradient method"
                )
            if name not in moments:
                moments[name] = _Moments.zeros(layer)
                # the layer's weight as the pass saw it: a BatchNorm without affine has none
                dtypes[name] = layer.weight.dtype
            moments[name].add(layer, record.call.inputs[0], record.call.output)
        plan = forward.plan
        samples += batch.shape[0]
    if plan is None:
        raise InvalidInputError("no data to fit patterns on")
    patterns: dict[str, torch.Tensor] = {}
    layers: dict[str, list[Any]] = {}
    for name in plan.order:
        positive = estimator == "two_component" and name in plan.relu_after
        patterns[_plain(name)] = moments[name].pattern(positive).to(dtypes[name])
        layers[_plain(name)] = [plan.types[name], list(moments[name].weight.shape)]
    return Patterns(patterns, estimator, layers, samples)


def _refuse_recurrent(model: nn.Module) -> None:
    """Refuse a recurrent layer before reading data: its cells' linear maps get no patterns."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) is a recurrent layer, for which "
                "PatternNet's patterns are not defined (Kindermans et al. estimate them for dense "
                "and convolutional layers fed by the data); explain recurrent nets with the LRP "
                "presets (lrp.epsilon, lrp.epsilon_plus, lrp.attn) or the gradient methods"
            )


def _plain(name: str) -> str:
    """A layer's name without the ``_orig_mod`` of compiled submodules: one pattern for both."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


class PatternRule(AffineRule):
    """Backward with the pattern (PatternNet) or the pattern times the weight (attribution).

    Raises:
        PatternMismatchError: If a layer has no pattern or one of another shape.
    """

    def __init__(self, patterns: Patterns, attribution: bool) -> None:
        self.patterns = patterns
        self.attribution = attribution

    def forward(self, call: RuleCall) -> torch.Tensor:  # noqa: D102
        layer, _, _ = self.affine(call)
        pattern = self.patterns.patterns.get(_plain(layer.name))
        if pattern is None or pattern.shape != layer.weight.shape:
            got = "no pattern" if pattern is None else f"a pattern of shape {tuple(pattern.shape)}"
            raise PatternMismatchError(
                f"the patterns were fitted on a different architecture: layer {layer.name!r} "
                f"(weight {tuple(layer.weight.shape)}) has {got}; fit patterns for this model "
                "with fit_patterns(model, data)"
            )
        pattern = pattern.to(layer.weight)
        return pattern * layer.weight if self.attribution else pattern

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        return (layer.transpose(grad_output, x, call.state),)


def _method_name(attribution: bool) -> str:
    return "pattern_attribution" if attribution else "patternnet"


def _resolve(patterns: Patterns | str | Path | None, method: str) -> Patterns:
    if patterns is None:
        raise InvalidInputError(
            f"{method} needs patterns fitted from data: patterns = fit_patterns(model, loader), "
            f"then explain(model, x, {method!r}, patterns=patterns) (or a saved file's path)"
        )
    if isinstance(patterns, (str, Path)):
        return Patterns.load(patterns)
    if not isinstance(patterns, Patterns):
        raise InvalidInputError(
            f"patterns must be Patterns or a path; got {type(patterns).__name__}"
        )
    return patterns


def pattern_forward(
    model: nn.Module, inputs: torch.Tensor, patterns: Patterns, attribution: bool, record: bool
) -> ForwardPass:
    """The forward pass with pattern rules attached, after checking the patterns fit."""
    composite = Composite(
        [(LINEAR_TYPES + BATCHNORM_TYPES, PatternRule(patterns, attribution))],
        name=_method_name(attribution),
    )
    forward = ModifiedBackprop(composite, record=record).forward(model, inputs)
    extra = sorted(set(patterns.patterns) - {_plain(name) for name in forward.plan.order})
    if extra:
        raise PatternMismatchError(
            "the patterns were fitted on a different architecture: they hold layers the model "
            f"does not have or does not use ({', '.join(map(repr, extra[:5]))})"
        )
    for name, (type_name, _shape) in patterns.layers.items():
        if forward.plan.types.get(name, type_name) != type_name:
            raise PatternMismatchError(
                f"the patterns were fitted on a different architecture: layer {name!r} was a "
                f"{type_name}, the model has a {forward.plan.types[name]}"
            )
    return forward


def pattern_propagator(model, inputs, patterns: Patterns, attribution: bool):
    """Signals from any layer with the patterns (for CSC)."""
    from explain_modbp.propagation import EnginePropagator

    forward = pattern_forward(model, inputs, patterns, attribution, record=True)
    return EnginePropagator(forward, "signal", method=_method_name(attribution))


def pattern_signal(
    model: nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor | None,
    patterns: Patterns,
    attribution: bool,
) -> MethodResult:
    """Backpropagate the explained output with the patterns."""
    forward = pattern_forward(model, inputs, patterns, attribution, record=False)
    output = forward.output.detach()
    chosen = select_target(output, target)
    signal = forward.backward(one_hot(output, chosen)).input_signal
    return MethodResult(signal, output, chosen, None, {"estimator": patterns.estimator})


@dataclass
class _PatternMethod(Method):
    """Shared body of PatternNet and PatternAttribution.

    Attributes:
        patterns: Fitted :class:`Patterns`, or the path of a saved patterns file.
    """

    patterns: Patterns | str | Path | None = None
    attribution: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.patterns = _resolve(self.patterns, _method_name(self.attribution))

    def attribute(self, model, inputs, target, baselines) -> MethodResult:
        return pattern_signal(model, inputs, target, self.patterns, self.attribution)  # type: ignore[arg-type]

    def layer_propagator(self, model, inputs, baselines):
        return pattern_propagator(model, inputs, self.patterns, self.attribution)  # type: ignore[arg-type]


@dataclass
class PatternNet(_PatternMethod):
    """PatternNet: the signal ``A_lᵀ r_{l+1}`` backwards (with the ReLU masks).

    Attributes:
        patterns: Fitted :class:`Patterns`, or the path of a saved patterns file.
    """

    attribution: ClassVar[bool] = False


@dataclass
class PatternAttribution(_PatternMethod):
    """PatternAttribution: ``(W_l ⊙ A_l)ᵀ r_{l+1}`` backwards (with the ReLU masks).

    Attributes:
        patterns: Fitted :class:`Patterns`, or the path of a saved patterns file.
    """

    attribution: ClassVar[bool] = True


def method_specs(spec: Callable[[str, object, str], MethodSpec]) -> list[MethodSpec]:
    """The registered names of this module."""
    return [
        spec("patternnet", PatternNet, "PatternNet: patterns Aᵀ backwards (patterns=fitted)"),
        spec(
            "pattern_attribution",
            PatternAttribution,
            "PatternAttribution: (W⊙A)ᵀ backwards (patterns=fitted)",
        ),
    ]
