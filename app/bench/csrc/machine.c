/* What one core of this machine can do at most: the fp32 FMA peak and the memory stream bandwidth of one thread.
 *
 * Compiled like the engine's kernels (kvmesh.engine.native: -O3 -march=native), so the vectors are as wide as the
 * engine's: AVX-512 zmm on a CPU that has it, narrower elsewhere (GCC vector extensions; the lanes are reported).
 *
 * fma_peak: CHAINS independent chains of a = a * m + c on registers only (nothing read or written in the loop),
 * enough chains to cover the FMA latency on two ports, so the loop runs at the FMA units' throughput.
 * Streams (STREAM's kernels, bytes counted as STREAM does: read + written, no write-allocate): read (a sum, the
 * weight stream of a decode step), copy, triad.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define CHAINS 12

typedef float vf __attribute__((vector_size(LANES * 4)));

int64_t kvmesh_probe_lanes(void) { return LANES; }
int64_t kvmesh_probe_chains(void) { return CHAINS; }

/* ``iters`` rounds of CHAINS vector FMAs: CHAINS * LANES * 2 * iters flops. Returns a sum so nothing is dead. */
float kvmesh_probe_fma(int64_t iters, float seed) {
    vf acc[CHAINS];
    vf m, c;
    for (int j = 0; j < LANES; j++) {
        m[j] = 0.999999f;
        c[j] = 1e-7f * (float)(j + 1);
    }
    for (int i = 0; i < CHAINS; i++)
        for (int j = 0; j < LANES; j++) acc[i][j] = seed + (float)(i * LANES + j);
    for (int64_t n = 0; n < iters; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) acc[i] = acc[i] * m + c;
    }
    vf s = acc[0];
    for (int i = 1; i < CHAINS; i++) s += acc[i];
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += s[j];
    return total;
}

/* Sum of x[0, n): reads 4n bytes. n a multiple of 4 * LANES. */
float kvmesh_probe_read(const float *x, int64_t n) {
    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (int64_t i = 0; i < n; i += 4 * LANES) {
        vf a, b, c, d;
        memcpy(&a, x + i, sizeof a);
        memcpy(&b, x + i + LANES, sizeof b);
        memcpy(&c, x + i + 2 * LANES, sizeof c);
        memcpy(&d, x + i + 3 * LANES, sizeof d);
        s0 += a, s1 += b, s2 += c, s3 += d;
    }
    vf s = s0 + s1 + s2 + s3;
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += s[j];
    return total;
}

/* y = x: 8n bytes. */
void kvmesh_probe_copy(float *restrict y, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i];
}

/* a = b + s * c: 12n bytes. */
void kvmesh_probe_triad(float *restrict a, const float *restrict b, const float *restrict c, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
