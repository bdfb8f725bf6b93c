/* Decode attention on the CPU straight from the paged KV cache (kernels/cpu_attention.py).
 *
 * The torch path gathers every sequence's keys and values into a padded copy, masks the
 * padding and runs SDPA: per layer it reads the KV three times and writes it once. Here
 * each unit of work reads its keys and values in place, once, for all the query heads of
 * their groups: scores, a softmax with glibc's vector expf (libmvec), and the weighted sum
 * of values. Units are split across threads with OpenMP (the libgomp torch loaded). fp32
 * arithmetic over fp32 or bf16 caches (decode_attention_f32 / _bf16: a bf16 element widens
 * to fp32 exactly, so the two agree bit for bit on the same values); head_dim must be a
 * multiple of 16.
 *
 * What sets its speed at a batch-64 decode (SmolLM2's heads, 129 keys; `duplex bench
 * attention`): not the bytes alone but the work per key. A key's scores are FMA chains over
 * head_dim whose horizontal sums are done 16 keys at a time (sum16), each key's row is
 * loaded once for up to 4 heads, and the weighted values stay in registers over all keys
 * instead of being loaded and stored per key: 1.0 -> 0.7 ms a layer on fp32 caches, and
 * 0.5 ms on bf16 ones, whose half-size rows then matter.
 *
 * From DRAM (a step's layers each read their own cache) what sets it is how many rows are
 * on their way: besides the row 4 keys ahead into L1, the walk (AVX512 and AVX2) asks for
 * the rows 16 keys ahead into L2, and a sequence longer than a chunk (AVX512: 1 MB of keys
 * and values, 512 keys of 8 x 64 bf16 heads; AVX2: 512 KB) is cut into chunks, each a unit
 * of work whose values are still in L2 when its value pass reads them; the chunks' partial
 * results are merged afterwards. 1B shape, 16 sequences, bf16 (docs/BENCHMARKS.md): 430
 * keys 1.1 -> 0.77 ms a layer, 4096 keys 12-14 -> 8.4 ms; one sequence of 4096 keys 1.0 ->
 * 0.5 ms (its chunks on both cores).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scratch.h"

#define MAX_GROUP 16
#define MAX_HEADS 1024  /* query heads one unit of work may hold */

int attn_available(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#define PREFETCH_AHEAD 4  /* keys */
#define FAR_AHEAD 16      /* keys: rows asked for into L2 */

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}
static inline void prefetch_l2(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}
#endif

#if defined(__AVX512F__)
__m512 _ZGVeN16v_expf(__m512);  /* glibc libmvec */

static __thread struct scratch scores;

static __thread struct scratch tiles;

static float *scores_for(size_t n) { return scratch_grow(&scores, n * sizeof(float)); }
/* n 64-byte-aligned vectors */
static void *scores_for_tiles(size_t n) {
    float *base = scratch_grow(&tiles, (n + 1) * sizeof(__m512));
    return base ? (void *)(((uintptr_t)base + 63) & ~(uintptr_t)63) : NULL;
}

/* a 16-lane fp32 vector from 16 cache elements: fp32 as is, bf16 widened (its 16 bits are
 * the high half of the fp32 it stands for, so the widening is exact) */
static inline __m512 load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 dot products' partial vectors -> one vector of their 16 sums, lane i the sum of acc[i].
 * Each sum pairs its lanes exactly as _mm512_reduce_add_ps does (i with i+8, then i+4, then
 * i+2, then i+1; float addition commutes), so a score is bitwise the one-at-a-time one. */
static inline __m512 sum16(const __m512 *acc) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* [x.q0 + x.q2, x.q1 + x.q3, y.q0 + y.q2, y.q1 + y.q3] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quarters: the 4-lane partial sums of 4 dots */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)  /* per quarter: lanes (0,2) and (1,3) of two dots */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    /* lane 4q + r holds dot 4r + q... of the order the shuffles left: put dot i in lane i */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s);
}

