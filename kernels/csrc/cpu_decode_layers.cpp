// A decode step through every decoder layer of a Llama-family model in one operator call:
// torch.ops.raylm.llama_decode_layers (called by raylm/models/cpu_fused_decode.py).
//
// Why: on a CPU a decode step streams every layer's weights from memory, which leaves the last-
// level cache holding weights, not the Python interpreter's working set. The ~10 Python calls
// between a layer's kernels (module calls, argument checks, the op dispatch) then run from
// memory: on a 2-core Zen 4 EPYC an op call from Python took 2.4 us with warm caches and 25 us
// after a 64 MiB stream, a module call 7 us and 45-56 us; in the ~100M Llama's bf16 generate
// the gaps between a decode layer's kernels summed to ~0.27 s of ~8.4 s. Here the same kernels
// are called in the same order from C++ through the dispatcher (each stays a profiled op), and
// the code between them is a few hundred instructions.
//
// It computes exactly what LlamaDecoderLayer's modules compute on the CPU path, kernel for
// kernel, so results are bitwise those of the Python path:
//   layer 0: residual = hidden; hidden = rms_norm(hidden)      (no residual yet)
//   else:    residual += hidden; hidden = rms_norm(residual)   (fused_add_rms_norm, in place)
//   qkv = linear(hidden); rotary on q and k (in place); write k, v to the layer's cache slots;
//   attn = paged_decode_attention(q, the layer's sliding window); hidden = linear(attn)
//   residual += hidden; hidden = rms_norm(residual); hidden = linear(silu_and_mul(linear(hidden)))
//   (the inner two as one avx512_linear_silu_mul or avx2_linear_silu_mul where gate_up_proj
//   has the gated copy)
// and returns (hidden, residual) after the last layer. A residual_multiplier other than 1
// (Granite's) scales each block's output, attention's and the MLP's, before its residual add,
// as GraniteDecoderLayer does (`hidden * multiplier`: the same mul kernel, here in place on the
// block's fresh output); at 1 the op multiplies nothing, so Llama's results are untouched.
// A layer given q and k norm weights (Qwen3's and OLMo 2's q_norm and k_norm) normalises q and
// k before the rotary, as their attention does: rms_norm over rows of the weight's length
// (Qwen3's [head_size]: each head; OLMo 2's [q_size] and [kv_size]: the whole projection), into
// new tensors, then the rotary on each of the two.
// With post_norms (OLMo 2's layout) no norm precedes a block; each block's output is normalised
// before its residual add, as Olmo2DecoderLayer computes:
//   hidden = hidden + residual (not in layer 0); residual = hidden; attention block on hidden;
//   hidden = residual + rms_norm(attention output); residual = hidden;
//   hidden = rms_norm(MLP block on hidden)
// (the adds are PyTorch's, out of place, as the layer's `+`), and the two norm weights are the
// post-attention and post-feedforward norms'.
//
// Per layer, `tensors` holds kTensorsPerLayer entries, in this order: input_layernorm weight,
// post_attention_layernorm weight (with post_norms: post_attention_layernorm and
// post_feedforward_layernorm weights), then (weight, bias or None) for qkv_proj, o_proj,
// gate_up_proj and down_proj, then k_cache and v_cache, then the q and k norm weights (both
// None: no q/k norms). `ints` holds, per layer, the kernel
// (LinearKind) and out_features of each of the four linears (for kAvx512SiluMul and
// kAvx2SiluMul, the d of its [T, d] output). `sliding_windows` holds each layer's window (0: none). The caller chooses each linear's
// kernel and weight copy for this batch size exactly as parallel/cpu_gemm.linear would.
//
// With LoRA (`lora_token_slots` given: each token's adapter slot, -1 for the base model), each
// of the four linears' output gets its tokens' adapter terms added by raylm::lora_bgmv
// (csrc/cpu_lora.cpp) right after the linear, as the LoRA layers of parallel/lora_linear.py
// do; `lora_tensors` holds, per layer, kLoRATensorsPerLayer entries: lora_a and each output
// slice's lora_b of qkv_proj (q, k, v), o_proj, gate_up_proj (gate, up) and down_proj.
// gate_up_proj must then not be the gated kernel (its output is past the activation).
//
// `hidden` (it becomes the residual, added to in place) and the KV caches are written in place;
// the schema cannot mark tensors of a list as mutated, nor the returned residual as hidden's
// alias: the op is for eager decode steps, not for graphs that reorder or functionalize.
// Built by raylm/kernels/native_build.py; it needs cpu_ops and cpu_attention loaded, and the
// linear kernels its `ints` name.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// parallel/cpu_gemm.py's LINEAR_* constants. kAvx512SiluMul and kAvx2SiluMul are gate_up_proj
// only: the AVX-512 or AVX2 kernel on its gated copy, whose output is silu(gate) * up.
enum LinearKind : int64_t {
  kAvx512 = 0, kAmx = 1, kOneDnn = 2, kDense = 3, kAvx512SiluMul = 4, kAvx2 = 5, kAvx2SiluMul = 6
};

