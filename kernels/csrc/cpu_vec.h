// Small vector helpers shared by the native CPU kernels: AVX2 + FMA where the compiler
// targets them (-march=native, narrowed by RAYLM_CPU_ISA: see native_build.py), scalar forms
// for the fallbacks; and, at the end, `vfloat`, one vector type of whatever width the target
// has, for kernels written once for all. bf16 tensors are `uint16_t` here: loads widen them
// to fp32 with a shift, stores round to nearest even as PyTorch does. fp8 KV caches are
// `fp8_e4m3` / `fp8_e5m2`: loads widen them to fp32 exactly (see below).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RAYLM_AVX2 1
#else
#define RAYLM_AVX2 0
#endif

#if defined(__AVX512F__) && RAYLM_AVX2  // immintrin.h is included above
#define RAYLM_AVX512 1
#else
#define RAYLM_AVX512 0
#endif

namespace raylm {

// exp(x) for x <= 0 (scores minus their running max), written without calls or branches so
// the loop around it vectorizes (no memcpy either): Cephes' expf, 2^n built from the
// exponent bits.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * two_n;
}

// 2^x for x <= 0, 0 below -126 (no subnormals, which are slow to multiply): a degree-5
// polynomial for 2^f, f in [-1/2, 1/2] (relative error 8e-8, about fp32's rounding), scaled
// by 2^n from the exponent bits. Cheaper than exp_nonpositive; for softmaxes whose scores
// are already in log2 units.
constexpr float kExp2Coefficients[6] = {1.0000000710f, 0.69314694916f, 0.24022121754f, 0.055507426160f,
                                        0.0096754597455f, 0.0013266970386f};

inline float exp2_nonpositive(float x) {
  const bool underflow = x < -126.0f;
  x = underflow ? -126.0f : x;
  const float n = std::floor(x + 0.5f);
  const float f = x - n;
  float p = kExp2Coefficients[5];
  for (int i = 4; i >= 0; --i) p = p * f + kExp2Coefficients[i];
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * two_n;
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// One byte of an fp8 KV cache, a type per format so that templates over the cache's element
// pick the conversion: E4M3 as torch.float8_e4m3fn (bias 7, no infinities, 0x7F and 0xFF are
// NaN, largest 448) and E5M2 as torch.float8_e5m2 (bias 15, the high byte of an fp16, with
// its infinities and NaNs). Every fp8 value is an fp32 value, so each load is exact: the
// subnormals included, without fp32 subnormals (which DAZ would flush, and which are slow
// to multiply), NaN codes NaN, as PyTorch's conversions give them.
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;

inline float to_float(fp8_e4m3 x) {
  const uint32_t magnitude = x.bits & 0x7Fu, exponent = magnitude >> 3, mantissa = magnitude & 7u;
  float value = exponent == 0 ? static_cast<float>(mantissa) * 0x1p-9f  // subnormal: m/8 * 2^-6
                              : __builtin_bit_cast(float, (exponent + 120u) << 23 | mantissa << 20);
  if (magnitude == 0x7Fu) value = std::numeric_limits<float>::quiet_NaN();
  return x.bits & 0x80u ? -value : value;
}

inline float to_float(fp8_e5m2 x) {
  const uint32_t magnitude = x.bits & 0x7Fu, exponent = magnitude >> 2, mantissa = magnitude & 3u;
  float value = exponent == 0 ? static_cast<float>(mantissa) * 0x1p-16f  // subnormal: m/4 * 2^-14
                              : __builtin_bit_cast(float, (exponent + 112u) << 23 | mantissa << 21);
  if (exponent == 31) value = mantissa == 0 ? std::numeric_limits<float>::infinity()
                                            : std::numeric_limits<float>::quiet_NaN();
  return x.bits & 0x80u ? -value : value;
}

// fp32 -> bf16 bits, rounded to nearest even; any NaN becomes 0x7FC0 (c10::BFloat16's rule).
inline uint16_t to_bf16(float x) {
  if (x != x) return 0x7FC0;
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// *p = x in p's type.
inline void store_scalar(float* p, float x) { *p = x; }
inline void store_scalar(uint16_t* p, float x) { *p = to_bf16(x); }

#if RAYLM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32: the bf16 bits are the high half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// fp8 -> fp32 through fp16, which F16C widens in hardware (fp16 subnormals included, DAZ or
// not). E5M2 is the high byte of an fp16. E4M3's bits, sign-extended to 16 and shifted left by
// 7, put its sign at fp16's sign (and at bit 14, cleared) and its 7 exponent and mantissa bits
// under fp16's (a 5-bit exponent of bias 15 against 4 bits of bias 7): value / 2^8 for normals
// and subnormals alike, times 256 exact. The NaN code's 7 bits, all ones, carry into bit 14
// when 0x80 is added: that bit, or-ed in, makes the fp16 exponent 31, a NaN.
#if defined(__F16C__)
inline __m256 fp8_to_fp32x8(__m128i bytes, fp8_e5m2) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}

inline __m256 fp8_to_fp32x8(__m128i bytes, fp8_e4m3) {
  const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                     _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m128i nan_bit = _mm_and_si128(_mm_add_epi16(half, _mm_set1_epi16(0x80)), _mm_set1_epi16(0x4000));
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(half, nan_bit)), _mm256_set1_ps(256.0f));
}

template <typename fp8_t, std::enable_if_t<kIsFp8<fp8_t>, int> = 0>
inline __m256 load8(const fp8_t* p) {
  return fp8_to_fp32x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), fp8_t{});
}
#else
template <typename fp8_t, std::enable_if_t<kIsFp8<fp8_t>, int> = 0>
inline __m256 load8(const fp8_t* p) {
  return _mm256_setr_ps(to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3]), to_float(p[4]),
                        to_float(p[5]), to_float(p[6]), to_float(p[7]));
}
#endif

// Lane j of the result is the sum of the 8 lanes of a[j].
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  // Low 128 bits: partial sums of a0..a3 (resp. a4..a7) over lanes 0-3; high: over 4-7.
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// exp(x) on 8 lanes, Cephes' expf as exp_nonpositive below; inputs beyond +-87 are clamped
// there (exp(87) ~ 6e37), which the callers (softmax weights, SiLU) do not notice.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// exp(x) for x <= 0, 0 below -87 (as exp_nonpositive).
inline __m256 exp8_nonpositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, exp8(x));
}

// All lanes below `count` set.
inline __m256 lanes_below(int count) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

inline float max8(__m256 v) {
  const __m128 quad = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}

inline float sum8(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// 8 fp32 -> 8 bf16 at p, rounded as to_bf16, with integer ops (AVX2 has no bf16 instructions).
inline void store8(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // packus works within 128-bit halves: the 4 + 4 results land in 64-bit lanes 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// vfloat: 16 fp32 lanes with AVX-512, 8 with AVX2 + FMA, one (a plain float) elsewhere;
// kVecWidth says which. The ops mirror the intrinsics they wrap.
#if RAYLM_AVX512
constexpr int kVecWidth = 16;
using vfloat = __m512;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const uint16_t* p) {  // 16 bf16 -> 16 fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// 16 fp8 -> 16 fp32, as load8 (AVX-512 implies F16C).
inline vfloat vload(const fp8_e5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
}
inline vfloat vload(const fp8_e4m3* p) {
  const __m256i half = _mm256_and_si256(
      _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7),
      _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m256i nan_bit = _mm256_and_si256(_mm256_add_epi16(half, _mm256_set1_epi16(0x80)), _mm256_set1_epi16(0x4000));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(half, nan_bit)), _mm512_set1_ps(256.0f));
}
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
#if defined(__AVX512BF16__)
// One instruction, rounding to nearest even like to_bf16 (it flushes fp32 subnormals, below
// 1.2e-38, to zero, where to_bf16 keeps them).
inline void vstore(uint16_t* p, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#else
inline void vstore(uint16_t* p, vfloat v) {  // as store8, 16 lanes
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
#endif
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
// 1 / x to about fp32 precision: the 14-bit estimate and one Newton step, several times the
// throughput of a division.
inline vfloat vreciprocal(vfloat x) {
  const __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
}
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vmax_all(vfloat v) { return _mm512_reduce_max_ps(v); }
inline vfloat vneg_abs(vfloat x) {  // -|x|: the sign bit set
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}
// Lane by lane, a > b ? if_greater : otherwise.
inline vfloat vselect_greater(vfloat a, vfloat b, vfloat if_greater, vfloat otherwise) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), otherwise, if_greater);
}
// 2^x for x <= 0, 0 below -126, as exp2_nonpositive.
inline vfloat vexp2_nonpositive(vfloat x) {
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Coefficients[5]);
  for (int i = 4; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Coefficients[i]));
  return _mm512_maskz_scalef_ps(in_range, p, n);
}
#elif RAYLM_AVX2
constexpr int kVecWidth = 8;
using vfloat = __m256;
inline vfloat vload(const float* p) { return load8(p); }
inline vfloat vload(const uint16_t* p) { return load8(p); }
inline vfloat vload(const fp8_e4m3* p) { return load8(p); }
inline vfloat vload(const fp8_e5m2* p) { return load8(p); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline void vstore(uint16_t* p, vfloat v) { store8(p, v); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vreciprocal(vfloat x) {  // the 12-bit estimate and one Newton step: ~23 bits
  const __m256 r = _mm256_rcp_ps(x);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.0f)));
}
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline float vsum(vfloat v) { return sum8(v); }
inline float vmax_all(vfloat v) { return max8(v); }
inline vfloat vneg_abs(vfloat x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
inline vfloat vselect_greater(vfloat a, vfloat b, vfloat if_greater, vfloat otherwise) {
  return _mm256_blendv_ps(otherwise, if_greater, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
}
inline vfloat vexp2_nonpositive(vfloat x) {
  const __m256 in_range = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Coefficients[5]);
  for (int i = 4; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Coefficients[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(in_range, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
#else
constexpr int kVecWidth = 1;
using vfloat = float;
inline vfloat vload(const float* p) { return *p; }
inline vfloat vload(const uint16_t* p) { return to_float(*p); }
inline vfloat vload(const fp8_e4m3* p) { return to_float(*p); }
inline vfloat vload(const fp8_e5m2* p) { return to_float(*p); }
inline void vstore(float* p, vfloat v) { *p = v; }
inline void vstore(uint16_t* p, vfloat v) { *p = to_bf16(v); }
inline vfloat vset1(float x) { return x; }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return a * b + c; }
inline vfloat vadd(vfloat a, vfloat b) { return a + b; }
inline vfloat vsub(vfloat a, vfloat b) { return a - b; }
inline vfloat vmul(vfloat a, vfloat b) { return a * b; }
inline vfloat vreciprocal(vfloat x) { return 1.0f / x; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
inline float vsum(vfloat v) { return v; }
inline float vmax_all(vfloat v) { return v; }
inline vfloat vneg_abs(vfloat x) { return -std::fabs(x); }
inline vfloat vselect_greater(vfloat a, vfloat b, vfloat if_greater, vfloat otherwise) {
  return a > b ? if_greater : otherwise;
}
inline vfloat vexp2_nonpositive(vfloat x) { return exp2_nonpositive(x); }
#endif

// silu(x) = x * sigmoid(x), with e = exp(-|x|) <= 1 so nothing overflows: sigmoid is
// 1 / (1 + e) for x >= 0 and e / (1 + e) below. Shared by silu_and_mul (cpu_ops.cpp) and the
// AVX-512 GEMM's fused epilogue (cpu_gemm_avx512.cpp), which must agree bit for bit.
inline vfloat vsilu(vfloat x) {
  const vfloat e = vexp2_nonpositive(vmul(vneg_abs(x), vset1(1.44269504088896341f)));
  const vfloat inv = vreciprocal(vadd(vset1(1.0f), e));
  return vmul(x, vselect_greater(vset1(0.0f), x, vmul(e, inv), inv));
}

// cap * tanh(x / cap), Gemma 2's attention soft cap, with e = exp(-2|x| / cap) <= 1 so nothing
// overflows: tanh(|y|) = (1 - e) / (1 + e), the sign put back. Within ~1e-7 * cap of std::tanh.
inline vfloat vsoft_cap(vfloat x, float cap) {
  const vfloat e = vexp2_nonpositive(vmul(vneg_abs(x), vset1(2.0f * 1.44269504088896341f / cap)));
  const vfloat magnitude = vmul(vset1(cap), vmul(vsub(vset1(1.0f), e), vreciprocal(vadd(vset1(1.0f), e))));
  return vselect_greater(vset1(0.0f), x, vsub(vset1(0.0f), magnitude), magnitude);
}

// scores[0:n] = cap * tanh(scores / cap) in place.
inline void soft_cap_in_place(float* scores, int64_t n, float cap) {
  int64_t t = 0;
  for (; t + kVecWidth <= n; t += kVecWidth) vstore(scores + t, vsoft_cap(vload(scores + t), cap));
  for (; t < n; ++t) scores[t] = cap * std::tanh(scores[t] / cap);
}

}  // namespace raylm
