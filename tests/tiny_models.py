"""Builds tiny Hugging Face-format models (random weights, trained BPE tokenizer) on disk.

Nothing can be downloaded, so every test model is made here: a transformers config,
random weights saved with safetensors, and a byte-level BPE tokenizer trained with
`tokenizers` on a little text, with a chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch at every step.",
    "import os\nimport sys\nprint(os.getcwd())\n",
    "Ray places one worker actor on each GPU of the cluster.",
    "Once upon a time there was a tiny language model that loved numbers: 1 2 3 4 5 6 7 8 9 10.",
    "for i in range(10):\n    print(i * i)\n",
    "Tensor parallelism splits attention heads and MLP columns across devices.",
    "Hello, world! How are you today? I am fine, thank you.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|end|>"]


def build_tokenizer(path: Path, vocab_size: int) -> None:
    """Trains a byte-level BPE tokenizer and saves it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def random_prompts(count: int, seed: int, min_len: int, max_len: int, vocab_size: int = 512) -> list[list[int]]:
    """`count` prompts of token ids, each min_len to max_len long, with no special token
    (ids 0-3), so that they look like text."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def random_prompts_spanning(count: int, seed: int, min_len: int, max_len: int,
                            vocab_size: int = 512) -> list[list[int]]:
    """As `random_prompts`, but the first prompt is min_len long and the second max_len, so
    that a batch holds both extremes."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(count - 2)]
    return [[rng.randrange(4, vocab_size) for _ in range(length)] for length in lengths]


def _llama_like_config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        common["tie_word_embeddings"] = True  # Qwen2's small models tie them
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(**common)
    raise ValueError(f"unknown test architecture {arch!r}")


def build_tiny_model(path: Path, arch: str = "llama", vocab_size: int = 512, seed: int = 0,
                     dtype: torch.dtype = torch.float32, **config_overrides) -> Path:
    """Writes config.json, model.safetensors and tokenizer files for a tiny random model."""
    return _save_random_model(path, _llama_like_config(arch, vocab_size, **config_overrides), vocab_size, seed, dtype)


def build_tiny_base_model(path: Path, arch: str = "llama", vocab_size: int = 512, seed: int = 0,
                          **config_overrides) -> Path:
    """A tiny random bare decoder (transformers' AutoModel: `LlamaModel`, `Qwen2Model`,
    `MistralModel`, `Qwen3Model`), saved as embedding checkpoints are: architectures
    names the base model, tensors have no `model.` prefix, there is no LM head. Norm
    weights are random too, so that the final norm matters to the pooled states."""
    from transformers import AutoModel

    return _save_with_random_norms(path, AutoModel, _tiny_config(arch, vocab_size, **config_overrides), vocab_size,
                                   seed)


def build_tiny_classifier(path: Path, arch: str = "llama", num_labels: int = 3, vocab_size: int = 512, seed: int = 0,
                          **config_overrides) -> Path:
    """A tiny random sequence classifier (transformers' AutoModelForSequenceClassification:
    `LlamaForSequenceClassification`, `Qwen2...`, `Qwen3...`, `Mistral...`): the decoder
    under `model.` and a bias-free `score` head of `num_labels` outputs. Norm weights are
    random too, so that the final norm matters to the logits."""
    from transformers import AutoModelForSequenceClassification

    config = _tiny_config(arch, vocab_size, num_labels=num_labels, **config_overrides)
    _save_with_random_norms(path, AutoModelForSequenceClassification, config, vocab_size, seed)
    _add_pair_template(Path(path))
    return Path(path)


def _add_pair_template(path: Path) -> None:
    """Gives the folder's tokenizer the special tokens real cross-encoders' tokenizers put
    around a text pair (`<s> A </s> B </s>`, one text `<s> A </s>`), so that a pair
    tokenized as a pair differs from its two texts joined."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    special = [(token, tokenizer.token_to_id(token)) for token in ("<s>", "</s>")]
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                                             special_tokens=special)
    tokenizer.save(str(path / "tokenizer.json"))


def _tiny_config(arch: str, vocab_size: int, **overrides):
    """The tiny models' config of `arch`: llama, qwen2, mistral (`_llama_like_config`) or qwen3."""
    from transformers import Qwen3Config

    if arch == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **overrides)
    return _llama_like_config(arch, vocab_size, **overrides)


