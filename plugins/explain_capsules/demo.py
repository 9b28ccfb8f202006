"""The demo's capsule sections: REM on the 8×8 digits, and parse trees with and without REM.

Two multi-layer capsule nets (16 primary, 3×16 hidden, 10 class capsules of 8D) are trained on the
digits: one as it is (evaluated with couplings quantised into K = 11 levels, "+Q") and one with
REM's magnitude pruning during training ("+REM", same quantiser). REM's claim: pruning makes the
couplings of a class agree, so the per-class parse-tree dictionaries have fewer keys and lower
entropy at about the same accuracy.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from explain_capsules.models import MultiLayerCapsNet
from explain_capsules.pruning import (
    MagnitudePruner,
    PruningSchedule,
    default_prunable,
    train_with_pruning,
)
from explain_capsules.recording import record_parse_tree_data
from explain_capsules.rem import ParseTreeDictionary, quantise_couplings
from explain_capsules.training import CapsuleTrainConfig, train_capsnet
from explain_core.demo import DemoContext, DemoSection, DemoStep
from explain_core.training import accuracy

LEVELS = 11  # REM's quantiser: centres 0, 0.1, …, 1.0
TITLES = ("CapsNet+Q", "CapsNet+REM")
ARCH = {"primary_caps": 16, "hidden_layers": 3, "hidden_caps": 16, "dim": 8}


def set_levels(model: nn.Module, levels: int | None) -> None:
    """Quantise the couplings of every routing layer into ``levels`` at inference (None: off)."""
    transform = None if levels is None else partial(quantise_couplings, levels=levels)
    for layer in model.routing:
        layer.coupling_transform = transform


def sparsity(model: nn.Module) -> float:
    """Fraction of exactly-zero weights among the prunable weights."""
    params = dict(model.named_parameters())
    weights = [params[name].detach() for name in default_prunable(model)]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


def class_dictionary(model: nn.Module, images: torch.Tensor) -> ParseTreeDictionary:
    """REM's dictionary of the last layer's K-level couplings, per predicted class."""
    recording = record_parse_tree_data(model, images, levels=LEVELS)
    dictionary = ParseTreeDictionary(n_classes=model.classes)
    dictionary.update(recording.layers[-1].couplings, recording.predicted, LEVELS)
    return dictionary


class CapsulesREMDemoStep(DemoStep):
    """Train capsule nets with and without REM pruning; compare their parse-tree dictionaries."""

    title = "Capsules and REM: parse-tree dictionaries with and without pruning"
    order = 40
    provides = ("capsules",)

    def run(self, context: DemoContext) -> DemoSection:
        """Train (or load) both models, tabulate accuracy, sparsity, keys and entropy."""
        digits = context.digits()
        epochs = 6 if context.quick else 15  # pruned nets need a few epochs to recover
        target = 0.8
        config = {"epochs": epochs, "batch_size": 32, "lr": 3e-3, "seed": context.seed}
        settings = {"arch": {**ARCH, "in_features": [1, 8, 8]}, "train": config, "version": 1}
        rem_settings = {**settings, "sparsity": target, "layer_floor": 0.05}
        schedule = PruningSchedule.gradual(target, end=max(epochs - 3, 1))

        def build() -> MultiLayerCapsNet:
            return MultiLayerCapsNet(in_features=(1, 8, 8), **ARCH)

        def build_rem() -> MultiLayerCapsNet:
            model = build()
            MagnitudePruner(model, target, schedule=schedule, layer_floor=0.05)  # mask buffers
            return model

        def train(model: nn.Module) -> None:
            train_capsnet(
                model, digits.train_images, digits.train_labels, CapsuleTrainConfig(**config)
            )

        def train_rem(model: nn.Module) -> None:
            pruner = MagnitudePruner(model, target, schedule=schedule, layer_floor=0.05)
            train_with_pruning(
                model,
                digits.train_images,
                digits.train_labels,
                CapsuleTrainConfig(**config),
                pruner,
            )

        plain, _, cached_q = context.cached_model("capsnet-q", settings, build, train)
        rem, _, cached_rem = context.cached_model("capsnet-rem", rem_settings, build_rem, train_rem)
        models = dict(zip(TITLES, (plain, rem), strict=True))
        context.artefacts["capsule_models"] = models

        rows: dict[str, dict[str, Any]] = {}
        dictionaries = {}
        test = digits.test_images
        for name, model in models.items():
            set_levels(model, None)
            raw = accuracy(model, test, digits.test_labels)
            set_levels(model, LEVELS)
            quantised = accuracy(model, test, digits.test_labels)
            dictionary = class_dictionary(model, test)
            set_levels(model, None)
            dictionaries[name] = dictionary
            rows[name] = {
                "accuracy": raw,
                "accuracy_k11": quantised,
                "sparsity": sparsity(model),
                "mean_entropy_bits": dictionary.mean_entropy(),
                "mean_keys_per_class": float(dictionary.keys_per_class().float().mean()),
                "entropy_per_class": [float(v) for v in dictionary.entropy()],
                "keys_per_class": [int(v) for v in dictionary.keys_per_class()],
            }
        q, r = (rows[t] for t in TITLES)
        overview = [
            "| model | accuracy | accuracy, K = 11 | sparsity | mean entropy (bits) | "
            "mean keys per class |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {name} | {row['accuracy']:.1%} | {row['accuracy_k11']:.1%} | "
                f"{row['sparsity']:.1%} | {row['mean_entropy_bits']:.2f} | "
                f"{row['mean_keys_per_class']:.1f} |"
                for name, row in rows.items()
            ),
        ]
        per_class = [
            f"| class | keys {TITLES[0]} | keys {TITLES[1]} | entropy {TITLES[0]} | "
            f"entropy {TITLES[1]} |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in range(10):
            per_class.append(
                f"| {c} | {q['keys_per_class'][c]} | {r['keys_per_class'][c]} | "
                f"{q['entropy_per_class'][c]:.2f} | {r['entropy_per_class'][c]:.2f} |"
            )
        lower = r["mean_entropy_bits"] < q["mean_entropy_bits"]
        finding = (
            "REM lowers the mean parse-tree entropy here"
            if lower
            else "REM does not lower the mean parse-tree entropy in this run"
        )
        cached = " (weights from the cache)" if cached_q and cached_rem else ""
        return DemoSection(
            self.title,
            lines=[
                "Two multi-layer capsule nets (16 primary capsules, three hidden layers of 16, "
                f"10 class capsules, all 8D, 3 routing iterations) trained for {epochs} epochs on "
                f"the 8×8 digits{cached}: **{TITLES[0]}** as it is, **{TITLES[1]}** with global "
                f"magnitude pruning to {target:.0%} during training (gradual cubic schedule, at "
                "least 5% of every layer kept). Both are evaluated with their couplings "
                f"quantised into K = {LEVELS} levels at inference. A parse-tree dictionary "
                "counts, per predicted class, the distinct quantised coupling patterns of the "
                "last routing layer over the test set (keys) and their entropy "
                f"H = −Σ p log₂ p. {finding}: {q['mean_entropy_bits']:.2f} → "
                f"{r['mean_entropy_bits']:.2f} bits, {q['mean_keys_per_class']:.1f} → "
                f"{r['mean_keys_per_class']:.1f} keys per class, at "
                f"{q['accuracy_k11']:.1%} → {r['accuracy_k11']:.1%} test accuracy.",
                "",
                *overview,
                "",
                "Per class (test set, K = 11):",
                "",
                *per_class,
            ],
            accuracies={
                f"{TITLES[0]} (K = {LEVELS})": q["accuracy_k11"],
                f"{TITLES[1]} (K = {LEVELS}, {r['sparsity']:.0%} sparse)": r["accuracy_k11"],
            },
            summary={"levels": LEVELS, "epochs": epochs, "models": rows},
        )


class ParseTreesDemoStep(DemoStep):
    """Draw parse trees of both capsule nets side by side (needs the capsule step's models)."""

    title = "Parse trees with and without REM"
    order = 41
    provides = ("parse-trees",)

    def run(self, context: DemoContext) -> DemoSection:
        """Record both models on test digits and draw sample and class trees side by side."""
        models = context.artefacts.get("capsule_models")
        if models is None:
            return DemoSection(self.title, unavailable="the capsule step did not run")
        from explain_core.errors import MissingDependencyError
        from explain_core.extras import require
        from explain_core.parse_trees import compare_parse_trees

        try:
            require("networkx", "parse-tree graphs")
            require("graphviz", "rendering parse trees")
        except MissingDependencyError as error:
            return DemoSection(self.title, unavailable=" ".join(str(error).split()))
        digits = context.digits()
        count = 64 if context.quick else 200
        images = digits.test_images[:count]
        recordings = []
        for model in models.values():
            set_levels(model, LEVELS)
            recordings.append(record_parse_tree_data(model, images, levels=LEVELS))
            set_levels(model, None)
        samples = [0] if context.quick else [0, 1, 2]
        classes = [int(digits.test_labels[0])] if context.quick else [0, 3, 8]
        folder = context.out_dir / "parse_trees"
        compared = compare_parse_trees(
            recordings,
            folder,
            titles=TITLES,
            samples=samples,
            classes=classes,
            class_names=[str(c) for c in range(10)],
            format="svg",
            require_dot=False,
        )
        figures = [
            str(c.rendered.path.relative_to(context.out_dir)) for c in compared if c.rendered
        ]
        lines = [
            f"Parse trees of {TITLES[0]} (left) and {TITLES[1]} (right) on the same inputs, "
            f"couplings quantised into K = {LEVELS} levels: for single test digits (backtracked "
            "from each model's own prediction) and for whole classes (mean couplings over the "
            f"class's samples among the first {count} test digits). Nodes are capsules (layer 1 "
            "= primary; shade = activation ‖u‖), edges couplings above 1/|parents|; capsules "
            "outside the tree are faded. The `.gv` sources are beside the pictures.",
        ]
        errors = {c.error for c in compared if c.error}
        if errors:
            lines += [
                "",
                "Graphviz's `dot` program is missing, so the trees are given as text only "
                f"(install it to get pictures): {' '.join(sorted(errors)[0].split())}",
                "",
                "```",
                *compared[0].text.splitlines(),
                "```",
            ]
        return DemoSection(
            self.title,
            lines=lines,
            figures=figures,
            summary={
                "pictures": len(figures),
                "dot_missing": bool(errors),
                "trees": {
                    c.key: {t: g.number_of_edges() for t, g in zip(TITLES, c.graphs, strict=True)}
                    for c in compared
                },
            },
        )
