import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


def state_fingerprint(model: torch.nn.Module) -> dict:
    """Everything attribution must leave unchanged, in comparable form."""
    hook_names = [
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
    ]
    return {
        "state": {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
        "param_ids": {k: id(v) for k, v in model.named_parameters()},
        "buffer_ids": {k: id(v) for k, v in model.named_buffers()},
        "module_ids": {k: id(m) for k, m in model.named_modules()},
        "hooks": {
            k: [len(getattr(m, h, {})) for h in hook_names] for k, m in model.named_modules()
        },
        "attrs": {k: sorted(m.__dict__) for k, m in model.named_modules()},
        "training": {k: m.training for k, m in model.named_modules()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "state":
            assert before[key].keys() == after[key].keys()
            for name in before[key]:
                assert torch.equal(before[key][name], after[key][name]), name
        else:
            assert before[key] == after[key], key
