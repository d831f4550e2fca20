"""The `fastrpe` command line: one command, several subcommands."""
