/* ninefold CPU kernels: building the block records of nf_cpu.h at load time, on all OpenMP threads.
 *
 * The torch reference of both is in ninefold/ops/quantized.py (_pack_blocks_torch, requantize_q8's torch path);
 * the tests check these against it byte for byte. */
#include "nf_cpu.h"

#include <omp.h>

/* Below this many blocks or records the work stays on the calling thread: waking the team costs more (a few
 * looked-up embedding rows each step). */
#define NF_PARALLEL_MIN 256

/* Records of an [n, k] weight (k a multiple of 32) into out (groups of 16 rows, padded rows zero).
 * kind NF_KIND_8: codes int8, stored + 128; NF_KIND_4 / NF_KIND_L4: codes uint8 in [0, 15], two per byte;
 * NF_KIND_5: codes uint8 in [0, 31], their low 4 bits as NF_KIND_4's and the fifth bits in a plane of their own.
 * scales and offsets (NF_KIND_4 and NF_KIND_5; else NULL) are float16 bit patterns [n, k / 32]. */
void nf_pack_blocks(const uint8_t *codes, const uint16_t *scales, const uint16_t *offsets, int64_t n, int64_t k,
                    int64_t kind, uint8_t *out) {
    const int64_t nb = k / NF_BLOCK, groups = (n + NF_ROWS - 1) / NF_ROWS, rec = nf_record_bytes((int)kind);
#pragma omp parallel for schedule(static) if (groups * nb >= NF_PARALLEL_MIN)
    for (int64_t t = 0; t < groups * nb; t++) {
        const int64_t g = t / nb, b = t % nb;
        uint8_t *r = out + t * rec;
        memset(r, 0, (size_t)rec);
        uint16_t *d = (uint16_t *)(r + nf_scales_at((int)kind)), *m = d + NF_ROWS;
        for (int64_t row = 0; row < NF_ROWS && g * NF_ROWS + row < n; row++) {
            const int64_t src = g * NF_ROWS + row;
            const uint8_t *c = codes + src * k + b * NF_BLOCK;
            if (kind == NF_KIND_8) { /* byte (s, row, j) at 64 s + 4 row + j: column 4 s + j */
                for (int s = 0; s < 8; s++)
                    for (int j = 0; j < 4; j++) r[64 * s + 4 * row + j] = (uint8_t)(c[4 * s + j] + 128);
            } else { /* byte (p, row, j): column 4 p + j in the low nibble, 16 + 4 p + j in the high one */
                for (int p = 0; p < 4; p++)
                    for (int j = 0; j < 4; j++)
                        r[64 * p + 4 * row + j] = (uint8_t)((c[4 * p + j] & 15) | ((c[16 + 4 * p + j] & 15) << 4));
                if (kind == NF_KIND_5) /* bit s of byte 256 + 4 row + j: the fifth bit of column 4 s + j */
                    for (int col = 0; col < NF_BLOCK; col++)
                        r[256 + 4 * row + col % 4] |= (uint8_t)(((c[col] >> 4) & 1) << (col / 4));
            }
            d[row] = scales[src * nb + b];
            if (nf_affine((int)kind)) m[row] = offsets[src * nb + b];
        }
    }
}

