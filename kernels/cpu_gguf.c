/* GGUF quantized weights computed from their own bytes (kernels/cpu_gguf.py builds and calls
 * this). Portable C (vectorized by the compiler with -march=native): one code path on every
 * x86/ARM CPU, AVX512 or not.
 *
 * A weight is `n` rows of `row_bytes` bytes, each row a run of ggml blocks (the layouts are
 * those of the `gguf` package's numpy dequantizers, which the tests hold this to):
 *
 *   type   weights/block  bytes  layout                                       w
 *   Q4_0        32          18   d f16 | 16 B nibbles                         d (q - 8)
 *   Q4_1        32          20   d f16 | m f16 | 16 B nibbles                 d q + m
 *   Q5_0        32          22   d f16 | qh u32 | 16 B nibbles                d (q - 16)
 *   Q5_1        32          24   d f16 | m f16 | qh u32 | 16 B nibbles        d q + m
 *   Q8_0        32          34   d f16 | 32 int8                              d q
 *   Q4_K       256         144   d | dmin | 12 B 6-bit (sc, m) x 8 | 128 B    d sc q - dmin m
 *   Q5_K       256         176   d | dmin | 12 B scales | qh 32 B | 128 B     d sc q - dmin m
 *   Q6_K       256         210   ql 128 B | qh 64 B | 16 int8 scales | d      d sc (q - 32)
 *   F16/BF16/F32  1        2/2/4
 *
 * Nibbles of a 32-block: low nibbles are weights 0..15, high ones 16..31. K-quants: each 32
 * bytes of nibbles hold two sub-blocks of 32 (low, then high); Q5_K's bit 4 of sub-block j
 * is bit j of qh[i]; Q6_K: half h (128 weights) takes ql[64h..] (sub-blocks 4h..4h+3 are the
 * low nibbles of bytes 0-31, 32-63, then the high ones) and 2 bits from qh[32h + i] >> 2s.
 *
 *   gg_dequant:  rows [0, n) -> fp32 [n, k]          (the tiled GEMM path, the reference)
 *   gg_linear:   out [m, n] = x [m, k] @ w.T, fp32   (few rows, F16/BF16/F32: each weight row
 *                is expanded once into an L1 buffer and dotted with every row of x)
 *   gg_quantize_x / gg_linear_q8: the same for the block types, on int8 activations
 *                (llama.cpp's way): x is quantized once per call to int8 with one scale per
 *                32 inputs, xq = round(x / dx), dx = max|x| / 127, and every 32 weights
 *                w = a q + c (q a small unsigned integer, Q8_0: signed) are summed in integers:
 *
 *                  sum_j w_j x_j = dx (a sum_j q_j xq_j + c sum_j xq_j)
 *
 *                (Q6_K has a scale per 16: each half of the 32 has its own a and c). With
 *                AVX2 the integer sums are vpmaddubsw/vpmaddwd, 32 products an instruction,
 *                read straight from the blocks for Q4_0/Q4_1/Q8_0; the other types are
 *                expanded to bytes first. Without AVX2 the same sums run as plain C.
 *
 * One unpacking of every block type (expand_block: bytes q and factors a, c) serves both
 * the int8 dots and the dequantizer (w = a q + c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GG_F32 = 0, GG_F16 = 1, GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7,
       GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14, GG_BF16 = 30 };  /* ggml's ids */

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal half: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline float bf16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* A 32-weight sub-block as w = a[h] q + c[h] over its halves h (16 weights each). */
typedef struct { float a[2], c[2]; } factors;

/* Expand one ggml block (32 or 256 weights) into q [bs] bytes (unsigned; Q8_0's are its
 * int8 values) and one `factors` per 32. */
