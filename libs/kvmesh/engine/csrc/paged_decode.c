/* Decode attention straight over the paged KV pool (one query token per sequence).
 *
 * Reads each sequence's K and V rows once, in place, through its block table: no gather copy, no GQA head
 * expansion. The G = H / Hkv query heads that share a KV head are scored against one K row together.
 * Pool layout per layer: [num_blocks, block_size, Hkv, D]; storage fp32, bf16 (upper half of an fp32) or
 * fp8 e4m3fn (table lookup). q and out are fp32 [B, H, D]. scratch holds G * max_len floats.
 * Limits (checked by the caller): D <= 256, G <= 16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

static inline void load_f32(const float *src, float *dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }

static inline void load_bf16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &bits, sizeof(float));
    }
}

static inline void load_fp8(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = fp8_e4m3_table[src[i]];
}

#define DEFINE_DECODE(NAME, T, LOAD)                                                                         \
    void NAME(const float *q, const T *kc, const T *vc, const int64_t *tables, const int64_t *lens,         \
              float *out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t maxb,          \
              float scale, float *scratch) {                                                               \
        const int64_t G = H / Hkv, max_len = maxb * bs;                                                    \
        float row[256], acc[16 * 256];                                                                      \
        for (int64_t b = 0; b < B; b++) {                                                                  \
            const int64_t len = lens[b];                                                                   \
            const int64_t *table = tables + b * maxb;                                                      \
            for (int64_t h = 0; h < Hkv; h++) {                                                            \
                const float *qh = q + (b * H + h * G) * D;                                                 \
                for (int64_t t = 0; t < len; t++) {                                                        \
                    const int64_t off = ((table[t / bs] * bs + t % bs) * Hkv + h) * D;                     \
                    LOAD(kc + off, row, D);                                                                \
                    for (int64_t g = 0; g < G; g++) {                                                      \
                        const float *qg = qh + g * D;                                                      \
                        float s = 0.0f;                                                                    \
                        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qg[d] * row[d]; \
                        scratch[g * max_len + t] = s * scale;                                              \
                    }                                                                                      \
                }                                                                                          \
                float denom[16];                                                                            \
                for (int64_t g = 0; g < G; g++) {                                                          \
                    float *sg = scratch + g * max_len, m = -INFINITY, sum = 0.0f;                          \
                    for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;                           \
                    for (int64_t t = 0; t < len; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }          \
                    denom[g] = sum;                                                                        \
                }                                                                                          \
                memset(acc, 0, sizeof(float) * G * D);                                                     \
                for (int64_t t = 0; t < len; t++) {                                                        \
                    const int64_t off = ((table[t / bs] * bs + t % bs) * Hkv + h) * D;                     \
                    LOAD(vc + off, row, D);                                                                \
                    for (int64_t g = 0; g < G; g++) {                                                      \
                        const float p = scratch[g * max_len + t];                                          \
                        float *ag = acc + g * D;                                                           \
                        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) ag[d] += p * row[d];           \
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

DEFINE_DECODE(kvmesh_paged_decode_f32, float, load_f32)
DEFINE_DECODE(kvmesh_paged_decode_bf16, uint16_t, load_bf16)
DEFINE_DECODE(kvmesh_paged_decode_fp8, uint8_t, load_fp8)