def _save_with_random_norms(path: Path, auto_class, config, vocab_size: int, seed: int) -> Path:
    """Tokenizer, config and `auto_class`'s model of `config`, every weight random (norms
    around 1), in fp32."""
    Path(path).mkdir(parents=True, exist_ok=True)
    build_tokenizer(Path(path), vocab_size)
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


def write_sentence_transformers_pooling(path: Path, pooling_mode: str | None, normalize: bool) -> None:
    """The sentence-transformers module files of a model folder, as `save` writes them:
    modules.json listing the Transformer, the Pooling module (1_Pooling/config.json with
    `pooling_mode` true, e.g. "pooling_mode_mean_tokens"; None: no mode set) and, if
    `normalize`, the Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (Path(path) / "2_Normalize").mkdir(exist_ok=True)
    (Path(path) / "modules.json").write_text(json.dumps(modules, indent=2))
    modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
    config = {"word_embedding_dimension": 64, **{mode: mode == pooling_mode for mode in modes},
              "include_prompt": True}
    (Path(path) / "1_Pooling").mkdir(exist_ok=True)
    (Path(path) / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _save_random_model(path: Path, config, vocab_size: int, seed: int, dtype: torch.dtype) -> Path:
    """Tokenizer, config and random weights (norm weights, including GPT-2's `ln_*`, keep
    their ones). Larger-than-default init makes next-token distributions less flat, so
    greedy decoding does not hinge on near-ties and tests compare meaningful tokens."""
    model = _random_model(path, config, vocab_size, seed, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            if not is_norm:
                param.normal_(0.0, 0.08)
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


def save_random_model_with_random_norms(path: Path, config, seed: int, dtype: torch.dtype = torch.float32) -> Path:
    """Tokenizer, config and random weights, norm weights random too (around 1, around 0
    for Gemma's 1 + w), so that the norms (a model's q/k norms, Gemma's offset) matter."""
    model = _random_model(path, config, config.vocab_size, seed, dtype)
    norm_center = 0.0 if config.model_type in ("gemma2", "gemma3_text") else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(norm_center, 0.1)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


def _random_model(path: Path, config, vocab_size: int, seed: int, dtype: torch.dtype):
    """Makes the folder with its tokenizer, and the model of `config` seeded by `seed`."""
    from transformers import AutoModelForCausalLM

    Path(path).mkdir(parents=True, exist_ok=True)
    build_tokenizer(Path(path), vocab_size)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_tiny_opt(path: Path, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32,
                   **config_overrides) -> Path:
    """A tiny random OPTForCausalLM (pre-norm like opt-125m unless overridden, e.g.
    do_layer_norm_before=False, word_embed_proj_dim=32 for an opt-350m-like layout)."""
    from transformers import OPTConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, word_embed_proj_dim=64, activation_function="relu",
                  do_layer_norm_before=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(config_overrides)
    return _save_random_model(path, OPTConfig(**common), vocab_size, seed, dtype)


def build_tiny_gpt2(path: Path, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **config_overrides) -> Path:
    """A tiny random GPT2LMHeadModel (gelu_new, tied embeddings)."""
    from transformers import GPT2Config

    common = dict(vocab_size=vocab_size, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256,
                  activation_function="gelu_new", bos_token_id=1, eos_token_id=2)
    common.update(config_overrides)
    return _save_random_model(path, GPT2Config(**common), vocab_size, seed, dtype)


def build_tiny_gemma3(path: Path, sliding_window: int = 20, vocab_size: int = 512, seed: int = 0,
                      **config_overrides) -> Path:
    """A tiny random Gemma3ForCausalLM (transformers' Gemma3TextConfig) of 4 layers, the
    third global (sliding_window_pattern 3, as gemma-3's 6), the others windowed to
    `sliding_window` (shorter than test prompts; max_position_embeddings 1024); the global
    layers' rope linearly scaled as the 4B+ models' (base 1M, factor 8), the local ones'
    of base 10k; query_pre_attn_scalar 24 against head_dim 16; no soft caps, as released.
    Norm weights random around 0 (Gemma's 1 + w), embeddings untied (see
    `build_tiny_windowed_model`)."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              query_pre_attn_scalar=24, sliding_window=sliding_window, sliding_window_pattern=3,
                              rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=False,
                              **config_overrides)
    return save_random_model_with_random_norms(path, config, seed)


def build_tiny_olmo2(path: Path, vocab_size: int = 512, seed: int = 0, **config_overrides) -> Path:
    """A tiny random Olmo2ForCausalLM: 4 query heads to 1 KV head (so that tensor parallel
    ranks replicate it and its k_norm), random norm weights around 1 (q_norm and k_norm
    over whole projections)."""
    from transformers import Olmo2Config

    config = Olmo2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         **config_overrides)
    return save_random_model_with_random_norms(path, config, seed)


# ---- sliding-window models ----

# Architectures whose layers attend within a sliding window, and how the window is laid out.
WINDOWED_ARCHS = ("mistral", "gemma2", "qwen2")


def build_tiny_windowed_model(path: Path, arch: str, sliding_window: int, vocab_size: int = 512, seed: int = 0,
                              dtype: torch.dtype = torch.float32, **config_overrides) -> Path:
    """A tiny random model with sliding-window attention, the window meant to be shorter than
    test prompts (max_position_embeddings 1024): "mistral" windows every layer (v0.1);
    "gemma2" the even layers of 4 (its default layer_types), with attention and final logit
    soft caps small enough to change these models' logits; "qwen2" the layers from
    max_window_layers = 1 on of 3 (use_sliding_window). Norm weights are random too (around 1,
    around 0 for Gemma's 1 + w), and embeddings untied: tied ones made these tiny models repeat
    the last token, where greedy tokens should vary from step to step."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, sliding_window=sliding_window)
    if arch == "mistral":
        config = MistralConfig(**common, num_hidden_layers=2, tie_word_embeddings=False, **config_overrides)
    elif arch == "gemma2":
        config = Gemma2Config(**common, num_hidden_layers=4, pad_token_id=0, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=5.0, tie_word_embeddings=False,
                              **config_overrides)
    elif arch == "qwen2":
        config = Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
                             tie_word_embeddings=False, **config_overrides)
    else:
        raise ValueError(f"unknown windowed test architecture {arch!r}; one of {WINDOWED_ARCHS}")
    return save_random_model_with_random_norms(path, config, seed, dtype)


# ---- Mixture-of-Experts -------------------------------------------------------------------------

def build_tiny_mixtral(path: Path, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32,
                       **config_overrides) -> Path:
    """A tiny random MixtralForCausalLM: 7 experts (an odd count, so expert parallelism at 2
    ranks splits them 4 + 3), top-2, routing weights renormalised."""
    from transformers import MixtralConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=7, num_experts_per_tok=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(config_overrides)
    return _save_random_model(path, MixtralConfig(**common), vocab_size, seed, dtype)


def build_tiny_qwen3_moe(path: Path, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32,
                         **config_overrides) -> Path:
    """A tiny random Qwen3MoeForCausalLM: 3 layers, the middle one dense (`mlp_only_layers`),
    the others top-2 of 5 experts with `norm_topk_prob`; head_dim 32 with 4 heads of a
    64-wide model (Qwen3's head_dim is free of hidden_size)."""
    from transformers import Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=5,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(config_overrides)
    return _save_random_model(path, Qwen3MoeConfig(**common), vocab_size, seed, dtype)


def build_tiny_qwen2_moe(path: Path, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32,
                         **config_overrides) -> Path:
    """A tiny random Qwen2MoeForCausalLM: top-2 of 7 experts, not renormalised (Qwen2-MoE's
    default `norm_topk_prob` False), plus a shared expert gated per token."""
    from transformers import Qwen2MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  shared_expert_intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=7, num_experts_per_tok=2, norm_topk_prob=False,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(config_overrides)
    return _save_random_model(path, Qwen2MoeConfig(**common), vocab_size, seed, dtype)


# ------------------------------------------------------------ reasoning models
# A chat template in Qwen3's and DeepSeek-R1's ways: `think_open` opens <think> in the
# prompt (R1's template), `enable_thinking: false` closes an empty one (Qwen3's); tools go in
# a system turn, and an earlier assistant turn's `reasoning_content` is shown in its tags
# (Qwen3's template shows those of the turns since the last user message).
REASONING_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% elif think_open is defined and think_open %}<think>{% endif %}{% endif %}"
)
THINK_TAGS = ("<think>", "</think>")


