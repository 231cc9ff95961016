/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in fp32, for a weight packed once into column panels.
 *
 * Panel layout: W is stored as [ceil(N / 16), K, 16] (16 output features per panel, K-major, zero-padded past N),
 * so one panel is a single contiguous stream of K vectors of 16 floats (one AVX-512 register).
 *
 * Rows go in blocks of ROW_BLOCK; a block reads every panel once for all its rows, so a decode step (M <= 16)
 * streams the weights from memory exactly once and each extra row costs only its FMAs. Within a block: one pair
 * of panels at a time, streamed whole (all of K: two sequential streams, and each tile's accumulators finish in
 * registers, never reloaded from y), in tiles of up to MR rows x 2 panels (24 accumulators; balanced, so 16
 * rows are 8 + 8). The first tile reads the pair from memory; the later ones read it again from cache and
 * meanwhile prefetch the next pair, so the stream keeps going while they compute (with K blocks and the pair
 * loop inside them, the memory sat idle during the later tiles). Measured on this CPU (30 layers of
 * SmolLM2-135M + lm_head, 1 thread, `python -m app.bench.gemm`): 2 panels x 12 rows beat 1 panel x 16 rows,
 * 3 x 8 and 4 x 6 at 1-16 rows; streaming whole pairs beat K blocks of 256 by 5% at 1 row and 12-20% at 8-24.
 * GCC vector extensions: AVX-512 zmm under -march=native on a CPU that has it, narrower vectors elsewhere.
 */
#include <stdint.h>
#include <string.h>

#define NR 16         /* floats per panel row */
#define MR 12         /* rows per tile (x 2 panels = 24 accumulators) */
#define ROW_BLOCK 192
#define PREFETCH 256  /* floats ahead in the panel stream (1 KiB); 1-16 KiB and L2-only measured no better */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* y[mr, ncols] = x rows (stride ldx) @ nv panels (stride pstride) over k in [0, K) (+ bias), ncols <= nv * NR;
 * each panel load is paired with a prefetch pf floats further on (ahead in the same stream, or the next pair;
 * a prefetch past the end of the panels never faults). */
static inline __attribute__((always_inline)) void tile(int mr, int nv, const float *x, int64_t ldx,
                                                       const float *w, int64_t pstride, int64_t K, float *y,
                                                       int64_t ldy, const float *bias, int64_t ncols, int64_t pf) {
    v16 acc[MR][2];
    float buf[2 * NR];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (v16){0};
    for (int64_t k = 0; k < K; k++) {
        v16 wv[2];
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) {
            const float *wk = w + v * pstride + k * NR;
            __builtin_prefetch(wk + pf);
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

#define ARGS x, ldx, w, pstride, K, y, ldy, bias, ncols, pf
/* `mr` and `nv` literals in each case, so that every tile is fully unrolled with its accumulators in registers. */
static void tile_rows(int mr, int nv, const float *x, int64_t ldx, const float *w, int64_t pstride, int64_t K,
                      float *y, int64_t ldy, const float *bias, int64_t ncols, int64_t pf) {
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

/* x [M, K] (row stride ldx), panels from kvmesh_gemm_pack, bias [N] or NULL -> y [M, N] (row stride ldy);
 * accumulate: y += the product instead (a residual add fused into the projection, rounded as y + (x @ W + bias)
 * would be). The tile writes a small buffer then, added to y here: a tile with an accumulate branch, even one
 * fixed at compile time, ran 8 + 8 rows ~40% slower (16 rows 51.6 -> 73.1 ms a stack). */
void kvmesh_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels, int64_t N,
                     const float *bias, float *y, int64_t ldy, int accumulate) {
    float part[MR * 2 * NR];
    int64_t np = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        int64_t ntiles = (mb + MR - 1) / MR, base = mb / ntiles, extra = mb % ntiles; /* 16 rows: 8 + 8 */
        for (int64_t p = 0; p < np; p += 2) {
            int nv = p + 1 < np ? 2 : 1;
            int64_t n0 = p * NR, ncols = N - n0 < nv * NR ? N - n0 : nv * NR;
            const float *w = panels + p * K * NR, *b = bias ? bias + n0 : NULL;
            for (int64_t t = 0, r0 = m0; t < ntiles; t++) {
                int mr = (int)(base + (t < extra));
                int64_t pf = t == 0 ? PREFETCH : 2 * K * NR; /* later tiles: the next pair */
                if (accumulate) {
                    tile_rows(mr, nv, x + r0 * ldx, ldx, w, K * NR, K, part, 2 * NR, b, ncols, pf);
                    for (int r = 0; r < mr; r++)
                        for (int64_t j = 0; j < ncols; j++) y[(r0 + r) * ldy + n0 + j] += part[r * 2 * NR + j];
                } else {
                    tile_rows(mr, nv, x + r0 * ldx, ldx, w, K * NR, K, y + r0 * ldy + n0, ldy, b, ncols, pf);
                }
                r0 += mr;
            }
        }
    }
}
