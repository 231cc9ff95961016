/* Shared by the kernels in this folder (native.py hashes every header into each kernel's cache key). */
#ifndef KVMESH_EXP_H
#define KVMESH_EXP_H
#include <stdint.h>
#include <string.h>

/* exp(x) in plain arithmetic, so that the loop around it vectorizes (libm's expf is a call per element):
 * Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial; relative error ~1e-7), x clamped
 * to [-87, 88] (the fp32 range: below, ~1e-38 instead of 0). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds x / ln 2 to an integer */
    const float n = t - 12582912.0f;
    int32_t ni;
    memcpy(&ni, &t, sizeof ni);
    ni -= 0x4B400000;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f, z = r * r;
    const float p = ((((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r
                        + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f);
    const int32_t bits = (ni + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
