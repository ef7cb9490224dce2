/* ninefold CPU kernels: causal attention over packed sequences (prefill without a paged cache).
 *
 * For each sequence, query row i of Lq attends keys 0 .. i + (Lk - Lq) of Lk (bottom-right aligned,
 * as ops.attention_prefill specifies), GQA by query-head groups. First the keys become float32 tiles
 * of 16 keys transposed ([d][16]: one FMA multiplies a query value by 16 keys) and the values float32
 * rows, once per (sequence, KV head); then one task per (sequence, KV head, tile of NF_QT query rows)
 * takes each of its query rows and heads in three passes: scores, exp(score - max) with their sum,
 * and the values weighted by them. */
#include "nf_cpu.h"

#include <omp.h>

#define NF_QT 32 /* query rows per task */

static int64_t longest16(const int64_t *cu_k, int64_t nseq) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++) n = cu_k[s + 1] - cu_k[s] > n ? cu_k[s + 1] - cu_k[s] : n;
    return (n + 15) / 16 * 16;
}

static int64_t kv_floats(const int64_t *cu_k, int64_t nseq, int64_t hk, int64_t hd) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++) n += (cu_k[s + 1] - cu_k[s] + 15) / 16 * 16;
    return n * hk * hd * 2;
}

/* Float32 scratch: the keys and values of all sequences (each padded to 16 keys), then one row of
 * scores per thread. */
int64_t nf_attention_scratch_floats(const int64_t *cu_k, int64_t nseq, int64_t hk, int64_t hd) {
    return kv_floats(cu_k, nseq, hk, hd) + omp_get_max_threads() * longest16(cu_k, nseq) + 64;
}

static int64_t tiles_of(int64_t lq) { return (lq + NF_QT - 1) / NF_QT; }

#if NF_AVX2
/* row[j] = exp(q . k_j - max) for the nk visible keys of the transposed tiles (zero past them up to a
 * multiple of 16); returns their sum. Each tile of 16 keys is two registers of 8. */
static float scores_exp8(const float *qf, const float *kt, int64_t hd, int64_t nk, float *row) {
    const int64_t ntile = (nk + 15) / 16;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < ntile; t++) {
        const float *kb = kt + t * hd * 16;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int64_t d = 0; d < hd; d += 2) {
            const __m256 q0 = _mm256_set1_ps(qf[d]), q1 = _mm256_set1_ps(qf[d + 1]);
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kb + d * 16), a0);
            b0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kb + d * 16 + 8), b0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kb + d * 16 + 16), a1);
            b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kb + d * 16 + 24), b1);
        }
        __m256 sc[2] = {_mm256_add_ps(a0, a1), _mm256_add_ps(b0, b1)};
        for (int h = 0; h < 2; h++) {
            const int64_t valid = nk - t * 16 - 8 * h;
            if (valid < 8) sc[h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc[h], nf_lanes_below(valid));
            _mm256_storeu_ps(row + t * 16 + 8 * h, sc[h]);
            mx = _mm256_max_ps(mx, sc[h]);
        }
    }
    const __m256 mv = _mm256_set1_ps(nf_hmax8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < ntile * 16; j += 8) {
        __m256 e = nf_exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
        if (nk - j < 8) e = _mm256_and_ps(e, nf_lanes_below(nk - j));
        _mm256_storeu_ps(row + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return nf_hsum8(sum);
}

/* o[d .. d + 8 n8) = sum over the nk keys of row[j] * v_j: n8 independent accumulators of 8. */
static inline __attribute__((always_inline)) void weigh_values8(const float *row, const float *vf, int64_t nk,
                                                                int64_t hd, int64_t d, float *o, const int n8) {
    __m256 acc[8];
    for (int c = 0; c < n8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        const __m256 pj = _mm256_set1_ps(row[j]);
        for (int c = 0; c < n8; c++) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vf + j * hd + d + 8 * c), acc[c]);
    }
    for (int c = 0; c < n8; c++) _mm256_storeu_ps(o + d + 8 * c, acc[c]);
}
#endif

