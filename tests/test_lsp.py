"""`netdsl lsp`: driven through pygls's own client over a pipe, as an editor would:
initialize, open, change, hover, definition, completion, formatting, document symbols."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

pytest.importorskip("pygls")
from lsprotocol import types as T  # noqa: E402
from pygls.lsp.client import LanguageClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOOD = """\
import resnet

# a conv, BN and ReLU
block unit(x, width) {
    return relu(batchnorm(conv2d(x, width, kernel=3, padding=1, bias=false)))
}

network small {
    input x: f32[N, 3, 32, 32]
    input y: i64[N]
    h = resnet.cifar_stem(x, 16)
    h = unit(h, 32)
    logits = linear(flatten(global_avgpool(h)), 10)
    output logits
    loss softmax_cross_entropy(logits, y)
}
"""
# two independent mistakes, one of them inside a block (a call chain)
BAD = GOOD.replace("h = unit(h, 32)", "h = unit(flatten(h), 32)").replace(
    "linear(flatten(global_avgpool(h)), 10)", "linear(flatten(global_avgpool(h)), 10) + q")


class Session:
    """A server started as `python -m netdsl_cli lsp`, and a client on its pipes."""

    def __init__(self, tmp_path: Path):
        self.client = LanguageClient("netdsl-test", "0")
        self.diagnostics: dict[str, list[T.Diagnostic]] = {}
        self.file = tmp_path / "small.net"
        self.uri = self.file.resolve().as_uri()

        self.versions: list[int | None] = []  # of every publication, in order

        @self.client.feature(T.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
        def publish(params: T.PublishDiagnosticsParams):
            self.diagnostics[params.uri] = params.diagnostics
            self.versions.append(params.version)

    async def start(self):
        await self.client.start_io(sys.executable, "-m", "netdsl_cli", "lsp")
        result = await self.client.initialize_async(T.InitializeParams(
            capabilities=T.ClientCapabilities(), root_uri=self.file.parent.as_uri()))
        self.client.initialized(T.InitializedParams())
        return result

    async def diagnostics_for(self, version_text: str, timeout: float = 60.0):
        """Wait for the diagnostics published after the last change."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.uri not in self.diagnostics:
            if loop.time() > end:
                raise TimeoutError(f"no diagnostics for {version_text}")
            await asyncio.sleep(0.05)
        return self.diagnostics.pop(self.uri)

    def open(self, text: str):
        self.file.write_text(text)
        self.client.text_document_did_open(T.DidOpenTextDocumentParams(
            text_document=T.TextDocumentItem(uri=self.uri, language_id="netdsl", version=1,
                                             text=text)))

    def change(self, text: str, version: int):
        self.client.text_document_did_change(T.DidChangeTextDocumentParams(
            text_document=T.VersionedTextDocumentIdentifier(uri=self.uri, version=version),
            content_changes=[T.TextDocumentContentChangeWholeDocument(text=text)]))

    def at(self, line: int, character: int) -> dict:
        return {"text_document": T.TextDocumentIdentifier(uri=self.uri),
                "position": T.Position(line=line, character=character)}

    async def stop(self):
        await self.client.shutdown_async(None)
        self.client.exit(None)
        await self.client.stop()


def run(tmp_path, scenario):
    async def main():
        s = Session(tmp_path)
        try:
            await asyncio.wait_for(scenario(s), timeout=120)
        finally:
            await s.stop()
    asyncio.run(main())


def test_diagnostics_hover_definition(tmp_path):
    async def scenario(s: Session):
        init = await s.start()
        caps = init.capabilities
        assert caps.hover_provider and caps.definition_provider
        assert caps.document_formatting_provider and caps.document_symbol_provider
        assert "." in caps.completion_provider.trigger_characters

        s.open(GOOD)
        assert list(await s.diagnostics_for("good")) == []

        # hover on `h` in `h = unit(h, 32)` (line 12, 0-based 11): its type and maker
        h = await s.client.text_document_hover_async(T.HoverParams(**s.at(11, 4)))
        assert "h: f32[N, 32, 32, 32]" in h.contents.value
        assert "made by `relu` (node `unit.relu`)" in h.contents.value
        # on the call of a stdlib block: its signature, doc comment, params and FLOPs
        h = await s.client.text_document_hover_async(T.HoverParams(**s.at(10, 16)))
        assert "block cifar_stem(x, width=16)" in h.contents.value
        assert "returns `f32[N, 16, 32, 32]`" in h.contents.value
        assert "params 464" in h.contents.value  # 3*3*3*16 + 2*16
        assert "3x3 convolution, BN, ReLU: the CIFAR stem" in h.contents.value
        # on an operator call
        h = await s.client.text_document_hover_async(T.HoverParams(**s.at(12, 14)))
        assert "linear(x, out_features" in h.contents.value and "f32[N, 10]" in h.contents.value
        assert "params 330" in h.contents.value  # 32*10 + 10

        # definition: a local block, a stdlib block, the imported file
        d = await s.client.text_document_definition_async(T.DefinitionParams(**s.at(11, 9)))
        assert d.uri == s.uri and d.range.start.line == 3
        d = await s.client.text_document_definition_async(T.DefinitionParams(**s.at(10, 16)))
        assert d.uri == (ROOT / "stdlib" / "resnet.net").resolve().as_uri()
        assert "block cifar_stem" in (ROOT / "stdlib" / "resnet.net").read_text().split(
            "\n")[d.range.start.line]
        d = await s.client.text_document_definition_async(T.DefinitionParams(**s.at(0, 9)))
        assert d.uri.endswith("/stdlib/resnet.net") and d.range.start.line == 0

        # the user breaks it: the same errors as `netdsl check`, with ranges and chains
        s.change(BAD, 2)
        diags = await s.diagnostics_for("bad")
        assert len(diags) == 2
        first, second = sorted(diags, key=lambda d: d.range.start.line)
        assert "conv2d expects a 4-d input" in first.message
        assert first.range.start.line == 4  # inside block `unit`
        assert first.related_information[0].location.range.start.line == 11  # its call
        assert "in block `unit`" in first.related_information[0].message
        assert "`q` is not defined" in second.message and second.range.start.line == 12
        q = BAD.split("\n")[12].index(" q") + 1
        assert (second.range.start.character, second.range.end.character) == (q, q + 1)

        # hover on a keyword argument: the block parameter, and go to it
        h = await s.client.text_document_hover_async(T.HoverParams(**s.at(4, 48)))
        assert "kernel: pair = 1" in h.contents.value and "argument of `conv2d(" in \
            h.contents.value

        # typing fast: only the last version is checked (and published)
        published = len(s.versions)
        s.change(BAD.replace("+ q", "+ "), 3)
        s.change(GOOD, 4)
        assert list(await s.diagnostics_for("fixed")) == []
        await asyncio.sleep(0.5)
        assert s.versions[published:] == [4]

    run(tmp_path, scenario)


