"""Float64 references for the zoo's table that share no code with the engine or the methods.

LRP: the gradient trick on a copy.

Each ruled layer of a deep copy of the model returns its own output value, but with the gradient
of a function whose vector-Jacobian product is the rule (Zennit's approach, written here from the
rules' equations in ``plugins/explain_modbp/rules.py``'s table): ``out = z + f(x) − f(x)``, the
first and last terms detached. Relevance at the input is ``x ⊙ ∂out/∂x`` (``∂out/∂x`` itself for
the input-layer rules w², flat and z^B, which return relevance). What the engine finds by tracing
is found here by forward hooks on the copy's modules, one kind of module at a time:

- Linear/Conv/ConvTranspose: the composite's rule; a BatchNorm whose input is such a layer's
  output is merged into it (the rule sees ``W·s`` and ``(b − μ)·s + β``), any other BatchNorm is
  the per-channel map ``a·x + b`` with the composite's lone-BatchNorm rule;
- element-wise activations other than ReLU pass relevance: ``out = x ⊙ (f(x)/x)`` held constant;
- squeeze-excitation gates (the modules named ``scale_activation``) are held constant;
- LayerNorm holds its normalising scale constant;
- ReLU, pooling, additions, concatenations, permutes and upsampling keep their gradient.

Only the module structure of ``tests/zoo.py`` is covered (its SE blocks name their gate
``scale_activation``); the engine's own tests cover models written otherwise.

Guided BP, Deconv and RectGrad: every ReLU call (module or functional) of the forward replaced,
through a torch function mode, by one whose backward is the papers' rectified gradient.
Integrated Gradients: the midpoint rule of its integral. SmoothGrad: the average gradient over
the noisy copies the method documents (its seeded generator, one draw per copy). Contrastive
LRP: the paper's Eq. 15 over two z⁺ references. DeepLIFT: the copy run on the inputs and the
zero reference stacked, every element-wise activation (ReLU, ReLU6, SiLU, tanh …) and max
pooling replaced (through a torch function mode) by one whose backward is the rule's multiplier,
and for RevealCancel and its ablation every affine layer's Δz split into the parts of Eq. 13,
carried through additions. AttnLRP on attention models: the papers' Gradient×Input form on the
copy, through a torch function mode (see :func:`reference_attn_lrp`).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

Linear = Callable[..., torch.Tensor]
"""The layer's linear map applied with another weight (and bias): ``lin(x, W[, b])``."""


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, 0 where the denominator is 0."""
    safe = torch.where(denominator == 0, torch.ones_like(denominator), denominator)
    return torch.where(denominator == 0, torch.zeros_like(numerator), numerator / safe)


def _stabilised(d: torch.Tensor, epsilon: float) -> torch.Tensor:
    return torch.where(d >= 0, d + epsilon, d - epsilon)


# --- the rules: f(x) whose vector-Jacobian product is the rule's signal map -----------------


@dataclass
class Zero:
    """LRP-0: ``s_in = Wᵀ(s ⊙ [z ≠ 0])``."""

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        return lin(x, weight) * (z != 0)


@dataclass
class Epsilon:
    """LRP-ε: ``s_in = Wᵀ(s ⊙ z / (z + ε·sign z))``."""

    epsilon: float = 1e-6

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        return lin(x, weight) * (z / _stabilised(z, self.epsilon))


@dataclass
class AlphaBeta:
    """LRP-αβ for inputs of either sign, bias not counted: ``α·pos/d⁺ − β·neg/d⁻``."""

    alpha: float = 2.0
    beta: float = 1.0

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        xp, xn = x.clamp(min=0), x.clamp(max=0)
        wp, wn = weight.clamp(min=0), weight.clamp(max=0)
        positive = lin(xp, wp) + lin(xn, wn)
        negative = lin(xp, wn) + lin(xn, wp)
        result = self.alpha * positive * _ratio(z, positive.detach())
        if self.beta:
            result = result - self.beta * negative * _ratio(z, negative.detach())
        return result


def z_plus() -> AlphaBeta:
    return AlphaBeta(1.0, 0.0)


@dataclass
class Gamma:
    """Generalised LRP-γ: the contributions agreeing in sign with ``z`` amplified by ``1 + γ``."""

    gamma: float = 0.25
    epsilon: float = 1e-6

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        up_w = weight + self.gamma * weight.clamp(min=0)
        down_w = weight + self.gamma * weight.clamp(max=0)
        up_b = down_b = None
        if bias is not None:
            up_b = bias + self.gamma * bias.clamp(min=0)
            down_b = bias + self.gamma * bias.clamp(max=0)
        xp, xn = x.clamp(min=0), x.clamp(max=0)
        up = lin(xp, up_w, up_b) + lin(xn, down_w)  # a bias has no gradient: kept in f
        down = lin(xp, down_w, down_b) + lin(xn, up_w)
        rising = z >= 0
        denominator = _stabilised(torch.where(rising, up, down).detach(), self.epsilon)
        return torch.where(rising, up, down) * _ratio(z, denominator)


@dataclass
class Excitation:
    """Excitation BP's W⁺ rule: ``s_in = W⁺ᵀ(s ⊙ z / W⁺x)``."""

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        positive = lin(x, weight.clamp(min=0))
        return positive * _ratio(z, positive.detach())


