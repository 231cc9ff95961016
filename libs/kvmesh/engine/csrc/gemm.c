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

/* One row of a tile's two accumulators (64 bytes each) -> y[0, ncols) (+ bias). */
static inline __attribute__((always_inline)) void store_row(const void *a0, const void *a1, float *y,
                                                            const float *bias, int64_t ncols) {
    float buf[2 * NR];
    memcpy(buf, a0, NR * sizeof(float));
    memcpy(buf + NR, a1, NR * sizeof(float));
    if (bias)
        for (int64_t j = 0; j < ncols; j++) buf[j] += bias[j];
    memcpy(y, buf, (size_t)ncols * sizeof(float));
}

/* y[mr, ncols] = x rows (stride ldx) @ nv panels (stride pstride) over k in [0, K) (+ bias), ncols <= nv * NR;
 * each panel load is paired with a prefetch pf floats further on (ahead in the same stream, or the next pair;
 * a prefetch past the end of the panels never faults). */
static inline __attribute__((always_inline)) void tile(int mr, int nv, const float *x, int64_t ldx,
                                                       const float *w, int64_t pstride, int64_t K, float *y,
                                                       int64_t ldy, const float *bias, int64_t ncols, int64_t pf) {
    v16 acc[MR][2];
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
    for (int r = 0; r < mr; r++) store_row(&acc[r][0], &acc[r][1], y + r * ldy, bias, ncols);
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

/* Whether the tile fits the registers: 24 accumulators of 16 floats are 24 zmm of AVX-512's 32. Built without
 * AVX-512 (AVX2: 16 ymm), each v16 is two ymm and the tile spills; measured on an AVX2 EPYC (SmolLM2-135M, one
 * thread) a decode step took 3.4x oneDNN's time, so the engine leaves the products to oneDNN there. */
int kvmesh_gemm_fast(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

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

/* One pair of panels (nv = 1 or 2, ncols columns from n0) for rows m0 .. m0 + mb of x, in balanced row tiles.
 * pf_later: what the tiles after the first prefetch (the next pair in the panels, or 0 to stay in place). */
static void pair_tiles(const float *x, int64_t ldx, int64_t m0, int64_t mb, const float *w, int64_t K, int nv,
                       int64_t n0, int64_t ncols, const float *b, float *y, int64_t ldy, int accumulate,
                       int64_t pf_later) {
    float part[MR * 2 * NR];
    int64_t ntiles = (mb + MR - 1) / MR, base = mb / ntiles, extra = mb % ntiles; /* 16 rows: 8 + 8 */
    for (int64_t t = 0, r0 = m0; t < ntiles; t++) {
        int mr = (int)(base + (t < extra));
        int64_t pf = t == 0 ? PREFETCH : pf_later;
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

/* x [M, K] (row stride ldx), panels from kvmesh_gemm_pack, bias [N] or NULL -> y [M, N] (row stride ldy);
 * accumulate: y += the product instead (a residual add fused into the projection, rounded as y + (x @ W + bias)
 * would be). The tile writes a small buffer then, added to y here: a tile with an accumulate branch, even one
 * fixed at compile time, ran 8 + 8 rows ~40% slower (16 rows 51.6 -> 73.1 ms a stack). */
void kvmesh_gemm_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *panels, int64_t N,
                     const float *bias, float *y, int64_t ldy, int accumulate) {
    int64_t np = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        for (int64_t p = 0; p < np; p += 2) {
            int nv = p + 1 < np ? 2 : 1;
            int64_t n0 = p * NR, ncols = N - n0 < nv * NR ? N - n0 : nv * NR;
            pair_tiles(x, ldx, m0, mb, panels + p * K * NR, K, nv, n0, ncols, bias ? bias + n0 : NULL, y, ldy,
                       accumulate, 2 * K * NR); /* later tiles: the next pair */
        }
    }
}

/* ---- quantized panels: the GGUF's blocks, rearranged per panel, dequantized a pair at a time into L1 ----------
 *
 * A weight stored as Q4_1 (w = d * q + m, q 4-bit, d and m per 32 weights along K) or Q8_0 (w = d * q, q int8)
 * is kept in that form, laid out per panel of 16 output features and block of 32 k: Q4_1 d[16] m[16] (fp32) and
 * 32 rows of 8 bytes (byte j: feature j in its low nibble, feature j + 8 in its high one), 384 bytes; Q8_0
 * d[16] and 32 rows of 16 int8, 576 bytes. Each pair of panels is dequantized into a scratch [2][K][16] and the
 * tiles above run on it, so the products are bit for bit those of the dense panels holding the dequantized
 * values (the multiply and add round separately, as the dequantizer's did: no FMA here). The stream is the
 * quantized bytes: 5-9 bits a weight instead of 32. AVX-512 only; elsewhere kvmesh_q_block_bytes says 0 and
 * the engine keeps the dense panels.
 */
#define QK 32
enum { Q4_1 = 1, Q8_0 = 2 };

int64_t kvmesh_q_block_bytes(int64_t type) {
#if defined(__AVX512F__)
    return type == Q4_1 ? 2 * NR * 4 + QK * NR / 2 : type == Q8_0 ? NR * 4 + QK * NR : 0;
#else
    (void)type;
    return 0;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Weights k and k + 1 of a block's 16 features, as fp32 vectors (d * q + m or d * q, rounded as the
 * dequantizer rounds: no FMA). Q4_1 reads both rows' 16 bytes at once. */
static inline __attribute__((always_inline)) void dequant2(int64_t type, const uint8_t *blk, int k, __m512 d,
                                                           __m512 m, __m512 *w0, __m512 *w1) {
    if (type == Q4_1) {
        const __m128i low = _mm_set1_epi8(0x0F);
        const __m128i b16 = _mm_loadu_si128((const __m128i *)(blk + 2 * NR * 4 + k * NR / 2));
        const __m128i lo = _mm_and_si128(b16, low), hi = _mm_and_si128(_mm_srli_epi16(b16, 4), low);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(lo, hi)));
        *w0 = _mm512_add_round_ps(_mm512_mul_round_ps(d, f0, RN), m, RN);
        *w1 = _mm512_add_round_ps(_mm512_mul_round_ps(d, f1, RN), m, RN);
    } else {
        const int8_t *q = (const int8_t *)(blk + NR * 4) + k * NR;
        *w0 = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))),
                                  d, RN);
        *w1 = _mm512_mul_round_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + NR)))), d, RN);
    }
}

