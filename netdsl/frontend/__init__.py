"""The front end: `.net` text -> AST (parser) -> graph IR (elaborate), with located errors."""
from __future__ import annotations

from pathlib import Path

from netdsl.errors import NetdslError
from netdsl.frontend.deep import run_deep
from netdsl.frontend.elaborate import Elaborator
from netdsl.frontend.modules import Loader, ModuleEnv
from netdsl.frontend.parser import parse
from netdsl.frontend.train import train_config
from netdsl.ir.graph import Graph
from netdsl.ir.verify import verify

__all__ = ["Loader", "ModuleEnv", "elaborate", "load_module", "parse", "train_config"]


def load_module(path: str | Path | None = None, *, text: str | None = None,
                file: str = "<string>") -> ModuleEnv:
    """Parse a file (or text) and its imports; raises NetdslError listing every problem."""
    return run_deep(_load_module, path, text, file)


def _load_module(path, text, file) -> ModuleEnv:
    loader = Loader()
    env = loader.load_file(path) if text is None else loader.load_text(text, file, Path(file).stem)
    if loader.diagnostics:
        raise NetdslError(diagnostics=loader.diagnostics)
    return env


def elaborate(env: ModuleEnv, network: str | None = None) -> Graph:
    """Evaluate one network of a module into a verified forward graph (symbolic batch N)."""
    return run_deep(_elaborate, env, network)


def _elaborate(env: ModuleEnv, network: str | None) -> Graph:
    nets = env.tree.networks
    tree = env.tree
    if not nets and not tree.blocks and not tree.imports and tree.train is None:
        raise NetdslError(f"{env.file} is empty (or holds only comments): there is no "
                          "network to check; a file needs at least `network NAME { input x: "
                          "f32[N, ...]  output ... }`")
    if not nets:
        raise NetdslError(f"{env.file} defines no `network` (only blocks: it can be imported)")
    if network is None:
        if len(nets) > 1:
            raise NetdslError(f"{env.file} defines {len(nets)} networks "
                              f"({', '.join(n.name for n in nets)}); choose one", nets[1].loc)
        net = nets[0]
    else:
        matches = [n for n in nets if n.name == network]
        if not matches:
            raise NetdslError(f"{env.file} has no network `{network}`")
        net = matches[0]
    g = Elaborator(env, net).run()
    # every node came from `make_node`, whose type *is* its shape rule's answer: running
    # the rules again (a tenth of checking a big file) would check nothing; every pass
    # after this one verifies with the rules re-run
    verify(g, recheck_shapes=False)
    return g
