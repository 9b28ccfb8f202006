"""Small networks and references shared by the modified-backpropagation and faithfulness tests."""

import torch
import torch.nn.functional as F
from torch import nn

from explain_modbp import rules


def conv_net(channels, side, dense, *, batchnorm=False):
    """Conv-ReLU-MaxPool-Conv-[BN]-ReLU-Flatten, then Linear layers with ReLUs between them.

    ``channels`` is ``(input, first conv, second conv)``, ``side`` the spatial size after the
    pooling and ``dense`` the output sizes of the Linear layers. The model is in eval mode.
    """
    c_in, c1, c2 = channels
    layers = [
        nn.Conv2d(c_in, c1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1),
        *([nn.BatchNorm2d(c2)] if batchnorm else []),
        nn.ReLU(),
        nn.Flatten(),
    ]
    features = c2 * side * side
    for index, size in enumerate(dense):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(features, size))
        features = size
    return nn.Sequential(*layers).eval()


def randomise_batchnorm(model):
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.3, 0.3)
    return model


def vgg_bn(bias=True):
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=bias),
        nn.BatchNorm2d(6),
        nn.ReLU(inplace=True),
        nn.Conv2d(6, 6, 3, padding=1, bias=bias),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1, bias=bias),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(8 * 2 * 2, 16, bias=bias),
        nn.ReLU(),
        nn.Linear(16, 5, bias=bias),
    )
    return randomise_batchnorm(model).double().eval()


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=bias)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 12, stride=2)
        self.fc = nn.Linear(24, 4, bias=bias)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = self.layer1(x)
        x = self.layer2(x)
        pooled = torch.cat([F.adaptive_avg_pool2d(x, 1), x.mean((2, 3), keepdim=True)], dim=1)
        x = torch.flatten(pooled, 1)
        return self.fc(x)


def resnet(bias=True):
    return randomise_batchnorm(TinyResNet(bias)).double().eval()


def dense(layer: nn.Module, shape: tuple[int, ...]):
    """Weight matrix W (out × in) and bias vector b (out) of an affine layer, from its Jacobian."""
    n = int(torch.tensor(shape).prod())
    with torch.no_grad():
        zero = layer(torch.zeros(1, *shape, dtype=torch.float64)).reshape(-1)
        basis = torch.eye(n, dtype=torch.float64).reshape(n, *shape)
        columns = layer(basis).reshape(n, -1) - zero
    return columns.T.contiguous(), zero


def reference(rule, layer, x, relevance_out):
    """Matrix-form relevance R_i = Σ_j num_ij / den_j · R_j, per rule."""
    w, b = dense(layer, tuple(x.shape[1:]))
    flat_x = x.reshape(x.shape[0], -1)
    r = relevance_out.reshape(x.shape[0], -1)
    contributions = flat_x[:, None, :] * w[None]  # (batch, out, in): x_i W_ji
    wp, wn = w.clamp(min=0), w.clamp(max=0)

    def spread(num, den):
        safe = torch.where(den == 0, torch.ones_like(den), den)
        return (num * torch.where(den == 0, 0.0, r / safe)[:, :, None]).sum(1)

    if isinstance(rule, rules.Epsilon):
        z = contributions.sum(2) + b
        den = z + rule.epsilon * torch.where(z >= 0, 1.0, -1.0).double()
        out = spread(contributions, den)
    elif isinstance(rule, rules.Gamma):
        stabilise = lambda d: d + rule.epsilon * torch.where(d >= 0, 1.0, -1.0).double()  # noqa: E731
        # ρ⁺ amplifies positive parts, ρ⁻ negative ones; the dense reference's bias is b itself
        up_w, up_b = w + rule.gamma * wp, b + rule.gamma * b.clamp(min=0)
        down_w, down_b = w + rule.gamma * wn, b + rule.gamma * b.clamp(max=0)
        if not rule.generalised:  # w + γw⁺ for every sign
            num = flat_x[:, None, :] * up_w[None]
            out = spread(num, stabilise(num.sum(2) + up_b))
        else:  # z ≥ 0: x⁺ρ⁺(w) + x⁻ρ⁻(w) + ρ⁺(b); z < 0: x⁺ρ⁻(w) + x⁻ρ⁺(w) + ρ⁻(b)
            xp, xn = flat_x.clamp(min=0)[:, None, :], flat_x.clamp(max=0)[:, None, :]
            num_up, num_down = xp * up_w + xn * down_w, xp * down_w + xn * up_w
            rising = contributions.sum(2) + b >= 0
            num = torch.where(rising[:, :, None], num_up, num_down)
            den = torch.where(rising, num_up.sum(2) + up_b, num_down.sum(2) + down_b)
            out = spread(num, stabilise(den))
    elif isinstance(rule, rules.AlphaBeta):
        pos, neg = contributions.clamp(min=0), contributions.clamp(max=0)
        pos_b, neg_b = (b.clamp(min=0), b.clamp(max=0)) if rule.bias else (0.0, 0.0)
        out = rule.alpha * spread(pos, pos.sum(2) + pos_b)
        if rule.beta:
            out = out - rule.beta * spread(neg, neg.sum(2) + neg_b)
    elif isinstance(rule, rules.WSquare):
        num = (w**2)[None].expand_as(contributions)
        out = spread(num, num.sum(2))
    elif isinstance(rule, rules.Flat):
        num = (w != 0).double()[None].expand_as(contributions)
        out = spread(num, num.sum(2))
    elif isinstance(rule, rules.ZBox):
        low = torch.full_like(flat_x, rule.low)
        high = torch.full_like(flat_x, rule.high)
        num = contributions - low[:, None, :] * wp[None] - high[:, None, :] * wn[None]
        out = spread(num, num.sum(2))
    elif isinstance(rule, rules.ContrastiveExcitation):
        pos = flat_x[:, None, :] * wp[None]
        neg = flat_x[:, None, :] * (-w).clamp(min=0)[None]
        out = spread(pos, pos.sum(2)) - spread(neg, neg.sum(2))
    elif isinstance(rule, rules.Excitation):
        pos = flat_x[:, None, :] * wp[None]
        out = spread(pos, pos.sum(2))
    else:  # pragma: no cover
        raise AssertionError(rule)
    return out.reshape(x.shape)
