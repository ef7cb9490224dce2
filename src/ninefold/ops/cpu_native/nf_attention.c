/* ninefold CPU kernels: causal attention over packed sequences (prefill without a paged cache).
 *
 * For each sequence, query row i of Lq attends keys 0 .. i + (Lk - Lq) of Lk (bottom-right aligned,
 * as ops.attention_prefill specifies), GQA by query-head groups. First the keys become float32 tiles
 * of 16 keys transposed ([d][16]: one FMA multiplies a query value by 16 keys) and the values float32
 * rows, once per (sequence, KV head); then one task per (sequence, KV head, tile of NF_QT query rows)
 * runs an online softmax over the key tiles for each of its query rows and heads. */
#include "nf_cpu.h"

#include <omp.h>

#define NF_QT 32 /* query rows per task */

/* Float32 scratch for the keys and values of all sequences (each padded to 16 keys). */
int64_t nf_attention_scratch_floats(const int64_t *cu_k, int64_t nseq, int64_t hk, int64_t hd) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++) n += (cu_k[s + 1] - cu_k[s] + 15) / 16 * 16;
    return n * hk * hd * 2 + 64;
}

static int64_t tiles_of(int64_t lq) { return (lq + NF_QT - 1) / NF_QT; }

void nf_attention_prefill(const void *q, int64_t sq, const void *k, int64_t sk, const void *v, int64_t sv,
                          int64_t bf16, const int64_t *cu_q, const int64_t *cu_k, int64_t nseq, int64_t hq,
                          int64_t hk, int64_t hd, double scale, void *out, int64_t so, float *scratch) {
    const int64_t group = hq / hk;
    int64_t tasks = 0;
    for (int64_t s = 0; s < nseq; s++) tasks += hk * tiles_of(cu_q[s + 1] - cu_q[s]);
#pragma omp parallel
    {
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
                    float m = -INFINITY, l = 0.0f;
                    for (int64_t t = 0; t * 16 <= limit; t++) {
                        const float *kb = kt + t * hd * 16;
                        const int64_t valid = limit - t * 16 + 1 < 16 ? limit - t * 16 + 1 : 16;
                        float p[16];
#if NF_VNNI
                        __m512 s4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                        for (int64_t d = 0; d < hd; d += 4) /* four independent chains: FMA latency, not one long chain */
                            for (int c = 0; c < 4; c++)
                                s4[c] = _mm512_fmadd_ps(_mm512_set1_ps(qf[d + c]), _mm512_loadu_ps(kb + (d + c) * 16), s4[c]);
                        __m512 sc = _mm512_add_ps(_mm512_add_ps(s4[0], s4[1]), _mm512_add_ps(s4[2], s4[3]));
                        if (valid < 16) sc = _mm512_mask_mov_ps(sc, (__mmask16)(0xFFFFu << valid), _mm512_set1_ps(-INFINITY));
                        const float mt = _mm512_reduce_max_ps(sc), mnew = mt > m ? mt : m;
                        const __m512 pe = nf_exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mnew)));
                        _mm512_storeu_ps(p, pe);
                        const float corr = expf(m - mnew);
                        l = l * corr + _mm512_reduce_add_ps(pe);
                        if (hd % 64 == 0) { /* values: keys outer, four 16-wide head chunks inner (independent) */
                            const __m512 cv = _mm512_set1_ps(corr);
                            for (int64_t d = 0; d < hd; d += 64) {
                                __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(o + d), cv);
                                __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(o + d + 16), cv);
                                __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(o + d + 32), cv);
                                __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(o + d + 48), cv);
                                for (int64_t jj = 0; jj < valid; jj++) {
                                    const __m512 pj = _mm512_set1_ps(p[jj]);
                                    const float *vr = vf + (t * 16 + jj) * hd + d;
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
                            m = mnew;
                            continue;
                        }
#else
                        float mt = -INFINITY;
                        for (int64_t jj = 0; jj < 16; jj++) {
                            float acc = 0.0f;
                            for (int64_t d = 0; d < hd; d++) acc += qf[d] * kb[d * 16 + jj];
                            p[jj] = jj < valid ? acc : -INFINITY;
                            mt = p[jj] > mt ? p[jj] : mt;
                        }
                        const float mnew = mt > m ? mt : m, corr = expf(m - mnew);
                        float sum = 0.0f;
                        for (int64_t jj = 0; jj < 16; jj++) {
                            p[jj] = jj < valid ? expf(p[jj] - mnew) : 0.0f;
                            sum += p[jj];
                        }
                        l = l * corr + sum;
#endif
                        for (int64_t d = 0; d < hd; d++) o[d] *= corr;
                        for (int64_t jj = 0; jj < valid; jj++)
                            for (int64_t d = 0; d < hd; d++) o[d] += p[jj] * vf[(t * 16 + jj) * hd + d];
                        m = mnew;
                    }
                    const float inv = 1.0f / l;
                    for (int64_t d = 0; d < hd; d++) nf_store(out, (cu_q[s] + i) * so + h * hd + d, o[d] * inv, bf16);
                }
            }
        }
    }
}
