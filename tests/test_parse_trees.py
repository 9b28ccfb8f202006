"""Parse-tree graphs: building (thresholds, backtracking, in-degree rule, modes), rendering,
the missing-`dot` behaviour, exports and the `explain parse-tree` command."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file

from explain_core.errors import GraphvizNotFoundError, InvalidInputError, MissingDependencyError
from explain_core.parse_trees import (
    ParseTreeData,
    build_parse_tree,
    class_parse_tree,
    collect_parse_tree_data,
    compare_parse_trees,
    dataset_parse_tree,
    default_thresholds,
    node_id,
    parse_tree,
    read_graphml,
    read_node_link_json,
    render_parse_tree,
    render_side_by_side,
    sample_parse_tree,
    text_tree,
    to_dot,
    write_graphml,
    write_node_link_json,
)

DOT = shutil.which("dot")
needs_dot = pytest.mark.skipif(
    DOT is None,
    reason="graphviz's `dot` program is not installed (Debian/Ubuntu: apt-get install graphviz; "
    "scripts/setup-env.sh with the graphs extra installs it where it can)",
)
SVG = "{http://www.w3.org/2000/svg}"


pytestmark = pytest.mark.usefixtures("restore_showwarning")


# --- hand-made couplings -----------------------------------------------------------------------
# Layer 1: 3 primary capsules; layer 2: 4 capsules (threshold 1/4 on c^[1]); layer 3: 2 classes
# (threshold 1/2 on c^[2]). L2:C3 receives no coupling above 1/4 (in-degree 0), L2:C1 couples
# to both classes with exactly 0.5 (not above the threshold).
C1 = torch.tensor(
    [
        [0.70, 0.10, 0.10, 0.10],
        [0.20, 0.50, 0.10, 0.20],
        [0.10, 0.10, 0.60, 0.20],
    ]
)
C2 = torch.tensor([[0.90, 0.10], [0.50, 0.50], [0.30, 0.70], [0.95, 0.05]])
A = [torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.6, 0.5, 0.4, 0.3]), torch.tensor([0.8, 0.2])]


def hand_tree(roots=(0,), **options):
    return build_parse_tree([C1, C2], A, roots, class_names=["zero", "one"], **options)


def edge_set(graph) -> set[tuple[str, str]]:
    return set(graph.edges())


def test_node_ids_are_stable_text():
    assert node_id(2, 5) == "L2:C5"
    assert node_id(torch.tensor(1), np.int64(0)) == "L1:C0"
    tree = hand_tree(keep_all_nodes=True)
    expected = {f"L{layer}:C{i}" for layer, n in ((1, 3), (2, 4), (3, 2)) for i in range(n)}
    assert set(tree.nodes) == expected
    assert sorted(hand_tree(keep_all_nodes=True).nodes) == sorted(tree.nodes)  # no hash()


def test_default_threshold_is_one_over_the_parent_count():
    assert default_thresholds([3, 4, 2]) == [0.25, 0.5]
    assert hand_tree().graph["thresholds"] == "0.25,0.5"


def test_backtracking_threshold_and_in_degree_rule():
    tree = hand_tree(roots=(0,))
    # L2:C1 -> class 0 is exactly 0.5 (not above); L2:C3 -> class 0 is 0.95 but deg⁻(L2:C3) = 0.
    assert edge_set(tree) == {("L1:C0", "L2:C0"), ("L2:C0", "L3:C0")}
    assert set(tree.nodes) == {"L1:C0", "L2:C0", "L3:C0"}
    assert tree.edges["L2:C0", "L3:C0"]["weight"] == pytest.approx(0.9)
    assert tree.edges["L1:C0", "L2:C0"]["layer"] == 1
    root = tree.nodes["L3:C0"]
    assert root["root"] and root["class_name"] == "zero" and root["label"] == "zero"
    assert tree.nodes["L2:C0"] == {
        "layer": 2,
        "index": 0,
        "activation": pytest.approx(0.6),
        "in_tree": True,
        "root": False,
        "label": "C0",
    }
    # Backtracking from class 1 reaches another branch only.
    assert edge_set(hand_tree(roots=(1,))) == {("L1:C2", "L2:C2"), ("L2:C2", "L3:C1")}


def test_custom_thresholds_and_no_backtracking():
    tree = hand_tree(roots=(0,), threshold=0.45)
    assert edge_set(tree) == {
        ("L1:C0", "L2:C0"),
        ("L1:C1", "L2:C1"),
        ("L2:C0", "L3:C0"),
        ("L2:C1", "L3:C0"),
    }
    assert edge_set(hand_tree(roots=(0,), threshold=[0.25, 0.45])) == edge_set(tree)
    everything = hand_tree(roots=(0,), backtrack=False)
    assert edge_set(everything) == {
        ("L1:C0", "L2:C0"),
        ("L1:C1", "L2:C1"),
        ("L1:C2", "L2:C2"),
        ("L2:C0", "L3:C0"),
        ("L2:C2", "L3:C1"),
    }
    # A low threshold lets L2:C3 in (in-degree 1 then) and keeps ties above 0.4.
    low = hand_tree(roots=(0,), threshold=0.15)
    assert ("L2:C3", "L3:C0") in edge_set(low) and ("L1:C1", "L2:C3") in edge_set(low)
    with pytest.raises(InvalidInputError, match="one value per routing layer"):
        hand_tree(threshold=[0.1])


def test_keep_all_nodes_marks_capsules_outside_the_tree():
    tree = hand_tree(keep_all_nodes=True)
    outside = {n for n, d in tree.nodes(data=True) if not d["in_tree"]}
    assert outside == {"L1:C1", "L1:C2", "L2:C1", "L2:C2", "L2:C3", "L3:C1"}
    assert edge_set(tree) == edge_set(hand_tree())


def test_bad_shapes_and_roots_are_clear_errors():
    with pytest.raises(InvalidInputError, match="classes to backtrack from"):
        hand_tree(roots=(2,))
    with pytest.raises(InvalidInputError, match="layer 2"):
        build_parse_tree([C1, C2.T], A, [0])
    with pytest.raises(InvalidInputError, match="L-1"):
        build_parse_tree([C1], A, [0])


def make_data() -> ParseTreeData:
    # Sample 0 and 2 are predicted as class 0, sample 1 as class 1.
    c1 = torch.stack([C1, C1.roll(1, dims=1), C1 * 0.5])
    c2 = torch.stack([C2, C2.flip(1), C2])
    acts = [torch.stack([a, a * 0.5, a * 0.25]) for a in A]
    return ParseTreeData.from_tensors([c1, c2], acts, torch.tensor([0, 1, 0]))


def test_sample_mode_backtracks_from_the_prediction_or_a_target():
    data = make_data()
    tree = sample_parse_tree(data, 0)
    assert edge_set(tree) == edge_set(hand_tree())
    assert tree.graph["mode"] == "sample" and tree.graph["sample"] == 0
    assert sample_parse_tree(data, 1).graph["roots"] == "L3:C1"
    assert sample_parse_tree(data, 1, target=0).graph["roots"] == "L3:C0"
    with pytest.raises(InvalidInputError, match="out of range"):
        sample_parse_tree(data, 3)


def test_class_mode_averages_couplings_and_activations_of_the_class():
    data = make_data()
    tree = class_parse_tree(data, 0)
    mean_c1 = (C1 + C1 * 0.5) / 2
    mean_c2 = C2  # both class-0 samples have C2
    expected = build_parse_tree([mean_c1, mean_c2], [a * 0.625 for a in A], [0])
    assert edge_set(tree) == edge_set(expected)
    for u, v, weight in tree.edges(data="weight"):
        assert weight == pytest.approx(expected.edges[u, v]["weight"])
    for n, activation in tree.nodes(data="activation"):
        assert activation == pytest.approx(expected.nodes[n]["activation"])
    assert tree.graph["n_samples"] == 2 and tree.graph["class_index"] == 0
    # The halved L1 couplings fall to 0.35, 0.25, 0.30 at their maxima: only 0.35 stays above 1/4.
    assert edge_set(tree) == {("L1:C0", "L2:C0"), ("L2:C0", "L3:C0")}
    labelled = class_parse_tree(data, 1, labels=torch.tensor([1, 0, 0]))
    assert labelled.graph["n_samples"] == 1
    assert edge_set(labelled) == {("L1:C2", "L2:C2"), ("L2:C2", "L3:C1")}
    with pytest.raises(InvalidInputError, match="no sample is predicted as class 1"):
        class_parse_tree(ParseTreeData.from_tensors([C1, C2], A), 1)


def test_dataset_mode_averages_everything_and_backtracks_from_predicted_classes():
    data = make_data()
    tree = dataset_parse_tree(data)
    stack = data.mean()
    assert tree.graph["roots"] == "L3:C0,L3:C1" and tree.graph["n_samples"] == 3
    expected = build_parse_tree(stack.couplings, stack.activations, [0, 1])
    assert edge_set(tree) == edge_set(expected)
    assert parse_tree(data).graph["mode"] == "dataset"
    assert parse_tree(data, cls=1).graph["mode"] == "class"
    assert dataset_parse_tree(data, roots=[1]).graph["roots"] == "L3:C1"


def test_parse_tree_data_quantises_with_rems_binning():
    import numpy as np

    from explain_capsules import rem
    from explain_core import quantisation

    assert rem.quantise_couplings is quantisation.quantise_couplings  # one implementation
    c = torch.rand(5, 7, 3)
    c[0, 0, :] = torch.tensor([0.05, 0.25, 0.75])  # on nominal half-way points of K = 11
    edges = np.linspace(-0.05, 1.05, 12)  # REM's public code
    expected = (np.digitize(c.double().numpy(), edges) - 1) / 10
    data = ParseTreeData.from_tensors([c], [torch.rand(5, 7), torch.rand(5, 3)], None)
    assert np.array_equal(data.quantised(11).couplings[0].numpy(), expected.astype(np.float32))
    data = make_data().quantised(3)
    assert data.levels == 3 and set(data.couplings[0].unique().tolist()) <= {0.0, 0.5, 1.0}


def test_text_tree_for_terminals():
    text = text_tree(hand_tree(roots=(0, 1), threshold=0.45), title="hand-made")
    lines = text.splitlines()
    assert lines[0] == "hand-made"
    assert lines[1].startswith("L3:C0 zero ‖u‖=0.80")
    assert any(line.startswith("├── L2:C0 C0") and "c=0.90" in line for line in lines)
    assert any("L1:C1 C1" in line for line in lines)
    assert lines.count("L3:C1 one ‖u‖=0.20") == 1


def test_text_tree_says_when_no_coupling_passes_the_threshold():
    # C2's strongest coupling into class 0 is 0.95: nothing is above 0.96.
    lines = text_tree(hand_tree(threshold=0.96)).splitlines()
    assert lines == [
        "L3:C0 zero ‖u‖=0.80",
        "(no edges: no coupling is above the thresholds 0.96,0.96)",
    ]
    assert "no edges" not in text_tree(hand_tree(threshold=0.45))


def test_graphml_and_node_link_json_round_trip(tmp_path: Path):
    tree = sample_parse_tree(make_data(), 0, title="round trip", keep_all_nodes=True)
    back = read_graphml(write_graphml(tree, tmp_path / "tree.graphml"))
    assert nx.utils.graphs_equal(tree, back)
    assert back.nodes["L3:C0"]["in_tree"] is True and isinstance(back.nodes["L1:C0"]["index"], int)
    path = write_node_link_json(tree, tmp_path / "tree.json")
    assert json.loads(path.read_text())["graph"]["title"] == "round trip"
    assert nx.utils.graphs_equal(tree, read_node_link_json(path))


# --- rendering ---------------------------------------------------------------------------------


def svg_titles(path: Path) -> tuple[set[str], set[str], list[str]]:
    root = ET.parse(path).getroot()
    nodes, edges = set(), set()
    for group in root.iter(f"{SVG}g"):
        title = group.find(f"{SVG}title")
        if group.get("class") == "node":
            nodes.add(title.text)
        elif group.get("class") == "edge":
            edges.add(title.text)
    texts = [t.text for t in root.iter(f"{SVG}text")]
    return nodes, edges, texts


@needs_dot
def test_rendered_svg_has_the_tree_nodes_and_edges(tmp_path: Path):
    tree = hand_tree(roots=(0,), threshold=0.45)
    rendered = render_parse_tree(tree, tmp_path / "tree.svg", title="hand-made")
    assert rendered.path == tmp_path / "tree.svg" and rendered.source_path.suffix == ".gv"
    nodes, edges, texts = svg_titles(rendered.path)
    capsules = {n for n in nodes if ":C" in n}
    assert capsules == set(tree.nodes)
    assert edges == {f"{u}->{v}" for u, v in tree.edges}
    assert "zero" in texts and "hand-made" in texts and "classes" in texts
    # Stronger couplings are drawn wider and more opaque.
    style = {}
    for group in ET.parse(rendered.path).getroot().iter(f"{SVG}g"):
        if group.get("class") == "edge":
            path = next(group.iter(f"{SVG}path"))
            width, opacity = float(path.get("stroke-width")), float(path.get("stroke-opacity"))
            style[group.find(f"{SVG}title").text] = (width, opacity)
    by_weight = sorted(tree.edges(data="weight"), key=lambda e: e[2])
    drawn = [style[f"{u}->{v}"] for u, v, _ in by_weight]
    assert drawn == sorted(drawn) and drawn[0] < drawn[-1]
    assert style["L2:C0->L3:C0"][0] == pytest.approx(0.4 + 3.6 * 0.9, abs=0.01)


@needs_dot
def test_png_pdf_and_side_by_side(tmp_path: Path):
    tree = hand_tree(keep_all_nodes=True)
    assert render_parse_tree(tree, tmp_path / "a.png").path.read_bytes()[:4] == b"\x89PNG"
    assert render_parse_tree(tree, tmp_path / "b", format="pdf").path.name == "b.pdf"
    assert (tmp_path / "b.pdf").read_bytes()[:4] == b"%PDF"
    both = render_side_by_side(
        [("DR-CapsNet+Q", tree), ("DR-CapsNet+REM", hand_tree(roots=(1,)))],
        tmp_path / "both.svg",
    )
    nodes, edges, texts = svg_titles(both.path)
    assert {"t1/L2:C3", "t2/L2:C2", "t2/L3:C1"} <= nodes and "t2/L2:C3" not in nodes
    assert "t2/L2:C2->t2/L3:C1" in edges
    assert "DR-CapsNet+Q" in texts and "DR-CapsNet+REM" in texts
    with pytest.raises(InvalidInputError, match="unknown picture format"):
        render_parse_tree(tree, tmp_path / "c.svg", format="jpg")


def test_dot_source_keeps_index_order_in_each_rank():
    source = to_dot(hand_tree(keep_all_nodes=True))
    assert 'rank=same\n\t\t"layer:2" -> "L2:C0" [style=invis, weight=8]' in source
    assert '"L2:C2" -> "L2:C3" [style=invis, weight=8]' in source
    assert '"layer:1" -> "layer:2" [style=invis, weight=50]' in source  # labels in a column
    assert "rankdir=BT" in source


def test_missing_dot_writes_the_source_and_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` anywhere
    tree = hand_tree()
    with pytest.raises(GraphvizNotFoundError, match="apt-get install graphviz") as caught:
        render_parse_tree(tree, tmp_path / "tree.svg")
    source = tmp_path / "tree.gv"
    assert caught.value.source_path == source
    assert '"L1:C0" -> "L2:C0"' in source.read_text()
    assert str(source) in str(caught.value) and "text_tree" in str(caught.value)
    assert not (tmp_path / "tree.svg").exists()
    # The same through graphviz's own exception, as raised where the binary is absent.
    import graphviz

    def no_dot(*args, **kwargs):
        raise graphviz.ExecutableNotFound(("dot",))

    monkeypatch.setattr(graphviz.Source, "pipe", no_dot)
    with pytest.raises(GraphvizNotFoundError):
        render_side_by_side([("a", tree), ("b", tree)], tmp_path / "pair.png")
    assert (tmp_path / "pair.gv").is_file()


def test_missing_python_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "networkx", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'explain-torch\[graphs\]'"):
        hand_tree()


# --- a trained multi-layer capsule net ---------------------------------------------------------

FACTORY = """
from explain_capsules import MultiLayerCapsNet


