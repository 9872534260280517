"""`ServerArgs`: the one definition of the OpenAI server's own settings.

The engine's settings live in `EngineArgs`; the server's here, each field once, with its
type, default and help. From these fields come the `raylm serve` flags
(`add_cli_args`), the keys of the Ray Serve application (`from_values`, typed: the
strings of `serve run ... trust_request_chat_template=false` become False), and
`docs/server_flags.md`. The request limits (`RequestLimits`) are part of them, spelled
beside the others (`--max-stop-strings`, key `max_stop_strings`).

This module imports neither FastAPI nor Ray, so that building the command line costs
neither.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from raylm.deploy.limits import RequestLimits
from raylm.deploy.reasoning_parsers import REASONING_PARSERS, check_reasoning_parser
from raylm.deploy.tool_parsers import TOOL_PARSERS, check_tool_settings
from raylm.engine import envs
from raylm.engine.arg_fields import SettingsMixin, nested, setting

# 4x the engine's default max_num_seqs (256): enough waiting requests to keep the batch
# full, a bounded queue behind it (TGI's --max-concurrent-requests defaults to 128).
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
# A prompt of 128k tokens as text or as token ids, or --max-prompts-per-request prompts
# of a few thousand token ids, fit several times over.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# A 16 MiB body at 4 Mbit/s, with room to spare; nginx's client_body_timeout is 60 s too
# (between two reads, where this bounds the whole body).
DEFAULT_REQUEST_BODY_TIMEOUT_S = 60.0
# Below Kubernetes' default grace period (30 s, then SIGKILL), so the engine and its
# workers are shut down before the kill.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0
# What an adapter being served costs is its name and path (at most 5 KiB together), its
# files' digest and its /v1/models entry; its weights are held only while it is in host
# memory (max_cpu_loras, least recently used dropped). vLLM bounds none of it; this leaves
# room for the hundreds of adapters multi-tenant servers run.
DEFAULT_MAX_SERVED_LORAS = 1024
# Request chat templates that may wait for one of the 2 processes that render them
# (deploy/chat_template_sandbox.py: DEFAULT_MAX_PROCESSES x QUEUED_RENDERS_PER_PROCESS, not
# imported here, since it would bring Jinja into the command line's start).
DEFAULT_MAX_QUEUED_CHAT_TEMPLATE_RENDERS = 8
# --chat-template-content-format's choices (deploy/chat_template.py's CONTENT_FORMATS).
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
# The environment variable holding the API key, so that it need not be on the command
# line (where `ps` shows it): vLLM reads VLLM_API_KEY.
API_KEY_ENV = envs.API_KEY_VARIABLE

@dataclass
class LoRAServerSettings:
    """The server's LoRA settings (the engine's, --enable-lora, --max-loras and the others,
    are engine arguments); see docs/lora.md."""

    lora_modules: list[str] | None = field(default=None, metadata=setting(
        "LoRA adapters to serve (needs --enable-lora), each `name=path` or JSON {\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...}: requests with `model` set to the name run under the adapter (a PEFT folder "
        "with adapter_config.json and adapter_model.safetensors). Default: none."))
    allow_runtime_lora_updating: bool = field(default=False, metadata=setting(
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): "
        "clients may then load adapters from the folders under --allowed-lora-dirs."))
    allowed_lora_dirs: list[str] | None = field(default=None, metadata=setting(
        "Folders under which /v1/load_lora_adapter may load adapters (needed by --allow-runtime-lora-updating); "
        "a path outside them, symbolic links resolved, is refused. Default: none."))
    max_served_loras: int = field(default=DEFAULT_MAX_SERVED_LORAS, metadata=setting(
        "Most LoRA adapters served at once, --lora-modules and runtime loads together: a /v1/load_lora_adapter past "
        "it is answered 400 (unload one first). Any number of them may be served while at most --max-cpu-loras are "
        "in host memory (the least recently used are dropped and read again when needed), as in vLLM, which bounds "
        "neither."))

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, str):
            # One string: a JSON list, one JSON object, or comma-separated `name=path` entries.
            text = self.lora_modules.strip()
            self.lora_modules = (json.loads(text) if text.startswith("[") else [text] if text.startswith("{")
                                 else [part for part in text.split(",") if part])
        if isinstance(self.allowed_lora_dirs, str):
            self.allowed_lora_dirs = [part for part in self.allowed_lora_dirs.split(",") if part]
        if self.allow_runtime_lora_updating and not self.allowed_lora_dirs:
            raise ValueError("allow_runtime_lora_updating needs allowed_lora_dirs (--allowed-lora-dirs): the folders "
                             "from which clients may load adapters.")
        if isinstance(self.max_served_loras, bool) or not isinstance(self.max_served_loras, int) \
                or self.max_served_loras < 1:
            raise ValueError(f"max_served_loras must be a positive integer, got {self.max_served_loras!r}.")
        if len(self.lora_modules or ()) > self.max_served_loras:
            raise ValueError(f"lora_modules names {len(self.lora_modules)} adapters; at most max_served_loras "
                             f"(--max-served-loras) = {self.max_served_loras} may be served.")
        for folder in self.allowed_lora_dirs or ():
            if not os.path.isdir(folder):
                raise ValueError(f"allowed_lora_dirs: {folder!r} is not a folder.")


_SERVE_HTTP = "Ray Serve's http_options set it (`serve run --host/--port`, the config's http_options)."
_UVICORN_ONLY = "uvicorn's own; Ray Serve runs its own HTTP proxy."


@dataclass
class ServerArgs(SettingsMixin):
    """The server's settings (the engine's are in `EngineArgs`)."""

    setting_kind = "server setting"

    host: str = field(default="127.0.0.1", metadata=setting(
        "Address to listen on; the default listens on loopback only.", key=False, note=_SERVE_HTTP))
    port: int = field(default=8000, metadata=setting("Port to listen on.", key=False, note=_SERVE_HTTP))
    api_key: str | None = field(default=None, metadata=setting(
        f"Require `Authorization: Bearer KEY` on every route but /health and /metrics. Default: the key in "
        f"--api-key-file, else the environment variable {API_KEY_ENV}, else no key. A key given here shows in "
        f"`ps`; prefer {API_KEY_ENV} or --api-key-file."))
    api_key_file: str | None = field(default=None, metadata=setting(
        "A file whose content (less surrounding whitespace) is the API key; default: none."))
    root_path: str = field(default="", metadata=setting(
        "The path prefix a proxy serves this server under (uvicorn's root_path), as in vLLM; default: none."))
    served_model_name: list[str] | None = field(default=None, metadata=setting(
        "Model name(s) clients use in `model`; the first is reported in responses, /v1/models and metric labels. "
        "Default: the model folder's name ('raylm-demo-code' for the demo model), never its path. As a Serve "
        "key, several names are comma-separated."))
    chat_template: str | None = field(default=None, metadata=setting(
        "Chat template (a Jinja file or the template itself) instead of the tokenizer's; default: the "
        "tokenizer's. For a cross-encoder it is also vLLM's score template: /score and /rerank render each pair "
        "with it, as messages of roles 'query' and 'document' (e.g. examples/score_templates/qwen3_reranker.jinja "
        "for Qwen3-Reranker); without it a pair is tokenized as is."))
    trust_request_chat_template: bool = field(default=False, metadata=setting(
        "Accept a chat_template sent with a chat request (off, as in vLLM: a template is code the server runs); "
        "it renders in a process of its own, within --max-chat-template-render-seconds and "
        "--max-chat-template-steps (docs/serving.md, Chat templates)."))
    max_queued_chat_template_renders: int = field(default=DEFAULT_MAX_QUEUED_CHAT_TEMPLATE_RENDERS, metadata=setting(
        "Request chat templates (--trust-request-chat-template) that may wait for one of the 2 processes that "
        "render them; one more is answered 429 with Retry-After at once. The time a template waits counts against "
        "its --max-chat-template-render-seconds; one whose time runs out before a process is free is answered 429 "
        "too."))
    enable_auto_tool_choice: bool = field(default=False, metadata=setting(
        "Serve tool_choice 'auto' (the default when a chat request gives tools): the model decides whether to "
        "call tools, and --tool-call-parser finds the calls in its text (off, as in vLLM: such requests get 400)."))
    tool_call_parser: str | None = field(default=None, metadata=setting(
        "The model family's tool-call format, for --enable-auto-tool-choice: hermes (Hermes, Qwen 2.5 / 3), "
        "llama3_json (Llama 3.1 / 3.2 JSON), mistral, openai (gpt-oss's harmony calls; it turns on --reasoning-parser "
        "openai_gptoss), qwen3_coder or its alias qwen3_xml (Qwen3-Coder, Qwen3.5 XML calls); default: none.",
        choices=tuple(sorted(TOOL_PARSERS))))
    reasoning_parser: str | None = field(default=None, metadata=setting(
        "The reasoning model's format: chat replies come split into `reasoning` (the thinking between <think> and "
        "</think>) and `content` (the answer after it), tool calls and structured outputs applying to the answer "
        "alone (docs/reasoning.md). deepseek_r1 (DeepSeek-R1, QwQ), openai_gptoss (gpt-oss's harmony channels: "
        "analysis is the reasoning, final the content), qwen3 (Qwen3, whose thinking a request's "
        "chat_template_kwargs {\"enable_thinking\": false} turns off); default: none.",
        choices=tuple(sorted(REASONING_PARSERS))))
    return_tokens_as_token_ids: bool = field(default=False, metadata=setting(
        "Name each token in logprobs `token_id:{id}` instead of its text, the alternatives in top_logprobs too, so "
        "that tokens whose text is not valid UTF-8 on their own can be told apart (vLLM's flag; off). A request's "
        "return_tokens_as_token_ids overrides it either way."))
    response_role: str = field(default="assistant", metadata=setting(
        "The role of the chat reply's message when the request has add_generation_prompt (the default); a request "
        "that continues its last message (add_generation_prompt false) is answered in that message's role, as in "
        "vLLM."))
    chat_template_content_format: str = field(default="auto", metadata=setting(
        "How a chat message's content reaches the chat template, as vLLM's flag: 'string' as one string (text "
        "parts joined by newlines), 'openai' as OpenAI's list of parts ([{\"type\": \"text\", \"text\": ...}], a "
        "string content becoming one part); 'auto' picks 'openai' for a template that loops over a message's "
        "content, else 'string'.", choices=CHAT_TEMPLATE_CONTENT_FORMATS))
    enable_log_requests: bool = field(default=False, metadata=setting(
        "Log each request as it reaches the engine, at INFO: its id, prompt, prompt token ids (both cut to "
        "--max-log-len), sampling parameters and LoRA adapter (vLLM's flag; off). Headers, and so API keys, are "
        "never logged."))
    disable_log_requests: bool = field(default=False, metadata=setting(
        "vLLM's older spelling, from before request logging was off by default: requests are not logged, as "
        "without --enable-log-requests; the two together are an error."))
    enable_prompt_tokens_details: bool = field(default=False, metadata=setting(
        "Completions' and chats' usage also gives prompt_tokens_details.cached_tokens: the prompt's tokens whose "
        "keys and values came from the prefix cache (vLLM's flag; off). /v1/responses always reports them."))
    enable_log_outputs: bool = field(default=False, metadata=setting(
        "With --enable-log-requests: also log each choice as it finishes, at INFO: the text as the model wrote it "
        "(reasoning and tool-call markup included), its token ids (both cut to --max-log-len) and finish reason; "
        "a streamed choice once, whole (vLLM's flag; vLLM also logs every streamed delta)."))
    max_log_len: int | None = field(default=None, metadata=setting(
        "With --enable-log-requests: most characters of a prompt, and most of its token ids, a request's log line "
        "shows; default: all of them."))
    uvicorn_log_level: str = field(default="warning", metadata=setting(
        "uvicorn's log level.", key=False, note=_UVICORN_ONLY,
        choices=("critical", "error", "warning", "info", "debug", "trace")))
    max_concurrent_requests: int = field(default=DEFAULT_MAX_CONCURRENT_REQUESTS, metadata=setting(
        "Requests in flight (received, not yet fully answered) past which a new one is answered 429 at once; "
        "/health and /metrics do not count."))
    max_response_tokens_in_flight: int | None = field(default=None, metadata=setting(
        "Most tokens the responses in flight may hold together, each request counted as --max-response-tokens "
        "counts it (tokens, logprobs and prompt copies, at some 512 bytes each); a request that does not fit beside "
        "the others is answered 429 with Retry-After. Default: a quarter of the memory the process may use (the "
        "machine's, or its cgroup's limit where lower) / 512 bytes, at least --max-response-tokens."))
    max_request_body_bytes: int = field(default=DEFAULT_MAX_REQUEST_BODY_BYTES, metadata=setting(
        "Largest request body (16 MiB by default); a larger one is answered 413 before it is read."))
    request_body_timeout: float = field(default=DEFAULT_REQUEST_BODY_TIMEOUT_S, metadata=setting(
        "Seconds a request's body may take to arrive after its headers; a slower one is answered 408 and no longer "
        "counts against --max-concurrent-requests (a client that sent part of a body and waited held its place "
        "for ever; under Ray Serve, the ingress's place among its max_ongoing_requests)."))
    shutdown_timeout: float = field(default=DEFAULT_SHUTDOWN_TIMEOUT_S, metadata=setting(
        "Seconds SIGTERM lets the requests in flight finish before it aborts them (under Ray Serve: the "
        "replica's graceful_shutdown_timeout_s)."))
    limits: RequestLimits = field(default_factory=RequestLimits, metadata=nested())
    lora: LoRAServerSettings = field(default_factory=LoRAServerSettings, metadata=nested())

    def __post_init__(self) -> None:
        if self.enable_log_requests and self.disable_log_requests:
            raise ValueError("--enable-log-requests and --disable-log-requests contradict each other: give one.")
        if self.max_log_len is not None and (isinstance(self.max_log_len, bool) or not isinstance(self.max_log_len, int)
                                             or self.max_log_len < 0):
            raise ValueError(f"max_log_len (--max-log-len) must be a non-negative integer, got {self.max_log_len!r}.")
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format (--chat-template-content-format) must be one of auto, "
                             f"string, openai, got {self.chat_template_content_format!r}.")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(f"response_role (--response-role) must be a non-empty string, got "
                             f"{self.response_role!r}.")
        for name in ("max_concurrent_requests", "max_request_body_bytes", "max_queued_chat_template_renders"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        in_flight = self.max_response_tokens_in_flight
        if in_flight is not None:
            if not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 1:
                raise ValueError(f"max_response_tokens_in_flight must be a positive integer, got {in_flight!r}.")
            if in_flight < self.limits.max_response_tokens:
                raise ValueError(f"max_response_tokens_in_flight (--max-response-tokens-in-flight) {in_flight} is "
                                 f"below max_response_tokens (--max-response-tokens) "
                                 f"{self.limits.max_response_tokens}: a request within the one could never fit "
                                 f"the other.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        if not self.request_body_timeout > 0:
            raise ValueError(f"request_body_timeout (--request-body-timeout) must be > 0 seconds, got "
                             f"{self.request_body_timeout}.")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout (--shutdown-timeout) must be >= 0 seconds, got "
                             f"{self.shutdown_timeout}.")
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        check_tool_settings(self.enable_auto_tool_choice, self.tool_call_parser)
        check_reasoning_parser(self.reasoning_parser)
        if self.tool_call_parser == "openai":
            # gpt-oss's calls reach the openai tool parser through the harmony split, which
            # vLLM always makes for gpt-oss: it is on with the tool parser.
            if self.reasoning_parser is None:
                self.reasoning_parser = "openai_gptoss"
            elif self.reasoning_parser != "openai_gptoss":
                raise ValueError(f"tool_call_parser (--tool-call-parser) 'openai' reads gpt-oss's harmony replies, "
                                 f"which need reasoning_parser (--reasoning-parser) 'openai_gptoss', not "
                                 f"{self.reasoning_parser!r}.")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("Give the API key once: api_key (--api-key) or api_key_file (--api-key-file), not both.")

    # ------------------------------------------------------------- reading
    def resolved_api_key(self) -> str | None:
        """The key the server requires: --api-key, else the file's, else RAYLM_API_KEY's."""
        if self.api_key:
            return self.api_key
        if self.api_key_file is not None:
            path = Path(self.api_key_file)
            try:
                key = path.read_text().strip()
            except OSError as exc:
                raise FileNotFoundError(f"api_key_file (--api-key-file) {str(path)!r} cannot be read: "
                                        f"{exc.strerror}.") from None
            if not key:
                raise ValueError(f"api_key_file (--api-key-file) {str(path)!r} is empty.")
            return key
        return envs.RAYLM_API_KEY

    def model_names(self, model: str) -> list[str]:
        """The names the model is served as: served_model_name, else the model folder's name
        (the demo model's short name for the bundled one), never the path: clients, logs
        and metric labels need not learn where the weights are."""
        if self.served_model_name:
            return list(self.served_model_name)
        return [default_model_name(model)]

    def model_aliases(self, model: str) -> list[str]:
        """Other names a request's `model` may use without being listed: the model's path, as
        given and resolved, where no served_model_name was set. vLLM serves a model under its
        path by default, so clients written for it send the path; they still reach it, while
        /v1/models and the metrics show only the name."""
        if self.served_model_name:
            return []
        aliases = [model]
        try:
            aliases.append(str(Path(model).resolve()))
        except (OSError, RuntimeError):
            pass
        return aliases


def default_model_name(model: str) -> str:
    from raylm.models.bundled import DEMO_MODEL_NAME, default_model_path

    path = Path(model)
    try:
        if path.resolve() == Path(default_model_path()).resolve():
            return DEMO_MODEL_NAME
    except (FileNotFoundError, RuntimeError):
        pass
    return path.resolve().name or model


# What `request_router` may name: raylm's prefix-aware router (deploy/prefix_router.py),
# or Serve's default.
PREFIX_AWARE_ROUTER = "prefix_aware"
POWER_OF_TWO_ROUTER = "power_of_two"


@dataclass
class DeploymentArgs(SettingsMixin):
    """How Ray Serve runs the replicas (`raylm serve --ray-serve`, `serve run ... app_builder`):
    Serve app keys, the replica counts and the router's main choices also `raylm serve` flags."""

    setting_kind = "deployment setting"

    num_replicas: int | None = field(default=None, metadata=setting(
        "Ray Serve: a fixed number of engine replicas, each with its own engine and placement group; default: "
        "autoscaling between min_replicas and max_replicas."))
    min_replicas: int = field(default=1, metadata=setting("Ray Serve: fewest replicas (autoscaling)."))
    max_replicas: int | None = field(default=None, metadata=setting(
        "Ray Serve: most replicas (autoscaling); default: min_replicas."))
    initial_replicas: int | None = field(default=None, metadata=setting(
        "Ray Serve: replicas to start with (autoscaling); default: min_replicas.", cli=False))
    target_ongoing_requests: float = field(default=64.0, metadata=setting(
        "Ray Serve: requests in flight per replica the autoscaler aims at.", cli=False))
    upscale_delay_s: float = field(default=10.0, metadata=setting(
        "Ray Serve: seconds the load must call for more replicas before the autoscaler adds one.", cli=False))
    downscale_delay_s: float = field(default=300.0, metadata=setting(
        "Ray Serve: seconds the load must allow fewer replicas before the autoscaler removes one (a removed "
        "replica's prefix cache is lost).", cli=False))
    max_ongoing_requests: int = field(default=256, metadata=setting(
        "Ray Serve: requests in flight per engine replica past which Serve holds new ones back in the ingress.", cli=False))
    replica_cpus: float = field(default=1.0, metadata=setting(
        "Ray Serve: CPUs of the replica's own bundle (the engine, the scheduler, the HTTP app).", cli=False))
    worker_cpus: float | None = field(default=None, metadata=setting(
        "Ray Serve on CPU: CPUs of each tensor-parallel worker's bundle; default: the engine argument "
        "ray_cpus_per_worker (0.5).", cli=False))
    use_gpu: bool = field(default=False, metadata=setting(
        "Ray Serve: give each worker a GPU bundle ({\"GPU\": 1}) instead of CPUs. `raylm serve --ray-serve` "
        "sets it when the engine's device is not cpu and a GPU is present.", cli=False))
    health_check_period_s: float = field(default=10.0, metadata=setting(
        "Ray Serve: seconds between a replica's health checks (a dead worker fails them).", cli=False))
    health_check_timeout_s: float = field(default=30.0, metadata=setting(
        "Ray Serve: seconds a health check may take.", cli=False))
    name: str = field(default="RaylmDeployment", metadata=setting(
        "Ray Serve: the engine deployment's name.", cli=False))
    request_router: str = field(default=PREFIX_AWARE_ROUTER, metadata=setting(
        "Ray Serve: how a request picks its replica. 'prefix_aware': the replica that holds the longest prefix "
        "of its prompt in its prefix cache, unless that replica is overloaded, else the least loaded; "
        "'power_of_two': Serve's default, the less loaded of two replicas drawn at random.",
        choices=(PREFIX_AWARE_ROUTER, POWER_OF_TWO_ROUTER)))
    router_imbalance_threshold: int = field(default=32, metadata=setting(
        "Prefix-aware router: requests in flight by which the replica holding a prompt's prefix may exceed the "
        "least loaded replica before the request goes to the least loaded instead."))
    router_min_match_ratio: float = field(default=0.1, metadata=setting(
        "Prefix-aware router: the fraction of a prompt's keyed blocks a replica must hold to count as holding "
        "its prefix; below it the request goes to the least loaded replica."))
    router_retention_s: float = field(default=60.0, metadata=setting(
        "Prefix-aware router: seconds the router remembers sending a prompt's blocks to a replica; after "
        "that, only the replica's own reports of what it caches count.", cli=False))
    router_stats_period_s: float = field(default=1.0, metadata=setting(
        "Prefix-aware router: seconds between a replica's reports of the blocks it caches (Serve's "
        "request_routing_stats_period_s).", cli=False))
    router_reported_blocks: int = field(default=8192, metadata=setting(
        "Prefix-aware router: most block hashes a replica reports (the most recently used, 8 bytes each).",
        cli=False))
    router_max_key_blocks: int = field(default=256, metadata=setting(
        "Prefix-aware router: the leading blocks of a prompt the router hashes; a longer prompt's text is cut "
        "before the router tokenizes it.", cli=False))
    ingress_replicas: int = field(default=1, metadata=setting(
        "Ray Serve: replicas of the HTTP ingress, which reads each request, keys it for the router and relays "
        "it to an engine replica.", cli=False))
    ingress_cpus: float = field(default=0.5, metadata=setting(
        "Ray Serve: CPUs of each ingress replica.", cli=False))

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or (self.max_replicas is not None and self.max_replicas < max(1, self.min_replicas)):
            raise ValueError(f"Replicas must satisfy 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}.")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas (--num-replicas) must be at least 1, got {self.num_replicas}.")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.replica_range[1]):
            raise ValueError(f"initial_replicas must lie in [min_replicas, max_replicas] = "
                             f"[{self.min_replicas}, {self.replica_range[1]}], got {self.initial_replicas}.")
        if self.request_router not in (PREFIX_AWARE_ROUTER, POWER_OF_TWO_ROUTER):
            raise ValueError(f"request_router (--request-router) must be one of {PREFIX_AWARE_ROUTER}, "
                             f"{POWER_OF_TWO_ROUTER}, got {self.request_router!r}.")
        if self.router_imbalance_threshold < 0:
            raise ValueError(f"router_imbalance_threshold (--router-imbalance-threshold) must be >= 0, got "
                             f"{self.router_imbalance_threshold}.")
        if not 0.0 <= self.router_min_match_ratio <= 1.0:
            raise ValueError(f"router_min_match_ratio (--router-min-match-ratio) must lie in [0, 1], got "
                             f"{self.router_min_match_ratio}.")
        for name, least in (("router_retention_s", "> 0"), ("router_stats_period_s", "> 0"),
                            ("upscale_delay_s", ">= 0"), ("downscale_delay_s", ">= 0")):
            value = getattr(self, name)
            if value < 0 or (value == 0 and least == "> 0"):
                raise ValueError(f"{name} must be {least} seconds, got {value}.")
        for name in ("router_reported_blocks", "router_max_key_blocks", "ingress_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.ingress_cpus < 0:
            raise ValueError(f"ingress_cpus must be >= 0, got {self.ingress_cpus}.")

    @property
    def replica_range(self) -> tuple[int, int]:
        """(min_replicas, max_replicas) with the default filled in."""
        return self.min_replicas, max(1, self.max_replicas if self.max_replicas is not None else self.min_replicas)

    @property
    def most_replicas(self) -> int:
        """The most engine replicas there can be: num_replicas, else max_replicas."""
        return self.num_replicas if self.num_replicas is not None else self.replica_range[1]
