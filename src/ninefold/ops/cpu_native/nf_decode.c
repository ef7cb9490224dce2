/* ninefold CPU kernels: one decode step (one new token per sequence) of a Llama-architecture model,
 * every layer in one OpenMP region: rms_norm -> int8 activations -> qkv GEMM -> (q/k norm) -> rope ->
 * KV-cache write -> attention over the paged cache -> o GEMM (+ residual) -> rms_norm -> gate_up GEMM
 * -> silu * up -> down GEMM (+ residual). The residual stream stays float32 between layers.
 * Formulas as ninefold.llm.models.llama's generic forward (neox rope over the whole head, GQA).
 * With LoRA adapters (md->lora_slots), each row's adapter adds (x @ A) @ B to a projection: every thread
 * computes the small x @ A of all rows for itself, and the program computing a group of outputs adds their
 * share of the up-projection right after it, so the adapters cost no barrier. */
#include "nf_cpu.h"

#include <omp.h>

/* One projection's LoRA slots (bfloat16), slot by slot: a [slots, k, r], b [slots, ceil(n / 16), r, 16] (the
 * 16 outputs of a kernel group contiguous for every rank). r 0: no adapter changes this projection. */
typedef struct {
    const uint16_t *a, *b;
    int64_t r;
} nf_lora;

typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* float32; q_norm / k_norm NULL when absent */
    nf_mat qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [blocks, block_size, hk, hd], float32 or bf16 */
    nf_lora lqkv, lo, lgate_up, ldown;
} nf_layer;

typedef struct {
    int64_t n_layers, dim, hq, hk, hd, inter, block_size, table_stride, cache_bf16, io_bf16;
    double eps, scale;
    const nf_layer *layers;
    const void *embed;       /* [vocab, dim] in the io dtype */
    const float *final_norm; /* [dim] */
    const float *cos_sin;    /* [positions, hd]: cos in the first half, sin in the second */
    int64_t m, max_ctx;      /* this step: sequences, longest context */
    const int64_t *ids, *positions, *slots;
    const int32_t *block_tables, *context_lens; /* [m, table_stride], [m] */
    void *out;                                  /* [m, dim] in the io dtype */
    void *scratch;                              /* nf_decode_scratch_bytes(model) bytes */
    int64_t threads;                            /* this step's OpenMP threads (<= 0: the runtime's default) */
    const int64_t *lora_slots;                  /* [m]: each row's adapter slot, -1 none; NULL: no adapters */
    int64_t lora_r;                             /* the widest nf_lora.r of any projection */
} nf_model;

static int64_t kmax(const nf_model *md) {
    int64_t k = md->dim > md->inter ? md->dim : md->inter;
    return k > md->hq * md->hd ? k : md->hq * md->hd;
}

/* Per thread: its own int8 copy of a normed row block (m rows of dim) or, for m <= NF_PRIVATE_SILU,
 * of silu(gate) * up (m rows of inter), so no barrier separates them from the GEMM that reads them. */
#define NF_PRIVATE_SILU 2
static int64_t private_bytes(const nf_model *md) {
    const int64_t k = md->dim > md->inter ? md->dim : md->inter;
    const int64_t lora = md->lora_slots ? md->m * md->lora_r * 4 : 0;
    return (md->m * k + 4 + 2 * md->m * (k / NF_BLOCK) * 4 + md->dim * 4 + lora + 63) / 64 * 64;
}

/* Where this thread keeps x @ A of every row: after its row buffer. */
static float *lora_down_buffer(const nf_model *md, char *priv) {
    const int64_t k = md->dim > md->inter ? md->dim : md->inter;
    return (float *)(priv + (md->m * k + 4 + 2 * md->m * (k / NF_BLOCK) * 4 + md->dim * 4 + 3) / 4 * 4);
}

static int lora_on(const nf_model *md, const nf_lora *lr) { return md->lora_slots && lr->r; }

