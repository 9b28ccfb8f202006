"""The tensors a parse tree is built from: couplings and activations of every capsule layer.

Layers are numbered as the paper's ``Ω^[l]`` (REM, §2.1): layer 1 holds the input capsules of the
first routing layer (the primary capsules), layer ``L`` the output capsules of the last routing
layer (the classes). ``couplings[l-1]`` are the couplings ``c_ij^[l]`` from capsule ``i`` of layer
``l`` (a part, the child) to capsule ``j`` of layer ``l+1`` (the whole, the parent), normalised by
the routing softmax over the parents ``j``.

:class:`ParseTreeData` holds ``N`` samples as plain CPU tensors and is made from tensors
(:meth:`ParseTreeData.from_tensors`), from any capsule recording with ``layers`` and ``predicted``
(:meth:`ParseTreeData.from_recording`) or by running a model with routing layers
(:func:`collect_parse_tree_data`, built on
:func:`~explain_core.interfaces.routing.record_routing_batches`, the one capsule recorder). Nothing
here imports networkx.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from explain_core.eager import uncompiled
from explain_core.errors import InvalidInputError
from explain_core.interfaces.routing import RoutingLayer, record_routing_batches
from explain_core.quantisation import quantise_couplings

__all__ = [
    "LayerStack",
    "ParseTreeData",
    "check_record_inputs",
    "collect_parse_tree_data",
    "routing_parents",
]


def as_index(value: Any, what: str) -> int:
    """``value`` as an int if it is an integer: an int, a NumPy integer or a 0-d integer tensor.

    Raises:
        InvalidInputError: For anything else, floats and bools included (``2.7`` or ``True``
            would otherwise be read silently as class 2 or sample 1).
    """
    if isinstance(value, Tensor) and value.dim() == 0 and not not_integral(value.dtype):
        return int(value.item())
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    raise InvalidInputError(
        f"{what} must be an integer (an int, a NumPy integer or a 0-d integer tensor); got "
        f"{value!r}"
    )


def not_integral(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds no class indices: floating, complex or bool."""
    return dtype.is_floating_point or dtype.is_complex or dtype == torch.bool


def routing_parents(layer: nn.Module, n_out: int) -> int:
    """Over how many parents ``layer``'s routing softmax normalises each child's couplings.

    All ``n_out`` output capsules for fully connected routing. A layer routing every receptive
    field on its own says so by an int ``out_types`` attribute, as
    convolutional capsule layers do: each window's couplings are a softmax over
    its ``out_types`` capsules, so their uniform value is ``1/out_types``, not ``1/n_out``.
    """
    types = getattr(layer, "out_types", None)
    if isinstance(types, int) and not isinstance(types, bool) and 1 <= types <= n_out:
        return types
    return n_out


def check_record_inputs(model: nn.Module, inputs: Any) -> None:
    """Check, before the model runs, that ``inputs`` are a batch of samples the model can take.

    Raises:
        InvalidInputError: If ``inputs`` is not a tensor of at least one sample, is not floating
            point, or is of another floating dtype than the model's parameters (torch would say
            only "mat1 and mat2 must have the same dtype").
    """
    if not isinstance(inputs, Tensor):
        raise InvalidInputError(
            f"inputs must be a torch.Tensor of shape (N, ...); got {type(inputs).__name__}. "
            "Convert NumPy arrays with torch.from_numpy(array).float()"
        )
    if inputs.dim() < 1 or inputs.shape[0] == 0:
        raise InvalidInputError(
            f"inputs must hold at least one sample; got shape {tuple(inputs.shape)}"
        )
    if not inputs.is_floating_point():
        raise InvalidInputError(
            f"inputs must be floating point; got dtype {inputs.dtype}. Convert them, e.g. "
            "inputs.float() (integer images: inputs.float() / 255)"
        )
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    # Only a model of one dtype says unambiguously what its inputs must be.
    if len(dtypes) == 1 and inputs.dtype not in dtypes:
        (wanted,) = dtypes
        raise InvalidInputError(
            f"inputs are {inputs.dtype} but the parameters of {type(model).__name__} are "
            f"{wanted}; convert the inputs with inputs.to({wanted}) (or the model with "
            f"model.to({inputs.dtype}))"
        )


