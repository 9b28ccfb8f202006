"""Dynamic Alignment Units: dense and convolutional layers, ``y = W(x)·x``.

A DAU computes ``w(x) = g(A·B·x + b)`` and outputs ``w(x)ᵀx`` (Böhle et al., CVPR 2021, eq. 1).
A layer of ``k`` DAUs shares ``B``. Parameters are named and laid out as in Algorithm 1 of the
supplement (the released code names them ``weight_mod.weighting_f.0``/``.1`` with the same shapes
and layout: :mod:`explain_coda.original` renames its checkpoints):

- ``dim_reduction``: ``B`` (``Conv2d(in, rank, k, stride, padding, bias=False)``);
- ``weightings``: ``A`` and ``b`` (``Conv2d(rank, out * patch_dim, 1, bias=True)``), where output
  channel ``p * out + j`` is entry ``p`` of DAU ``j``'s weight, ``p`` in ``F.unfold`` order.

:class:`DAUConv2d` has two exact forward forms. ``"direct"`` is Algorithm 1: it materialises the
``(batch, patch_dim, out, h, w)`` weight tensor. ``"factorised"`` never does. With a patch ``p``,
``z' = [Bp; 1]`` and ``A'_j = [A_j, b_j]`` (``patch_dim × (rank + 1)``), ``w_j = A'_j z'`` and

- numerator ``w_jᵀp = z'ᵀ(A'_jᵀp)``: ``A'_jᵀp`` for all ``j`` is ONE ``k × k`` convolution of the
  input with ``out * (rank + 1)`` output channels, contracted with ``z'`` per position;
- squared norm ``q_j = ‖w_j‖² = ‖Q_jᵀA'_j z'‖²``, where ``Q_j`` is an orthonormal basis of the
  column space of ``A'_j`` (from a QR factorisation, treated as a constant). The sum of squares is
  never negative and, unlike the Gram form ``z'ᵀA'_jᵀA'_j z'``, does not cancel in float32 when
  ``A_j z ≈ −b_j``: its rounding error is that of computing ``w_j`` itself.

Why the basis is a constant rather than differentiated through ``torch.linalg.qr``: QR's backward
solves with ``R``, which is singular whenever ``A'_j`` is rank deficient (e.g. all-zero weightings)
and gives NaN gradients. For any constant orthonormal ``Q``,
``‖A'z'‖² = ‖QᵀA'z'‖² + ‖(I − QQᵀ)A'z'‖²``, and the second term is ``‖(I − QQᵀ)(A' − A'₀)z'‖²`` when
``Q`` spans the columns of the current ``A'₀``: quadratic in the change of ``A'``. Hence the value,
all first derivatives and all derivatives at most linear in the ``weightings`` parameters (mixed
input/parameter second derivatives included) are exact; only pure second derivatives with respect
to ``weightings`` omit the part of the perturbation outside the column space.

Cost: the numerator convolution has the FLOPs of Algorithm 1's ``weightings`` convolution, the
norm adds ``(rank + 1) / patch_dim`` of that, and the largest tensors shrink from
``out * patch_dim`` to ``out * (rank + 1)`` values per position, which is what makes it faster:
Algorithm 1 is dominated by elementwise passes over its weight tensor. ``benchmarks/
bench_dau_conv.py`` measures both.
"""

from __future__ import annotations

import threading
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from explain_coda.nonlinearity import Nonlinearity, check_nonlinearity, scale_from_squared_norm
from explain_core.interfaces.dynamic_linear import DynamicLinear

__all__ = [
    "FORMS",
    "DAUConv2d",
    "DAULinear",
    "Form",
    "orthonormal_columns",
]

Form = Literal["auto", "factorised", "direct"]
FORMS: tuple[str, ...] = ("auto", "factorised", "direct")


