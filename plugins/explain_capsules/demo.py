"""The demo's capsule sections: REM on the 8×8 digits, and parse trees with and without REM.

Two multi-layer capsule nets (16 primary, 3×16 hidden, 10 class capsules of 8D) are trained on the
digits: one as it is (evaluated with couplings quantised into K = 11 levels, "+Q") and one with
REM's magnitude pruning during training ("+REM", same quantiser). REM's claim: pruning makes the
couplings of a class agree, so the per-class parse-tree dictionaries have fewer keys and lower
entropy at about the same accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from explain_core.demo import DemoContext, DemoSection, DemoStep, word_list
from explain_core.training import accuracy

LEVELS = 11  # REM's quantiser: centres 0, 0.1, …, 1.0
TITLES = ("CapsNet+Q", "CapsNet+REM")
ARCH = {"primary_caps": 16, "hidden_layers": 3, "hidden_caps": 16, "dim": 8}

OWN_MODEL = """\
from explain_capsules import ParseTreeDictionary, record_parse_tree_data

recording = record_parse_tree_data(model, images, levels=11)  # couplings in K = 11 levels
dictionary = ParseTreeDictionary(n_classes=model.classes)
dictionary.update(recording.layers[-1].couplings, recording.predicted, 11)  # .entropy(), keys
"""

OWN_MODEL_TREES = """\
from explain_capsules import record_parse_tree_data
from explain_core.parse_trees import compare_parse_trees