/* One panel's K weights -> out [K][16] fp32. */
static void dequant_panel(const uint8_t *qp, int64_t type, int64_t K, float *out) {
    const int64_t nb = K / QK, bb = kvmesh_q_block_bytes(type);
    for (int64_t b = 0; b < nb; b++, out += QK * NR) {
        const uint8_t *blk = qp + b * bb;
        const __m512 d = _mm512_loadu_ps((const float *)blk);
        const __m512 m = type == Q4_1 ? _mm512_loadu_ps((const float *)blk + NR) : d;
        for (int k = 0; k < QK; k += 2) {
            __m512 w0, w1;
            dequant2(type, blk, k, d, m, &w0, &w1);
            _mm512_storeu_ps(out + k * NR, w0);
            _mm512_storeu_ps(out + (k + 1) * NR, w1);
        }
    }
}

/* A tile of up to MR rows x nv panels straight from the quantized panels (steps of <= MR rows: no other tile
 * would reuse a dequantized pair, so each weight vector goes from the stream to the FMAs in registers). The
 * same FMAs, in the same order, as `tile` over the dense panels. */
static inline __attribute__((always_inline)) void tile_q(int mr, int nv, int64_t type, const float *x, int64_t ldx,
                                                         const uint8_t *q, int64_t pstride, int64_t K, float *y,
                                                         int64_t ldy, const float *bias, int64_t ncols) {
    const int64_t nb = K / QK, bb = kvmesh_q_block_bytes(type);
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 d[2], m[2];
        const uint8_t *blk[2];
#pragma GCC unroll 2
        for (int v = 0; v < nv; v++) {
            blk[v] = q + v * pstride + b * bb;
            __builtin_prefetch(blk[v] + 4 * bb);
            __builtin_prefetch(blk[v] + 4 * bb + 64);
            d[v] = _mm512_loadu_ps((const float *)blk[v]);
            m[v] = type == Q4_1 ? _mm512_loadu_ps((const float *)blk[v] + NR) : d[v];
        }
        for (int k = 0; k < QK; k += 2) {
            __m512 w0[2], w1[2];
#pragma GCC unroll 2
            for (int v = 0; v < nv; v++) dequant2(type, blk[v], k, d[v], m[v], &w0[v], &w1[v]);
            const int64_t kk = b * QK + k;
#pragma GCC unroll 12
            for (int r = 0; r < mr; r++) {
                const float x0 = x[r * ldx + kk];
#pragma GCC unroll 2
                for (int v = 0; v < nv; v++) acc[r][v] += x0 * w0[v];
            }
#pragma GCC unroll 12
            for (int r = 0; r < mr; r++) {
                const float x1 = x[r * ldx + kk + 1];
#pragma GCC unroll 2
                for (int v = 0; v < nv; v++) acc[r][v] += x1 * w1[v];
            }
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) store_row(&acc[r][0], &acc[r][1], y + r * ldy, bias, ncols);
}