/* down[0 .. r) = x @ A of slot `slot` (x has k values); four inputs per pass over down. */
static void lora_down(const nf_lora *lr, const float *restrict x, int64_t k, int64_t slot, float *restrict down) {
    const int64_t r = lr->r, w = r;
    for (int64_t j = 0; j < r; j++) down[j] = 0.0f;
    if (slot < 0) return;
    const uint16_t *restrict a = lr->a + slot * k * r;
    int64_t c = 0;
    for (; c + 4 <= k; c += 4) {
        const float x0 = x[c], x1 = x[c + 1], x2 = x[c + 2], x3 = x[c + 3];
        const uint16_t *restrict a0 = a + c * w, *restrict a1 = a0 + w, *restrict a2 = a1 + w, *restrict a3 = a2 + w;
        for (int64_t j = 0; j < r; j++)
            down[j] += x0 * nf_bf16_to_float(a0[j]) + x1 * nf_bf16_to_float(a1[j]) + x2 * nf_bf16_to_float(a2[j]) + x3 * nf_bf16_to_float(a3[j]);
    }
    for (; c < k; c++)
        for (int64_t j = 0; j < r; j++) down[j] += x[c] * nf_bf16_to_float(a[c * w + j]);
}

/* y[i, r0 .. r0 + rows) += down_i @ B of row i's slot, for every row (n: B's columns, the projection's outputs). */
static void lora_up(const nf_model *md, const nf_lora *lr, const float *down, int64_t n, int64_t g, float *y,
                    int64_t ldy) {
    const int64_t r0 = g * NF_ROWS, rows = n - r0 < NF_ROWS ? n - r0 : NF_ROWS;
    for (int64_t i = 0; i < md->m; i++) {
        const int64_t slot = md->lora_slots[i];
        if (slot < 0) continue;
        float acc[NF_ROWS] = {0};
        const float *d = down + i * md->lora_r;
        const uint16_t *b = lr->b + (slot * ((n + NF_ROWS - 1) / NF_ROWS) + g) * lr->r * NF_ROWS;
        for (int64_t j = 0; j < lr->r; j++) /* (a tile's padding past n is zero) */
            for (int64_t c = 0; c < NF_ROWS; c++) acc[c] += d[j] * nf_bf16_to_float(b[j * NF_ROWS + c]);
        float *yi = y + i * ldy + r0;
        for (int64_t c = 0; c < rows; c++) yi[c] += acc[c];
    }
}

int64_t nf_decode_scratch_bytes(const nf_model *md) {
    const int64_t m = md->m, nqkv = (md->hq + 2 * md->hk) * md->hd, k = kmax(md);
    const int64_t floats = m * (md->dim + nqkv + md->hq * md->hd + 2 * md->inter + md->hq * md->max_ctx)
                           + 2 * m * (k / NF_BLOCK);
    return floats * 4 + m * k + 256 + omp_get_max_threads() * private_bytes(md);
}

static void rms_norm_row(const float *x, const float *w, int64_t n, double eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + (float)eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

static float dot_cache(const float *q, const void *k, int64_t hd, int64_t bf16) {
#if NF_VNNI
    if (hd % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < hd; i += 16) {
            __m512 kv = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + i))), 16))
                             : _mm512_loadu_ps((const float *)k + i);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kv, acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#elif NF_AVX2
    if (hd % 16 == 0) { /* two chains: FMA latency */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int64_t i = 0; i < hd; i += 16) {
            const uint16_t *kh = (const uint16_t *)k + i;
            const float *kf = (const float *)k + i;
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), bf16 ? nf_ld8_bf16(kh) : _mm256_loadu_ps(kf), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), bf16 ? nf_ld8_bf16(kh + 8) : _mm256_loadu_ps(kf + 8), a1);
        }
        return nf_hsum8(_mm256_add_ps(a0, a1));
    }
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < hd; i++) s += q[i] * nf_load(k, i, bf16);
    return s;
}

static void axpy_cache(float a, const void *v, int64_t hd, int64_t bf16, float *o) {
#if NF_VNNI
    if (hd % 16 == 0) {
        const __m512 av = _mm512_set1_ps(a);
        for (int64_t i = 0; i < hd; i += 16) {
            __m512 vv = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                   _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i))), 16))
                             : _mm512_loadu_ps((const float *)v + i);
            _mm512_storeu_ps(o + i, _mm512_fmadd_ps(av, vv, _mm512_loadu_ps(o + i)));
        }
        return;
    }
