"""raylm as a Ray Serve application: an HTTP ingress in front of N engine replicas.

The engine deployment (`RaylmDeployment`) runs N replicas (a fixed `num_replicas`, or
Serve's autoscaling between min_replicas and max_replicas), each with its own
`AsyncLLMEngine` and the OpenAI app `raylm serve` runs. Each replica owns a placement
group: bundle 0 holds the replica itself (the engine, the scheduler and the app, no model
work), bundles 1..tp one tensor-parallel worker each, which `RayDistributedExecutor` finds
through `get_current_placement_group()`. STRICT_PACK keeps a replica's workers on one node,
so their collectives stay local. `check_health` asks the engine, so a replica whose worker
died is replaced by Serve.

In front, the ingress (`RaylmIngress`, deploy/serve_ingress.py) reads each request and
relays it to a replica that Serve's router for the engine deployment picks:
`request_router=prefix_aware` (the default, deploy/prefix_router.py) sends it to the
replica holding the longest prefix of its prompt, `power_of_two` is Serve's default. The
replicas report the blocks their prefix caches hold (`record_routing_stats`), which Serve
carries to the router every `router_stats_period_s`.

    serve run deploy/serve_config.yaml
    serve run raylm.deploy.serve_app:app_builder model=/path/to/model num_replicas=2
    raylm serve MODEL_DIR --ray-serve --num-replicas 2 --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve import Application

from raylm.deploy.prefix_key import KEY_HASH_BYTES
from raylm.deploy.prefix_router import PrefixAwareRouter, build_report
from raylm.deploy.serve_ingress import ForwardedRequest, RaylmIngress, run_forwarded
from raylm.deploy.server_args import PREFIX_AWARE_ROUTER, DeploymentArgs, ServerArgs
from raylm.engine import arg_fields, envs
from raylm.engine.arg_utils import EngineArgs
from raylm.models.bundled import resolve_model_path

logger = logging.getLogger(__name__)

# The ingress deployment's name (the engine's is DeploymentArgs.name).
INGRESS_NAME = "RaylmIngress"


class RaylmDeployment:
    """One engine replica: an `AsyncLLMEngine` and the OpenAI app built over it, which
    serves the requests the ingress relays (`handle_http`)."""

    def __init__(self, engine_kwargs: dict[str, Any], server_args: ServerArgs,
                 reported_blocks: int = DeploymentArgs.router_reported_blocks) -> None:
        from raylm.deploy.api_server import build_app, freeze_startup_heap
        from raylm.engine.async_llm_engine import AsyncLLMEngine
        from raylm.engine.usage_context import UsageContext

        logging.getLogger("raylm").setLevel(logging.INFO)
        self.server_args = server_args
        self.reported_blocks = reported_blocks
        # Built here, on the replica's own thread: the executor reads the replica's
        # placement group from the task context and puts its workers in bundles 1..tp.
        self.engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_kwargs(**engine_kwargs),
                                                     usage_context=UsageContext.OPENAI_API_SERVER)
        self.app = build_app(self.engine, self.server_args)
        freeze_startup_heap()

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[list[dict[str, Any]]]:
        """Answers an HTTP request the ingress relays: its ASGI response messages, in batches."""
        async for messages in run_forwarded(self.app, request):
            yield messages

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        await self.engine.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this every router_stats_period_s and hands the result to the
        routers: the replica's prefix-cache counters (tokens) and the hashes of the blocks
        it caches, most recently used first (the router's view of this replica)."""
        kv_cache_manager = self.engine.scheduler.kv_cache_manager
        hashes = await self.engine.recent_cached_block_hashes(self.reported_blocks)
        return build_report(kv_cache_manager.block_size, hashes, kv_cache_manager.prefix_cache_hits,
                            kv_cache_manager.prefix_cache_queries, KEY_HASH_BYTES)

    def served_server_args(self) -> ServerArgs:
        """The server settings this replica serves with (operations, tests)."""
        return self.server_args

    def worker_actors(self) -> list[Any]:
        """The tensor-parallel worker actors behind this replica (operations, tests)."""
        return list(getattr(self.engine.engine.executor, "workers", []))

    def uses_compiled_graph(self) -> bool:
        """Whether this replica's steps reach its workers through a Ray compiled graph."""
        return bool(getattr(self.engine.engine.executor, "uses_compiled_graph", False))

    def __del__(self) -> None:
        # Serve calls this when it stops the replica; the app gets no lifespan events here.
        from raylm.deploy.api_server import shutdown_app

        app = getattr(self, "app", None)
        if app is not None:
            with contextlib.suppress(Exception):  # best effort while the replica goes away
                shutdown_app(app)
        engine = getattr(self, "engine", None)
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()


