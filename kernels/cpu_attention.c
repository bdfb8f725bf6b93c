/* Decode attention on the CPU straight from the paged KV cache (kernels/cpu_attention.py).
 *
 * The torch path gathers every sequence's keys and values into a padded copy, masks the
 * padding and runs SDPA: per layer it reads the KV three times and writes it once. Here
 * each (sequence, kv head) pair reads its keys and values in place, once, for all the
 * query heads of its group: scores, a softmax with glibc's vector expf (libmvec), and the
 * weighted sum of values. Pairs are split across threads with OpenMP (the libgomp torch
 * loaded). fp32 throughout; head_dim must be a multiple of 16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_scratch.h"

#define MAX_GROUP 16
#define MAX_HEADS 1024  /* query heads one unit of work may hold */

int attn_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>

__m512 _ZGVeN16v_expf(__m512);  /* glibc libmvec */

static __thread struct scratch scores;

static float *scores_for(size_t n) { return scratch_grow(&scores, n * sizeof(float)); }

static inline float dot(const float *a, const float *b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* p[0:n] = exp(p - max), returns the sum */
static inline float exp_shifted(float *p, int64_t n) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = p[i] > mx ? p[i] : mx;
    __m512 vmx = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(p + i), vmx));
        _mm512_storeu_ps(p + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + i), vmx));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(p + i, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    return _mm512_reduce_add_ps(vsum);
}

#define PREFETCH_AHEAD 4  /* keys */

static inline void prefetch_row(const float *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Query heads of kv heads [kv0, kv0 + nkv) of one sequence over its n keys. Keys are read
 * key by key for all those kv heads at once: with every kv head (nkv == kv_heads) a key's
 * row is one contiguous read, and a block's keys stream in order. */
static void attend(const float *q, const float *k, const float *v, const int64_t *keys, int64_t n,
                   int64_t kv0, int64_t nkv, int64_t kv_heads, int64_t group, int64_t d,
                   float scale, float *out) {
    int64_t heads = nkv * group;
    float *p = scores_for((size_t)(heads * n));
    const float *qh = q + kv0 * group * d;
    int64_t row_bytes = nkv * d * (int64_t)sizeof(float);
    for (int64_t l = 0; l < n; l++) {
        const float *kr = k + (keys[l] * kv_heads + kv0) * d;
        if (l + PREFETCH_AHEAD < n)  /* the key ahead, and this key's value for the next pass */
            prefetch_row(k + (keys[l + PREFETCH_AHEAD] * kv_heads + kv0) * d, row_bytes);
        prefetch_row(v + (keys[l] * kv_heads + kv0) * d, row_bytes);
        for (int64_t h = 0; h < heads; h++)
            p[h * n + l] = dot(qh + h * d, kr + (h / group) * d, d) * scale;
    }
    float inv[MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) inv[h] = 1.0f / exp_shifted(p + h * n, n);
    float *oh = out + kv0 * group * d;
    for (int64_t i = 0; i < heads * d; i += 16) _mm512_storeu_ps(oh + i, _mm512_setzero_ps());
    for (int64_t l = 0; l < n; l++) {
        const float *vr = v + (keys[l] * kv_heads + kv0) * d;
        for (int64_t j = 0; j < nkv; j++)
            for (int64_t i = 0; i < d; i += 16) {
                __m512 vv = _mm512_loadu_ps(vr + j * d + i);
                for (int64_t g = 0; g < group; g++) {
                    int64_t h = j * group + g;
                    float *o = oh + h * d + i;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(p[h * n + l]), vv,
                                                        _mm512_loadu_ps(o)));
                }
            }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *o = oh + h * d;
        __m512 s = _mm512_set1_ps(inv[h]);
        for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), s));
    }
}
#endif

/* q [B, H, D] rows (row b at q + rows[b] * q_row_stride, head stride D); k/v [slots, KVH, D];
 * keys [B, L] int64 cache slots, the first counts[b] valid; out [B, H, D] contiguous.
 * Returns 0, or -1 when the shapes are not supported. */
int decode_attention_f32(const float *q, const int64_t *rows, int64_t q_row_stride,
                         const float *k, const float *v, const int64_t *keys,
                         const int64_t *counts, int64_t B, int64_t L, int64_t H,
                         int64_t kv_heads, int64_t d, float scale, float *out, int threads) {
#if defined(__AVX512F__)
    if (d % 16 || H % kv_heads || H / kv_heads > MAX_GROUP) return -1;
    int64_t group = H / kv_heads;
    /* whole sequences when there are enough to share out, else (sequence, kv head) pairs */
    int64_t split = B >= 2 * threads && H <= MAX_HEADS ? 1 : kv_heads;
    int64_t nkv = kv_heads / split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && B * split > 1)
    for (int64_t unit = 0; unit < B * split; unit++) {
        int64_t b = unit / split, kv0 = (unit % split) * nkv;
        const float *qb = q + (rows ? rows[b] : b) * q_row_stride;
        attend(qb, k, v, keys + b * L, counts[b], kv0, nkv, kv_heads, group, d, scale,
               out + b * H * d);
    }
    return 0;
#else
    (void)q; (void)rows; (void)q_row_stride; (void)k; (void)v; (void)keys; (void)counts;
    (void)B; (void)L; (void)H; (void)kv_heads; (void)d; (void)scale; (void)out; (void)threads;
    return -1;
#endif
}
