/* ninefold CPU kernels: y = W x on quantized blocks with int8 activations (see nf_cpu.h). */
#include "nf_cpu.h"

#include <omp.h>

/* This build's instruction tier: 2 AVX-512 VNNI, 1 AVX2 (with FMA and F16C), 0 portable C loops. */
int64_t nf_simd(void) { return NF_VNNI ? 2 : NF_AVX2; }

/* Bytes of scratch nf_linear needs for m rows of k columns. */
int64_t nf_linear_scratch_bytes(int64_t m, int64_t k) {
    return 2 * m * k * 4 + 4 * m * (k / NF_BLOCK) * 4 + 2 * m * k + 64;
}

/* y[m, n] = x[m, k] W^T (+ bias), x and y float32 or bf16 (row strides ldx, ldy), on all OpenMP
 * threads: the rows are quantized, then the groups of W are split between the threads.
 * terms == 2: each row is quantized twice, x ~ q1 dx1 + q2 dx2 with the second term the int8
 * rounding of what the first left (relative error ~1e-4 instead of ~1e-2), as two rows of the GEMM
 * whose results are added. */
void nf_linear(const nf_mat *w, const void *x, int64_t x_bf16, int64_t ldx, int64_t m, void *y, int64_t y_bf16,
               int64_t ldy, int64_t terms, void *scratch) {
    const int64_t k = w->k, nb = k / NF_BLOCK, groups = nf_groups(w), rows_q = m * terms;
    float *xf = (float *)scratch; /* [rows_q, k] float32 rows (the input, then its residual) */
    float *xd = xf + rows_q * k;
    float *xs = xd + rows_q * nb;
    int8_t *xq = (int8_t *)(xs + rows_q * nb);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            float *row = xf + i * terms * k;
            for (int64_t c = 0; c < k; c++) row[c] = nf_load(x, i * ldx + c, x_bf16);
            const int64_t q0 = i * terms;
            nf_quantize_row(row, k, xq + q0 * k, xd + q0 * nb, xs + q0 * nb);
            if (terms == 2) {
                float *res = row + k;
                for (int64_t c = 0; c < k; c++) res[c] = row[c] - xq[q0 * k + c] * xd[q0 * nb + c / NF_BLOCK];
                nf_quantize_row(res, k, xq + (q0 + 1) * k, xd + (q0 + 1) * nb, xs + (q0 + 1) * nb);
            }
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            float tile[NF_MC * NF_ROWS];
            const int64_t r0 = g * NF_ROWS, rows = w->n - r0 < NF_ROWS ? w->n - r0 : NF_ROWS;
            for (int64_t i0 = 0; i0 < rows_q; i0 += NF_MC) { /* NF_MC is even: both terms of a row in one tile */
                const int64_t mc = rows_q - i0 < NF_MC ? rows_q - i0 : NF_MC;
                /* the tile's rows start at column -r0 of a row stride of 16, so row i lands at tile[16 i] */
                nf_gemm_group(w, g, xq + i0 * k, xd + i0 * nb, xs + i0 * nb, mc, tile - r0, NF_ROWS, 0);
                for (int64_t i = 0; i < mc; i += terms) {
                    const int64_t out_row = (i0 + i) / terms;
                    for (int64_t r = 0; r < rows; r++) {
                        float v = tile[i * NF_ROWS + r] + (terms == 2 ? tile[(i + 1) * NF_ROWS + r] : 0.0f);
                        nf_store(y, out_row * ldy + r0 + r, v, y_bf16);
                    }
                }
            }
        }
    }
}