/* p[0:n] = exp(p - mx), returns the sum */
static inline float exp_shifted(float *p, int64_t n, float mx) {
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

#define KEY_TILE 16       /* keys scored together (one sum16) */
#define QK_HEADS 4        /* query heads scored against one load of a key */
#define PV_HEADS 4        /* query heads ... */
#define PV_VECS 4         /* ... by 16-lane pieces of head_dim: the accumulators in registers */

/* attend_T: query heads of kv heads [kv0, kv0 + nkv) of one sequence over its n keys, for
 * caches of element type T read through LOAD.
 * Scores: keys are read key by key for all those kv heads at once (with every kv head a
 * key's row is one contiguous read, and a block's keys stream in order); each head's dot
 * with a key is a chain of FMAs over head_dim, and 16 keys' chains are summed together.
 * Weighted values: a tile of up to PV_HEADS heads x PV_VECS vectors of one kv head's group
 * is accumulated in registers over all keys, in key order as a one-key-at-a-time sum would
 * be, and scaled by the softmax's 1/sum once. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                          \
static int NAME(const float *q, const T *k, const T *v, const int64_t *keys, int64_t n,       \
                 int64_t ahead, int64_t kv0, int64_t nkv, int64_t kv_heads, int64_t group,     \
                 int64_t d, float scale, float *out, float *mx_out, float *sum_out) {          \
    int64_t heads = nkv * group;                                                               \
    float *p = scores_for((size_t)(heads * (n + KEY_TILE)));                                   \
    __m512 *acc = (__m512 *)scores_for_tiles((size_t)(heads * KEY_TILE));                     \
    if (!p || !acc) return -1;  /* out of memory */                                            \
    const float *qh = q + kv0 * group * d;                                                     \
    int64_t row_bytes = nkv * d * (int64_t)sizeof(T);                                          \
    float mx[MAX_HEADS];                                                                       \
    for (int64_t h = 0; h < heads; h++) mx[h] = -INFINITY;                                     \
    for (int64_t l0 = 0; l0 < n; l0 += KEY_TILE) {                                             \
        int64_t tile = n - l0 < KEY_TILE ? n - l0 : KEY_TILE;                                  \
        for (int64_t t = 0; t < tile; t++) {                                                   \
            int64_t l = l0 + t;                                                                \
            const T *kr = k + (keys[l] * kv_heads + kv0) * d;                                  \
            if (l + PREFETCH_AHEAD < ahead)  /* the key ahead, this key's value for later */   \
                prefetch_row(k + (keys[l + PREFETCH_AHEAD] * kv_heads + kv0) * d, row_bytes);  \
            prefetch_row(v + (keys[l] * kv_heads + kv0) * d, row_bytes);                       \
            if (l + FAR_AHEAD < ahead) {  /* and far ahead into L2 */                          \
                prefetch_l2(k + (keys[l + FAR_AHEAD] * kv_heads + kv0) * d, row_bytes);        \
                prefetch_l2(v + (keys[l + FAR_AHEAD] * kv_heads + kv0) * d, row_bytes);        \
            }                                                                                  \
            for (int64_t j = 0; j < nkv; j++)                                                  \
                for (int64_t g0 = 0; g0 < group; g0 += QK_HEADS) {                             \
                    int64_t nh = group - g0 < QK_HEADS ? group - g0 : QK_HEADS;                \
                    const float *qr = qh + (j * group + g0) * d;                               \
                    __m512 a[QK_HEADS];                                                        \
                    _Pragma("GCC unroll 4") for (int u = 0; u < QK_HEADS; u++)                 \
                        a[u] = _mm512_setzero_ps();                                            \
                    for (int64_t i = 0; i < d; i += 16) {                                      \
                        __m512 kv = LOAD(kr + j * d + i);                                      \
                        _Pragma("GCC unroll 4") for (int u = 0; u < QK_HEADS; u++)             \
                            if (u < nh)                                                        \
                                a[u] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + u * d + i), kv, a[u]); \
                    }                                                                          \
                    _Pragma("GCC unroll 4") for (int u = 0; u < QK_HEADS; u++)                 \
                        if (u < nh) acc[(j * group + g0 + u) * KEY_TILE + t] = a[u];           \
                }                                                                              \
        }                                                                                      \
        __mmask16 live = (__mmask16)((1u << tile) - 1);                                        \
        for (int64_t h = 0; h < heads; h++) {                                                  \
            __m512 *ah = acc + h * KEY_TILE;                                                   \
            for (int64_t t = tile; t < KEY_TILE; t++) ah[t] = _mm512_setzero_ps();             \
            __m512 sc = _mm512_mul_ps(sum16(ah), _mm512_set1_ps(scale));                       \
            _mm512_mask_storeu_ps(p + h * n + l0, live, sc);                                   \
            float tmax = _mm512_mask_reduce_max_ps(live, sc);                                  \
            mx[h] = tmax > mx[h] ? tmax : mx[h];                                               \
        }                                                                                      \
    }                                                                                          \
    float inv[MAX_HEADS];                                                                      \
    for (int64_t h = 0; h < heads; h++) {                                                      \
        float sum = exp_shifted(p + h * n, n, mx[h]);                                          \
        if (mx_out) mx_out[h] = mx[h], sum_out[h] = sum;                                       \
        inv[h] = mx_out ? 1.0f : 1.0f / sum;  /* a chunk's part stays unnormalized */           \
    }                                                                                          \
    float *oh = out + kv0 * group * d;                                                         \
    for (int64_t j = 0; j < nkv; j++)                                                          \
        for (int64_t g0 = 0; g0 < group; g0 += PV_HEADS)                                       \
            for (int64_t c0 = 0; c0 < d; c0 += 16 * PV_VECS) {                                 \
                int64_t nh = group - g0 < PV_HEADS ? group - g0 : PV_HEADS;                    \
                int64_t nv = (d - c0) / 16 < PV_VECS ? (d - c0) / 16 : PV_VECS;                \
                int64_t h0 = j * group + g0;                                                   \
                __m512 o[PV_HEADS][PV_VECS];                                                   \
                _Pragma("GCC unroll 4") for (int a = 0; a < PV_HEADS; a++)                     \
                _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)                      \
                    o[a][u] = _mm512_setzero_ps();                                             \
                for (int64_t l = 0; l < n; l++) {                                              \
                    const T *vr = v + (keys[l] * kv_heads + kv0 + j) * d + c0;                 \
                    __m512 vv[PV_VECS];                                                        \
                    _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)                  \
                        vv[u] = u < nv ? LOAD(vr + 16 * u) : _mm512_setzero_ps();              \
                    _Pragma("GCC unroll 4") for (int a = 0; a < PV_HEADS; a++) {               \
                        if (a >= nh) break;                                                    \
                        __m512 w = _mm512_set1_ps(p[(h0 + a) * n + l]);                        \
                        _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)              \
                            o[a][u] = _mm512_fmadd_ps(w, vv[u], o[a][u]);                      \
                    }                                                                          \
                }                                                                              \
                _Pragma("GCC unroll 4") for (int a = 0; a < PV_HEADS; a++) {                   \
                    if (a >= nh) break;                                                        \
                    __m512 s = _mm512_set1_ps(inv[h0 + a]);                                    \
                    _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)                  \
                        if (u < nv)                                                            \
                            _mm512_storeu_ps(oh + (h0 + a) * d + c0 + 16 * u,                  \
                                             _mm512_mul_ps(o[a][u], s));                       \
                }                                                                              \
            }                                                                                  \
    return 0;                                                                                  \
}

