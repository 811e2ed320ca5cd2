"""`netdsl lsp`: a language server for `.net` files over stdio, on pygls 2 and lsprotocol
(the `lsp` extra). The answers come from `netdsl.tooling.analysis`; this module converts
positions (LSP counts lines and characters from 0, netdsl from 1) and types.

Diagnostics are exactly the errors `netdsl check` gives, each with its range and the chain
of block calls as related locations; an error inside an imported file is shown at the
call in this file that led there. Every open file is checked again on each change.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from lsprotocol import types as T
from pygls.lsp.server import LanguageServer
from pygls.workspace.position_codec import PositionCodec

from netdsl.errors import Diagnostic, NetdslError, SourceLoc, source_line
from netdsl.frontend.format import format_source
from netdsl.tooling.analysis import Analysis, Symbol, same_file
from netdsl.tooling.completion import Completion

DEBOUNCE_S = 0.25  # the pause in typing after which a changed file is checked again
_COMPLETION_KINDS = {
    "operator": T.CompletionItemKind.Function, "block": T.CompletionItemKind.Class,
    "module": T.CompletionItemKind.Module, "keyword": T.CompletionItemKind.Keyword,
    "builtin": T.CompletionItemKind.Function, "variable": T.CompletionItemKind.Variable,
    "argument": T.CompletionItemKind.Property, "dtype": T.CompletionItemKind.TypeParameter,
}
_SYMBOL_KINDS = {"network": T.SymbolKind.Class, "block": T.SymbolKind.Function,
                 "train": T.SymbolKind.Namespace, "input": T.SymbolKind.Variable}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("netdsl")
    except PackageNotFoundError:
        return "unknown"


# how the client counts characters (UTF-16 code units unless it asked for another);
# netdsl counts code points. Set from the workspace when the server starts.
_codec = PositionCodec()


def _pos(line: int, col: int, file: str | None = None) -> T.Position:
    """netdsl's (line, column), from 1 in code points, as the client counts."""
    text = source_line(file, line) if file is not None else None
    char = max(col - 1, 0)
    if text is not None and not text.isascii():
        char = _codec.client_num_units(text[:char])
    return T.Position(line=max(line - 1, 0), character=char)


def _range(loc: SourceLoc) -> T.Range:
    start = _pos(loc.line, loc.column, loc.file)
    if loc.end_line is not None and loc.end_column is not None:
        return T.Range(start=start, end=_pos(loc.end_line, loc.end_column, loc.file))
    return T.Range(start=start, end=_pos(loc.line, loc.column + 1, loc.file))


def _uri(file: str) -> str:
    return Path(file).resolve().as_uri()


def _location(loc: SourceLoc) -> T.Location:
    return T.Location(uri=_uri(loc.file), range=_range(loc))


def to_lsp_diagnostic(d: Diagnostic, file: str) -> T.Diagnostic:
    """One netdsl diagnostic for the file `file`: at its location if it is in this file,
    else at the outermost block call in this file that led there."""
    related = [T.DiagnosticRelatedInformation(
        location=_location(site.loc), message=f"in block `{site.block}`, called from here")
        for site in reversed(d.stack)]
    loc = d.loc
    message = d.message
    if loc is None or not same_file(loc.file, file):
        here = [s.loc for s in d.stack if same_file(s.loc.file, file)]
        if loc is not None:
            related.insert(0, T.DiagnosticRelatedInformation(
                location=_location(loc), message="the error is here"))
            message += f" (in {loc})"
        loc = here[0] if here else None
    rng = _range(loc) if loc is not None else T.Range(start=_pos(1, 1), end=_pos(1, 1))
    if d.notes:
        message += "\n" + "\n".join(f"note: {n}" for n in d.notes)
    return T.Diagnostic(range=rng, message=message, severity=T.DiagnosticSeverity.Error,
                        source="netdsl", related_information=related or None)


def _completion(c: Completion) -> T.CompletionItem:
    doc = T.MarkupContent(kind=T.MarkupKind.Markdown, value=c.doc) if c.doc else None
    return T.CompletionItem(label=c.label, kind=_COMPLETION_KINDS[c.kind], detail=c.detail or None,
                            documentation=doc, insert_text=c.insert)


def _symbol(s: Symbol) -> T.DocumentSymbol:
    line, col, end_line, end_col = s.range
    rng = T.Range(start=_pos(line, col, s.selection.file),
                  end=_pos(end_line, end_col, s.selection.file))
    sel = _range(s.selection)
    if not (rng.start.line, rng.start.character) <= (sel.start.line, sel.start.character):
        sel = rng
    return T.DocumentSymbol(name=s.name, kind=_SYMBOL_KINDS[s.kind], range=rng,
                            selection_range=sel, detail=s.detail,
                            children=[_symbol(c) for c in s.children] or None)