@dataclass
class ContrastiveExcitation:
    """Contrastive Excitation BP's output layer (Zhang et al.): ``Z⁺ − N⁺``, ``N⁺`` from ``−W``."""

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        positive, flipped = lin(x, weight.clamp(min=0)), lin(x, (-weight).clamp(min=0))
        return positive * _ratio(z, positive.detach()) - flipped * _ratio(z, flipped.detach())


@dataclass
class WSquare:
    """Deep Taylor's w² (input layer): relevance ``Σ_j w²_ji / Σ_i' w²_ji' · R_j``."""

    returns_relevance = True

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        squared = weight.square()
        return lin(x, squared) * _ratio(z, lin(torch.ones_like(x), squared))


@dataclass
class Flat:
    """The flat rule (input layer): w² with every weight 1."""

    returns_relevance = True

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        ones = torch.ones_like(weight)
        return lin(x, ones) * _ratio(z, lin(torch.ones_like(x), ones))


@dataclass
class ZBox:
    """Deep Taylor's z^B (input layer): ``(x w − l w⁺ − h w⁻) / Σ(…)``, relevance at ``x, l, h``."""

    low: float
    high: float
    returns_relevance = True

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        low = torch.full_like(x, self.low).requires_grad_(True)
        high = torch.full_like(x, self.high).requires_grad_(True)
        self.bounds = (low, high)
        parts = lin(x, weight) - lin(low, weight.clamp(min=0)) - lin(high, weight.clamp(max=0))
        return parts * _ratio(z, parts.detach())


@dataclass
class Pattern:
    """PatternNet's backward with the pattern ``A`` of layer ``name``, PatternAttribution's with
    ``A ⊙ W`` (Kindermans et al. 2018), for given patterns (their fitting is tested elsewhere)."""

    patterns: dict[str, torch.Tensor]
    attribution: bool

    def __call__(self, lin: Linear, x, weight, bias, z, name=""):
        pattern = self.patterns[name].to(weight)
        return lin(x, pattern * weight if self.attribution else pattern)


# --- the composites -------------------------------------------------------------------------


@dataclass
class Spec:
    """Which rule each layer gets: the input layer, convolutions, dense layers, lone BatchNorms."""

    conv: Callable
    dense: Callable
    lone_batchnorm: Callable
    first: Callable | None = None
    start: str = "logit"
    returns_signal: bool = False  # the signal at the input, not the relevance
    last: Callable | None = None  # the output layer's rule


PRESETS: dict[str, Callable[[], Spec]] = {
    "lrp.z": lambda: Spec(Zero(), Zero(), Zero()),
    "lrp.epsilon": lambda: Spec(Epsilon(), Epsilon(), Epsilon()),
    "lrp.zplus": lambda: Spec(z_plus(), z_plus(), Epsilon()),
    "lrp.alpha_beta": lambda: Spec(AlphaBeta(), AlphaBeta(), Epsilon()),
    "lrp.alpha2beta1": lambda: Spec(AlphaBeta(), AlphaBeta(), Epsilon()),
    "lrp.gamma": lambda: Spec(Gamma(), Gamma(), Epsilon()),
    "lrp.w2": lambda: Spec(z_plus(), z_plus(), Epsilon(), first=WSquare()),
    "lrp.zb": lambda: Spec(z_plus(), z_plus(), Epsilon(), first=ZBox(0.0, 1.0)),
    "lrp.flat": lambda: Spec(z_plus(), Epsilon(), Epsilon(), first=Flat()),
    "lrp.epsilon_plus": lambda: Spec(z_plus(), Epsilon(), Epsilon()),
    "lrp.custom": lambda: Spec(z_plus(), Epsilon(), Epsilon()),  # run with lrp_epsilon_plus()
    "lrp.epsilon_gamma": lambda: Spec(Gamma(), Epsilon(), Epsilon()),
    "lrp.epsilon_gamma_box": lambda: Spec(Gamma(), Epsilon(), Epsilon(), first=ZBox(0.0, 1.0)),
    "lrp.cmp": lambda: Spec(z_plus(), Zero(), Zero()),
    "excitation_bp": lambda: Spec(Excitation(), Excitation(), None, start="one"),
    "excitation_bp.contrastive": lambda: Spec(
        Excitation(), Excitation(), None, start="one", last=ContrastiveExcitation()
    ),
}
"""The registered LRP methods' default rules (``rules.py``'s and ``composites.py``'s tables)."""


# --- the copy with the rules attached --------------------------------------------------------

_CONV = {
    nn.Conv1d: F.conv1d,
    nn.Conv2d: F.conv2d,
    nn.Conv3d: F.conv3d,
}
_TRANSPOSED = {
    nn.ConvTranspose1d: F.conv_transpose1d,
    nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d,
}
_PASSED = (nn.GELU, nn.SiLU, nn.Hardswish, nn.ELU, nn.Mish, nn.LeakyReLU, nn.PReLU, nn.Tanh)


def _linear_map(module: nn.Module) -> Linear:
    if isinstance(module, nn.Linear):
        return lambda x, w, b=None: F.linear(x, w, b)
    for kind, conv in _CONV.items():
        if isinstance(module, kind):
            m = module
            return lambda x, w, b=None: conv(x, w, b, m.stride, m.padding, m.dilation, m.groups)
    for kind, conv in _TRANSPOSED.items():
        if isinstance(module, kind):
            m = module
            return lambda x, w, b=None: conv(
                x, w, b, m.stride, m.padding, m.output_padding, m.groups, m.dilation
            )
    raise TypeError(type(module).__name__)