#elif NF_AVX2
    if (hd % 8 == 0) {
        const __m256 av = _mm256_set1_ps(a);
        for (int64_t i = 0; i < hd; i += 8) {
            __m256 vv = bf16 ? nf_ld8_bf16((const uint16_t *)v + i) : _mm256_loadu_ps((const float *)v + i);
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(av, vv, _mm256_loadu_ps(o + i)));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < hd; i++) o[i] += a * nf_load(v, i, bf16);
}

/* exp(s[i] - max) in place for n scores; returns their sum. */
static float softmax_exp(float *s, int64_t n) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    int64_t t = 0;
#if NF_VNNI
    __m512 acc = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        __m512 e = nf_exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(s + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif NF_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = nf_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = nf_hsum8(acc);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    return sum;
}

/* silu(g) * u for 32 values. */
static void silu_mul_block(const float *g, const float *u, float *out) {
#if NF_VNNI
    for (int i = 0; i < NF_BLOCK; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 e = nf_exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(sig, _mm512_loadu_ps(u + i)));
    }
#elif NF_AVX2
    for (int i = 0; i < NF_BLOCK; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), nf_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
    }
#else
    for (int i = 0; i < NF_BLOCK; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
#endif
}

static void *cache_row(void *cache, int64_t slot, int64_t hk, int64_t g, int64_t hd, int64_t bf16) {
    return (char *)cache + ((slot * hk + g) * hd) * (bf16 ? 2 : 4);
}

/* This thread's int8 rows of rms_norm(h) * w (all m rows: every thread computes them), and with `lr` their x @ A. */
static void norm_quantize_private(const nf_model *md, const float *h, const float *w, const nf_lora *lr, char *priv,
                                  int8_t **xq, float **xd, float **xs) {
    const int64_t m = md->m, dim = md->dim, nb = dim / NF_BLOCK;
    *xq = (int8_t *)priv;
    *xd = (float *)(priv + (m * dim + 3) / 4 * 4);
    *xs = *xd + m * nb;
    float *t = *xs + m * nb;
    for (int64_t i = 0; i < m; i++) {
        rms_norm_row(h + i * dim, w, dim, md->eps, t);
        nf_quantize_row(t, dim, *xq + i * dim, *xd + i * nb, *xs + i * nb);
        if (lora_on(md, lr)) lora_down(lr, t, dim, md->lora_slots[i], lora_down_buffer(md, priv) + i * md->lora_r);
    }
}

/* This thread's x @ A of every row of silu(gate) * up (gu: the gate_up outputs), for the down projection. */
static void silu_lora_down(const nf_model *md, const nf_lora *lr, const float *gu, char *priv) {
    const int64_t inter = md->inter;
    float act[NF_BLOCK];
    float *down = lora_down_buffer(md, priv);
    for (int64_t i = 0; i < md->m; i++) {
        const int64_t slot = md->lora_slots[i];
        float *d = down + i * md->lora_r;
        for (int64_t j = 0; j < lr->r; j++) d[j] = 0.0f;
        if (slot < 0) continue;
        for (int64_t b = 0; b < inter / NF_BLOCK; b++) {
            silu_mul_block(gu + i * 2 * inter + b * NF_BLOCK, gu + i * 2 * inter + inter + b * NF_BLOCK, act);
            for (int64_t c = 0; c < NF_BLOCK; c++) {
                const uint16_t *ac = lr->a + (slot * inter + b * NF_BLOCK + c) * lr->r;
                for (int64_t j = 0; j < lr->r; j++) d[j] += act[c] * nf_bf16_to_float(ac[j]);
            }
        }
    }
}

/* This thread's int8 rows of silu(gate) * up (all m rows). */
static void silu_quantize_private(const nf_model *md, const float *gu, char *priv, int8_t **xq, float **xd,
                                  float **xs) {
    const int64_t m = md->m, inter = md->inter, nb = inter / NF_BLOCK;
    *xq = (int8_t *)priv;
    *xd = (float *)(priv + (m * inter + 3) / 4 * 4);
    *xs = *xd + m * nb;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < nb; b++) {
            float act[NF_BLOCK];
            silu_mul_block(gu + i * 2 * inter + b * NF_BLOCK, gu + i * 2 * inter + inter + b * NF_BLOCK, act);
            (*xd)[i * nb + b] = nf_quantize_block(act, *xq + i * inter + b * NF_BLOCK, *xs + i * nb + b);
        }
    }
}

