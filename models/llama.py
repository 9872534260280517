"""Llama-family decoder (Llama 2/3, Mistral, Qwen2), written against the parallel layers so
the same code runs sharded under tensor parallelism.

Qwen2 is Llama with biases on q/k/v; Mistral is Llama. Layers attend within the sliding
window the config gives them (`layer_sliding_windows`: every layer for Mistral v0.1, the
layers from `max_window_layers` on for Qwen2 with `use_sliding_window`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.kernels.cpu_fused_decode import CpuFusedDecode
from raylm.kernels.mlp_row_chunks import mlp_in_row_chunks
from raylm.models.activation import SiluAndMul
from raylm.models.attention import Attention
from raylm.models.causal_lm import CausalLM
from raylm.models.forward_context import get_forward_context, last_layer_rows, select_rows
from raylm.models.logits_processor import LogitsProcessor
from raylm.models.pipeline import (PPMissingLayer, is_first_stage, is_last_stage, make_layers, skip_other_stages,
                                   stage_input)
from raylm.models.rmsnorm import RMSNorm, norm_with_residual
from raylm.models.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters_from_config
from raylm.models.sliding_window import layer_sliding_windows
from raylm.parallel import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                            VocabParallelEmbedding, get_tensor_model_parallel_world_size)
from raylm.parallel.linear import LinearOutputSlice
from raylm.parallel.pipeline import IntermediateTensors


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for Llama-family models, got {hidden_act!r}.")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       silu_and_mul_follows=True)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_in_row_chunks(self._mlp, x, self.gate_up_proj.weight.shape[0])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        activation = self.gate_up_proj.silu_and_mul(x)  # one kernel for CPU decode batches, else None
        if activation is None:
            activation = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(activation)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_size, self.total_num_heads,
                                          self.total_num_kv_heads, bias=qkv_bias)
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_size, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_size, self.head_size ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window)
        # The q and the k/v parts of qkv_proj, packed apart (`prepare_output_row_projections`),
        # for a last layer whose outputs are read at a few rows only.
        self.output_row_projections: tuple[LinearOutputSlice, LinearOutputSlice] | None = None

    def prepare_output_row_projections(self) -> None:
        """Packs the q and the k/v rows of qkv_proj apart, so that forward with output_rows
        projects queries for those rows only (the model's last layer calls this at load)."""
        self.output_row_projections = (LinearOutputSlice(self.qkv_proj, 0, self.q_size),
                                       LinearOutputSlice(self.qkv_proj, self.q_size, 2 * self.kv_size))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], or the rows output_rows (ForwardContext.output_rows)."""
        if (output_rows is not None and self.output_row_projections is not None and type(self.attn) is Attention
                and get_forward_context().attn_metadata is not None):
            return self._forward_output_rows(positions, hidden_states, output_rows)
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        kv_cache = self.fused_kv_cache()
        if self.rotary_emb.rotate_and_cache(positions, q, k, v, kv_cache):  # one launch on CUDA
            return self.o_proj(self.attn(q, k, v, output_rows, kv_cached=kv_cache is not None))
        q, k = self.rotary_emb.rotate(positions, qkv.narrow(-1, 0, self.q_size + self.kv_size)).split(
            [self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, output_rows))

    def fused_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
        """Where the rotary kernel may store this step's keys and values (`Attention.fused_kv_cache`);
        None for attention layers of other kinds, which write their own."""
        return self.attn.fused_kv_cache() if type(self.attn) is Attention else None

    def _forward_output_rows(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                             output_rows: torch.Tensor) -> torch.Tensor:
        """forward's result for the output rows, with keys and values projected (and cached)
        for every row, as later tokens attend to them, but queries and attention for the
        output rows alone: a prefill step of whole prompts so skips the last layer's query
        projection and prefill attention on all but one row per prompt."""
        q_proj, kv_proj = self.output_row_projections
        k, v = kv_proj(hidden_states).split([self.kv_size, self.kv_size], dim=-1)
        k = self.rotary_emb.rotate(positions, k)
        q = self.rotary_emb.rotate(positions.index_select(0, output_rows),
                                   q_proj(hidden_states.index_select(0, output_rows)))
        return self.o_proj(self.attn.forward_rows(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, qkv_bias=qkv_bias,
                                        o_bias=bool(getattr(config, "attention_bias", False)),
                                        sliding_window=sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = norm_with_residual(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, output_rows)
        residual = select_rows(residual, output_rows)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def is_plain_llama_layer(layer: nn.Module, layer_class: type[nn.Module] = LlamaDecoderLayer,
                         attention_class: type[nn.Module] = LlamaAttention) -> bool:
    """Whether a layer computes exactly what the fused CPU decode op does: of exactly
    `layer_class` (a subclass may compute otherwise; Granite's, whose only change the op
    takes, names its own) over exactly `attention_class` (Qwen3's, whose q/k norms the op
    takes), Llama's MLP, norms and rotary."""
    if type(layer) is not layer_class:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (type(attn) is attention_class and type(mlp) is LlamaMLP and type(mlp.act_fn) is SiluAndMul
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and type(attn.rotary_emb) is RotaryEmbedding)