def build_tiny_reasoning_model(path: Path, chain: list[str], seed: int = 0, added_tokens: tuple[str, ...] = ()
                               ) -> Path:
    """A tiny Llama whose tokenizer has <think> and </think> as added tokens (as Qwen3's and
    DeepSeek-R1's have), and `added_tokens` too (Qwen3's <tool_call> and </tool_call>, or
    pieces of text the chain writes as one token each), with `REASONING_CHAT_TEMPLATE`, and
    weights chosen so that greedy decoding follows `chain`: each piece of text is followed by
    the next, the last by EOS.

    The next token depends on the current token alone: attention and MLP write nothing to
    the residual stream (o_proj and down_proj are zero), so the final hidden state is the
    normalised embedding of the current token, and lm_head's row of each successor is its
    predecessor's embedding, scaled (random 64-dimensional embeddings are nearly
    orthogonal, so the successor's logit stands far above every other). Every piece must
    be one token, and no token may appear twice in the chain."""
    from transformers import AutoTokenizer

    Path(path).mkdir(parents=True, exist_ok=True)
    build_tokenizer(Path(path), 512)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens([*THINK_TAGS, *added_tokens])
    tokenizer.chat_template = REASONING_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    ids = _chain_token_ids(tokenizer, chain) + [tokenizer.eos_token_id]
    return _save_chain_model(path, ids, len(tokenizer), seed)