class DAULinear(DynamicLinear):
    """``out_features`` DAUs over a ``in_features``-dim input with rank ``rank`` and shared ``B``.

    Args:
        in_features: Input dimension ``d``.
        out_features: Number of DAUs ``k``.
        rank: Rank ``r`` of ``A_j·B``.
        nonlinearity: ``"l2"`` or ``"squash"``.
    """

    def __init__(
        self, in_features: int, out_features: int, rank: int, nonlinearity: Nonlinearity = "squash"
    ) -> None:
        super().__init__()
        _check_positive(in_features=in_features, out_features=out_features, rank=rank)
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.nonlinearity = check_nonlinearity(nonlinearity)
        self.dim_reduction = nn.Linear(in_features, rank, bias=False)
        self.weightings = nn.Linear(rank, out_features * in_features, bias=True)

    def dynamic_weight(self, x: torch.Tensor) -> torch.Tensor:
        """``W(x)``, shape ``(batch, out_features, in_features)``; row ``j`` is ``w_j(x)``."""
        raw = self.weightings(self.dim_reduction(self.weight_input(x)))
        raw = raw.view(-1, self.in_features, self.out_features).transpose(1, 2)
        return raw * scale_from_squared_norm((raw * raw).sum(-1, keepdim=True), self.nonlinearity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, in_features) → (batch, out_features)``."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"DAULinear expects inputs of shape (batch, {self.in_features}); "
                f"got {tuple(x.shape)}"
            )
        # A dense layer has one "patch" per sample, so W is only batch × out × in: materialising it
        # costs no more than the factorised form would.
        return torch.einsum("boi,bi->bo", self.dynamic_weight(x), x)

    def extra_repr(self) -> str:
        """Sizes and non-linearity, for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, nonlinearity={self.nonlinearity!r}"
        )


class DAUConv2d(DynamicLinear):
    """A convolutional Dynamic Alignment layer: one DAU per output channel, on every patch.

    Args:
        in_channels: Input channels.
        out_channels: Number of DAUs (output channels).
        rank: Rank of ``A_j·B``.
        kernel_size: Square patch size ``k``.
        stride: Patch stride.
        padding: Zero padding; ``(k - 1) // 2`` by default, so only strides shrink the map.
        nonlinearity: ``"l2"`` or ``"squash"``.
        form: How :meth:`forward` computes the output, all exact: ``"direct"`` (Algorithm 1,
            materialises ``W``), ``"factorised"`` (see the module docstring) or ``"auto"``
            (default): factorised where ``patch_dim > rank + 1``, i.e. where its per-position
            intermediates (``out * (rank + 1)``) are smaller than Algorithm 1's
            (``out * patch_dim``); direct otherwise (e.g. a 1×1 layer with ``rank ≥ in``) and
            while exporting a graph (``torch.onnx``/``torch.export``: ONNX has no QR).

    Attributes:
        form: The requested form; :attr:`effective_form` is the one used.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        rank: int,
        kernel_size: int,
        stride: int = 1,
        padding: int | None = None,
        nonlinearity: Nonlinearity = "squash",
        *,
        form: Form = "auto",
    ) -> None:
        super().__init__()
        _check_positive(
            in_channels=in_channels,
            out_channels=out_channels,
            rank=rank,
            kernel_size=kernel_size,
            stride=stride,
        )
        if padding is not None and (not isinstance(padding, int) or padding < 0):
            raise ValueError(f"padding must be a non-negative int or None; got {padding!r}")
        if form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}; got {form!r}")
        self.in_channels, self.out_channels, self.rank = in_channels, out_channels, rank
        self.kernel_size, self.stride = kernel_size, stride
        self.padding = (kernel_size - 1) // 2 if padding is None else padding
        self.nonlinearity = check_nonlinearity(nonlinearity)
        self.form: Form = form
        self.patch_dim = in_channels * kernel_size * kernel_size
        self.dim_reduction = nn.Conv2d(
            in_channels, rank, kernel_size, stride, self.padding, bias=False
        )
        self.weightings = nn.Conv2d(rank, out_channels * self.patch_dim, 1, bias=True)

    @property
    def effective_form(self) -> Literal["factorised", "direct"]:
        """The form :meth:`forward` uses: ``form`` with ``"auto"`` resolved."""
        if self.form == "auto":
            # ONNX has no QR operator: graph exports take Algorithm 1, which agrees to rounding.
            if torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting():
                return "direct"
            return "factorised" if self.patch_dim > self.rank + 1 else "direct"
        return self.form

    def dynamic_weight(self, x: torch.Tensor) -> torch.Tensor:
        """``W(x)`` per patch: ``(batch, out_channels, patch_dim, h, w)``.

        This materialises the large weight tensor; use it for inspection and small inputs.
        """
        return self.patch_major_weight(x).transpose(1, 2)

    def patch_major_weight(self, x: torch.Tensor) -> torch.Tensor:
        """``W(x)`` laid out as computed: ``(batch, patch_dim, out_channels, h, w)``.

        :meth:`dynamic_weight` is its transposed view; graphs (ONNX) that contract it over either
        axis read this layout directly instead of materialising the transpose.
        """
        self._check_input(x)
        reduced = self.dim_reduction(self.weight_input(x))
        batch, _, h, w = reduced.shape
        raw = self.weightings(reduced).view(batch, self.patch_dim, self.out_channels, h, w)
        # raw * raw, not raw.pow(2): the same numbers (PyTorch's pow(2) multiplies), but ONNX's
        # Pow is onnxruntime's slow kernel (2.6 of an explained CoDA-Net's 36 ms; Mul: about 1).
        return raw * scale_from_squared_norm((raw * raw).sum(1, keepdim=True), self.nonlinearity)

    def position_major_weight(self, x: torch.Tensor) -> torch.Tensor:
        """``W(x)`` laid out per position: ``(batch, h, w, patch_dim, out_channels)``.

        The numbers of :meth:`patch_major_weight` (up to the summation order of the 1×1
        convolution and its bias), computed as one matrix product over positions whose output
        already has this layout. For graphs (ONNX): onnxruntime runs the 1×1 convolution in its
        blocked layout and then spends more than half as long again reordering its large output
        (an explained CoDA-Net's contributions on digits, batch 32: 19 ms instead of 28).
        """
        self._check_input(x)
        reduced = self.dim_reduction(self.weight_input(x)).permute(0, 2, 3, 1)  # (B, h, w, rank)
        batch, h, w, _ = reduced.shape
        kernel = self.weightings.weight.flatten(1)  # (patch_dim * out_channels, rank)
        bias = self.weightings.bias
        if bias is not None:
            # The bias as one more column of the product (times an input of 1): onnxruntime
            # adds a bias in a second pass over this large output, as an Add or inside Gemm.
            kernel = torch.cat([kernel, bias[:, None]], dim=1)
            reduced = torch.cat([reduced, torch.ones_like(reduced[..., :1])], dim=-1)
        raw = (reduced @ kernel.T).view(batch, h, w, self.patch_dim, self.out_channels)
        return raw * scale_from_squared_norm((raw * raw).sum(3, keepdim=True), self.nonlinearity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, in_channels, H, W) → (batch, out_channels, h, w)``."""
        self._check_input(x)
        if self.effective_form == "direct":
            return self._direct(x)
        numerator, squared_norm = self._numerator_and_squared_norm(x)
        output = numerator * scale_from_squared_norm(squared_norm, self.nonlinearity)
        return output.permute(0, 3, 1, 2).contiguous()

    def _direct(self, x: torch.Tensor) -> torch.Tensor:
        """Algorithm 1: apply the materialised ``W(x)`` to the unfolded patches."""
        weights = self.dynamic_weight(x)  # (B, out, patch_dim, h, w)
        batch, _, _, h, w = weights.shape
        patches = F.unfold(x, self.kernel_size, padding=self.padding, stride=self.stride)
        patches = patches.view(batch, 1, self.patch_dim, h, w)
        return (patches * weights).sum(2)

    def _numerator_and_squared_norm(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A'_j z')ᵀp`` and ``‖A'_j z'‖²`` per position and DAU, both ``(batch, h, w, out)``.

        ``z'`` (and so the norm) comes from :meth:`weight_input`; the patches ``p`` from ``x``, so
        in explanation mode the numerator is linear in ``x`` with a constant ``z'``.
        """
        out, n, k = self.out_channels, self.rank + 1, self.kernel_size
        # Channels-last: faster oneDNN/cuDNN convolutions, and the (batch, h, w, out, rank + 1)
        # view of the numerator convolution below is free. The copy is input-sized, i.e. small.
        x = x.contiguous(memory_format=torch.channels_last)
        reduced = self.dim_reduction(self.weight_input(x)).permute(0, 2, 3, 1)  # (B, h, w, rank)
        batch, h, w, _ = reduced.shape
        # z' = [Bp; 1]: b_j becomes the last column of A'_j, so one kernel serves A_j and b_j.
        z = torch.cat([reduced, reduced.new_ones(batch, h, w, 1)], -1)  # (B, h, w, n)
        a = torch.cat(
            [
                self.weightings.weight.reshape(self.patch_dim, out, self.rank),
                self.weightings.bias.reshape(self.patch_dim, out, 1),
            ],
            2,
        ).permute(1, 0, 2)  # (out, patch_dim, n): A'_j, rows in F.unfold = Conv2d weight order

        # Numerator: channel j*n + ρ of this convolution is (A'_jᵀp)_ρ on every patch p.
        kernel = a.transpose(1, 2).reshape(out * n, self.in_channels, k, k)
        kernel = kernel.contiguous(memory_format=torch.channels_last)
        projected = F.conv2d(x, kernel, stride=self.stride, padding=self.padding)
        projected = projected.permute(0, 2, 3, 1).reshape(batch, h, w, out, n)
        numerator = _Contract.apply(projected, z)  # (B, h, w, out)

        # Squared norm in an orthonormal basis Q_j of A'_j's column space, a constant (see the
        # module docstring): coords = Q_jᵀA'_j (≈ R_j of A'_j = Q_j R_j) is differentiable in A'.
        basis = orthonormal_columns(a)  # (out, patch_dim, m), m = min(patch_dim, n)
        coords = basis.transpose(1, 2) @ a  # (out, m, n)
        m = coords.shape[1]
        # Q_jᵀw_j = coords_j z' for all j at once: one (B·h·w, n) × (n, out·m) product.
        rotated = z.reshape(-1, n) @ coords.reshape(out * m, n).t()
        squared_norm = _SquaredNorm.apply(rotated.view(batch, h, w, out, m))
        return numerator, squared_norm

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"DAUConv2d expects inputs of shape (batch, {self.in_channels}, H, W); "
                f"got {tuple(x.shape)}"
            )

    def extra_repr(self) -> str:
        """Sizes, non-linearity and form, for ``repr``."""
        return (
            f"{self.in_channels}, {self.out_channels}, rank={self.rank}, "
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"nonlinearity={self.nonlinearity!r}, form={self.form!r}"
        )


