/* ninefold CPU kernels: shared types and inline pieces (quantized blocks, int8 activations).
 *
 * Weight layout ("blocks", made at load by ninefold.ops.quantized.BlockWeight): rows in groups of 16;
 * for each group, for each block of 32 columns, one record:
 *   4-bit: 256 bytes of codes, then 16 fp16 scales d, then 16 fp16 offsets m   (320 bytes)
 *          byte (p, r, j) at 64 p + 4 r + j holds column 4 p + j of row r in its low nibble and
 *          column 16 + 4 p + j in its high nibble (p < 4, r < 16, j < 4)
 *   8-bit: 512 bytes of codes + 128, then 16 fp16 scales d                       (544 bytes)
 *          byte (s, r, j) at 64 s + 4 r + j holds column 4 s + j of row r (s < 8)
 *   4-bit levels: the 4-bit codes' 256 bytes, then 16 fp16 scales d              (288 bytes)
 *          the code indexes a table of 16 int8 levels (GGUF's IQ4_NL/IQ4_XS): value = d * levels[code]
 *   5-bit: the low 4 bits as the 4-bit codes (256 bytes), then 64 bytes of fifth bits, then 16 fp16 scales d and
 *          16 fp16 offsets m (384 bytes); bit s of byte 256 + 4 r + j is the fifth bit of column 4 s + j of row r
 * A weight value is d * code + m (8-bit: m = -128 d, so d * (code - 128) = d * gguf_code).
 * Activations are quantized per row and block of 32: q = round(x / dx) in [-127, 127] with
 * dx = max|x| / 127, and xs = dx * sum(q) (what the offsets multiply).
 * With 16 rows in a group, one AVX-512 VNNI instruction (vpdpbusd) multiplies 4 columns of 16 rows
 * by the same 4 activations: the 16 lanes are the 16 rows' partial sums.
 */
#ifndef NF_CPU_H
#define NF_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Instruction tiers: AVX-512 VNNI (NF_VNNI), else AVX2 with FMA and F16C (NF_AVX2: vpmaddubsw sums two
 * u8 x s8 products per 16-bit lane, so 8 rows of a group share one 256-bit register), else portable C. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define NF_VNNI 1
#define NF_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NF_VNNI 0
#define NF_AVX2 1
#include <immintrin.h>
#else
#define NF_VNNI 0
#define NF_AVX2 0
#endif

#define NF_ROWS 16  /* rows per group */
#define NF_BLOCK 32 /* columns per block */
#define NF_MC 8     /* activation rows per pass of a group */

typedef struct {
    const uint8_t *data;   /* the block records */
    int64_t n, k, bits;    /* rows (before padding), columns, 4 or 8 */
    const float *bias;     /* [n] or NULL */
    int64_t lead;          /* with bits 8: the first `lead` rows (a multiple of 16) are lead_bits records, stored first */
    const int8_t *levels;  /* with bits 4: NULL (codes are affine), or the 16 levels the codes index */
    int64_t lead_bits;     /* 4 or 5: the affine records of the lead rows */
} nf_mat;

/* The kind of a group's records, what nf_group specializes on: affine 4-bit, affine 5-bit, 8-bit, 4-bit levels. */
#define NF_KIND_4 4
#define NF_KIND_5 5
#define NF_KIND_8 8
#define NF_KIND_L4 3

static inline int64_t nf_record_bytes(int kind) {
    return kind == NF_KIND_4 ? 320 : kind == NF_KIND_5 ? 384 : kind == NF_KIND_8 ? 544 : 288;
}

/* Where a record's 16 fp16 scales start (the offsets, for affine kinds, follow them). */
static inline int64_t nf_scales_at(int kind) { return kind == NF_KIND_8 ? 512 : kind == NF_KIND_5 ? 320 : 256; }

/* Records with offsets m (affine codes): 4- and 5-bit. */
static inline int nf_affine(int kind) { return kind == NF_KIND_4 || kind == NF_KIND_5; }
static inline int64_t nf_groups(const nf_mat *w) { return (w->n + NF_ROWS - 1) / NF_ROWS; }