constexpr int64_t kTensorsPerLayer = 14;
constexpr int64_t kIntsPerLayer = 8;
// qkv_proj: a, b_q, b_k, b_v; o_proj: a, b; gate_up_proj: a, b_gate, b_up; down_proj: a, b.
constexpr int64_t kLoRATensorsPerLayer = 11;
constexpr int64_t kLoRASlices[4] = {3, 1, 2, 1};

template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// kernels/cpu_gemm.py's onednn_rows, ONEDNN_EXACT_ROWS and ONEDNN_ROWS_PER_DOUBLING: the few
// row counts oneDNN GEMMs run with, so that it keeps few primitives (one per shape it sees).
constexpr int64_t kOneDnnExactRows = 16;
constexpr int64_t kOneDnnRowsPerDoubling = 8;

int64_t onednn_rows(int64_t rows) {
  if (rows <= kOneDnnExactRows) return rows;
  int64_t below = 1;  // the largest power of two under rows
  while (below * 2 < rows) below *= 2;
  const int64_t step = below / kOneDnnRowsPerDoubling;
  return (rows + step - 1) / step * step;
}

using StreamingLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);

at::Tensor linear(int64_t kind, const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  switch (kind) {
    case kAvx512: {
      static const auto op = typed_op<StreamingLinear>("raylm::avx512_linear");
      return op.call(x, weight, out_features, bias);
    }
    case kAmx: {
      static const auto op = typed_op<StreamingLinear>("raylm::amx_linear");
      return op.call(x, weight, out_features, bias);
    }
    case kAvx2: {
      static const auto op = typed_op<StreamingLinear>("raylm::avx2_linear");
      return op.call(x, weight, out_features, bias);
    }
    case kOneDnn: {
      // torch's own op, at the rows cpu_gemm.cpu_linear runs it with (onednn_rows: x's, zeros
      // below), so that the results are bitwise the modules'; boxed, as its schema's list of
      // optional scalars has no stable unboxed C++ type across torch versions.
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
      const int64_t rows = x.size(0), padded_rows = onednn_rows(rows);
      at::Tensor input = x;
      if (padded_rows != rows) {
        input = at::zeros({padded_rows, x.size(1)}, x.options());
        input.narrow(0, 0, rows).copy_(x);
      }
      torch::jit::Stack stack{input, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                              std::optional<std::string>(std::string())};
      op.callBoxed(&stack);
      return stack.back().toTensor().narrow(0, 0, rows);
    }
    case kDense:
      return at::linear(x, weight, bias);
    default:
      TORCH_CHECK(false, "raylm::llama_decode_layers: unknown linear kernel ", kind);
  }
}

