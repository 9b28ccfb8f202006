"""Output paths that cannot be written, and parse trees that are not parse trees.

Every writer (``write_atomically``, parse-tree pictures and exports) reports a bad path as one
``OutputPathError`` naming the caller's path, never the hidden temporary file, and writes nothing.
The suite runs as root, so unwritable folders are simulated by a failing ``mkstemp`` (as in
``/proc``) or made by putting a file where a folder should be.
"""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path

import pytest
import torch

from explain_core.errors import InvalidInputError
from explain_core.files import (
    OutputPathError,
    check_output_folder,
    check_output_path,
    temporary_beside,
    write_atomically,
)

nx = pytest.importorskip("networkx")

from explain_core.parse_trees import (  # noqa: E402
    build_parse_tree,
    parse_tree,
    render_parse_tree,
    render_side_by_side,
    text_tree,
    to_dot,
    to_node_link,
    write_graphml,
    write_node_link_json,
)


@pytest.fixture
def blocker(tmp_path: Path) -> Path:
    """A regular file where a folder would have to be."""
    path = tmp_path / "blocker"
    path.write_text("a regular file")
    return path


@pytest.fixture
def no_new_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Folders refuse new files, as /proc does (root ignores permission bits)."""

    def refuse(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)


def tree():
    couplings = [torch.tensor([[0.9, 0.1], [0.2, 0.8]])]
    activations = [torch.tensor([0.9, 0.8]), torch.tensor([0.7, 0.3])]
    return build_parse_tree(couplings, activations, [0])


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- the checks in explain_core.files ----------------------------------------------------------


def test_output_path_checks_create_nothing(tmp_path: Path) -> None:
    assert check_output_path(tmp_path / "new" / "deeper" / "t.svg") == (
        tmp_path / "new" / "deeper" / "t.svg"
    )
    assert check_output_folder(str(tmp_path / "out")) == tmp_path / "out"
    assert listing(tmp_path) == []


def test_path_that_is_a_folder(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match=r"is a folder; give a file name"):
        check_output_path(tmp_path)
    with pytest.raises(OutputPathError, match=r"is a folder"):
        write_atomically(tmp_path, b"data")
    assert listing(tmp_path) == []


def test_parent_that_is_a_file(blocker: Path) -> None:
    with pytest.raises(OutputPathError, match=r"blocker is a file, not a folder"):
        check_output_path(blocker / "t.svg")
    with pytest.raises(OutputPathError, match=r"cannot create the output folder .*sub"):
        check_output_path(blocker / "sub" / "t.svg")
    with pytest.raises(OutputPathError, match=r"cannot create output folder .*blocker is a file"):
        check_output_folder(blocker / "out")
    with pytest.raises(OutputPathError, match=r"a file of that name exists"):
        check_output_folder(blocker)
    assert blocker.read_text() == "a regular file"


def test_write_atomically_names_the_callers_path(blocker: Path) -> None:
    target = blocker / "sub" / "t.json"
    with pytest.raises(OutputPathError) as caught:
        write_atomically(target, b"{}")
    message = str(caught.value)
    assert str(target) in message and ".t.json-" not in message
    assert "choose a path in a folder that exists" in message


def test_folder_that_refuses_new_files(tmp_path: Path, no_new_files: None) -> None:
    target = tmp_path / "t.gv"
    with pytest.raises(OutputPathError, match=r"does not accept new files \(no such file"):
        check_output_path(target)
    with pytest.raises(OutputPathError) as caught, temporary_beside(target):
        pass
    assert str(target) in str(caught.value) and ".t.gv-" not in str(caught.value)
    with pytest.raises(OutputPathError, match=r"cannot write into output folder"):
        check_output_folder(tmp_path / "out")


def test_output_path_error_is_both_a_user_error_and_an_os_error() -> None:
    # Callers that tolerate unwritable places (the demo's model cache) catch OSError.
    assert issubclass(OutputPathError, InvalidInputError)
    assert issubclass(OutputPathError, OSError)


# --- parse-tree writers ------------------------------------------------------------------------


def test_render_to_a_path_under_a_file_writes_nothing(blocker: Path) -> None:
    with pytest.raises(OutputPathError, match=r"cannot write .*t\.svg: .*blocker is a file"):
        render_parse_tree(tree(), blocker / "t.svg")
    with pytest.raises(OutputPathError, match=r"blocker is a file"):
        render_side_by_side([("a", tree())], blocker / "t.png")
    assert listing(blocker.parent) == ["blocker"]


def test_render_to_a_folder_that_refuses_files(tmp_path: Path, no_new_files: None) -> None:
    with pytest.raises(OutputPathError) as caught:
        render_parse_tree(tree(), tmp_path / "t.svg")
    message = str(caught.value)
    assert "t.svg" in message and ".gv-" not in message and "does not accept new files" in message


def test_graph_exports_refuse_bad_paths(tmp_path: Path, blocker: Path) -> None:
    with pytest.raises(OutputPathError, match=r"is a folder"):
        write_graphml(tree(), tmp_path)
    with pytest.raises(OutputPathError, match=r"blocker is a file"):
        write_graphml(tree(), blocker / "t.graphml")
    with pytest.raises(OutputPathError, match=r"blocker is a file"):
        write_node_link_json(tree(), blocker / "t.json")
    assert listing(tmp_path) == ["blocker"]


@pytest.mark.parametrize(
    "call",
    [
        lambda graph, folder: text_tree(graph),
        lambda graph, folder: to_dot(graph),
        lambda graph, folder: to_node_link(graph),
        lambda graph, folder: render_parse_tree(graph, folder / "t.svg"),
        lambda graph, folder: write_graphml(graph, folder / "t.graphml"),
        lambda graph, folder: write_node_link_json(graph, folder / "t.json"),
    ],
    ids=["text", "dot", "node-link", "render", "graphml", "json"],
)
def test_writers_refuse_what_is_not_a_parse_tree(tmp_path: Path, call) -> None:
    with pytest.raises(InvalidInputError, match=r"expected a parse-tree graph .*got str"):
        call("x", tmp_path)
    plain = nx.DiGraph()
    plain.add_edge("a", "b")
    with pytest.raises(InvalidInputError, match=r"node 'a' lacks layer, index, activation"):
        call(plain, tmp_path)
    assert listing(tmp_path) == []


def test_side_by_side_needs_title_graph_pairs() -> None:
    with pytest.raises(InvalidInputError, match=r"\(title, graph\) pairs"):
        to_dot([tree()])


def test_threshold_text_is_a_clear_error() -> None:
    from explain_core.parse_trees import ParseTreeData

    data = ParseTreeData.from_tensors(
        [torch.tensor([[[0.9, 0.1], [0.2, 0.8]]])], [torch.rand(1, 2), torch.rand(1, 2)]
    )
    with pytest.raises(InvalidInputError, match=r"threshold must be a number.*got 'high'"):
        parse_tree(data, sample=0, threshold="high")


def test_written_files_and_demo_folders_get_the_umask_permissions(tmp_path):
    """tempfile makes 0600 files and 0700 folders; outputs must be readable as plain writes are."""
    import os

    from explain_core.files import give_default_permissions, write_atomically

    mask = os.umask(0o022)
    os.umask(mask)
    path = write_atomically(tmp_path / "out.bin", b"data")
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    give_default_permissions(folder, folder=True)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask
