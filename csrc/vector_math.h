#pragma once
// Vector helpers the AVX2/FMA and AVX-512 paths of several ops share.
#include "cpu_features.h"

namespace specengine {

#ifdef SPECENGINE_X86
SPECENGINE_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for x <= 0 (logits minus their max over a temperature; attention scores minus theirs):
// Cephes' expf polynomial on x - n ln2 with n = round(x log2 e), scaled by 2^n through the
// exponent bits; within 2 ulp of std::exp. Below -87.3 (where float leaves its normal range) and at -inf it gives 0.
SPECENGINE_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3365447f);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

// The same operations lane for lane on 16 lanes, so its results equal the 256-bit version's bit for bit.
SPECENGINE_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.3365447f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(p, _mm512_castsi512_ps(scale)));
}

// v[i] = lane i of each of v[0..15] in turn (the 16 x 16 transpose): pairs of rows interleaved,
// then pairs of pairs, then 128-bit quarters twice.
SPECENGINE_AVX512 inline void transpose16x16(__m512 (&v)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    v[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    v[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    v[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_f32x4(v[8 * i + c], v[8 * i + 4 + c], _MM_SHUFFLE(2, 0, 2, 0));
      t[8 * i + 4 + c] = _mm512_shuffle_f32x4(v[8 * i + c], v[8 * i + 4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    }
  for (int c = 0; c < 8; ++c) {
    v[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], _MM_SHUFFLE(2, 0, 2, 0));
    v[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// v[i] = lane i of each of v[0..7] in turn (the 8 x 8 transpose).
SPECENGINE_AVX2 inline void transpose8x8(__m256 (&v)[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    v[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

#endif

}  // namespace specengine