@dataclass(frozen=True)
class LayerStack:
    """Couplings and activations of every layer for one tree: one sample, or a mean over samples.

    Attributes:
        couplings: ``couplings[l-1]`` is ``(|Ω^l|, |Ω^{l+1}|)``, for ``l = 1 … L-1``.
        activations: ``activations[l-1]`` is ``(|Ω^l|,)``, the capsule lengths ``‖u‖``, for
            ``l = 1 … L``.
        n_samples: How many samples were averaged (1 for a single sample).
    """

    couplings: tuple[Tensor, ...]
    activations: tuple[Tensor, ...]
    n_samples: int = 1

    @property
    def sizes(self) -> list[int]:
        """Number of capsules ``|Ω^l|`` of every layer ``l = 1 … L``."""
        return [int(a.shape[0]) for a in self.activations]


@dataclass(frozen=True)
class ParseTreeData:
    """Couplings, activations and predictions of ``N`` samples (detached CPU tensors).

    Attributes:
        couplings: ``couplings[l-1]`` is ``(N, |Ω^l|, |Ω^{l+1}|)`` for ``l = 1 … L-1``.
        activations: ``activations[l-1]`` is ``(N, |Ω^l|)`` for ``l = 1 … L``.
        predicted: Predicted class per sample, int64 ``(N,)``.
        class_names: Names of the last layer's capsules, or ``None`` (their indices are used).
        levels: Number of quantisation levels ``K`` applied to the couplings, or ``None``.
        parents: Per routing layer, over how many parents each capsule's couplings are
            normalised (the routing softmax): ``|Ω^{l+1}|`` for fully connected routing, a
            window's capsule types for convolutional capsules; ``None`` means ``|Ω^{l+1}|``
            everywhere. The default edge thresholds are their uniform couplings.
    """

    couplings: tuple[Tensor, ...]
    activations: tuple[Tensor, ...]
    predicted: Tensor
    class_names: tuple[str, ...] | None = None
    levels: int | None = None
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _validate(self.couplings, self.activations, self.predicted, self.class_names)
        _validate_parents(self.parents, self.couplings)

    @classmethod
    def from_tensors(
        cls,
        couplings: Sequence[Tensor],
        activations: Sequence[Tensor],
        predicted: Tensor | None = None,
        *,
        class_names: Sequence[str] | None = None,
        levels: int | None = None,
        parents: Sequence[int] | None = None,
    ) -> ParseTreeData:
        """Build from per-layer tensors; a single sample may omit the batch axis.

        Args:
            couplings: ``L-1`` tensors ``(N, |Ω^l|, |Ω^{l+1}|)`` (or ``(|Ω^l|, |Ω^{l+1}|)``).
            activations: ``L`` tensors ``(N, |Ω^l|)`` (or ``(|Ω^l|,)``).
            predicted: ``(N,)`` classes; ``None`` takes the argmax of the last activations.
            class_names: Names of the last layer's capsules.
            levels: Quantise the couplings into ``K`` levels
                (:func:`explain_core.quantisation.quantise_couplings`).
            parents: Per routing layer, the number of parents of each routing softmax (see the
                class docstring); give it for convolutional capsules, whose windows route over
                their capsule types only.

        Raises:
            InvalidInputError: If the shapes do not chain or agree.
        """
        couplings = [torch.as_tensor(c).detach().cpu() for c in couplings]
        activations = [torch.as_tensor(a).detach().cpu() for a in activations]
        if couplings and all(c.dim() == 2 for c in couplings):
            couplings = [c[None] for c in couplings]
        if activations and all(a.dim() == 1 for a in activations):
            activations = [a[None] for a in activations]
        if levels is not None:
            couplings = [quantise_couplings(c, levels) for c in couplings]
        if predicted is None and activations:
            predicted = activations[-1].argmax(dim=1)
        predicted = torch.as_tensor(predicted).detach().cpu().long().reshape(-1)
        names = None if class_names is None else tuple(str(n) for n in class_names)
        softmax_sizes = None if parents is None else tuple(as_index(p, "parents") for p in parents)
        return cls(tuple(couplings), tuple(activations), predicted, names, levels, softmax_sizes)

    @classmethod
    def from_recording(
        cls, recording: Any, *, class_names: Sequence[str] | None = None
    ) -> ParseTreeData:
        """Build from a capsule recording (e.g. a capsule plugin's per-layer record).

        The recording needs ``layers`` (routing layers in forward order, each with
        ``couplings (N, n_in, n_out)``, ``input_activations (N, n_in)`` and
        ``output_activations (N, n_out)``, optionally ``parents``, the size of its routing
        softmax), ``predicted (N,)`` and optionally ``levels``. Layer ``l``'s activations are
        the inputs of routing layer ``l``; the last layer's are the outputs of the last routing
        layer.

        Raises:
            InvalidInputError: If the object lacks these fields or the layers do not chain.
        """
        if isinstance(recording, ParseTreeData):
            return recording if class_names is None else recording.with_class_names(class_names)
        layers = getattr(recording, "layers", None)
        if not layers or not hasattr(recording, "predicted"):
            raise InvalidInputError(
                f"expected a capsule recording with .layers and .predicted (e.g. a capsule "
                f"plugin's recording of parse-tree data); got {type(recording).__name__}"
            )
        try:
            couplings = [layer.couplings for layer in layers]
            activations = [layer.input_activations for layer in layers]
            activations.append(layers[-1].output_activations)
        except AttributeError as error:
            raise InvalidInputError(
                f"the recording's layers need couplings, input_activations and "
                f"output_activations: {error}"
            ) from None
        names = None if class_names is None else tuple(str(n) for n in class_names)
        return cls(
            tuple(c.detach().cpu() for c in couplings),
            tuple(a.detach().cpu() for a in activations),
            torch.as_tensor(recording.predicted).detach().cpu().long().reshape(-1),
            names,
            getattr(recording, "levels", None),
            _recorded_parents(layers),
        )

    @property
    def n_samples(self) -> int:
        """Number of samples ``N``."""
        return int(self.predicted.shape[0])

    @property
    def n_layers(self) -> int:
        """Number of capsule layers ``L`` (routing layers plus one)."""
        return len(self.activations)

    @property
    def sizes(self) -> list[int]:
        """Number of capsules ``|Ω^l|`` of every layer ``l = 1 … L``."""
        return [int(a.shape[1]) for a in self.activations]

    def class_name(self, index: int) -> str:
        """Name of class capsule ``index`` (its index as text without class names)."""
        return self.class_names[index] if self.class_names is not None else str(index)

    def with_class_names(self, class_names: Sequence[str]) -> ParseTreeData:
        """A copy with names for the last layer's capsules."""
        return replace(self, class_names=tuple(str(n) for n in class_names))

    def quantised(self, levels: int) -> ParseTreeData:
        """A copy with couplings quantised into ``K = levels`` levels (REM's ``c̃``)."""
        return replace(
            self,
            couplings=tuple(quantise_couplings(c, levels) for c in self.couplings),
            levels=levels,
        )

    def sample(self, index: int) -> LayerStack:
        """The tensors of one sample (an int, NumPy integer or 0-d integer tensor; may be < 0).

        Raises:
            InvalidInputError: If ``index`` is not an integer or is out of range.
        """
        index = self.sample_index(index)
        return LayerStack(
            tuple(c[index] for c in self.couplings), tuple(a[index] for a in self.activations)
        )

    def sample_index(self, index: Any) -> int:
        """``index`` as an index in ``[0, N)``; negative ones count from the end.

        Raises:
            InvalidInputError: If ``index`` is not an integer or is out of range.
        """
        index = as_index(index, "sample index")
        if not -self.n_samples <= index < self.n_samples:
            raise InvalidInputError(
                f"sample index {index} is out of range for {self.n_samples} recorded samples"
            )
        return index % self.n_samples

    def mean(self, mask: Tensor | None = None) -> LayerStack:
        """Couplings and activations averaged over all samples, or those where ``mask`` is true.

        Raises:
            InvalidInputError: If no sample is selected.
        """
        if mask is None:
            mask = torch.ones(self.n_samples, dtype=torch.bool)
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
        if mask.shape[0] != self.n_samples:
            raise InvalidInputError(
                f"mask has {mask.shape[0]} entries but {self.n_samples} samples were recorded"
            )
        count = int(mask.sum())
        if count == 0:
            raise InvalidInputError("no sample is selected; cannot average over zero samples")
        return LayerStack(
            tuple(c[mask].double().mean(0).float() for c in self.couplings),
            tuple(a[mask].double().mean(0).float() for a in self.activations),
            count,
        )


