"""The Pygments lexer for `.net`: registered through the entry point, it covers every
character of every example and stdlib file, classifies the language's words, and the CLI
highlights quoted source lines with it on a terminal (and only there)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from pygments.lexers import find_lexer_class_for_filename, get_lexer_by_name
from pygments.token import Comment, Error, Keyword, Name, Number, String

from netdsl.errors import NetdslError
from netdsl.frontend.elaborate import _builtins
from netdsl.tooling.lexer import NetdslLexer
from netdsl.tooling.names import BUILTINS
from netdsl_cli.app import print_error

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "examples").glob("*.net")) + sorted((ROOT / "stdlib").glob("*.net"))


def test_registered_through_the_entry_point():
    assert type(get_lexer_by_name("netdsl")) is NetdslLexer
    assert type(get_lexer_by_name("net")) is NetdslLexer
    assert find_lexer_class_for_filename("model.net") is NetdslLexer


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_every_file_lexes_without_errors(path):
    text = path.read_text()
    tokens = list(NetdslLexer().get_tokens(text))
    assert "".join(v for _, v in tokens) == text
    assert not [v for t, v in tokens if t in Error]


def test_words_are_classified():
    src = ('import resnet\n@stage(1)\nblock f(x, w=1) { return conv2d(x, w, kernel=3) }  # c\n'
           'network n { input x: f32[N, 3]; h = if true then 1.5e-3 else "s" }\n')
    kinds = {v: t for t, v in NetdslLexer().get_tokens(src) if v.strip()}
    assert kinds["import"] in Keyword and kinds["resnet"] in Name.Namespace
    assert kinds["@"] in Name.Decorator and kinds["stage"] in Name.Decorator
    assert kinds["f"] in Name.Function and kinds["n"] in Name.Class
    assert kinds["conv2d"] in Name.Builtin and kinds["kernel"] in Name.Attribute
    assert kinds["return"] in Keyword and kinds["true"] in Keyword.Constant
    assert kinds["f32"] in Keyword.Type and kinds["1.5e-3"] in Number.Float
    assert kinds['"s"'] in String and kinds["# c"] in Comment
    assert kinds["h"] in Name.Variable and kinds["x"] in Name


def test_the_builtin_names_are_the_front_ends():
    assert set(BUILTINS) == set(_builtins(None))


def _error(tmp_path) -> NetdslError:
    import netdsl
    f = tmp_path / "bad.net"
    f.write_text("block g(x) {\n    return conv2d(x, 4)\n}\nnetwork n {\n"
                 "    input x: f32[N, 3]\n    output g(x)\n}\n")
    with pytest.raises(NetdslError) as e:
        netdsl.load(f)
    return e.value


def test_errors_are_highlighted_on_a_terminal(tmp_path, monkeypatch, capsys):
    e = _error(tmp_path)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    print_error(e)
    err = capsys.readouterr().err
    assert "\x1b[" in err
    assert re.sub(r"\x1b\[[0-9;]*m", "", err).rstrip("\n") == e.render()
    # the keyword and the operator of the quoted line have colours of their own
    line = err.split("\n")[1]
    assert re.search(r"\x1b\[[0-9;]*mreturn\x1b", line) and \
        re.search(r"\x1b\[[0-9;]*mconv2d\x1b", line)


def test_errors_are_plain_text_when_piped(tmp_path, monkeypatch, capsys):
    e = _error(tmp_path)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    print_error(e)
    assert capsys.readouterr().err == e.render() + "\n"
