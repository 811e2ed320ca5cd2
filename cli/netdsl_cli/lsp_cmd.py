"""`netdsl lsp`: the language server, for editors (see docs/tools.md)."""
from __future__ import annotations

from netdsl_cli.common import app, guard


@app.command()
def lsp() -> None:
    """Run the language server on stdin/stdout: an editor starts it (needs the lsp extra).

    Diagnostics as you type, hover (tensor types, FLOPs, block signatures), go to
    definition, completion, document symbols and formatting."""
    with guard():
        from netdsl.errors import NetdslError
        try:
            from netdsl.tooling.lsp import serve
        except ImportError as e:
            raise NetdslError(f"netdsl lsp needs pygls and lsprotocol ({e.name} is missing); "
                              "install the lsp extra: pip install 'netdsl[lsp]'") from None
        serve()
