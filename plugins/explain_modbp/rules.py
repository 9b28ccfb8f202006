"""LRP and Deep-Taylor rules for affine layers, in the engine's signal convention.

Notation: a layer computes ``z_j = Σ_i w_ji x_i + b_j``; ``R_j`` is the relevance of output ``j``.
Rules return the signal ``s_i`` with input relevance ``R_i = x_i s_i``, except the input-layer
rules (w², flat, z^B), which return ``R_i`` itself. Every rule is a few convolutions with
modified weights in the forward pass plus one transposed convolution per weight variant in the
backward pass.

=================  ==========================================================================
rule               ``R_i``
=================  ==========================================================================
LRP-0 (``z``)      ``Σ_j x_i w_ji / z_j · R_j`` (bias in ``z``); = Input×Gradient on ReLU nets
ε                  ``Σ_j x_i w_ji / (z_j + ε·sign z_j) · R_j``
γ                  ``Σ_j x_i ρ(w)_ji / (Σ_i' x_i' ρ(w)_ji' + ρ(b)_j) · R_j``, ``ρ(w) = w + γw⁺``
                   for ``x, z >= 0``; generalised to any sign (see :class:`Gamma`)
αβ                 ``Σ_j (α [x_i w_ji]⁺/Σ_i'[x_i' w_ji']⁺ − β [x_i w_ji]⁻/Σ_i'[x_i' w_ji']⁻) R_j``
                   (bias ignored, as in the paper's Eq. 5, or counted with ``bias=True``)
z⁺                 αβ with α=1, β=0
w² (input)         ``Σ_j w_ji² / Σ_i' w_ji'² · R_j``
flat (input)       ``Σ_j 1 / Σ_i' 1 · R_j`` over each output's receptive field
z^B (input)        ``Σ_j (x_i w_ji − l_i w⁺_ji − h_i w⁻_ji) / Σ_i'(…) · R_j`` for ``l ≤ x ≤ h``
=================  ==========================================================================
"""

from __future__ import annotations

import torch

from explain_core.affine import AffineLayer
from explain_core.errors import InvalidInputError
from explain_core.interfaces.relevance import AffineRule, RuleCall, safe_divide


def _stabilise(z: torch.Tensor, epsilon: float) -> torch.Tensor:
    return torch.where(z >= 0, z + epsilon, z - epsilon)