/* Rotate one head (neox: halves) at position pos, after its optional rms_norm: in -> out (float32). */
static void rope_head(const nf_model *md, const float *in, const float *norm_w, int64_t pos, float *out) {
    const int64_t hd = md->hd, half = hd / 2;
    if (norm_w) rms_norm_row(in, norm_w, hd, md->eps, out);
    else memcpy(out, in, hd * 4);
    const float *cs = md->cos_sin + pos * hd;
    for (int64_t j = 0; j < half; j++) {
        const float x1 = out[j], x2 = out[j + half], c = cs[j], s = cs[half + j];
        out[j] = x1 * c - x2 * s;
        out[j + half] = x2 * c + x1 * s;
    }
}

/* Hidden states after the final norm for one decode step: md->out [m, dim]. A row is one new token at
 * md->positions[i] attending to md->context_lens[i] cached positions (its own included); several rows
 * may belong to one sequence (speculative drafts at consecutive positions).
 * Six barriers per layer (after each GEMM, after the cache writes and after attention; seven for more
 * than NF_PRIVATE_SILU rows): every thread computes the norms (and, for few rows, silu * up) for itself. */
void nf_decode_step(const nf_model *md) {
    const int64_t m = md->m, dim = md->dim, hq = md->hq, hk = md->hk, hd = md->hd, inter = md->inter;
    const int64_t nqkv = (hq + 2 * hk) * hd, group = hq / hk, k = kmax(md);
    const int64_t cb = md->cache_bf16, bs = md->block_size;
    float *h = (float *)md->scratch;
    float *qkv = h + m * dim;
    float *att = qkv + m * nqkv;
    float *gu = att + m * hq * hd;
    float *scores = gu + m * 2 * inter;
    float *xd = scores + m * hq * md->max_ctx;
    float *xs = xd + m * (k / NF_BLOCK);
    int8_t *xq = (int8_t *)(xs + m * (k / NF_BLOCK));
    char *priv_all = (char *)md->scratch + (nf_decode_scratch_bytes(md) - omp_get_max_threads() * private_bytes(md));
    const int nt = md->threads > 0 ? (int)md->threads : omp_get_max_threads();
#pragma omp parallel num_threads(nt)
    {
        char *priv = priv_all + omp_get_thread_num() * private_bytes(md);
        int8_t *pq;
        float *pd, *ps;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < dim; c++) h[i * dim + c] = nf_load(md->embed, md->ids[i] * dim + c, md->io_bf16);
        for (int64_t l = 0; l < md->n_layers; l++) {
            const nf_layer *ly = &md->layers[l];
            float *down = lora_down_buffer(md, priv);
            norm_quantize_private(md, h, ly->in_norm, &ly->lqkv, priv, &pq, &pd, &ps);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < nf_groups(&ly->qkv); g++) {
                nf_gemm_group(&ly->qkv, g, pq, pd, ps, m, qkv, nqkv, 0);
                if (lora_on(md, &ly->lqkv)) lora_up(md, &ly->lqkv, down, nqkv, g, qkv, nqkv);
            }
            /* the new keys (rotated) and values into the cache first: rows of one sequence (speculative
             * drafts) attend to each other's, so every row is cached before any attends */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < m * hk; task++) {
                const int64_t i = task / hk, g = task % hk;
                const float *row = qkv + i * nqkv;
                float knew[512];
                rope_head(md, row + (hq + g) * hd, ly->k_norm, md->positions[i], knew);
                void *kd = cache_row(ly->k_cache, md->slots[i], hk, g, hd, cb);
                void *vd = cache_row(ly->v_cache, md->slots[i], hk, g, hd, cb);
                for (int64_t j = 0; j < hd; j++) {
                    nf_store(kd, j, knew[j], cb);
                    nf_store(vd, j, row[(hq + hk + g) * hd + j], cb);
                }
            }
            /* attention: one task per (sequence, query head); its output is quantized per block at once */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < m * hq; task++) {
                const int64_t i = task / hq, head = task % hq, g = head / group, ctx = md->context_lens[i];
                float q[512];
                rope_head(md, qkv + i * nqkv + head * hd, ly->q_norm, md->positions[i], q);
                const int32_t *table = md->block_tables + i * md->table_stride;
                float *s = scores + task * md->max_ctx, *o = att + i * hq * hd + head * hd;
                for (int64_t p = 0; p < ctx; p++) {
                    const int64_t slot = (int64_t)table[p / bs] * bs + p % bs;
                    s[p] = (float)md->scale * dot_cache(q, cache_row(ly->k_cache, slot, hk, g, hd, cb), hd, cb);
                }
                const float inv = 1.0f / softmax_exp(s, ctx);
                for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
                for (int64_t p = 0; p < ctx; p++) {
                    const int64_t slot = (int64_t)table[p / bs] * bs + p % bs;
                    axpy_cache(s[p] * inv, cache_row(ly->v_cache, slot, hk, g, hd, cb), hd, cb, o);
                }
                const int64_t kk = hq * hd, nb = kk / NF_BLOCK;
                for (int64_t b = head * hd / NF_BLOCK; b < (head + 1) * hd / NF_BLOCK; b++)
                    xd[i * nb + b] = nf_quantize_block(att + i * kk + b * NF_BLOCK, xq + i * kk + b * NF_BLOCK,
                                                       xs + i * nb + b);
            }
            if (lora_on(md, &ly->lo))
                for (int64_t i = 0; i < m; i++)
                    lora_down(&ly->lo, att + i * hq * hd, hq * hd, md->lora_slots[i], down + i * md->lora_r);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < nf_groups(&ly->o); g++) {
                nf_gemm_group(&ly->o, g, xq, xd, xs, m, h, dim, 1);
                if (lora_on(md, &ly->lo)) lora_up(md, &ly->lo, down, dim, g, h, dim);
            }
            norm_quantize_private(md, h, ly->post_norm, &ly->lgate_up, priv, &pq, &pd, &ps);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < nf_groups(&ly->gate_up); g++) {
                nf_gemm_group(&ly->gate_up, g, pq, pd, ps, m, gu, 2 * inter, 0);
                if (lora_on(md, &ly->lgate_up)) lora_up(md, &ly->lgate_up, down, 2 * inter, g, gu, 2 * inter);
            }
            if (lora_on(md, &ly->ldown)) silu_lora_down(md, &ly->ldown, gu, priv);
            if (m <= NF_PRIVATE_SILU) { /* every thread rounds all of silu * up for itself: one barrier less */
                silu_quantize_private(md, gu, priv, &pq, &pd, &ps);
            } else {
#pragma omp for schedule(static)
                for (int64_t task = 0; task < m * (inter / NF_BLOCK); task++) {
                    const int64_t i = task / (inter / NF_BLOCK), b = task % (inter / NF_BLOCK), nb = inter / NF_BLOCK;
                    float act[NF_BLOCK];
                    silu_mul_block(gu + i * 2 * inter + b * NF_BLOCK, gu + i * 2 * inter + inter + b * NF_BLOCK, act);
                    xd[i * nb + b] = nf_quantize_block(act, xq + i * inter + b * NF_BLOCK, xs + i * nb + b);
                }
                pq = xq, pd = xd, ps = xs;
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < nf_groups(&ly->down); g++) {
                nf_gemm_group(&ly->down, g, pq, pd, ps, m, h, dim, 1);
                if (lora_on(md, &ly->ldown)) lora_up(md, &ly->ldown, down, dim, g, h, dim);
            }
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            float *t = (float *)(priv + private_bytes(md)) - dim; /* this thread's row buffer */
            rms_norm_row(h + i * dim, md->final_norm, dim, md->eps, t);
            for (int64_t c = 0; c < dim; c++) nf_store(md->out, i * dim + c, t[c], md->io_bf16);
        }
    }
}