static inline float nf_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float nf_bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t nf_float_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element i of a row stored as float32 (bf16 == 0) or bfloat16 (bf16 == 1). */
static inline float nf_load(const void *p, int64_t i, int64_t bf16) {
    return bf16 ? nf_bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void nf_store(void *p, int64_t i, float v, int64_t bf16) {
    if (bf16) ((uint16_t *)p)[i] = nf_float_to_bf16(v);
    else ((float *)p)[i] = v;
}

#if NF_VNNI
/* exp(x) for x <= ~88, relative error ~2e-7: 2^n * e^r with |r| <= ln2/2, degree-6 polynomial. */
static inline __m512 nf_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if NF_AVX2
static inline float nf_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float nf_hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t nf_hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* exp(x) for x in [-87, 88], the same reduction and polynomial as nf_exp512; 2^n built in the exponent bits. */
static inline __m256 nf_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 bfloat16 values as float32 */
static inline __m256 nf_ld8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Lanes at or past `valid` (< 8) of a row of 8: all ones where kept. */
static inline __m256 nf_lanes_below(int64_t valid) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), iota));
}
#endif

#if NF_AVX2
/* The signed 8-bit codes of 4-column slice sl (columns 4 sl .. 4 sl + 3) of rows 8 h .. 8 h + 7 of a record:
 * 8-bit records store code + 128; level records (NF_KIND_L4) hold 4-bit indices into `lut`, slices 0-3 in the low
 * nibbles of bytes 64 sl .., slices 4-7 in the high nibbles of bytes 64 (sl - 4) ... */
static inline __m256i nf_signed_slice(const uint8_t *blk, int kind, int h, int sl, __m256i lut) {
    if (kind == NF_KIND_L4) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (sl % 4) + 32 * h));
        return _mm256_shuffle_epi8(lut, _mm256_and_si256(sl < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)));
    }
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * sl + 32 * h)), _mm256_set1_epi8((char)0x80));
}
#endif

#if NF_AVX2
/* The unsigned codes (4- or 5-bit affine records) of slice sl of rows 8 h .. 8 h + 7, placed as nf_signed_slice's. */
static inline __m256i nf_affine_slice(const uint8_t *blk, int kind, int h, int sl) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * (sl % 4) + 32 * h));
    __m256i c = _mm256_and_si256(sl < 4 ? v : _mm256_srli_epi16(v, 4), low);
    if (kind == NF_KIND_5) { /* bit sl of each byte of the fifth-bit plane, moved to bit 4 */
        __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * h));
        hb = sl <= 4 ? _mm256_slli_epi16(hb, 4 - sl) : _mm256_srli_epi16(hb, sl - 4);
        c = _mm256_or_si256(c, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
    }
    return c;
}
#endif

/* Quantize 32 float32 values to int8 q; returns dx, writes dx * sum(q) to *xs. */
static inline float nf_quantize_block(const float *x, int8_t *q, float *xs) {
#if NF_VNNI
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    float dx = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
    *xs = dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    return dx;
#elif NF_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    float amax = nf_hmax8(mx);
    float dx = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    /* packs interleave the 128-bit lanes: the permute puts the 32 bytes back in order */
    __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    q16 = _mm256_permutevar8x32_epi32(q16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, q16);
    *xs = dx * (float)nf_hsum8i(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
    return dx;
#else
    float amax = 0.0f;
    for (int i = 0; i < NF_BLOCK; i++) amax = fmaxf(amax, fabsf(x[i]));
    float dx = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < NF_BLOCK; i++) {
        int v = (int)nearbyintf(x[i] * inv);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[i] = (int8_t)v;
        sum += v;
    }
    *xs = dx * (float)sum;
    return dx;
#endif
}

/* Quantize one row of k float32 values (k a multiple of 32). */
static inline void nf_quantize_row(const float *x, int64_t k, int8_t *q, float *xd, float *xs) {
    for (int64_t b = 0; b < k / NF_BLOCK; b++) xd[b] = nf_quantize_block(x + b * NF_BLOCK, q + b * NF_BLOCK, xs + b);
}

