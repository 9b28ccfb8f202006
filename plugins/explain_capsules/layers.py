"""Capsule layers: primary (conv + squash), fully connected and convolutional routing layers.

Capsule order convention (shared by every layer here and by the recorded couplings): a capsule
grid ``M × N × O`` (rows × columns × capsule types) is flattened row-major as
``index = (m * N + n) * O + o``, i.e. grid positions first, capsule types fastest. Reshaping a
``(batch, M*N*O, dim)`` tensor to ``(batch, M, N, O, dim)`` recovers the grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from explain_capsules.routing import CouplingTransform, _check_iterations, dynamic_routing, squash
from explain_core.interfaces.routing import RoutingLayer
from explain_core.scoped import scoped_setting

# Scoped setting (see explain_core.scoped) that overrides a layer's coupling_transform in one
# context only, e.g. REM's quantised routing while other threads use the continuous model.
COUPLING_TRANSFORM = "coupling_transform"


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def _conv_out(size: int, kernel: int, stride: int, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class PrimaryCapsules(nn.Module):
    """Convolution + reshape into capsules + squash (no routing).

    The convolution outputs ``capsule_types * capsule_dim`` channels, read as ``capsule_types``
    groups of ``capsule_dim`` channels. Output capsules are ordered positions × types (see the
    module docstring): shape ``(batch, M*N*O, capsule_dim)`` with ``(M, N, O) = grid_shape``.

    Attributes:
        grid_shape: ``(M, N, O)`` of the last forward pass (``None`` before the first), so
            saliency can map capsules back to positions.
    """

    def __init__(
        self,
        in_channels: int,
        capsule_types: int,
        capsule_dim: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
    ) -> None:
        super().__init__()
        self.in_channels = _positive_int("in_channels", in_channels)
        self.capsule_types = _positive_int("capsule_types", capsule_types)
        self.capsule_dim = _positive_int("capsule_dim", capsule_dim)
        self.kernel_size = _positive_int("kernel_size", kernel_size)
        self.stride = _positive_int("stride", stride)
        self.padding = padding
        self.conv = nn.Conv2d(
            in_channels, capsule_types * capsule_dim, kernel_size, stride=stride, padding=padding
        )
        self.grid_shape: tuple[int, int, int] | None = None

    def output_grid(self, h_in: int, w_in: int) -> tuple[int, int, int]:
        """Capsule grid ``(M, N, O)`` produced from an ``h_in × w_in`` input.

        Raises:
            ValueError: If the input is smaller than the kernel.
        """
        m = _conv_out(h_in, self.kernel_size, self.stride, self.padding)
        n = _conv_out(w_in, self.kernel_size, self.stride, self.padding)
        if m < 1 or n < 1:
            raise ValueError(
                f"PrimaryCapsules: input {h_in}×{w_in} is smaller than the kernel "
                f"{self.kernel_size}×{self.kernel_size} (padding {self.padding}); expected at "
                "least the kernel size"
            )
        return m, n, self.capsule_types

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map feature maps ``(batch, in_channels, H, W)`` to capsules ``(batch, M*N*O, dim)``."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"PrimaryCapsules: expected input (batch, {self.in_channels}, H, W); "
                f"got shape {tuple(x.shape)}"
            )
        m, n, o = self.output_grid(x.shape[2], x.shape[3])
        out = self.conv(x).view(x.shape[0], o, self.capsule_dim, m, n)
        # (B, O, D, M, N) -> (B, M, N, O, D): positions first, types fastest.
        caps = out.permute(0, 3, 4, 1, 2).reshape(x.shape[0], m * n * o, self.capsule_dim)
        self.grid_shape = (m, n, o)
        return squash(caps)


class _RoutingCapsules(RoutingLayer):
    """Shared routing options and error naming for the routing capsule layers."""

    def __init__(
        self,
        iterations: int,
        detach_intermediate_votes: bool,
        constant_couplings: bool,
        name: str,
    ) -> None:
        super().__init__()
        _check_iterations(iterations)
        self.iterations = iterations
        self.detach_intermediate_votes = detach_intermediate_votes
        self.constant_couplings = constant_couplings
        self.name = name
        # Applied to the final couplings in eval mode only (e.g. REM's K-level quantiser);
        # training always routes with the continuous couplings.
        self.coupling_transform: CouplingTransform | None = None

    @property
    def display_name(self) -> str:
        """Class name plus the optional ``name`` given at construction, for messages."""
        return f"{type(self).__name__}({self.name!r})" if self.name else type(self).__name__

    @property
    def active_coupling_transform(self) -> CouplingTransform | None:
        """The transform in force in this context (:func:`~explain_capsules.quantised_routing`)."""
        return scoped_setting(self, COUPLING_TRANSFORM, self.coupling_transform)

    def _route(self, votes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dynamic_routing(
            votes,
            self.iterations,
            detach_intermediate_votes=self.detach_intermediate_votes,
            constant_couplings=self.constant_couplings,
            coupling_transform=(
                None if self.routes_in_training_mode else self.active_coupling_transform
            ),
            layer_name=self.display_name,
        )


class FullyConnectedCapsules(_RoutingCapsules):
    """All-to-all capsule layer with dynamic routing (FcCaps / ClassCaps).

    Votes ``û_{j|i} = W_ij u_i`` with ``weight`` of shape ``[in_caps, out_caps, out_dim,
    in_dim]``. Emits couplings ``(batch, in_caps, out_caps)``, input activations ``‖u_i‖``
    ``(batch, in_caps)`` and output activations ``‖v_j‖`` ``(batch, out_caps)``.
    """

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_dim: int,
        out_dim: int,
        iterations: int = 3,
        *,
        detach_intermediate_votes: bool = False,
        constant_couplings: bool = False,
        weight_std: float = 0.01,
        name: str = "",
    ) -> None:
        super().__init__(iterations, detach_intermediate_votes, constant_couplings, name)
        self.in_caps = _positive_int("in_caps", in_caps)
        self.out_caps = _positive_int("out_caps", out_caps)
        self.in_dim = _positive_int("in_dim", in_dim)
        self.out_dim = _positive_int("out_dim", out_dim)
        self.weight = nn.Parameter(torch.randn(in_caps, out_caps, out_dim, in_dim) * weight_std)

    def votes(self, u: torch.Tensor) -> torch.Tensor:
        """Predictions ``û_{j|i} = W_ij u_i``, shape ``(batch, in_caps, out_caps, out_dim)``."""
        self._check_input(u)
        return torch.einsum("ijdk,bik->bijd", self.weight, u)

    def _check_input(self, u: torch.Tensor) -> None:
        if u.dim() != 3 or u.shape[1:] != (self.in_caps, self.in_dim):
            raise ValueError(
                f"{self.display_name}: expected input capsules (batch, {self.in_caps}, "
                f"{self.in_dim}); got shape {tuple(u.shape)}"
            )

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Route ``(batch, in_caps, in_dim)`` capsules to ``(batch, out_caps, out_dim)``."""
        v, couplings = self._route(self.votes(u))
        if self.is_recording:
            # Exact norms of detached tensors: activations are reported, not differentiated.
            self.emit_routing(couplings, u.detach().norm(dim=-1), v.detach().norm(dim=-1))
        return v


