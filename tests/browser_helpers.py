"""Driving the dashboard in headless Chromium (the ``browser`` fixture is in conftest)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def wait_for(driver, script: str, timeout: float = 20.0):
    """The script's value once it is truthy (polled), else a failed assertion."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {script}")


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    """A screenshot of the page, kept in $INFLIGHT_SCREENSHOT_DIR when set."""
    path = tmp_path / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    keep = os.environ.get("INFLIGHT_SCREENSHOT_DIR")
    if keep:
        shutil.copy(path, Path(keep) / name)
    return path