def build():
    return MultiLayerCapsNet(
        in_features=(1, 8, 8), primary_caps=8, hidden_layers=1, hidden_caps=8, dim=4
    )
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A small MultiLayerCapsNet (8 primary, 8 hidden, 10 classes) trained briefly on digits."""
    from explain_capsules.training import CapsuleTrainConfig, train_capsnet
    from explain_core.data import load_digits

    root = tmp_path_factory.mktemp("capsnet")
    module = f"pt_models_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(FACTORY)
    sys.path.insert(0, str(root))
    torch.manual_seed(0)
    try:
        model = __import__(module).build()
    finally:
        sys.path.remove(str(root))
    digits = load_digits()
    train_capsnet(
        model,
        digits.train_images,
        digits.train_labels,
        CapsuleTrainConfig(epochs=1, batch_size=32, lr=1e-2),
    )
    weights = root / "capsnet.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return model.eval(), digits, root, module, weights


def assert_paper_rules(tree, data: ParseTreeData) -> None:
    stack = data.sample(tree.graph["sample"]) if tree.graph["mode"] == "sample" else None
    thresholds = [float(t) for t in tree.graph["thresholds"].split(",")]
    (root,) = tree.graph["roots"].split(",")
    for u, v, attributes in tree.edges(data=True):
        layer = attributes["layer"]
        assert attributes["weight"] > thresholds[layer - 1]
        assert nx.has_path(tree, v, root)  # every edge leads up to the root
        if layer > 1 and stack is not None:  # the in-degree rule, on all couplings
            index = tree.nodes[u]["index"]
            assert int((stack.couplings[layer - 2][:, index] > thresholds[layer - 2]).sum()) >= 1


def test_trained_capsnet_trees_follow_the_paper_rules(trained):
    from explain_capsules import record_parse_tree_data

    model, digits, *_ = trained
    images = digits.test_images[:64]
    data = collect_parse_tree_data(model, images, levels=11)
    recorded = ParseTreeData.from_recording(record_parse_tree_data(model, images, levels=11))
    assert all(torch.equal(a, b) for a, b in zip(data.couplings, recorded.couplings, strict=True))
    assert torch.equal(data.predicted, recorded.predicted) and recorded.levels == 11
    assert data.sizes == [8, 8, 10]
    assert (data.predicted == digits.test_labels[:64]).float().mean() > 0.2  # it learned a bit
    sizes = []
    for index in range(8):
        tree = sample_parse_tree(data, index)
        assert tree.graph["roots"] == node_id(3, int(data.predicted[index]))
        assert_paper_rules(tree, data)
        sizes.append(tree.number_of_edges())
    assert max(sizes) > 0
    cls = int(data.predicted[0])
    assert class_parse_tree(data, cls).graph["n_samples"] == int((data.predicted == cls).sum())
    assert dataset_parse_tree(data).number_of_nodes() >= 1


def test_compare_two_recordings_side_by_side(trained, tmp_path: Path, monkeypatch):
    from explain_capsules import record_parse_tree_data

    model, digits, *_ = trained
    images = digits.test_images[:32]
    plain = record_parse_tree_data(model, images, levels=11)
    coarse = record_parse_tree_data(model, images, levels=3)
    titles = ("DR-CapsNet+Q", "DR-CapsNet+REM")
    results = compare_parse_trees(
        [plain, coarse], tmp_path, titles=titles, samples=[0, 1], classes=[], dataset=True
    )
    assert [r.key for r in results] == ["sample-0", "sample-1", "dataset"]
    assert all(len(r.graphs) == 2 for r in results)
    assert "DR-CapsNet+REM: sample 0, predicted" in results[0].text
    if DOT is not None:
        assert results[0].rendered.path == tmp_path / "sample-0.svg"
        nodes, _, _ = svg_titles(results[0].rendered.path)
        assert any(n.startswith("t2/L3:") for n in nodes)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (missing,) = compare_parse_trees(
        [plain, coarse], tmp_path / "no-dot", titles=titles, samples=[2], require_dot=False
    )
    assert missing.rendered is None and "apt-get install graphviz" in missing.error
    assert (tmp_path / "no-dot" / "sample-2.gv").is_file() and missing.text


# --- the command line --------------------------------------------------------------------------


@needs_dot
def test_cli_draws_an_input_a_class_and_the_dataset(trained, tmp_path, monkeypatch, capsys):
    model, digits, root, module, weights = trained
    monkeypatch.chdir(root)
    base = ["parse-tree", "--model", f"{module}:build", "--weights", str(weights)]
    sample = tmp_path / "digit.npy"
    np.save(sample, digits.test_images[0].numpy())
    code, out, err = run_cli(
        [*base, "--input", str(sample), "--out", str(tmp_path / "s.svg")], capsys
    )
    assert code == 0, err
    predicted = int(model(digits.test_images[:1]).argmax())
    assert f"digit.npy: predicted class {predicted}" in out and str(tmp_path / "s.svg") in out
    nodes, _, _ = svg_titles(tmp_path / "s.svg")
    assert f"L3:C{predicted}" in nodes
    expected = sample_parse_tree(collect_parse_tree_data(model, digits.test_images[:1]), 0)
    assert {n for n in nodes if ":C" in n} == set(expected.nodes)

    out_class = tmp_path / "class.png"
    argv = [*base, "--class", "3", "--levels", "11", "--out", str(out_class), "--text"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert out_class.read_bytes()[:4] == b"\x89PNG" and "class 3" in out
    assert "L3:C3 3 ‖u‖=" in out  # the text tree

    code, out, err = run_cli(
        [*base, "--dataset", "digits", "--threshold", "0.3", "--out", str(tmp_path / "all"),
         "--format", "pdf"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "all.pdf").read_bytes()[:4] == b"%PDF" and "all 450 samples" in out


def test_cli_errors_are_one_line(trained, tmp_path, monkeypatch, capsys):
    _, _, root, module, weights = trained
    monkeypatch.chdir(root)
    base = ["parse-tree", "--model", f"{module}:build", "--weights", str(weights)]
    out = ["--out", str(tmp_path / "t.svg")]
    plain = f"plain_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{plain}.py").write_text(
        "import torch\n\n\ndef build():\n    return torch.nn.Flatten()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    flat = f"flat_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{flat}.py").write_text(
        "from explain_capsules import MultiLayerCapsNet\n\n\n"
        "def build():\n    return MultiLayerCapsNet(in_features=64, hidden_layers=1)\n"
    )
    sample = tmp_path / "digit.npy"
    np.save(sample, np.zeros((1, 8, 8), np.float32))
    flat_input = ["parse-tree", "--model", f"{flat}:build", "--input", str(sample), *out]
    cases = [
        (["parse-tree", "--model", f"{plain}:build", *out], "has no routing layers"),
        (
            flat_input,
            "(batch, 64); got (1, 1, 8, 8); to take such inputs, build the model with "
            "MultiLayerCapsNet(in_features=(1, 8, 8))",
        ),
        (
            [*base, "--class", "0", "--out", str(tmp_path / "t.jpg")],
            "parse trees are drawn as svg, png, pdf; got .jpg",
        ),
        ([*base, "--class", "0", *out, "--format", "png"], "ends in .svg but --format is png"),
        ([*base, "--class", "11", *out], "no sample is predicted as class 11"),
        ([*base, "--input", str(tmp_path / "x.npy"), "--dataset", "digits", *out], "--dataset"),
        ([*base, "--levels", "1", *out], "--levels must be at least 2"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == 1, err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("explain: error:") and message in lines[0]
        assert lines[0].count("(batch, 64)") <= 1  # the accepted shape said once
    assert not list(tmp_path.glob("t.*"))  # no t.jpg.svg, no t.svg.png
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, stdout, err = run_cli([*base, "--class", "0", "--text", *out], capsys)
    assert code == 1 and "apt-get install graphviz" in err and len(err.splitlines()) == 1
    assert "L3:C0 0 ‖u‖=" in stdout and (tmp_path / "t.gv").is_file()


@needs_dot
def test_cli_says_when_no_coupling_passes_the_threshold(trained, tmp_path, monkeypatch, capsys):
    model, digits, root, module, weights = trained
    monkeypatch.chdir(root)
    sample = tmp_path / "digit.npy"
    np.save(sample, digits.test_images[0].numpy())
    argv = ["parse-tree", "--model", f"{module}:build", "--weights", str(weights), "--input",
            str(sample), "--threshold", "0.999", "--out", str(tmp_path / "t.svg")]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "1 capsules, 0 couplings" in out
    # Independently: the strongest coupling of the last routing layer into the predicted class.
    with torch.no_grad():
        predicted = int(model(digits.test_images[:1]).argmax())
    data = collect_parse_tree_data(model, digits.test_images[:1])
    strongest = float(data.sample(0).couplings[-1][:, predicted].max())
    assert err.splitlines() == [
        "explain: note: the tree has no edges: no coupling is above the threshold 0.999 (the "
        f"strongest into L3:C{predicted} is {strongest:.3g}); give a lower --threshold"
    ]
    code, _, err = run_cli([*argv[:-4], "--out", str(tmp_path / "t.svg")], capsys)
    assert code == 0 and err == ""  # the default threshold keeps couplings: nothing to say


def test_cli_help_lists_parse_tree(capsys):
    code, out, _ = run_cli(["parse-tree", "--help"], capsys)
    assert code == 0 and out.startswith("usage: explain parse-tree")
    for option in ("--input", "--class", "--dataset", "--threshold", "--levels", "--format"):
        assert option in out


@needs_dot
def test_explain_executable_end_to_end(trained, tmp_path):
    _, _, root, module, weights = trained
    explain = Path(sys.executable).parent / "explain"
    if not explain.exists():
        pytest.skip("the explain console script is not installed (pip install -e .)")
    result = subprocess.run(
        [str(explain), "parse-tree", "--model", f"{module}:build", "--weights", str(weights),
         "--class", "0", "--out", str(tmp_path / "tree.svg")],
        capture_output=True, text=True, timeout=120, cwd=root,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"-> {tmp_path / 'tree.svg'}" in result.stdout
    assert (tmp_path / "tree.svg").read_text().lstrip().startswith("<?xml")


# --- rendering: failing dot, labels, paths, depths ---------------------------------------------


def fake_dot(folder: Path, message: str) -> str:
    """A `dot` that exists but fails, as a graphviz without the PDF plugin does."""
    folder.mkdir()
    script = folder / "dot"
    script.write_text(f"#!/bin/sh\necho 'Warning: ignored' >&2\necho '{message}' >&2\nexit 1\n")
    script.chmod(0o755)
    return str(folder)


def test_a_failing_dot_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    from explain_core.errors import ExplainError
    from explain_core.parse_trees import GraphvizRenderError

    monkeypatch.setenv("PATH", fake_dot(tmp_path / "bin", 'Format: "pdf" not recognized'))
    with pytest.raises(GraphvizRenderError) as caught:
        render_parse_tree(hand_tree(), tmp_path / "t.pdf")
    message = str(caught.value)
    assert isinstance(caught.value, ExplainError) and "\n" not in message
    assert 'failed to draw t.pdf (exit status 1): Format: "pdf" not recognized.' in message
    assert "`dot -T?` lists the formats" in message and "Warning" not in message
    assert caught.value.source_path == tmp_path / "t.gv" and (tmp_path / "t.gv").is_file()
    assert not (tmp_path / "t.pdf").exists()
    assert capsys.readouterr().err == ""  # dot's stderr is in the message, not above it


def test_cli_says_in_one_line_that_dot_failed(trained, tmp_path, monkeypatch, capsys):
    _, _, root, module, weights = trained
    monkeypatch.chdir(root)
    path = fake_dot(tmp_path / "bin", 'Format: "pdf" not recognized')
    monkeypatch.setenv("PATH", path)
    argv = ["parse-tree", "--model", f"{module}:build", "--weights", str(weights), "--class",
            "0", "--out", str(tmp_path / "t.pdf")]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("explain: error: the graphviz `dot` program failed to draw t.pdf")


def dot_layout(source: str) -> tuple[dict, str]:
    """dot's own layout of ``source`` (JSON) and what it wrote on stderr."""
    done = subprocess.run(
        [DOT, "-Tjson"], input=source.encode(), capture_output=True, check=True, timeout=60
    )
    return json.loads(done.stdout), done.stderr.decode()


