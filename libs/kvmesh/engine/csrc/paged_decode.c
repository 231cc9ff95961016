/* Decode attention straight over the paged KV pool (one query token per sequence).
 *
 * Reads each sequence's K and V rows once, in place, through its block table: no gather copy, no GQA head
 * expansion. The G = H / Hkv query heads that share a KV head are scored against one K row together.
 * Pool layout per layer: [num_blocks, block_size, Hkv, D]; storage fp32, bf16 (upper half of an fp32) or
 * fp8 e4m3fn (table lookup). q and out are fp32 [B, H, D]. scratch holds G * max_len floats.
 * Limits (checked by the caller): D <= 256, G <= 16. Head sizes 64 and 128 get their own copies with D a
 * constant (loops over D fully unrolled, no remainder code), and the softmax's exp is inline arithmetic, so it
 * vectorizes. An fp32 pool with those head sizes takes the AVX-512 copy further down (paged_decode_f32_d*):
 * 1.5-2.3x the generic loops, which GCC vectorized at 256 bits with a horizontal sum per row and head; at 8 rows
 * x 512 tokens it reads the KV about as fast as this machine streams memory (189 MB a step, ~6 GB/s a core).
 * Software prefetch of the next rows measured no better.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"

static float fp8_e4m3_table[256];

void kvmesh_init_fp8_table(void) {
    for (int i = 0; i < 256; i++) {
        int sign = i >> 7, exp = (i >> 3) & 0xF, man = i & 0x7;
        float v;
        if (exp == 0xF && man == 0x7) v = NAN;
        else if (exp == 0) v = ldexpf((float)man / 8.0f, -6);
        else v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
        fp8_e4m3_table[i] = sign ? -v : v;
    }
}

/* Each loader returns a pointer to D fp32 values: the row itself for fp32, else `buf` filled by conversion. */
static inline const float *load_f32(const float *src, float *buf, int64_t n) { (void)buf; (void)n; return src; }

static inline const float *load_bf16(const uint16_t *src, float *buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(&buf[i], &bits, sizeof(float));
    }
    return buf;
}

static inline const float *load_fp8(const uint8_t *src, float *buf, int64_t n) {
    for (int64_t i = 0; i < n; i++) buf[i] = fp8_e4m3_table[src[i]];
    return buf;
}

/* Each of the G score rows (``len`` scores, ``max_len`` apart) turned into exp(score - max) in place; returns
 * their sums in ``denom``. */
static inline void softmax_rows(float *scratch, int64_t G, int64_t max_len, int64_t len, float *denom) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = scratch + g * max_len, m = -INFINITY, sum = 0.0f;
        _Pragma("omp simd reduction(max : m)") for (int64_t i = 0; i < len; i++) m = fmaxf(m, sg[i]);
        _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < len; i++) {
            sg[i] = exp_clamped(sg[i] - m);
            sum += sg[i];
        }
        denom[g] = sum;
    }
}

