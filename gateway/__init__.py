"""kvgate's gateway: the OpenAI-compatible HTTP server, the ModelRouter, config and the `kvgate` command."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvgate")  # pyproject.toml's, the one place the version is written
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
