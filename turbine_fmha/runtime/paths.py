"""Where artifacts live by default: one rule for Python, every CLI command
and every error hint.

  artifacts:  $TURBINE_FMHA_ARTIFACTS, else <user cache>/artifacts
  compiled on demand (compile_missing):
              $TURBINE_FMHA_CACHE, else <user cache>/compiled
  <user cache>: $XDG_CACHE_HOME/turbine-fmha, else ~/.cache/turbine-fmha

A directory inside the installed package (site-packages) is never a
default: it is shared by every user of the interpreter, is often read-only,
and is replaced by each reinstall.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core import env


def user_cache_root() -> Path:
    # The XDG spec says a relative $XDG_CACHE_HOME is invalid and must be
    # ignored: it would make the directory depend on the working directory.
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "turbine-fmha"


def default_artifact_dir() -> Path:
    return env.path(env.ARTIFACTS) or user_cache_root() / "artifacts"


def default_cache_dir() -> Path:
    # A sibling of the artifact directory, not the root above it, so that
    # neither directory nests inside the other.
    return env.path(env.CACHE) or user_cache_root() / "compiled"


def default_compile_missing() -> bool:
    """Whether the process-wide default sessions (calls without
    `session=`) compile a missing variant into default_cache_dir(): when the
    build extra is installed and no manifest pin is set (a pin excludes
    compiling, see Session)."""
    from ..build.aot import missing_build_modules

    return not env.comma_list(env.MANIFEST_SHA256) and not missing_build_modules()
