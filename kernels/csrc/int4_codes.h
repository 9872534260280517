// GPTQ / AWQ packed integer codes widened in registers: what the int4 linear kernel
// (cpu_int4_linear.cpp) and the int4 MoE experts' dequantization (cpu_int4_experts.cpp) share.
//
// A word is an int32 of 32 / bits codes, code i in bits [bits i, bits (i + 1)). A vwords holds
// kVecWidth words (cpu_vec.h: 16 with AVX-512, 8 with AVX2 + FMA, 1 in the scalar fallback),
// one per lane; codes_at takes the same code of every lane's word (a shift known at compile
// time), codes_shifted each lane's own code (a shift per lane).

#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cpu_vec.h"

namespace raylm::int4 {

#if RAYLM_AVX512
using vwords = __m512i;
inline vwords load_words(const int32_t* p) { return _mm512_loadu_si512(p); }
// Lane l: base[offsets[l]] (gather_words, gather_floats).
inline vwords gather_words(const int32_t* base, vwords offsets) { return _mm512_i32gather_epi32(offsets, base, 4); }
inline vwords broadcast_word(int32_t w) { return _mm512_set1_epi32(w); }
inline vfloat gather_floats(const float* base, vwords offsets) { return _mm512_i32gather_ps(offsets, base, 4); }
template <int kShift, int kMask>
inline vfloat codes_at(vwords w) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, kShift), _mm512_set1_epi32(kMask)));
}
inline vfloat codes_shifted(vwords w, vwords shifts, int32_t mask) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shifts), _mm512_set1_epi32(mask)));
}
#elif RAYLM_AVX2
using vwords = __m256i;
inline vwords load_words(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vwords gather_words(const int32_t* base, vwords offsets) { return _mm256_i32gather_epi32(base, offsets, 4); }
inline vwords broadcast_word(int32_t w) { return _mm256_set1_epi32(w); }
inline vfloat gather_floats(const float* base, vwords offsets) { return _mm256_i32gather_ps(base, offsets, 4); }
template <int kShift, int kMask>
inline vfloat codes_at(vwords w) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, kShift), _mm256_set1_epi32(kMask)));
}
inline vfloat codes_shifted(vwords w, vwords shifts, int32_t mask) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), _mm256_set1_epi32(mask)));
}
#else
using vwords = uint32_t;
inline vwords load_words(const int32_t* p) { return static_cast<uint32_t>(*p); }
inline vwords gather_words(const int32_t* base, vwords offsets) {
  return static_cast<uint32_t>(base[static_cast<int32_t>(offsets)]);
}
inline vwords broadcast_word(int32_t w) { return static_cast<uint32_t>(w); }
inline vfloat gather_floats(const float* base, vwords offsets) { return base[static_cast<int32_t>(offsets)]; }
template <int kShift, int kMask>
inline vfloat codes_at(vwords w) {
  return static_cast<float>((w >> kShift) & kMask);
}
inline vfloat codes_shifted(vwords w, vwords shifts, int32_t mask) {
  return static_cast<float>(static_cast<int32_t>((w >> shifts) & static_cast<uint32_t>(mask)));
}
#endif

// Calls f(std::integral_constant<int, 0>), ..., f(std::integral_constant<int, N - 1>): the
// code index as a compile-time constant, so every shift is an immediate.
template <int N, typename F, int I = 0>
inline void for_each_code(F&& f) {
  if constexpr (I < N) {
    f(std::integral_constant<int, I>{});
    for_each_code<N, F, I + 1>(std::forward<F>(f));
  }
}

}  // namespace raylm::int4
