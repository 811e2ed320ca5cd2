"""The declared meta keys (netdsl.ir.meta): verify rejects an undeclared key or a value of
the wrong type, every graph the layers make passes, and every key the code names is
declared."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from _examples import EXAMPLES, load

from netdsl.config import TrainConfig
from netdsl.ir import meta
from netdsl.ir.graph import Graph
from netdsl.ir.rewrite import make_node, make_source
from netdsl.ir.types import TensorType
from netdsl.ir.verify import IRError
from netdsl.parallel.project import mark_over_mpi, project
from netdsl.parallel.split import SplitSpec, split_step
from netdsl.step.graphs import training_graph

ROOT = Path(__file__).resolve().parents[1]


def small() -> Graph:
    g = Graph("small", batch=2)
    g.add(make_source("x", "input", TensorType((2, 3)), {"shape": (2, 3)}))
    g.add(make_node(g, "y", "relu", ["x"], meta={"phase": "forward"}))
    g.outputs = {"output": ["y"]}
    return g.verify()


def test_an_undeclared_node_key_fails_verify_naming_the_node_and_key():
    g = small()
    g["y"].meta["phaze"] = "backward"
    with pytest.raises(IRError, match=r"%y: meta key 'phaze' is not declared"):
        g.verify()


def test_a_value_of_the_wrong_type_fails_verify_naming_the_node_and_key():
    g = small()
    g["y"].meta["rows"] = [0, 1]  # declared a tuple
    with pytest.raises(IRError, match=r"%y: meta\['rows'\] is a list, declared tuple"):
        g.verify()
    g["y"].meta["rows"] = (0, 1)
    g["y"].meta["members"] = "y"  # a tuple of names, or a count
    with pytest.raises(IRError, match=r"%y: meta\['members'\] is a str, declared tuple or int"):
        g.verify()


def test_the_graph_meta_is_checked_too():
    g = small()
    g.meta["grad_of"] = {}
    g.meta["flavour"] = 1
    with pytest.raises(IRError, match=r"graph small: meta key 'flavour' is not declared"):
        g.verify()
    g.meta.pop("flavour")
    g.meta["rank"] = "0"
    with pytest.raises(IRError, match=r"graph small: meta\['rank'\] is a str, declared int"):
        g.verify()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_training_step_passes_verify(path):
    net = load(path.name)
    step = training_graph(net.lower(2), net.train or TrainConfig())
    step.verify()
    assert step.meta["grad_of"] and any(n.meta.get("phase") == "backward" for n in step.nodes)


def test_split_and_projected_steps_pass_verify():
    """The keys the splitter and an MPI rank's projection set (rows, members, shard,
    held_to, part_sizes, rank ...) are declared with the types they are set to."""
    net = load("digits-cnn.net")
    opt = {"kind": "sgd", "lr": 0.1}
    for spec in (SplitSpec(pipeline=2, microbatches=2, schedule="1f1b"),
                 SplitSpec(data=2, tensor=2)):
        g = split_step(net.graph, 8, spec, opt)
        mark_over_mpi(g)
        g.verify()
        for rank in (0, 1):
            # a rank's collectives keep their own input alone: their shape rules no
            # longer see the group, so only the other invariants are checked
            project(g, rank).verify(recheck_shapes=False)


# -- the declarations against the code ------------------------------------------------------
def _is_meta(x: ast.expr) -> bool:
    return (isinstance(x, ast.Attribute) and x.attr == "meta") or (
        isinstance(x, ast.Name) and x.id == "meta")


def _key(x: ast.expr) -> str | None:
    """A key the code spells out: a string, or a name netdsl.ir.meta defines (PER_PROCESS)."""
    if isinstance(x, ast.Constant) and isinstance(x.value, str):
        return x.value
    if isinstance(x, ast.Name) and isinstance(getattr(meta, x.id, None), str):
        return getattr(meta, x.id)
    return None


def _dict_keys(x: ast.expr) -> list[ast.expr]:
    return [k for d in ast.walk(x) if isinstance(d, ast.Dict) for k in d.keys if k is not None]


def meta_keys_in(tree: ast.AST) -> set[str]:
    """Every meta key a module names: meta[k], meta.get/setdefault/pop(k), k in ...meta,
    and the keys of dicts passed as `meta=` or assigned to a variable `meta`."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_meta(node.value):
            keys.append(node.slice)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop") and _is_meta(node.func.value)
              and node.args):
            keys.append(node.args[0])
        elif (isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_meta(node.comparators[0])):
            keys.append(node.left)
        elif isinstance(node, ast.keyword) and node.arg == "meta":
            keys += _dict_keys(node.value)
        elif isinstance(node, ast.Assign) and any(_is_meta(t) for t in node.targets):
            keys += _dict_keys(node.value)
    return {k for k in map(_key, keys) if k is not None}


def test_every_meta_key_the_code_names_is_declared():
    declared = meta.NODE_META.keys() | meta.GRAPH_META.keys()
    found = {}
    for path in [*(ROOT / "netdsl").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        for key in meta_keys_in(ast.parse(path.read_text(encoding="utf-8"))):
            found.setdefault(key, path.relative_to(ROOT))
    assert {"phase", "rows", "held_to", "split", meta.PER_PROCESS} <= found.keys()
    assert {k: str(p) for k, p in found.items() if k not in declared} == {}


def test_the_declared_setters_and_readers_exist():
    for table in (meta.NODE_META, meta.GRAPH_META):
        for key, spec in table.items():
            assert spec.name == key and spec.set_by and spec.meaning
            for m in spec.set_by + spec.read_by:
                if m != "tests":
                    full = m if m.startswith("netdsl_cli.") else f"netdsl.{m}"
                    assert importlib.util.find_spec(full) is not None, (key, m)
