"""Tools for people who write `.net` files: the Pygments lexer (`lexer`), the language
server (`lsp`, on pygls) and training-curve plots (`curves`, on matplotlib). The formatter
itself is in `netdsl.frontend.format`. Only this package imports pygments, pygls,
lsprotocol and matplotlib (an import-linter contract), each lazily where it is optional."""
