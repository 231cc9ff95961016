/* Prefill attention straight over the paged KV pool: every query row of a prompt chunk against the cached
 * prefix and the chunk itself (causal), fp32, AVX-512, head dim 64 or 128.
 *
 * The chunk's K/V are already in the pool (the caller writes them first), so a first chunk and a later one
 * (on top of a cached prefix or earlier chunks) are one case: no gather copy of the prefix, no mask tensor, and
 * key chunks past a row's position are never computed (SDPA with an explicit mask computed them all).
 *
 * Tiles of 16 query rows of one head, the rows in the vector lanes (flash attention's online softmax per lane):
 * - scores S^T [16 keys][16 rows]: for each of the D dims, one vector of the tile's queries (Q^T, built once per
 *   tile, pre-scaled) times each key's element broadcast from the pool, 16 independent FMA chains;
 * - the running max, the rescale and the row sums are vector ops over the lanes (no horizontal reductions);
 * - O^T [D][16 rows] += P^T x V: for 8 dims at a time, each key's probabilities (one vector) times its V
 *   elements broadcast, 8 accumulators in registers.
 * Pool layout per layer: [num_blocks, block_size, Hkv, D]. A block size that is a multiple of 16 is read in
 * place (16 keys never straddle a block); any other is copied 16 keys at a time into a small buffer first.
 * Sums run in another order than SDPA's: results agree to fp32 rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int kvmesh_paged_prefill_available(void) { return 1; }

/* exp(x) over 16 lanes, the arithmetic of exp.h's exp_clamped (Cephes: reduction by ln 2 in two parts, a
 * degree-6 polynomial), the power of two applied by scalef. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    const __m512 z = _mm512_mul_ps(r, r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define TILE 16

/* One tile: ``rows`` (<= 16) query rows of one head, at positions pos0 .., ``q`` / ``out`` their first row
 * (rows ``q_ld`` / ``ld`` floats apart); keys 0 .. pos0 + rows - 1 through ``table``. */
#define DEFINE_TILE(C)                                                                                       \
    static void tile_d##C(const float *q, int64_t q_ld, float *out, int64_t ld, int64_t rows, int64_t pos0,  \
                          const float *kc, const float *vc, const int64_t *table, int64_t bs, int64_t Hkv,   \
                          int64_t h, float scale) {                                                          \
        enum { D = 16 * (C) };                                                                               \
        float QT[D * TILE] __attribute__((aligned(64)));                                                     \
        float OT[D * TILE] __attribute__((aligned(64)));                                                     \
        float P[TILE * TILE] __attribute__((aligned(64)));                                                   \
        float KV[2 * TILE * D] __attribute__((aligned(64)));                                                 \
        for (int64_t d = 0; d < D; d++)                                                                      \
            for (int64_t r = 0; r < TILE; r++) QT[d * TILE + r] = r < rows ? q[r * q_ld + d] * scale : 0.0f; \
        memset(OT, 0, sizeof OT);                                                                            \
        __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();                                       \
        const __m512i rowpos = _mm512_add_epi32(_mm512_set1_epi32((int)pos0),                                \
                                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)); \
        const int64_t nkeys = pos0 + rows, row_stride = Hkv * D;                                             \
        for (int64_t t0 = 0; t0 < nkeys; t0 += TILE) {                                                       \
            const int64_t nk = nkeys - t0 < TILE ? nkeys - t0 : TILE;                                        \
            const float *kp, *vp;                                                                            \
            int64_t ks;                                                                                      \
            if (bs % TILE == 0) {                                                                            \
                const int64_t at = (table[t0 / bs] * bs + t0 % bs) * Hkv + h;                                \
                kp = kc + at * D, vp = vc + at * D, ks = row_stride;                                         \
            } else {                                                                                         \
                for (int64_t j = 0; j < TILE; j++) {                                                         \
                    if (j < nk) {                                                                            \
                        const int64_t t = t0 + j, at = ((table[t / bs] * bs + t % bs) * Hkv + h) * D;        \
                        memcpy(KV + j * D, kc + at, D * sizeof(float));                                      \
                        memcpy(KV + (TILE + j) * D, vc + at, D * sizeof(float));                             \
                    } else {                                                                                 \
                        memset(KV + j * D, 0, D * sizeof(float));                                            \
                        memset(KV + (TILE + j) * D, 0, D * sizeof(float));                                   \
                    }                                                                                        \
                }                                                                                            \
                kp = KV, vp = KV + TILE * D, ks = D;                                                         \
            }                                                                                                \
            __m512 s[TILE];                                                                                  \
            for (int j = 0; j < TILE; j++) s[j] = _mm512_setzero_ps();                                       \
            for (int64_t d = 0; d < D; d++) {                                                                \
                const __m512 qd = _mm512_load_ps(QT + d * TILE);                                             \
                for (int j = 0; j < TILE; j++) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kp[j * ks + d]), s[j]); \
            }                                                                                                \
            /* lane r sees key t0 + j iff it is not after the row's position (and exists) */                 \
            __mmask16 valid[TILE];                                                                           \
            const int masked = t0 + TILE - 1 > pos0 || nk < TILE;                                            \
            __m512 mx = _mm512_set1_ps(-INFINITY);                                                           \
            for (int j = 0; j < TILE; j++) {                                                                 \
                valid[j] = !masked ? (__mmask16)0xFFFF                                                       \
                    : j < nk ? _mm512_cmpge_epi32_mask(rowpos, _mm512_set1_epi32((int)(t0 + j))) : 0;        \
                mx = _mm512_mask_max_ps(mx, valid[j], mx, s[j]);                                             \
            }                                                                                                \
            const __m512 mnew = _mm512_max_ps(m, mx);                                                        \
            const __m512 alpha = exp512(_mm512_sub_ps(m, mnew));                                             \
            __m512 sum = _mm512_setzero_ps();                                                                \
            for (int j = 0; j < TILE; j++) {                                                                 \
                const __m512 p = _mm512_maskz_mov_ps(valid[j], exp512(_mm512_sub_ps(s[j], mnew)));           \
                sum = _mm512_add_ps(sum, p);                                                                 \
                _mm512_store_ps(P + j * TILE, p);                                                            \
            }                                                                                                \
            l = _mm512_fmadd_ps(l, alpha, sum);                                                              \
            m = mnew;                                                                                        \
            for (int64_t d0 = 0; d0 < D; d0 += 8) {                                                          \
                __m512 acc[8];                                                                               \
                for (int i = 0; i < 8; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(OT + (d0 + i) * TILE), alpha); \
                for (int64_t j = 0; j < nk; j++) {                                                           \
                    const __m512 p = _mm512_load_ps(P + j * TILE);                                           \
                    const float *v = vp + j * ks + d0;                                                       \
                    for (int i = 0; i < 8; i++) acc[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(v[i]), acc[i]);   \
                }                                                                                            \
                for (int i = 0; i < 8; i++) _mm512_store_ps(OT + (d0 + i) * TILE, acc[i]);                   \
            }                                                                                                \
        }                                                                                                    \
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);                                           \
        float o[TILE] __attribute__((aligned(64)));                                                          \
        for (int64_t d = 0; d < D; d++) {                                                                    \
            _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(OT + d * TILE), inv));                           \
            for (int64_t r = 0; r < rows; r++) out[r * ld + d] = o[r];                                       \
        }                                                                                                    \
    }