static void expand_block(int type, const uint8_t *b, uint8_t *q, factors *f) {
    if (type == GG_Q4_K || type == GG_Q5_K) {
        int five = type == GG_Q5_K;
        float d = f16_at(b), dmin = f16_at(b + 2);
        const uint8_t *qh = b + 16, *ql = five ? b + 48 : b + 16;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(j, b + 4, &sc, &mn);
            f[j].a[0] = f[j].a[1] = d * (float)sc;
            f[j].c[0] = f[j].c[1] = -dmin * (float)mn;
            const uint8_t *p = ql + 32 * (j / 2);
            int shift = (j & 1) * 4;
            for (int i = 0; i < 32; i++)
                q[32 * j + i] = (uint8_t)(((p[i] >> shift) & 0x0F) |
                                          (five ? ((qh[i] >> j) & 1) << 4 : 0));
        }
        return;
    }
    if (type == GG_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = f16_at(b + 208);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) {
                const uint8_t *p = ql + 64 * h + 32 * (s & 1);
                int shift = (s >> 1) * 4, sb = 4 * h + s;
                for (int i = 0; i < 32; i++)
                    q[32 * sb + i] = (uint8_t)(((p[i] >> shift) & 0x0F) |
                                               (((qh[32 * h + i] >> (2 * s)) & 3) << 4));
                for (int half = 0; half < 2; half++) {
                    f[sb].a[half] = d * (float)scales[2 * sb + half];
                    f[sb].c[half] = -32.0f * f[sb].a[half];
                }
            }
        return;
    }
    float d = f16_at(b), m = 0.0f;
    const uint8_t *qs;
    uint32_t qh = 0;
    switch (type) {
    case GG_Q8_0: memcpy(q, b + 2, 32); m = 0.0f; break;
    case GG_Q4_0: qs = b + 2; m = -8.0f * d; break;
    case GG_Q4_1: qs = b + 4; m = f16_at(b + 2); break;
    case GG_Q5_0: memcpy(&qh, b + 2, 4); qs = b + 6; m = -16.0f * d; break;
    default: /* Q5_1 */ m = f16_at(b + 2); memcpy(&qh, b + 4, 4); qs = b + 8; break;
    }
    f->a[0] = f->a[1] = d;
    f->c[0] = f->c[1] = m;
    if (type == GG_Q8_0) return;
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
        q[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}


static int block_size(int type) {
    switch (type) {
    case GG_F32: case GG_F16: case GG_BF16: return 1;
    case GG_Q4_0: case GG_Q4_1: case GG_Q5_0: case GG_Q5_1: case GG_Q8_0: return 32;
    case GG_Q4_K: case GG_Q5_K: case GG_Q6_K: return 256;
    default: return 0;
    }
}

static int block_bytes(int type) {
    static const int bytes[31] = {[GG_F32] = 4, [GG_F16] = 2, [GG_Q4_0] = 18, [GG_Q4_1] = 20,
                                  [GG_Q5_0] = 22, [GG_Q5_1] = 24, [GG_Q8_0] = 34,
                                  [GG_Q4_K] = 144, [GG_Q5_K] = 176, [GG_Q6_K] = 210,
                                  [GG_BF16] = 2};
    return type >= 0 && type <= 30 ? bytes[type] : 0;
}

/* One row of k weights -> y [k] fp32: each block expanded to bytes and factors (as the
 * int8 dots read it), then w = a q + c (Q6_K: a (q - 32), gguf's order of operations). */
static void dequant_row(int type, const uint8_t *row, int64_t k, float *y) {
    int64_t i;
    switch (type) {
    case GG_F32: memcpy(y, row, (size_t)k * 4); return;
    case GG_F16: for (i = 0; i < k; i++) y[i] = f16_at(row + 2 * i); return;
    case GG_BF16: for (i = 0; i < k; i++) y[i] = bf16_at(row + 2 * i); return;
    }
    uint8_t q[256];
    factors f[8];
    int bs = block_size(type), bb = block_bytes(type);
    for (i = 0; i < k / bs; i++) {
        expand_block(type, row + i * bb, q, f);
        for (int h = 0; h < bs / 16; h++) {  /* halves of 16: the loops vectorize */
            float a = f[h / 2].a[h & 1], c = f[h / 2].c[h & 1], *out = y + i * bs + 16 * h;
            const uint8_t *p = q + 16 * h;
            if (type == GG_Q6_K)
                for (int j = 0; j < 16; j++) out[j] = a * (float)(p[j] - 32);
            else if (type == GG_Q8_0)
                for (int j = 0; j < 16; j++) out[j] = a * (float)(int8_t)p[j];
            else
                for (int j = 0; j < 16; j++) out[j] = a * (float)p[j] + c;
        }
    }
}

