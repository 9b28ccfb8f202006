"""The relevance engine: modified backpropagation on ordinary PyTorch models.

A :class:`Composite` maps modules, layer positions and traced operations to
:class:`~explain_core.Rule` objects; :class:`ModifiedBackprop` traces the model once (checking
that it can see every operation), applies the composite's canonizers to the traced layers and
runs the model with the rules attached, in the calling thread only. :class:`OpHandler` changes
operations for a whole pass where a per-tensor rule cannot (DeepLIFT's reference half).
"""

from explain_core.engine.attach import LayerRecord
from explain_core.engine.backprop import BackwardResult, ForwardPass, ModifiedBackprop
from explain_core.engine.composite import Composite
from explain_core.engine.ops import OpHandler
from explain_core.engine.plan_cache import clear_plan_cache

__all__ = [
    "BackwardResult",
    "Composite",
    "ForwardPass",
    "LayerRecord",
    "ModifiedBackprop",
    "OpHandler",
    "clear_plan_cache",
]