// silu(x Wg^T) * (x Wu^T) by the gated kernel `kind` (kAvx512SiluMul or kAvx2SiluMul), each
// op looked up at its first use: a process has the library of the one its layers took.
at::Tensor gated_linear(int64_t kind, const at::Tensor& x, const at::Tensor& weight, int64_t d) {
  using GatedLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
  if (kind == kAvx512SiluMul) {
    static const auto op = typed_op<GatedLinear>("raylm::avx512_linear_silu_mul");
    return op.call(x, weight, d);
  }
  static const auto op = typed_op<GatedLinear>("raylm::avx2_linear_silu_mul");
  return op.call(x, weight, d);
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("raylm::rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)> fused_add_rms_norm =
      typed_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>("raylm::fused_add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      typed_op<at::Tensor(const at::Tensor&)>("raylm::silu_and_mul");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)> rotary =
      typed_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>("raylm::rotary_embedding");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>
      write_kv_cache = typed_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                     const at::Tensor&)>("raylm::write_kv_cache");
  // (..., scale, sliding_window, logits_soft_cap, k_scale, v_scale, sinks): the caches here are
  // the model's dtype, whose scales are 1, and Llama layers have no sinks.
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, int64_t, double, double, double,
                                      const c10::optional<at::Tensor>&)>
      decode_attention =
          typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double, int64_t, double, double, double,
                              const c10::optional<at::Tensor>&)>("raylm::paged_decode_attention");
};

const Ops& ops() {
  static const Ops instance;  // looked up once: the libraries register their ops when loaded
  return instance;
}

// x [T, n] normalised over rows of the weight's length (Qwen3Attention's
// `q_norm(q.reshape(-1, head_size)).view(-1, q_size)`), in a new [T, n] tensor.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ops().rms_norm.call(x.reshape({-1, weight.size(0)}), weight, eps).view({x.size(0), x.size(1)});
}

using LoRABgmv = void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList, at::IntArrayRef,
                      const at::Tensor&, int64_t);

// The adapters' terms of one linear (index 0-3 of the layer: qkv, o, gate_up, down), added to
// `out` in place; `first` points to the linear's lora_a among the layer's LoRA tensors.
void add_lora(at::Tensor& out, const at::Tensor& x, const at::Tensor* first, int64_t slices,
              const at::Tensor& token_slots, int64_t rank) {
  static const auto op = typed_op<LoRABgmv>("raylm::lora_bgmv");
  std::vector<at::Tensor> b(first + 1, first + 1 + slices);
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (const at::Tensor& piece : b) {
    offsets.push_back(offset);
    offset += piece.size(1);
  }
  op.call(out, x, *first, b, offsets, token_slots, rank);
}