def deployment_options(num_workers: int = 1, deployment: DeploymentArgs | None = None, *,
                       use_ray_workers: bool | None = None, worker_cpus: float = 0.5,
                       shutdown_timeout: float = ServerArgs.shutdown_timeout) -> dict[str, Any]:
    """Serve options for the engine deployment, whose replicas have `num_workers` workers
    each (tensor_parallel_size x pipeline_parallel_size).

    The placement group is [{"CPU": replica_cpus}] + [{"GPU": 1} or {"CPU": worker_cpus}] *
    num_workers; without Ray workers (one worker in process) it is the replica's bundle alone. The
    autoscaling config scales between min_replicas and max_replicas on ongoing requests
    (a fixed num_replicas overrides it). The server's shutdown_timeout is how long Serve
    lets a stopping replica finish its requests. The request router config names the
    router and how often the replicas report their prefix caches.
    """
    deployment = deployment or DeploymentArgs()
    use_ray_workers = num_workers > 1 if use_ray_workers is None else use_ray_workers
    options: dict[str, Any] = dict(
        name=deployment.name,
        ray_actor_options={"num_cpus": deployment.replica_cpus},
        max_ongoing_requests=deployment.max_ongoing_requests,
        health_check_period_s=deployment.health_check_period_s,
        health_check_timeout_s=deployment.health_check_timeout_s,
        graceful_shutdown_timeout_s=shutdown_timeout,
        request_router_config=request_router_config(deployment),
    )
    if use_ray_workers:
        worker_bundle = {"GPU": 1.0} if deployment.use_gpu else {"CPU": worker_cpus}
        options["placement_group_bundles"] = [{"CPU": deployment.replica_cpus}] + [
            dict(worker_bundle) for _ in range(num_workers)]
        options["placement_group_strategy"] = "STRICT_PACK"
    if deployment.num_replicas is not None:
        options["num_replicas"] = deployment.num_replicas
    else:
        min_replicas, max_replicas = deployment.replica_range
        options["autoscaling_config"] = {
            "min_replicas": min_replicas,
            "initial_replicas": min_replicas if deployment.initial_replicas is None else deployment.initial_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": deployment.target_ongoing_requests,
            "upscale_delay_s": deployment.upscale_delay_s,
            "downscale_delay_s": deployment.downscale_delay_s,
        }
    return options


def request_router_config(deployment: DeploymentArgs) -> Any:
    """Serve's RequestRouterConfig for the engine deployment: the prefix-aware router with
    its settings, or Serve's default; the replicas report every router_stats_period_s."""
    from ray.serve.config import RequestRouterConfig

    period = deployment.router_stats_period_s
    # A report is a few ms of the engine's thread; one that takes longer than a few
    # periods is given up and asked again.
    timing = dict(request_routing_stats_period_s=period, request_routing_stats_timeout_s=max(10.0, 5 * period))
    if deployment.request_router != PREFIX_AWARE_ROUTER:
        return RequestRouterConfig(**timing)
    return RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={"imbalance_threshold": deployment.router_imbalance_threshold,
                               "min_match_ratio": deployment.router_min_match_ratio,
                               "retention_s": deployment.router_retention_s},
        **timing)


def ingress_options(deployment: DeploymentArgs, shutdown_timeout: float) -> dict[str, Any]:
    """Serve options for the ingress: it forwards, so it takes as many requests in flight
    as all the engine replicas together."""
    return dict(name=INGRESS_NAME, num_replicas=deployment.ingress_replicas,
                ray_actor_options={"num_cpus": deployment.ingress_cpus},
                max_ongoing_requests=deployment.max_ongoing_requests * deployment.most_replicas,
                graceful_shutdown_timeout_s=shutdown_timeout)


def keyer_arguments(engine_args: EngineArgs, server_args: ServerArgs, deployment: DeploymentArgs
                    ) -> dict[str, Any] | None:
    """What the ingress builds its prefix keyer from, or None when nothing is keyed (Serve's
    default router, prefix caching off, as a MEAN or CLS pooling engine has it, or a single
    replica: nothing to choose)."""
    if (deployment.request_router != PREFIX_AWARE_ROUTER or deployment.most_replicas < 2
            or not engine_args.caches_prefixes()):
        return None
    return dict(tokenizer=None if engine_args.skip_tokenizer_init else engine_args.tokenizer or engine_args.model,
                trust_remote_code=engine_args.trust_remote_code, revision=engine_args.revision,
                tokenizer_mode=engine_args.tokenizer_mode, block_size=engine_args.block_size,
                max_blocks=deployment.router_max_key_blocks, chat_template=server_args.chat_template,
                trust_request_chat_template=server_args.trust_request_chat_template,
                base_model_names=_base_model_names(engine_args, server_args),
                chat_template_content_format=server_args.chat_template_content_format)


