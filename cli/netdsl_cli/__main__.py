"""`python -m netdsl_cli` runs the `netdsl` command."""
from netdsl_cli.app import main

main()
