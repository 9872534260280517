"""Runs one scheduled step on one rank: builds the input tensors, runs the model over the
paged KV cache, and samples.

The step carries only each request's new tokens and block table; what the sampler needs
across steps (token history for penalties and min_tokens, seeded generators; on a GPU the
penalties' state on the device, executors/penalty_state.py) is kept here, keyed by ``req_id``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from raylm.engine.config import EngineConfig, kv_cache_block_bytes, max_blocks_per_request
from raylm.engine.multimodal.processor import DEFAULT_LIMIT_PER_PROMPT
from raylm.engine.sampling_params import SamplingParams
from raylm.engine.step import (PLACEHOLDER_TOKEN_ID, ExecuteModelRequest, SampledToken, SamplerOutput,
                               ScheduledRequest, TokenLogprobs)
from raylm.executors import prompt_logprobs
from raylm.executors.cpu_malloc import release_freed_memory
from raylm.executors.cuda_graphs import DecodeGraphInputs, DecodeGraphs, DecodeInputs, capture_sizes, decode_layout
from raylm.executors.draft_model_runner import DraftModelRunner
from raylm.executors.eagle_runner import EagleRunner
from raylm.executors.encoder_cache import EncoderCache, StepImages, profile_num_images
from raylm.executors.grammar_bitmask import apply_grammar_bitmask
from raylm.executors.input_staging import (InputStaging, fill_block_tables, host_tensor, layout, layout_bytes,
                                           to_device)
from raylm.executors.allowed_token_masks import AllowedTokenMasks
from raylm.executors.penalty_state import PenaltyState
from raylm.executors.prompt_embeds_cache import PromptEmbedsCache, StepPromptEmbeds
from raylm.executors.rejection_sampler import RejectionSampler
from raylm.executors.logits_processors import LogitsProcessorError, LogitsProcessors
from raylm.executors.sampler import PendingSample, Sampler
from raylm.executors.sampling_metadata import (RequestSamplingState, SamplingMetadata, keeps_host_history,
                                               sibling_generator)
from raylm.executors.sleep_mode import SleepingWeights
from raylm.executors.token_history import TokenHistory
from raylm.kernels import cpu_ops
from raylm.kernels.attention_metadata import AttentionMetadata, rows_sequences
from raylm.kernels.backend import AttentionBackend, get_attention_backend
from raylm.kernels.kv_cache_dtype import kv_cache_torch_dtype
from raylm.models import get_model, release_model
from raylm.models.weight_utils import num_weight_loads, safetensors_weights_iterator
from raylm.models.attention import Attention
from raylm.models.forward_context import set_forward_context, step_output_rows
from raylm.parallel.communication import tensor_model_parallel_broadcast
from raylm.parallel.parallel_state import get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size
from raylm.parallel.pipeline import IntermediateTensors, get_pp_indices


logger = logging.getLogger(__name__)

# Steps whose longest query is at most this many tokens (the verification of proposals)
# attend one row at a time (`_as_decode_rows`), through the decode kernels and, on the CPU,
# the fused decode layers, instead of the prefill path: a demo-model step verifying 4
# proposals of one request took 1.11 ms instead of 1.84 (2 proposals: 0.76 instead of 3.59;
# a plain decode step 0.82), medians of 3 alternated runs on a loaded 2-core machine. Each
# row reads its context again, which for so few rows costs less than the packed path.
MAX_QUERY_AS_DECODE_ROWS = 8
# The CPU KV cache's default ceiling (vLLM's CPU backend takes 4 GiB by default too).
_DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3
# What each captured CUDA graph is assumed to cost beside its share of the memory pool
# (its output buffer and the driver's copy of its kernels' parameters).
_GRAPH_OVERHEAD_BYTES = 2 * 1024**2


@dataclass
class HostStep:
    """One step's inputs as Python lists, before they become tensors."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    # Per request, the packed row of its last token.
    last_rows: list[int]

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