def _flag(name: str, value: object) -> bool:
    """``value`` if it is a bool (a string such as ``"no"`` would silently be true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def _ratio(
    z: torch.Tensor, denominator: torch.Tensor, scale: float = 1.0, *, overwrite: bool = False
) -> torch.Tensor:
    """``scale · z / denominator`` with 0 where the denominator is 0 (computed once, forward).

    ``overwrite``: write it into ``denominator``, a temporary (no new tensor to allocate).
    """
    ratio = torch.div(z, denominator, out=denominator) if overwrite else torch.div(z, denominator)
    if scale != 1.0:
        ratio.mul_(scale)
    return ratio.nan_to_num_(0.0, 0.0, 0.0)


def _kept_for_backward(weights: tuple[torch.Tensor | None, ...], ratio: torch.Tensor) -> bool:
    """Whether to keep ``weights`` for the backward pass: together no larger than ``ratio``.

    Made once, they save the backward a pass over the weights; kept always, a large layer's
    copies (a dense layer on a small batch) would outweigh what the layer keeps anyway.
    """
    return sum(w.numel() for w in weights if w is not None) <= ratio.numel()


def _times_ratio(call: RuleCall, grad_output: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """``grad_output ⊙ ratio``; written into the kept ratio when no other backward reads it."""
    return ratio.mul_(grad_output) if call.last_backward else grad_output * ratio


class _RelevanceForm(AffineRule):
    """A rule written for relevance at the output: the signal ``s`` is the relevance ``z ⊙ s``."""

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:
        return self.relevance(call, grad_output * call.output)


class _ModifiedWeights(_RelevanceForm):
    """A rule whose state starts with a modified weight ``ρ(W)`` and the denominators ``d``.

    ``R_i = Σ_j x_i ρ(w)_ji / d_j · R_j`` (or without ``x_i`` for input-layer rules).
    """

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor]:
        layer, x, _ = self.affine(call)
        weight, denominator = call.state[0], call.state[1]
        return (layer.transpose(safe_divide(relevance, denominator), x, weight),)


class _ModifiedWeightsWithRatio(_ModifiedWeights):
    """A :class:`_ModifiedWeights` rule with state ``(ρ(W), d, z / d)`` (ratio from the forward)."""

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:
        layer, x, _ = self.affine(call)
        weight, _, ratio = call.state
        return (layer.transpose(_times_ratio(call, grad_output, ratio), x, weight),)


class Epsilon(AffineRule):
    """LRP-ε: the output (with bias) stabilised by ``ε·sign(z)``; ``ε=0`` is LRP-0.

    Backward keeps one tensor per layer, the ratio ``z / (z + ε·sign z)`` (for LRP-0 the mask
    ``z ≠ 0``), and not the output: the model may free or change it. On a layer only a ReLU
    reads, the ratio is 0 where ``z <= 0``: ``y / (y + ε)`` of the ReLU's output ``y``, which
    the model keeps anyway, computed in backward (LRP-0 keeps its mask ``z > 0``: a byte per
    output).

    Args:
        epsilon: Stabiliser, ``>= 0``.
    """

    output_in_backward = False
    uses_rectified_outputs = True  # the ratio's magnitude is |z|, clamped there to z⁺

    def __init__(self, epsilon: float = 1e-6) -> None:
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0; got {epsilon}")
        self.epsilon = float(epsilon)

    def forward(self, call: RuleCall) -> torch.Tensor:  # noqa: D102
        layer, _, z = self.affine(call)
        rectified = layer.output_rectified  # the ReLU's gradient: no signal where z <= 0
        if not self.epsilon:  # z / z = 1 where z != 0: the gradient (LRP-0 = Input×Gradient)
            return z > 0 if rectified else z != 0
        if rectified:  # from the ReLU's output, in backward
            return None
        return self._ratio(z.abs())

    def _ratio(self, magnitude: torch.Tensor) -> torch.Tensor:
        """``|z| / (|z| + ε)``, which is ``z / (z + ε·sign z)`` exactly (negation does not round).

        ``magnitude``: ``|z|``, or the ReLU's output ``max(z, 0)``.
        """
        denominator = magnitude + self.epsilon
        return torch.div(magnitude, denominator, out=denominator)

    def reads_input_in_backward(self, call: RuleCall) -> bool:  # noqa: D102
        return False  # only its shape, for the transposed product

    def reads_rectified_output(self, call: RuleCall) -> bool:  # noqa: D102
        return call.state is None

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        ratio = call.state
        if ratio is None:  # max(z, 0) / (max(z, 0) + ε), a temporary
            signal = self._ratio(call.rectified_output).mul_(grad_output)
        elif ratio.dtype == torch.bool:
            signal = torch.where(ratio, grad_output, 0.0)
        else:
            signal = _times_ratio(call, grad_output, ratio)
        return (layer.transpose(signal, x),)

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        denominator = _stabilise(layer.forward(x, bias=layer.bias), self.epsilon)
        return (layer.transpose(safe_divide(relevance, denominator), x),)


class Zero(Epsilon):
    """LRP-0 (the "z" rule): ``ε = 0``."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def __repr__(self) -> str:
        return "Zero()"


def _amplified(tensor: torch.Tensor | None, gamma: float, sign: int) -> torch.Tensor | None:
    """``t + γ t⁺`` (``sign=1``) or ``t + γ t⁻`` (``sign=-1``); ``None`` stays ``None``."""
    if tensor is None:
        return None
    part = tensor.clamp(min=0) if sign > 0 else tensor.clamp(max=0)
    return torch.add(tensor, part, alpha=gamma)


class _SignAware(AffineRule):
    """A rule with a cheaper form for non-negative inputs (``x⁻ = 0``) than for signed ones.

    The signed form is exact for any input; the layer's ``input_sign`` says which to take
    (``"unknown"``: look at the values; a traced graph asks for ``"signed"``).
    """

    def forward(self, call: RuleCall) -> tuple:
        layer, x, z = self.affine(call)
        sign = layer.input_sign
        nonnegative = sign == "nonnegative" or (sign == "unknown" and bool((x >= 0).all()))
        return self.prepare(layer, x, z, nonnegative=nonnegative)

    def prepare(
        self, layer: AffineLayer, x: torch.Tensor, z: torch.Tensor, *, nonnegative: bool
    ) -> tuple:
        """The rule's state, for inputs known to be non-negative or of either sign."""
        raise NotImplementedError