def _chain_token_ids(tokenizer, chain: list[str]) -> list[int]:
    """The ids of the chain's pieces, each one token: an added token's own id (the model may
    write one whose text the tokenizer would split, such as a piece holding special tokens'
    text), else the one token the piece encodes to."""
    ids = []
    added = tokenizer.get_added_vocab()
    for piece in chain:
        piece_ids = [added[piece]] if piece in added else tokenizer.encode(piece, add_special_tokens=False)
        assert len(piece_ids) == 1, f"{piece!r} is {len(piece_ids)} tokens"
        ids.extend(piece_ids)
    return ids


def _save_chain_model(path: Path, ids: list[int], vocab_size: int, seed: int, **config_overrides) -> Path:
    """A tiny Llama whose greedy decoding follows `ids`, each token followed by the next (the
    weights of build_tiny_reasoning_model, which says how)."""
    from transformers import AutoModelForCausalLM

    assert len(set(ids)) == len(ids), f"a token appears twice in the chain {ids}"
    config = _llama_like_config("llama", vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings.normal_(0.0, 1.0)
        head = model.lm_head.weight
        head.zero_()
        for current, following in zip(ids, ids[1:]):
            head[following] = 4.0 * embeddings[current] / embeddings[current].norm()
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


# ------------------------------------------------------------ gpt-oss's harmony format
# gpt-oss's special tokens of the harmony format (<|end|> is already one of build_tokenizer's).
HARMONY_SPECIAL_TOKENS = ("<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
GPT_OSS_CHAT_TEMPLATE = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text()


def build_harmony_tokenizer(path: Path, added_tokens: tuple[str, ...] = ()) -> Any:
    """A gpt-oss-shaped tokenizer: the tiny BPE with the harmony markers as special tokens
    (as gpt-oss's o200k_harmony has them), `<|return|>` its EOS as gpt-oss's is, and a copy
    of gpt-oss's chat template; `added_tokens` as ordinary added tokens (pieces of text a
    chain writes as one token). Saved to `path` and returned."""
    from transformers import AutoTokenizer

    Path(path).mkdir(parents=True, exist_ok=True)
    build_tokenizer(Path(path), 512)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIAL_TOKENS), "eos_token": "<|return|>"},
                                 replace_extra_special_tokens=False)
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = GPT_OSS_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return tokenizer


