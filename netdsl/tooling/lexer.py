"""A Pygments lexer for `.net` files, registered as the `pygments.lexers` entry point
`netdsl` (aliases `netdsl`, `net`): editors, docs builders and `pygmentize` find it, and
the CLI highlights the source lines it quotes in errors with it."""
from __future__ import annotations

from pygments.lexer import RegexLexer, bygroups, words
from pygments.token import (
    Comment,
    Keyword,
    Name,
    Number,
    Operator,
    Punctuation,
    String,
    Text,
    Whitespace,
)

from netdsl.tooling.names import BUILTINS, CONSTANTS, dtypes, keywords, operators

_NAME = r"[A-Za-z_][A-Za-z_0-9]*"


class NetdslLexer(RegexLexer):
    name = "netdsl"
    aliases = ["netdsl", "net"]
    filenames = ["*.net"]
    mimetypes = ["text/x-netdsl"]
    url = "https://github.com/netdsl/netdsl"

    tokens = {
        "root": [
            (r"[ \t\r\f]+", Whitespace),
            (r"\n", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r'"(?:[^"\\\n]|\\.)*"', String.Double),
            (r"(block)(\s+)(" + _NAME + ")", bygroups(Keyword.Declaration, Whitespace,
                                                       Name.Function)),
            (r"(network)(\s+)(" + _NAME + ")", bygroups(Keyword.Declaration, Whitespace,
                                                         Name.Class)),
            (r"(import)(\s+)(" + _NAME + ")", bygroups(Keyword.Namespace, Whitespace,
                                                        Name.Namespace)),
            (r"(@)(" + _NAME + ")", bygroups(Name.Decorator, Name.Decorator)),
            (words(CONSTANTS, suffix=r"\b"), Keyword.Constant),
            (words(("import", "as"), suffix=r"\b"), Keyword.Namespace),
            (words(("block", "network", "train", "parallel", "input", "output", "loss"),
                   suffix=r"\b"), Keyword.Declaration),
            (words(keywords(), suffix=r"\b"), Keyword),
            (words(dtypes(), suffix=r"\b"), Keyword.Type),
            (words(tuple(operators()) + BUILTINS, suffix=r"\b"), Name.Builtin),
            # a keyword argument `kernel=3` (not `==`); an assignment or a setting
            (r"([(,])(\s*)(" + _NAME + r")(\s*)(=)(?!=)",
             bygroups(Punctuation, Whitespace, Name.Attribute, Whitespace, Operator)),
            (r"(" + _NAME + r")(\s*)(=)(?!=)", bygroups(Name.Variable, Whitespace, Operator)),
            (_NAME, Name),
            (r"([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+", Number.Float),
            (r"[0-9][0-9_]*", Number.Integer),
            (r"\*\*|//|==|!=|<=|>=|[-+*/%<>=]", Operator),
            (r"[()\[\]{},;:.]", Punctuation),
            (r".", Text),  # anything else (an error the parser reports) stays visible
        ],
    }