@needs_dot
def test_nodes_fit_their_labels_without_warnings():
    names = ["airplane", "automobile", "bird"]
    c = torch.tensor([[0.8, 0.1, 0.1]] * 3 + [[0.1, 0.8, 0.1]] * 1200)
    tree = build_parse_tree([c], [torch.rand(1203), torch.tensor([0.9, 0.2, 0.1])], [0, 1],
                            class_names=names, keep_all_nodes=True)  # fmt: skip
    layout, stderr = dot_layout(to_dot(tree))
    assert "too small for label" not in stderr
    for node in layout["objects"]:
        texts = [op for draw in node.get("_ldraw_", []) for op in [draw] if op["op"] == "T"]
        if not texts or ":C" not in node["name"]:
            continue
        # dot's own measure of the label against the node's width (inches → points)
        assert float(node["width"]) * 72 >= texts[0]["width"], node["name"]
    widths = {n["name"]: float(n["width"]) for n in layout["objects"] if ":C" in n["name"]}
    assert widths["L2:C1"] > widths["L2:C2"] > 0.41  # "automobile" wider than "bird" (0.42)


@needs_dot
def test_pictures_are_byte_identical_across_runs(tmp_path: Path):
    tree = hand_tree(keep_all_nodes=True)
    for suffix in ("svg", "png"):
        a = render_parse_tree(tree, tmp_path / f"a.{suffix}").path.read_bytes()
        b = render_parse_tree(tree, tmp_path / f"b.{suffix}").path.read_bytes()
        assert a == b