def collect_parse_tree_data(
    model: nn.Module,
    inputs: Tensor,
    *,
    levels: int | None = None,
    batch_size: int = 256,
    class_names: Sequence[str] | None = None,
) -> ParseTreeData:
    """Run ``model`` over ``inputs`` and collect every routing layer's couplings and activations.

    Works for any model whose capsule layers derive from
    :class:`~explain_core.interfaces.routing.RoutingLayer` and call each routing layer once per
    forward pass, in a chain (layer ``k``'s outputs are layer ``k+1``'s inputs); layers are taken
    in the order the forward pass calls them. The model runs under ``torch.no_grad`` in eval
    mode and is left exactly as it was (training flags and attributes a forward pass sets, such
    as a capsule grid's shape, are restored).

    Args:
        model: A capsule network returning ``(batch, classes)`` scores.
        inputs: ``(N, ...)`` floating-point inputs of the model's dtype.
        levels: Round the *collected* couplings into ``K`` levels (REM's ``c̃``). Only the
            copies are rounded: the model still routes with its own couplings, so predictions,
            activations and the couplings of later layers are those of the unquantised model.
            For REM's "+Q" model, which routes with quantised couplings, run this inside
            the capsule plugin's quantised routing (REM's +Q model).
        batch_size: Samples per forward pass.
        class_names: Names of the class capsules.

    Raises:
        InvalidInputError: If the model has no routing layer, the inputs are not floating point
            or not of the model's dtype, the routing layers do not form a chain, or the output is
            not ``(batch, classes)``.
    """
    if not any(isinstance(m, RoutingLayer) for m in model.modules()):
        raise InvalidInputError(
            f"{type(model).__name__} has no routing layers (modules deriving from "
            "explain_core.RoutingLayer); parse trees need a capsule network"
        )
    check_record_inputs(model, inputs)
    routed = record_routing_batches(model, inputs, batch_size=batch_size)
    order = list(routed.layers)
    couplings = [routed.layers[name].couplings for name in order]
    activations = [routed.layers[name].input_activations for name in order]
    activations.append(routed.layers[order[-1]].output_activations)
    for k in range(len(order) - 1):
        if couplings[k].shape[2] != couplings[k + 1].shape[1]:
            raise InvalidInputError(
                f"routing layers {order[k]!r} ({couplings[k].shape[2]} outputs) and "
                f"{order[k + 1]!r} ({couplings[k + 1].shape[1]} inputs) do not form a chain; "
                "parse trees need consecutive capsule layers"
            )
    modules = dict(uncompiled(model).named_modules())
    parents = [
        routing_parents(modules[name], int(c.shape[2]))
        for name, c in zip(order, couplings, strict=True)
    ]
    predicted = routed.outputs.argmax(dim=1)
    return ParseTreeData.from_tensors(
        couplings,
        activations,
        predicted,
        class_names=class_names,
        levels=levels,
        parents=parents,
    )