/* 0 when (type, k, row_bytes) describe rows this file can read, else -1. */
int gg_check(int type, int64_t k, int64_t row_bytes) {
    int bs = block_size(type);
    if (bs == 0 || k <= 0 || k % bs) return -1;
    return row_bytes == k / bs * block_bytes(type) ? 0 : -1;
}

/* out [n, k] (row stride ldo) = the rows' weights in fp32. */
int gg_dequant(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, float *out,
               int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 16)
    for (int64_t r = 0; r < n; r++) dequant_row(type, w + r * row_bytes, k, out + r * ldo);
    return 0;
}

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ w.T; each thread expands its
 * rows of w one at a time into a k-float buffer and dots it with every row of x. */
int gg_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
              const float *x, int64_t ldx, int64_t m, float *out, int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes) || m < 1) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        float *buf = malloc((size_t)k * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!buf) continue;
            dequant_row(type, w + r * row_bytes, k, buf);
            for (int64_t i = 0; i < m; i++) {
                const float *xi = x + i * ldx;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t j = 0; j < k; j++) s += buf[j] * xi[j];
                out[i * ldo + r] = s;
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------- int8 activations */

/* x [k] -> xq [k] int8, dx [k/32] = max|x| / 127, xs [k/16] = sums of xq over each 16. */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *dx, int32_t *xs) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = amax > fabsf(v[j]) ? amax : fabsf(v[j]);
        float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)nearbyintf(v[j] * inv);
            xq[32 * b + j] = (int8_t)q;
            if (j < 16) s0 += q; else s1 += q;
        }
        dx[b] = d;
        xs[2 * b] = s0;
        xs[2 * b + 1] = s1;
    }
}

/* x [m, k] (row stride ldx) -> xq [m, k], dx [m, k/32], xs [m, k/16]. */
int gg_quantize_x(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *xq, float *dx,
                  int32_t *xs) {
    if (k % 32 || m < 1) return -1;
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * ldx, k, xq + i * k, dx + i * (k / 32), xs + i * (k / 16));
    return 0;
}

#if defined(__AVX2__)
/* The two 16-halves of sum q_j xq_j over 32: q unsigned bytes (<= 63), xq int8. */
static inline __m256i dot32_u8(__m256i q, __m256i xq) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), _mm256_set1_epi16(1));
}
/* q signed (Q8_0): |q| times xq with q's sign. */
static inline __m256i dot32_s8(__m256i q, __m256i xq) {
    return dot32_u8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q));
}
/* 8 int32 lanes (lanes 0-3: the first 16 weights) -> the two halves' sums. */
static inline void halves(__m256i v, int32_t *h0, int32_t *h1) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    lo = _mm_hadd_epi32(lo, hi);      /* l0+l1, l2+l3, h0+h1, h2+h3 */
    lo = _mm_hadd_epi32(lo, lo);      /* first half, second half, ... */
    *h0 = _mm_cvtsi128_si32(lo);
    *h1 = _mm_extract_epi32(lo, 1);
}
static inline __m256i nibbles16(const uint8_t *p) {  /* 16 bytes -> lows then highs */
    __m128i v = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}
#endif

/* sum over the 32 weights of sub-block q (expanded bytes) against xq, as two halves. */
static inline void dot32(int is_signed, const uint8_t *q, const int8_t *xq, int32_t *h) {
#if defined(__AVX2__)
    __m256i vq = _mm256_loadu_si256((const __m256i *)q);
    __m256i vx = _mm256_loadu_si256((const __m256i *)xq);
    halves(is_signed ? dot32_s8(vq, vx) : dot32_u8(vq, vx), h, h + 1);
#else
    int32_t s0 = 0, s1 = 0;
    if (is_signed) {
        for (int j = 0; j < 16; j++) s0 += (int8_t)q[j] * xq[j];
        for (int j = 16; j < 32; j++) s1 += (int8_t)q[j] * xq[j];
    } else {
        for (int j = 0; j < 16; j++) s0 += q[j] * xq[j];
        for (int j = 16; j < 32; j++) s1 += q[j] * xq[j];
    }
    h[0] = s0;
    h[1] = s1;
#endif
}