DEFINE_ATTEND(attend_f32, float, load_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, load_bf16)


#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* ------------------------------------------------ AVX2 (no AVX512: most laptops, Zen 1-3)
 *
 * The same walk as the AVX512 attend in 8-lane vectors: a key's row read once for up to
 * QK_HEADS query heads of its group, each score an FMA chain over head_dim summed
 * horizontally, the softmax's exponentials through libmvec's 8-lane expf, and a tile of
 * PV_HEADS heads x PV_VECS vectors of the weighted values in registers over all keys; the
 * same prefetches (4 keys ahead into L1, 16 into L2) and the same chunks (CHUNK_BYTES). */

__m256 _ZGVdN8v_expf(__m256);  /* glibc libmvec */

static __thread struct scratch scores;

static float *scores_for(size_t n) { return scratch_grow(&scores, n * sizeof(float)); }

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {  /* widened exactly */
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float attn_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* p[0:n] = exp(p - mx), returns the sum (the last partial vector padded with -inf: exp 0) */
static inline float exp_shifted(float *p, int64_t n, float mx) {
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(p + i), vmx));
        _mm256_storeu_ps(p + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (i < n) {
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = i + j < n ? p[i + j] : -INFINITY;
        __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(tail), vmx));
        _mm256_storeu_ps(tail, e);
        for (int j = 0; i + j < n; j++) p[i + j] = tail[j];
        vsum = _mm256_add_ps(vsum, e);
    }
    return attn_hsum8(vsum);
}

#define QK_HEADS 4  /* query heads scored against one load of a key */
#define PV_HEADS 3  /* query heads ... */
#define PV_VECS 4   /* ... by 8-lane pieces of head_dim: the accumulators in registers */