def _base_model_names(engine_args: EngineArgs, server_args: ServerArgs) -> list[str] | None:
    """With LoRA on, the `model` values that mean the base model (any other names an
    adapter, which the prefix key must tell apart); None with LoRA off."""
    if not engine_args.enable_lora:
        return None
    model = resolve_model_path(engine_args.model)
    return server_args.model_names(model) + server_args.model_aliases(model)


def build_serve_app(engine_kwargs: dict[str, Any], server_args: ServerArgs | dict[str, Any] | None = None,
                    deployment: DeploymentArgs | None = None, **deployment_kwargs: Any) -> Application:
    """The bound Serve application: the ingress over the engine deployment. `server_args`: a
    `ServerArgs`, or a dict of its keys; `deployment_kwargs`: `DeploymentArgs` fields (or a
    whole `deployment`)."""
    engine_kwargs = dict(engine_kwargs)
    if not isinstance(server_args, ServerArgs):
        server_args = ServerArgs.from_values(server_args or {})
    deployment = deployment or DeploymentArgs.from_values(deployment_kwargs)
    if server_args.lora.allow_runtime_lora_updating and deployment.most_replicas > 1:
        # A load request reaches one replica; the others would answer 404 for the adapter.
        raise ValueError(f"allow_runtime_lora_updating loads an adapter on the one replica its request reaches, so "
                         f"it needs a single engine replica (num_replicas=1), got up to {deployment.most_replicas}; "
                         f"serve adapters on several replicas with lora_modules.")
    if envs.RAYLM_SERVER_DEV_MODE and deployment.most_replicas > 1:
        # /sleep, /wake_up and /collective_rpc (a trainer's weight push) would reach the one
        # replica the router picks: the others would serve on, awake or with the old weights.
        raise ValueError(f"RAYLM_SERVER_DEV_MODE's routes (/sleep, /wake_up, /collective_rpc, ...) act on the one "
                         f"replica their request reaches, so they need a single engine replica (num_replicas=1), "
                         f"got up to {deployment.most_replicas}.")
    # One bundle per worker: tensor_parallel_size of them in each pipeline stage.
    num_workers = (int(engine_kwargs.get("tensor_parallel_size", 1))
                   * int(engine_kwargs.get("pipeline_parallel_size", 1)))
    use_ray_workers = num_workers > 1 or engine_kwargs.get("distributed_executor_backend") == "ray"
    if use_ray_workers:
        engine_kwargs.setdefault("distributed_executor_backend", "ray")
    # The executor gives each worker its bundle's CPUs; one number sizes both.
    if deployment.worker_cpus is not None:
        engine_kwargs.setdefault("ray_cpus_per_worker", deployment.worker_cpus)
    worker_cpus = float(engine_kwargs.get("ray_cpus_per_worker", EngineArgs.ray_cpus_per_worker))
    options = deployment_options(num_workers, deployment, use_ray_workers=use_ray_workers, worker_cpus=worker_cpus,
                                 shutdown_timeout=server_args.shutdown_timeout)
    if use_ray_workers and str(engine_kwargs.get("ray_span_nodes", False)).lower() in ("true", "1"):
        options["placement_group_strategy"] = "PACK"  # the replica's workers may span nodes (pipeline stages)
    engine = serve.deployment(RaylmDeployment).options(**options).bind(
        engine_kwargs, server_args, deployment.router_reported_blocks)
    keyer_args = keyer_arguments(EngineArgs.from_kwargs(**engine_kwargs), server_args, deployment)
    ingress = serve.deployment(RaylmIngress).options(
        **ingress_options(deployment, server_args.shutdown_timeout))
    return ingress.bind(engine, keyer_args, server_args.max_request_body_bytes, server_args.root_path,
                        server_args.resolved_api_key(), server_args.request_body_timeout)


@dataclass
class AppArguments:
    """A Serve app's `args`, sorted and typed: the given engine arguments (model resolved),
    the server settings and the deployment settings."""

    engine_kwargs: dict[str, Any]
    server_args: ServerArgs
    deployment: DeploymentArgs