/* Tokens are visited block by block: row r of block `table[j]` sits at ((block * bs + r) * Hkv + h) * D. */
#define DEFINE_DECODE(NAME, T, LOAD)                                                                         \
    static inline __attribute__((always_inline)) void NAME##_impl(                                         \
              const float *q, const T *kc, const T *vc, const int64_t *tables, const int64_t *lens,         \
              float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t maxb,          \
              float scale, float *scratch) {                                                               \
        const int64_t G = H / Hkv, max_len = maxb * bs, row_stride = Hkv * D;                              \
        float buf[4 * 256], acc[16 * 256], qs[16 * 256], denom[16];                                            \
        for (int64_t b = 0; b < B; b++) {                                                                  \
            const int64_t len = lens[b], nblocks = (len + bs - 1) / bs;                                    \
            const int64_t *table = tables + b * maxb;                                                      \
            for (int64_t h = 0; h < Hkv; h++) {                                                            \
                for (int64_t i = 0; i < G * D; i++) qs[i] = q[(b * H + h * G) * D + i] * scale;            \
                int64_t t = 0;                                                                             \
                for (int64_t j = 0; j < nblocks; j++) {                                                    \
                    const T *kb = kc + (table[j] * bs * Hkv + h) * D;                                      \
                    const int64_t rows = len - t < bs ? len - t : bs;                                      \
                    int64_t r = 0;                                                                         \
                    for (; r + 4 <= rows; r += 4, t += 4) { /* four rows at once: independent FMA chains */  \
                        const float *k0 = LOAD(kb + r * row_stride, buf, D);                               \
                        const float *k1 = LOAD(kb + (r + 1) * row_stride, buf + 256, D);                   \
                        const float *k2 = LOAD(kb + (r + 2) * row_stride, buf + 512, D);                   \
                        const float *k3 = LOAD(kb + (r + 3) * row_stride, buf + 768, D);                   \
                        for (int64_t g = 0; g < G; g++) {                                                  \
                            const float *qg = qs + g * D;                                                  \
                            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                              \
                            _Pragma("omp simd reduction(+ : s0, s1, s2, s3)") for (int64_t d = 0; d < D; d++) { \
                                s0 += qg[d] * k0[d]; s1 += qg[d] * k1[d];                                  \
                                s2 += qg[d] * k2[d]; s3 += qg[d] * k3[d];                                  \
                            }                                                                              \
                            float *sg = scratch + g * max_len + t;                                         \
                            sg[0] = s0; sg[1] = s1; sg[2] = s2; sg[3] = s3;                                \
                        }                                                                                  \
                    }                                                                                      \
                    for (; r < rows; r++, t++) {                                                           \
                        const float *k = LOAD(kb + r * row_stride, buf, D);                                \
                        for (int64_t g = 0; g < G; g++) {                                                  \
                            const float *qg = qs + g * D;                                                  \
                            float s = 0.0f;                                                                \
                            _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qg[d] * k[d]; \
                            scratch[g * max_len + t] = s;                                                  \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
                softmax_rows(scratch, G, max_len, len, denom);                                             \
                memset(acc, 0, sizeof(float) * G * D);                                                     \
                t = 0;                                                                                     \
                for (int64_t j = 0; j < nblocks; j++) {                                                    \
                    const T *vb = vc + (table[j] * bs * Hkv + h) * D;                                      \
                    const int64_t rows = len - t < bs ? len - t : bs;                                      \
                    int64_t r = 0;                                                                         \
                    for (; r + 4 <= rows; r += 4, t += 4) { /* four rows per pass over the accumulators */   \
                        const float *v0 = LOAD(vb + r * row_stride, buf, D);                               \
                        const float *v1 = LOAD(vb + (r + 1) * row_stride, buf + 256, D);                   \
                        const float *v2 = LOAD(vb + (r + 2) * row_stride, buf + 512, D);                   \
                        const float *v3 = LOAD(vb + (r + 3) * row_stride, buf + 768, D);                   \
                        for (int64_t g = 0; g < G; g++) {                                                  \
                            const float *p = scratch + g * max_len + t;                                    \
                            const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];                        \
                            float *ag = acc + g * D;                                                       \
                            _Pragma("omp simd") for (int64_t d = 0; d < D; d++)                            \
                                ag[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];                \
                        }                                                                                  \
                    }                                                                                      \
                    for (; r < rows; r++, t++) {                                                           \
                        const float *v = LOAD(vb + r * row_stride, buf, D);                                \
                        for (int64_t g = 0; g < G; g++) {                                                  \
                            const float p = scratch[g * max_len + t];                                      \
                            float *ag = acc + g * D;                                                       \
                            _Pragma("omp simd") for (int64_t d = 0; d < D; d++) ag[d] += p * v[d];         \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    float *o = out + (b * H + h * G + g) * D;                                              \
                    const float inv = 1.0f / denom[g];                                                     \
                    for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;                           \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }

/* fp32 pool, D = 64 or 128 (C = D / 16 vectors a row), AVX-512 intrinsics: GCC's auto-vectorizer picked 256-bit
 * vectors and per-row horizontal sums for the generic loops above, ~5x this at 512-token contexts. Scores: each
 * K row is loaded once (C vectors) for the G query heads, four rows at a time (independent chains), one horizontal
 * sum per (row, head). Values: the heads' output accumulators live in registers, GG heads at a time
 * (GG * C <= 16), each V row loaded once per group and multiplied by each head's probability. Sums run in
 * another order than the generic loops': results agree to fp32 rounding (~1e-7), not bit for bit. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define DEFINE_FAST(C)                                                                                       \
    static void paged_decode_f32_d##C(const float *q, const float *kc, const float *vc, const int64_t *tables,  \
                                     const int64_t *lens, float *out, int64_t B, int64_t H, int64_t Hkv,     \
                                     int64_t bs, int64_t maxb, float scale, float *scratch) {                \
        enum { D = 16 * (C), GG = 16 / (C) };                                                                \
        const int64_t G = H / Hkv, max_len = maxb * bs, row_stride = Hkv * D;                                 \
        __m512 qs[16 * (C)];                                                                                 \
        const __m512 vscale = _mm512_set1_ps(scale);                                                         \
        for (int64_t b = 0; b < B; b++) {                                                                    \
            const int64_t len = lens[b], nblocks = (len + bs - 1) / bs;                                      \
            const int64_t *table = tables + b * maxb;                                                        \
            for (int64_t h = 0; h < Hkv; h++) {                                                              \
                const float *qh = q + (b * H + h * G) * D;                                                   \
                for (int64_t i = 0; i < G * (C); i++) qs[i] = _mm512_mul_ps(_mm512_loadu_ps(qh + 16 * i), vscale); \
                int64_t t = 0;                                                                               \
                for (int64_t j = 0; j < nblocks; j++) {                                                      \
                    const float *kb = kc + (table[j] * bs * Hkv + h) * D;                                    \
                    const int64_t rows = len - t < bs ? len - t : bs;                                        \
                    int64_t r = 0;                                                                           \
                    for (; r + 4 <= rows; r += 4, t += 4) {                                                  \
                        const float *k0 = kb + r * row_stride;                                               \
                        __m512 k[4][C];                                                                      \
                        for (int u = 0; u < 4; u++)                                                          \
                            for (int c = 0; c < (C); c++) k[u][c] = _mm512_loadu_ps(k0 + u * row_stride + 16 * c); \
                        for (int64_t g = 0; g < G; g++) {                                                    \
                            const __m512 *qg = qs + g * (C);                                                 \
                            float *sg = scratch + g * max_len + t;                                           \
                            for (int u = 0; u < 4; u++) {                                                    \
                                __m512 a = _mm512_mul_ps(qg[0], k[u][0]);                                    \
                                for (int c = 1; c < (C); c++) a = _mm512_fmadd_ps(qg[c], k[u][c], a);        \
                                sg[u] = _mm512_reduce_add_ps(a);                                             \
                            }                                                                                \
                        }                                                                                    \
                    }                                                                                        \
                    for (; r < rows; r++, t++) {                                                             \
                        const float *k0 = kb + r * row_stride;                                               \
                        for (int64_t g = 0; g < G; g++) {                                                    \
                            const __m512 *qg = qs + g * (C);                                                 \
                            __m512 a = _mm512_mul_ps(qg[0], _mm512_loadu_ps(k0));                            \
                            for (int c = 1; c < (C); c++) a = _mm512_fmadd_ps(qg[c], _mm512_loadu_ps(k0 + 16 * c), a); \
                            scratch[g * max_len + t] = _mm512_reduce_add_ps(a);                              \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
                float inv[16];                                                                               \
                softmax_rows(scratch, G, max_len, len, inv);                                                 \
                for (int64_t g = 0; g < G; g++) inv[g] = 1.0f / inv[g];                                      \
                for (int64_t g0 = 0; g0 < G; g0 += GG) {                                                     \
                    const int64_t ng = G - g0 < GG ? G - g0 : GG;                                            \
                    __m512 acc[GG][C];                                                                       \
                    for (int g = 0; g < GG; g++)                                                             \
                        for (int c = 0; c < (C); c++) acc[g][c] = _mm512_setzero_ps();                       \
                    t = 0;                                                                                   \
                    for (int64_t j = 0; j < nblocks; j++) {                                                  \
                        const float *vb = vc + (table[j] * bs * Hkv + h) * D;                                \
                        const int64_t rows = len - t < bs ? len - t : bs;                                    \
                        for (int64_t r = 0; r < rows; r++, t++) {                                            \
                            const float *v0 = vb + r * row_stride;                                           \
                            __m512 v[C];                                                                     \
                            for (int c = 0; c < (C); c++) v[c] = _mm512_loadu_ps(v0 + 16 * c);               \
                            for (int g = 0; g < GG; g++) {                                                   \
                                if (g >= ng) break;                                                          \
                                const __m512 p = _mm512_set1_ps(scratch[(g0 + g) * max_len + t]);            \
                                for (int c = 0; c < (C); c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]); \
                            }                                                                                \
                        }                                                                                    \
                    }                                                                                        \
                    for (int g = 0; g < ng; g++) {                                                           \
                        float *o = out + (b * H + h * G + g0 + g) * D;                                       \
                        const __m512 s = _mm512_set1_ps(inv[g0 + g]);                                        \
                        for (int c = 0; c < (C); c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[g][c], s)); \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_FAST(4)
DEFINE_FAST(8)
#define KVMESH_FAST_F32 1
#endif

/* The entry points: D a literal where it is one of the common head sizes. */
#define DEFINE_ENTRY(NAME, T)                                                                              \
    void NAME(const float *q, const T *kc, const T *vc, const int64_t *tables, const int64_t *lens,         \
              float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t maxb,          \
              float scale, float *scratch) {                                                               \
        if (D == 64) NAME##_impl(q, kc, vc, tables, lens, out, B, H, Hkv, 64, bs, maxb, scale, scratch);     \
        else if (D == 128) NAME##_impl(q, kc, vc, tables, lens, out, B, H, Hkv, 128, bs, maxb, scale, scratch); \
        else NAME##_impl(q, kc, vc, tables, lens, out, B, H, Hkv, D, bs, maxb, scale, scratch);              \
    }
DEFINE_DECODE(kvmesh_paged_decode_f32, float, load_f32)
DEFINE_DECODE(kvmesh_paged_decode_bf16, uint16_t, load_bf16)
DEFINE_DECODE(kvmesh_paged_decode_fp8, uint8_t, load_fp8)
#ifdef KVMESH_FAST_F32
void kvmesh_paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *tables,
                             const int64_t *lens, float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                             int64_t bs, int64_t maxb, float scale, float *scratch) {
    if (D == 64) paged_decode_f32_d4(q, kc, vc, tables, lens, out, B, H, Hkv, bs, maxb, scale, scratch);
    else if (D == 128) paged_decode_f32_d8(q, kc, vc, tables, lens, out, B, H, Hkv, bs, maxb, scale, scratch);
    else kvmesh_paged_decode_f32_impl(q, kc, vc, tables, lens, out, B, H, Hkv, D, bs, maxb, scale, scratch);
}
#else
DEFINE_ENTRY(kvmesh_paged_decode_f32, float)
#endif
DEFINE_ENTRY(kvmesh_paged_decode_bf16, uint16_t)
DEFINE_ENTRY(kvmesh_paged_decode_fp8, uint8_t)