#define DEFINE_ATTEND(NAME, T, LOAD)                                                          \
static int NAME(const float *q, const T *k, const T *v, const int64_t *keys, int64_t n,       \
                 int64_t ahead, int64_t kv0, int64_t nkv, int64_t kv_heads, int64_t group,     \
                 int64_t d, float scale, float *out, float *mx_out, float *sum_out) {          \
    int64_t heads = nkv * group;                                                               \
    float *p = scores_for((size_t)(heads * n));                                                \
    if (!p) return -1;  /* out of memory */                                                    \
    const float *qh = q + kv0 * group * d;                                                     \
    int64_t row_bytes = nkv * d * (int64_t)sizeof(T);                                          \
    float mx[MAX_HEADS];                                                                       \
    for (int64_t h = 0; h < heads; h++) mx[h] = -INFINITY;                                     \
    for (int64_t l = 0; l < n; l++) {                                                          \
        const T *kr = k + (keys[l] * kv_heads + kv0) * d;                                      \
        if (l + PREFETCH_AHEAD < ahead)  /* the key ahead, this key's value for later */       \
            prefetch_row(k + (keys[l + PREFETCH_AHEAD] * kv_heads + kv0) * d, row_bytes);      \
        prefetch_row(v + (keys[l] * kv_heads + kv0) * d, row_bytes);                           \
        if (l + FAR_AHEAD < ahead) {  /* and far ahead into L2 */                              \
            prefetch_l2(k + (keys[l + FAR_AHEAD] * kv_heads + kv0) * d, row_bytes);            \
            prefetch_l2(v + (keys[l + FAR_AHEAD] * kv_heads + kv0) * d, row_bytes);            \
        }                                                                                      \
        for (int64_t j = 0; j < nkv; j++)                                                      \
            for (int64_t g0 = 0; g0 < group; g0 += QK_HEADS) {                                 \
                int64_t nh = group - g0 < QK_HEADS ? group - g0 : QK_HEADS;                    \
                const float *qr = qh + (j * group + g0) * d;                                   \
                __m256 a[QK_HEADS];                                                            \
                _Pragma("GCC unroll 4") for (int u = 0; u < QK_HEADS; u++)                     \
                    a[u] = _mm256_setzero_ps();                                                \
                for (int64_t i = 0; i < d; i += 8) {                                           \
                    __m256 kv = LOAD(kr + j * d + i);                                          \
                    _Pragma("GCC unroll 4") for (int u = 0; u < QK_HEADS; u++)                 \
                        if (u < nh)                                                            \
                            a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + u * d + i), kv, a[u]); \
                }                                                                              \
                _Pragma("GCC unroll 4") for (int u = 0; u < QK_HEADS; u++) {                   \
                    if (u >= nh) break;                                                        \
                    int64_t h = j * group + g0 + u;                                            \
                    float sc = attn_hsum8(a[u]) * scale;                                            \
                    p[h * n + l] = sc;                                                         \
                    mx[h] = sc > mx[h] ? sc : mx[h];                                           \
                }                                                                              \
            }                                                                                  \
    }                                                                                          \
    float inv[MAX_HEADS];                                                                      \
    for (int64_t h = 0; h < heads; h++) {                                                      \
        float sum = exp_shifted(p + h * n, n, mx[h]);                                          \
        if (mx_out) mx_out[h] = mx[h], sum_out[h] = sum;                                       \
        inv[h] = mx_out ? 1.0f : 1.0f / sum;  /* a chunk's part stays unnormalized */           \
    }                                                                                          \
    float *oh = out + kv0 * group * d;                                                         \
    for (int64_t j = 0; j < nkv; j++)                                                          \
        for (int64_t g0 = 0; g0 < group; g0 += PV_HEADS)                                       \
            for (int64_t c0 = 0; c0 < d; c0 += 8 * PV_VECS) {                                  \
                int64_t nh = group - g0 < PV_HEADS ? group - g0 : PV_HEADS;                    \
                int64_t nv = (d - c0) / 8 < PV_VECS ? (d - c0) / 8 : PV_VECS;                  \
                int64_t h0 = j * group + g0;                                                   \
                __m256 o[PV_HEADS][PV_VECS];                                                   \
                _Pragma("GCC unroll 3") for (int a = 0; a < PV_HEADS; a++)                     \
                _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)                      \
                    o[a][u] = _mm256_setzero_ps();                                             \
                for (int64_t l = 0; l < n; l++) {                                              \
                    const T *vr = v + (keys[l] * kv_heads + kv0 + j) * d + c0;                 \
                    __m256 vv[PV_VECS];                                                        \
                    _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)                  \
                        vv[u] = u < nv ? LOAD(vr + 8 * u) : _mm256_setzero_ps();               \
                    _Pragma("GCC unroll 3") for (int a = 0; a < PV_HEADS; a++) {               \
                        if (a >= nh) break;                                                    \
                        __m256 w = _mm256_set1_ps(p[(h0 + a) * n + l]);                        \
                        _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)              \
                            o[a][u] = _mm256_fmadd_ps(w, vv[u], o[a][u]);                      \
                    }                                                                          \
                }                                                                              \
                _Pragma("GCC unroll 3") for (int a = 0; a < PV_HEADS; a++) {                   \
                    if (a >= nh) break;                                                        \
                    __m256 s = _mm256_set1_ps(inv[h0 + a]);                                    \
                    _Pragma("GCC unroll 4") for (int u = 0; u < PV_VECS; u++)                  \
                        if (u < nv)                                                            \
                            _mm256_storeu_ps(oh + (h0 + a) * d + c0 + 8 * u,                   \
                                             _mm256_mul_ps(o[a][u], s));                       \
                }                                                                              \
            }                                                                                  \
    return 0;                                                                                  \
}

DEFINE_ATTEND(attend_f32, float, load8_f32)
DEFINE_ATTEND(attend_bf16, uint16_t, load8_bf16)
#endif

/* q [B, H, D] rows (row b at q + rows[b] * q_row_stride, head stride D); k/v [slots, KVH, D]
 * of fp32 (decode_attention_f32) or bf16 (decode_attention_bf16); keys [B, L] int64 cache
 * slots, the first counts[b] valid; out [B, H, D] contiguous fp32.
 * Returns 0, or -1 when the shapes are not supported. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
#define CHUNK_BYTES ((int64_t)1 << 20)
#define VLANES 16
#define VF __m512
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VZERO _mm512_setzero_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#else
#define CHUNK_BYTES ((int64_t)1 << 19)
#define VLANES 8
#define VF __m256
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VZERO _mm256_setzero_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#endif

/* the walks' vector width in fp32 lanes: 16 (AVX512) or 8 (AVX2), which build is loaded */
int attn_lanes(void) { return VLANES; }

#define MERGE_MAX 64  /* chunks whose weights merge_head holds at once */
/* Keys of one unit of work: as many as make CHUNK_BYTES of keys and values (a core's L2:
 * AVX512, 1 MB as on Zen 4, 512 keys of 8 x 64 bf16 heads; AVX2, 512 KB as on Zen 2/3), in
 * 16s, 64 to 512 */
static inline int64_t chunk_keys(int64_t row_bytes) {
    int64_t n = CHUNK_BYTES / (2 * row_bytes) / 16 * 16;
    return n < 64 ? 64 : n > 512 ? 512 : n;
}

/* One head of a sequence cut into chunks: the chunks' unnormalized outputs weighted by
 * exp(chunk max - max), over the same-weighted sums, added in chunk order. */
static void merge_head(const float *part, const float *mx, const float *sum, int64_t chunks,
                       int64_t stride, int64_t d, float *out) {
    float m = -INFINITY, total = 0.0f, w[MERGE_MAX];
    for (int64_t c = 0; c < chunks; c++) m = mx[c * stride] > m ? mx[c * stride] : m;
    for (int64_t c0 = 0; c0 < chunks; c0 += MERGE_MAX) {  /* MERGE_MAX chunks at a time */
        int64_t nc = chunks - c0 < MERGE_MAX ? chunks - c0 : MERGE_MAX;
        for (int64_t c = 0; c < nc; c++) {
            w[c] = expf(mx[(c0 + c) * stride] - m);
            total += sum[(c0 + c) * stride] * w[c];
        }
        for (int64_t i = 0; i < d; i += VLANES) {
            VF acc = c0 ? VLOAD(out + i) : VZERO();
            for (int64_t c = 0; c < nc; c++)
                acc = VFMA(VSET1(w[c]), VLOAD(part + (c0 + c) * stride * d + i), acc);
            VSTORE(out + i, acc);
        }
    }
    VF inv = VSET1(1.0f / total);
    for (int64_t i = 0; i < d; i += VLANES) VSTORE(out + i, VMUL(VLOAD(out + i), inv));
}

