"""Vector-Jacobian products, as ``torch.autograd.grad`` computes them, without its slow first call.

Given a tensor ``grad_outputs``, ``torch.autograd.grad`` imports torch's symbolic-shapes module
(and with it SymPy) on first use, to compare shapes: ≈ 0.4 s and 34 MB of resident memory that
a process's first explanation would pay (torch 2.13, measured on this project's CPU machine).
:func:`vjp` differentiates ``Σ_k ⟨output_k, grad_k⟩`` instead, which gives the same values bit
for bit (the sum hands each product ones, the product's backward multiplies them by ``grad_k``),
and compares the shapes itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from explain_core.errors import InvalidInputError

__all__ = ["vjp"]


def vjp(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    grad_outputs: torch.Tensor | Sequence[torch.Tensor] | None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, ...)``, the same values.

    Args:
        outputs: Differentiated tensors.
        inputs: Tensors the products are taken with respect to.
        grad_outputs: One tensor per output, shaped like it (``None``: scalar outputs, whose
            gradients need no import).
        retain_graph: Keep the graph (default: ``create_graph``).
        create_graph: Build the graph of the products (for higher derivatives).
        allow_unused: Return ``None`` for inputs the outputs do not depend on.

    Raises:
        InvalidInputError: If the numbers or shapes of ``outputs`` and ``grad_outputs`` differ
            (a ``ValueError``; torch raises a ``RuntimeError`` there).
    """
    if grad_outputs is None:
        return torch.autograd.grad(
            outputs, inputs, None, retain_graph, create_graph, allow_unused=allow_unused
        )
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    grads = (grad_outputs,) if isinstance(grad_outputs, torch.Tensor) else tuple(grad_outputs)
    if len(outputs) != len(grads):
        raise InvalidInputError(f"{len(outputs)} outputs but {len(grads)} grad_outputs")
    for index, (output, grad) in enumerate(zip(outputs, grads, strict=True)):
        if output.shape != grad.shape:
            raise InvalidInputError(
                f"grad_outputs[{index}] has shape {tuple(grad.shape)}, but output[{index}] "
                f"has shape {tuple(output.shape)}"
            )
    if not all(output.requires_grad for output in outputs):
        # torch's own error names the output that is not part of a graph.
        return torch.autograd.grad(
            outputs, inputs, grads, retain_graph, create_graph, allow_unused=allow_unused
        )
    with torch.enable_grad():  # also inside a backward pass, where autograd turns it off
        total = (outputs[0] * grads[0]).sum()
        for output, grad in zip(outputs[1:], grads[1:], strict=True):
            total = total + (output * grad).sum()
    return torch.autograd.grad(
        total, inputs, retain_graph=retain_graph, create_graph=create_graph,
        allow_unused=allow_unused,
    )  # fmt: skip