class LlamaModel(nn.Module):
    # Decode steps on the CPU through every layer in one native call (None: the layers' loop
    # always, as for models built on other layers).
    fused_decode: CpuFusedDecode | None = None
    # tie_word_embeddings where the config does not say (LlamaConfig's default).
    default_tie_word_embeddings = False

    def __init__(self, config: Any, qkv_bias: bool) -> None:
        super().__init__()
        self._build_modules(config, lambda rotary_emb, window: LlamaDecoderLayer(config, rotary_emb, qkv_bias,
                                                                                 sliding_window=window))
        self.fused_decode = CpuFusedDecode(self.stage_layers, is_plain_llama_layer)

    def _build_modules(self, config: Any, make_layer: Callable[[RotaryEmbedding, int | None], nn.Module],
                       embedding_type: type[VocabParallelEmbedding] = VocabParallelEmbedding,
                       norm_type: type[RMSNorm] = RMSNorm) -> None:
        """The token embedding, the decoder layers (`make_layer(rotary_emb, sliding_window)`)
        and the final norm, for models that run Llama's forward over their own modules."""
        # Pipeline parallel: a stage builds its own layers only (`models/pipeline.py`); the
        # embedding lives on the first stage, and on the last too when the LM head shares it.
        self.is_last_stage = is_last_stage()
        tied = bool(getattr(config, "tie_word_embeddings", self.default_tie_word_embeddings))
        self.embed_tokens = (embedding_type(config.vocab_size, config.hidden_size)
                             if is_first_stage() or (tied and self.is_last_stage) else PPMissingLayer())
        rotary_embs = self._layer_rotary_embs(config)
        windows = layer_sliding_windows(config)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: make_layer(rotary_embs[i], windows[i]))
        self.norm = norm_type(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()

    def _layer_rotary_embs(self, config: Any) -> list[RotaryEmbedding]:
        """Each decoder layer's rotary embedding: here one cos/sin table shared by every
        layer; models whose layers rotate differently (Gemma 3's local and global) override."""
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_emb = get_rope(head_size, config.max_position_embeddings, rope_parameters_from_config(config))
        return [rotary_emb] * config.num_hidden_layers

    @property
    def stage_layers(self) -> nn.ModuleList:
        """The decoder layers this pipeline stage holds (all of them without pipeline parallelism)."""
        return self.layers[self.start_layer:self.end_layer]

    def process_weights_after_loading(self) -> None:
        if self.fused_decode is not None:
            self.fused_decode.reset()  # it holds the layers' packed weights of the last load
        last = self.layers[-1].self_attn if len(self.layers) and self.is_last_stage else None
        if (isinstance(last, LlamaAttention) and type(last).forward is LlamaAttention.forward
                and type(last.attn) is Attention and last.qkv_proj.quant_method is None):
            last.prepare_output_row_projections()  # its outputs are read at the output rows only

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """The final hidden states; on a pipeline stage before the last, what it hands on.
        inputs_embeds (a multi-modal model's): the input rows' embeddings, images merged in,
        in place of the token embeddings of input_ids."""
        hidden_states = (inputs_embeds if inputs_embeds is not None
                         else stage_input(intermediate_tensors, self.embed_tokens, input_ids))
        # The fused op returns every row: it runs only on steps that read them all.
        every_row = get_forward_context().output_rows is None
        fused = (self.fused_decode.run(hidden_states, positions, get_forward_context().attn_metadata)
                 if self.fused_decode and every_row else None)
        if fused is not None:
            hidden_states, residual = fused
        else:
            residual = None
            for i in range(self.start_layer, self.end_layer):
                hidden_states, residual = self.layers[i](positions, hidden_states, residual,
                                                         last_layer_rows(i, len(self.layers)))
        if not self.is_last_stage:
            return IntermediateTensors.of_hidden_states(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    default_qkv_bias = False
    # Splits into pipeline stages (`models/pipeline.py`); so do its subclasses.
    supports_pipeline_parallel = True
    # Takes given embeddings for its input rows (enable_prompt_embeds); so do its subclasses.
    supports_prompt_embeds = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self._init_model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                self.model.default_tie_word_embeddings))
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def _init_model(self, config: Any) -> LlamaModel:
        """The decoder under the LM head; subclasses over other layers build their own."""
        qkv_bias = bool(getattr(config, "attention_bias", self.default_qkv_bias)) or self.default_qkv_bias
        return LlamaModel(config, qkv_bias=qkv_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden] (only the rows
        ForwardContext.output_rows when it is set). A pipeline stage after the first starts
        from the previous stage's `intermediate_tensors`; one before the last returns its own.
        inputs_embeds [T, hidden] (prompt embeddings merged into `get_input_embeddings`'
        rows): the first layer's input in place of input_ids' embeddings."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows of input_ids, as the first layer takes them."""
        return self.model.embed_tokens(input_ids)

    def prompt_embeds_as_inputs(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """Given prompt embeddings (Hugging Face's `inputs_embeds`: what its embedding table
        returns) as `get_input_embeddings` returns rows: the same here; Granite multiplies."""
        return prompt_embeds

    def _checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super()._checkpoint_tensors(skip_other_stages(self, weights)):
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue
            yield name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    default_qkv_bias = True