static __thread struct scratch chunk_starts;
static __thread struct scratch chunk_parts;

/* Units of work: (sequence, chunk of its keys, kv heads). A sequence longer than a chunk is
 * cut into chunks: its keys and values are then read a cache-sized piece at a time (the
 * value pass no longer finds them evicted) and a long sequence is shared among threads.
 * Where there are too few units for the threads, each takes one kv head. A sequence's cut
 * depends on its length alone, so its result does not depend on the batch or the threads. */
#define DEFINE_DECODE(NAME, T, ATTEND)                                                        \
int NAME(const float *q, const int64_t *rows, int64_t q_row_stride, const T *k, const T *v,    \
         const int64_t *keys, const int64_t *counts, int64_t B, int64_t L, int64_t H,          \
         int64_t kv_heads, int64_t d, float scale, float *out, int threads) {                  \
    if (d % 16 || H % kv_heads || H / kv_heads > MAX_GROUP || H > MAX_HEADS) return -1;        \
    int64_t group = H / kv_heads, chunk = chunk_keys(kv_heads * d * (int64_t)sizeof(T));      \
    int64_t *first = scratch_grow(&chunk_starts, (size_t)(B + 1) * sizeof(int64_t));           \
    if (!first) return -1;                                                                     \
    first[0] = 0;                                                                              \
    for (int64_t b = 0; b < B; b++)                                                            \
        first[b + 1] = first[b] + (counts[b] > chunk ? (counts[b] + chunk - 1) / chunk : 1);   \
    int64_t chunks = first[B];                                                                 \
    float *part = NULL, *mxs = NULL, *sums = NULL;                                             \
    if (chunks > B) {                                                                          \
        part = scratch_grow(&chunk_parts, (size_t)(chunks * H * (d + 2)) * sizeof(float));     \
        if (!part) return -1;                                                                  \
        mxs = part + chunks * H * d;                                                           \
        sums = mxs + chunks * H;                                                               \
    }                                                                                          \
    int64_t split = chunks >= 2 * threads ? 1 : kv_heads, nkv = kv_heads / split;              \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(threads) if (threads > 1 && chunks * split > 1) reduction(|:failed)") \
    {                                                                                          \
        int64_t b = 0;                                                                         \
        _Pragma("omp for schedule(dynamic, 1)")                                                \
        for (int64_t unit = 0; unit < chunks * split; unit++) {                                \
            int64_t u = unit / split, kv0 = (unit % split) * nkv, h0 = kv0 * group;            \
            while (first[b + 1] <= u) b++;                                                     \
            while (first[b] > u) b--;                                                          \
            const float *qb = q + (rows ? rows[b] : b) * q_row_stride;                         \
            const int64_t *kb = keys + b * L;                                                  \
            if (first[b + 1] - first[b] == 1) {                                                \
                failed |= ATTEND(qb, k, v, kb, counts[b], counts[b], kv0, nkv, kv_heads,       \
                                 group, d, scale, out + b * H * d, NULL, NULL) != 0;           \
            } else {                                                                           \
                int64_t l0 = (u - first[b]) * chunk;                                           \
                int64_t n = counts[b] - l0 < chunk ? counts[b] - l0 : chunk;                   \
                failed |= ATTEND(qb, k, v, kb + l0, n, counts[b] - l0, kv0, nkv, kv_heads,     \
                                 group, d, scale, part + u * H * d, mxs + u * H + h0,          \
                                 sums + u * H + h0) != 0;                                      \
            }                                                                                  \
        }                                                                                      \
        if (part) {                                                                            \
            _Pragma("omp for schedule(dynamic, 1)")                                            \
            for (int64_t s = 0; s < B * H; s++) {                                              \
                int64_t sb = s / H, h = s % H, c0 = first[sb], nc = first[sb + 1] - c0;        \
                if (nc > 1)                                                                    \
                    merge_head(part + (c0 * H + h) * d, mxs + c0 * H + h, sums + c0 * H + h,   \
                               nc, H, d, out + (sb * H + h) * d);                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    return failed ? -1 : 0;                                                                    \
}

DEFINE_DECODE(decode_attention_f32, float, attend_f32)
DEFINE_DECODE(decode_attention_bf16, uint16_t, attend_bf16)
#else
#define DEFINE_DECODE(NAME, T, ATTEND)                                                        \
int NAME(const float *q, const int64_t *rows, int64_t q_row_stride, const T *k, const T *v,    \
         const int64_t *keys, const int64_t *counts, int64_t B, int64_t L, int64_t H,          \
         int64_t kv_heads, int64_t d, float scale, float *out, int threads) {                  \
    (void)q; (void)rows; (void)q_row_stride; (void)k; (void)v; (void)keys; (void)counts;       \
    (void)B; (void)L; (void)H; (void)kv_heads; (void)d; (void)scale; (void)out; (void)threads; \
    return -1;                                                                                 \
}
DEFINE_DECODE(decode_attention_f32, float, attend_f32)
DEFINE_DECODE(decode_attention_bf16, uint16_t, attend_bf16)
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* ------------------------------------------------ prompt attention (AVX512 or AVX2)
 *
 * Q queries of one sequence (positions L - Q .. L - 1) over its L keys, query i seeing keys
 * 0 .. L - Q + i, as flash attention: a unit of work is PF_ROWS positions x the heads of one
 * kv head's group, its running max, sum and output kept over key tiles of 16. A tile's keys
 * are widened and transposed once ([head_dim][16 keys]) for all the unit's rows, so a row's
 * 16 scores are head_dim FMAs of a broadcast query element against a register of 16 keys
 * (no horizontal sums); the softmax's exponentials take 16 scores (or 16 rows' corrections)
 * a libmvec call; values are widened once a tile and accumulated 4 rows x 64 dims at a
 * time in registers. A row's tiles start at key 0 and its masked keys add exactly nothing,
 * so a position's output does not depend on how its prompt is cut into steps. On 2 Zen 4
 * cores (`duplex bench attention --queries N`, 1B heads): 59-74 G multiply-adds/s against
 * torch's fused attention's 29-62, 0.50x its time for a 267-token prompt, 0.82-0.85x at
 * 2048 keys (docs/BENCHMARKS.md).
 *
 * The same walk runs on AVX2 without AVX512 (most laptops, Zen 1-3) in 8-lane vectors: key
 * tiles of 8 (an 8 x 8 register transpose), masked scores by a compare and a blend, libmvec's
 * 8-lane expf, 4 rows x 3 vectors of values in registers (pf_* below: one definition of each
 * operation per instruction set). */