class NetdslServer(LanguageServer):
    def __init__(self):
        super().__init__("netdsl", _version())
        self.analyses: dict[str, Analysis] = {}  # the latest analysis of each open file
        self.parsed: dict[str, Analysis] = {}  # the latest that parsed, for completion

    def path(self, uri: str) -> str:
        doc = self.workspace.get_text_document(uri)
        return doc.path or uri

    def where(self, uri: str, position: T.Position) -> tuple[int, int]:
        """The client's position as netdsl's (line, column), from 1 in code points."""
        doc = self.workspace.get_text_document(uri)
        p = self.workspace.position_codec.position_from_client_units(doc.lines, position)
        return p.line + 1, p.character + 1

    def analyse(self, uri: str) -> Analysis:
        global _codec
        _codec = self.workspace.position_codec
        doc = self.workspace.get_text_document(uri)
        file = doc.path or uri
        a = Analysis(doc.source, file)
        self.analyses[uri] = a
        if a.env is not None:
            self.parsed[uri] = a
        self.text_document_publish_diagnostics(T.PublishDiagnosticsParams(
            uri=uri, version=doc.version,
            diagnostics=[to_lsp_diagnostic(d, file) for d in a.diagnostics]))
        return a

    def current(self, uri: str) -> Analysis:
        doc = self.workspace.get_text_document(uri)
        a = self.analyses.get(uri)
        if a is None or a.text != doc.source:
            a = self.analyse(uri)
        return a


def make_server() -> NetdslServer:
    server = NetdslServer()

    @server.feature(T.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: NetdslServer, params: T.DidOpenTextDocumentParams):
        ls.analyse(params.text_document.uri)

    @server.feature(T.TEXT_DOCUMENT_DID_CHANGE)
    async def did_change(ls: NetdslServer, params: T.DidChangeTextDocumentParams):
        # while the user types, check once they pause: a newer change supersedes this one
        uri, version = params.text_document.uri, params.text_document.version
        await asyncio.sleep(DEBOUNCE_S)
        if ls.workspace.get_text_document(uri).version == version:
            ls.analyse(uri)

    @server.feature(T.TEXT_DOCUMENT_DID_SAVE)
    def did_save(ls: NetdslServer, params: T.DidSaveTextDocumentParams):
        ls.analyse(params.text_document.uri)  # an imported file may have changed

    @server.feature(T.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: NetdslServer, params: T.DidCloseTextDocumentParams):
        uri = params.text_document.uri
        ls.analyses.pop(uri, None)
        ls.parsed.pop(uri, None)
        ls.text_document_publish_diagnostics(T.PublishDiagnosticsParams(uri=uri,
                                                                        diagnostics=[]))

    @server.feature(T.TEXT_DOCUMENT_HOVER)
    def hover(ls: NetdslServer, params: T.HoverParams):
        a = ls.current(params.text_document.uri)
        text = a.hover(*ls.where(params.text_document.uri, params.position))
        if text is None:
            return None
        return T.Hover(contents=T.MarkupContent(kind=T.MarkupKind.Markdown, value=text))

    @server.feature(T.TEXT_DOCUMENT_DEFINITION)
    def definition(ls: NetdslServer, params: T.DefinitionParams):
        a = ls.current(params.text_document.uri)
        loc = a.definition(*ls.where(params.text_document.uri, params.position))
        return _location(loc) if loc is not None else None

    @server.feature(T.TEXT_DOCUMENT_COMPLETION,
                    T.CompletionOptions(trigger_characters=[".", "(", ","]))
    def completion(ls: NetdslServer, params: T.CompletionParams):
        uri = params.text_document.uri
        doc = ls.workspace.get_text_document(uri)
        ls.current(uri)
        a = ls.parsed.get(uri) or ls.analyses[uri]
        items = a.completions(*ls.where(uri, params.position), doc.source)
        return T.CompletionList(is_incomplete=False, items=[_completion(c) for c in items])

    @server.feature(T.TEXT_DOCUMENT_FORMATTING)
    def formatting(ls: NetdslServer, params: T.DocumentFormattingParams):
        doc = ls.workspace.get_text_document(params.text_document.uri)
        try:
            new = format_source(doc.source, doc.path or doc.uri)
        except NetdslError:
            return None  # the diagnostics already say why; never rewrite a broken file
        if new == doc.source:
            return []
        lines = doc.source.split("\n")
        end = T.Position(line=len(lines), character=0)
        return [T.TextEdit(range=T.Range(start=T.Position(line=0, character=0), end=end),
                           new_text=new)]

    @server.feature(T.TEXT_DOCUMENT_DOCUMENT_SYMBOL)
    def document_symbol(ls: NetdslServer, params: T.DocumentSymbolParams):
        a = ls.current(params.text_document.uri)
        return [_symbol(s) for s in a.symbols()]

    return server


def serve() -> None:
    """Serve over stdin/stdout until the client says `exit`."""
    make_server().start_io()