def test_completion_formatting_symbols(tmp_path):
    async def scenario(s: Session):
        await s.start()
        s.open(GOOD)
        await s.diagnostics_for("good")

        # while typing `resnet.` the file does not parse; the blocks still come
        broken = GOOD.replace("    h = unit(h, 32)\n", "    h = resnet.\n")
        s.change(broken, 2)
        assert len(await s.diagnostics_for("broken")) == 1
        c = await s.client.text_document_completion_async(T.CompletionParams(**s.at(11, 15)))
        labels = {i.label for i in c.items}
        assert {"stem", "stage", "cifar_stem", "head"} <= labels and "conv2d" not in labels

        s.change(GOOD, 3)
        await s.diagnostics_for("good again")
        # inside `conv2d(`: its keyword arguments with their defaults, and the operators
        c = await s.client.text_document_completion_async(T.CompletionParams(**s.at(4, 36)))
        items = {i.label: i for i in c.items}
        assert items["kernel="].kind == T.CompletionItemKind.Property
        assert "kernel: pair = 1" in items["kernel="].detail
        assert items["relu"].kind == T.CompletionItemKind.Function
        assert items["unit"].detail == "block unit(x, width)"
        assert "x" not in items or items["x"].kind != T.CompletionItemKind.Property

        edits = await s.client.text_document_formatting_async(T.DocumentFormattingParams(
            text_document=T.TextDocumentIdentifier(uri=s.uri),
            options=T.FormattingOptions(tab_size=4, insert_spaces=True)))
        assert not edits  # already formatted: no edit
        ugly = GOOD.replace("h = unit(h, 32)", "h=unit( h,32 ) ;")
        s.change(ugly, 4)
        await s.diagnostics_for("ugly")
        edits = await s.client.text_document_formatting_async(T.DocumentFormattingParams(
            text_document=T.TextDocumentIdentifier(uri=s.uri),
            options=T.FormattingOptions(tab_size=4, insert_spaces=True)))
        assert len(edits) == 1 and edits[0].new_text == GOOD
        assert edits[0].range.start == T.Position(line=0, character=0)

        syms = await s.client.text_document_document_symbol_async(T.DocumentSymbolParams(
            text_document=T.TextDocumentIdentifier(uri=s.uri)))
        assert [(x.name, x.kind) for x in syms] == [("unit", T.SymbolKind.Function),
                                                    ("small", T.SymbolKind.Class)]
        net = syms[1]
        assert (net.range.start.line, net.range.end.line) == (7, 15)
        assert [c.name for c in net.children] == ["x", "y"]

        # positions count UTF-16 code units, as LSP says: an emoji is two of them
        line = '    t = "\U0001F60B"; z = relu(qq)'
        s.change(GOOD.replace("    h = unit(h, 32)", line + "\n    h = unit(h, 32)"), 5)
        (d,) = await s.diagnostics_for("emoji")
        units = lambda text: len(text.encode("utf-16-le")) // 2  # noqa: E731
        assert "`qq` is not defined" in d.message
        assert d.range.start.character == units(line[:line.index("qq")])
        h = await s.client.text_document_hover_async(T.HoverParams(
            **s.at(11, units(line[:line.index("(qq")]) - 1)))  # on the `u` of `relu`
        assert "relu(x)" in h.contents.value

    run(tmp_path, scenario)


def test_without_pygls_a_clear_message(monkeypatch):
    from typer.testing import CliRunner

    from netdsl_cli.app import app
    monkeypatch.setitem(sys.modules, "pygls", None)
    monkeypatch.setitem(sys.modules, "pygls.lsp.server", None)
    monkeypatch.delitem(sys.modules, "netdsl.tooling.lsp", raising=False)
    r = CliRunner().invoke(app, ["lsp"])
    assert r.exit_code == 1 and "pip install 'netdsl[lsp]'" in r.output
