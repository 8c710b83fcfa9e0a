"""`python -m dsa.frontends.lerobot.cli init ...`: the dsa-lerobot command line (dsa.frontends.lerobot.main);
the dsa_lerobot_policy rule runs it to write a seeded policy directory."""

from dsa.core.errors import run_cli
from dsa.frontends.lerobot import main

if __name__ == "__main__":
    run_cli(main, "dsa-lerobot")