#define PF_ROWS 16   /* query positions of a unit */
#define PF_MAX_R 256 /* rows (positions x heads of a group) of a unit */

static __thread struct scratch pf_scratch;

#if defined(__AVX512F__)
#define PF_TILE 16   /* keys a tile: one vector of scores */
#define PV_NC 4      /* vectors of head_dim a row's values hold in registers */
typedef __m512 pf_vec;
#define pf_load _mm512_load_ps
#define pf_loadu _mm512_loadu_ps
#define pf_store _mm512_store_ps
#define pf_storeu _mm512_storeu_ps
#define pf_zero _mm512_setzero_ps
#define pf_set1 _mm512_set1_ps
#define pf_mul _mm512_mul_ps
#define pf_sub _mm512_sub_ps
#define pf_fma _mm512_fmadd_ps
#define pf_exp _ZGVeN16v_expf
#define pf_hsum _mm512_reduce_add_ps
#define pf_transpose transpose16_ps
#define pf_load_f32 load_f32
#define pf_load_bf16 load_bf16

/* r[x] = column x of the 16 x 16 matrix whose row t is r[t] (unpack, shuffle, two 128-bit
 * lane shuffles: 64 operations where element-wise copies take 256 loads and stores) */
static inline void transpose16_ps(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(u[8 * i + j], u[8 * i + 4 + j], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    }
}

/* a row's scores with the keys it does not see (lanes `seen` on) at -inf; *tmax: their max */
static inline pf_vec pf_live(pf_vec a, int64_t seen, float *tmax) {
    __mmask16 live = seen >= 16 ? (__mmask16)0xFFFF
                   : seen <= 0 ? (__mmask16)0 : (__mmask16)((1u << seen) - 1);
    *tmax = live ? _mm512_mask_reduce_max_ps(live, a) : -INFINITY;
    return _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), a);
}
#else
#define PF_TILE 8
#define PV_NC 3
typedef __m256 pf_vec;
#define pf_load _mm256_load_ps
#define pf_loadu _mm256_loadu_ps
#define pf_store _mm256_store_ps
#define pf_storeu _mm256_storeu_ps
#define pf_zero _mm256_setzero_ps
#define pf_set1 _mm256_set1_ps
#define pf_mul _mm256_mul_ps
#define pf_sub _mm256_sub_ps
#define pf_fma _mm256_fmadd_ps
#define pf_exp _ZGVdN8v_expf
#define pf_hsum attn_hsum8
#define pf_transpose transpose8_ps
#define pf_load_f32 load8_f32
#define pf_load_bf16 load8_bf16

/* r[x] = column x of the 8 x 8 matrix whose row t is r[t] */
static inline void transpose8_ps(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline pf_vec pf_live(pf_vec a, int64_t seen, float *tmax) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), a,
                                _mm256_cmp_ps(lane, _mm256_set1_ps((float)seen), _CMP_LT_OQ));
    *tmax = hmax8(v);
    return v;
}
#endif

/* NR rows' PF_TILE scores against a transposed key tile kt [d][PF_TILE]: NR FMA chains, each
 * element of a row's query broadcast (a constant NR: no per-row branch in the loop) */
static inline __attribute__((always_inline)) void pf_scores(const float *qs, const float *kt,
                                                            int64_t d, const int NR, pf_vec *a) {
    _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) a[u] = pf_zero();
    for (int64_t c = 0; c < d; c++) {
        pf_vec kc = pf_load(kt + c * PF_TILE);
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++)
            if (u < NR) a[u] = pf_fma(pf_set1(qs[u * d + c]), kc, a[u]);
    }
}

