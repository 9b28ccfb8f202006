"""explain() switches torch.compiler's process-wide stance to force_eager while it runs; a stance
that another thread sets meanwhile must survive it, and none of the attribution's may be left."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from explain_core import explain

dynamo = pytest.importorskip("torch._dynamo")
eval_frame = pytest.importorskip("torch._dynamo.eval_frame")


def _stance() -> str:
    return eval_frame._stance.stance


def _parked_attribution(model: nn.Module, x: torch.Tensor) -> tuple[threading.Thread, Any]:
    """Start an attribution in a thread, parked inside its forward until released."""
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def park(module: nn.Module, args: tuple) -> None:
        if threading.current_thread() is worker and not inside.is_set():
            inside.set()
            release.wait(30)

    def run() -> None:
        handle = model[0].register_forward_pre_hook(park)
        try:
            explain(model, x, "lrp.epsilon_plus", 0)
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            handle.remove()

    worker = threading.Thread(target=run)
    worker.start()
    assert inside.wait(30)

    def finish() -> None:
        release.set()
        worker.join(30)
        assert not errors, errors

    return worker, finish


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    return model, torch.rand(2, 4)


@pytest.fixture(autouse=True)
def _default_stance():
    torch.compiler.set_stance("default")
    yield
    torch.compiler.set_stance("default")


def test_a_stance_set_by_another_thread_during_an_attribution_is_kept():
    model, x = _model()
    _, finish = _parked_attribution(model, x)
    assert _stance() == "force_eager"
    torch.compiler.set_stance("eager_on_recompile")  # the service's own setting
    finish()
    assert _stance() == "eager_on_recompile"


def test_a_user_block_ending_during_an_attribution_leaves_no_stance_behind():
    model, x = _model()
    entered, leave = threading.Event(), threading.Event()

    def user_block() -> None:
        with torch.compiler.set_stance("fail_on_recompile"):
            entered.set()
            leave.wait(30)

    user = threading.Thread(target=user_block)
    user.start()
    assert entered.wait(30)
    _, finish = _parked_attribution(model, x)
    leave.set()
    user.join(30)
    finish()
    assert _stance() == "default"  # not the user's block's stance, which ended before


def test_the_stance_comes_back_after_an_attribution_alone():
    model, x = _model()
    torch.compiler.set_stance("eager_on_recompile")
    explain(model, x, "lrp.epsilon_plus", 0)
    assert _stance() == "eager_on_recompile"