class Gamma(_SignAware):
    """LRP-γ: the contributions that agree in sign with the output amplified by ``1 + γ``.

    The generalised rule (Andéol et al. 2021; zennit's ``Gamma``): for an output ``z_j >= 0`` the
    positive contributions ``x⁺w⁺``, ``x⁻w⁻`` and ``b⁺`` are amplified, for ``z_j < 0`` the negative
    ones ``x⁺w⁻``, ``x⁻w⁺`` and ``b⁻``. The denominator then has the sign of ``z_j`` and
    ``|d_j| >= |z_j|``, so it never crosses zero. For non-negative inputs and outputs (a ReLU
    network's hidden layers) this is the paper's ``ρ(w) = w + γw⁺``. With ``generalised=False``
    ``ρ(w) = w + γw⁺`` (and ``b + γb⁺``) is used for every input and output sign, as written in the
    paper: its denominator can cross zero where inputs or outputs are negative (the input layer, a
    negative logit, a residual branch without a ReLU), which makes maps unstable there.

    Args:
        gamma: Amplification, ``>= 0``.
        epsilon: Small stabiliser of the denominator.
        generalised: Amplify by the sign of each output (default) or always the positive parts.
    """

    output_in_backward = False

    def __init__(
        self, gamma: float = 0.25, epsilon: float = 1e-6, generalised: bool = True
    ) -> None:
        if gamma < 0 or epsilon < 0:
            raise ValueError(f"gamma and epsilon must be >= 0; got {gamma}, {epsilon}")
        self.gamma = float(gamma)
        self.epsilon = float(epsilon)
        self.generalised = _flag("generalised", generalised)

    @property
    def uses_rectified_outputs(self) -> bool:  # type: ignore[override]
        """Generalised, the ratio has the output's sign: clamped, it is 0 where a ReLU stops."""
        return self.generalised

    def prepare(  # noqa: D102
        self, layer: AffineLayer, x: torch.Tensor, z: torch.Tensor, *, nonnegative: bool
    ) -> tuple:
        # Kept for backward: the sign form, the ratio z / |d| (generalised: its sign is the
        # output's, so no mask is kept; on a layer only a ReLU reads, computed in backward from
        # the ReLU's output) and, where small enough, the amplified weight.
        signed = self.generalised and not nonnegative
        if self.uses_rectified_outputs and layer.output_rectified:
            return signed, None, None
        amplified = self._up(layer)
        denominator = self._denominator(layer, x, z, signed, amplified)
        ratio = torch.div(z, denominator, out=denominator)  # |d| >= ε: no zero
        up = amplified[0]
        return signed, ratio, up if _kept_for_backward((up,), ratio) else None

    def reads_input_in_backward(self, call: RuleCall) -> bool:  # noqa: D102
        # the signed form reads the input's signs; from the ReLU's output, d needs the input
        return call.state[0] or call.state[1] is None

    def reads_rectified_output(self, call: RuleCall) -> bool:  # noqa: D102
        return call.state[1] is None

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        signed, ratio, up = call.state
        if ratio is None:  # max(z, 0) / d_up: the ReLU's gradient, no signal where z <= 0
            amplified = self._up(layer)
            relu_output = call.rectified_output
            denominator = self._denominator(layer, x, None, signed, amplified)
            signal = torch.div(relu_output, denominator, out=denominator).mul_(grad_output)
            return (self._propagate(call, amplified[0], signal),)
        up = up if up is not None else self._up(layer)[0]
        if not self.generalised:  # no signal on falling outputs
            return (self._propagate(call, up, _times_ratio(call, grad_output, ratio)),)
        s_falling = ratio.clamp(max=0).mul_(grad_output)  # before the ratio is overwritten
        return (self._propagate(call, up, _times_ratio(call, grad_output, ratio), s_falling),)

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        signed = call.state[0]
        z = layer.forward(x, bias=layer.bias)
        amplified = self._up(layer)
        denominator = self._denominator(layer, x, z, signed, amplified)
        s = safe_divide(relevance, denominator)
        up = amplified[0]
        if not self.generalised:
            return (self._propagate(call, up, s),)
        return (self._propagate(call, up, s, torch.where(z < 0, s, 0.0)),)

    def _up(self, layer: AffineLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W + γW⁺`` and ``b + γb⁺``."""
        return _amplified(layer.weight, self.gamma, 1), _amplified(layer.bias, self.gamma, 1)

    def _denominator(
        self,
        layer: AffineLayer,
        x: torch.Tensor,
        falling: torch.Tensor | None,
        signed: bool,
        amplified: tuple[torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        """The stabilised denominators: ``d`` (not generalised) or ``|d| + ε`` (generalised).

        Generalised, ``d`` is ``d_up`` (the positive contributions amplified) where ``z >= 0``
        and ``d_down`` (the negative ones) elsewhere. Their amplified parts add up to ``γz``,
        so ``d_up + d_down = (2 + γ) z`` and ``|d| = max(d_up, −d_down) = d_up + (2 + γ)·max(−z,
        0)``: one convolution, not two, and no mask of the outputs' signs. ``ε`` rides in the
        convolution's bias; the clamp to ``ε`` only catches rounding where the exact value is
        ``>= ε``. ``falling`` is the output ``z``, whose falling part corrects ``d_up``; ``None``
        where no signal reaches the outputs ``z < 0`` (a ReLU reads them): ``d_up`` then serves
        everywhere, where ``z < 0`` its ratio only has to be finite (not generalised, unused).
        ``amplified`` is :meth:`_up`'s ``(W + γW⁺, b + γb⁺)``.
        """
        up, bias_up = amplified
        if not self.generalised:  # w + γw⁺ for every sign
            return _stabilise(layer.forward(x, up, bias_up), self.epsilon)
        bias_up = _shifted(bias_up, self.epsilon, layer, up)
        if not signed:
            d_up = layer.forward(x, up, bias_up)
        else:  # x⁻ contributes positively through W⁻: amplified by W + γW⁻
            down = _amplified(layer.weight, self.gamma, -1)
            d_up = layer.forward_stacked((x.clamp(min=0), x.clamp(max=0)), (up, down), bias_up)
        if falling is not None:  # in place: a new tensor costs more in page faults than a pass
            d_up.sub_(falling.clamp(max=0), alpha=2 + self.gamma)
        return d_up.clamp_(min=self.epsilon)

    def _propagate(
        self,
        call: RuleCall,
        up: torch.Tensor,
        s: torch.Tensor,
        s_falling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The signal at the input from the output signal ``s`` (``up``: ``W + γW⁺``).

        Generalised, ``s = R / |d|`` is ``a = R / d`` on the rising outputs (``z >= 0``) and
        ``−b``, ``b = R / d``, on the falling ones; ``s_falling`` is ``−b`` there, else 0
        (``None``: no falling output carries signal). The input signal ``upᵀa + downᵀb`` (for
        ``x > 0``; ``downᵀa + upᵀb`` for ``x < 0``) with ``down = (2 + γ)W − up`` is
        ``upᵀs − (2 + γ)Wᵀs_falling`` (and ``(2 + γ)Wᵀ(s − s_falling) − upᵀs``): transposed
        products with ``up`` and ``W``.
        """
        layer, x, _ = self.affine(call)
        scale = 2 + self.gamma
        if not call.state[0]:  # non-negative inputs, or not generalised: x⁺ reads up only
            signal = layer.transpose(s, x, up)
            if s_falling is not None:
                signal.sub_(layer.transpose(s_falling, x, layer.weight), alpha=scale)
            return signal
        up_s, weight_s = layer.transpose_stacked(s, x, (up, layer.weight))
        if s_falling is None:
            return torch.where(x > 0, up_s, scale * weight_s - up_s)
        weight_falling = layer.transpose(s_falling, x, layer.weight)
        for_positive_x = up_s - scale * weight_falling
        for_negative_x = scale * (weight_s - weight_falling) - up_s
        return torch.where(x > 0, for_positive_x, for_negative_x)


def _shifted(
    bias: torch.Tensor | None, shift: float, layer: AffineLayer, weight: torch.Tensor
) -> torch.Tensor:
    """``bias + shift`` (``shift`` for each output channel of ``layer`` where there is none)."""
    if bias is not None:
        return bias + shift
    channels = weight.shape[1] * layer.groups if layer.kind == "conv_transpose" else len(weight)
    return weight.new_full((channels,), shift)


class AlphaBeta(_SignAware):
    """LRP-αβ: positive and negative contributions normalised separately.

    Inputs of either sign are handled by splitting ``x`` into ``x⁺`` and ``x⁻``; for
    non-negative inputs (after a ReLU) that costs one convolution per weight sign.

    Args:
        alpha: Weight of the positive part; ``alpha - beta`` must be 1.
        beta: Weight of the negative part, ``>= 0``.
        bias: Count the bias in the denominators (``b⁺`` with the positive, ``b⁻`` with the
            negative contributions), as zennit does. Default: ignored, as in the
            paper's Eq. 5.
    """

    output_in_backward = False
    uses_rectified_outputs = True  # z⁺ >= 0 >= z⁻: the ratios' signs are z's and -z's

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, bias: bool = False) -> None:
        if beta < 0 or abs(alpha - beta - 1) > 1e-9:
            raise ValueError(
                f"alpha - beta must be 1 with beta >= 0; got alpha={alpha}, beta={beta}"
            )
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.bias = _flag("bias", bias)

    @property
    def counts_bias(self) -> bool:  # noqa: D102
        return self.bias

    def prepare(  # noqa: D102
        self, layer: AffineLayer, x: torch.Tensor, z: torch.Tensor, *, nonnegative: bool
    ) -> tuple:
        # Kept for backward: the sign form, the ratios z / z⁺ (and z / z⁻) and, where small
        # enough, the clamped weights; the denominators are not needed. On a layer only a ReLU
        # reads, nothing: the ratios come from the ReLU's output in backward.
        if layer.output_rectified:
            return nonnegative, None, None
        weights = self._weights(layer, nonnegative)
        ratios = self._ratios(layer, x, z, nonnegative, weights)
        return nonnegative, ratios, weights if _kept_for_backward(weights, ratios[0]) else None

    def _ratios(
        self,
        layer: AffineLayer,
        x: torch.Tensor,
        z: torch.Tensor,
        nonnegative: bool,
        weights: tuple[torch.Tensor, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``α z / z⁺`` and ``β z / z⁻`` (``None`` without β), 0 where a denominator is 0.

        From the ReLU's output ``max(z, 0)`` as ``z`` they are 0 where ``z <= 0``: the ReLU's
        gradient.
        """
        pos, neg = self._denominators(layer, x, nonnegative, weights)
        ratio_neg = _ratio(z, neg, self.beta, overwrite=True) if neg is not None else None
        return _ratio(z, pos, self.alpha, overwrite=True), ratio_neg

    def reads_input_in_backward(self, call: RuleCall) -> bool:  # noqa: D102
        # the form for inputs of either sign reads their signs; from the ReLU's output, the
        # denominators need the input
        return not call.state[0] or call.state[1] is None

    def reads_rectified_output(self, call: RuleCall) -> bool:  # noqa: D102
        return call.state[1] is None

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        nonnegative, ratios, weights = call.state
        if weights is None:
            weights = self._weights(layer, nonnegative)
        if ratios is None:  # made now from the ReLU's output: temporaries the signal goes into
            ratios = self._ratios(layer, x, call.rectified_output, nonnegative, weights)
            s_pos, s_neg = (r if r is None else r.mul_(grad_output) for r in ratios)
        else:
            s_pos, s_neg = (r if r is None else _times_ratio(call, grad_output, r) for r in ratios)
        return (self._propagate(call, weights, s_pos, s_neg),)

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        nonnegative = call.state[0]
        weights = self._weights(layer, nonnegative)
        pos, neg = self._denominators(layer, x, nonnegative, weights)
        s_pos = safe_divide(relevance, pos)
        if self.alpha != 1:
            s_pos = s_pos * self.alpha
        s_neg = safe_divide(relevance, neg) * self.beta if neg is not None else None
        return (self._propagate(call, weights, s_pos, s_neg),)

    def _weights(
        self, layer: AffineLayer, nonnegative: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W⁺`` and ``W⁻`` (z⁺ on non-negative inputs never needs ``W⁻``)."""
        positive = layer.weight.clamp(min=0)
        negative = layer.weight.clamp(max=0) if self.beta or not nonnegative else None
        return positive, negative

    def _denominators(
        self,
        layer: AffineLayer,
        x: torch.Tensor,
        nonnegative: bool,
        weights: tuple[torch.Tensor, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``z⁺`` and ``z⁻`` (``None`` without β)."""
        positive, negative = weights
        has_bias = self.bias and layer.bias is not None
        bias_pos = layer.bias.clamp(min=0) if has_bias else None
        bias_neg = layer.bias.clamp(max=0) if has_bias and self.beta else None
        if nonnegative:
            pos = layer.forward(x, positive, bias_pos)
            neg = layer.forward(x, negative, bias_neg) if self.beta else None
            return pos, neg
        assert negative is not None
        xp, xn = x.clamp(min=0), x.clamp(max=0)
        pos = layer.forward_stacked((xp, xn), (positive, negative), bias_pos)
        if not self.beta:
            return pos, None
        return pos, layer.forward_stacked((xp, xn), (negative, positive), bias_neg)

    def _propagate(
        self,
        call: RuleCall,
        weights: tuple[torch.Tensor, torch.Tensor | None],
        s_pos: torch.Tensor,
        s_neg: torch.Tensor | None,
    ) -> torch.Tensor:
        """The signal at the input from the output signals ``s_pos`` and ``s_neg`` (``W⁺, W⁻``)."""
        layer, x, _ = self.affine(call)
        nonnegative = call.state[0]
        positive, negative = weights
        if nonnegative:
            signal = layer.transpose(s_pos, x, positive)
            if s_neg is not None:
                signal = signal.sub_(layer.transpose(s_neg, x, negative))
            return signal
        assert negative is not None
        for_positive_x, for_negative_x = layer.transpose_stacked(s_pos, x, (positive, negative))
        if s_neg is not None:
            negative_for_positive, negative_for_negative = layer.transpose_stacked(
                s_neg, x, (negative, positive)
            )
            for_positive_x = for_positive_x - negative_for_positive
            for_negative_x = for_negative_x - negative_for_negative
        return torch.where(x > 0, for_positive_x, for_negative_x)


class ZPlus(AlphaBeta):
    """The z⁺ rule: LRP-α1β0 (Deep Taylor's rule for ReLU inputs).

    Args:
        bias: Count ``b⁺`` in the denominator (zennit's convention); default: ignored,
            as in the paper's Eq. 5.
    """

    def __init__(self, bias: bool = False) -> None:
        super().__init__(1.0, 0.0, bias)

    def __repr__(self) -> str:
        return "ZPlus(bias=True)" if self.bias else "ZPlus()"


class WSquare(_ModifiedWeights):
    """Deep Taylor's w² rule for unbounded real inputs (input layer only)."""

    counts_bias = False  # type: ignore[assignment]  # the denominators hold no bias

    returns_relevance = True

    def forward(self, call: RuleCall) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        squared = layer.weight.square()
        return squared, layer.forward(_input_ones(call, x), squared)


class Flat(_ModifiedWeights):
    """The flat rule: each output's relevance spread uniformly over its inputs (input layer)."""

    counts_bias = False  # type: ignore[assignment]  # the denominators hold no bias

    returns_relevance = True

    def forward(self, call: RuleCall) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        ones = torch.ones_like(layer.weight)
        return ones, layer.forward(_input_ones(call, x), ones)


def _input_ones(call: RuleCall, x: torch.Tensor) -> torch.Tensor:
    """1 for each input of the layer, 0 for zero padding (the model's own or its conv's)."""
    return call.input_path.ones(x) if call.input_path is not None else torch.ones_like(x)


class ZBox(AffineRule):
    """Deep Taylor's z^B rule for inputs bounded by ``low <= x <= high`` (input layer only).

    Args:
        low: Lower bound: a number, or a tensor broadcastable to the inputs (or one sample).
        high: Upper bound, likewise.

    Raises:
        InvalidInputError: If a bound is missing, or (at use) does not fit the inputs or the
            inputs leave the bounds.
    """

    counts_bias = False  # type: ignore[assignment]  # the denominators hold no bias

    returns_relevance = True
    output_in_backward = False

    def __init__(self, low: float | torch.Tensor | None, high: float | torch.Tensor | None) -> None:
        if low is None or high is None:
            raise InvalidInputError(
                "the z^B rule needs the input's bounds: pass low= and high= (numbers or tensors "
                "shaped like the inputs), e.g. low=0.0, high=1.0 for images scaled to [0, 1], "
                "to explain() or to the Explainer itself (Explainer(model, 'lrp.zb', low=0.0, "
                "high=1.0)), whose options hold for every call of attribute()"
            )
        self.low = low
        self.high = high

    def _bound(self, value: float | torch.Tensor, call: RuleCall, what: str) -> torch.Tensor:
        """The bound at the layer's inputs.

        Fitted to the model input, then reshaped, permuted or padded as the model does it
        (:class:`~explain_core.interfaces.relevance.InputPath`).
        """
        x = call.inputs[0]
        path = call.input_path
        shape = path.shape if path is not None else x.shape
        bound = torch.as_tensor(value, dtype=x.dtype, device=x.device)
        try:  # a sample's shape, the batch's, or one that broadcasts to it ((C, 1, 1))
            bound = torch.broadcast_to(bound, shape)
        except RuntimeError:
            raise InvalidInputError(
                f"z^B bound {what} of shape {tuple(bound.shape)} does not fit the inputs of "
                f"shape {tuple(shape)}; give a number or a tensor shaped like one sample, like "
                "the batch, or broadcastable to them, in the layout of the model's input"
            ) from None
        return path.apply(bound) if path is not None else bound

    def forward(self, call: RuleCall) -> tuple:  # noqa: D102
        layer, x, z = self.affine(call)
        low, high = self._bound(self.low, call, "low"), self._bound(self.high, call, "high")
        tolerance = 1e-6 * (1 + float(x.abs().max()))
        if bool((x < low - tolerance).any() or (x > high + tolerance).any()):
            raise InvalidInputError(
                "the inputs leave the z^B bounds (low <= x <= high must hold); got inputs in "
                f"[{float(x.min()):.4g}, {float(x.max()):.4g}], check low= and high="
            )
        # Kept for backward: the bounds, the weights (W, −W⁺, −W⁻) and the ratio z / d.
        weights = (layer.weight, -layer.weight.clamp(min=0), -layer.weight.clamp(max=0))
        denominator = layer.forward_stacked((x, low, high), weights)
        return low, high, weights, _ratio(z, denominator, overwrite=True)

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        return (self._propagate(call, _times_ratio(call, grad_output, call.state[3])),)

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        low, high, weights, _ = call.state
        denominator = layer.forward_stacked((x, low, high), weights)
        return (self._propagate(call, safe_divide(relevance, denominator)),)

    def _propagate(self, call: RuleCall, s: torch.Tensor) -> torch.Tensor:
        """``x ⊙ Wᵀs − l ⊙ W⁺ᵀs − h ⊙ W⁻ᵀs`` for ``s = R / d``: one transposed product."""
        layer, x, _ = self.affine(call)
        low, high, weights, _ = call.state
        for_x, for_low, for_high = layer.transpose_stacked(s, x, weights)
        return (x * for_x).addcmul_(low, for_low).addcmul_(high, for_high)


class Excitation(_ModifiedWeightsWithRatio):
    """Excitation backprop's marginal winning probability: only positive weights (``W⁺``).

    ``R_i = Σ_j x_i w⁺_ji / Σ_i' x_i' w⁺_ji' · R_j`` (equals z⁺ for non-negative inputs).
    """

    counts_bias = False  # type: ignore[assignment]  # the denominators hold no bias

    def forward(self, call: RuleCall) -> tuple[torch.Tensor, ...]:  # noqa: D102
        layer, x, z = self.affine(call)
        positive = layer.weight.clamp(min=0)
        denominator = layer.forward(x, positive)
        return positive, denominator, _ratio(z, denominator)


class ContrastiveExcitation(_RelevanceForm):
    """Contrastive excitation backprop's final-layer rule ``(Z⁺ − N⁺)``, ``N⁺`` from ``−W``."""

    counts_bias = False  # type: ignore[assignment]  # the denominators hold no bias

    def forward(self, call: RuleCall) -> tuple[torch.Tensor, ...]:  # noqa: D102
        layer, x, _ = self.affine(call)
        positive, flipped = layer.weight.clamp(min=0), (-layer.weight).clamp(min=0)
        return positive, flipped, layer.forward(x, positive), layer.forward(x, flipped)

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        layer, x, _ = self.affine(call)
        positive, flipped, den_positive, den_flipped = call.state
        return (
            layer.transpose(safe_divide(relevance, den_positive), x, positive)
            - layer.transpose(safe_divide(relevance, den_flipped), x, flipped),
        )


__all__ = [
    "AlphaBeta",
    "ContrastiveExcitation",
    "Epsilon",
    "Excitation",
    "Flat",
    "Gamma",
    "WSquare",
    "ZBox",
    "ZPlus",
    "Zero",
]