def test_picture_paths_that_are_not_files_are_refused(tmp_path: Path):
    from explain_core.files import OutputPathError

    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(OutputPathError, match=r"cannot write .*folder: it is a folder; give a"):
        render_parse_tree(hand_tree(), folder)
    with pytest.raises(InvalidInputError, match=r"path is empty; give a file name such as"):
        render_parse_tree(hand_tree(), "")
    with pytest.raises(InvalidInputError, match=r"path is empty"):
        render_side_by_side([("a", hand_tree())], "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_pictures_of_one_stem_share_their_source(tmp_path: Path, monkeypatch):
    # Documented: the source is named after the stem, so t.png's source replaces t.svg's.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for name, roots in (("t.svg", (0,)), ("t.png", (1,))):
        with pytest.raises(GraphvizNotFoundError) as caught:
            render_parse_tree(hand_tree(roots=roots), tmp_path / name)
        assert caught.value.source_path == tmp_path / "t.gv"
    (root,) = [
        line for line in (tmp_path / "t.gv").read_text().splitlines() if "doublecircle" in line
    ]
    assert root.lstrip().startswith('"L3:C1"')  # the second picture's root


def rank_rows(source: str) -> dict[str, set[str]]:
    """The DOT names in every ``rank=same`` subgraph, by subgraph name."""
    rows = {}
    for name, body in re.findall(r'subgraph "([^"]+)" \{(.*?)\n\t\}', source, re.S):
        rows[name] = set(re.findall(r'"([^"]+)"', body))
    return rows


def test_side_by_side_trees_of_different_depths_share_the_class_row():
    deep = hand_tree(keep_all_nodes=True)  # 3 layers
    shallow = build_parse_tree([C2], A[1:], [0], class_names=["zero", "one"])  # 2 layers
    rows = rank_rows(to_dot([("deep", deep), ("shallow", shallow)]))
    assert {"t1/L3:C0", "t1/L3:C1", "t2/L2:C0", "t1/layer:3", "t2/layer:2"} <= rows["row 0"]
    assert {"t1/L2:C0", "t2/L1:C0", "t1/layer:2", "t2/layer:1"} <= rows["row 1"]
    assert {"t1/L1:C0", "t1/layer:1"} <= rows["row 2"] and not any(
        name.startswith("t2/") for name in rows["row 2"]
    )


@needs_dot
def test_side_by_side_class_rows_are_drawn_at_one_height(tmp_path: Path):
    deep = hand_tree(keep_all_nodes=True)
    shallow = build_parse_tree([C2], A[1:], [0], class_names=["zero", "one"])
    rendered = render_side_by_side([("deep", deep), ("shallow", shallow)], tmp_path / "p.svg")
    heights = {}
    for group in ET.parse(rendered.path).getroot().iter(f"{SVG}g"):
        if group.get("class") == "node":
            shape = next(group.iter(f"{SVG}ellipse"), None)  # inside the tooltip's link
            if shape is not None:
                heights[group.find(f"{SVG}title").text] = float(shape.get("cy"))
    assert heights["t1/L3:C0"] == heights["t2/L2:C0"]
    assert heights["t1/L2:C0"] == heights["t2/L1:C0"] != heights["t1/L1:C0"]


# --- compare_parse_trees: everything checked first -------------------------------------------


def test_compare_checks_every_tree_before_drawing(tmp_path: Path):
    data = make_data()  # predicted 0, 1, 0
    only_zero = ParseTreeData.from_tensors(data.couplings, data.activations, torch.zeros(3).long())
    out = tmp_path / "cmp"
    with pytest.raises(InvalidInputError, match=r"^recording 2 \(B\): no sample is predicted as "
                       r"class 1; classes present: \[0\]$"):  # fmt: skip
        compare_parse_trees([data, only_zero], out, titles=("A", "B"), samples=[0], classes=[1])
    with pytest.raises(InvalidInputError, match="sample index 3 is out of range for 3"):
        compare_parse_trees([data, only_zero], out, titles=("A", "B"), samples=[0, 3])
    with pytest.raises(InvalidInputError, match="unknown picture format 'jpg'"):
        compare_parse_trees([data, only_zero], out, titles=("A", "B"), samples=[0], format="jpg")
    assert not out.exists()  # nothing written by any of them


def test_compare_names_negative_samples_by_their_index(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # the sources are written all the same
    data = make_data()
    results = compare_parse_trees(
        [data, data], tmp_path, titles=("A", "B"), samples=[-1, 0], require_dot=False
    )
    assert [r.key for r in results] == ["sample-2", "sample-0"]
    assert results[0].graphs[0].graph["sample"] == 2
    assert sorted(p.name for p in tmp_path.glob("*.gv")) == ["sample-0.gv", "sample-2.gv"]


# --- the command line: quantised routing, pruned weights, folders ------------------------------


@needs_dot
def test_cli_records_the_quantised_model_on_request(trained, tmp_path, monkeypatch, capsys):
    from explain_capsules.rem import quantised_routing

    model, digits, root, module, weights = trained
    monkeypatch.chdir(root)
    base = ["parse-tree", "--model", f"{module}:build", "--weights", str(weights), "--text",
            "--levels", "3", "--dataset", "digits"]  # fmt: skip
    code, out, err = run_cli(
        [*base, "--quantised-routing", "--out", str(tmp_path / "q.svg")], capsys
    )
    assert code == 0, err
    assert "couplings in 3 levels, routed with them" in out
    with quantised_routing(model, levels=3):
        routed = collect_parse_tree_data(model, digits.test_images, levels=3)
    plain = collect_parse_tree_data(model, digits.test_images, levels=3)
    assert not torch.equal(routed.predicted, plain.predicted)  # K = 3 changes predictions
    expected = text_tree(parse_tree(routed)).splitlines()
    assert out.splitlines()[1 : 1 + len(expected)] == expected
    code, out, err = run_cli([*base, "--out", str(tmp_path / "p.svg")], capsys)
    assert code == 0 and "routed with them" not in out
    assert out.splitlines()[1 : 1 + len(expected)] != expected
    assert all(layer.coupling_transform is None for layer in model.routing)  # put back


def test_cli_refuses_quantised_routing_without_levels_and_folders(trained, tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    _, _, root, module, weights = trained
    monkeypatch.chdir(root)
    base = ["parse-tree", "--model", f"{module}:build", "--weights", str(weights)]
    folder = tmp_path / "pictures"
    folder.mkdir()
    cases = [
        ([*base, "--quantised-routing", "--out", str(tmp_path / "t.svg")],
         "--quantised-routing needs --levels K (the number of levels)"),
        ([*base, "--class", "0", "--out", str(folder)],
         f"--out {folder} is a folder; give a picture file, e.g. --out {folder / 'tree.svg'}"),
    ]  # fmt: skip
    for argv, message in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == 1 and err.splitlines() == [f"explain: error: {message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pictures"]


PRUNED_FACTORY = """
from explain_capsules import DRCapsNet, MagnitudePruner


def plain():
    return DRCapsNet(image_size=8, conv_channels=4, primary_types=2, primary_dim=4, class_dim=4,
                     conv_kernel=3, primary_kernel=3, primary_stride=1)


def pruned():
    model = plain()
    MagnitudePruner(model, 0.5)
    return model
"""


def test_cli_says_how_to_load_pruned_weights(tmp_path, monkeypatch, capsys):
    from explain_capsules import MagnitudePruner
    from explain_core.loading import load_model

    module = f"pruned_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(PRUNED_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    model = __import__(module).plain()
    MagnitudePruner(model, 0.5).prune_to(0.5)
    weights = tmp_path / "pruned.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    argv = ["parse-tree", "--model", f"{module}:plain", "--weights", str(weights), "--class", "0",
            "--out", str(tmp_path / "t.svg")]  # fmt: skip
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert "pruned.safetensors holds pruned weights with REM pruning masks (class_capsules" in err
    assert "MagnitudePruner(model, 0.8)" in err and "remove_masks(model)" in err
    # The way it names: a factory that builds the pruner loads them.
    loaded = load_model(f"{module}:pruned", weights)
    assert torch.equal(loaded.class_capsules.weight_mask, model.class_capsules.weight_mask)
