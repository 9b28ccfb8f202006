"""Every registered method on the real torchvision models at 224×224 (random weights, eval mode).

torchvision cannot be a dependency of the project (it replaces torch with a CUDA build), so this
runs in a throw-away environment (REFERENCE §4):

    python -m venv /tmp/tv-env
    /tmp/tv-env/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy pluggy tqdm safetensors
    /tmp/tv-env/bin/pip install --no-deps -e .  # the built-in methods register through it
    PYTHONPATH=.:plugins:exporters:tests /tmp/tv-env/bin/python benchmarks/check_torchvision_zoo.py

Each cell is what ``tests/zoo.py``'s ``method_outcome`` reports, with the same exact checks as
the test suite's table of the re-creations (``docs/zoo.md``): LRP-0, CP-LRP and AttnLRP conserve
on the bias-free twin, DeepLIFT sums to ``f(x) − f(0)``, the gradient methods equal autograd's,
every other method equals its float64 reference
(``tests/zoo_references.py``), every map is finite, refusals are one line naming the operation
and module. It writes ``benchmarks/results/torchvision_zoo.md`` and says where the real models'
outcomes differ from the re-creations' table; with ``--more`` it runs one architecture of each
other family of torchvision's classification zoo (AlexNet … MaxViT) and writes
``benchmarks/results/torchvision_zoo_more.md``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).parents[1] / "docs" / "zoo.md"
MODELS = (
    "resnet50",
    "vgg16_bn",
    "densenet121",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
    "regnet_y_400mf",
    "squeezenet1_1",
)
"""The architectures the test suite re-creates (``tests/zoo.py``, the table in ``docs/zoo.md``)."""
MORE_MODELS = (
    "alexnet",
    "googlenet",
    "inception_v3",
    "mnasnet1_0",
    "mobilenet_v2",
    "shufflenet_v2_x1_0",
    "resnext50_32x4d",
    "regnet_x_400mf",
    "vit_b_16",
    "swin_t",
    "swin_v2_t",
    "maxvit_t",
)
"""One of each other family of torchvision's classification zoo (``--more``): no re-creation."""


def _documented() -> dict[tuple[str, str], str]:
    """The re-creations' table in docs/zoo.md, by (method, model)."""
    lines = [line for line in DOCS.read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    names = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    table = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        method = cells[0].strip("`")
        table.update({(method, name): cell for name, cell in zip(names, cells[1:], strict=True)})
    return table


def _without_zero_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Linear layers initialised to zero (ViT's head) drawn at random: else every map is 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.any():
            torch.nn.init.normal_(module.weight, std=0.02)
    return model


def main() -> None:
    """Run the methods on the real models and write the table."""
    import torchvision
    from harness import registered_methods
    from zoo import method_outcome

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument(
        "--more",
        action="store_true",
        help="the other families (MORE_MODELS), written to torchvision_zoo_more.md",
    )
    parser.add_argument("--methods", nargs="*", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.models = args.models or list(MORE_MODELS if args.more else MODELS)
    results = RESULTS / ("torchvision_zoo_more.md" if args.more else "torchvision_zoo.md")
    torch.set_num_threads(args.threads)
    methods = args.methods or registered_methods()
    image = torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    documented = _documented()
    rows = ["| method | " + " | ".join(args.models) + " |", "|" + " --- |" * (len(args.models) + 1)]
    differences = []
    started = time.perf_counter()
    for method in methods:
        cells = []
        for name in args.models:

            def make(name: str = name) -> torch.nn.Module:
                return _without_zero_layers(getattr(torchvision.models, name)(weights=None))

            cell = method_outcome(method, make, image)
            cells.append(cell)
            expected = documented.get((method, name))
            if expected is not None and expected != cell:
                differences.append(
                    f"- `{method}` on {name}: real {cell!r}, re-creation {expected!r}"
                )
            print(f"{method:28s} {name:20s} {cell}", flush=True)
        rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
    seconds = time.perf_counter() - started
    script = "PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_torchvision_zoo.py"
    command = " ".join([script, *sys.argv[1:]])
    text = [
        "# Every method on the real torchvision models (224×224, random weights, eval mode)"
        + (": the other families" if args.more else ""),
        "",
        f"Run with torch {torch.__version__}, torchvision {torchvision.__version__} on "
        f"{platform.machine()} with {torch.get_num_threads()} threads in {seconds:.0f} s. "
        f"Command (in the environment the script's docstring sets up): `{command}`.",
        "",
        *rows,
        "",
    ]
    if not args.more:  # the other families have no re-creation to compare with
        text += [
            "Where the real models differ from the re-creations' table in `docs/zoo.md`:",
            "",
            *(differences or ["- nowhere"]),
            "",
        ]
    results.write_text("\n".join(text), encoding="utf-8")
    print("\n".join(text))
    if any("refuses: " in row for row in rows):
        sys.exit("a refusal the table does not recognise: see the cells marked 'refuses: '")


if __name__ == "__main__":
    main()