def _recorded_parents(layers: Sequence[Any]) -> tuple[int, ...] | None:
    """The routing softmax sizes a recording's layers report (``n_out`` where one does not)."""
    reported = [getattr(layer, "parents", None) for layer in layers]
    if all(p is None for p in reported):
        return None
    return tuple(
        int(layer.couplings.shape[2]) if p is None else int(p)
        for layer, p in zip(layers, reported, strict=True)
    )


def _validate_parents(parents: Sequence[int] | None, couplings: Sequence[Tensor]) -> None:
    if parents is None:
        return
    if len(parents) != len(couplings):
        raise InvalidInputError(
            f"parents needs one value per routing layer ({len(couplings)}); got {len(parents)}"
        )
    for k, (p, c) in enumerate(zip(parents, couplings, strict=True)):
        n_out = int(c.shape[-1])
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= n_out:
            raise InvalidInputError(
                f"parents of routing layer {k + 1} must be an int in [1, {n_out}] (the size of "
                f"its routing softmax); got {p!r}"
            )


def _validate(
    couplings: Sequence[Tensor],
    activations: Sequence[Tensor],
    predicted: Tensor,
    class_names: Sequence[str] | None,
) -> None:
    if len(couplings) < 1 or len(activations) != len(couplings) + 1:
        raise InvalidInputError(
            f"a parse tree needs L-1 ≥ 1 coupling tensors and L activation tensors; got "
            f"{len(couplings)} and {len(activations)}"
        )
    n = int(predicted.shape[0]) if predicted.dim() == 1 else -1
    for k, c in enumerate(couplings):
        a_in, a_out = activations[k], activations[k + 1]
        if (
            c.dim() != 3
            or a_in.shape != (n, c.shape[1])
            or a_out.dim() != 2
            or a_out.shape != (n, c.shape[2])
        ):
            raise InvalidInputError(
                f"layer {k + 1}: couplings {tuple(c.shape)} need activations ({n}, n_in) and "
                f"({n}, n_out) matching predictions ({n},); got {tuple(a_in.shape)} and "
                f"{tuple(a_out.shape)}"
            )
    if n == 0:
        raise InvalidInputError("parse-tree data needs at least one sample")
    classes = int(activations[-1].shape[1])
    if class_names is not None and len(class_names) != classes:
        raise InvalidInputError(
            f"{len(class_names)} class names given for {classes} class capsules"
        )
    if predicted.numel() and (int(predicted.min()) < 0 or int(predicted.max()) >= classes):
        raise InvalidInputError(f"predicted classes must lie in [0, {classes - 1}]")
