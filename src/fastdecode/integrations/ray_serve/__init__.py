"""fastdecode on Ray Serve (the ``ray`` extra): ``fastdecode serve --ray``, or in Python::

    from ray import serve
    from fastdecode.integrations.ray_serve import ReplicaOptions, build_app
    from fastdecode.serve import ServeSettings

    serve.run(build_app("/models/smollm2.gguf", settings=ServeSettings(model_name="smollm2"),
                        options=ReplicaOptions(min_replicas=1, max_replicas=4)))

An ingress deployment speaks ``fastdecode serve``'s HTTP API in front of a model deployment whose
replicas each run one engine behind the same application; Serve config files name
``fastdecode.integrations.ray_serve:app_builder``. Modules: forwarding.py (what travels between
the two), replica.py, ingress.py, router.py (prefix-aware routing), metrics.py, options.py, app.py.
Ray is imported only when an application is built.
"""

from __future__ import annotations

from typing import Any

from .options import ROUTING_POLICIES, ReplicaOptions

__all__ = ["ReplicaOptions", "ROUTING_POLICIES", "app_builder", "build_app"]


def __getattr__(name: str) -> Any:
    if name in ("build_app", "app_builder"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