def _batchnorm_scale(module: nn.Module) -> torch.Tensor:
    """A BatchNorm's per-channel factor ``γ / √(v + ε)`` at inference."""
    return module.weight.detach() / torch.sqrt(module.running_var + module.eps)


def _merged_weight(layer: nn.Module, scale: torch.Tensor) -> torch.Tensor:
    """``layer``'s weight with a BatchNorm's per-output-channel ``scale`` merged in."""
    return layer.weight.detach() * scale.reshape(_out_channel_shape(layer))


def _out_channel_shape(module: nn.Module) -> tuple[int, ...]:
    """How a per-output-channel factor broadcasts over the module's weight."""
    dims = module.weight.dim()
    if isinstance(module, tuple(_TRANSPOSED)):  # (in, out / groups, k…): outputs on axis 1
        if module.groups != 1:
            raise NotImplementedError("grouped transposed convolution followed by BatchNorm")
        return (1, -1) + (1,) * (dims - 2)
    return (-1,) + (1,) * (dims - 1)


def _replace(z: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """The value ``z`` with the gradient of ``f``."""
    return z.detach() + f - f.detach()


class _Reference:
    def __init__(self, model: nn.Module, spec: Spec) -> None:
        self.model = copy.deepcopy(model).double().eval()
        self.spec = spec
        self.input: torch.Tensor | None = None
        self.input_rule: Callable | None = None
        # output id → (the output, its layer, the layer's input, its rule); the output is kept
        # so that a later tensor with the same id is not taken for it
        self.produced: dict[int, tuple] = {}
        self.activation_inputs: dict[int, torch.Tensor] = {}
        self.names = {id(module): name for name, module in self.model.named_modules()}
        self.output_layer: nn.Module | None = None  # the last affine module called
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, *_CONV, *_TRANSPOSED)):
                module.register_forward_hook(self._affine)
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_hook(self._batchnorm)
            elif isinstance(module, nn.LayerNorm):
                module.register_forward_hook(self._layer_norm)
            elif isinstance(module, _PASSED):
                module.register_forward_pre_hook(self._keep_input)
                module.register_forward_hook(self._passed)
        for name, module in self.model.named_modules():
            if name.endswith("scale_activation"):
                module.register_forward_hook(lambda m, args, out: out.detach())

    def _rule_for(self, module: nn.Module, x: torch.Tensor) -> Callable:
        if module is self.output_layer and self.spec.last is not None:
            return self.spec.last
        if x is self.input and self.spec.first is not None:
            self.input_rule = self.spec.first
            return self.spec.first
        return self.spec.dense if isinstance(module, nn.Linear) else self.spec.conv

    def _affine(self, module, args, output):
        x = args[0]
        rule = self._rule_for(module, x)
        bias = module.bias.detach() if module.bias is not None else None
        weight = module.weight.detach()
        f = rule(_linear_map(module), x, weight, bias, output.detach(), self.names[id(module)])
        result = _replace(output, f)
        self.produced[id(result)] = (result, module, x, rule)
        return result

    def _batchnorm(self, module, args, output):
        x = args[0]
        scale = _batchnorm_scale(module)
        shift = module.bias.detach() - module.running_mean * scale
        z = output.detach()
        if id(x) in self.produced and self.produced[id(x)][0] is x:  # merged into its layer
            _, layer, layer_x, rule = self.produced[id(x)]
            weight = _merged_weight(layer, scale)
            bias = layer.bias.detach() if layer.bias is not None else torch.zeros_like(shift)
            name = self.names[id(layer)]
            f = rule(_linear_map(layer), layer_x, weight, bias * scale + shift, z, name)
            return _replace(output, f)
        if self.spec.lone_batchnorm is None:
            raise NotImplementedError("no rule for a BatchNorm that cannot be merged")
        per_channel = (1, -1) + (1,) * (x.dim() - 2)

        def lin(inputs: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None):
            return inputs * a.reshape(per_channel) + (0 if b is None else b.reshape(per_channel))

        rule = self.spec.lone_batchnorm
        return _replace(output, rule(lin, x, scale, shift, z, self.names[id(module)]))

    def _layer_norm(self, module, args, output):
        x = args[0]
        channels_first = type(module) is not nn.LayerNorm  # tests/zoo.py's LayerNorm2d
        if channels_first:
            x = x.permute(0, 2, 3, 1)
        axes = tuple(range(-len(module.normalized_shape), 0))
        centred = x - x.mean(axes, keepdim=True)
        scale = torch.sqrt(centred.detach().square().mean(axes, keepdim=True) + module.eps)
        y = centred / scale * module.weight.detach() + module.bias.detach()
        return y.permute(0, 3, 1, 2) if channels_first else y

    def _keep_input(self, module, args):
        # An in-place activation would overwrite its input: it gets a copy, the rule the original.
        self.activation_inputs[id(module)] = args[0]
        return (args[0].clone(), *args[1:])

    def _passed(self, module, args, output):
        x = self.activation_inputs.pop(id(module))
        with torch.enable_grad():  # f'(x) where x = 0, f(x)/x elsewhere
            probe = x.detach().clone().requires_grad_(True)
            # .forward: without the hooks; on a copy: an in-place activation must not write a leaf
            (slope,) = torch.autograd.grad(module.forward(probe.clone()).sum(), probe)
        ratio = torch.where(x == 0, slope, output.detach() / torch.where(x == 0, 1.0, x.detach()))
        return _replace(output, x * ratio)

    def relevance(self, x: torch.Tensor, signal_for: Callable) -> torch.Tensor:
        if self.spec.last is not None:  # a plain pass first, to find the output layer
            self._find_output_layer(x.detach().double())
        self.input = x.detach().double().clone().requires_grad_(True)
        output = self.model(self.input)
        signal = signal_for(output.detach())
        if self.spec.start == "one":
            signal = signal / output.detach()
        inputs = [self.input]
        if isinstance(self.input_rule, ZBox):
            inputs += list(self.input_rule.bounds)
        grads = torch.autograd.grad(output, inputs, signal)
        if self.spec.returns_signal:
            return grads[0]
        if getattr(self.input_rule, "returns_relevance", False):
            if isinstance(self.input_rule, ZBox):
                return sum(t.detach() * g for t, g in zip(inputs, grads, strict=True))
            return grads[0]
        return self.input.detach() * grads[0]

    def _find_output_layer(self, x: torch.Tensor) -> None:
        called: list[nn.Module] = []
        affine = [m for m in self.model.modules() if isinstance(m, (nn.Linear, *_CONV))]
        handles = [m.register_forward_pre_hook(lambda m, a: called.append(m)) for m in affine]
        spec, self.spec = self.spec, Spec(Zero(), Zero(), Zero())
        with torch.no_grad():
            self.model(x)
        self.spec = spec
        for handle in handles:
            handle.remove()
        self.output_layer = called[-1]


