"""The engine that runs modified backpropagation on ordinary PyTorch models.

**Signal convention.** Everything flows backwards as a *signal* ``s`` shaped like the tensor it
belongs to, with relevance ``R = h ⊙ s`` for an activation ``h`` (for DeepLIFT ``Δh ⊙ s``: the
signal is DeepLIFT's multiplier). In this convention the ordinary gradient already is LRP-0 for
every linear operation without parameters: ReLU, max pooling (winner takes all), average pooling,
sums of branches (residual additions), concatenation, flatten/view and dropout in eval mode all
redistribute relevance exactly and conserve it. Only layers with weights need rules: each ruled
Linear/Conv (merged with the BatchNorm that follows it by the composite's canonizer, without
touching the model) returns the same output values through a small autograd function whose
backward is the rule, computed from the tensors saved in the forward pass (one transposed
convolution per weight variant; no module is run again). On a layer only a ReLU reads, rules may
read that ReLU's output instead of keeping anything the size of the layer's output
(:meth:`~explain_core.interfaces.relevance.AffineRule.reads_rectified_output`).

**Checks.** Before attaching anything the engine traces the model once on the first sample with a
:class:`~torch.overrides.TorchFunctionMode`: every operation on input-dependent tensors outside a
ruled module must be one of the operations above; a ruled module called twice, a Linear/Conv
without a rule, a BatchNorm that cannot be merged and any other operation (a sigmoid, a
``F.linear`` in ``forward``, a product of two activations) raise :class:`UnsupportedModelError`
naming the module path and type and how to register a rule. Nothing falls back to the gradient
silently.

**Layers.** :meth:`ModifiedBackprop.forward` returns a :class:`ForwardPass` whose
:meth:`~ForwardPass.backward` starts from the output or injects a signal or a relevance at any
affine layer ``k`` and reads the signal at the input of every layer below it (what the CSC metric
needs), for a pass run with ``record=True``: the records keep every layer's input and output,
which a plain pass lets the model free.

**Modules.** The parts live in their own modules: :class:`~explain_core.engine.Composite` in
:mod:`.composite`, the operation sets and :class:`OpHandler` in :mod:`.ops`,
the trace in :mod:`.tracing`, the plan cache in :mod:`.plan_cache` and the hooks of one pass in
:mod:`.attach`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from explain_core.eager import eager_mode
from explain_core.engine.attach import (
    LayerRecord,
    OperationMode,
    RulePass,
    masks_rectified_outputs,
)
from explain_core.engine.ops import OpHandler
from explain_core.engine.plan_cache import expected_calls, forget_plan, planned
from explain_core.engine.tracing import Plan
from explain_core.errors import InvalidInputError, UnsupportedModelError
from explain_core.model_guard import require_eval_mode
from explain_core.scoped import listening
from explain_core.validation import CUT_PATH
from explain_core.vjp import vjp

if TYPE_CHECKING:
    from explain_core.engine.composite import Composite

__all__ = ["BackwardResult", "ForwardPass", "ModifiedBackprop"]


@dataclass
class BackwardResult:
    """Signals after one backward pass.

    Attributes:
        input_signal: Signal at the model input (relevance if ``input_is_relevance``).
        layer_signals: Layer name → signal at that layer's input (only when read).
        input_is_relevance: The input layer's rule returned relevance (w², flat, z^B).
    """

    input_signal: torch.Tensor
    layer_signals: dict[str, torch.Tensor]
    input_is_relevance: bool


@dataclass
class ForwardPass:
    """A forward pass with rules attached; the model itself is already restored.

    Attributes:
        input: The tensor fed to the model (requires grad; for DeepLIFT input and reference).
        output: The model output (part of the graph).
        records: Every affine layer in execution order, for a pass run with ``record=True``
            (else empty: a record keeps its layer's input and output alive).
        plan: What the trace found.
    """

    input: torch.Tensor
    output: torch.Tensor
    records: dict[str, LayerRecord]
    plan: Plan

    @property
    def layers(self) -> list[str]:
        """Names of the recorded layers, input side first."""
        return list(self.records)

    def backward(
        self,
        signal: torch.Tensor | None = None,
        *,
        start: str | None = None,
        relevance: torch.Tensor | None = None,
        read_layers: bool = False,
        retain_graph: bool = False,
    ) -> BackwardResult:
        """Propagate backwards and return the signal at the input (and at every lower layer).

        Args:
            signal: Signal at the model output (``start=None``) or at layer ``start``'s output.
            start: Inject at the output of this recorded layer instead of the model output
                (the pass must have been run with ``record=True``).
            relevance: Inject relevance (not a signal) at ``start``'s output; it passes through
                that layer's rule first.
            read_layers: Also return the signal at the input of every recorded layer below (and
                at ``start``'s own input).
            retain_graph: Keep the graph (and the records) for another backward pass; without
                it the pass is spent: each rule's tensors are freed once it has run, as
                autograd frees what it saved, and the records are cleared.

        Raises:
            KeyError: If ``start`` is not a recorded layer.
            InvalidInputError: If ``start`` or ``read_layers`` is given for a pass that recorded
                no layers.
        """
        names = list(self.records)
        if (start is not None or read_layers) and not names:
            raise InvalidInputError(
                "this pass recorded no layers, so it cannot start at or read one: run it with "
                "ModifiedBackprop(composite, record=True) (records keep every layer's input and "
                "output until the backward pass)"
            )
        if start is None:
            below = names
            outputs, grads = self.output, signal
        else:
            if start not in self.records:
                raise KeyError(f"no recorded layer {start!r}; recorded: {', '.join(names)}")
            record = self.records[start]
            below = names[: names.index(start)]
            if relevance is not None:
                with torch.no_grad():
                    (grads,) = record.rule.relevance(record.call, relevance)
                outputs = record.input
            else:
                _require_rectified_signal(record, signal)
                outputs, grads = record.output, signal
        wanted: list[torch.Tensor] = [self.input]
        keys: list[str] = [""]
        if read_layers:
            for name in below:
                wanted.append(self.records[name].input)
                keys.append(name)
            if start is not None:
                wanted.append(self.records[start].input)
                keys.append(start)
        unique: dict[int, torch.Tensor] = {}
        for tensor in wanted:
            unique.setdefault(id(tensor), tensor)
        tensors = list(unique.values())
        if not retain_graph:  # the pass is spent; its records would hold every layer to the end
            self.records.clear()
        results = vjp(outputs, tensors, grads, allow_unused=True, retain_graph=retain_graph)
        by_id = {
            id(t): (g if g is not None else torch.zeros_like(t))
            for t, g in zip(tensors, results, strict=True)
        }
        signals = {key: by_id[id(t)] for key, t in zip(keys, wanted, strict=True)}
        input_signal = signals.pop("")
        return BackwardResult(input_signal, signals, self.plan.input_relevance_form)


class ModifiedBackprop:
    """Runs a model with a composite's rules (and an operation handler) attached.

    Args:
        composite: Maps modules, layer positions and operations to rules.
        handler: Changes ReLU/max-pool/addition backward passes (Guided BP, DeepLIFT, …).
        record: Record every affine layer, keeping its input and output, for reading and injecting
            signals at intermediate layers.
        extra_ops: Further operation names the trace accepts (the handler's own).
        cache: Reuse the trace of an earlier call with the same model structure (validated on
            every call and against the modules actually run; see :func:`planned`).
    """

    def __init__(
        self,
        composite: Composite,
        handler: OpHandler | None = None,
        *,
        record: bool = False,
        extra_ops: frozenset[str] = frozenset(),
        cache: bool = True,
    ) -> None:
        self.composite = composite
        self.handler = handler
        self.record = record
        self.cache = cache
        self.extra_ops = (
            extra_ops | composite.op_kinds | (handler.ops if handler is not None else frozenset())
        )

    def forward(self, model: nn.Module, inputs: torch.Tensor, *, grad: bool = True) -> ForwardPass:
        """Trace, attach rules, run the forward pass and restore the model.

        The returned pass holds the autograd graph; call :meth:`ForwardPass.backward`. With
        ``grad=False`` no graph is built (for rules that only collect statistics).

        Raises:
            ModelStateError: If a BatchNorm or Dropout is in training mode (the trace would
                update its running statistics).
            UnsupportedModelError: For what the rules cannot propagate through.
        """
        require_eval_mode(model)
        for use_cache in (self.cache, False):
            with contextlib.ExitStack() as stack:
                plan, cached = planned(
                    model, inputs, self.composite, self.extra_ops, cache=use_cache
                )
                if plan.input_masks and self.handler is not None:
                    _refuse_input_masks(plan, self.handler)
                attached = RulePass(model, plan, self.record)
                calls = attached.count_calls() if cached else {}
                if plan.custom:  # their rules' hooks must run as written, not be traced
                    stack.enter_context(eager_mode())
                stack.enter_context(listening(attached))
                x = inputs.detach()
                if self.handler is not None:
                    x = self.handler.start(x, attached.records)
                x = x.requires_grad_(grad)
                attached.input = x
                with torch.set_grad_enabled(grad):
                    handled = self.handler is not None and self.handler.ops
                    if (
                        self.composite.op_kinds
                        or handled
                        or plan.decomposed
                        or plan.rectified
                        or plan.input_arranged  # noted for the input layer's rule
                    ):
                        with OperationMode(self.composite, self.handler, attached):
                            output = model(x)
                    else:
                        output = model(x)
            if not cached or calls == expected_calls(plan):
                break
            forget_plan(model)  # the model ran other modules than planned: trace again
        if grad and isinstance(output, torch.Tensor) and not output.requires_grad:
            raise UnsupportedModelError(CUT_PATH.format(signal="relevance"))
        return ForwardPass(x, output, attached.records, plan)


def _refuse_input_masks(plan: Plan, handler: OpHandler) -> None:
    """Refuse a mask of the input where the pass compares the input with a reference.

    Raises:
        UnsupportedModelError: Naming the operation and the way to pass the mask as given.
    """
    if not handler.compares_with_reference:
        return
    raise UnsupportedModelError(
        f"{plan.input_masks[0]} computes a mask from the model input (its padding, the lengths "
        "of its sequences, say), which differs between the input and the reference the method "
        "compares it with, so the differences it explains would include the mask's own. Pass "
        "the mask (or the lengths) as an input of its own, held as given for both: "
        "explain_inputs(model, {'x': x, 'mask': mask}, method, target, explained='x'); or "
        "explain with a method without a reference (the lrp presets, the gradient methods)"
    )


def _require_rectified_signal(record: LayerRecord, signal: torch.Tensor) -> None:
    """A signal injected at a rectified layer's output must be 0 where a ReLU would stop it.

    A rule that gives the outputs ``<= 0`` of such a layer no signal (only a ReLU reads them, so
    no signal reaches them in a pass through the model) kept no state for them.
    """
    if not masks_rectified_outputs(record.rule, record.call):
        return
    if bool((signal * (record.output.detach() <= 0)).any()):
        raise InvalidInputError(
            f"layer {record.name!r} is read only by a ReLU, so its rule {record.rule!r} keeps "
            "nothing for outputs <= 0 and the signal injected there must be 0 where the "
            "output is <= 0 (as the ReLU's gradient is); inject relevance instead "
            "(backward(start=..., relevance=...)), or a signal masked by output > 0"
        )
