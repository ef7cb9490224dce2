/* ninefold CPU kernels: row-wise operators of a prefill step (many rows), one pass per row on all
 * OpenMP threads: add + rms_norm, silu(gate) * up, neox rope. Inputs float32 or bf16 (flag), rounded
 * at the same points as ninefold.ops' vendor formulas (bf16: the sum, silu and the product each). */
#include "nf_cpu.h"

#include <omp.h>

static inline float nf_round(float v, int64_t bf16) { return bf16 ? nf_bf16_to_float(nf_float_to_bf16(v)) : v; }

#if NF_VNNI
/* 16 values from element i of a float32 or bf16 row, as float32 */
static inline __m512 ld16(const void *p, int64_t i, int64_t bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* v rounded to bf16 (nearest even; finite values), kept as float32 */
static inline __m512 rnd16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline void st16(void *p, int64_t i, __m512 v, int64_t bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    __m512i b = _mm512_srli_epi32(_mm512_castps_si512(rnd16(v)), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(b));
}
#elif NF_AVX2
/* the same for 8 values */
static inline __m256 ld8(const void *p, int64_t i, int64_t bf16) {
    return bf16 ? nf_ld8_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline __m256 rnd8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void st8(void *p, int64_t i, __m256 v, int64_t bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m256i b = _mm256_srli_epi32(_mm256_castps_si256(rnd8(v)), 16); /* 0 .. 65535: packus keeps them */
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif

/* total = x + residual (rounded to the dtype), out = total * rsqrt(mean(total^2) + eps) * w. */
void nf_add_rms_norm(const void *x, int64_t sx, const void *r, int64_t sr, const float *w, int64_t rows, int64_t d,
                     double eps, int64_t bf16, void *out, void *total) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
#if NF_VNNI
        if (d % 16 == 0) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < d; j += 16) {
                __m512 t = _mm512_add_ps(ld16(x, i * sx + j, bf16), ld16(r, i * sr + j, bf16));
                if (bf16) t = rnd16(t);
                st16(total, i * d + j, t, bf16);
                acc = _mm512_fmadd_ps(t, t, acc);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + (float)eps));
            for (int64_t j = 0; j < d; j += 16)
                st16(out, i * d + j, _mm512_mul_ps(_mm512_mul_ps(ld16(total, i * d + j, bf16), inv), _mm512_loadu_ps(w + j)),
                     bf16);
            continue;
        }
#elif NF_AVX2
        if (d % 8 == 0) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < d; j += 8) {
                __m256 t = _mm256_add_ps(ld8(x, i * sx + j, bf16), ld8(r, i * sr + j, bf16));
                if (bf16) t = rnd8(t);
                st8(total, i * d + j, t, bf16);
                acc = _mm256_fmadd_ps(t, t, acc);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(nf_hsum8(acc) / (float)d + (float)eps));
            for (int64_t j = 0; j < d; j += 8)
                st8(out, i * d + j, _mm256_mul_ps(_mm256_mul_ps(ld8(total, i * d + j, bf16), inv), _mm256_loadu_ps(w + j)),
                    bf16);
            continue;
        }
#endif
        float ss = 0.0f;
        for (int64_t j = 0; j < d; j++) {
            const float t = nf_round(nf_load(x, i * sx + j, bf16) + nf_load(r, i * sr + j, bf16), bf16);
            nf_store(total, i * d + j, t, bf16);
            ss += t * t;
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + (float)eps);
        for (int64_t j = 0; j < d; j++) nf_store(out, i * d + j, nf_load(total, i * d + j, bf16) * inv * w[j], bf16);
    }
}

/* out[i, j] = silu(x[i, j]) * x[i, d + j] for rows of 2 d values (row stride sx). */
void nf_silu_and_mul(const void *x, int64_t sx, int64_t rows, int64_t d, int64_t bf16, void *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        int64_t j = 0;
#if NF_VNNI
        for (; j + 16 <= d; j += 16) {
            const __m512 gv = ld16(x, i * sx + j, bf16);
            const __m512 e = nf_exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            if (bf16) sv = rnd16(sv);
            st16(out, i * d + j, _mm512_mul_ps(sv, ld16(x, i * sx + d + j, bf16)), bf16);
        }
#elif NF_AVX2
        for (; j + 8 <= d; j += 8) {
            const __m256 gv = ld8(x, i * sx + j, bf16);
            const __m256 e = nf_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            if (bf16) sv = rnd8(sv);
            st8(out, i * d + j, _mm256_mul_ps(sv, ld8(x, i * sx + d + j, bf16)), bf16);
        }
#endif
        for (; j < d; j++) {
            const float g = nf_load(x, i * sx + j, bf16), u = nf_load(x, i * sx + d + j, bf16);
            nf_store(out, i * d + j, nf_round(g / (1.0f + expf(-g)), bf16) * u, bf16);
        }
    }
}

/* Neox rope of the first rot features of every head of q [T, hq, hd] and k [T, hk, hd] (token strides
 * sq, sk; heads contiguous) at positions[t]: new contiguous qo, ko. */
void nf_rope_neox(const void *q, int64_t sq, const void *k, int64_t sk, const int64_t *positions,
                  const float *cos_sin, int64_t rot, int64_t tokens, int64_t hq, int64_t hk, int64_t hd, int64_t bf16,
                  void *qo, void *ko) {
    const int64_t half = rot / 2;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < tokens * (hq + hk); task++) {
        const int64_t t = task / (hq + hk), h = task % (hq + hk);
        const void *src = h < hq ? q : k;
        void *dst = h < hq ? qo : ko;
        const int64_t hh = h < hq ? h : h - hq, nh = h < hq ? hq : hk;
        const int64_t in = t * (h < hq ? sq : sk) + hh * hd, o = (t * nh + hh) * hd;
        const float *cs = cos_sin + positions[t] * rot;
        int64_t j = 0;
#if NF_VNNI
        for (; j + 16 <= half; j += 16) {
            const __m512 x1 = ld16(src, in + j, bf16), x2 = ld16(src, in + half + j, bf16);
            const __m512 c = _mm512_loadu_ps(cs + j), sn = _mm512_loadu_ps(cs + half + j);
            st16(dst, o + j, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, sn)), bf16);
            st16(dst, o + half + j, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, sn)), bf16);
        }
#elif NF_AVX2
        for (; j + 8 <= half; j += 8) {
            const __m256 x1 = ld8(src, in + j, bf16), x2 = ld8(src, in + half + j, bf16);
            const __m256 c = _mm256_loadu_ps(cs + j), sn = _mm256_loadu_ps(cs + half + j);
            st8(dst, o + j, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, sn)), bf16);
            st8(dst, o + half + j, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, sn)), bf16);
        }
#endif
        for (; j < half; j++) {
            const float x1 = nf_load(src, in + j, bf16), x2 = nf_load(src, in + half + j, bf16);
            nf_store(dst, o + j, x1 * cs[j] - x2 * cs[half + j], bf16);
            nf_store(dst, o + half + j, x2 * cs[j] + x1 * cs[half + j], bf16);
        }
        for (int64_t j = rot; j < hd; j++) nf_store(dst, o + j, nf_load(src, in + j, bf16), bf16);
    }
}
