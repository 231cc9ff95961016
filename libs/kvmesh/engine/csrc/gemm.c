/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in fp32, for a weight packed once into column panels.
 *
 * Panel layout: W is stored as [ceil(N / 16), K, 16] (16 output features per panel, K-major, zero-padded past N),
 * so one panel is a single contiguous stream of K vectors of 16 floats (one AVX-512 register).
 *
 * Rows go in blocks of ROW_BLOCK; a block reads every panel once for all its rows, so a decode step (M <= 16)
 * streams the weights from memory exactly once and each extra row costs only its FMAs, overlapped with the
 * stream. Within a block: tiles of up to MR rows x 2 panels (24 accumulators in registers; balanced, so 16 rows
 * are 8 + 8) over K blocks of KC (the two panels' block, 32 KiB, stays in L1 across the row tiles), accumulating
 * into y between K blocks. Measured on this CPU (30 layers of SmolLM2-135M + lm_head, 1 thread): 2 panels x
 * 12 rows beat 1 panel x 16 rows, 3 x 8 and 4 x 6 at 1-16 rows.
 * GCC vector extensions: AVX-512 zmm under -march=native on a CPU that has it, narrower vectors elsewhere.
 */
#include <stdint.h>
#include <string.h>

#define NR 16         /* floats per panel row */
#define MR 12         /* rows per tile (x 2 panels = 24 accumulators) */
#define KC 256
#define ROW_BLOCK 192
#define PREFETCH 256  /* floats ahead in the panel stream (1 KiB); 1-16 KiB and L2-only measured no better */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* acc[mr][nv] over k in [0, kc) of x rows (stride ldx) and nv panels (stride pstride); first: start from zero
 * (else from y); last: add the bias; the tile writes ncols (<= nv * NR) columns of y. */
static inline __attribute__((always_inline)) void tile(int mr, int nv, const float *x, int64_t ldx,
                                                       const float *w, int64_t pstride, int64_t kc, float *y,
                                                       int64_t ldy, const float *bias, int64_t ncols, int first) {
    v16 acc[MR][2];
    float buf[2 * NR];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        if (first) {
            acc[r][0] = acc[r][1] = (v16){0};
        } else {
            memcpy(buf, y + r * ldy, (size_t)ncols * sizeof(float));
            memcpy(&acc[r][0], buf, sizeof(v16));
            memcpy(&acc[r][1], buf + NR, sizeof(v16));
        }
    }
    for (int64_t k = 0; k < kc; k++) {
        v16 wv[2];
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) {
            const float *wk = w + v * pstride + k * NR;
            __builtin_prefetch(wk + PREFETCH);
            wv[v] = *(const v16 *)wk;
        }
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            float xv = x[r * ldx + k];
#pragma GCC unroll 2
            for (int v = 0; v < nv; v++) acc[r][v] += xv * wv[v];
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        memcpy(buf, &acc[r][0], sizeof(v16));
        memcpy(buf + NR, &acc[r][1], sizeof(v16));
        if (bias)
            for (int64_t j = 0; j < ncols; j++) buf[j] += bias[j];
        memcpy(y + r * ldy, buf, (size_t)ncols * sizeof(float));
    }
}

#define ARGS x, ldx, w, pstride, kc, y, ldy, bias, ncols, first
/* `mr` and `nv` literals in each case, so that every tile is fully unrolled with its accumulators in registers. */
static void tile_rows(int mr, int nv, const float *x, int64_t ldx, const float *w, int64_t pstride, int64_t kc,
                      float *y, int64_t ldy, const float *bias, int64_t ncols, int first) {
    if (nv == 2) {
        switch (mr) {
#define CASE(n) case n: tile(n, 2, ARGS); return;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
            default: return;
        }
    }
    switch (mr) {
#define CASE(n) case n: tile(n, 1, ARGS); return;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
        default: return;
    }
}
#undef ARGS

int64_t kvmesh_gemm_panel_width(void) { return NR; }

/* W [N, K] row-major (row stride ldw) -> panels [ceil(N / NR), K, NR], zero-padded. */
void kvmesh_gemm_pack(const float *w, int64_t N, int64_t K, int64_t ldw, float *panels) {
    int64_t np = (N + NR - 1) / NR;
    for (int64_t p = 0; p < np; p++) {
        float *dst = panels + p * K * NR;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                dst[k * NR + j] = n < N ? w[n * ldw + k] : 0.0f;
            }
    }
}

/* x [M, K] (row stride ldx), panels from kvmesh_gemm_pack, bias [N] or NULL -> y [M, N] (row stride ldy). */
void kvmesh_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels, int64_t N,
                     const float *bias, float *y, int64_t ldy) {
    int64_t np = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        int64_t ntiles = (mb + MR - 1) / MR, base = mb / ntiles, extra = mb % ntiles; /* 16 rows: 8 + 8 */
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            int64_t kc = K - k0 < KC ? K - k0 : KC;
            int first = k0 == 0, last = k0 + kc == K;
            for (int64_t p = 0; p < np; p += 2) {
                int nv = p + 1 < np ? 2 : 1;
                int64_t n0 = p * NR, ncols = N - n0 < nv * NR ? N - n0 : nv * NR;
                const float *w = panels + p * K * NR + k0 * NR;
                const float *b = bias && last ? bias + n0 : NULL;
                for (int64_t t = 0, r0 = m0; t < ntiles; t++) {
                    int mr = (int)(base + (t < extra));
                    tile_rows(mr, nv, x + r0 * ldx + k0, ldx, w, K * NR, kc, y + r0 * ldy + n0, ldy, b, ncols,
                              first);
                    r0 += mr;
                }
            }
        }
    }
}