def app_arguments(args: dict[str, Any] | None) -> AppArguments:
    """Sorts and types a Serve app's `args`. Values from the `serve run` command line
    arrive as strings and are parsed by each setting's type ("false" is False); a key that
    is no setting is a ValueError naming its near misses."""
    from raylm.models.bundled import resolve_model_path

    args = dict(args or {})
    engine_names = [s.name for s in arg_fields.settings_of(EngineArgs)]
    server_names = [s.name for s in arg_fields.settings_of(ServerArgs)]
    deployment_names = [s.name for s in arg_fields.settings_of(DeploymentArgs)]
    unknown = [key for key in args if key not in {*engine_names, *server_names, *deployment_names}]
    if unknown:
        raise ValueError(arg_fields.unknown_keys_message(
            unknown, engine_names + ServerArgs.keys() + DeploymentArgs.keys(), "app argument")
            + " Keys are engine arguments (docs/engine_args.md), server and deployment settings "
              "(docs/server_flags.md).")
    engine_values = {k: v for k, v in args.items() if k in engine_names}
    engine_args = EngineArgs.from_values(engine_values)
    # No model, or the demo model's short name (what deploy/serve_config.yaml ships with),
    # means the bundled demo model's folder.
    engine_kwargs = {name: getattr(engine_args, name) for name in engine_values}
    engine_kwargs["model"] = resolve_model_path(engine_args.model or None)
    return AppArguments(engine_kwargs,
                        ServerArgs.from_values({k: v for k, v in args.items() if k in server_names}),
                        DeploymentArgs.from_values({k: v for k, v in args.items() if k in deployment_names}))


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run raylm.deploy.serve_app:app_builder model=... tensor_parallel_size=2`, or a
    Serve config's `args:`: engine arguments, server settings and deployment settings, by
    their field names (docs/engine_args.md, docs/server_flags.md)."""
    parsed = app_arguments(args)
    return build_serve_app(parsed.engine_kwargs, parsed.server_args, parsed.deployment)


def cli_serve_app(args: argparse.Namespace, **deployment_overrides: Any) -> tuple[Application, ServerArgs]:
    """`raylm serve --ray-serve`'s application and server settings, from its flags: every
    server setting reaches the replicas (the API key resolved here, from --api-key,
    --api-key-file or RAYLM_API_KEY). `deployment_overrides`: DeploymentArgs fields that
    have no flag."""
    from raylm.deploy.api_server import resolve_model

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = resolve_model(args)
    server_args = ServerArgs.from_cli_args(args)
    server_args = dataclasses.replace(server_args, api_key=server_args.resolved_api_key(), api_key_file=None)
    deployment = DeploymentArgs.from_cli_args(args)
    deployment = dataclasses.replace(deployment, use_gpu=engine_args.device != "cpu" and _has_gpu(),
                                     **deployment_overrides)
    return build_serve_app(dataclasses.asdict(engine_args), server_args, deployment), server_args


class _ShutdownRequested(Exception):
    """SIGTERM or SIGINT reached `raylm serve --ray-serve`."""


def run_cli(args: argparse.Namespace) -> None:
    """`raylm serve --ray-serve`: starts (or joins) Ray, runs the app and blocks until
    SIGTERM or Ctrl-C (even during startup), then shuts Serve down, logging each stage."""
    import signal

    import ray

    from raylm.deploy.api_server import check_port_free, resolve_model

    application, server_args = cli_serve_app(args)
    # Found now, not after Ray and the replicas have started.
    check_port_free(server_args.host, server_args.port)
    if not ray.is_initialized():
        ray.init(address="auto" if _ray_cluster_running() else None, include_dashboard=False)

    def request_shutdown(signum: int, _: Any) -> None:
        raise _ShutdownRequested(signal.Signals(signum).name)

    # After ray.init, which installs handlers of its own.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_shutdown)
    try:
        serve.start(http_options={"host": server_args.host, "port": server_args.port})
        serve.run(application, name="raylm", route_prefix="/")
        names = server_args.model_names(resolve_model(args))
        deployment = DeploymentArgs.from_cli_args(args)
        replicas = (str(deployment.num_replicas) if deployment.num_replicas is not None
                    else "{}-{}".format(*deployment.replica_range))
        logger.info("Ray Serve app 'raylm' serving %s on http://%s:%d%s (%s engine replicas, %s routing)",
                    ", ".join(names), server_args.host, server_args.port, server_args.root_path, replicas,
                    deployment.request_router)
        while True:
            signal.pause()
    except (_ShutdownRequested, KeyboardInterrupt) as stop:
        name = str(stop) or "SIGINT"
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        logger.info("Shutting down on %s: Serve lets each replica finish its requests for up to %.0f s, then "
                    "stops it and its workers.", name, server_args.shutdown_timeout)
        serve.shutdown()
        logger.info("Shutdown complete.")


def _ray_cluster_running() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False