def _one_hot(target: int) -> Callable:
    def signal(output: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros_like(output)
        chosen[:, target] = 1.0
        return chosen

    return signal


def reference_relevance(
    model: nn.Module, x: torch.Tensor, method: str, target: int
) -> torch.Tensor:
    """The relevance ``method`` (a :data:`PRESETS` key) gives ``x`` for ``target``, in float64."""
    return _Reference(model, PRESETS[method]()).relevance(x, _one_hot(target))


def reference_pattern(
    model: nn.Module,
    x: torch.Tensor,
    patterns: dict[str, torch.Tensor],
    attribution: bool,
    target: int,
) -> torch.Tensor:
    """PatternNet's (or PatternAttribution's) signal at the input for ``target``, in float64."""
    rule = Pattern(patterns, attribution)
    spec = Spec(rule, rule, rule, returns_signal=True)
    return _Reference(model, spec).relevance(x, _one_hot(target))


def reference_contrastive_lrp(model: nn.Module, x: torch.Tensor, target: int) -> torch.Tensor:
    """Contrastive LRP (Gu et al. 2018, Eq. 15) over z⁺: ``max(0, n(R_target)) − n(R_others)``."""
    for_target = _Reference(model, PRESETS["lrp.zplus"]()).relevance(x, _one_hot(target))

    def others(output: torch.Tensor) -> torch.Tensor:
        return 1.0 - _one_hot(target)(output)

    for_others = _Reference(model, PRESETS["lrp.zplus"]()).relevance(x, others)

    def normalised(relevance: torch.Tensor) -> torch.Tensor:
        return relevance / relevance.sum(dim=tuple(range(1, relevance.dim())), keepdim=True)

    return normalised(for_target).clamp(min=0) - normalised(for_others)


# --- Guided BP, Deconv, RectGrad -------------------------------------------------------------


class _RectifiedReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mode: str, q: float) -> torch.Tensor:
        y = x.clamp(min=0)
        ctx.save_for_backward(y)
        ctx.mode, ctx.q = mode, q
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        if ctx.mode == "guided":  # Springenberg et al.: [g]⁺ where the ReLU was active
            return g.clamp(min=0) * (y > 0), None, None
        if ctx.mode == "deconv":  # Zeiler & Fergus: [g]⁺
            return g.clamp(min=0), None, None
        # Kim et al.: g where y ⊙ g exceeds its q-th percentile (per sample and layer)
        importance = (y * g).flatten(1)
        threshold = torch.quantile(importance, ctx.q / 100, dim=1, keepdim=True)
        return g * ((importance > threshold).reshape(g.shape) & (y > 0)), None, None


_RELUS = {F.relu, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_}


class _RectifyReLUs(TorchFunctionMode):
    def __init__(self, mode: str, q: float) -> None:
        super().__init__()
        self.mode, self.q = mode, q

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _RELUS:
            return _RectifiedReLU.apply(args[0], self.mode, self.q)
        return func(*args, **(kwargs or {}))


def reference_rectified(
    model: nn.Module, x: torch.Tensor, mode: str, target: int, q: float = 98.0
) -> torch.Tensor:
    """Guided BP (``"guided"``), Deconv (``"deconv"``) or RectGrad's signal at the input."""
    copy_ = copy.deepcopy(model).double().eval()
    inputs = x.detach().double().clone().requires_grad_(True)
    with _RectifyReLUs(mode, q):
        output = copy_(inputs)
    (signal,) = torch.autograd.grad(output[:, target].sum(), inputs)
    return signal


# --- Integrated Gradients, SmoothGrad -------------------------------------------------------------


def reference_integrated_gradients(
    model: nn.Module, x: torch.Tensor, target: int, steps: int = 20
) -> torch.Tensor:
    """Sundararajan et al.'s integral from the zero baseline by the midpoint rule, in float64.

    (Captum's own ``riemann_middle`` makes its path's points with float32 ``linspace``, which
    moves a deep ReLU net's path across activation boundaries: up to 7e-5 of the map's largest
    value on torchvision's VGG-16; ``tests/test_captum_drop_in.py`` compares with it on small
    nets.)
    """
    copy_ = copy.deepcopy(model).double().eval()
    x = x.detach().double()
    total = torch.zeros_like(x)
    for step in range(steps):
        point = (x * ((step + 0.5) / steps)).requires_grad_(True)
        (grad,) = torch.autograd.grad(copy_(point)[:, target].sum(), point)
        total += grad
    return x * total / steps