def build_tiny_harmony_model(path: Path, chain: list[str], added_tokens: tuple[str, ...] = (), seed: int = 0
                             ) -> Path:
    """A tiny Llama with build_harmony_tokenizer's tokenizer whose greedy decoding follows
    `chain` (as build_tiny_reasoning_model's does); `<|return|>` and `<|call|>` end a reply,
    as gpt-oss's generation config says, so a chain ends with one of them."""
    tokenizer = build_harmony_tokenizer(path, added_tokens)
    stops = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    return _save_chain_model(path, _chain_token_ids(tokenizer, chain), len(tokenizer), seed, eos_token_id=stops,
                             max_position_embeddings=1024)


# ---- vision-language (LLaVA) ------------------------------------------------------------------

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_tiny_llava(path: Path, seed: int = 0, image_size: int = 32, patch_size: int = 8) -> Path:
    """A tiny random LlavaForConditionalGeneration (a CLIP vision tower of (32/8)^2 = 16 patches,
    the "default" feature strategy dropping CLS: 16 image tokens a picture; a gelu projector; a
    Llama decoder) with its processor: CLIPImageProcessor and the tiny tokenizer plus an
    `<image>` token, LLaVA-1.5's chat template shape."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    Path(path).mkdir(parents=True, exist_ok=True)
    build_tokenizer(Path(path), 512)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    vision_config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=image_size, patch_size=patch_size, projection_dim=32)
    text_config = _llama_like_config("llama", len(tokenizer))
    config = LlavaConfig(vision_config=vision_config, text_config=text_config,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return Path(path)


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma3_vl(path: Path, seed: int = 0, sliding_window: int = 12) -> Path:
    """A tiny random Gemma3ForConditionalGeneration: a SigLIP tower of (32/8)^2 = 16 patches
    (2 layers, no pooling head, as released), average-pooled to mm_tokens_per_image = 4 image
    tokens; the text model as `build_tiny_gemma3`'s (4 layers, the third global, the others
    windowed to `sliding_window`, shorter than an image-bearing prompt); Gemma3Processor over the
    tiny tokenizer plus `<start_of_image>`, `<end_of_image>` and `<image_soft_token>`, with a
    Gemma-shaped chat template. Weights random (norms too, around Gemma's 1 + w)."""
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    Path(path).mkdir(parents=True, exist_ok=True)
    build_tokenizer(Path(path), 512)
    tokenizer = AutoTokenizer.from_pretrained(str(path), extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    text_config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, query_pre_attn_scalar=24, sliding_window=sliding_window,
        sliding_window_pattern=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})
    vision_config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=32, patch_size=8, vision_use_head=False)
    config = Gemma3Config(text_config=text_config, vision_config=vision_config, mm_tokens_per_image=4,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA3_CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return Path(path)


def random_image(seed: int, size: tuple[int, int] = (48, 40)):
    """A PIL RGB image of random pixels (width, height)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# ---- Phi-3 and Granite ----------------------------------------------------------------------------

# A tiny Phi-3's LongRoPE: the original context (32 tokens) test prompts pass; 6 factors each
# (rotary_dim 12 of head_dim 16 at partial_rotary_factor 0.75), the long ones far from the short.
PHI3_ORIGINAL_MAX_POSITION = 32
PHI3_SHORT_FACTOR = [1.0, 1.2, 1.5, 2.0, 3.0, 4.0]
PHI3_LONG_FACTOR = [1.5, 2.5, 4.0, 7.0, 12.0, 20.0]


def build_tiny_phi3(path: Path, seed: int = 0, longrope: bool = True, dtype: torch.dtype = torch.float32,
                    **config_overrides) -> Path:
    """A tiny random Phi3ForCausalLM (fused qkv_proj and gate_up_proj). longrope: as
    Phi-4-mini, LongRoPE over 3/4 of each head from an original 32 positions to 256 (an
    attention factor of sqrt(1 + ln 8 / ln 32)); else plain rotary over whole heads
    (override sliding_window for Phi-3-mini's window). Embeddings untied unless overridden
    (Phi-4-mini ties them): tied ones make these tiny models repeat a token from step to
    step. Norm weights random too."""
    from transformers import Phi3Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if longrope:
        common.update(original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITION, partial_rotary_factor=0.75,
                      rope_scaling=dict(rope_type="longrope", short_factor=PHI3_SHORT_FACTOR,
                                        long_factor=PHI3_LONG_FACTOR))
    common.update(config_overrides)
    return save_random_model_with_random_norms(path, Phi3Config(**common), seed, dtype)


def build_tiny_granite(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides) -> Path:
    """A tiny random GraniteForCausalLM with its four multipliers away from 1 (the
    attention's from head_dim ** -0.5), as the released models' are. Embeddings untied
    unless overridden (Granite 3.x ties them; see `build_tiny_phi3`). Norm weights random too."""
    from transformers import GraniteConfig

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, embedding_multiplier=4.0,
                  residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)
    common.update(config_overrides)
    return save_random_model_with_random_norms(path, GraniteConfig(**common), seed, dtype)


def build_tiny_gpt_oss(path: Path, vocab_size: int = 512, seed: int = 0, dtype: torch.dtype = torch.float32,
                       **config_overrides) -> Path:
    """A tiny random GptOssForCausalLM: 3 layers alternating sliding (window 8, shorter than
    test prompts) and full attention as gpt-oss does, 4 query heads to 2 KV heads of 16, top-2
    of 5 experts (an odd count), YaRN rope (factor 4 over an original 64 positions, so the
    ramp between kept and scaled frequencies falls inside the head). swiglu_limit 0.5, not
    the released 7, so that the clamps bite on these small activations; sinks around 0 with
    std 1 so that they take a real share of each softmax."""
    from transformers import GptOssConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=5,
                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-5,
                  swiglu_limit=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                       beta_slow=1.0, truncate=False, original_max_position_embeddings=64))
    common.update(config_overrides)
    model = _random_model(path, GptOssConfig(**common), vocab_size, seed, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            std = 1.0 if name.endswith("sinks") else 0.1 if "bias" in name else 0.08
            param.normal_(0.0, std)
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


# What Qwen3-Reranker's tokenizer holds that the trained tiny one lacks: its answer tokens
# ("yes", "no", whole tokens of the vocabulary) and the chat markers of its prompt.
RERANKER_TOKENS = ["yes", "no"]
RERANKER_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]


def build_tiny_reranker(path: Path, arch: str = "qwen3", vocab_size: int = 512, seed: int = 0,
                        **config_overrides) -> Path:
    """A tiny random causal LM saved as an LLM reranker such as Qwen3-Reranker is: a
    `*ForCausalLM` checkpoint (qwen3, llama, qwen2, mistral) whose tokenizer holds "yes" and
    "no" as tokens and `<|im_start|>` / `<|im_end|>` as special tokens, all within
    `vocab_size`. Norm weights are random too, so that the final norm matters to the logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, vocab_size - len(RERANKER_TOKENS) - len(RERANKER_SPECIAL_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(RERANKER_TOKENS)
    tokenizer.add_tokens(RERANKER_SPECIAL_TOKENS, special_tokens=True)
    assert len(tokenizer) <= vocab_size, len(tokenizer)
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch, vocab_size, **config_overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
