"""The package's version: its distribution's metadata version."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("turbine-fmha")
except PackageNotFoundError:  # a source tree on sys.path, never installed (scripts/build_artifacts.py)
    VERSION = "0+unknown"
