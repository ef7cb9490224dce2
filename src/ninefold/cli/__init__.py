"""The ``ninefold`` command line: wires subcommands to the packages, nothing more."""
