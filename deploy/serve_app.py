"""raylm as a Ray Serve application.

Each replica owns a placement group: bundle 0 holds the replica itself (the engine, the
scheduler and the FastAPI ingress, no model work), bundles 1..tp one tensor-parallel
worker each, which `RayDistributedExecutor` finds through `get_current_placement_group()`.
STRICT_PACK keeps a replica's workers on one node, so their collectives stay local.
`check_health` asks the engine, so a replica whose worker died is replaced by Serve.

    serve run deploy/serve_config.yaml
    serve run raylm.deploy.serve_app:app_builder model=/path/to/model tensor_parallel_size=2
    raylm serve MODEL_DIR --ray-serve --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from ray import serve
from ray.serve import Application

from raylm.deploy.limits import RequestLimits

logger = logging.getLogger(__name__)

# Keys of app_builder's args that configure the deployment, not the engine or the server.
DEPLOYMENT_KEYS = ("num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "replica_cpus",
                   "worker_cpus", "use_gpu", "health_check_period_s", "health_check_timeout_s",
                   "max_ongoing_requests", "name")
SERVER_KEYS = ("served_model_name", "api_key", "chat_template", "trust_request_chat_template", "max_concurrent_requests",
               "max_request_body_bytes", "enable_auto_tool_choice", "tool_call_parser") + tuple(
                   f.name for f in dataclasses.fields(RequestLimits))


@serve.ingress()
class RaylmDeployment:
    """One replica: an `AsyncLLMEngine` and the OpenAI app built over it."""

    def __init__(self, engine_kwargs: dict[str, Any], server_kwargs: dict[str, Any]) -> None:
        from raylm.engine.arg_utils import EngineArgs
        from raylm.engine.async_llm_engine import AsyncLLMEngine

        logging.getLogger("raylm").setLevel(logging.INFO)
        self._server_kwargs = dict(server_kwargs, model=engine_kwargs.get("model"))
        # Built here, on the replica's own thread: the executor reads the replica's
        # placement group from the task context and puts its workers in bundles 1..tp.
        self.engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_kwargs(**engine_kwargs))

    def __serve_build_asgi_app__(self) -> Any:
        from raylm.deploy.api_server import build_app

        return build_app(self.engine, self._server_kwargs)

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        await self.engine.check_health()

    def worker_actors(self) -> list[Any]:
        """The tensor-parallel worker actors behind this replica (operations, tests)."""
        return list(getattr(self.engine.engine.executor, "workers", []))

    def uses_compiled_graph(self) -> bool:
        """Whether this replica's steps reach its workers through a Ray compiled graph."""
        return bool(getattr(self.engine.engine.executor, "uses_compiled_graph", False))

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - best effort while the replica goes away
                pass


def deployment_options(tensor_parallel_size: int = 1, *, use_ray_workers: bool | None = None,
                       replica_cpus: float = 1.0, worker_cpus: float = 0.5, use_gpu: bool = False,
                       num_replicas: int | None = None, min_replicas: int = 1, max_replicas: int = 1,
                       target_ongoing_requests: float = 64, max_ongoing_requests: int = 256,
                       health_check_period_s: float = 10.0, health_check_timeout_s: float = 30.0,
                       name: str = "RaylmDeployment") -> dict[str, Any]:
    """Serve options for a replica with `tensor_parallel_size` workers.

    The placement group is [{"CPU": replica_cpus}] + [{"GPU": 1} or {"CPU": worker_cpus}] * tp;
    without Ray workers (tp 1 in process) it is the replica's bundle alone. The
    autoscaling config scales between min_replicas and max_replicas on ongoing requests
    (a fixed num_replicas overrides it).
    """
    use_ray_workers = tensor_parallel_size > 1 if use_ray_workers is None else use_ray_workers
    options: dict[str, Any] = dict(
        name=name,
        ray_actor_options={"num_cpus": replica_cpus},
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s,
        # Building a replica loads the model and starts its workers: allow for it.
        graceful_shutdown_timeout_s=5,
    )
    if use_ray_workers:
        worker_bundle = {"GPU": 1.0} if use_gpu else {"CPU": worker_cpus}
        options["placement_group_bundles"] = [{"CPU": replica_cpus}] + [dict(worker_bundle)
                                                                         for _ in range(tensor_parallel_size)]
        options["placement_group_strategy"] = "STRICT_PACK"
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": min_replicas,
            "initial_replicas": min_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests,
            "upscale_delay_s": 10,
            "downscale_delay_s": 300,
        }
    return options