class ConvolutionalCapsules(_RoutingCapsules):
    """Capsule layer routing over receptive fields (ConvCaps), weights shared over positions.

    Each output position ``l`` routes from the ``k·k·in_types`` input capsules of its window
    (window index ``(kh * k + kw) * in_types + t``) to its ``out_types`` capsules, with
    ``weight`` of shape ``[k*k*in_types, out_types, out_dim, in_dim]``; the softmax runs over
    the ``out_types`` parents of that window. No padding.

    Input: a grid ``(batch, H, W, in_types, in_dim)``, or flat ``(batch, H*W*in_types, in_dim)``
    with ``grid_hw=(H, W)``. Output: flat ``(batch, H'*W'*out_types, out_dim)`` in the module's
    positions × types order; ``grid_shape = (H', W', out_types)`` after a forward pass.

    Recorded couplings follow the ``(batch, n_in, n_out)`` contract with ``n_in = H*W*in_types``
    input capsules and ``n_out = H'*W'*out_types`` output capsules (both positions × types):
    entry ``(i, j)`` is the coupling of input capsule ``i`` to output capsule ``j`` if ``i``
    lies in ``j``'s window, else 0. Each window's couplings sum to 1 over its ``out_types``
    parents, so a row sums to the number of windows covering that input capsule. The dense
    matrix is built only while a recording listens.
    """

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        kernel_size: int,
        stride: int = 1,
        iterations: int = 3,
        *,
        detach_intermediate_votes: bool = False,
        constant_couplings: bool = False,
        weight_std: float = 0.01,
        name: str = "",
    ) -> None:
        super().__init__(iterations, detach_intermediate_votes, constant_couplings, name)
        self.in_types = _positive_int("in_types", in_types)
        self.in_dim = _positive_int("in_dim", in_dim)
        self.out_types = _positive_int("out_types", out_types)
        self.out_dim = _positive_int("out_dim", out_dim)
        self.kernel_size = _positive_int("kernel_size", kernel_size)
        self.stride = _positive_int("stride", stride)
        n_window = kernel_size * kernel_size * in_types
        self.weight = nn.Parameter(torch.randn(n_window, out_types, out_dim, in_dim) * weight_std)
        self.grid_shape: tuple[int, int, int] | None = None

    def output_grid(self, h_in: int, w_in: int) -> tuple[int, int, int]:
        """Output capsule grid ``(H', W', out_types)`` for an ``h_in × w_in`` input grid."""
        h = _conv_out(h_in, self.kernel_size, self.stride)
        w = _conv_out(w_in, self.kernel_size, self.stride)
        if h < 1 or w < 1:
            raise ValueError(
                f"{self.display_name}: input grid {h_in}×{w_in} is smaller than the kernel "
                f"{self.kernel_size}×{self.kernel_size}; expected at least the kernel size"
            )
        return h, w, self.out_types

    def _as_grid(self, u: torch.Tensor, grid_hw: tuple[int, int] | None) -> torch.Tensor:
        if u.dim() == 3 and grid_hw is not None:
            h, w = grid_hw
            if u.shape[1:] != (h * w * self.in_types, self.in_dim):
                raise ValueError(
                    f"{self.display_name}: expected flat capsules (batch, {h}*{w}*"
                    f"{self.in_types}={h * w * self.in_types}, {self.in_dim}); "
                    f"got shape {tuple(u.shape)}"
                )
            return u.view(u.shape[0], h, w, self.in_types, self.in_dim)
        if u.dim() == 5 and grid_hw is None:
            if u.shape[3:] != (self.in_types, self.in_dim):
                raise ValueError(
                    f"{self.display_name}: expected a capsule grid (batch, H, W, "
                    f"{self.in_types}, {self.in_dim}); got shape {tuple(u.shape)}"
                )
            return u
        raise ValueError(
            f"{self.display_name}: expected (batch, H, W, {self.in_types}, {self.in_dim}) or "
            f"(batch, H*W*{self.in_types}, {self.in_dim}) with grid_hw=(H, W); got shape "
            f"{tuple(u.shape)} with grid_hw={grid_hw}"
        )

    def windows(self, grid: torch.Tensor) -> torch.Tensor:
        """Unfold ``(batch, H, W, T, D)`` into windows ``(batch, L, k*k*T, D)``."""
        b, h, w, t, d = grid.shape
        k = self.kernel_size
        cols = F.unfold(grid.permute(0, 3, 4, 1, 2).reshape(b, t * d, h, w), k, stride=self.stride)
        # unfold's channel order is (T, D, kh, kw); move to (kh, kw, T) for the window index.
        cols = cols.view(b, t, d, k, k, -1).permute(0, 5, 3, 4, 1, 2)
        return cols.reshape(b, cols.shape[1], k * k * t, d)

    def _window_rows(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """Input-capsule index of each (position l, window slot) pair, shape ``(L, k*k*T)``."""
        k, s, t = self.kernel_size, self.stride, self.in_types
        h_out, w_out, _ = self.output_grid(h, w)
        oh = torch.arange(h_out, device=device).view(-1, 1, 1, 1, 1)
        ow = torch.arange(w_out, device=device).view(1, -1, 1, 1, 1)
        kh = torch.arange(k, device=device).view(1, 1, -1, 1, 1)
        kw = torch.arange(k, device=device).view(1, 1, 1, -1, 1)
        tt = torch.arange(t, device=device).view(1, 1, 1, 1, -1)
        rows = ((oh * s + kh) * w + (ow * s + kw)) * t + tt
        return rows.reshape(h_out * w_out, k * k * t)

    def forward(self, u: torch.Tensor, grid_hw: tuple[int, int] | None = None) -> torch.Tensor:
        """Route a capsule grid to ``(batch, H'*W'*out_types, out_dim)`` capsules."""
        grid = self._as_grid(u, grid_hw)
        b, h, w = grid.shape[:3]
        h_out, w_out, o = self.output_grid(h, w)
        n_pos = h_out * w_out
        win = self.windows(grid)
        votes = torch.einsum("ijdk,blik->blijd", self.weight, win)
        # Windows route independently: fold positions into the batch axis (a view, no copy).
        v, couplings = self._route(votes.reshape(b * n_pos, *votes.shape[2:]))
        v = v.reshape(b, n_pos * o, self.out_dim)
        self.grid_shape = (h_out, w_out, o)
        if self.is_recording:
            n_in, n_out = h * w * self.in_types, n_pos * o
            rows = self._window_rows(h, w, u.device)  # (L, kkT)
            cols = torch.arange(n_pos, device=u.device).view(-1, 1, 1) * o + torch.arange(
                o, device=u.device
            )  # (L, 1, O)
            flat_index = (rows.unsqueeze(-1) * n_out + cols).reshape(1, -1).expand(b, -1)
            c = couplings.detach().reshape(b, -1)
            dense = c.new_zeros(b, n_in * n_out).scatter_(1, flat_index, c)
            self.emit_routing(
                dense.view(b, n_in, n_out),
                grid.detach().norm(dim=-1).reshape(b, n_in),
                v.detach().norm(dim=-1),
            )
        return v
