"""Scale-out on Ray Serve (the optional ``inflight[ray]`` extra): many engine
replicas behind one OpenAI endpoint, a prefix-aware router and an autoscaling
policy for continuous-batching engines.

``routing`` and ``autoscaling`` are plain Python (no Ray import); ``build_app``
and ``app_builder`` (from ``inflight.ray.app``) need Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app_builder", "build_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from inflight.ray import app

        return getattr(app, name)
    raise AttributeError(name)