/* NR rows' outputs os[r][V c0 .. V (c0 + NC)) (V: a vector's lanes) = os * alpha[r] + sum over
 * the tile's keys of s[r][t] vw[t]: NR x NC accumulators in registers */
static inline __attribute__((always_inline)) void pf_values(const float *s, const float *vw,
                                                            float *os, const float *alpha,
                                                            int64_t d, int64_t c0, int64_t tile,
                                                            const int NR, const int NC) {
    const int V = PF_TILE;
    pf_vec o[4][PV_NC];
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
        pf_vec al = pf_set1(u < NR ? alpha[u] : 0.0f);
        _Pragma("GCC unroll 4") for (int w = 0; w < PV_NC; w++)
            o[u][w] = u < NR && w < NC ? pf_mul(pf_load(os + u * d + V * (c0 + w)), al) : pf_zero();
    }
    for (int64_t t = 0; t < tile; t++) {
        pf_vec vv[PV_NC];
        _Pragma("GCC unroll 4") for (int w = 0; w < PV_NC; w++)
            vv[w] = w < NC ? pf_load(vw + t * d + V * (c0 + w)) : pf_zero();
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
            if (u >= NR) break;
            pf_vec pu = pf_set1(s[u * PF_TILE + t]);
            _Pragma("GCC unroll 4") for (int w = 0; w < PV_NC; w++)
                if (w < NC) o[u][w] = pf_fma(pu, vv[w], o[u][w]);
        }
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++)
        _Pragma("GCC unroll 4") for (int w = 0; w < PV_NC; w++)
            if (u < NR && w < NC) pf_store(os + u * d + V * (c0 + w), o[u][w]);
}