/* One group (16 rows) against mc <= NF_MC quantized activation rows: out[i][r] (+)= sum over blocks. */
/* kind: NF_KIND_4, NF_KIND_5, NF_KIND_8 or NF_KIND_L4 (then `levels` holds the 16 int8 levels). */
static inline __attribute__((always_inline)) void nf_group(const uint8_t *wg, int64_t nb, const int kind,
                                                           const int8_t *levels, const int8_t *xq, const float *xd,
                                                           const float *xs, int64_t k, const int mc,
                                                           float acc_out[][NF_ROWS]) {
#if NF_VNNI
    const int bits = kind == NF_KIND_8 ? 8 : 4;
    __m512 acc[NF_MC];
    for (int i = 0; i < mc; i++) acc[i] = _mm512_setzero_ps();
    const int64_t rec = nf_record_bytes(kind);
    /* the levels + 128 as unsigned bytes, in every 128-bit lane: a byte shuffle maps codes to 8-bit codes */
    const __m512i lut = kind == NF_KIND_L4
        ? _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)levels), _mm_set1_epi8((char)0x80)))
        : _mm512_setzero_si512();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * rec;
        __m512i w[8];
        __m512 d, m;
        if (bits == 4) {
            const __m512i low = _mm512_set1_epi8(0x0F);
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * p));
                w[p] = _mm512_and_si512(v, low);
                w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (kind == NF_KIND_5) { /* bit s of each byte of the fifth-bit plane: bit 4 of w[s]'s byte */
                const __m512i hb = _mm512_loadu_si512((const void *)(blk + 256)), bit4 = _mm512_set1_epi8(0x10);
                for (int sl = 0; sl < 8; sl++) {
                    __m512i hi = sl <= 4 ? _mm512_slli_epi16(hb, 4 - sl) : _mm512_srli_epi16(hb, sl - 4);
                    w[sl] = _mm512_or_si512(w[sl], _mm512_and_si512(hi, bit4));
                }
            }
            const int64_t at = nf_scales_at(kind);
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + at)));
            if (kind == NF_KIND_L4) {
                for (int p = 0; p < 8; p++) w[p] = _mm512_shuffle_epi8(lut, w[p]);
                m = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
            } else {
                m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + at + 32)));
            }
        } else {
            for (int s = 0; s < 8; s++) w[s] = _mm512_loadu_si512((const void *)(blk + 64 * s));
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512)));
            m = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
        }
        for (int i = 0; i < mc; i++) {
            const int8_t *xb = xq + i * k + b * NF_BLOCK;
            int32_t x4[8];
            memcpy(x4, xb, 32);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(x4[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(x4[1]));
            s0 = _mm512_dpbusd_epi32(s0, w[2], _mm512_set1_epi32(x4[2]));
            s1 = _mm512_dpbusd_epi32(s1, w[3], _mm512_set1_epi32(x4[3]));
            s0 = _mm512_dpbusd_epi32(s0, w[4], _mm512_set1_epi32(x4[4]));
            s1 = _mm512_dpbusd_epi32(s1, w[5], _mm512_set1_epi32(x4[5]));
            s0 = _mm512_dpbusd_epi32(s0, w[6], _mm512_set1_epi32(x4[6]));
            s1 = _mm512_dpbusd_epi32(s1, w[7], _mm512_set1_epi32(x4[7]));
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            const int64_t nbx = k / NF_BLOCK;
            acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nbx + b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * nbx + b]), acc[i]);
        }
    }
    for (int i = 0; i < mc; i++) _mm512_storeu_ps(acc_out[i], acc[i]);