recording = record_parse_tree_data(model, images, levels=11)
trees = compare_parse_trees([recording], "trees", titles=["my model"], samples=[0], classes=[])
print(trees[0].text)  # trees/sample-0.svg is the picture (needs graphviz's dot program)
"""


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
        for name, model in context.progress(models.items(), "evaluating", total=len(models)):
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
        summary = {"levels": LEVELS, "epochs": epochs, "target_sparsity": target, "models": rows}
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
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=rem_takeaways(summary),
        )


def rem_takeaways(summary: Mapping) -> list[str]:
    """The REM section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``models``: for each of :data:`TITLES`, its accuracies, sparsity, mean entropy,
            mean keys and entropy per class.

    Returns:
        Three sentences: what REM does to the dictionaries, what it costs in accuracy, and the
        classes that go against the mean.
    """
    q, r = (summary["models"][title] for title in TITLES)
    entropy = (q["mean_entropy_bits"], r["mean_entropy_bits"])
    keys = (q["mean_keys_per_class"], r["mean_keys_per_class"])
    verb = "lowers" if entropy[1] < entropy[0] else "does not lower"
    first = (
        f"REM {verb} the mean parse-tree entropy: {entropy[0]:.2f} → {entropy[1]:.2f} bits, "
        f"with {keys[0]:.1f} → {keys[1]:.1f} distinct coupling patterns per class."
    )
    change = r["accuracy_k11"] - q["accuracy_k11"]
    second = (
        f"Pruning {r['sparsity']:.0%} of the weights "
        + (
            f"costs {-100 * change:.1f} percentage points of test accuracy"
            if change < 0
            else f"costs no test accuracy (it changes by {100 * change:+.1f} points)"
        )
        + f" ({q['accuracy_k11']:.1%} → {r['accuracy_k11']:.1%}, couplings in K = "
        f"{summary['levels']} levels)."
    )
    pairs = list(zip(q["entropy_per_class"], r["entropy_per_class"], strict=True))
    falls = entropy[1] < entropy[0]
    against = [c for c, (a, b) in enumerate(pairs) if (b < a) != falls]  # equal: not falling
    if against:
        cases = word_list([f"{c} ({pairs[c][0]:.2f} → {pairs[c][1]:.2f})" for c in against])
        noun = "class" if len(against) == 1 else "classes"
        third = (
            f"Not every class follows the mean: the entropy "
            f"{'does not fall' if falls else 'falls'} "
            f"with REM for {noun} {cases}."
        )
    else:
        third = (
            f"Every class follows the mean: the entropy {'falls' if falls else 'does not fall'} "
            f"with REM for all {len(pairs)} classes."
        )
    return [first, second, third]


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
        from explain_core.plots import grid, save_figure

        try:
            require("networkx", "parse-tree graphs")
            require("graphviz", "rendering parse trees")
        except MissingDependencyError as error:
            return DemoSection(self.title, unavailable=" ".join(str(error).split()))
        digits = context.digits()
        count = 64 if context.quick else 200
        images, labels = digits.test_images[:count], digits.test_labels[:count]
        recordings = []
        for model in context.progress(models.values(), "recording", total=len(models)):
            set_levels(model, LEVELS)
            recordings.append(record_parse_tree_data(model, images, levels=LEVELS))
            set_levels(model, None)
        predicted = torch.stack([r.predicted for r in recordings], dim=1)  # (count, models)
        # The first digits, and the first one a model gets wrong: a tree of a wrong prediction.
        samples = [0] if context.quick else [0, 1, 2]
        wrong = (predicted != labels[:, None]).any(dim=1).nonzero().flatten().tolist()
        if wrong and wrong[0] not in samples:
            samples.append(wrong[0])
        classes = [int(labels[0])] if context.quick else [0, 3, 8]
        folder = context.out_dir / "parse_trees"
        options = {
            "class_names": [str(c) for c in range(10)],
            "format": "svg",
            "require_dot": False,
        }
        facts = {
            "samples": {
                str(i): {
                    "label": int(labels[i]),
                    "predicted": dict(zip(TITLES, predicted[i].tolist(), strict=True)),
                }
                for i in samples
            },
            "classes": {
                str(c): {
                    t: {
                        "predicted": int((predicted[:, m] == c).sum()),
                        "truly": int(((predicted[:, m] == c) & (labels == c)).sum()),
                    }
                    for m, t in enumerate(TITLES)
                }
                for c in classes
            },
        }
        compared, captions = [], {}
        for i in context.progress(samples, "sample trees"):
            fact = facts["samples"][str(i)]
            titles = [
                f"{t}, true {fact['label']}" + (" ✗ wrong" if p != fact["label"] else "")
                for t, p in fact["predicted"].items()
            ]
            (tree,) = compare_parse_trees(recordings, folder, titles=titles, samples=[i], **options)
            compared.append(tree)
            captions[tree.key] = _sample_caption(i, fact)
        for c in classes:
            fact = facts["classes"][str(c)]
            titles = [f"{t}, {n['truly']} of {n['predicted']} truly {c}" for t, n in fact.items()]
            (tree,) = compare_parse_trees(recordings, folder, titles=titles, classes=[c], **options)
            compared.append(tree)
            captions[tree.key] = _class_caption(c, fact)

        inputs_figure = "parse_trees/inputs.png"
        save_figure(
            grid(
                inputs=[images[i] for i in samples for _ in TITLES],
                labels=[int(labels[i]) for i in samples for _ in TITLES],
                predictions=[int(predicted[i, m]) for i in samples for m in range(len(TITLES))],
                column_titles=[f"sample {i}: {t}" for i in samples for t in TITLES],
                title="The digits of the sample trees, as each model sees them",
            ),
            context.out_dir / inputs_figure,
        )
        figures = [inputs_figure]
        figure_captions = {
            inputs_figure: "The digits whose trees follow, once per model, titled with the true "
            "label and that model's prediction (✗: wrong)."
        }
        for tree in compared:
            if tree.rendered:
                path = str(tree.rendered.path.relative_to(context.out_dir))
                figures.append(path)
                figure_captions[path] = captions[tree.key]
        lines = [
            f"Parse trees of {TITLES[0]} (left) and {TITLES[1]} (right) on the same inputs, "
            f"couplings quantised into K = {LEVELS} levels: for single test digits (backtracked "
            "from each model's own prediction, right or wrong) and for whole classes (mean "
            f"couplings over the samples each model predicts as that class among the first "
            f"{count} test digits, wrong ones included). Nodes are capsules (layer 1 = primary; "
            "shade = activation ‖u‖), edges couplings above 1/|parents|; capsules outside the "
            "tree are faded. The `.gv` sources are beside the pictures.",
            "",
            *[f"- {captions[tree.key]}" for tree in compared],
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
        summary = {
            "pictures": len(figures) - 1,
            "dot_missing": bool(errors),
            "trees": {
                c.key: {t: g.number_of_edges() for t, g in zip(TITLES, c.graphs, strict=True)}
                for c in compared
            },
            **facts,
        }
        return DemoSection(
            self.title,
            lines=lines,
            figures=figures,
            captions=figure_captions,
            summary=summary,
            own_model=OWN_MODEL_TREES,
            takeaways=tree_takeaways(summary),
        )


def _verdict(label: int, prediction: int) -> str:
    return f"{prediction} (right)" if prediction == label else f"{prediction} (wrong ✗)"


def _sample_caption(index: int, fact: Mapping) -> str:
    """What a sample's picture shows, in words: the true label and each model's prediction."""
    label = fact["label"]
    said = word_list([f"{t} predicts {_verdict(label, p)}" for t, p in fact["predicted"].items()])
    text = f"Sample {index}, a {label}: {said}."
    wrong = [t for t, p in fact["predicted"].items() if p != label]
    if wrong:
        text += (
            f" The tree{'s' * (len(wrong) > 1)} of {word_list(wrong)} "
            f"explain{'s' * (len(wrong) == 1)} a wrong prediction: backtracked from the "
            "predicted class, a tree shows how the model reached its answer."
        )
    return text


def _class_caption(cls: int, fact: Mapping) -> str:
    """What a class picture shows: how many samples each model predicts as it, how many truly."""
    parts = [
        f"{t} averages the {n['predicted']} digits it predicts as {cls} ({n['truly']} truly {cls})"
        for t, n in fact.items()
    ]
    return f"Class {cls}: {word_list(parts)}."


def tree_takeaways(summary: Mapping) -> list[str]:
    """The parse-tree section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``trees`` (picture → model → edges), ``samples`` (index → true label and each
            model's prediction) and ``classes`` (class → model → samples predicted and truly).

    Returns:
        Three sentences: which model's trees are smaller, which trees explain wrong
        predictions, and how pure the class trees are.
    """
    edges = {t: [tree[t] for tree in summary["trees"].values()] for t in TITLES}
    mean = {t: sum(values) / len(values) for t, values in edges.items()}
    smaller = min(TITLES, key=mean.__getitem__)
    first = (
        f"{smaller}'s trees are the smaller ones: "
        + word_list([f"{mean[t]:.1f} edges for {t}" for t in TITLES])
        + f" on average over the {len(summary['trees'])} pictures."
        if mean[TITLES[0]] != mean[TITLES[1]]
        else f"Both models' trees have {mean[TITLES[0]]:.1f} edges on average."
    )
    wrong = [
        f"sample {i} (a {fact['label']}, predicted "
        + word_list([f"{p} by {t}" for t, p in fact["predicted"].items() if p != fact["label"]])
        + ")"
        for i, fact in summary["samples"].items()
        if any(p != fact["label"] for p in fact["predicted"].values())
    ]
    shown = len(summary["samples"])
    second = (
        f"{len(wrong)} of the {shown} sample pictures {'shows' if len(wrong) == 1 else 'show'} "
        f"trees of wrong predictions, {word_list(wrong)}: a tree shows how the model reached "
        "its answer, not where the true digit is."
        if wrong
        else f"All {shown} sample pictures show trees of right predictions."
    )
    purity = {
        (c, t): n["truly"] / n["predicted"]
        for c, per_model in summary["classes"].items()
        for t, n in per_model.items()
        if n["predicted"]
    }
    (c, t) = min(purity, key=purity.__getitem__)
    n = summary["classes"][c][t]
    if purity[(c, t)] < 1:
        third = (
            f"The class trees average whatever a model predicts: {t}'s class-{c} tree holds "
            f"{n['predicted'] - n['truly']} of {n['predicted']} digits of other classes."
        )
    else:
        digits = sum(
            n["predicted"] for per_model in summary["classes"].values() for n in per_model.values()
        )
        third = (
            f"No class tree mixes in other classes: all {digits} digits they average are truly "
            "of their tree's class."
        )
    return [first, second, third]
