"""rayzero's version (as pyproject.toml has it), named once: the package root exports it and the
jobs tag their runs with it, neither importing the other."""

__version__ = "0.1.0"
