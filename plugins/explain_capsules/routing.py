"""Squashing non-linearity and dynamic routing by agreement (Sabour et al., 2017).

All functions work on whole batches with einsum/broadcasting; nothing is replicated over the
batch axis. Norms put their epsilon inside the square root, so zero vectors give finite values
and finite gradients (``‖s‖`` itself has a NaN gradient at ``s = 0``).
"""

from __future__ import annotations

import torch

from explain_core.errors import InvalidInputError
from explain_core.interfaces.routing import CouplingTransform

__all__ = ["CouplingTransform", "capsule_length", "dynamic_routing", "squash"]


def squash(s: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """Squash vectors to a length in ``[0, 1)``: ``s · q/(1+q) / sqrt(q+eps)``, ``q = ‖s‖²``.

    Args:
        s: Capsule vectors.
        dim: Axis holding the capsule dimensions.
        eps: Added to ``q`` inside the square root, keeping forward and backward finite at
            ``s = 0``.

    Returns:
        Tensor shaped like ``s`` whose vectors have length ``≈ q/(1+q)``.
    """
    q = (s * s).sum(dim=dim, keepdim=True)
    return s * (q / (1.0 + q)) / torch.sqrt(q + eps)


def capsule_length(u: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """Differentiable capsule length ``sqrt(‖u‖² + eps)`` (finite gradient at ``u = 0``).

    Args:
        u: Capsule vectors.
        dim: Axis holding the capsule dimensions (removed from the result).
        eps: Added inside the square root; the result is ``≈ ‖u‖`` up to ``sqrt(eps)``.

    Returns:
        Lengths with ``dim`` reduced.
    """
    return torch.sqrt((u * u).sum(dim=dim) + eps)


def _check_iterations(iterations: int) -> None:
    # bool is an int subclass; `True` iterations is almost certainly a mistake.
    if isinstance(iterations, bool) or not isinstance(iterations, int):
        raise ValueError(f"routing iterations must be an int ≥ 1; got {iterations!r}")
    if iterations < 1:
        raise ValueError(f"routing iterations must be ≥ 1; got {iterations}")


def dynamic_routing(
    votes: torch.Tensor,
    iterations: int,
    *,
    detach_intermediate_votes: bool = False,
    constant_couplings: bool = False,
    coupling_transform: CouplingTransform | None = None,
    layer_name: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route votes to parent capsules by agreement (Sabour et al., Algorithm 1).

    ``b = 0``; for each of ``iterations`` rounds: ``c = softmax_j(b)``,
    ``s_j = Σ_i c_ij û_{j|i}``, ``v_j = squash(s_j)`` and, except after the last round,
    ``b_ij += û_{j|i} · v_j``.

    Args:
        votes: Predictions ``û_{j|i}``, shape ``(batch, n_in, n_out, d_out)``.
        iterations: Number of routing rounds ``r ≥ 1``.
        detach_intermediate_votes: Use ``votes.detach()`` in all rounds but the last, so
            gradients reach the votes only through the final ``s`` (common practice; the
            outputs are unchanged).
        constant_couplings: Detach the couplings used in the final ``s``, i.e. treat ``c_ij``
            as constants in backpropagation (justified when couplings are polarised).
        coupling_transform: Optional map applied to the final couplings before the final ``s``
            is computed (e.g. a K-level quantiser at inference); must keep the shape.
        layer_name: Name used in error messages.

    Returns:
        ``(v, c)``: output capsules ``(batch, n_out, d_out)`` and the final couplings
        ``(batch, n_in, n_out)`` that produced them (after ``coupling_transform``).

    Raises:
        ValueError: On a wrong ``votes`` rank, ``iterations < 1`` or a transform changing the
            shape.
        InvalidInputError: For couplings that became NaN (votes that overflowed); also a
            ``ValueError``.
    """
    _check_iterations(iterations)
    where = f" in {layer_name}" if layer_name else ""
    if votes.dim() != 4:
        raise ValueError(
            f"dynamic_routing{where}: expected votes of shape (batch, n_in, n_out, d_out); "
            f"got shape {tuple(votes.shape)}"
        )
    logits = votes.new_zeros(votes.shape[:3])
    for r in range(iterations):
        last = r == iterations - 1
        u_hat = votes.detach() if detach_intermediate_votes and not last else votes
        # Softmax over the parents j: each child distributes its output among the parents.
        couplings = torch.softmax(logits, dim=2)
        if last:
            if torch.isnan(couplings).any():
                raise InvalidInputError(
                    f"dynamic_routing{where}: the couplings became NaN because the votes or "
                    f"their agreements overflowed ({_overflow(votes)}); scale the "
                    "inputs like the training data (e.g. to [0, 1]) and check the weights for "
                    "NaN or infinite values"
                )
            if coupling_transform is not None:
                transformed = coupling_transform(couplings)
                if transformed.shape != couplings.shape:
                    raise ValueError(
                        f"dynamic_routing{where}: coupling_transform must keep shape "
                        f"{tuple(couplings.shape)}; got {tuple(transformed.shape)}"
                    )
                couplings = transformed
            used = couplings.detach() if constant_couplings else couplings
        else:
            used = couplings
        s = torch.einsum("bij,bijd->bjd", used, u_hat)
        v = squash(s)
        if not last:
            # Agreement û_{j|i} · v_j raises the logit of parents that agree with the child.
            logits = logits + torch.einsum("bijd,bjd->bij", u_hat, v)
    return v, couplings


def _overflow(votes: torch.Tensor) -> str:
    """How large the votes got, for the overflow message."""
    finite = torch.isfinite(votes)
    if not bool(finite.all()):
        return f"{int((~finite).sum())} of {votes.numel()} votes are NaN or infinite"
    return f"the largest |vote| is {float(votes.detach().abs().max()):.3g}"