#define DEFINE_PREFILL(NAME, T, LOADV)                                                        \
static int NAME##_unit(const float *q, int64_t q_stride, const T *k, const T *v,              \
                       const int64_t *keys, int64_t L, int64_t Q, int64_t i0, int64_t nq,      \
                       int64_t j, int64_t kv_heads, int64_t group, int64_t d, float scale,     \
                       float *out, int64_t o_stride) {                                         \
    const int64_t W = PF_TILE, R = nq * group, RW = (R + W - 1) / W * W, nv = d / W;           \
    const int64_t pos0 = L - Q;                                                                \
    /* scratch: rows' queries and outputs [R][d], keys [d][W], values [W][d], scores [R][W],  \
     * running sums [R][W], maxima and corrections [R] (padded to W) */                       \
    size_t floats = (size_t)(2 * R * d + 2 * W * d + 2 * R * W + 2 * RW);                     \
    float *base = scratch_grow(&pf_scratch, floats * sizeof(float) + 64);                     \
    if (!base) return -1;                                                                      \
    float *qs = (float *)(((uintptr_t)base + 63) & ~(uintptr_t)63);                            \
    float *os = qs + R * d, *kt = os + R * d, *vw = kt + W * d, *s = vw + W * d;               \
    float *ls = s + R * W, *mx = ls + R * W, *alpha = mx + RW;                                 \
    /* row r = (position i0 + r / group, head j * group + r % group), scaled queries */       \
    for (int64_t r = 0; r < R; r++) {                                                          \
        const float *qr = q + (i0 + r / group) * q_stride + (j * group + r % group) * d;       \
        for (int64_t c = 0; c < d; c += W)                                                     \
            pf_store(qs + r * d + c, pf_mul(pf_loadu(qr + c), pf_set1(scale)));                \
        mx[r] = -INFINITY;                                                                     \
    }                                                                                          \
    memset(os, 0, (size_t)(R * d) * sizeof(float));                                           \
    memset(ls, 0, (size_t)(R * W) * sizeof(float));                                           \
    const int64_t last = pos0 + i0 + nq - 1;  /* the last key any row sees */                 \
    for (int64_t l0 = 0; l0 <= last; l0 += W) {                                                \
        int64_t tile = last + 1 - l0 < W ? last + 1 - l0 : W;                                  \
        for (int64_t t = 0; t < W; t++) {  /* values in rows (fp32) */                        \
            if (t < tile) {                                                                    \
                const T *vr = v + (keys[l0 + t] * kv_heads + j) * d;                           \
                if (t + 16 < L - l0) {                                                         \
                    prefetch_row(k + (keys[l0 + t + 16] * kv_heads + j) * d, d * (int64_t)sizeof(T)); \
                    prefetch_row(v + (keys[l0 + t + 16] * kv_heads + j) * d, d * (int64_t)sizeof(T)); \
                }                                                                              \
                for (int64_t c = 0; c < d; c += W) pf_store(vw + t * d + c, LOADV(vr + c));    \
            } else {                                                                           \
                for (int64_t c = 0; c < d; c += W) pf_store(vw + t * d + c, pf_zero());        \
            }                                                                                  \
        }                                                                                      \
        for (int64_t c = 0; c < d; c += W) {  /* keys transposed, W columns at a time */      \
            pf_vec kr[PF_TILE];                                                                \
            for (int64_t t = 0; t < W; t++)                                                    \
                kr[t] = t < tile ? LOADV(k + (keys[l0 + t] * kv_heads + j) * d + c) : pf_zero(); \
            pf_transpose(kr);                                                                  \
            for (int x = 0; x < PF_TILE; x++) pf_store(kt + (c + x) * W, kr[x]);               \
        }                                                                                      \
        /* scores, 8 rows at a time */                                                         \
        for (int64_t r0 = 0; r0 < R; r0 += 8) {                                                \
            pf_vec a[8];                                                                       \
            int64_t nr = R - r0 < 8 ? R - r0 : 8;                                              \
            if (nr == 8) pf_scores(qs + r0 * d, kt, d, 8, a);                                  \
            else pf_scores(qs + r0 * d, kt, d, (int)nr, a);                                    \
            _Pragma("GCC unroll 8") for (int u = 0; u < 8; u++) {                              \
                if (u >= nr) break;                                                            \
                int64_t r = r0 + u, seen = pos0 + i0 + r / group - l0 + 1;  /* keys of the tile it sees */ \
                float tmax;                                                                    \
                pf_store(s + r * W, pf_live(a[u], seen, &tmax));                               \
                float mnew = tmax > mx[r] ? tmax : mx[r];                                      \
                alpha[r] = mx[r] - mnew;  /* exp'd below, W rows a call */                    \
                mx[r] = mnew;                                                                  \
            }                                                                                  \
        }                                                                                      \
        for (int64_t r = 0; r < R; r += W) pf_store(alpha + r, pf_exp(pf_load(alpha + r)));    \
        for (int64_t r = 0; r < R; r++) {  /* probabilities; sums scaled by the correction */ \
            pf_vec p = pf_exp(pf_sub(pf_load(s + r * W), pf_set1(mx[r])));                    \
            pf_store(s + r * W, p);                                                            \
            pf_store(ls + r * W, pf_fma(pf_load(ls + r * W), pf_set1(alpha[r]), p));           \
        }                                                                                      \
        /* values: 4 rows x PV_NC vectors in registers over the tile's keys */                \
        for (int64_t r0 = 0; r0 < R; r0 += 4) {                                                \
            int64_t nr = R - r0 < 4 ? R - r0 : 4;                                              \
            for (int64_t c0 = 0; c0 < nv; c0 += PV_NC) {                                       \
                int64_t nc = nv - c0 < PV_NC ? nv - c0 : PV_NC;                                \
                if (nr == 4 && nc == PV_NC)                                                    \
                    pf_values(s + r0 * W, vw, os + r0 * d, alpha + r0, d, c0, tile, 4, PV_NC); \
                else                                                                           \
                    pf_values(s + r0 * W, vw, os + r0 * d, alpha + r0, d, c0, tile, (int)nr, (int)nc); \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int64_t r = 0; r < R; r++) {                                                          \
        pf_vec inv = pf_set1(1.0f / pf_hsum(pf_load(ls + r * W)));                             \
        float *orow = out + (i0 + r / group) * o_stride + (j * group + r % group) * d;        \
        for (int64_t c = 0; c < d; c += W) pf_storeu(orow + c, pf_mul(pf_load(os + r * d + c), inv)); \
    }                                                                                          \
    return 0;                                                                                  \
}                                                                                              \
                                                                                               \
int NAME(const float *q, int64_t q_stride, const T *k, const T *v, const int64_t *keys,        \
         int64_t L, int64_t Q, int64_t H, int64_t kv_heads, int64_t d, float scale, float *out, \
         int64_t o_stride, int threads) {                                                      \
    if (d % PF_TILE || H % kv_heads || Q < 1 || Q > L || PF_ROWS * (H / kv_heads) > PF_MAX_R)  \
        return -1;                                                                             \
    int64_t group = H / kv_heads, blocks = (Q + PF_ROWS - 1) / PF_ROWS;                        \
    int failed = 0;                                                                            \
    /* the last positions' blocks (the most keys) first */                                     \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1) reduction(|:failed)") \
    for (int64_t u = 0; u < blocks * kv_heads; u++) {                                          \
        int64_t b = blocks - 1 - u / kv_heads, j = u % kv_heads, i0 = b * PF_ROWS;             \
        int64_t nq = Q - i0 < PF_ROWS ? Q - i0 : PF_ROWS;                                      \
        failed |= NAME##_unit(q, q_stride, k, v, keys, L, Q, i0, nq, j, kv_heads, group, d,    \
                              scale, out, o_stride) != 0;                                      \
    }                                                                                          \
    return failed ? -1 : 0;                                                                    \
}

DEFINE_PREFILL(prefill_attention_f32, float, pf_load_f32)
DEFINE_PREFILL(prefill_attention_bf16, uint16_t, pf_load_bf16)
int prefill_available(void) { return 1; }
#else
/* prompt attention: AVX512 or AVX2 + FMA (torch's fused attention elsewhere) */
int prefill_available(void) { return 0; }
#define PREFILL_STUB(NAME, T)                                                                 \
int NAME(const float *q, int64_t q_stride, const T *k, const T *v, const int64_t *keys,        \
         int64_t L, int64_t Q, int64_t H, int64_t kv_heads, int64_t d, float scale, float *out, \
         int64_t o_stride, int threads) {                                                      \
    (void)o_stride; (void)q; (void)q_stride; (void)k; (void)v; (void)keys; (void)L; (void)Q; (void)H;          \
    (void)kv_heads; (void)d; (void)scale; (void)out; (void)threads;                            \
    return -1;                                                                                 \
}
PREFILL_STUB(prefill_attention_f32, float)
PREFILL_STUB(prefill_attention_bf16, uint16_t)
#endif