DEFINE_TILE(4)
DEFINE_TILE(8)

/* Every prefill slice of a step: slice i's query rows start at row starts[i] of q ([T, H, D] fp32, rows q_ld
 * floats apart, each row's heads contiguous: a view of the fused q|k|v projection) and of out ([T, H, D],
 * contiguous), nqs[i] of them, at the last positions of its kv_lens[i] tokens, whose blocks are row i of
 * ``tables`` ([n, maxb]). Returns 0, or -1 for a head dim it has no copy for (the caller falls back). */
int kvmesh_paged_prefill_f32(const float *q, int64_t q_ld, const float *kc, const float *vc, float *out,
                             int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t n, const int64_t *starts,
                             const int64_t *nqs, const int64_t *kv_lens, const int64_t *tables, int64_t maxb,
                             float scale) {
    if (D != 64 && D != 128) return -1;
    const int64_t G = H / Hkv, ld = H * D;
    for (int64_t i = 0; i < n; i++) {
        const int64_t first = kv_lens[i] - nqs[i];
        for (int64_t head = 0; head < H; head++)
            for (int64_t r0 = 0; r0 < nqs[i]; r0 += TILE) {
                const int64_t rows = nqs[i] - r0 < TILE ? nqs[i] - r0 : TILE, row = starts[i] + r0;
                const float *qt = q + row * q_ld + head * D;
                float *ot = out + (row * H + head) * D;
                if (D == 64) tile_d4(qt, q_ld, ot, ld, rows, first + r0, kc, vc, tables + i * maxb, bs, Hkv, head / G,
                                     scale);
                else tile_d8(qt, q_ld, ot, ld, rows, first + r0, kc, vc, tables + i * maxb, bs, Hkv, head / G, scale);
            }
    }
    return 0;
}
#else
int kvmesh_paged_prefill_available(void) { return 0; }

int kvmesh_paged_prefill_f32(const float *q, int64_t q_ld, const float *kc, const float *vc, float *out,
                             int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t n, const int64_t *starts,
                             const int64_t *nqs, const int64_t *kv_lens, const int64_t *tables, int64_t maxb,
                             float scale) {
    (void)q; (void)q_ld; (void)kc; (void)vc; (void)out; (void)H; (void)Hkv; (void)D; (void)bs; (void)n;
    (void)starts; (void)nqs; (void)kv_lens; (void)tables; (void)maxb; (void)scale;
    return -1;
}
#endif