def reference_smoothgrad(
    model: nn.Module, x: torch.Tensor, target: int, samples: int = 25, noise_level: float = 0.15
) -> torch.Tensor:
    """Smilkov et al.'s average gradient over noisy copies, σ = level × each sample's range.

    The noise is the documented one: a generator on the input's device seeded with 0, one
    ``randn`` draw shaped like one sample per copy, the same for every sample.
    """
    copy_ = copy.deepcopy(model).double().eval()
    x = x.detach().double()
    spread = (x.flatten(1).amax(1) - x.flatten(1).amin(1)).reshape(-1, *(1,) * (x.dim() - 1))
    generator = torch.Generator(device=x.device).manual_seed(0)
    total = torch.zeros_like(x)
    for _ in range(samples):
        noise = torch.randn((1, *x.shape[1:]), generator=generator, dtype=x.dtype, device=x.device)
        noisy = (x + noise_level * spread * noise).requires_grad_(True)
        (grad,) = torch.autograd.grad(copy_(noisy)[:, target].sum(), noisy)
        total += grad
    return total / samples


# --- DeepLIFT ---------------------------------------------------------------------------------

_EPS = 1e-10


def _secant(
    delta_in: torch.Tensor, delta_out: torch.Tensor, derivative: torch.Tensor
) -> torch.Tensor:
    """An activation's ``Δy/Δx``; its ``derivative`` at the input where ``|Δx| < 1e-10``."""
    flat = delta_in.abs() < _EPS
    return torch.where(flat, derivative, delta_out / torch.where(flat, 1.0, delta_in))


Activation = Callable[[torch.Tensor], torch.Tensor]


def _derivative(f: Activation, at: torch.Tensor) -> torch.Tensor:
    """The element-wise ``f``'s derivative at ``at`` (autograd's, as the gradient methods')."""
    with torch.enable_grad():
        point = at.detach().requires_grad_(True)
        (slope,) = torch.autograd.grad(f(point).sum(), point)
    return slope


def _clamp(low: float | None, high: float | None) -> Activation:
    return lambda t: t.clamp(low, high)


# Each element-wise activation a forward may call → its function, out of place, from the call's
# arguments after the input (keyword or positional, in the torch function's order). DeepLIFT
# rescales them, AttnLRP passes relevance through them.
_ACTIVATIONS: dict[Callable, Callable[..., Activation]] = {
    F.relu: lambda inplace=False: _clamp(0.0, None),
    torch.relu: lambda: _clamp(0.0, None),
    torch.relu_: lambda: _clamp(0.0, None),
    torch.Tensor.relu: lambda: _clamp(0.0, None),
    torch.Tensor.relu_: lambda: _clamp(0.0, None),
    F.relu6: lambda inplace=False: _clamp(0.0, 6.0),
    F.hardtanh: lambda min_val=-1.0, max_val=1.0, inplace=False: _clamp(min_val, max_val),
    F.leaky_relu: lambda negative_slope=0.01, inplace=False: (
        lambda t: torch.where(t >= 0, t, t * negative_slope)
    ),
    F.elu: lambda alpha=1.0, inplace=False: lambda t: torch.where(t > 0, t, alpha * t.expm1()),
    F.silu: lambda inplace=False: lambda t: t * torch.sigmoid(t),
    F.gelu: lambda approximate="none": lambda t: F.gelu(t, approximate=approximate),
    F.hardswish: lambda inplace=False: lambda t: t * (t + 3).clamp(0, 6) / 6,
    F.hardsigmoid: lambda inplace=False: lambda t: (t + 3).clamp(0, 6) / 6,
    F.mish: lambda inplace=False: lambda t: t * torch.tanh(F.softplus(t)),
    torch.tanh: lambda: torch.tanh,
    torch.Tensor.tanh: lambda: torch.tanh,
    torch.sigmoid: lambda: torch.sigmoid,
    torch.Tensor.sigmoid: lambda: torch.sigmoid,
}