#elif NF_AVX2
    /* h = 0, 1: rows 8 h .. 8 h + 7, the 32-byte half of each 64-byte record slice */
    __m256 acc[NF_MC][2];
    for (int i = 0; i < mc; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const int64_t rec = nf_record_bytes(kind), nbx = k / NF_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lut = kind == NF_KIND_L4 ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)levels))
                                           : _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * rec;
        const uint8_t *scales = blk + nf_scales_at(kind);
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * h)));
            m[h] = nf_affine(kind) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 + 16 * h)))
                                   : _mm256_setzero_ps();
        }
        /* Signed codes (8-bit, levels): each weight w enters as |w| (u8) times x with w's sign, every pair sum
         * within 16 bits. With several activation rows, |w| and w of each 4-column slice are made once per block. */
        __m256i wmag[2][8], wsgn[2][8]; /* affine kinds: the unsigned codes in wmag */
        if (mc > 1) {
            for (int h = 0; h < 2; h++) {
                for (int sl = 0; sl < 8; sl++) {
                    if (nf_affine(kind)) {
                        wmag[h][sl] = nf_affine_slice(blk, kind, h, sl);
                    } else {
                        wsgn[h][sl] = nf_signed_slice(blk, kind, h, sl, lut);
                        wmag[h][sl] = _mm256_sign_epi8(wsgn[h][sl], wsgn[h][sl]);
                    }
                }
            }
        }
        for (int i = 0; i < mc; i++) {
            int32_t x4[8];
            memcpy(x4, xq + i * k + b * NF_BLOCK, 32);
            for (int h = 0; h < 2; h++) {
                __m256i dot;
                if (!nf_affine(kind)) {
                    dot = _mm256_setzero_si256();
                    for (int sl = 0; sl < 8; sl++) {
                        __m256i w = mc > 1 ? wsgn[h][sl] : nf_signed_slice(blk, kind, h, sl, lut);
                        __m256i mag = mc > 1 ? wmag[h][sl] : _mm256_sign_epi8(w, w);
                        __m256i pr = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(_mm256_set1_epi32(x4[sl]), w));
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pr, ones));
                    }
                } else {
                    /* |code x| <= 15 * 127 (4-bit): eight pair sums fit a 16-bit lane; 31 * 127 (5-bit): four */
                    __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
                    for (int p = 0; p < 4; p++) { /* slices p (columns 4 p + j) and p + 4 (16 + 4 p + j) */
                        __m256i lo = mc > 1 ? wmag[h][p] : nf_affine_slice(blk, kind, h, p);
                        __m256i hi = mc > 1 ? wmag[h][p + 4] : nf_affine_slice(blk, kind, h, p + 4);
                        t0 = _mm256_add_epi16(t0, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[p])));
                        t1 = _mm256_add_epi16(t1, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[p + 4])));
                    }
                    dot = kind == NF_KIND_5 ? _mm256_add_epi32(_mm256_madd_epi16(t0, ones), _mm256_madd_epi16(t1, ones))
                                            : _mm256_madd_epi16(_mm256_add_epi16(t0, t1), ones);
                }
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[h], _mm256_set1_ps(xd[i * nbx + b])),
                                            acc[i][h]);
                if (nf_affine(kind)) acc[i][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(xs[i * nbx + b]), acc[i][h]);
            }
        }
    }
    for (int i = 0; i < mc; i++) {
        _mm256_storeu_ps(acc_out[i], acc[i][0]);
        _mm256_storeu_ps(acc_out[i] + 8, acc[i][1]);
    }
#else
    const int bits = kind == NF_KIND_8 ? 8 : 4;
    const int64_t rec = nf_record_bytes(kind), nbx = k / NF_BLOCK;
    for (int i = 0; i < mc; i++)
        for (int r = 0; r < NF_ROWS; r++) acc_out[i][r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * rec;
        const uint16_t *dh = (const uint16_t *)(blk + nf_scales_at(kind));
        for (int r = 0; r < NF_ROWS; r++) {
            uint8_t code[NF_BLOCK];
            for (int c = 0; c < NF_BLOCK; c++) {
                if (bits == 4) {
                    int p = (c % 16) / 4, j = c % 4;
                    uint8_t byte = blk[64 * p + 4 * r + j];
                    code[c] = c < 16 ? (byte & 0x0F) : (byte >> 4);
                    if (kind == NF_KIND_5) code[c] |= ((blk[256 + 4 * r + c % 4] >> (c / 4)) & 1) << 4;
                    if (kind == NF_KIND_L4) code[c] = (uint8_t)(levels[code[c]] + 128);
                } else {
                    code[c] = blk[64 * (c / 4) + 4 * r + c % 4];
                }
            }
            float d = nf_half_to_float(dh[r]);
            float m = nf_affine(kind) ? nf_half_to_float(dh[NF_ROWS + r]) : -128.0f * d;
            for (int i = 0; i < mc; i++) {
                const int8_t *xb = xq + i * k + b * NF_BLOCK;
                int32_t dot = 0;
                for (int c = 0; c < NF_BLOCK; c++) dot += (int32_t)code[c] * xb[c];
                acc_out[i][r] += (float)dot * (d * xd[i * nbx + b]) + m * xs[i * nbx + b];
            }
        }
    }
