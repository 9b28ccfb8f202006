"""Render parse trees of a capsule network: one digit, one class, the whole test set.

A multi-layer capsule net (16 primary capsules, three hidden layers of 16, 10 class capsules) is
trained briefly on the bundled 8×8 digits; its couplings are recorded on test digits, quantised
into K = 11 levels as in REM, and turned into parse trees (networkx graphs). Pictures need the
graphs extra and graphviz's ``dot`` program; without ``dot`` the ``.gv`` sources and the text
trees are still written.

Run from the repository root (a few seconds)::

    .venv/bin/python examples/parse_trees.py --out parse-trees
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from explain_capsules import (
    CapsuleTrainConfig,
    MultiLayerCapsNet,
    record_parse_tree_data,
    train_capsnet,
)
from explain_core.data import load_digits
from explain_core.errors import GraphvizNotFoundError
from explain_core.parse_trees import (
    parse_tree,
    render_parse_tree,
    text_tree,
    write_graphml,
)

LEVELS = 11


def main(out: Path, epochs: int = 5) -> dict[str, object]:
    """Train, record, build and draw the trees; returns what was written."""
    torch.set_num_threads(1)  # small model: one thread is fastest
    digits = load_digits()
    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=(1, 8, 8))
    config = CapsuleTrainConfig(epochs=epochs, batch_size=32, lr=3e-3)
    train_capsnet(model, digits.train_images, digits.train_labels, config)
    model.eval()

    recording = record_parse_tree_data(model, digits.test_images[:200], levels=LEVELS)
    predicted = int(recording.predicted[0])
    trees = {
        "sample-0": parse_tree(recording, sample=0),  # backtracked from its predicted class
        f"class-{predicted}": parse_tree(recording, cls=predicted),  # mean over the class
        "dataset": parse_tree(recording, threshold=0.2),  # all 200 samples
    }
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, object] = {"pictures": [], "graphml": [], "dot_missing": False}
    for name, tree in trees.items():
        (out / f"{name}.txt").write_text(text_tree(tree) + "\n", encoding="utf-8")
        written["graphml"].append(write_graphml(tree, out / f"{name}.graphml"))
        try:
            written["pictures"].append(render_parse_tree(tree, out / f"{name}.svg").path)
        except GraphvizNotFoundError as missing:  # the .gv source is written all the same
            written["dot_missing"] = True
            print(f"{name}: {missing}")
    print(text_tree(trees["sample-0"]))
    print(f"wrote {len(written['pictures'])} pictures and {len(trees)} GraphML files to {out}")
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("parse-trees"), help="output folder")
    parser.add_argument("--epochs", type=int, default=5, help="training epochs")
    arguments = parser.parse_args()
    main(arguments.out, arguments.epochs)
