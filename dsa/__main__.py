"""`python -m dsa COMMAND ...`: the rule set's one command (dsa/tools/cli.py)."""

from dsa.tools.cli import main

main()
