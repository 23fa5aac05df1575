"""Where inflight keeps what it builds once per machine (converted models,
compiled kernels): $INFLIGHT_CACHE_DIR, else $XDG_CACHE_HOME/inflight, else
~/.cache/inflight."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("INFLIGHT_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inflight"