std::tuple<at::Tensor, at::Tensor> llama_decode_layers(
    at::Tensor& hidden_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cos_sin_cache,
    const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_size, int64_t rotary_dim, double eps, double scale,
    double residual_multiplier, bool post_norms, at::IntArrayRef sliding_windows,
    const std::optional<at::Tensor>& lora_token_slots, at::TensorList lora_tensors, int64_t lora_rank) {
  const int64_t num_layers = static_cast<int64_t>(tensors.size()) / kTensorsPerLayer;
  const bool lora = lora_token_slots.has_value();
  TORCH_CHECK(!lora || static_cast<int64_t>(lora_tensors.size()) == num_layers * kLoRATensorsPerLayer,
              "raylm::llama_decode_layers takes ", kLoRATensorsPerLayer, " LoRA tensors per layer, got ",
              lora_tensors.size());
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(tensors.size()) == num_layers * kTensorsPerLayer &&
                  static_cast<int64_t>(ints.size()) == num_layers * kIntsPerLayer &&
                  static_cast<int64_t>(sliding_windows.size()) == num_layers,
              "raylm::llama_decode_layers takes ", kTensorsPerLayer, " tensors, ", kIntsPerLayer,
              " ints and one sliding window per layer, got ", tensors.size(), ", ", ints.size(), " and ",
              sliding_windows.size());
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.is_contiguous(), "raylm::llama_decode_layers takes hidden [T, H]");
  const Ops& op = ops();
  const int64_t T = hidden_in.size(0);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  const bool scale_blocks = residual_multiplier != 1.0;
  at::Tensor hidden = hidden_in, residual;
  std::optional<at::Tensor> slots[kTensorsPerLayer];
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t t0 = layer * kTensorsPerLayer;
    const int64_t* kinds = ints.data() + layer * kIntsPerLayer;
    for (int64_t i = 0; i < kTensorsPerLayer; ++i) slots[i] = tensors.get(t0 + i);
    for (int64_t i : {0, 1, 2, 4, 6, 8, 10, 11}) {
      TORCH_CHECK(slots[i].has_value(), "raylm::llama_decode_layers: tensors[", t0 + i, "] must not be None");
    }
    TORCH_CHECK(slots[12].has_value() == slots[13].has_value(),
                "raylm::llama_decode_layers: a layer's q and k norm weights are both given or both None");
    // Attention block.
    if (post_norms) {
      if (layer > 0) hidden = hidden + residual;
      residual = hidden;
    } else if (layer == 0) {
      residual = hidden;
      hidden = op.rms_norm.call(hidden, *slots[0], eps);
    } else {
      op.fused_add_rms_norm.call(hidden, residual, *slots[0], eps);
    }
    const at::Tensor* lora_layer = lora ? lora_tensors.data() + layer * kLoRATensorsPerLayer : nullptr;
    at::Tensor qkv = linear(kinds[0], hidden, *slots[2], kinds[1], slots[3]);
    if (lora) add_lora(qkv, hidden, lora_layer, kLoRASlices[0], *lora_token_slots, lora_rank);
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    if (slots[12].has_value()) {
      q = norm_rows(q, *slots[12], eps);
      k = norm_rows(k, *slots[13], eps);
      op.rotary.call(q, positions, cos_sin_cache, head_size, rotary_dim);
      op.rotary.call(k, positions, cos_sin_cache, head_size, rotary_dim);
    } else {
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size);  // one call for both
      op.rotary.call(qk, positions, cos_sin_cache, head_size, rotary_dim);
    }
    q = q.view({T, num_heads, head_size});
    k = k.view({T, num_kv_heads, head_size});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_size});
    at::Tensor& k_cache = *slots[10];
    at::Tensor& v_cache = *slots[11];
    op.write_kv_cache.call(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor attn = op.decode_attention.call(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                sliding_windows[layer], 0.0, 1.0, 1.0, c10::nullopt);
    const at::Tensor attn_rows = attn.reshape({T, q_size});
    hidden = linear(kinds[2], attn_rows, *slots[4], kinds[3], slots[5]);
    if (lora) add_lora(hidden, attn_rows, lora_layer + 4, kLoRASlices[1], *lora_token_slots, lora_rank);
    if (scale_blocks) hidden.mul_(residual_multiplier);
    // MLP block.
    if (post_norms) {
      hidden = residual + op.rms_norm.call(hidden, *slots[0], eps);
      residual = hidden;
    } else {
      op.fused_add_rms_norm.call(hidden, residual, *slots[1], eps);
    }
    at::Tensor activation;
    if (kinds[4] == kAvx512SiluMul || kinds[4] == kAvx2SiluMul) {
      TORCH_CHECK(!lora, "raylm::llama_decode_layers: gate_up_proj's gated kernel cannot take a LoRA term");
      activation = gated_linear(kinds[4], hidden, *slots[6], kinds[5]);
    } else {
      at::Tensor gate_up = linear(kinds[4], hidden, *slots[6], kinds[5], slots[7]);
      if (lora) add_lora(gate_up, hidden, lora_layer + 6, kLoRASlices[2], *lora_token_slots, lora_rank);
      activation = op.silu_and_mul.call(gate_up);
    }
    hidden = linear(kinds[6], activation, *slots[8], kinds[7], slots[9]);
    if (lora) add_lora(hidden, activation, lora_layer + 9, kLoRASlices[3], *lora_token_slots, lora_rank);
    if (scale_blocks) hidden.mul_(residual_multiplier);
    if (post_norms) hidden = op.rms_norm.call(hidden, *slots[1], eps);
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylm, m) {
  m.def("llama_decode_layers(Tensor(a!) hidden, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor cos_sin_cache, Tensor?[] tensors, int[] ints, int num_heads, int num_kv_heads, "
        "int head_size, int rotary_dim, float eps, float scale, float residual_multiplier, bool post_norms, "
        "int[] sliding_windows, "
        "Tensor? lora_token_slots, Tensor[] lora_tensors, int lora_rank) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("llama_decode_layers", &llama_decode_layers); }
// oneDNN's packed fp32 weights are MkldnnCPU tensors; among the op's tensors they select that key.
TORCH_LIBRARY_IMPL(raylm, MkldnnCPU, m) { m.impl("llama_decode_layers", &llama_decode_layers); }