class ModelRunner:
    # Devices on which penalties read per-request state kept on the device (`PenaltyState`)
    # rather than the host's histories, which the CPU's native pass reads in place (tests
    # add "cpu" to walk the GPU's path).
    penalty_state_devices: tuple[str, ...] = ("cuda",)
    # Devices whose weights sleep moves out of device memory (executors/sleep_mode.py); on
    # the CPU they are host memory already and stay (tests add "cpu" to walk the GPU's path).
    sleep_offload_devices: tuple[str, ...] = ("cuda",)

    def __init__(self, engine_config: EngineConfig, rank: int = 0, device: torch.device | str = "cpu") -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.parallel_config = engine_config.parallel_config
        self.rank = rank
        self.device = torch.device(device)
        self.block_size = self.cache_config.block_size
        self.num_kv_heads = self.model_config.num_kv_heads_per_rank(self.parallel_config.tensor_parallel_size)
        self.model: nn.Module | None = None
        # enable_lora: the model's LoRA layers, loaded adapters and slots (executors/lora_manager.py).
        self.lora_manager = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler(self.model_config.logprobs_mode)
        # Prompt rows scored at once (executors/prompt_logprobs.py).
        self.prompt_logprobs_chunk_rows = prompt_logprobs.PROMPT_LOGPROBS_CHUNK_ROWS
        self.rejection_sampler = RejectionSampler(self.sampler)
        # Speculative decoding with a draft model: it runs beside the target on every rank.
        speculative_config = engine_config.speculative_config
        # An EAGLE head runs the same way over the target's hidden states (`EagleRunner`).
        self.draft_runner: DraftModelRunner | None = None
        if speculative_config is not None and speculative_config.uses_draft_model:
            runner_class = EagleRunner if speculative_config.is_eagle else DraftModelRunner
            self.draft_runner = runner_class(engine_config, rank, self.device)
        self._states: dict[int, RequestSamplingState] = {}
        # Multi-modal models: the running requests' images and their embeddings.
        self.encoder_cache = EncoderCache()
        self.is_multimodal = self.model_config.is_multimodal
        # enable_prompt_embeds: the running embeddings prompts' embeddings.
        self.prompt_embeds: PromptEmbedsCache | None = (PromptEmbedsCache() if self.model_config.enable_prompt_embeds
                                                        else None)
        # The sampling worker on a device in penalty_state_devices: penalised requests' rows
        # of penalty state, allocated in load_model (before the KV cache is sized).
        self.penalty_state: PenaltyState | None = None
        # Each running request's sampling parameters, sent once per admission (step.py).
        self._sampling_params: dict[int, SamplingParams] = {}
        # The sampling worker: running requests' allowed_token_ids on the device, as masks.
        self.allowed_token_masks = AllowedTokenMasks(self.device) if rank == 0 else None
        # The running requests whose sampling keeps nothing between steps (no host history,
        # no generator of their own): decided once per admission, from their parameters,
        # so that a step's per-request passes skip them at the cost of a set lookup.
        self._stateless: set[int] = set()
        # Rank 0: each running request's last sampled token; with async scheduling the next
        # step arrives before the driver has seen it, as a placeholder (step.py).
        self._last_sampled: dict[int, int] = {}
        # Rank 0, deferred reads (`execute_model(defer_read=True)`): each request whose last
        # sampled token is still on its way to the host -> (the step's token tensor on the
        # device, the request's row in it, the step's serial). The next step takes such a
        # token from the device; the step's collect() moves it to _last_sampled.
        self._pending_samples: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._launch_serial = 0
        self.attn_backend: AttentionBackend | None = None
        # CUDA only: the pinned staging buffer every step's integer inputs go through, and
        # the decode graphs captured over its decode layout (None: eager).
        self.staging: InputStaging | None = None
        self.decode_graphs: DecodeGraphs | None = None
        # What the KV sizing set aside for the graphs, and what capturing them took.
        self.cuda_graph_memory_estimate = 0
        self.max_blocks_per_seq = -(-self.model_config.max_model_len // self.block_size)
        # Pipeline parallel: this worker's stage, and the layers (so the KV caches) it holds.
        pp_rank, pp_size = get_pipeline_model_parallel_rank(), get_pipeline_model_parallel_world_size()
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        start, end = get_pp_indices(self.model_config.num_layers, pp_rank, pp_size)
        self.num_stage_layers = end - start
        # Sleep mode: the weights taken out of device memory (None while they are in), and
        # the model's weight-load count when the packed copies were last made (see
        # `process_weights_after_loading`).
        self.sleeping_weights: SleepingWeights | None = None
        self._processed_weight_loads = -1
        # After a level-2 sleep freed the weights: the model's weight-load count then, until
        # weights are loaded again (a step before that reads zeros and is warned about).
        self._weight_loads_at_discard: int | None = None
        # The sampling worker: the engine's custom logits processors (engine/logits_processor.py),
        # built once here, and the token lists and batch rows they read.
        self.logits_processors: LogitsProcessors | None = None
        if self.model_config.logits_processors and rank == 0 and self.is_last_stage:
            self.logits_processors = LogitsProcessors(self.model_config.logits_processors, engine_config,
                                                      self.device, self.device.type == "cuda")

    # ---- setup -------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device)
        if self.engine_config.lora_config is not None:
            from raylm.executors.lora_manager import WorkerLoRAManager

            self.lora_manager = WorkerLoRAManager(self.model, self.engine_config.lora_config,
                                                  self.model_config.hf_config, self.device, self.model_config.dtype)
        self.attn_backend = get_attention_backend(self.model_config.attention_backend)
        for layer in self._attention_layers():
            layer.attn_backend = self.attn_backend
        if self.draft_runner is not None:
            self.draft_runner.load_model(self.model)
        if self.device.type == "cuda":
            self.staging = InputStaging(self.device, self._max_step_input_bytes())
        if self.rank == 0 and self.is_last_stage and self.device.type in self.penalty_state_devices:
            # One row per request that can run at once: allocated now, the KV cache is
            # sized around it (on CUDA it is part of what is in use after loading).
            self.penalty_state = PenaltyState(self.scheduler_config.max_num_seqs, self.model_config.vocab_size,
                                              self.device)
        self._processed_weight_loads = num_weight_loads(self.model)  # get_model ran the hooks
        if self.device.type == "cpu":
            release_freed_memory()  # loading's temporaries are not a step's working set

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on CUDA with the Triton kernels (the others
        read the step's lengths on the host) and one rank, unless enforce_eager."""
        return (self.device.type == "cuda" and not self.model_config.enforce_eager
                and self.attn_backend is not None and self.attn_backend.name == "triton"
                # Not yet with collectives inside the graph (never run on GPUs).
                and self.parallel_config.tensor_parallel_size == 1
                and self.parallel_config.pipeline_parallel_size == 1
                # LoRA layers read each step's token slots, set on the host per step.
                and self.lora_manager is None
                # Layers that attend otherwise (Gemma 2's soft cap runs the PyTorch
                # reference, which reads lengths on the host) say so, or are not plain.
                and all(getattr(layer, "cuda_graph_safe", type(layer) is Attention)
                        for layer in self._attention_layers()))

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def get_cache_block_size_bytes(self) -> int:
        """Bytes of one block on this rank: the KV of this stage's layers, and the draft
        model's under the same block id."""
        block_bytes = kv_cache_block_bytes(self.model_config, self.block_size,
                                           self.parallel_config.tensor_parallel_size, self.num_stage_layers,
                                           self.cache_config.cache_dtype)
        if self.draft_runner is not None:
            block_bytes += self.draft_runner.get_cache_block_size_bytes()
        return block_bytes

    def _profile_num_tokens(self) -> int:
        return min(self.scheduler_config.max_num_batched_tokens,
                   self.scheduler_config.max_num_seqs * self.model_config.max_model_len)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Bytes a forward over a full token budget (CUDA), without a KV cache, allocates
        at its peak beyond what was allocated before it (the weights), its logits over a
        full batch, a chunk of prompt rows' logprobs and an EAGLE head's kept hidden states
        included."""
        num_tokens = self._profile_num_tokens()
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        # Positions stay within the context length the rotary tables cover.
        positions = torch.arange(num_tokens, device=self.device) % self.model_config.max_model_len

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        # A vision-language model's step first runs its vision tower on its images, one at a
        # time, and holds their embeddings (EncoderCache): vLLM's worst case, measured too.
        image_embeddings = self._profile_image_embeddings() if self.is_multimodal else None
        # An EAGLE head's kept hidden states (`DraftModelRunner.profile_held_state`).
        held_state = self.draft_runner.profile_held_state(num_tokens) if self.draft_runner is not None else None
        with set_forward_context(None):
            hidden = self.model(input_ids, positions, *self._stage_inputs(num_tokens))
        if self.is_last_stage:
            self._profile_outputs(hidden, num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden, input_ids, positions, image_embeddings, held_state
        torch.cuda.empty_cache()
        return peak

    def _profile_image_embeddings(self) -> list[torch.Tensor]:
        """The embeddings of `profile_num_images` blank images of the vision tower's size, each
        encoded alone as EncoderCache encodes them, all held at once (for profile_run)."""
        limit = (self.model_config.limit_mm_per_prompt or {}).get("image", DEFAULT_LIMIT_PER_PROMPT)
        if limit == 0:
            return []
        size = self.model_config.hf_config.vision_config.image_size
        pixel_values = torch.zeros(1, 3, size, size, dtype=self.model_config.dtype, device=self.device)
        embeddings = [self.model.get_multimodal_embeddings(pixel_values)]
        num_images = profile_num_images(embeddings[0].shape[-2], limit, self.scheduler_config.max_num_seqs,
                                        self.scheduler_config.max_num_batched_tokens)
        while len(embeddings) < num_images:
            embeddings.append(self.model.get_multimodal_embeddings(pixel_values))
        logger.info("Profiling with %d images of %d tokens held by the encoder cache (limit_mm_per_prompt "
                    "image=%d).", num_images, embeddings[0].shape[-2], limit)
        return embeddings

    def _profile_outputs(self, hidden: torch.Tensor, num_tokens: int) -> None:
        """What the last stage computes from a full step's hidden states at its peak: the
        logits of a full batch, and a chunk of prompt rows' logprobs."""
        num_rows = min(num_tokens, self.scheduler_config.max_num_seqs)
        self.model.compute_logits(hidden[:num_rows])
        # A step scoring prompt logprobs holds one chunk of rows' logits and their
        # log-softmax instead (executors/prompt_logprobs.py), at the most alternatives.
        chunk = min(num_tokens, self.prompt_logprobs_chunk_rows)
        max_k = self.model_config.max_logprobs
        max_k = self.model_config.vocab_size if max_k < 0 else min(max_k, self.model_config.vocab_size)
        prompt_logprobs.compute_prompt_logprobs(self.model.compute_logits, hidden[:chunk], [0] * chunk,
                                                [max_k] * chunk, chunk)

    def _fillable_blocks(self) -> int:
        """What max_num_seqs requests of max_model_len tokens can fill, plus a tenth for the
        prefix cache: more blocks than that would never be used."""
        blocks_per_seq = max_blocks_per_request(self.model_config.max_model_len, self.block_size,
                                                self.cache_config.sliding_window,
                                                self.scheduler_config.max_num_batched_tokens)
        fillable = self.scheduler_config.max_num_seqs * blocks_per_seq
        return fillable + fillable // 10

    def determine_num_available_blocks(self) -> int:
        """KV blocks this rank can hold: num_gpu_blocks_override if set; on CUDA, what is
        left of total * gpu_memory_utilization after the weights, everything else on the
        device (CUDA context, other processes), a profiled peak forward and the decode
        graphs; on CPU, cpu_kv_cache_space_bytes, or by default at most 4 GiB. Either way
        no more than max_num_seqs requests can hold at once (`max_blocks_per_request`:
        max_model_len tokens, or bounded by the window on a model windowed in every layer),
        plus a tenth for the prefix cache."""
        block_bytes = self.get_cache_block_size_bytes()
        if self.cache_config.num_gpu_blocks_override is not None:
            return self.cache_config.num_gpu_blocks_override
        if self.device.type == "cuda":
            num_blocks = min(max(0, self._cuda_kv_cache_bytes() // block_bytes), self._fillable_blocks())
        elif self.cache_config.cpu_kv_cache_space_bytes is not None:
            num_blocks = self.cache_config.cpu_kv_cache_space_bytes // block_bytes
        else:
            num_blocks = min(self._fillable_blocks(), _DEFAULT_CPU_KV_CACHE_BYTES // block_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"No memory is left for the KV cache: one block needs {block_bytes} bytes. Raise "
                f"gpu_memory_utilization ({self.cache_config.gpu_memory_utilization}) or, on CPU, "
                f"kv_cache_space ({self.cache_config.cpu_kv_cache_space_bytes} bytes).")
        return num_blocks

    def _cuda_kv_cache_bytes(self) -> int:
        """vLLM's rule: total * gpu_memory_utilization, less what is in use after loading
        (torch.cuda.mem_get_info sees the weights, the CUDA context, cuBLAS workspaces and
        other processes alike), less the profiled forward's peak, less the graphs' estimate."""
        torch.cuda.empty_cache()
        activation_peak = self.profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free
        self.cuda_graph_memory_estimate = self._cuda_graph_memory_estimate(activation_peak)
        available = (int(total * self.cache_config.gpu_memory_utilization) - in_use - activation_peak
                     - self.cuda_graph_memory_estimate)
        penalty_bytes = self.penalty_state.nbytes if self.penalty_state is not None else 0
        logger.info("GPU memory: %.2f GiB total, %.2f GiB in use after loading (%.2f GiB of it penalty state), "
                    "%.2f GiB forward peak, %.2f GiB for CUDA graphs: %.2f GiB left for the KV cache at "
                    "gpu_memory_utilization %.2f.", total / 2**30, in_use / 2**30, penalty_bytes / 2**30,
                    activation_peak / 2**30, self.cuda_graph_memory_estimate / 2**30, max(0, available) / 2**30,
                    self.cache_config.gpu_memory_utilization)
        return available

    def _cuda_graph_memory_estimate(self, activation_peak: int) -> int:
        """The graphs' memory pool holds one forward's activations at the largest captured
        batch (smaller graphs reuse its blocks): the profiled peak scaled to that batch,
        plus a per-graph allowance. Logged against the measured figure after capture."""
        if not self.uses_cuda_graphs:
            return 0
        sizes = capture_sizes(self.scheduler_config.max_num_seqs)
        share = min(1.0, sizes[-1] / max(1, self._profile_num_tokens()))
        return int(activation_peak * share) + len(sizes) * _GRAPH_OVERHEAD_BYTES

    def initialize_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.model_config.head_size)
        layers = self._attention_layers()
        self.kv_caches = []
        # Zeroed, so every page is mapped now, on the CPU too. Left untouched (torch.empty),
        # the process would grow only with the blocks used, but each decode step's KV writes
        # would then take the page faults: in the ~100M Llama's generate (bf16, 2 cores)
        # write_kv_cache took 120 ms instead of 15 ms, and a machine short of memory would find
        # out mid-run rather than at start. Zeroing 2.4 GB takes ~0.6 s there. (Every kernel
        # reads only the slots of a sequence's own tokens: the zeros are never attended to.)
        for layer in layers:
            kv = (self._zeroed_cache(shape), self._zeroed_cache(shape))
            layer.kv_cache = kv
            self.kv_caches.append(kv)
        if self.draft_runner is not None:
            self.draft_runner.initialize_cache(num_blocks, self._zeroed_cache)

    def _zeroed_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's K or V cache, zeroed with every page mapped. On the CPU it lies on
        transparent huge pages: a decode step reads blocks scattered over the cache, and with
        4 KiB pages most block reads begin with a TLB miss (see cpu_ops.zeros_on_huge_pages).
        Mapping it costs more than ordinary pages in some VMs (the ~100M Llama's 2.2 GiB pool:
        ~1.9 s more at start on a 2-core EPYC VM, no compaction stalls)."""
        dtype = kv_cache_torch_dtype(self.cache_config.cache_dtype, self.model_config.dtype)
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return cpu_ops.zeros_on_huge_pages(shape, dtype).zero_()  # zero_ maps the pages

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs, before the first request, a step of a full token budget of prompt tokens and
        one of a full batch of decodes (as vLLM warms its model up with a dummy run): what a
        first step of each kind does once (fault its activations' memory in, create oneDNN's
        primitives for the shapes, compile Triton kernels) then costs no request its latency.
        Their keys and values land in block 0, which holds nothing yet (a later request
        writes every slot it reads before reading it). They sample greedily, drawing nothing
        from the random streams, and their sampler state is dropped."""
        config = self.scheduler_config
        max_len = self.model_config.max_model_len
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * max_len)
        prompt_lens = [max_len] * (num_tokens // max_len) + [num_tokens % max_len] * bool(num_tokens % max_len)
        decode_lens = [1] * min(config.max_num_seqs, num_tokens)
        for lens in (prompt_lens, decode_lens):
            requests = [self._warm_up_request(-1 - i, n) for i, n in enumerate(lens)]
            self.execute_model(ExecuteModelRequest(requests=requests), *self._stage_inputs(sum(lens)))
            self.execute_model(ExecuteModelRequest(requests=[], finished_req_ids=[r.req_id for r in requests]))
        if self.attn_backend is not None and self.attn_backend.warm_up is not None:
            # The kernel variants those two steps did not need (split-K decode and its
            # merges, every prefill tile size), so that no request waits for a compile.
            shapes = {(layer.num_heads, layer.num_kv_heads, layer.head_size, layer.scale, layer.sliding_window,
                       layer.logits_soft_cap, layer.sinks is not None): layer.kv_cache
                      for layer in self._attention_layers()}
            for (num_heads, num_kv_heads, head_size, scale, window, soft_cap, sinks), (k_cache, v_cache) in \
                    shapes.items():
                self.attn_backend.warm_up(num_heads, num_kv_heads, head_size, scale, k_cache, v_cache, max_len,
                                          sliding_window=window, logits_soft_cap=soft_cap,
                                          query_dtype=self.model_config.dtype, has_sinks=sinks)
        if self.uses_cuda_graphs:
            self.capture_decode_graphs()

    @torch.inference_mode()
    def capture_decode_graphs(self, graph_factory=None) -> None:
        """Captures a decode graph per padded batch size (`executors/cuda_graphs.py`)."""
        inputs = DecodeGraphInputs(self.staging, capture_sizes(self.scheduler_config.max_num_seqs)[-1],
                                   self.max_blocks_per_seq, self.model_config.max_model_len)
        graphs = DecodeGraphs(inputs, capture_sizes(self.scheduler_config.max_num_seqs), self._forward_decode,
                              graph_factory)
        # Every padded row is a valid one-token step of block 0 (see cuda_graphs.py).
        inputs.write([], [], [], [], [], inputs.max_batch)
        try:
            graphs.capture()
        except RuntimeError as error:  # an op that reads back to the host mid-forward
            graphs.release()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            logger.warning("Capturing the decode CUDA graphs failed, so decode steps run eagerly: %s", error)
            return
        self.decode_graphs = graphs
        if self.device.type == "cuda":
            logger.info("Captured %d decode CUDA graphs (batch sizes up to %d): %.0f MiB, %.0f MiB were set aside.",
                        len(graphs.sizes), graphs.sizes[-1], graphs.memory_bytes / 2**20,
                        self.cuda_graph_memory_estimate / 2**20)

    def _forward_decode(self, inputs: DecodeInputs) -> torch.Tensor:
        with set_forward_context(inputs.attn_metadata):
            return self.model(inputs.input_ids, inputs.positions)

    def _stage_inputs(self, num_tokens: int) -> tuple[IntermediateTensors, ...]:
        """The extra model input of a forward run without a previous stage (profiling,
        warm-up): zeros in place of that stage's hidden states; none on the first stage."""
        if self.is_first_stage:
            return ()
        hidden = torch.zeros(num_tokens, self.model_config.hf_config.hidden_size, dtype=self.model_config.dtype,
                             device=self.device)
        return (IntermediateTensors({"hidden_states": hidden}),)

    def _warm_up_request(self, req_id: int, num_tokens: int) -> ScheduledRequest:
        return ScheduledRequest(req_id=req_id, token_ids=[0] * num_tokens, num_computed_tokens=0,
                                block_table=[0] * -(-num_tokens // self.block_size), num_prompt_tokens=num_tokens,
                                sampling_params=SamplingParams(temperature=0.0), resumed=True)

    def release_memory(self) -> None:
        """Drops the CUDA graphs, the KV cache, the model and the staging buffers, and hands
        the freed device memory back, so that another engine in this process can take it.
        The runner runs no more steps."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        if self.model is not None:
            release_model(self.model)  # its modules are in cycles: freed now, without a collection
        self.kv_caches = []
        self.model = None
        self.lora_manager = None  # it holds the model's LoRA layers and the adapters' weights
        if self.draft_runner is not None:
            self.draft_runner.release_memory()
        if self.staging is not None:
            self.staging.release()
            self.staging = None
        self._states.clear()
        if self.prompt_embeds is not None:
            self.prompt_embeds = PromptEmbedsCache()
        self.penalty_state = None
        if self.allowed_token_masks is not None:
            self.allowed_token_masks.clear()
        self._sampling_params.clear()
        self._stateless.clear()
        self._last_sampled.clear()
        self._pending_samples.clear()
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace per thread and stream it ran on (the caller's, the
            # step thread's, the graph capture's): 3 x 32 MiB the be08b85 record found still
            # allocated after shutdown. Private in torch 2.x, hence the guard. Assumes no other
            # engine in this process still replays graphs: a graph captured after its stream's
            # workspace existed may use that workspace.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    # ---- sleep mode and weight updates (enable_sleep_mode, collective_rpc) ------------------

    def sleep(self, level: int) -> None:
        """Frees the KV cache and the CUDA graphs; on a device in sleep_offload_devices also
        the weights' memory, backed up in host memory at level 1 and discarded at level 2
        (executors/sleep_mode.py). The runner runs no step until `wake_up`."""
        self._release_kv_cache()
        if self.device.type in self.sleep_offload_devices and self.sleeping_weights is None:
            self.sleeping_weights = SleepingWeights.take(self._models(), keep_contents=level == 1)
            if level == 2:
                self._weight_loads_at_discard = num_weight_loads(self.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Gives back what `sleep` freed, for each tag of "weights" and "kv_cache": the
        weights (their contents at level 1, zeros at level 2, to be loaded with
        `reload_weights` or `load_weights`) and a zeroed KV cache of the same blocks. Once
        both are back, the decode CUDA graphs are captured again (they read both by address)."""
        if "weights" in tags and self.sleeping_weights is not None:
            self.sleeping_weights.restore()
            self.sleeping_weights = None
        if "kv_cache" in tags and not self.kv_caches:
            self.initialize_cache(self.cache_config.num_gpu_blocks)
        if (self.sleeping_weights is None and self.kv_caches and self.decode_graphs is None
                and self.uses_cuda_graphs):
            self.capture_decode_graphs()

    def _release_kv_cache(self) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        for model in self._models():
            for module in model.modules():
                if isinstance(module, Attention):
                    module.kv_cache = None
                fused_decode = getattr(module, "fused_decode", None)
                if fused_decode is not None:
                    fused_decode.reset()  # it holds the first layer's cache
        self.kv_caches = []

    def _models(self) -> list[nn.Module]:
        return [self.model] + ([self.draft_runner.model] if self.draft_runner is not None else [])

    def reload_weights(self) -> None:
        """Loads the checkpoint's weights again, in place (vLLM's reload_weights, after a
        level-2 sleep); a draft model's too, from its own checkpoint (level 2 discards it
        with the target's, and a zeroed draft only proposes tokens that are rejected)."""
        self.load_weights(safetensors_weights_iterator(self.model_config.model))
        if self.draft_runner is not None:
            draft = self.draft_runner.model
            draft.load_weights(safetensors_weights_iterator(self.draft_runner.model_config.model))
            _run_weight_hooks(draft)

    def load_weights(self, weights) -> set[str]:
        """Copies (name, full checkpoint tensor) pairs into the running model through each
        parameter's `weight_loader` (which cuts this rank's shard), in place: the CUDA
        graphs keep reading them. Returns the names of the parameters loaded."""
        if self.sleeping_weights is not None:
            raise RuntimeError("The weights are asleep: wake them up first (LLM.wake_up(tags=['weights'])), then "
                               "load weights into them.")
        loaded = self.model.load_weights(weights)
        self.process_weights_after_loading()
        return loaded

    def _warn_if_weights_discarded(self) -> None:
        """Once per level-2 sleep: a step runs on weights that sleep discarded (zeros since
        wake-up) and nothing loaded since. vLLM serves such garbage silently (its issue
        29341); a warning only, since a trainer may write the parameters in ways not counted
        here (CUDA IPC, NCCL broadcast into `param.data`)."""
        if num_weight_loads(self.model) == self._weight_loads_at_discard:
            logger.warning("A step runs on weights discarded by sleep(level=2) and not loaded since: they are zeros "
                           "and the outputs are garbage. Load weights after wake_up(tags=['weights']): "
                           "collective_rpc('reload_weights') or collective_rpc('load_weights', args=(weights,)).")
        self._weight_loads_at_discard = None

    def process_weights_after_loading(self) -> None:
        """Runs the modules' hooks again (the CPU GEMM's packed copies, the fused decode's
        tables), as the loader does after the checkpoint: also when a worker extension
        called `model.load_weights` itself, as vLLM's RLHF examples do (`execute_model`
        notices that from the model's weight-load count)."""
        _run_weight_hooks(self.model)
        self._processed_weight_loads = num_weight_loads(self.model)
        if self.device.type == "cpu":
            release_freed_memory()

    # ---- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, req: ExecuteModelRequest, intermediate_tensors: IntermediateTensors | None = None,
                      defer_read: bool = False) -> SamplerOutput | DeferredSamplerOutput | IntermediateTensors | None:
        """Runs one step; rank 0 returns the drawn tokens (and prompt logprobs), other
        tensor-parallel ranks return None. Pipeline parallel: a stage after the first
        starts from the previous stage's `intermediate_tensors`; a stage before the last
        returns its own (None for an empty step), and only the last stage samples.

        defer_read (single worker): a step that only draws tokens returns once they are
        queued on the device, as a DeferredSamplerOutput whose collect() reads them; the
        next step may be run first, and takes those tokens from the device (the GPU then
        never waits for the host between steps). Steps that need a pending token on the
        host (`needs_collected_tokens`) must wait for its collect()."""
        if self.logits_processors is not None:
            self.logits_processors.forget(req.finished_req_ids)
        for req_id in req.finished_req_ids:
            self._states.pop(req_id, None)
            self._sampling_params.pop(req_id, None)
            self._stateless.discard(req_id)
            self._last_sampled.pop(req_id, None)
            self._pending_samples.pop(req_id, None)
        if self.penalty_state is not None:
            # Preempted ones are given a fresh row when readmitted (`PenaltyState.update`).
            self.penalty_state.release(req.finished_req_ids)
            self.penalty_state.release(req.preempted_req_ids)
        if self.allowed_token_masks is not None:
            self.allowed_token_masks.release(req.finished_req_ids)
            self.allowed_token_masks.release(req.preempted_req_ids)
        if self.draft_runner is not None:
            self.draft_runner.finish(req.finished_req_ids)
        self.encoder_cache.release(req.finished_req_ids)
        self.encoder_cache.release(req.preempted_req_ids)
        if self.prompt_embeds is not None:
            self.prompt_embeds.release(req.finished_req_ids)
            self.prompt_embeds.release(req.preempted_req_ids)
        if not req.requests:
            return SamplerOutput() if self.rank == 0 and self.is_last_stage else None
        if self._processed_weight_loads != num_weight_loads(self.model):
            self.process_weights_after_loading()  # weights were loaded into the model meanwhile
        if self._weight_loads_at_discard is not None:
            self._warn_if_weights_discarded()
        if not self.kv_caches:
            raise RuntimeError("The engine is asleep (LLM.sleep): wake it up (LLM.wake_up) before running steps.")
        self._fill_sampling_params(req.requests)
        # Before _update_states: it asks which requests' prompts are embeddings.
        prompt_embeds = (self.prompt_embeds.step_embeddings(req.requests, self.device)
                         if self.prompt_embeds is not None else None)
        device_holes = self._fill_placeholders(req.requests)
        self._update_states(req.requests, device_holes)
        if self.logits_processors is not None:
            self.logits_processors.track(req.requests)
        draft_probs = None
        if self.draft_runner is not None:
            # Fills the proposal placeholders of spec_token_ids; rank 0 gets the
            # distributions they were drawn from.
            draft_probs = self.draft_runner.propose(req, self)

        host = self._host_inputs(req.requests)
        holes = [(host.last_rows[index], token) for index, token in device_holes]
        mm_embeddings = (self.encoder_cache.step_embeddings(self.model, req.requests, self.device)
                         if self.is_multimodal else None)
        if not self.is_last_stage:  # pipeline parallel: every row goes on to the next stage
            return self._run_model(host, None, intermediate_tensors, holes)
        sampled, sample_rows, prompt_requests, prompt_rows = _rows_to_read(req.requests, host.last_rows)
        rows = sample_rows + prompt_rows
        lora_failures: dict[tuple[int, Any], tuple[str, str]] = {}
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(req.requests, req.lora_activations,
                                           step_output_rows(rows, len(host.input_ids)))
            lora_failures = self.lora_manager.step_failures
        if isinstance(self.draft_runner, EagleRunner):
            # The EAGLE head's next catch-up reads the final hidden state of every row.
            every_row = self._run_model(host, list(range(len(host.input_ids))), intermediate_tensors, holes,
                                        mm_embeddings, prompt_embeds)
            self.draft_runner.record(req.requests, host.last_rows, every_row)
            selected = every_row.index_select(0, to_device(rows, every_row.device)) if rows else every_row[:0]
        else:
            selected = self._run_model(host, rows, intermediate_tensors, holes, mm_embeddings, prompt_embeds)
        if not rows:
            return SamplerOutput(lora_failures=lora_failures) if self.rank == 0 else None
        assert selected.shape[0] == len(rows), "the model must return the forward context's output rows"
        output = SamplerOutput(lora_failures=lora_failures)
        num_sampled = len(sample_rows)
        if sample_rows:
            logits = self.model.compute_logits(selected[:num_sampled])
            if logits is not None:  # tensor parallel: only rank 0 holds the logits and samples
                pending = self._sample(logits, req, sampled, draft_probs, output, defer_read and not prompt_rows)
                if pending is not None:
                    return self._deferred(output, pending, sampled)
            del logits  # before the prompt rows' logits exist
        if prompt_rows:
            # Every rank takes part in each chunk's logits gather; rank 0 gets the values.
            scored = self._prompt_logprobs(selected[num_sampled:], prompt_requests)
            if scored is not None:
                output.prompt_logprobs = scored
        return output if self.rank == 0 else None

    def _sample(self, logits: torch.Tensor, req: ExecuteModelRequest, sampled: list[ScheduledRequest],
                draft_probs: dict[int, torch.Tensor] | None, output: SamplerOutput,
                defer_read: bool) -> PendingSample | None:
        """Draws (or verifies) the sampled requests' tokens from their logits rows into
        `output`; with defer_read, only launches the draws and returns them."""
        logits = logits.float()
        if req.structured_output_req_ids:
            # Structured outputs: tokens the grammar refuses get -inf before any sampling.
            apply_grammar_bitmask(logits, req.grammar_bitmask, _grammar_rows(sampled, req.structured_output_req_ids))
        # The drawn tokens come back as the next step's token_ids, which is when
        # _update_states appends them to the histories.
        try:
            if self.logits_processors is not None:
                self.logits_processors.update_state(sampled)
            if any(scheduled.spec_token_ids for scheduled in sampled):
                output.outputs = self._verify(logits, sampled, draft_probs)
            elif defer_read and self.draft_runner is None:
                return self.sampler.launch(logits, self._sampling_metadata(sampled))
            else:
                output.outputs = self.sampler(logits, self._sampling_metadata(sampled))
        except LogitsProcessorError as error:
            # The processor saw the whole batch: every request of the step fails (token 0
            # stands in for theirs, as for a row of logits that were not finite).
            output.outputs = [SampledToken(scheduled.req_id, 0, None) for scheduled in sampled]
            output.request_errors = {scheduled.req_id: str(error) for scheduled in sampled}
        last, pending_samples = self._last_sampled, self._pending_samples
        for token in output.outputs:
            last[token.req_id] = token.token_id
            pending_samples.pop(token.req_id, None)  # an older deferred step's token
        return None

    def _run_model(self, host: HostStep, rows: list[int] | None,
                   intermediate_tensors: IntermediateTensors | None = None,
                   holes: list[tuple[int, tuple[torch.Tensor, int, int]]] = (),
                   mm_embeddings: StepImages | None = None, prompt_embeds: StepPromptEmbeds | None = None
                   ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states of `rows`, in that order: a decode graph's replay where
        one is captured for the batch, else an eager forward. rows None: a pipeline stage
        before the last, which hands every row on. holes: input rows whose token is taken
        on the device from a step not read yet (`_fill_placeholders`). mm_embeddings: the
        input rows that hold image placeholders and their image embeddings (`EncoderCache`).
        prompt_embeds: the input rows of embeddings prompts and their given embeddings
        (`PromptEmbedsCache`)."""
        graphs = self.decode_graphs
        batch_size = graphs.batch_size_for(len(host.input_ids)) if graphs is not None else None
        if (batch_size is not None and mm_embeddings is None and prompt_embeds is None and host.is_decode_only
                and rows == list(range(len(host.input_ids)))):
            graphs.inputs.write(host.input_ids, host.positions, host.slot_mapping, host.seq_lens,
                                host.block_tables, batch_size)
            if holes:
                _fill_holes(graphs.inputs.views(batch_size).input_ids, holes)
            return graphs.replay(batch_size)[:len(rows)]
        output_rows = None if rows is None else step_output_rows(rows, len(host.input_ids))
        input_ids, positions, attn_metadata, rows_tensor, rows_metadata = self._step_tensors(host, output_rows)
        if holes:
            _fill_holes(input_ids, holes)
        stage_input = () if intermediate_tensors is None else (intermediate_tensors,)
        image_spans = mm_embeddings.spans if mm_embeddings is not None else None
        with set_forward_context(attn_metadata, rows_tensor, output_rows, rows_metadata, image_spans):
            if mm_embeddings is not None:
                inputs_embeds = self.model.get_input_embeddings(input_ids)
                inputs_embeds[mm_embeddings.rows] = mm_embeddings.embeddings.to(inputs_embeds.dtype)
                return self.model(input_ids, positions, *stage_input, inputs_embeds=inputs_embeds)
            if prompt_embeds is not None:
                # The table's rows for every input (the placeholders' included), then the given
                # embeddings over the embeddings prompts' rows, as images are merged.
                inputs_embeds = self.model.get_input_embeddings(input_ids)
                given = self.model.prompt_embeds_as_inputs(prompt_embeds.embeddings.to(inputs_embeds.dtype))
                inputs_embeds[prompt_embeds.rows] = given
                return self.model(input_ids, positions, *stage_input, inputs_embeds=inputs_embeds)
            return self.model(input_ids, positions, *stage_input)

    def _step_tensors(self, host: HostStep, output_rows: list[int] | None
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None,
                                 AttentionMetadata | None]:
        """An eager step's tensors: input ids, positions, attention metadata, and with
        output rows their tensor and (staged path only) their attention metadata. Also
        what the draft model's forwards run on (`DraftModelRunner`)."""
        if self.staging is not None:
            return self._staged_tensors(host, output_rows)
        input_ids, positions, attn_metadata = self._tensors(host)
        rows_tensor = None if output_rows is None else host_tensor(output_rows, torch.long)
        return input_ids, positions, attn_metadata, rows_tensor, None

    def _host_inputs(self, requests: list[ScheduledRequest]) -> HostStep:
        """The step's packed inputs as lists, plus, per request, the row of its last token."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        last_rows: list[int] = []
        for scheduled in requests:
            start = scheduled.num_computed_tokens
            tokens = scheduled.token_ids if not scheduled.spec_token_ids else (
                scheduled.token_ids + scheduled.spec_token_ids)
            n = len(tokens)
            end = start + n
            table = scheduled.block_table
            input_ids.extend(tokens)
            if n == 1:
                positions.append(start)
                slot_mapping.append(table[start // block_size] * block_size + start % block_size)
            else:
                span = range(start, end)
                positions.extend(span)
                slot_mapping.extend([table[p // block_size] * block_size + p % block_size for p in span])
            query_lens.append(n)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + n)
            last_rows.append(query_start_loc[-1] - 1)
            block_tables.append(table)
        if 1 < max(query_lens) <= MAX_QUERY_AS_DECODE_ROWS:
            query_lens, seq_lens, block_tables, query_start_loc = _as_decode_rows(positions, query_lens, block_tables)
        return HostStep(input_ids, positions, slot_mapping, query_start_loc, query_lens, seq_lens, block_tables,
                        last_rows)

    def _tensors(self, host: HostStep) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's tensors made from its lists one by one (the CPU path)."""
        assert self.device.type == "cpu", "other devices stage their inputs (_staged_tensors)"
        width = max(len(t) for t in host.block_tables)
        block_tables = np.empty((len(host.block_tables), width), dtype=np.int32)
        fill_block_tables(block_tables, host.block_tables)
        attn_metadata = AttentionMetadata(
            slot_mapping=host_tensor(host.slot_mapping, torch.long),
            query_start_loc=host_tensor(host.query_start_loc, torch.int32),
            seq_lens=host_tensor(host.seq_lens, torch.int32),
            block_tables=torch.from_numpy(block_tables),
            max_query_len=max(host.query_lens),
            max_seq_len=max(host.seq_lens),
            query_lens_list=host.query_lens,
            seq_lens_list=host.seq_lens,
        )
        return host_tensor(host.input_ids, torch.long), host_tensor(host.positions, torch.long), attn_metadata

    def _max_step_input_bytes(self) -> int:
        """The largest step layout (`_staged_tensors`): a full token budget, every row an
        output row and a sequence of max_model_len; or the decode graphs' layout."""
        tokens = max(self.scheduler_config.max_num_batched_tokens, self.scheduler_config.max_num_seqs)
        # A step of short queries (verification steps) attends as one-row queries, every row
        # with its own block table (`_as_decode_rows`), so up to one sequence per token.
        # Another step a draft model runs feeds each request at most one more token (the
        # last accepted proposal its KV lacks).
        if self.draft_runner is not None:
            tokens += self.scheduler_config.max_num_seqs
        eager = _step_layout(tokens, tokens, tokens, self.max_blocks_per_seq)
        graphs = decode_layout(min(self.scheduler_config.max_num_seqs, 512), self.max_blocks_per_seq)
        return max(layout_bytes(eager), layout_bytes(graphs))

    def _staged_tensors(self, host: HostStep, output_rows: list[int] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None,
                                   AttentionMetadata | None]:
        """The step's tensors as views of the staging buffer, sent in one copy (the CUDA
        path); with output rows, also the rows' tensor and their attention metadata
        (`AttentionMetadata.for_rows`), so that no layer makes a tensor from a list."""
        num_tokens, num_seqs = len(host.input_ids), len(host.seq_lens)
        width = max(len(t) for t in host.block_tables)
        num_rows = 0 if output_rows is None else len(output_rows)
        fields = _step_layout(num_tokens, num_rows, num_seqs, width)
        staging = self.staging
        if staging.reserve(layout_bytes(fields)) and self.decode_graphs is not None:
            logger.warning("A step outgrew the input staging buffer; decode steps run eagerly from now on.")
            self.decode_graphs = None
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"):
            staging.host(fields[name])[:] = getattr(host, name)
        fill_block_tables(staging.host(fields["block_tables"], (num_seqs, width)), host.block_tables)
        if output_rows is not None:
            row_seqs, row_seq_lens = rows_sequences(host.query_lens, host.seq_lens, output_rows)
            staging.host(fields["output_rows"])[:] = output_rows
            staging.host(fields["row_seqs"])[:] = row_seqs
            staging.host(fields["row_seq_lens"])[:] = row_seq_lens
        staging.send(layout_bytes(fields))

        view = staging.device_view
        block_tables = view(fields["block_tables"], (num_seqs, width))
        slot_mapping = view(fields["slot_mapping"])
        attn_metadata = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=view(fields["query_start_loc"]),
            seq_lens=view(fields["seq_lens"]), block_tables=block_tables, max_query_len=max(host.query_lens),
            max_seq_len=max(host.seq_lens), query_lens_list=host.query_lens, seq_lens_list=host.seq_lens)
        rows_tensor = rows_metadata = None
        if output_rows is not None:
            rows_tensor = view(fields["output_rows"])
            rows_metadata = AttentionMetadata(
                slot_mapping=slot_mapping.index_select(0, rows_tensor),
                # Each output row is a one-token query: 0, 1, ..., num_rows (the tail of
                # query_start_loc's field is not needed: arange on the device, no copy).
                query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=self.device),
                seq_lens=view(fields["row_seq_lens"]),
                block_tables=block_tables.index_select(0, view(fields["row_seqs"])),
                max_query_len=1, max_seq_len=max(row_seq_lens), query_lens_list=[1] * num_rows,
                seq_lens_list=row_seq_lens)
        return view(fields["input_ids"]), view(fields["positions"]), attn_metadata, rows_tensor, rows_metadata

    # ---- async scheduling ----------------------------------------------------------------

    def _fill_placeholders(self, requests: list[ScheduledRequest]) -> list[tuple[int, tuple[torch.Tensor, int, int]]]:
        """Puts the tokens rank 0 sampled in the previous step where the driver, which
        scheduled this step before it saw them, left placeholders (always a chunk's last
        token). Every rank sees the same step, so all take part in the broadcast or none.
        A token not read back yet (a deferred step's) stays on the device: returns those
        holes as (index of the request, where the token is); the host lists hold 0 there."""
        holes = [(index, scheduled) for index, scheduled in enumerate(requests)
                 if scheduled.token_ids[-1] == PLACEHOLDER_TOKEN_ID]
        if not holes:
            return []
        on_device: list[tuple[int, tuple[torch.Tensor, int, int]]] = []
        if self.rank == 0:
            token_ids = []
            for index, scheduled in holes:
                pending = self._pending_samples.get(scheduled.req_id)
                if pending is not None:
                    on_device.append((index, pending))
                    token_ids.append(0)
                else:
                    token_ids.append(self._last_sampled[scheduled.req_id])
        else:
            token_ids = [0] * len(holes)
        if self.parallel_config.tensor_parallel_size > 1:
            assert not on_device, "deferred reads run on a single worker"
            tensor = tensor_model_parallel_broadcast(to_device(token_ids, self.device, torch.long), src=0)
            if self.rank != 0 and self.draft_runner is None:
                # The other ranks need the tokens only as model input: they stay on the
                # device (reading them would wait for the broadcast, and on a GPU for
                # everything queued before it). A draft model builds its input on the host.
                return [(index, (tensor, row, 0)) for row, (index, _) in enumerate(holes)]
            if self.rank != 0:
                token_ids = tensor.tolist()
        for (_, scheduled), token_id in zip(holes, token_ids):
            scheduled.token_ids[-1] = token_id
        return on_device

    def needs_collected_tokens(self, req: ExecuteModelRequest) -> bool:
        """Whether this step needs on the host a token of a deferred step not collected yet:
        a request with proposals to verify, or a draft model that proposes from the tokens,
        or a request whose penalties read its history's tokens on the host (without a
        `PenaltyState`, which counts such a token from the device), or one whose bad words
        of several tokens compare its last tokens with theirs. Other steps take such
        tokens on the device (min_tokens counts its history's tokens but reads none: 0
        stands in there)."""
        if not self._pending_samples:
            return False
        if self.draft_runner is not None or self.logits_processors is not None:
            # Custom logits processors read every output token on the host.
            return True
        for scheduled in req.requests:
            if scheduled.req_id not in self._pending_samples or scheduled.token_ids[-1] != PLACEHOLDER_TOKEN_ID:
                continue
            params = scheduled.sampling_params or self._sampling_params.get(scheduled.req_id)
            if scheduled.spec_token_ids or params is None or (params.needs_penalties and self.penalty_state is None) \
                    or params.reads_output_for_bad_words:
                return True
        return False

    def _deferred(self, output: SamplerOutput, pending: PendingSample,
                  sampled: list[ScheduledRequest]) -> DeferredSamplerOutput:
        """Registers a launched step's tokens as pending, each on its row of the step."""
        self._launch_serial += 1
        serial = self._launch_serial
        for row, scheduled in enumerate(sampled):
            self._pending_samples[scheduled.req_id] = (pending.token_ids, row, serial)
        return DeferredSamplerOutput(output, pending, self, serial)

    def _collected(self, tokens: list[SampledToken], serial: int) -> None:
        """A deferred step's tokens reached the host: they become the requests' last
        sampled tokens, unless a later step sampled again or the request finished."""
        pending_samples, last = self._pending_samples, self._last_sampled
        for token in tokens:
            entry = pending_samples.get(token.req_id)
            if entry is not None and entry[2] == serial:
                del pending_samples[token.req_id]
                last[token.req_id] = token.token_id

    # ---- sampler state -----------------------------------------------------------------

    def _fill_sampling_params(self, requests: list[ScheduledRequest]) -> None:
        """Keeps the parameters a request's first step brings; fills them into its later
        steps, which arrive without them."""
        kept = self._sampling_params
        on_device = self.penalty_state is not None
        for scheduled in requests:
            params = scheduled.sampling_params
            if params is None:
                scheduled.sampling_params = kept[scheduled.req_id]
                continue
            kept[scheduled.req_id] = params
            if keeps_host_history(params, on_device) or _is_seeded(params):
                self._stateless.discard(scheduled.req_id)
            else:
                self._stateless.add(scheduled.req_id)

    def _update_states(self, requests: list[ScheduledRequest],
                       device_holes: list[tuple[int, tuple[torch.Tensor, int, int]]] = ()) -> None:
        """Brings each kept host history (`keeps_host_history`), and the penalty state's
        rows, up to date with this step's tokens, before sampling. Only the worker that
        samples keeps them (tensor-parallel rank 0 of the last pipeline stage): the others
        never read them. device_holes: `_fill_placeholders`' tokens left on the device."""
        if not (self.rank == 0 and self.is_last_stage):
            return
        if self.penalty_state is not None:
            penalised = [scheduled for scheduled in requests if scheduled.sampling_params.needs_penalties]
            if penalised:
                holes = {requests[index].req_id: (tokens, row) for index, (tokens, row, _) in device_holes}
                self.penalty_state.update(penalised, holes, self._unknown_prompt_req_ids())
        states, stateless = self._states, self._stateless
        on_device = self.penalty_state is not None
        unknown_prompts = self._unknown_prompt_req_ids()
        for scheduled in requests:
            if scheduled.req_id in stateless or not keeps_host_history(scheduled.sampling_params, on_device):
                continue
            state = states.get(scheduled.req_id)
            if state is None:
                state = states[scheduled.req_id] = RequestSamplingState()
            # An embeddings prompt's tokens are unknown: its history holds its output only.
            unknown_prompt = scheduled.req_id in unknown_prompts
            if scheduled.resumed or state.history is None:
                # (Re)admitted: rebuild the whole history (the prompt written once); a kept
                # generator continues its stream, so a recomputed request does not replay
                # its draws.
                tokens = (scheduled.context_token_ids or []) + scheduled.token_ids
                state.history = (TokenHistory(tokens[scheduled.num_prompt_tokens:], 0) if unknown_prompt
                                 else TokenHistory(tokens, scheduled.num_prompt_tokens))
                continue
            num_prompt = min(max(scheduled.num_prompt_tokens - scheduled.num_computed_tokens, 0),
                             len(scheduled.token_ids))
            if unknown_prompt:
                state.history.extend(scheduled.token_ids[num_prompt:])
            else:
                state.history.extend(scheduled.token_ids, num_prompt)

    def _unknown_prompt_req_ids(self) -> set[int] | frozenset[int]:
        """The requests whose prompt tokens penalties do not see: embeddings prompts, whose
        placeholder ids are no tokens (the repetition penalty then reads their output only)."""
        return self.prompt_embeds.embeds_req_ids if self.prompt_embeds is not None else frozenset()

    def _sampling_metadata(self, requests: list[ScheduledRequest]) -> SamplingMetadata:
        """One row per sampled request."""
        req_ids: list[int] = []
        params_list = []
        histories: list[TokenHistory | None] = []
        history_lens: list[int] = []
        generators: list[torch.Generator | None] = []
        states = self._states
        on_device = self.penalty_state is not None
        # The usual batch: no row reads a history or draws from its own generator (known
        # since each request's admission), so its lists are made whole, with no pass below.
        stateless = self._stateless.issuperset(scheduled.req_id for scheduled in requests)
        if stateless:
            n = len(requests)
            req_ids = [scheduled.req_id for scheduled in requests]
            params_list = [scheduled.sampling_params for scheduled in requests]
            histories, history_lens, generators = [None] * n, [0] * n, [None] * n
        for scheduled in () if stateless else requests:
            params = scheduled.sampling_params
            req_ids.append(scheduled.req_id)
            params_list.append(params)
            tracked = keeps_host_history(params, on_device)
            seeded = _is_seeded(params)
            if not (tracked or seeded):
                # The common case: nothing remembered between steps.
                histories.append(None)
                history_lens.append(0)
                generators.append(None)
                continue
            state = states.get(scheduled.req_id)
            if state is None:
                state = states[scheduled.req_id] = RequestSamplingState()
            if seeded and state.generator is None:
                state.generator = sibling_generator(params.seed, scheduled.sample_index, self.device)
            history = state.history if tracked else None
            histories.append(history)
            history_lens.append(history.num_tokens if history is not None else 0)
            generators.append(state.generator if seeded else None)
        metadata = SamplingMetadata(req_ids, params_list, histories, history_lens, generators,
                                    allowed_token_masks=self.allowed_token_masks,
                                    logits_processors=self.logits_processors)
        state = self.penalty_state
        if state is not None:
            metadata.penalty_state = state
            metadata.penalty_rows = [state.row_of(scheduled.req_id) if params.needs_penalties else -1
                                     for scheduled, params in zip(requests, params_list)]
        return metadata

    def _verify(self, logits: torch.Tensor, sampled: list[ScheduledRequest],
                draft_probs: dict[int, torch.Tensor] | None) -> list[SampledToken]:
        """Speculative decoding: the tokens each sampled request emits after verifying its
        proposals (RejectionSampler). The accepted proposals join the histories here: unlike
        drawn tokens, they never come back as a later step's token_ids."""
        drafts = [scheduled.spec_token_ids or [] for scheduled in sampled]
        probs = None if draft_probs is None else [draft_probs.get(scheduled.req_id) for scheduled in sampled]
        outputs = self.rejection_sampler(logits, self._sampling_metadata(sampled), drafts, probs)
        num_emitted: dict[int, int] = {}
        for token in outputs:
            num_emitted[token.req_id] = num_emitted.get(token.req_id, 0) + 1
        accepted: dict[int, list[int]] = {}
        for scheduled, proposals in zip(sampled, drafts):
            state = self._states.get(scheduled.req_id)
            if proposals and state is not None and state.history is not None:
                state.history.extend(proposals[:num_emitted[scheduled.req_id] - 1])
            if proposals and scheduled.sampling_params.needs_penalties:
                accepted[scheduled.req_id] = proposals[:num_emitted[scheduled.req_id] - 1]
        if self.penalty_state is not None and accepted:
            self.penalty_state.add_output_tokens(accepted)
        return outputs

    def _prompt_logprobs(self, hidden_states: torch.Tensor, requests: list[ScheduledRequest]
                         ) -> dict[int, list[TokenLogprobs]] | None:
        """The prompt logprobs of the requests' scored rows, whose final hidden states are
        `hidden_states` in the requests' order; None on ranks other than 0."""
        targets: list[int] = []
        top_ks: list[int] = []
        for scheduled in requests:
            targets.extend(scheduled.prompt_logprobs_targets)
            top_ks.extend([scheduled.sampling_params.prompt_logprobs or 0] * len(scheduled.prompt_logprobs_targets))
        entries = prompt_logprobs.compute_prompt_logprobs(self.model.compute_logits, hidden_states, targets, top_ks,
                                                          self.prompt_logprobs_chunk_rows)
        if entries is None:
            return None
        result: dict[int, list[TokenLogprobs]] = {}
        offset = 0
        for scheduled in requests:
            count = len(scheduled.prompt_logprobs_targets)
            result[scheduled.req_id] = entries[offset:offset + count]
            offset += count
        return result


def _is_seeded(params: SamplingParams) -> bool:
    """Whether the request draws from a generator of its own."""
    return params.seed is not None and not params.is_greedy


def _grammar_rows(sampled: list[ScheduledRequest], constrained_req_ids: list[int]) -> list[int]:
    """The logits row of each constrained request, among the sampled requests' rows: a
    request verifying k proposals has k + 1 rows, so rows and requests differ in number
    when the batch speculates. A constrained request proposes nothing (Drafter.num_drafts),
    so its one row is where its bitmask row goes."""
    row_of: dict[int, int] = {}
    row = 0
    for scheduled in sampled:
        row_of[scheduled.req_id] = row
        row += 1 + (len(scheduled.spec_token_ids) if scheduled.spec_token_ids else 0)
    constrained = set(constrained_req_ids)
    assert not any(s.spec_token_ids for s in sampled if s.req_id in constrained), \
        "a request with a grammar bitmask must not propose tokens"
    return [row_of[req_id] for req_id in constrained_req_ids]


def _as_decode_rows(positions: list[int], query_lens: list[int], block_tables: list[list[int]]
                    ) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """Attention metadata in which every packed row is a one-token query at its own
    position p, attending to the first p + 1 tokens of its sequence (vLLM V0's batch
    expansion): the same attention as the packed queries', since every layer writes the
    step's keys and values before it attends."""
    seq_lens = [p + 1 for p in positions]
    tables = [table for table, n in zip(block_tables, query_lens) for _ in range(n)]
    return [1] * len(positions), seq_lens, tables, list(range(len(positions) + 1))


def _step_layout(num_tokens: int, num_rows: int, num_seqs: int, width: int) -> dict:
    """The staging layout of an eager step (`ModelRunner._staged_tensors`)."""
    return layout([("input_ids", torch.int64, num_tokens), ("positions", torch.int64, num_tokens),
                   ("slot_mapping", torch.int64, num_tokens), ("output_rows", torch.int64, num_rows),
                   ("row_seqs", torch.int64, num_rows), ("row_seq_lens", torch.int32, num_rows),
                   ("seq_lens", torch.int32, num_seqs), ("query_start_loc", torch.int32, num_seqs + 1),
                   ("block_tables", torch.int32, num_seqs * width)])


def _rows_to_read(requests: list[ScheduledRequest], last_rows: list[int]
                  ) -> tuple[list[ScheduledRequest], list[int], list[ScheduledRequest], list[int]]:
    """The rows whose logits a step reads: (the sampled requests, their last rows, the
    requests with prompt logprobs, their prompt rows)."""
    sampled: list[ScheduledRequest] = []
    sample_rows: list[int] = []
    prompt_requests: list[ScheduledRequest] = []
    prompt_rows: list[int] = []
    for scheduled, last in zip(requests, last_rows):
        num_drafts = len(scheduled.spec_token_ids) if scheduled.spec_token_ids else 0
        if scheduled.do_sample:
            sampled.append(scheduled)
            if num_drafts:
                # The row before each proposal, and the one after the last.
                sample_rows.extend(range(last - num_drafts, last + 1))
            else:
                sample_rows.append(last)
        if scheduled.prompt_logprobs_targets:
            # Row of position p: last - (end - 1 - p), end the chunk's end position.
            end = scheduled.num_computed_tokens + len(scheduled.token_ids) + num_drafts
            first = last - (end - 1 - scheduled.prompt_logprobs_start)
            prompt_rows.extend(range(first, first + len(scheduled.prompt_logprobs_targets)))
            prompt_requests.append(scheduled)
    return sampled, sample_rows, prompt_requests, prompt_rows


@dataclass
class DeferredSamplerOutput:
    """A step launched with `execute_model(defer_read=True)`: its tokens are queued on the
    device; collect() waits for them (that step's work alone) and returns the step's
    SamplerOutput. Collect each in launch order, on the thread that runs the steps."""

    output: SamplerOutput
    pending: PendingSample
    runner: ModelRunner
    serial: int

    def collect(self) -> SamplerOutput:
        self.output.outputs = self.pending.result()
        self.runner._collected(self.output.outputs, self.serial)
        return self.output


def _fill_holes(input_ids: torch.Tensor, holes: list[tuple[int, tuple[torch.Tensor, int, int]]]) -> None:
    """Writes each hole's token from its step's token tensor into `input_ids` on the device,
    without waiting for it: holes are (input row, (token tensor, row in it, serial))."""
    device = input_ids.device
    by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for input_row, (tokens, row, _) in holes:
        entry = by_tensor.setdefault(id(tokens), (tokens, [], []))
        entry[1].append(input_row)
        entry[2].append(row)
    for tokens, input_rows, rows in by_tensor.values():
        input_ids[to_device(input_rows, device, torch.long)] = tokens[to_device(rows, device, torch.long)]


def _run_weight_hooks(model: nn.Module) -> None:
    """Each module's `process_weights_after_loading` (the CPU GEMM's packed copies, the fused
    decode's tables), as the loader runs them after the checkpoint."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