#define QARGS x, ldx, q, pstride, K, y, ldy, bias, ncols
static void tile_q_rows(int mr, int nv, int64_t type, const float *x, int64_t ldx, const uint8_t *q,
                        int64_t pstride, int64_t K, float *y, int64_t ldy, const float *bias, int64_t ncols) {
#define CASE(n, NV, T) case n: tile_q(n, NV, T, QARGS); return;
#define ROWS(NV, T)                                                                                              \
    switch (mr) {                                                                                                \
        CASE(1, NV, T) CASE(2, NV, T) CASE(3, NV, T) CASE(4, NV, T) CASE(5, NV, T) CASE(6, NV, T)                \
        CASE(7, NV, T) CASE(8, NV, T) CASE(9, NV, T) CASE(10, NV, T) CASE(11, NV, T) CASE(12, NV, T)             \
        default: return;                                                                                         \
    }
    if (type == Q4_1 && nv == 2) ROWS(2, Q4_1)
    if (type == Q4_1) ROWS(1, Q4_1)
    if (nv == 2) ROWS(2, Q8_0)
    ROWS(1, Q8_0)
#undef ROWS
#undef CASE
}
#undef QARGS

/* Every panel dequantized -> panels [N / 16][K][16] (what kvmesh_gemm_pack makes of the dense weight): the
 * engine checks them against its dense panels before it trusts the quantized form. */
void kvmesh_q_dequant(const uint8_t *q, int64_t type, int64_t N, int64_t K, float *panels) {
    const int64_t pstride = K / QK * kvmesh_q_block_bytes(type);
    for (int64_t p = 0; p < N / NR; p++) dequant_panel(q + p * pstride, type, K, panels + p * K * NR);
}

/* kvmesh_gemm_f32 over quantized panels (N a multiple of 16, K of 32); scratch holds 2 * K * 16 floats. */
void kvmesh_gemm_q_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int64_t type,
                       int64_t N, const float *bias, float *y, int64_t ldy, int accumulate, float *scratch) {
    const int64_t np = N / NR, pstride = K / QK * kvmesh_q_block_bytes(type);
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        if (mb <= MR) { /* one row tile: dequantize in registers */
            float part[MR * 2 * NR];
            for (int64_t p = 0; p < np; p += 2) {
                int nv = p + 1 < np ? 2 : 1;
                const float *b = bias ? bias + p * NR : NULL;
                if (accumulate) {
                    tile_q_rows((int)mb, nv, type, x + m0 * ldx, ldx, q + p * pstride, pstride, K, part, 2 * NR, b,
                                nv * NR);
                    for (int64_t r = 0; r < mb; r++)
                        for (int64_t j = 0; j < nv * NR; j++) y[(m0 + r) * ldy + p * NR + j] += part[r * 2 * NR + j];
                } else {
                    tile_q_rows((int)mb, nv, type, x + m0 * ldx, ldx, q + p * pstride, pstride, K,
                                y + m0 * ldy + p * NR, ldy, b, nv * NR);
                }
            }
            continue;
        }
        for (int64_t p = 0; p < np; p += 2) {
            int nv = p + 1 < np ? 2 : 1;
            for (int v = 0; v < nv; v++) dequant_panel(q + (p + v) * pstride, type, K, scratch + v * K * NR);
            pair_tiles(x, ldx, m0, mb, scratch, K, nv, p * NR, nv * NR, bias ? bias + p * NR : NULL, y, ldy,
                       accumulate, PREFETCH);
        }
    }
}
#else
void kvmesh_q_dequant(const uint8_t *q, int64_t type, int64_t N, int64_t K, float *panels) {
    (void)q; (void)type; (void)N; (void)K; (void)panels;
}
void kvmesh_gemm_q_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q, int64_t type,
                       int64_t N, const float *bias, float *y, int64_t ldy, int accumulate, float *scratch) {
    (void)x; (void)M; (void)K; (void)ldx; (void)q; (void)type; (void)N; (void)bias; (void)y; (void)ldy;
    (void)accumulate; (void)scratch;
}
#endif