/* One weight row against m quantized rows of x: out[i * ldo] for i < m. q/f: scratch of k
 * bytes and k/32 factors. */
static void row_q8(int type, const uint8_t *row, int64_t k, const int8_t *xq, const float *dx,
                   const int32_t *xs, int64_t m, float *out, int64_t ldo, uint8_t *q,
                   factors *f) {
    int bs = block_size(type), bb = block_bytes(type), is_signed = type == GG_Q8_0;
    for (int64_t b = 0; b < k / bs; b++) expand_block(type, row + b * bb, q + b * bs, f + b * bs / 32);
    for (int64_t i = 0; i < m; i++) {
        const int8_t *xi = xq + i * k;
        const float *di = dx + i * (k / 32);
        const int32_t *si = xs + i * (k / 16);
        float acc = 0.0f;
        for (int64_t s = 0; s < k / 32; s++) {
            int32_t h[2];
            dot32(is_signed, q + 32 * s, xi + 32 * s, h);
            acc += di[s] * (f[s].a[0] * (float)h[0] + f[s].a[1] * (float)h[1] +
                            f[s].c[0] * (float)si[2 * s] + f[s].c[1] * (float)si[2 * s + 1]);
        }
        out[i * ldo] = acc;
    }
}

#if defined(__AVX2__)
/* Q4_0 / Q4_1 / Q8_0 for one x row, straight from the blocks (no expansion): Q4_0's
 * nibbles less 8 and Q8_0's bytes are signed (no offset term); Q4_1 adds m sum(x). */
static float row_q8_direct(int type, const uint8_t *row, int64_t k, const int8_t *xq,
                           const float *dx, const int32_t *xs) {
    int bb = block_bytes(type);
    const __m256i eight = _mm256_set1_epi8(8);
    __m256 acc = _mm256_setzero_ps();
    float tail = 0.0f;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *blk = row + b * bb;
        __m256i vx = _mm256_loadu_si256((const __m256i *)(xq + 32 * b)), prod;
        if (type == GG_Q8_0) {
            prod = dot32_s8(_mm256_loadu_si256((const __m256i *)(blk + 2)), vx);
        } else if (type == GG_Q4_0) {
            prod = dot32_s8(_mm256_sub_epi8(nibbles16(blk + 2), eight), vx);
        } else {
            prod = dot32_u8(nibbles16(blk + 4), vx);
            tail += dx[b] * f16_at(blk + 2) * (float)(xs[2 * b] + xs[2 * b + 1]);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dx[b] * f16_at(blk)), _mm256_cvtepi32_ps(prod), acc);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s) + tail;
}
#endif

/* out [m, n] (row stride ldo) = x @ w.T from gg_quantize_x's xq, dx, xs (block types). */
int gg_linear_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                 const int8_t *xq, const float *dx, const int32_t *xs, int64_t m, float *out,
                 int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes) || m < 1 || block_size(type) < 32) return -1;
    int failed = 0;
#if defined(__AVX2__)
    int direct = type == GG_Q4_0 || type == GG_Q4_1 || type == GG_Q8_0;
#else
    int direct = 0;
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        uint8_t *q = direct ? NULL : malloc((size_t)k);
        factors *f = direct ? NULL : malloc((size_t)(k / 32) * sizeof(factors));
        int ok = direct || (q && f);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (!ok) continue;
#if defined(__AVX2__)
            if (direct) {
                for (int64_t i = 0; i < m; i++)
                    out[i * ldo + r] = row_q8_direct(type, w + r * row_bytes, k, xq + i * k,
                                                     dx + i * (k / 32), xs + i * (k / 16));
                continue;
            }
#endif
            row_q8(type, w + r * row_bytes, k, xq, dx, xs, m, out + r, ldo, q, f);
        }
        free(q);
        free(f);
    }
    return failed ? -1 : 0;
}
