"""Loading `.net` files and their imports: stdlib modules by name, other files by path."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from netdsl.errors import Diagnostic, NetdslError, SourceLoc
from netdsl.frontend import ast
from netdsl.frontend.parser import parse
from netdsl.frontend.resources import stdlib_dir
from netdsl.frontend.values import BlockRef, ModuleRef


@dataclass
class ModuleEnv:
    name: str
    file: str
    tree: ast.Module
    globals: dict = field(default_factory=dict)


class Loader:
    """Parses each file once; reports missing files and import cycles at the import."""

    def __init__(self):
        self.cache: dict[str, ModuleEnv] = {}
        self.loading: list[str] = []
        self.diagnostics: list[Diagnostic] = []

    def load_file(self, path: str | Path, name: str | None = None) -> ModuleEnv:
        p = Path(path)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise NetdslError(f"no such file: {p}") from None
        except OSError as e:
            raise NetdslError(f"cannot read {p}: {e.strerror or e}") from None
        text = decode_source(data, str(path))
        return self.load_text(text, str(path), name or p.stem, key=str(p.resolve()))

    def load_text(self, text: str, file: str, name: str, key: str | None = None) -> ModuleEnv:
        key = key or file
        if key in self.cache:
            return self.cache[key]
        tree = parse(text, file)
        env = ModuleEnv(name, file, tree)
        self.loading.append(key)
        try:
            for imp in tree.imports:
                try:
                    sub = self._import(imp, file)
                except NetdslError as e:
                    self.diagnostics.extend(e.diagnostics)
                    continue
                if imp.alias in env.globals:
                    self.diagnostics.append(Diagnostic(
                        f"`{imp.alias}` is imported twice", imp.loc))
                env.globals[imp.alias] = ModuleRef(sub)
        finally:
            self.loading.pop()
        for b in tree.blocks:
            if b.name in env.globals:
                prev = env.globals[b.name]
                # said "(as a block and a block)"; name the first definition instead
                first = ("the name of an import" if isinstance(prev, ModuleRef) else
                         f"first at line {prev.block.loc.line}, column {prev.block.loc.column}")
                self.diagnostics.append(Diagnostic(
                    f"block `{b.name}` is defined twice in this file ({first})", b.loc))
                continue
            env.globals[b.name] = BlockRef(b, env)
        self.cache[key] = env
        return env

    def _import(self, imp: ast.Import, importer: str) -> ModuleEnv:
        here = Path(importer).parent
        if imp.path is not None:
            target = (here / imp.path)
            if not target.is_file():
                raise NetdslError(f"cannot import \"{imp.path}\": no file {target}", imp.loc)
        else:
            local, std = here / f"{imp.module}.net", stdlib_dir() / f"{imp.module}.net"
            target = local if local.is_file() else std
            if not target.is_file():
                known = sorted(p.stem for p in stdlib_dir().glob("*.net"))
                raise NetdslError(
                    f"cannot import `{imp.module}`: there is no {imp.module}.net next to this "
                    f"file and no stdlib module of that name (the stdlib has: "
                    f"{', '.join(known)})", imp.loc)
        key = str(target.resolve())
        if key in self.loading:
            chain = self.loading[self.loading.index(key):] + [key]
            names = " -> ".join(Path(c).name for c in chain)
            raise NetdslError(f"import cycle: {names}", imp.loc)
        return self.load_file(target, imp.alias)


def decode_source(data: bytes, file: str) -> str:
    """A `.net` file's text: UTF-8, with or without a byte-order mark. Other bytes are an
    error at the line and column of the first one that is not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
        start = e.start + bom
        line_start = data.rfind(b"\n", 0, start) + 1
        line = data.count(b"\n", 0, start) + 1
        # the bytes before it on its line are valid UTF-8 (it is the first bad byte)
        column = len(data[max(line_start, bom):start].decode("utf-8")) + 1
        raise NetdslError(f"the file is not UTF-8 text: byte 0x{data[start]:02X} here is not "
                          "part of a UTF-8 character; save the file as UTF-8",
                          SourceLoc(file, line, column)) from None