#endif
}

/* Rows [g * 16, g * 16 + 16) of y = W xq (m activation rows; y row stride ldy, float32) for one group.
 * accumulate: y += result instead of y = result. The bias, if any, is added. */
static inline void nf_gemm_group(const nf_mat *w, int64_t g, const int8_t *xq, const float *xd, const float *xs,
                                 int64_t m, float *y, int64_t ldy, int accumulate) {
    const int64_t nb = w->k / NF_BLOCK, lead_groups = w->lead / NF_ROWS;
    const int tail = w->bits == 8 ? NF_KIND_8 : w->bits == 5 ? NF_KIND_5 : w->levels ? NF_KIND_L4 : NF_KIND_4;
    const int head = w->lead_bits == 5 ? NF_KIND_5 : NF_KIND_4;
    const int kind = g < lead_groups ? head : tail;
    const uint8_t *wg = g < lead_groups ? w->data + g * nb * nf_record_bytes(head)
                                        : w->data + lead_groups * nb * nf_record_bytes(head)
                                              + (g - lead_groups) * nb * nf_record_bytes(tail);
    const int64_t r0 = g * NF_ROWS, rows = w->n - r0 < NF_ROWS ? w->n - r0 : NF_ROWS;
    float acc[NF_MC][NF_ROWS];
    for (int64_t i0 = 0; i0 < m; i0 += NF_MC) {
        const int64_t mc = m - i0 < NF_MC ? m - i0 : NF_MC;
        const int8_t *xq0 = xq + i0 * w->k;
        const float *xd0 = xd + i0 * nb, *xs0 = xs + i0 * nb;
#define NF_CASE(K, MC) case MC: nf_group(wg, nb, K, w->levels, xq0, xd0, xs0, w->k, MC, acc); break;
        if (kind == NF_KIND_4) {
            switch (mc) { NF_CASE(NF_KIND_4, 1) NF_CASE(NF_KIND_4, 2) NF_CASE(NF_KIND_4, 3) NF_CASE(NF_KIND_4, 4)
                          NF_CASE(NF_KIND_4, 5) NF_CASE(NF_KIND_4, 6) NF_CASE(NF_KIND_4, 7) NF_CASE(NF_KIND_4, 8) }
        } else if (kind == NF_KIND_5) {
            switch (mc) { NF_CASE(NF_KIND_5, 1) NF_CASE(NF_KIND_5, 2) NF_CASE(NF_KIND_5, 3) NF_CASE(NF_KIND_5, 4)
                          NF_CASE(NF_KIND_5, 5) NF_CASE(NF_KIND_5, 6) NF_CASE(NF_KIND_5, 7) NF_CASE(NF_KIND_5, 8) }
        } else if (kind == NF_KIND_L4) {
            switch (mc) { NF_CASE(NF_KIND_L4, 1) NF_CASE(NF_KIND_L4, 2) NF_CASE(NF_KIND_L4, 3) NF_CASE(NF_KIND_L4, 4)
                          NF_CASE(NF_KIND_L4, 5) NF_CASE(NF_KIND_L4, 6) NF_CASE(NF_KIND_L4, 7) NF_CASE(NF_KIND_L4, 8) }
        } else {
            switch (mc) { NF_CASE(NF_KIND_8, 1) NF_CASE(NF_KIND_8, 2) NF_CASE(NF_KIND_8, 3) NF_CASE(NF_KIND_8, 4)
                          NF_CASE(NF_KIND_8, 5) NF_CASE(NF_KIND_8, 6) NF_CASE(NF_KIND_8, 7) NF_CASE(NF_KIND_8, 8) }
        }
#undef NF_CASE
        for (int64_t i = 0; i < mc; i++) {
            float *yr = y + (i0 + i) * ldy + r0;
            for (int64_t r = 0; r < rows; r++) {
                float v = acc[i][r] + (w->bias ? w->bias[r0 + r] : 0.0f);
                yr[r] = accumulate ? yr[r] + v : v;
            }
        }
    }
}

#endif
