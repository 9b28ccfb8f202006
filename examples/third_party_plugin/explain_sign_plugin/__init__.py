"""An example third-party plugin: registers ``sign.gradient_sign``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from explain_core import Method, MethodResult, MethodSpec, hookimpl
from explain_core.targets import select_target


@dataclass
class GradientSign(Method):
    """The sign (-1, 0 or +1) of the gradient of the explained output w.r.t. the input."""

    def attribute(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        target: torch.Tensor | None,
        baselines: torch.Tensor | None,
    ) -> MethodResult:
        """Explain ``model`` at ``inputs``; see :meth:`explain_core.Method.attribute`."""
        x = inputs.detach().requires_grad_(True)
        with torch.enable_grad():
            output = model(x)
            chosen = select_target(output, target)  # None -> the predicted class
            explained = output.gather(1, chosen[:, None]).sum()
            (gradient,) = torch.autograd.grad(explained, x)
        return MethodResult(attribution=gradient.sign(), output=output.detach(), target=chosen)


@hookimpl
def explain_register_methods() -> list[MethodSpec]:
    """Tell explain_core which methods this plugin provides."""
    summary = "Sign of the gradient of the target output"
    return [MethodSpec("sign.gradient_sign", GradientSign, "gradient", summary)]
