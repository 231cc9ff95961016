/* The per-layer elementwise work of a decode step in one call each (fp32, rows contiguous in the last dim):
 * a step of 8 rows spent ~30% of its time in ~20 small torch ops per layer (RMSNorm's upcast/pow/mean/rsqrt,
 * rotate_half's slices/neg/cat), each costing more in dispatch than in arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp.h"

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)), as Hugging Face's LlamaRMSNorm computes it in fp32. */
void kvmesh_rms_norm_f32(const float *x, int64_t T, int64_t D, int64_t ldx, const float *w, float eps,
                         float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * ldx;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; i++) ss += xt[i] * xt[i];
        float r = 1.0f / sqrtf(ss / (float)D + eps);
        float *ot = out + t * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) ot[i] = w[i] * (xt[i] * r);
    }
}

/* Rotary embedding in place on the first `heads` heads of each row of x (row stride ldx, heads of D floats
 * side by side: q's then k's in a fused q|k|v row): x * cos + rotate_half(x) * sin at each row's position,
 * cos/sin tables [max_pos, D]. */
void kvmesh_rope_f32(float *x, int64_t T, int64_t ldx, int64_t heads, int64_t D, const float *cos_t,
                     const float *sin_t, const int64_t *positions) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * ldx + h * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* The MLP's activation: out[t] = silu(gu[t, :I]) * gu[t, I:] (silu(g) = g / (1 + exp(-g)), as torch's), for
 * the fused gate|up projection's rows (row stride ldgu); one pass instead of silu on a strided view, then a
 * product, each allocating. */
void kvmesh_silu_mul_f32(const float *gu, int64_t T, int64_t I, int64_t ldgu, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * ldgu, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
    }
}