class _RescaledActivation(torch.autograd.Function):
    """``f`` on both halves; backward ``g ⊙ m`` to the input half, nothing to the reference."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f: Activation, multiplier: torch.Tensor) -> torch.Tensor:
        ctx.multiplier = multiplier
        return f(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        m = ctx.multiplier
        return torch.cat([g[: len(m)] * m, torch.zeros_like(g[len(m) :])]), None, None


class _SplitActivation(torch.autograd.Function):
    """``f`` on both halves; backward ``g ⊙ m⁺`` to the positive part, ``g ⊙ m⁻`` to the other."""

    @staticmethod
    def forward(ctx, x, f, positive, negative, m_pos, m_neg):
        ctx.m_pos, ctx.m_neg = m_pos, m_neg
        return f(x)

    @staticmethod
    def backward(ctx, g):
        g = g[: len(ctx.m_pos)]
        return None, None, g * ctx.m_pos, g * ctx.m_neg, None, None


class _RescaledMaxPool(torch.autograd.Function):
    """Max pooling whose ``Δy`` per window goes to the input's winner (up to the larger of the two
    maxima) and to the reference's winner (the rest), divided by each position's ``Δx``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, batch: int, kwargs: dict, pool: Callable) -> torch.Tensor:
        out, indices = pool(x, **kwargs, return_indices=True)
        ctx.batch, ctx.shape, ctx.indices = batch, x.shape, indices
        out_in, out_ref = out[:batch], out[batch:]
        top = torch.maximum(out_in, out_ref)
        ctx.parts = (top - out_ref, out_in - top)
        ctx.delta_in = x[:batch] - x[batch:]
        return out

    @staticmethod
    def backward(ctx, g):
        batch, (c, *spatial) = ctx.batch, ctx.shape[1:]
        g = g[:batch]

        def scatter(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            flat = torch.zeros(batch, c, math.prod(spatial), dtype=g.dtype, device=g.device)
            return flat.scatter_add_(2, indices.flatten(2), values.flatten(2)).reshape(
                batch, c, *spatial
            )

        to_input, to_reference = ctx.parts
        winners_in, winners_ref = ctx.indices[:batch], ctx.indices[batch:]
        split = scatter(g * to_input, winners_in) + scatter(g * to_reference, winners_ref)
        delta = ctx.delta_in
        flat = delta.abs() < _EPS
        grad = torch.where(flat, scatter(g, winners_in), split / torch.where(flat, 1.0, delta))
        return torch.cat([grad, torch.zeros_like(grad)]), None, None, None


_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__}
_ADDS |= {torch.Tensor.__iadd__, torch.Tensor.__radd__}
# Max pooling by name: the pooling function and its parameters after the input.
_POOL_KEYS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_MAX_POOLS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "max_pool2d": (F.max_pool2d, _POOL_KEYS),
    "_max_pool2d": (F.max_pool2d, _POOL_KEYS),
    "max_pool2d_with_indices": (F.max_pool2d, _POOL_KEYS),
    # adaptive windows: the global max of timm's avgmax and catavgmax heads
    "adaptive_max_pool2d": (F.adaptive_max_pool2d, ("output_size",)),
    "adaptive_max_pool2d_with_indices": (F.adaptive_max_pool2d, ("output_size",)),
}
# What carries an affine layer's parts unchanged to its output: a 1×1 convolution's head and
# its flatten (timm's DLA) are a Linear's.
_ARRANGING = {"flatten", "reshape", "view"}


class _DeepLiftReference(TorchFunctionMode):
    """Shrikumar et al.'s DeepLIFT on a copy run on ``[x; x⁰]``: Rescale, RevealCancel (Eq. 13)
    or its decoupled ablation, with Captum's max-pool rule."""

    def __init__(self, model: nn.Module, rule: str, batch: int) -> None:
        super().__init__()
        self.model = copy.deepcopy(model).double().eval()
        self.rule, self.batch = rule, batch
        self.parts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.consumed: dict[int, torch.Tensor] = {}
        self.produced: dict[int, tuple] = {}
        self.hooks = 0  # inside a hook: the reference's own operations pass through
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, *_CONV, *_TRANSPOSED)):
                module.register_forward_hook(self._hooked(self._affine))
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_hook(self._hooked(self._batchnorm))

    def _hooked(self, hook: Callable) -> Callable:
        def run(module, args, output):
            self.hooks += 1
            try:
                hook(module, args, output)
            finally:
                self.hooks -= 1

        return run

    # the parts of an affine layer's Δz, from its input's Δx split by sign
    def _register_parts(self, output, x, lin: Linear, weight) -> None:
        if self.rule == "rescale":
            return
        b = self.batch
        delta = x[:b] - x[b:]
        dpos, dneg = delta * (delta > 0), delta * (delta < 0)
        wp, wn = weight.clamp(min=0), weight.clamp(max=0)
        pp, nn_ = lin(dpos, wp), lin(dneg, wn)
        pn, np_ = lin(dpos, wn), lin(dneg, wp)
        if self.rule == "ablation":  # Eq. 13's values; the signal along W⁺ for r⁺, W⁻ for r⁻
            positive = pp + nn_.detach()
            negative = (pn + np_).detach() + nn_ - nn_.detach()
        else:
            positive, negative = pp + nn_, pn + np_
        self.parts[id(output)] = (output, positive, negative)

    def _affine(self, module, args, output):
        x = args[0]
        self.produced[id(output)] = (output, module, x)
        self._register_parts(output, x, _linear_map(module), module.weight.detach())

    def _batchnorm(self, module, args, output):
        x = args[0]
        scale = _batchnorm_scale(module)
        if id(x) in self.produced and self.produced[id(x)][0] is x:  # merged into its layer
            _, layer, layer_x = self.produced[id(x)]
            weight = _merged_weight(layer, scale)
            self._register_parts(output, layer_x, _linear_map(layer), weight)
            return
        shape = (1, -1) + (1,) * (x.dim() - 2)
        self._register_parts(output, x, lambda t, a: t * a.reshape(shape), scale)

    def _is_activation(self, value) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and value.shape[0] == 2 * self.batch
            and value.grad_fn is not None
        )

    def _split(self, tensor: torch.Tensor, pop: bool = False):
        entry = self.parts.get(id(tensor))
        fresh = entry is not None and entry[0] is tensor
        fresh = fresh and self.consumed.get(id(tensor)) is not tensor
        if pop:
            self.consumed[id(tensor)] = tensor
        if fresh:
            return entry[1], entry[2]
        delta = tensor[: self.batch] - tensor[self.batch :]
        return delta * (delta > 0), delta * (delta < 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hooks:
            return func(*args, **kwargs)
        if func in _ACTIVATIONS and args and self._is_activation(args[0]):
            return self._activation(args[0], _ACTIVATIONS[func](*args[1:], **kwargs))
        name = getattr(func, "__name__", "")
        if name in _MAX_POOLS and self._is_activation(args[0]) and not kwargs.get("return_indices"):
            function, keys = _MAX_POOLS[name]
            pool = dict(zip(keys, args[1:], strict=False))
            pool.update({k: v for k, v in kwargs.items() if k in keys})
            return _RescaledMaxPool.apply(args[0], self.batch, pool, function)
        result = func(*args, **kwargs)
        if name in _ARRANGING and self.rule != "rescale" and self._is_activation(result):
            entry = self.parts.get(id(args[0]))
            if entry is not None and entry[0] is args[0]:  # the parts stacked as the rows
                positive, negative = func(torch.cat(entry[1:]), *args[1:], **kwargs).chunk(2)
                self.parts[id(result)] = (result, positive, negative)
        if func in _ADDS and self.rule != "rescale" and self._is_activation(result):
            operands = [a for a in args[:2] if self._is_activation(a)]
            if operands and "alpha" not in kwargs:
                parts = [self._split(a) for a in operands]
                positive = sum(p for p, _ in parts)
                negative = sum(n for _, n in parts)
                self.parts[id(result)] = (result, positive, negative)
        return result

    def _activation(self, x: torch.Tensor, f: Activation) -> torch.Tensor:
        b = self.batch
        at, reference = x[:b].detach(), x[b:].detach()
        derivative = _derivative(f, at)
        if self.rule == "rescale":
            delta_in = x[:b].detach() - reference
            delta_out = f(at) - f(reference)
            return _RescaledActivation.apply(x, f, _secant(delta_in, delta_out, derivative))
        positive, negative = self._split(x, pop=True)
        p, n = positive.detach(), negative.detach()
        dy_pos = 0.5 * (f(reference + p) - f(reference)) + 0.5 * (
            f(reference + n + p) - f(reference + n)
        )
        dy_neg = 0.5 * (f(reference + n) - f(reference)) + 0.5 * (
            f(reference + p + n) - f(reference + p)
        )
        m_pos, m_neg = _secant(p, dy_pos, derivative), _secant(n, dy_neg, derivative)
        return _SplitActivation.apply(x, f, positive, negative, m_pos, m_neg)

    def attribution(self, x: torch.Tensor, target: int) -> torch.Tensor:
        x = x.detach().double()
        both = torch.cat([x, torch.zeros_like(x)]).requires_grad_(True)
        with self:
            output = self.model(both)
        b = self.batch
        start = torch.zeros_like(output[:b])
        start[:, target] = 1.0
        entry = self.parts.get(id(output))
        if entry is not None and entry[0] is output and self.consumed.get(id(output)) is None:
            (signal,) = torch.autograd.grad(entry[1:], both, (start, start))
        else:
            (signal,) = torch.autograd.grad(output, both, torch.cat([start, start * 0]))
        return x * signal[:b]


def reference_deeplift(model: nn.Module, x: torch.Tensor, rule: str, target: int) -> torch.Tensor:
    """DeepLIFT (``"rescale"``, ``"reveal_cancel"`` or ``"ablation"``) from the zero reference."""
    return _DeepLiftReference(model, rule, x.shape[0]).attribution(x, target)


# --- AttnLRP on attention models -------------------------------------------------------------

_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum", "mul", "__mul__"}
_PRODUCTS |= {"__rmul__"}
_SOFTMAX = {"softmax", "_softmax"}


class _AttnLRPReference(TorchFunctionMode):
    """AttnLRP (Achtibat et al. 2024) in its Gradient×Input form on a float64 copy.

    Every operation on input-dependent tensors runs as written but: a product of two or more of
    them (``@``, ``bmm``, ``baddbmm``, ``einsum``, ``*``) is the average of the product with all
    but one factor detached (the uniform rule), except ``*`` of a signal and a sigmoid-like gate
    (a sigmoid's or hard sigmoid's output, also reshaped or in arithmetic with a number: the
    squeeze-excitation of MaxViT's MBConv), which detaches the gate (Arras et al.'s
    signal-take-all, as the documented AttnLRP); ``layer_norm`` divides by its σ detached and
    ``normalize`` by its norm detached; an
    element-wise activation returns ``x ⊙ (f(x)/x)`` detached (``f'(0)`` at 0); softmax keeps
    its gradient. ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) is written out
    as its projections, products and softmax (self-attention without masks: torchvision's ViT).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(model).double().eval()
        self.dependent: dict[int, torch.Tensor] = {}
        self.gates: set[int] = set()  # ids of sigmoid-like gates (their tensors: dependent)
        self.softmax_seen = False

    def _is_dependent(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and self.dependent.get(id(value)) is value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, value in enumerate(flat) if self._is_dependent(value)]
        if not positions:
            return func(*args, **kwargs)
        if name == "multi_head_attention_forward":
            with self:  # written out: its operations seen one by one
                result = _self_attention(*args, **kwargs)
        elif name in _PRODUCTS and len(positions) > 1:
            gates = [p for p in positions if id(flat[p]) in self.gates]
            if name in _ELEMENTWISE_PRODUCTS and len(positions) == 2 and len(gates) == 1:
                flat[gates[0]] = flat[gates[0]].detach()  # the gate held: all to the signal
                call_args, call_kwargs = tree_unflatten(flat, spec)
                result = func(*call_args, **call_kwargs)
            else:
                result = self._uniform(func, flat, spec, positions)
        elif name == "layer_norm":
            result = _layer_norm_fixed_sigma(*args, **kwargs)
        elif name == "normalize":  # Swin V2's cosine attention: the norm held constant
            bound = inspect.signature(F.normalize).bind(*args, **kwargs).arguments
            x = bound["input"]
            norm = x.norm(bound.get("p", 2.0), bound.get("dim", 1), keepdim=True)
            result = x / norm.clamp_min(bound.get("eps", 1e-12)).detach()
        elif func in _ACTIVATIONS:  # DeepLIFT's table: each activation, out of place
            result = _pass_through(flat[positions[0]], _ACTIVATIONS[func](*args[1:], **kwargs))
        else:
            self.softmax_seen |= name in _SOFTMAX
            result = func(*args, **kwargs)
        gate = func in _SIGMOIDS or self._keeps_gate(name, args)
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self.dependent[id(value)] = value
                if gate:
                    self.gates.add(id(value))
        return result

    def _keeps_gate(self, name: str, args: tuple[Any, ...]) -> bool:
        """Whether the result is a gate still: one rearranged, or with a number added, …"""
        if name in _ARRANGING_GATES:
            return bool(args) and isinstance(args[0], torch.Tensor) and id(args[0]) in self.gates
        if name not in _NUMBER_ARITHMETIC or len(args) != 2:
            return False
        tensor, number = args if isinstance(args[0], torch.Tensor) else args[::-1]
        is_number = isinstance(number, (int, float)) and not isinstance(number, bool)
        return is_number and isinstance(tensor, torch.Tensor) and id(tensor) in self.gates

    @staticmethod
    def _uniform(func: Callable, flat: list, spec: Any, positions: list[int]) -> torch.Tensor:
        total = None
        for kept in positions:
            filled = list(flat)
            for position in positions:
                if position != kept:
                    filled[position] = flat[position].detach()
            call_args, call_kwargs = tree_unflatten(filled, spec)
            term = func(*call_args, **call_kwargs)
            total = term if total is None else total + term
        return total / len(positions)


_ATTENTION_ARGUMENTS = inspect.signature(F.multi_head_attention_forward)
_ELEMENTWISE_PRODUCTS = {"mul", "__mul__", "__rmul__"}
_SIGMOIDS = {torch.sigmoid, torch.Tensor.sigmoid, F.hardsigmoid}
# What a gate stays a gate through: its shape, and arithmetic with a number.
_ARRANGING_GATES = {"view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "flatten"}
_ARRANGING_GATES |= {"unsqueeze", "squeeze", "permute", "transpose", "contiguous", "__getitem__"}
_NUMBER_ARITHMETIC = {"mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub"}
_NUMBER_ARITHMETIC |= {"__sub__", "__rsub__", "div", "__truediv__"}


def _self_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``F.multi_head_attention_forward`` (sequence first) written out, for self-attention."""
    given = _ATTENTION_ARGUMENTS.bind(*args, **kwargs).arguments
    unsupported = ("bias_k", "bias_v", "key_padding_mask", "attn_mask", "q_proj_weight")
    if any(given.get(option) is not None for option in unsupported) or given.get("is_causal"):
        raise NotImplementedError("the reference writes out plain self-attention only")
    x, heads = given["query"], given["num_heads"]
    steps, batch, width = x.shape
    q, k, v = F.linear(x, given["in_proj_weight"], given["in_proj_bias"]).chunk(3, dim=-1)

    def split(t: torch.Tensor) -> torch.Tensor:  # (batch·heads, steps, width / heads)
        return t.reshape(steps, batch * heads, width // heads).transpose(0, 1)

    q, k, v = split(q), split(k), split(v)
    weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(width // heads), dim=-1)
    mixed = (weights @ v).transpose(0, 1).reshape(steps, batch, width)
    return F.linear(mixed, given["out_proj_weight"], given["out_proj_bias"]), None


def _layer_norm_fixed_sigma(
    input: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    centred = input - input.mean(dims, keepdim=True)
    sigma = torch.sqrt(input.var(dims, unbiased=False, keepdim=True) + eps)
    out = centred / sigma.detach()
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def _pass_through(x: torch.Tensor, f: Activation) -> torch.Tensor:
    """``x ⊙ (f(x)/x)`` with the ratio held constant (``f'(0)`` where ``x = 0``)."""
    at = x.detach()
    with torch.no_grad():
        zero = at == 0
        ratio = torch.where(zero, _derivative(f, at), f(at) / torch.where(zero, 1.0, at))
    return x * ratio


def reference_attn_lrp(model: nn.Module, x: torch.Tensor, target: int) -> tuple[torch.Tensor, bool]:
    """AttnLRP's map of class ``target``, and whether the model has an input-dependent softmax.

    Without one (a CNN) AttnLRP conserves on a bias-free model, which the zoo checks instead.
    """
    reference = _AttnLRPReference(model)
    inputs = x.detach().double().requires_grad_(True)
    reference.dependent[id(inputs)] = inputs
    with reference:
        output = reference.model(inputs)
    (grad,) = torch.autograd.grad(output[:, target].sum(), inputs)
    return inputs.detach() * grad, reference.softmax_seen