def build_serve_app(engine_kwargs: dict[str, Any], server_kwargs: dict[str, Any] | None = None,
                    **deployment_kwargs: Any) -> Application:
    """The bound Serve application: deployment options from `deployment_options`."""
    engine_kwargs = dict(engine_kwargs)
    tp = int(engine_kwargs.get("tensor_parallel_size", 1))
    use_ray_workers = tp > 1 or engine_kwargs.get("distributed_executor_backend") == "ray"
    if use_ray_workers:
        engine_kwargs.setdefault("distributed_executor_backend", "ray")
    # The executor gives each worker its bundle's CPUs; one number sizes both.
    if "worker_cpus" in deployment_kwargs:
        engine_kwargs.setdefault("ray_cpus_per_worker", deployment_kwargs["worker_cpus"])
    elif "ray_cpus_per_worker" in engine_kwargs:
        deployment_kwargs["worker_cpus"] = float(engine_kwargs["ray_cpus_per_worker"])
    options = deployment_options(tp, use_ray_workers=use_ray_workers, **deployment_kwargs)
    return serve.deployment(RaylmDeployment).options(**options).bind(engine_kwargs, dict(server_kwargs or {}))


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run raylm.deploy.serve_app:app_builder model=... tensor_parallel_size=2`, or a
    Serve config's `args:`. Engine keys are EngineArgs fields; server keys are
    served_model_name, api_key, chat_template; the rest (DEPLOYMENT_KEYS) shape the
    deployment. Values given on the `serve run` command line arrive as strings."""
    from raylm.engine.arg_utils import EngineArgs

    from raylm.models.bundled import resolve_model_path

    args = dict(args or {})
    # No model, or the demo model's short name (what deploy/serve_config.yaml ships with),
    # means the bundled demo model's folder.
    args["model"] = resolve_model_path(args.get("model"))
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(args) - set(engine_fields) - set(DEPLOYMENT_KEYS) - set(SERVER_KEYS))
    if unknown:
        raise ValueError(f"Unknown app argument(s) {unknown}: use EngineArgs fields, {list(SERVER_KEYS)} or "
                         f"{list(DEPLOYMENT_KEYS)}.")
    engine_kwargs = {k: _coerce(engine_fields[k].default, v) for k, v in args.items() if k in engine_fields}
    server_kwargs = {k: v for k, v in args.items() if k in SERVER_KEYS}
    deployment_kwargs = {k: _coerce_number(v) for k, v in args.items() if k in DEPLOYMENT_KEYS and k != "name"}
    if "use_gpu" in deployment_kwargs:
        deployment_kwargs["use_gpu"] = _as_bool(deployment_kwargs["use_gpu"])
    if "name" in args:
        deployment_kwargs["name"] = args["name"]
    return build_serve_app(engine_kwargs, server_kwargs, **deployment_kwargs)


def _as_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")


def _coerce_number(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return _as_bool(value) if value.lower() in ("true", "false") else value


def _coerce(default: Any, value: Any) -> Any:
    """`serve run key=value` gives strings: convert to the field's default's type."""
    if not isinstance(value, str):
        return value
    if isinstance(default, bool):
        return _as_bool(value)
    if isinstance(default, int) or default is None:
        try:
            return int(value)
        except ValueError:
            pass
    if isinstance(default, float) or default is None:
        try:
            return float(value)
        except ValueError:
            pass
    return value


def run_cli(args: argparse.Namespace) -> None:
    """`raylm serve --ray-serve`: starts (or joins) Ray, runs the app, blocks until Ctrl-C."""
    import time

    import ray

    from raylm.deploy.api_server import resolve_model
    from raylm.engine.arg_utils import EngineArgs

    args.model = resolve_model(args)
    engine_kwargs = dataclasses.asdict(EngineArgs.from_cli_args(args))
    server_kwargs = {"served_model_name": args.served_model_name, "api_key": args.api_key,
                     "chat_template": args.chat_template, "enable_auto_tool_choice": args.enable_auto_tool_choice,
                     "tool_call_parser": args.tool_call_parser}
    if not ray.is_initialized():
        ray.init(address="auto" if _ray_cluster_running() else None, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    application = build_serve_app(engine_kwargs, server_kwargs, min_replicas=args.min_replicas,
                                  max_replicas=max(args.min_replicas, args.max_replicas),
                                  use_gpu=args.device != "cpu" and _has_gpu())
    serve.run(application, name="raylm", route_prefix="/")
    logger.info("Ray Serve app 'raylm' serving %s on http://%s:%d", args.model, args.host, args.port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


def _ray_cluster_running() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False
