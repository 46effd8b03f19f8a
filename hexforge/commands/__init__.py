"""The commands: ``hexforge`` (cli.py) and what its subcommands run (serve, deploy, inspect,
estimate, bench, demo), and ``qhx-generate``."""
