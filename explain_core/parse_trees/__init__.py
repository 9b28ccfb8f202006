"""Parse trees of capsule networks: networkx graphs from routing, drawn with graphviz.

Build a tree (:mod:`.build`) from :class:`ParseTreeData` — couplings and activations of every
capsule layer, from tensors, a capsule recording or any model with routing layers (:mod:`.data`)
— for one sample, a class or the whole data set; draw it (:mod:`.render`), print it
(:mod:`.text`), export it (:mod:`.export`) or compare models side by side (:mod:`.compare`).

networkx and graphviz (the ``graphs`` extra) are imported only by the functions that need them;
importing this package needs neither.
"""

from explain_core.parse_trees.build import (
    build_parse_tree,
    check_parse_tree,
    class_parse_tree,
    dataset_parse_tree,
    default_thresholds,
    node_id,
    parse_tree,
    sample_parse_tree,
)
from explain_core.parse_trees.compare import ComparedTrees, compare_parse_trees
from explain_core.parse_trees.data import (
    LayerStack,
    ParseTreeData,
    collect_parse_tree_data,
)
from explain_core.parse_trees.export import (
    read_graphml,
    read_node_link_json,
    to_node_link,
    write_graphml,
    write_node_link_json,
)
from explain_core.parse_trees.render import (
    FORMATS,
    GraphvizRenderError,
    RenderedTree,
    render_parse_tree,
    render_side_by_side,
    to_dot,
)
from explain_core.parse_trees.text import text_tree

__all__ = [
    "FORMATS",
    "ComparedTrees",
    "GraphvizRenderError",
    "LayerStack",
    "ParseTreeData",
    "RenderedTree",
    "build_parse_tree",
    "check_parse_tree",
    "class_parse_tree",
    "collect_parse_tree_data",
    "compare_parse_trees",
    "dataset_parse_tree",
    "default_thresholds",
    "node_id",
    "parse_tree",
    "read_graphml",
    "read_node_link_json",
    "render_parse_tree",
    "render_side_by_side",
    "sample_parse_tree",
    "text_tree",
    "to_dot",
    "to_node_link",
    "write_graphml",
    "write_node_link_json",
]