_THREADS_LOCK = threading.Lock()


def orthonormal_columns(a: torch.Tensor) -> torch.Tensor:
    """``Q`` of the reduced QR factorisation of every ``a[j]``, as a constant (no autograd)."""
    with torch.no_grad():
        # LAPACK and cuSOLVER have no half-precision QR; the matrices are small, float32 is free.
        full = a if a.dtype in (torch.float32, torch.float64) else a.float()
        if full.device.type != "cpu" or torch.get_num_threads() == 1:
            return torch.linalg.qr(full).Q.to(a.dtype)
        # On CPU, MKL threads each small factorisation of the batch separately: its many short
        # parallel regions cost more than they save (S-CoDA layer 4: 16 ms on 2 threads, 6 ms on
        # one) and stall for hundreds of ms when the cores are oversubscribed. So run it on one
        # thread; the lock makes concurrent callers restore the setting in order.
        with _THREADS_LOCK:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                q = torch.linalg.qr(full).Q
            finally:
                torch.set_num_threads(threads)
        return q.to(a.dtype)


class _Contract(torch.autograd.Function):
    """``Σ_ρ p[..., j, ρ]·z[..., ρ]`` with batched row-vector products in both directions.

    Autograd's own backward of any single formulation either reads ``p`` transposed or returns a
    transposed gradient that is then copied; ``p`` is as large as everything else together, so
    this halves the cost of the contraction. Differentiable backward: higher derivatives work.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, p: torch.Tensor, z: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(p, z)
        return (z.unsqueeze(-2) @ p.transpose(-1, -2)).squeeze(-2)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        p, z = ctx.saved_tensors  # type: ignore[attr-defined]
        needs_p, needs_z = ctx.needs_input_grad  # type: ignore[attr-defined]
        # A permuted (small) grad would make grad_p permuted too, and the views upstream copy it.
        grad = grad.contiguous()
        grad_p = grad.unsqueeze(-1) * z.unsqueeze(-2) if needs_p else None
        grad_z = (grad.unsqueeze(-2) @ p).squeeze(-2) if needs_z else None
        return grad_p, grad_z


class _SquaredNorm(torch.autograd.Function):
    """``‖y‖²`` over the last dimension, with a one-pass backward ``2·g·y``.

    Autograd's ``y.square().sum(-1)`` backward makes three passes over ``y`` plus a copy; here
    ``y`` is the largest tensor of the factorised form. The backward is built from differentiable
    operations, so higher derivatives still work.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return (y.unsqueeze(-2) @ y.unsqueeze(-1)).view(y.shape[:-1])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return y * (2 * grad).contiguous().unsqueeze(-1)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