/* f rounded to the nearest float16 value (ties to even), as a float; beyond float16's range: +-inf. */
static inline float nf_round_to_half(float f) {
#if NF_VNNI || NF_AVX2
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    const float a = fabsf(f);
    if (!(a < 65520.0f)) return a != a ? f : copysignf(INFINITY, f); /* 65520 and up round past 65504 */
    if (a < 6.103515625e-05f) return nearbyintf(f * 16777216.0f) / 16777216.0f; /* subnormal: steps of 2^-24 */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0xFFFu + ((bits >> 13) & 1u); /* keep 10 of the 23 mantissa bits, ties to even */
    bits &= ~0x1FFFu;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Per block of 32 values of w (float32 [n, k]): scale = max|w| / 127 rounded to float16 (scales, float32
 * [n, k / 32]), codes = round(w / scale) clamped to [-127, 127], ties to even as torch.round; a zero block gives
 * a zero scale and zero codes. */
static inline void nf_q8_block(const float *w, float *scale, int8_t *codes) {
    float amax = 0.0f;
    for (int i = 0; i < NF_BLOCK; i++) amax = fmaxf(amax, fabsf(w[i]));
    *scale = nf_round_to_half(amax / 127.0f);
    const float s = *scale > 0 ? *scale : 1.0f;
    for (int i = 0; i < NF_BLOCK; i++) {
        float q = nearbyintf(w[i] / s);
        codes[i] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
    }
}

void nf_requantize_q8(const float *w, int64_t n, int64_t k, float *scales, int8_t *codes) {
    const int64_t blocks = n * (k / NF_BLOCK);
#pragma omp parallel for schedule(static) if (blocks >= NF_PARALLEL_MIN)
    for (int64_t b = 0; b < blocks; b++) nf_q8_block(w + b * NF_BLOCK, scales + b, codes + b * NF_BLOCK);
}

/* GGUF Q6_K blocks (210 bytes: ql[128], qh[64], int8 scales[16], fp16 d) -> float32 values, 256 per block:
 * value = d * (scale * q) with q the 6-bit code minus 32 (each product exact in float32), as ggml decodes them. */
static inline void nf_q6_k_block(const uint8_t *blk, float *y) {
    const int8_t *sc = (const int8_t *)(blk + 192);
    uint16_t dh;
    memcpy(&dh, blk + 208, 2);
    const float d = nf_half_to_float(dh);
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
        const int8_t *s = sc + 8 * half;
        float *yh = y + 128 * half;
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            yh[l] = d * (float)(s[is] * q1);
            yh[l + 32] = d * (float)(s[is + 2] * q2);
            yh[l + 64] = d * (float)(s[is + 4] * q3);
            yh[l + 96] = d * (float)(s[is + 6] * q4);
        }
    }
}

void nf_dequantize_q6_k(const uint8_t *blocks, int64_t n_blocks, float *out) {
#pragma omp parallel for schedule(static) if (n_blocks >= NF_PARALLEL_MIN)
    for (int64_t b = 0; b < n_blocks; b++) nf_q6_k_block(blocks + b * 210, out + b * 256);
}

/* Q6_K blocks straight to 8-bit codes and scales (nf_requantize_q8 of their decoded values, without the float
 * copy of the whole matrix): 8 scales and 256 codes per block. */
void nf_requantize_q6_k(const uint8_t *blocks, int64_t n_blocks, float *scales, int8_t *codes) {
#pragma omp parallel for schedule(static) if (n_blocks >= NF_PARALLEL_MIN)
    for (int64_t b = 0; b < n_blocks; b++) {
        float y[256];
        nf_q6_k_block(blocks + b * 210, y);
        for (int j = 0; j < 8; j++) nf_q8_block(y + 32 * j, scales + 8 * b + j, codes + 256 * b + 32 * j);
    }
}

/* GGUF Q4_K blocks (144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) as
 * 4-bit codes (uint8 [256] per block, in value order) with per-32 scales d * sc and offsets -(dmin * m) (float32,
 * each product exact): value = code * scale + offset, as ggml decodes them. */
void nf_q4_k_codes(const uint8_t *blocks, int64_t n_blocks, uint8_t *codes, float *scales, float *offsets) {
#pragma omp parallel for schedule(static) if (n_blocks >= NF_PARALLEL_MIN)
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *blk = blocks + b * 144, *q = blk + 4, *qs = blk + 16;
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        const float d = nf_half_to_float(dh), dmin = nf_half_to_float(mh);
        for (int j = 0; j < 8; j++) { /* scale and min j: 6 bits each, the top two bits of 4-7 beside 0-3's */
            const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
            const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
            scales[b * 8 + j] = d * (float)sc;
            offsets[b * 8 + j] = -(dmin * (float)mn);
        }
        uint8_t *c = codes + b * 256;
        for (int i = 0; i < 4; i++) /* 32 bytes per 64 values: low nibbles first, then high ones */
            for (int l = 0; l < 32; l++) {
                c[64 * i + l] = qs[32 * i + l] & 15;
                c[64 * i + 32 + l] = qs[32 * i + l] >> 4;
            }
    }
}
