"""The `netdsl` command-line interface (typer)."""