void nf_attention_prefill(const void *q, int64_t sq, const void *k, int64_t sk, const void *v, int64_t sv,
                          int64_t bf16, const int64_t *cu_q, const int64_t *cu_k, int64_t nseq, int64_t hq,
                          int64_t hk, int64_t hd, double scale, void *out, int64_t so, float *scratch) {
    const int64_t group = hq / hk;
    int64_t tasks = 0;
    for (int64_t s = 0; s < nseq; s++) tasks += hk * tiles_of(cu_q[s + 1] - cu_q[s]);
    float *rows = scratch + kv_floats(cu_k, nseq, hk, hd);
    const int64_t row_len = longest16(cu_k, nseq);
#pragma omp parallel
    {
        float *row = rows + omp_get_thread_num() * row_len;
#pragma omp for schedule(dynamic, 1)
        for (int64_t sg = 0; sg < nseq * hk; sg++) {
            const int64_t s = sg / hk, g = sg % hk, nk = cu_k[s + 1] - cu_k[s], nk16 = (nk + 15) / 16 * 16;
            int64_t base = 0;
            for (int64_t t = 0; t < s; t++) base += (cu_k[t + 1] - cu_k[t] + 15) / 16 * 16 * hk * hd * 2;
            float *kt = scratch + base + g * nk16 * hd * 2, *vf = kt + nk16 * hd;
            for (int64_t j = 0; j < nk16; j++) {
                for (int64_t d = 0; d < hd; d++) {
                    const int in = j < nk;
                    kt[(j / 16) * hd * 16 + d * 16 + j % 16] = in ? nf_load(k, (cu_k[s] + j) * sk + g * hd + d, bf16) : 0.0f;
                    vf[j * hd + d] = in ? nf_load(v, (cu_k[s] + j) * sv + g * hd + d, bf16) : 0.0f;
                }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            /* the task's sequence, KV head and tile: later tiles (more keys) come first in each sequence */
            int64_t s = 0, rest = task;
            for (;;) {
                const int64_t n = hk * tiles_of(cu_q[s + 1] - cu_q[s]);
                if (rest < n) break;
                rest -= n;
                s++;
            }
            const int64_t lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s], shift = lk - lq;
            const int64_t nt = tiles_of(lq), tile = nt - 1 - rest / hk, g = rest % hk;
            const int64_t r0 = tile * NF_QT, r1 = r0 + NF_QT < lq ? r0 + NF_QT : lq, nk16 = (lk + 15) / 16 * 16;
            int64_t base = 0;
            for (int64_t t = 0; t < s; t++) base += (cu_k[t + 1] - cu_k[t] + 15) / 16 * 16 * hk * hd * 2;
            const float *kt = scratch + base + g * nk16 * hd * 2, *vf = kt + nk16 * hd;
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                for (int64_t i = r0; i < r1; i++) {
                    const int64_t limit = i + shift; /* last visible key */
                    float qf[512], o[512];
                    for (int64_t d = 0; d < hd; d++) {
                        qf[d] = nf_load(q, (cu_q[s] + i) * sq + h * hd + d, bf16) * (float)scale;
                        o[d] = 0.0f;
                    }
                    /* three passes over the row's keys: scores, exp(score - max) and their sum, values */
                    const int64_t nk = limit + 1;
                    float l;
#if NF_VNNI
                    const int64_t ntile = (nk + 15) / 16;
                    __m512 mx = _mm512_set1_ps(-INFINITY);
                    for (int64_t t = 0; t < ntile; t++) {
                        const float *kb = kt + t * hd * 16;
                        __m512 s4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                        for (int64_t d = 0; d < hd; d += 4) /* four independent chains: FMA latency, not one long chain */
                            for (int c = 0; c < 4; c++)
                                s4[c] = _mm512_fmadd_ps(_mm512_set1_ps(qf[d + c]), _mm512_loadu_ps(kb + (d + c) * 16), s4[c]);
                        __m512 sc = _mm512_add_ps(_mm512_add_ps(s4[0], s4[1]), _mm512_add_ps(s4[2], s4[3]));
                        const int64_t valid = nk - t * 16;
                        if (valid < 16) sc = _mm512_mask_mov_ps(sc, (__mmask16)(0xFFFFu << valid), _mm512_set1_ps(-INFINITY));
                        _mm512_storeu_ps(row + t * 16, sc);
                        mx = _mm512_max_ps(mx, sc);
                    }
                    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t t = 0; t < ntile; t++) {
                        __m512 e = nf_exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t * 16), mv));
                        const int64_t valid = nk - t * 16;
                        if (valid < 16) e = _mm512_maskz_mov_ps((__mmask16)(0xFFFFu >> (16 - valid)), e);
                        _mm512_storeu_ps(row + t * 16, e);
                        sum = _mm512_add_ps(sum, e);
                    }
                    l = _mm512_reduce_add_ps(sum);
                    if (hd % 64 == 0) { /* four 16-wide head chunks as independent accumulators */
                        for (int64_t d = 0; d < hd; d += 64) {
                            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                            for (int64_t j = 0; j < nk; j++) {
                                const __m512 pj = _mm512_set1_ps(row[j]);
                                const float *vr = vf + j * hd + d;
                                a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr), a0);
                                a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16), a1);
                                a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 32), a2);
                                a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 48), a3);
                            }
                            _mm512_storeu_ps(o + d, a0);
                            _mm512_storeu_ps(o + d + 16, a1);
                            _mm512_storeu_ps(o + d + 32, a2);
                            _mm512_storeu_ps(o + d + 48, a3);
                        }
                    } else {
                        for (int64_t j = 0; j < nk; j++)
                            for (int64_t d = 0; d < hd; d++) o[d] += row[j] * vf[j * hd + d];
                    }
#elif NF_AVX2
                    l = scores_exp8(qf, kt, hd, nk, row);
                    if (hd % 64 == 0)
                        for (int64_t d = 0; d < hd; d += 64) weigh_values8(row, vf, nk, hd, d, o, 8);
                    else
                        for (int64_t d = 0; d < hd; d += 16) weigh_values8(row, vf, nk, hd, d, o, 2);
#else
                    float m = -INFINITY;
                    for (int64_t j = 0; j < nk; j++) {
                        float acc = 0.0f;
                        for (int64_t d = 0; d < hd; d++) acc += qf[d] * kt[(j / 16) * hd * 16 + d * 16 + j % 16];
                        row[j] = acc;
                        m = acc > m ? acc : m;
                    }
                    l = 0.0f;
                    for (int64_t j = 0; j < nk; j++) {
                        row[j] = expf(row[j] - m);
                        l += row[j];
                    }
                    for (int64_t j = 0; j < nk; j++)
                        for (int64_t d = 0; d < hd; d++) o[d] += row[j] * vf[j * hd + d];
#endif
                    const float inv = 1.0f / l;
                    for (int64_t d = 0; d < hd; d++) nf_store(out, (cu_q[s] + i) * so + h * hd + d, o[d] * inv, bf16);
                }
            }
        }
    }
}
