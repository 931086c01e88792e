"""The Serve application: an ingress deployment in front of a model deployment.

``build_app`` returns the application (``serve.run(build_app(...))``, or Serve config files
through ``app_builder``); ``run_service`` is ``fastdecode serve --ray``: it connects to (or
starts) Ray, runs the application on Serve's HTTP proxy and waits for SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

from ...errors import InvalidOptionError, ModelNotFoundError, RayUnavailableError
from ...load_settings import LoadSettings
from ...serve.service import ServeSettings
from .options import ReplicaOptions

APP_NAME = "fastdecode"
MODEL_DEPLOYMENT = "FastDecodeModel"
INGRESS_DEPLOYMENT = "FastDecodeIngress"
INGRESS_MAX_ONGOING = 10_000  # the ingress only relays: it never limits a request itself


def import_serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:
        raise RayUnavailableError(f"--ray needs Ray Serve: pip install 'fastdecode[ray]' ({exc})") from None
    return serve


def model_source(model: str | os.PathLike | Callable[[], Any] | None, device: str = "cpu", dtype: str = "float32",
                 quantize: str | None = None) -> LoadSettings | Callable[[], Any]:
    """What each replica loads: a path (made absolute: replicas may start elsewhere) or None for the
    embedded model, with load()'s options; or a function returning a Generator."""
    if callable(model):
        return model
    return LoadSettings(model=None if model is None else str(Path(model).absolute()), device=device, dtype=dtype,
                        quantize=quantize)


def build_app(model: str | os.PathLike | Callable[[], Any] | None = None, *, device: str = "cpu",
              dtype: str = "float32", quantize: str | None = None, settings: ServeSettings | None = None,
              options: ReplicaOptions | None = None) -> Any:
    """The fastdecode Serve application (a ``ray.serve.Application``).

    ``model``: an HF folder or .gguf file every replica can read, None for the embedded model, or
    a function returning a ``Generator`` (called in each replica); ``settings``: what
    ``fastdecode serve`` takes (API key, model name, batching, context); ``options``: replicas,
    CPUs and routing.
    """
    serve = import_serve()
    from .ingress import Ingress
    from .replica import ModelReplica
    from .router import router_class

    settings, options = settings or ServeSettings(), options or ReplicaOptions()
    router_kwargs = {"imbalanced_threshold": options.imbalanced_threshold} if options.routing == "prefix" else {}
    model_deployment = serve.deployment(ModelReplica).options(
        name=MODEL_DEPLOYMENT, graceful_shutdown_timeout_s=settings.grace_seconds,
        request_router_config={"request_router_class": router_class(options.routing),
                               "request_router_kwargs": router_kwargs},
        **options.deployment_options())
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT, num_replicas=options.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING, graceful_shutdown_timeout_s=settings.grace_seconds)
    # the key and CORS are the ingress's, the only way in (a replica answering CORS too would double the headers)
    replica_settings = dataclasses.replace(settings, api_key=None, allowed_origins=())
    return ingress.bind(model_deployment.bind(model_source(model, device, dtype, quantize), replica_settings,
                                              options.cpus_per_replica), settings)


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files and ``serve run``: ``import_path: fastdecode.integrations.ray_serve:app_builder``
    with ``args`` naming ``build_app``'s load options (model, device, dtype, quantize), ServeSettings
    fields and ReplicaOptions fields; string values (``serve run ... replicas=2``) are converted."""
    groups = {"load": {f.name: f for f in dataclasses.fields(LoadSettings)},
              "settings": {f.name: f for f in dataclasses.fields(ServeSettings)},
              "options": {f.name: f for f in dataclasses.fields(ReplicaOptions)}}
    values: dict[str, dict[str, Any]] = {group: {} for group in groups}
    for key, value in args.items():
        group = next((g for g, fields in groups.items() if key in fields), None)
        if group is None:
            known = sorted(name for fields in groups.values() for name in fields)
            raise InvalidOptionError(f"unknown argument {key!r} (known: {', '.join(known)})")
        values[group][key] = _converted(key, value, groups[group][key].type)
    return build_app(**values["load"], settings=ServeSettings(**values["settings"]),
                     options=ReplicaOptions(**values["options"]))


def _converted(key: str, value: Any, annotation: Any) -> Any:
    """A ``serve run`` string -> the field's type (from its annotation: int, float, str, or None)."""
    kinds = str(annotation)
    if not isinstance(value, str) or kinds.startswith("str"):
        return value
    if value.lower() in ("none", "null") and "None" in kinds:
        return None
    if "str" in kinds:
        return value
    try:
        return float(value) if "float" in kinds else int(value)
    except ValueError:
        raise InvalidOptionError(f"argument {key!r} must be a number, got {value!r}") from None


def run_service(load: LoadSettings, settings: ServeSettings, options: ReplicaOptions, address: str, host: str,
                port: int, announce: Callable[[str], None]) -> int:
    """``fastdecode serve --ray``: serve until SIGTERM or Ctrl-C, then drain and remove the application.

    ``address``: "local" (a private Ray for the service, with a CPU per replica), "auto" or a
    cluster address; Serve's HTTP proxy listens on ``host``:``port`` unless Serve already runs
    on that cluster (its own proxy is used then).
    """
    from ..ray_batch import RayOptions, quiet_ray_logs, ray_connection

    if address == "local" and load.model is not None and not Path(load.model).exists():
        raise ModelNotFoundError(f"model path {load.model} does not exist")  # before replicas fail to load it
    serve = import_serve()
    quiet_ray_logs()
    with ray_connection(RayOptions(address=address, actors=options.most_replicas,
                                   cpus_per_actor=options.cpus_per_replica)):
        serve.start(http_options={"host": host, "port": port})
        app = build_app(load.model, device=load.device, dtype=load.dtype, quantize=load.quantize, settings=settings,
                        options=options)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # no replica could start: the reason is in the message
            raise InvalidOptionError(f"the service did not start on Ray Serve: {exc}") from None
        import ray

        announce(f"fastdecode on Ray Serve: http://{host}:{port} ({options.describe()}; "
                 f"Ray at {ray.get_runtime_context().gcs_address})")
        _wait_for_stop()
        announce("stopping: in-flight requests finish first")
        serve.delete(APP_NAME)  # each replica drains for at most settings.grace_seconds
        if address == "local":
            serve.shutdown()
    return 0


def _wait_for_stop() -> None:
    """Until SIGTERM or Ctrl-C (installed after ray.init, which sets its own SIGTERM handler)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
