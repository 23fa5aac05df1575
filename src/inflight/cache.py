"""Where inflight keeps what it builds once per machine (converted models,
compiled kernels): $INFLIGHT_CACHE_DIR, else $XDG_CACHE_HOME/inflight, else
~/.cache/inflight; and what it must not lose (batch jobs and their files):
$INFLIGHT_DATA_DIR, else $XDG_DATA_HOME/inflight, else ~/.local/share/inflight."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("INFLIGHT_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inflight"


def data_root() -> Path:
    env = os.environ.get("INFLIGHT_DATA_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "inflight"
