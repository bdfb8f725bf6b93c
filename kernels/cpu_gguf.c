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
 *                32 inputs (K-quants: per 256, llama.cpp's Q8_K), xq = round(x / dx),
 *                dx = max|x| / 127, and every 32 weights w = a q + c (q a small unsigned
 *                integer, Q8_0: signed) are summed in integers:
 *
 *                  sum_j w_j x_j = dx (a sum_j q_j xq_j + c sum_j xq_j)
 *
 *                (Q6_K has a scale per 16: each half of the 32 has its own a and c).
 *   gg_linear_x: gg_quantize_x and gg_linear_q8 in one call (what kernels/cpu_gguf.py calls);
 *                gg_linear_x2 the same with x in two int8 parts (an output head's prompt rows).
 *
 * With AVX2 every block type is read straight from its bytes (the "AVX2" section below):
 * nibbles and high bits unpacked from 256-bit loads with and / shift, 32 products a
 * vpmaddubsw, then a vpmaddwd to 8 int32 lanes. 32-blocks: one int32 -> fp32 conversion and
 * one fmadd by d dx per block, the offset (c sum xq: Q4_1's m, Q4_0's -8 d) from float sums
 * of x. K-quants: the vpmaddwd multiplies by the sub-block's integer scale, so a whole
 * 256-block (one x scale) sums in int32 lanes, the mins (Q6_K: the -32) too, against the
 * int16 sums of x per 16; then one conversion and one fmadd a block (Q4_K / Q5_K: two).
 * That is why x takes one scale per 256 there, as in llama.cpp: per 32 the floats cost
 * 1.5x the time of the whole kernel on Zen 1 (docs/BENCHMARKS.md). One horizontal sum per
 * output. A K-quant block is unpacked once for up to 4 rows of x; one row of x takes the
 * weight rows two at a time. Without AVX2 the blocks go through expand_block (bytes q and
 * factors a, c) and the same sums run as plain C.
 *
 * With AVX-512 VNNI (and BW) the K-quants take 512-bit dots instead (kq512_*): 64 weights a
 * register and the scale multiply folded into vpdpwssd, 1.3-1.8x the AVX2 loop's speed at
 * 2-48 rows of x; more than one row of x goes through the weights in K chunks whose x rows
 * stay in L1 (kq512_group).
 *
 * expand_block also serves the dequantizer (w = a q + c).
 *
 * gg_gemm_bf16: prompt steps, out [m, n] bf16 = x [m, k] bf16 @ w.T with fp32 sums, the
 * weights dequantized to bf16 a panel at a time into L2, on AMX-BF16 tiles (amx_gemm_bf16)
 * or, without AMX, with AVX512-BF16's vdpbf16ps (bp_gemm_bf16); each output one sum in one
 * order whatever m (gg_gemm_bf16_kind says which runs).
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
/* A K-quant block's factors alone (expand_block's): one `factors` per 32 weights. */
static void kq_factors(int type, const uint8_t *b, factors *f) {
    if (type == GG_Q6_K) {
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = f16_at(b + 208);
        for (int sb = 0; sb < 8; sb++)
            for (int half = 0; half < 2; half++) {
                f[sb].a[half] = d * (float)scales[2 * sb + half];
                f[sb].c[half] = -32.0f * f[sb].a[half];
            }
        return;
    }
    float d = f16_at(b), dmin = f16_at(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        f[j].a[0] = f[j].a[1] = d * (float)sc;
        f[j].c[0] = f[j].c[1] = -dmin * (float)mn;
    }
}

static void expand_block(int type, const uint8_t *b, uint8_t *q, factors *f) {
    if (type == GG_Q4_K || type == GG_Q5_K) {
        int five = type == GG_Q5_K;
        const uint8_t *qh = b + 16, *ql = five ? b + 48 : b + 16;
        kq_factors(type, b, f);
        for (int j = 0; j < 8; j++) {
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
        kq_factors(type, b, f);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) {
                const uint8_t *p = ql + 64 * h + 32 * (s & 1);
                int shift = (s >> 1) * 4, sb = 4 * h + s;
                for (int i = 0; i < 32; i++)
                    q[32 * sb + i] = (uint8_t)(((p[i] >> shift) & 0x0F) |
                                               (((qh[32 * h + i] >> (2 * s)) & 3) << 4));
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

/* fp32 -> bf16, rounded to nearest even (what torch's .to(torch.bfloat16) does; a NaN stays
 * a NaN). Plain integer ops, so the loops that call it vectorize. */
static inline uint16_t gg_round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GG_KQ512 1
/* A K-quant block's 256 weight bytes, as expand_block writes them (the AVX-512 section) */
static void kq512_bytes(int type, const uint8_t *blk, uint8_t *q);
#endif

#if defined(__AVX512F__)
/* 16 expanded bytes -> 16 fp32 weights: dequant_row's loop (a multiply, then an add: no fused
 * contraction, as the file is built), so the same values. */
static inline __m512 f32x16(const uint8_t *p, float a, float c, int type) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m512i q = type == GG_Q8_0 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    if (type == GG_Q6_K) q = _mm512_sub_epi32(q, _mm512_set1_epi32(32));
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(a), _mm512_cvtepi32_ps(q));
    if (type != GG_Q6_K && type != GG_Q8_0) v = _mm512_add_ps(v, _mm512_set1_ps(c));
    return v;
}

/* One block's weight bytes and factors (K-quants from 512-bit unpacking: the same bytes) */
static inline void expand_any(int type, const uint8_t *blk, uint8_t *q, factors *f) {
#if defined(GG_KQ512)
    if (block_size(type) == 256) {
        kq512_bytes(type, blk, q);
        kq_factors(type, blk, f);
        return;
    }
#endif
    expand_block(type, blk, q, f);
}
#endif

/* One row -> bf16 [k]: the fp32 weights of dequant_row, each rounded once to bf16 (so a
 * bf16 tile is exactly the fp32 tile's .to(torch.bfloat16)). Block types are expanded a
 * block at a time (with AVX512-BF16, 16 weights an instruction sequence, rounded to nearest
 * even by the CPU). */
static void dequant_row_bf16(int type, const uint8_t *row, int64_t k, uint16_t *y) {
    float buf[256];
    int64_t i;
    if (type == GG_BF16) {
        memcpy(y, row, (size_t)k * 2);
        return;
    }
    int bs = block_size(type), bb = block_bytes(type);
    if (bs == 1) {  /* F16 / F32: 256 weights at a time through fp32 */
        int esize = type == GG_F32 ? 4 : 2;
        for (i = 0; i < k; i += 256) {
            int len = k - i < 256 ? (int)(k - i) : 256;
            dequant_row(type, row + i * esize, len, buf);
            for (int j = 0; j < len; j++) y[i + j] = gg_round_bf16(buf[j]);
        }
        return;
    }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    uint8_t q[256] __attribute__((aligned(64)));
    factors f[8];
    for (i = 0; i < k / bs; i++) {
        expand_any(type, row + i * bb, q, f);
        for (int h = 0; h < bs / 16; h++) {
            __m256bh v = _mm512_cvtneps_pbh(f32x16(q + 16 * h, f[h / 2].a[h & 1], f[h / 2].c[h & 1], type));
            _mm256_storeu_si256((__m256i *)(y + i * bs + 16 * h), (__m256i)v);
        }
    }
#else
    for (i = 0; i < k; i += bs) {
        dequant_row(type, row + i / bs * bb, bs, buf);
        for (int j = 0; j < bs; j++) y[i + j] = gg_round_bf16(buf[j]);
    }
#endif
}

#if defined(__AVX2__)
static void kq_dequant_row(int type, const uint8_t *row, int64_t k, float *y);  /* AVX2, below */
#endif

/* dequant_row's fp32 weights, block types a block at a time with AVX-512, K-quants with AVX2
 * (the same values); else dequant_row itself. */
static void dequant_row_fast(int type, const uint8_t *row, int64_t k, float *y) {
#if defined(__AVX512F__)
    int bs = block_size(type), bb = block_bytes(type);
    if (bs > 1) {
        uint8_t q[256] __attribute__((aligned(64)));
        factors f[8];
        for (int64_t i = 0; i < k / bs; i++) {
            expand_any(type, row + i * bb, q, f);
            for (int h = 0; h < bs / 16; h++)
                _mm512_storeu_ps(y + i * bs + 16 * h, f32x16(q + 16 * h, f[h / 2].a[h & 1], f[h / 2].c[h & 1], type));
        }
        return;
    }
#endif
#if defined(__AVX2__)
    if (block_size(type) == 256) {
        kq_dequant_row(type, row, k, y);
        return;
    }
#endif
    dequant_row(type, row, k, y);
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
    for (int64_t r = 0; r < n; r++) dequant_row_fast(type, w + r * row_bytes, k, out + r * ldo);
    return 0;
}

/* The same rows as bf16 (uint16) [n, k], row stride ldo: the tiles of a bf16 GEMM. */
int gg_dequant_bf16(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                    uint16_t *out, int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 16)
    for (int64_t r = 0; r < n; r++) dequant_row_bf16(type, w + r * row_bytes, k, out + r * ldo);
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
            dequant_row_fast(type, w + r * row_bytes, k, buf);
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

/* max |v_j| over n (a multiple of 32) inputs. */
static float abs_max(const float *v, int n) {
#if defined(__AVX2__)
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + j), abs));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
#else
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = amax > fabsf(v[j]) ? amax : fabsf(v[j]);
    return amax;
#endif
}

/* 32 inputs v times inv -> q [32] int8 (nearest, ties to even); s[0], s[1]: the sums of q
 * over each 16. */
static void round32(const float *v, float inv, int8_t *q, int32_t *s) {
#if defined(__AVX2__)
    __m256 vi = _mm256_set1_ps(inv);
    __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), vi)),
            q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), vi)),
            q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), vi)),
            q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), vi));
    /* packs work within 128-bit lanes: the 4-byte groups come out as inputs 0-3, 8-11,
     * 16-19, 24-27, 4-7, 12-15, 20-23, 28-31; the permute puts them back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    h = _mm256_hadd_epi32(h, h);  /* lanes 0, 1 (+ 4, 5): the sums of inputs 0-15, 16-31 */
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    s[0] = _mm_cvtsi128_si32(t);
    s[1] = _mm_extract_epi32(t, 1);
#else
    s[0] = s[1] = 0;
    for (int j = 0; j < 32; j++) {
        q[j] = (int8_t)(int)nearbyintf(v[j] * inv);
        s[j / 16] += q[j];
    }
#endif
}

/* x [k] -> xq [k] int8, dx [k/group] = max|x| / 127 over each group (32, or 256: the
 * K-quants' blocks, as llama.cpp's Q8_K), xs [k/16] = sums of xq over each 16.
 * xq = nearbyint(x * (127 / max|x|)) in fp32: the AVX2 lanes round the same way (to
 * nearest even), so both paths give the same bits. */
static void quantize_row(const float *x, int64_t k, int group, int8_t *xq, float *dx,
                         int32_t *xs) {
    for (int64_t g = 0; g < k / group; g++) {
        const float *v = x + group * g;
        float amax = abs_max(v, group);
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        dx[g] = amax / 127.0f;
        for (int j = 0; j < group; j += 32)
            round32(v + j, inv, xq + group * g + j, xs + (group * g + j) / 16);
    }
}

/* The x group a block type's kernels take: one scale per 32 inputs, per 256 for K-quants. */
static int x_group(int type) { return block_size(type) == 256 ? 256 : 32; }

#define QX_MIN_ELEMENTS 16384  /* fewer inputs are quantized on one thread (a fork costs more) */

/* x [m, k] (row stride ldx) -> xq [m, k], dx [m, k/group], xs [m, k/16], rows shared out
 * among `threads` (each row's bits are the same on any thread). */
static int gg_quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int group,
                            int8_t *xq, float *dx, int32_t *xs, int threads) {
    if ((group != 32 && group != 256) || k % group || m < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1 && m * k >= QX_MIN_ELEMENTS)
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * ldx, k, group, xq + i * k, dx + i * (k / group), xs + i * (k / 16));
    return 0;
}

/* x [m, k] (row stride ldx) -> xq [m, k], dx [m, k/group], xs [m, k/16]. */
int gg_quantize_x(const float *x, int64_t ldx, int64_t m, int64_t k, int group, int8_t *xq,
                  float *dx, int32_t *xs) {
    return gg_quantize_rows(x, ldx, m, k, group, xq, dx, xs, 1);
}

/* sum over the 32 weights of sub-block q (expanded bytes) against xq, as two halves: the
 * portable dots (every type without AVX2; Q5_0 / Q5_1 with it). */
static inline void dot32(int is_signed, const uint8_t *q, const int8_t *xq, int32_t *h) {
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
        const int g = x_group(type);
        const float *di = dx + i * (k / g);
        const int32_t *si = xs + i * (k / 16);
        float acc = 0.0f;
        for (int64_t s = 0; s < k / 32; s++) {
            int32_t h[2];
            dot32(is_signed, q + 32 * s, xi + 32 * s, h);
            acc += di[32 * s / g] * (f[s].a[0] * (float)h[0] + f[s].a[1] * (float)h[1] +
                            f[s].c[0] * (float)si[2 * s] + f[s].c[1] * (float)si[2 * s + 1]);
        }
        out[i * ldo] = acc;
    }
}

#if defined(__AVX2__)
/* ------------------------------------------------ AVX2: dots straight from the blocks
 *
 * A 32-sub-block's integer dot sum_j q_j xq_j takes vpmaddubsw + vpmaddwd (on Zen 1 these
 * two bound the loop: 16 of them a 256-block). 32-blocks: the activations' sums come in as
 * floats, xsf = dx xs per 32, so the offset term is one scalar fmadd per block. K-quants:
 * see kq_dot. The lanes are summed once per row. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Q4_K / Q5_K: the 12 scale bytes -> the 8 6-bit scales and the 8 6-bit mins as int16 lanes
 * (the bit layout of scale_min_k4, four sub-blocks a 32-bit word). */
ALWAYS_INLINE __m128i k4_scales(const uint8_t *s, __m128i *mins) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    uint64_t scales = (uint64_t)((u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u)) << 32 |
                      (u0 & 0x3F3F3F3Fu);
    uint64_t mn = (uint64_t)(((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u)) << 32 |
                  (u1 & 0x3F3F3F3Fu);
    *mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
    return _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales));
}

/* int16 lane j of `v` (j < 8, the same in both 128-bit halves) in every 16-bit lane. */
ALWAYS_INLINE __m256i lane16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(((2 * j + 1) << 8) | (2 * j))));
}

/* Most rows of x one pass over a weight row's blocks serves (each block unpacked once). */
#define KQ_ROWS 4

/* One K-quant block unpacked: the 8 sub-blocks' bytes q[s] (0..63) and its fp16 factor(s);
 * Q4_K / Q5_K: the scales as int16 in both halves (sc), the mins (mn); Q6_K: the 16 scales
 * per 16 weights (sc) and two copies with scales 0-7 (lo) and 8-15 (hi) in both halves. */
typedef struct { __m256i q[8], sc, lo, hi; __m128i mn; float d, dmin; } kq_block;

ALWAYS_INLINE void kq_unpack(int type, const uint8_t *blk, kq_block *u) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i *q = u->q;
    if (type == GG_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const __m256i bits = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h)),
                    l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)),
                    hi = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                                       _mm256_and_si256(_mm256_slli_epi16(hi, 4), bits));
            q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                           _mm256_and_si256(_mm256_slli_epi16(hi, 2), bits));
            q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                           _mm256_and_si256(hi, bits));
            q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi16(hi, 2), bits));
        }
        u->sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        u->lo = _mm256_permute2x128_si256(u->sc, u->sc, 0x00);
        u->hi = _mm256_permute2x128_si256(u->sc, u->sc, 0x11);
        u->d = f16_at(blk + 208);
    } else {
        const int five = type == GG_Q5_K;
        const uint8_t *qs = blk + (five ? 48 : 16);
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            q[2 * p] = _mm256_and_si256(v, low4);
            q[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        if (five) {  /* bit 4 of sub-block s: bit s of qh[i] */
            const __m256i bit4 = _mm256_set1_epi8(0x10);
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
            q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
            q[2] = _mm256_or_si256(q[2], _mm256_and_si256(_mm256_slli_epi16(qh, 2), bit4));
            q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_slli_epi16(qh, 1), bit4));
            q[4] = _mm256_or_si256(q[4], _mm256_and_si256(qh, bit4));
            q[5] = _mm256_or_si256(q[5], _mm256_and_si256(_mm256_srli_epi16(qh, 1), bit4));
            q[6] = _mm256_or_si256(q[6], _mm256_and_si256(_mm256_srli_epi16(qh, 2), bit4));
            q[7] = _mm256_or_si256(q[7], _mm256_and_si256(_mm256_srli_epi16(qh, 3), bit4));
        }
        u->sc = _mm256_broadcastsi128_si256(k4_scales(blk + 4, &u->mn));
        u->d = f16_at(blk);
        u->dmin = f16_at(blk + 2);
    }
}

/* One unpacked block against 256 inputs of one x row (xq; its scale dx; xs: the int16 sums
 * of xq per 16), all in integers but for one fmadd (two for Q4_K / Q5_K's mins):
 *   Q4_K / Q5_K:  dx (d sum_s sc_s dot(q_s, x_s) - dmin sum_s m_s xs32_s)
 *   Q6_K:         dx d sum_g sc_g (dot(q_g, x_g) - 32 xs_g)           (g: per 16)
 * A sub-block's 32 products are a vpmaddubsw into 16 int16 lanes and a vpmaddwd by its
 * scale (Q6_K: the low 8 lanes by one group's, the high by the next's) into 8 int32 lanes:
 * 16 multiplies a block, no float work per sub-block (the pair sums cannot saturate:
 * 2 * 63 * 127 < 32767, and the scales are at most 6 bits; Q6_K's 8-bit ones stay far
 * below int32's range). */
ALWAYS_INLINE void kq_dot(int type, const kq_block *u, const int8_t *x, float dx,
                          const int16_t *xs, __m256 *acc) {
    const __m256i *q = u->q;
    __m256i sumi;
    if (type == GG_Q6_K) {
        sumi = _mm256_madd_epi16(u->sc, _mm256_loadu_si256((const __m256i *)xs));
        sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sumi, 5));
        for (int s = 0; s < 8; s++) {
            const int j = 2 * (s & 3);  /* the groups 2s, 2s + 1 of this half's scales */
            const __m256i pick = _mm256_setr_epi8(
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1,
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1,
                2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2,
                2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3,
                2 * j + 2, 2 * j + 3);
            __m256i p = _mm256_maddubs_epi16(q[s], _mm256_loadu_si256((const __m256i *)(x + 32 * s)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(
                p, _mm256_shuffle_epi8(s < 4 ? u->lo : u->hi, pick)));
        }
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(dx * u->d), _mm256_cvtepi32_ps(sumi), *acc);
        return;
    }
    /* sums of x per 32 (pairs of the per-16 ones) against the mins */
    __m128i x32 = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)xs),
                                 _mm_loadu_si128((const __m128i *)(xs + 8)));
    __m256i mins = _mm256_zextsi128_si256(_mm_madd_epi16(u->mn, x32));
    sumi = _mm256_setzero_si256();
    for (int s = 0; s < 8; s += 2) {
        __m256i pl = _mm256_maddubs_epi16(q[s], _mm256_loadu_si256((const __m256i *)(x + 32 * s)));
        __m256i ph = _mm256_maddubs_epi16(q[s + 1],
                                          _mm256_loadu_si256((const __m256i *)(x + 32 * s + 32)));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(pl, lane16(u->sc, s)),
                                                       _mm256_madd_epi16(ph, lane16(u->sc, s + 1))));
    }
    *acc = _mm256_fnmadd_ps(_mm256_set1_ps(dx * u->dmin), _mm256_cvtepi32_ps(mins), *acc);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dx * u->d), _mm256_cvtepi32_ps(sumi), *acc);
}

/* Blocks ahead that kq_rows prefetches at one row of x, where the loop is a single stream
 * through a thread's weight rows (it runs past a row's end into the next one). On a 2-core
 * Zen 1 the 1B shape's 7 linears at one row of x took 3.48 ms with no prefetch, 3.16 ms with
 * 2 blocks (1: 3.19, 4: 3.37), in an earlier kernel that walked two weight rows in lockstep;
 * one row at a time then took 3.06 ms against that kernel's 3.54 (medians of 7 x 20 calls in
 * turns, the same bits): two streams 1152 bytes apart (a k = 2048 Q4_K row) read memory
 * slower than one. A far L2 prefetch on top (4-8 KB ahead) gave 1-2 %, within the spread.
 * With 2-4 rows of x the multiplies bound the loop and no prefetch helps (41.4 ms for the
 * layer at 16 rows, with and without). */
#define KQ_AHEAD 2
static int gg_kq_ahead = 1;  /* DUPLEX_GGUF_KQ_PREFETCH=0: off (gg_set_kq_prefetch) */
void gg_set_kq_prefetch(int on) { gg_kq_ahead = on; }

/* One weight row of K-quant blocks against `rows` (<= KQ_ROWS) quantized rows of x:
 * xq [rows, k], dx [rows, k/256], xs [rows, k/16]; out[r * ldo]. Each block is unpacked once
 * for all the rows. */
ALWAYS_INLINE void kq_rows(int type, const uint8_t *row, int64_t k, const int8_t *xq,
                           const float *dx, const int16_t *xs, int rows, float *out,
                           int64_t ldo) {
    const int bb = block_bytes(type);
    __m256 acc[KQ_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++) {
        kq_block u;
        if (rows == 1 && gg_kq_ahead)  /* past the row's end too: the next row is read next */
            for (int line = 0; line < bb; line += 64)
                _mm_prefetch((const char *)row + (b + KQ_AHEAD) * bb + line, _MM_HINT_T0);
        kq_unpack(type, row + b * bb, &u);
        for (int r = 0; r < rows; r++)
            kq_dot(type, &u, xq + r * k + 256 * b, dx[r * (k / 256) + b],
                   xs + r * (k / 16) + 16 * b, &acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r * ldo] = hsum8(acc[r]);
}

/* dequant_row for K-quants from kq_unpack's bytes: 8 weights an instruction sequence, a
 * multiply then an add (no contraction, as the file is built), so the same values. The
 * prompt tiles' dequantization of the 1B shape's layer (7 linears in 4 MB tiles, 2 threads,
 * Zen 1): 17.7 ms with dequant_row, 14.4 ms with this. */
ALWAYS_INLINE void kq_dequant_blocks(int type, const uint8_t *row, int64_t k, float *y) {
    const int bb = block_bytes(type);
    for (int64_t b = 0; b < k / 256; b++, y += 256) {
        kq_block u;
        factors f[8];
        kq_unpack(type, row + b * bb, &u);
        kq_factors(type, row + b * bb, f);
        for (int s = 0; s < 8; s++) {
            const __m128i lo = _mm256_castsi256_si128(u.q[s]), hi = _mm256_extracti128_si256(u.q[s], 1);
            const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int p = 0; p < 4; p++) {  /* weights 32 s + 8 p ..., in the half p / 2 */
                __m256i q = _mm256_cvtepu8_epi32(part[p]);
                if (type == GG_Q6_K) q = _mm256_sub_epi32(q, _mm256_set1_epi32(32));
                __m256 v = _mm256_mul_ps(_mm256_set1_ps(f[s].a[p / 2]), _mm256_cvtepi32_ps(q));
                if (type != GG_Q6_K) v = _mm256_add_ps(v, _mm256_set1_ps(f[s].c[p / 2]));
                _mm256_storeu_ps(y + 32 * s + 8 * p, v);
            }
        }
    }
}

static void kq_dequant_row(int type, const uint8_t *row, int64_t k, float *y) {
    switch (type) {  /* one copy of the loop per type */
    case GG_Q4_K: kq_dequant_blocks(GG_Q4_K, row, k, y); break;
    case GG_Q5_K: kq_dequant_blocks(GG_Q5_K, row, k, y); break;
    default: kq_dequant_blocks(GG_Q6_K, row, k, y); break;
    }
}

/* Q5_0 / Q5_1: bit j of qh as 0x10 in byte j (the fifth bit of weight j). */
ALWAYS_INLINE __m256i fifth_bits(const uint8_t *qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    uint32_t h;
    memcpy(&h, qh, 4);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* One 32-block of Q4_0 ... Q8_0 against x: 8 int32 lanes of sum q_j x_j, q the block's
 * unsigned nibbles (+ fifth bit) or Q8_0's signed bytes (vpsignb moves q's sign onto x).
 * *c: the block's offset per unit of x (Q4_0: -8 d, Q5_0: -16 d, Q4_1 / Q5_1: m). */
ALWAYS_INLINE __m256i block32_dot(int type, const uint8_t *blk, const int8_t *x, float *c) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i vx = _mm256_loadu_si256((const __m256i *)x), q;
    if (type == GG_Q8_0) {
        q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        vx = _mm256_sign_epi8(vx, q);
        q = _mm256_sign_epi8(q, q);
    } else {
        static const int qs_at[8] = {[GG_Q4_0] = 2, [GG_Q4_1] = 4, [GG_Q5_0] = 6, [GG_Q5_1] = 8};
        __m128i v = _mm_loadu_si128((const __m128i *)(blk + qs_at[type]));
        q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        if (type == GG_Q5_0 || type == GG_Q5_1)
            q = _mm256_or_si256(q, fifth_bits(blk + (type == GG_Q5_0 ? 2 : 4)));
        float d = f16_at(blk);
        *c = type == GG_Q4_0 ? -8.0f * d : type == GG_Q5_0 ? -16.0f * d : f16_at(blk + 2);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, vx), _mm256_set1_epi16(1));
}

/* One weight row of 32-blocks against one quantized row of x: sum_b d dx_b dot_b + c_b
 * xsf_b, two blocks an iteration into two accumulators. */
ALWAYS_INLINE float row_q8_direct(int type, const uint8_t *row, int64_t k, const int8_t *xq,
                                  const float *dx, const float *xsf) {
    const int bb = block_bytes(type);
    const int64_t nb = k / 32;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float t0 = 0.0f, t1 = 0.0f, c0 = 0.0f, c1 = 0.0f;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *blk = row + b * bb;
        __m256i p0 = block32_dot(type, blk, xq + 32 * b, &c0);
        __m256i p1 = block32_dot(type, blk + bb, xq + 32 * b + 32, &c1);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(dx[b] * f16_at(blk)), _mm256_cvtepi32_ps(p0), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(dx[b + 1] * f16_at(blk + bb)),
                             _mm256_cvtepi32_ps(p1), a1);
        if (type != GG_Q8_0) {
            t0 += c0 * xsf[b];
            t1 += c1 * xsf[b + 1];
        }
    }
    if (b < nb) {
        const uint8_t *blk = row + b * bb;
        __m256i p0 = block32_dot(type, blk, xq + 32 * b, &c0);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(dx[b] * f16_at(blk)), _mm256_cvtepi32_ps(p0), a0);
        if (type != GG_Q8_0) t0 += c0 * xsf[b];
    }
    return hsum8(_mm256_add_ps(a0, a1)) + (t0 + t1);
}

/* One weight row against m rows of x, AVX2 types (avx2_type): out[i * ldo] for i < m.
 * K-quants take dx per 256 and xs16 (the int16 sums of xq per 16), the 32-blocks dx per 32
 * and xsf (x_sums). */
static void row_avx2(int type, const uint8_t *row, int64_t k, const int8_t *xq, const float *dx,
                     const float *xsf, const int16_t *xs16, int64_t m, float *out, int64_t ldo) {
    for (int64_t i = 0; i < m;) {
        const int8_t *x = xq + i * k;
        const float *d = dx + i * (k / x_group(type)), *s = xsf + i * (k / 32);
        const int16_t *s16 = xs16 + i * (k / 16);
        int rows = m - i < KQ_ROWS ? (int)(m - i) : KQ_ROWS;
        switch (type) {  /* one copy of each loop per type, and for a single row of x */
#define KQ(T) \
        case T: \
            if (rows == 1) kq_rows(T, row, k, x, d, s16, 1, out + i * ldo, ldo); \
            else kq_rows(T, row, k, x, d, s16, rows, out + i * ldo, ldo); \
            break;
        KQ(GG_Q4_K) KQ(GG_Q5_K) KQ(GG_Q6_K)
#undef KQ
#define Q32(T) case T: out[i * ldo] = row_q8_direct(T, row, k, x, d, s); rows = 1; break;
        Q32(GG_Q4_0) Q32(GG_Q4_1) Q32(GG_Q5_0) Q32(GG_Q5_1)
#undef Q32
        default: out[i * ldo] = row_q8_direct(GG_Q8_0, row, k, x, d, s); rows = 1; break;
        }
        i += rows;
    }
}

static int avx2_type(int type) {
    return block_size(type) >= 32;  /* every block type */
}

/* ------------------------------------------------ AVX2: rows of x in the lanes (K-quants)
 *
 * kq_dot pays a vpmaddwd (the sub-block's scale) for every vpmaddubsw: a register holds 32
 * weights of one sub-block of one row against one row of x. On Zen 1 both run on one pipe
 * (FP0, two cycles a 256-bit one), so that loop tops out at 8 multiply-adds a cycle, the
 * fp32 FMA's rate. Here the lanes are 8 rows of x instead: a vpmaddubsw multiplies 4 weights
 * of one weight row (a broadcast dword) with 4 inputs of each of 8 rows of x, and its int16
 * lanes keep summing along K (vpaddw, any pipe) while the scale stays the same: a Q4_K
 * sub-block (32 weights, 8 steps) takes one vpmaddwd, 8 of 16 (|sum| <= 8 * 2 * 15 * 127 =
 * 30480, no int16 overflow); Q5_K's 5-bit weights one every 4 steps, Q6_K's 6-bit ones every
 * 2 (16002 a step). Every sum is exact in int32, and a block closes as in kq_dot (one fmadd
 * by d dx, Q4_K / Q5_K's mins one fnmadd by dmin dx before it; the mins and Q6_K's -32 are
 * vpmaddwd of x's int16 sums per 32 / 16 with the weights' integer (min / scale) pairs).
 * Each output is the same operations whatever the other rows, so a row's bits do not depend
 * on how many rows come with it (the prompt path takes this at every row count on AVX2).
 *
 * x is laid out once per call a tile of 8 rows at a time, [block][64 steps][8 rows][4]
 * (rows past m: zero); a task is a run of weight rows, whose blocks are unpacked once (into
 * 256 bytes in L1) for every tile; few tiles (a decode step): 2 weight rows a task, each
 * walked from its first block to its last; many (a prompt): 16 a task, block by block, the
 * tiles' sums kept in L1 between blocks so that x's block stays in L2 for all 16. */
#define X8_MIN_ROWS 6      /* gg_linear_q8: from here (decode steps) */
#define X8_FEW_TILES 4     /* up to this many tiles: tasks of 2 weight rows, else 16 */

typedef struct { uint8_t q[2][256]; int16_t sc[2][16]; int32_t pair[2][8]; float d[2], dmin[2]; } x8_rows;

/* weight row `row`'s block into slot j of xr: bytes, scales (int16), pairs of mins (Q4_K /
 * Q5_K) or of scales (Q6_K) as int32 words for the offsets */
ALWAYS_INLINE void x8_unpack(int type, const uint8_t *blk, int ahead, x8_rows *xr, int j) {
    const int bb = block_bytes(type);
    if (ahead)
        for (int line = 0; line < bb; line += 64) _mm_prefetch((const char *)blk + 2 * bb + line, _MM_HINT_T0);
    kq_block u;
    kq_unpack(type, blk, &u);
    for (int s = 0; s < 8; s++) _mm256_store_si256((__m256i *)(xr->q[j] + 32 * s), u.q[s]);
    if (type == GG_Q6_K) {
        _mm256_store_si256((__m256i *)xr->sc[j], u.sc);
        memcpy(xr->pair[j], xr->sc[j], 32);
    } else {
        _mm_store_si128((__m128i *)xr->sc[j], _mm256_castsi256_si128(u.sc));
        _mm_store_si128((__m128i *)xr->pair[j], u.mn);
        xr->dmin[j] = u.dmin;
    }
    xr->d[j] = u.d;
}

/* R weight rows of xr against T tiles (X[t]: the tile's block, [64][8][4]) -> sum[r * T + t],
 * int32 lanes (rows of x): sum_s sc_s dot_s */
ALWAYS_INLINE void x8_dots(int type, const int R, const int T, const x8_rows *xr,
                           const int8_t *const *X, __m256i *sum) {
    const int steps = type == GG_Q4_K ? 8 : type == GG_Q5_K ? 4 : 2;  /* steps a vpmaddwd */
    for (int i = 0; i < R * T; i++) sum[i] = _mm256_setzero_si256();
    for (int p = 0; p < 64 / steps; p++) {
        __m256i acc[4];
        for (int i = 0; i < R * T; i++) acc[i] = _mm256_setzero_si256();
        for (int c = 0; c < steps; c++) {
            const int ch = p * steps + c;  /* weights 4 ch .. 4 ch + 3 */
            __m256i w[2];
            for (int r = 0; r < R; r++) w[r] = _mm256_set1_epi32(((const int32_t *)xr->q[r])[ch]);
            for (int t = 0; t < T; t++) {
                const __m256i x = _mm256_load_si256((const __m256i *)(X[t] + 32 * ch));
                for (int r = 0; r < R; r++)
                    acc[r * T + t] = _mm256_add_epi16(acc[r * T + t], _mm256_maddubs_epi16(w[r], x));
            }
        }
        const int si = type == GG_Q4_K ? p : p / 2;  /* Q5_K: sub-block, Q6_K: group of 16 */
        for (int r = 0; r < R; r++) {
            const __m256i s = _mm256_set1_epi16(xr->sc[r][si]);
            for (int t = 0; t < T; t++)
                sum[r * T + t] = _mm256_add_epi32(sum[r * T + t], _mm256_madd_epi16(acc[r * T + t], s));
        }
    }
}

/* close block b of R rows x T tiles into acc (float lanes [row][tile][8]) */
ALWAYS_INLINE void x8_close(int type, const int R, const int T, const x8_rows *xr,
                            const __m256i *sum, const int16_t *const *XE, const float *const *DX,
                            float *const *acc) {
    const int six = type == GG_Q6_K, pairs = six ? 8 : 4;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            __m256i off = _mm256_setzero_si256();
            for (int p = 0; p < pairs; p++)
                off = _mm256_add_epi32(off, _mm256_madd_epi16(
                    _mm256_load_si256((const __m256i *)(XE[t] + 16 * p)), _mm256_set1_epi32(xr->pair[r][p])));
            const __m256 dx = _mm256_load_ps(DX[t]);
            __m256 v = _mm256_load_ps(acc[r] + 8 * t);
            if (six) {
                v = _mm256_fmadd_ps(_mm256_mul_ps(dx, _mm256_set1_ps(xr->d[r])), _mm256_cvtepi32_ps(
                    _mm256_sub_epi32(sum[r * T + t], _mm256_slli_epi32(off, 5))), v);
            } else {
                v = _mm256_fnmadd_ps(_mm256_mul_ps(dx, _mm256_set1_ps(xr->dmin[r])), _mm256_cvtepi32_ps(off), v);
                v = _mm256_fmadd_ps(_mm256_mul_ps(dx, _mm256_set1_ps(xr->d[r])), _mm256_cvtepi32_ps(sum[r * T + t]), v);
            }
            _mm256_store_ps(acc[r] + 8 * t, v);
        }
}

/* R (1 or 2) weight rows' block b, unpacked in xr, against every tile: acc[r] [tiles][8] */
ALWAYS_INLINE void x8_tiles(int type, const int R, const x8_rows *xr, const int8_t *xt,
                            const float *dxt, const int16_t *xet, int64_t nb, int64_t b,
                            int64_t tiles, float *const *acc) {
    const int64_t xe = type == GG_Q6_K ? 128 : 64;  /* int16 a tile's block */
    int64_t t = 0;
    for (; t + 2 <= tiles; t += 2) {
        const int8_t *X[2] = {xt + (t * nb + b) * 2048, xt + ((t + 1) * nb + b) * 2048};
        const int16_t *XE[2] = {xet + (t * nb + b) * xe, xet + ((t + 1) * nb + b) * xe};
        const float *DX[2] = {dxt + (t * nb + b) * 8, dxt + ((t + 1) * nb + b) * 8};
        float *A[2] = {acc[0] + 8 * t, R > 1 ? acc[1] + 8 * t : NULL};
        __m256i sum[4];
        x8_dots(type, R, 2, xr, X, sum);
        x8_close(type, R, 2, xr, sum, XE, DX, A);
    }
    if (t < tiles) {
        const int8_t *X[1] = {xt + (t * nb + b) * 2048};
        const int16_t *XE[1] = {xet + (t * nb + b) * xe};
        const float *DX[1] = {dxt + (t * nb + b) * 8};
        float *A[2] = {acc[0] + 8 * t, R > 1 ? acc[1] + 8 * t : NULL};
        __m256i sum[2];
        x8_dots(type, R, 1, xr, X, sum);
        x8_close(type, R, 1, xr, sum, XE, DX, A);
    }
}

/* weight rows [r0, r0 + nr) against every tile into out; acc: nr * tiles * 8 floats */
ALWAYS_INLINE void x8_task(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int nr,
                           int64_t k, const int8_t *xt, const float *dxt, const int16_t *xet,
                           int64_t tiles, int64_t m, float *out, int64_t ldo, x8_rows *xr,
                           float *acc) {
    const int64_t nb = k / 256;
    const int bb = block_bytes(type);
    memset(acc, 0, (size_t)(nr * tiles * 8) * sizeof(float));
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < nr; r += 2) {
            const int two = r + 1 < nr;
            const uint8_t *blk = w + (r0 + r) * row_bytes + b * bb;
            x8_unpack(type, blk, b + 2 < nb, xr, 0);
            if (two) x8_unpack(type, blk + row_bytes, b + 2 < nb, xr, 1);
            float *A[2] = {acc + r * tiles * 8, acc + (r + 1) * tiles * 8};
            if (two) x8_tiles(type, 2, xr, xt, dxt, xet, nb, b, tiles, A);
            else x8_tiles(type, 1, xr, xt, dxt, xet, nb, b, tiles, A);
        }
    for (int r = 0; r < nr; r++)
        for (int64_t i = 0; i < m; i++) out[i * ldo + r0 + r] = acc[(r * tiles + i / 8) * 8 + i % 8];
}

/* out [m, n] (row stride ldo) on the rows-of-x-in-lanes kernel, K-quants */
static int x8_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     const int8_t *xq, const float *dx, const int32_t *xs, int64_t m,
                     float *out, int64_t ldo, int threads) {
    const int64_t nb = k / 256, tiles = (m + 7) / 8;
    const int six = type == GG_Q6_K;
    const int64_t xe = six ? 128 : 64;
    const size_t xt_bytes = (size_t)(tiles * nb) * 2048, dxt_bytes = (size_t)(tiles * nb) * 32;
    uint8_t *buf = aligned_alloc(64, xt_bytes + dxt_bytes + (size_t)(tiles * nb * xe) * 2);
    if (!buf) return -1;
    int8_t *xt = (int8_t *)buf;
    float *dxt = (float *)(buf + xt_bytes);
    int16_t *xet = (int16_t *)(buf + xt_bytes + dxt_bytes);
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            int32_t *X = (int32_t *)(xt + (t * nb + b) * 2048);
            float *D = dxt + (t * nb + b) * 8;
            int16_t *E = xet + (t * nb + b) * xe;
            for (int64_t i = 0; i < 8; i++) {
                const int64_t row = 8 * t + i;
                const int in = row < m;
                const int8_t *x = xq + row * k + 256 * b;
                for (int c = 0; c < 64; c++) {
                    int32_t v = 0;
                    if (in) memcpy(&v, x + 4 * c, 4);
                    X[8 * c + i] = v;
                }
                D[i] = in ? dx[row * nb + b] : 0.0f;
                const int32_t *s = xs + row * (k / 16) + 16 * b;
                for (int p = 0; p < xe / 16; p++)  /* Q6_K: sums per 16; else per 32, in pairs */
                    for (int h = 0; h < 2; h++) {
                        const int g = 2 * p + h;
                        E[16 * p + 2 * i + h] = !in ? 0 : (int16_t)(six ? s[g] : s[2 * g] + s[2 * g + 1]);
                    }
            }
        }
    const int per = tiles <= X8_FEW_TILES ? 2 : 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        x8_rows *xr = aligned_alloc(64, (sizeof(x8_rows) + 63) & ~(size_t)63);
        float *acc = aligned_alloc(64, (size_t)(per * tiles * 8) * sizeof(float));
        if (!xr || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (n + per - 1) / per; g++) {
            if (!xr || !acc) continue;
            const int64_t r0 = per * g;
            const int nr = n - r0 < per ? (int)(n - r0) : per;
            switch (type) {  /* one copy of the task per type */
            case GG_Q4_K: x8_task(GG_Q4_K, w, row_bytes, r0, nr, k, xt, dxt, xet, tiles, m, out, ldo, xr, acc); break;
            case GG_Q5_K: x8_task(GG_Q5_K, w, row_bytes, r0, nr, k, xt, dxt, xet, tiles, m, out, ldo, xr, acc); break;
            default: x8_task(GG_Q6_K, w, row_bytes, r0, nr, k, xt, dxt, xet, tiles, m, out, ldo, xr, acc); break;
            }
        }
        free(xr);
        free(acc);
    }
    free(buf);
    return failed ? -1 : 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GG_AVX512 1
/* ------------------------------------------------ AVX-512 VNNI: the K-quants, 64 at a time
 *
 * The same integer sums as kq_dot, on 512-bit registers: a K-quant block unpacks into four
 * registers of 64 weights, two sub-blocks of 32 each (KQ512_SUB: Q6_K's in their natural
 * order, q[j] weights 64j..64j+63; Q4_K's and Q5_K's as their nibbles lie in 64 bytes of qs,
 * q[j] sub-blocks (0, 2), (1, 3), (4, 6), (5, 7): one load, a mask and a shift for two
 * registers, where a broadcast load and a per-half vpsrlvw for each was 1.15x the time of a
 * one-row pass; x is laid in the same order, once per call, kq512_x_order), and each
 * sub-block's scale is pre-spread into int16 lanes (sc[j], one vpermw a register, once per
 * weight block). Per row of x a block then costs 4 vpmaddubsw and 4 vpdpwssd (the scale
 * multiply and the int32 sum in one), against 8 vpmaddubsw, 8 vpshufb and 8 vpmaddwd and
 * the adds on 256 bits. The block's int32 lanes are exact, so only the fp32 sums (16 lanes,
 * one reduction an output) differ from the AVX2 path's; every output is computed the same
 * way whatever the number of rows (kq512_rows and kq512_two_rows share kq512_dot). */
typedef struct { __m512i q[4], sc[4]; __m256i sc16; __m128i mn; float d, dmin; } kq512_block;

/* Q4_K / Q5_K: the sub-blocks of 32 in the low and high halves of register j (kq512_unpack) */
static const int KQ512_SUB[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

/* int16 lanes: each half (16 lanes) shifted by its own count (a, then b) */
ALWAYS_INLINE __m512i halves16(int a, int b) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1);
}

ALWAYS_INLINE void kq512_unpack(int type, const uint8_t *blk, kq512_block *u) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if (type == GG_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const __m512i bits = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            /* L: ql bytes of sub-blocks 4h (low 32) and 4h + 1 (high 32); their high nibbles
             * are 4h + 2, 4h + 3. H: the 32 qh bytes of this half in both halves. */
            __m512i L = _mm512_loadu_si512((const void *)(ql + 64 * h));
            __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            u->q[2 * h] = _mm512_or_si512(_mm512_and_si512(L, low4),
                                          _mm512_and_si512(_mm512_sllv_epi16(H, halves16(4, 2)), bits));
            u->q[2 * h + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(L, 4), low4),
                _mm512_and_si512(_mm512_srlv_epi16(H, halves16(0, 2)), bits));
        }
        /* int16 lane i of register j (weights 64j + 2i, + 1) takes group 4j + i / 8 */
        u->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        __m512i all = _mm512_zextsi256_si512(u->sc16);
        for (int j = 0; j < 4; j++)
            u->sc[j] = _mm512_permutexvar_epi16(_mm512_set_epi16(
                4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3,
                4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2,
                4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                4 * j, 4 * j, 4 * j, 4 * j, 4 * j, 4 * j, 4 * j, 4 * j), all);
        u->d = f16_at(blk + 208);
        return;
    }
    const int five = type == GG_Q5_K;
    const uint8_t *qs = blk + (five ? 48 : 16);
    for (int h = 0; h < 2; h++) {  /* 64 bytes: chunks 2h, 2h + 1 (low nibbles 4h, 4h + 2) */
        __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * h));
        u->q[2 * h] = _mm512_and_si512(v, low4);
        u->q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if (five) {  /* bit 4 of sub-block s: bit s of qh[i], moved to bit 4 */
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        u->q[0] = _mm512_or_si512(u->q[0], _mm512_and_si512(_mm512_sllv_epi16(qh, halves16(4, 2)), bit4));
        u->q[1] = _mm512_or_si512(u->q[1], _mm512_and_si512(_mm512_sllv_epi16(qh, halves16(3, 1)), bit4));
        u->q[2] = _mm512_or_si512(u->q[2], _mm512_and_si512(_mm512_srlv_epi16(qh, halves16(0, 2)), bit4));
        u->q[3] = _mm512_or_si512(u->q[3], _mm512_and_si512(_mm512_srlv_epi16(qh, halves16(1, 3)), bit4));
    }
    __m512i all = _mm512_zextsi128_si512(k4_scales(blk + 4, &u->mn));
    for (int j = 0; j < 4; j++)  /* int16 lanes 0-15: sub-block a's scale, 16-31: b's */
        u->sc[j] = _mm512_permutexvar_epi16(
            _mm512_inserti64x4(_mm512_set1_epi16((short)KQ512_SUB[j][0]),
                               _mm256_set1_epi16((short)KQ512_SUB[j][1]), 1),
            all);
    u->d = f16_at(blk);
    u->dmin = f16_at(blk + 2);
}

/* An unpacked block's 256 weights in their natural order at q (64-byte aligned), minus off */
ALWAYS_INLINE void kq512_store(int type, const kq512_block *u, uint8_t *q, __m512i off) {
    if (type == GG_Q6_K) {
        for (int j = 0; j < 4; j++) _mm512_store_si512((void *)(q + 64 * j), _mm512_sub_epi8(u->q[j], off));
        return;
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_sub_epi8(u->q[j], off);
        _mm256_store_si256((__m256i *)(q + 32 * KQ512_SUB[j][0]), _mm512_castsi512_si256(v));
        _mm256_store_si256((__m256i *)(q + 32 * KQ512_SUB[j][1]), _mm512_extracti64x4_epi64(v, 1));
    }
}

ALWAYS_INLINE void kq512_bytes_of(int type, const uint8_t *blk, uint8_t *q) {
    kq512_block u;
    kq512_unpack(type, blk, &u);  /* its scales left unused */
    kq512_store(type, &u, q, _mm512_setzero_si512());
}

static void kq512_bytes(int type, const uint8_t *blk, uint8_t *q) {
    switch (type) {  /* one unpacking per type */
    case GG_Q4_K: kq512_bytes_of(GG_Q4_K, blk, q); break;
    case GG_Q5_K: kq512_bytes_of(GG_Q5_K, blk, q); break;
    default: kq512_bytes_of(GG_Q6_K, blk, q); break;
    }
}

/* x's rows in kq512_dot's order: Q4_K / Q5_K each block's sub-blocks as the registers take
 * them (KQ512_SUB), Q6_K as they are (returns xq itself; NULL: out of memory) */
static int8_t *kq512_x_order(int type, const int8_t *xq, int64_t m, int64_t k) {
    if (type == GG_Q6_K) return (int8_t *)xq;
    int8_t *xo = malloc((size_t)(m * k));
    if (!xo) return NULL;
    for (int64_t b = 0; b < m * (k / 256); b++)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++)
                memcpy(xo + 256 * b + 64 * j + 32 * h, xq + 256 * b + 32 * KQ512_SUB[j][h], 32);
    return xo;
}

/* kq_dot's sums for one unpacked block and one row of x, into 16 fp32 lanes */
ALWAYS_INLINE void kq512_dot(int type, const kq512_block *u, const int8_t *x, float dx,
                             const int16_t *xs, __m512 *acc) {
    __m512i sumi;
    if (type == GG_Q6_K) {
        __m256i m = _mm256_madd_epi16(u->sc16, _mm256_loadu_si256((const __m256i *)xs));
        sumi = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(m, 5)));
    } else {  /* xs: x's 8 sums per 32 (x_sums) */
        __m128 mins = _mm_cvtepi32_ps(_mm_madd_epi16(u->mn, _mm_loadu_si128((const __m128i *)xs)));
        *acc = _mm512_fnmadd_ps(_mm512_set1_ps(dx * u->dmin), _mm512_zextps128_ps512(mins), *acc);
        sumi = _mm512_setzero_si512();
    }
    /* two chains of exact int32 sums (the same total; half the dependent latency) */
    __m512i sum2 = _mm512_setzero_si512();
    for (int j = 0; j < 4; j += 2) {
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(
            u->q[j], _mm512_loadu_si512((const void *)(x + 64 * j))), u->sc[j]);
        sum2 = _mm512_dpwssd_epi32(sum2, _mm512_maddubs_epi16(
            u->q[j + 1], _mm512_loadu_si512((const void *)(x + 64 * j + 64))), u->sc[j + 1]);
    }
    sumi = _mm512_add_epi32(sumi, sum2);
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(dx * u->d), _mm512_cvtepi32_ps(sumi), *acc);
}

/* Most rows of x one pass over a weight row's blocks serves here (32 registers) */
#define KQ512_ROWS 8
/* x bytes per K chunk (see kq512_group): what stays in L1 beside the weights */
#define KQ512_X_BYTES (24 << 10)

/* kq_rows on 512 bits, over blocks [b0, b1): one weight row against `rows` (<= KQ512_ROWS)
 * rows of x, into the accumulators acc[r] (kept in memory between K chunks) */
ALWAYS_INLINE void kq512_rows(int type, const uint8_t *row, int64_t k, int64_t b0, int64_t b1,
                              const int8_t *xq, const float *dx, const int16_t *xs, int rows,
                              __m512 *acc) {
    const int bb = block_bytes(type);
    __m512 a[KQ512_ROWS];
    for (int r = 0; r < rows; r++) a[r] = acc[r];
    for (int64_t b = b0; b < b1; b++) {
        kq512_block u;
        kq512_unpack(type, row + b * bb, &u);
        for (int r = 0; r < rows; r++)
            kq512_dot(type, &u, xq + r * k + 256 * b, dx[r * (k / 256) + b],
                      xs + r * (k / 16) + 16 * b, &a[r]);
    }
    for (int r = 0; r < rows; r++) acc[r] = a[r];
}

static void kq512_pass(int type, const uint8_t *row, int64_t k, int64_t b0, int64_t b1,
                       const int8_t *xq, const float *dx, const int16_t *xs16, int64_t m,
                       __m512 *acc) {
    for (int64_t i = 0; i < m; i += KQ512_ROWS) {
        const int8_t *x = xq + i * k;
        const float *d = dx + i * (k / 256);
        const int16_t *s16 = xs16 + i * (k / 16);
        int rows = m - i < KQ512_ROWS ? (int)(m - i) : KQ512_ROWS;
        switch (type) {
#define KQ(T) \
        case T: \
            if (rows == KQ512_ROWS) kq512_rows(T, row, k, b0, b1, x, d, s16, KQ512_ROWS, acc + i); \
            else kq512_rows(T, row, k, b0, b1, x, d, s16, rows, acc + i); \
            break;
        KQ(GG_Q4_K) KQ(GG_Q5_K) default: KQ(GG_Q6_K)
#undef KQ
        }
    }
}

/* Weight rows [r0, r1) against m (> 1) rows of x, out[i * ldo + r]: K in chunks whose m rows
 * of x fit in L1 (KQ512_X_BYTES), each chunk through every weight row of the group, so x is
 * read from L1 and not again from L2 for each weight row (at m = 16, k = 8192 that was 1.4x
 * the time). Each output's sums run in the same order whatever m and the chunking: the
 * accumulators (acc: (r1 - r0) * m registers' worth) carry over between chunks. */
static void kq512_group(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t k, const int8_t *xq, const float *dx, const int16_t *xs16,
                        int64_t m, float *out, int64_t ldo, __m512 *acc) {
    const int64_t nb = k / 256;
    int64_t chunk = KQ512_X_BYTES / (256 * m);
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t j = 0; j < (r1 - r0) * m; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
        int64_t b1 = b0 + chunk < nb ? b0 + chunk : nb;
        for (int64_t r = r0; r < r1; r++) {
            /* the next row's part of this chunk, while this one computes (m > 1: the rows'
             * streams restart at every chunk and page, where the streamer loses them) */
            const char *next = (const char *)w + (r + 1) * row_bytes + b0 * block_bytes(type);
            for (int64_t line = 0; line < (b1 - b0) * block_bytes(type); line += 64)
                _mm_prefetch(next + line, _MM_HINT_T0);
            kq512_pass(type, w + r * row_bytes, k, b0, b1, xq, dx, xs16, m, acc + (r - r0) * m);
        }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < m; i++)
            out[i * ldo + r] = _mm512_reduce_add_ps(acc[(r - r0) * m + i]);
}

/* Weight rows a group (kq512_group): their accumulators stay in L1 (16 x 48 x 64 B at most) */
#define KQ512_GROUP 16
/* the fewest rows of x the AMX tiles take (below: the VNNI loop) */
#define AMX_MIN_ROWS 8

/* How far ahead kq512_two_rows fetches rows, into L2: ~8 KB (an even count of rows, at least
 * 2). The loop is as much arithmetic as memory (a block's unpacking, scales and dots: the
 * 3B shape's linears run at ~47 GB/s from L3), so the rows must already be on their way:
 * a pair of rows ahead into L1 read 22 GB/s from memory on an AMD Zen 4 (box: 44), 8 KB
 * ahead into L2 29.5 GB/s; into L1 at any distance, or into L2 at 16-32 KB, less
 * (docs/BENCHMARKS.md). */
#define PF_AHEAD_BYTES 8192
/* Two weight rows (row, row + row_bytes) against one row of x, on 512 bits */
ALWAYS_INLINE void kq512_two_rows(int type, const uint8_t *row, int64_t row_bytes, int64_t k,
                                  const int8_t *xq, const float *dx, const int16_t *xs,
                                  float *out) {
    const int bb = block_bytes(type);
    const int64_t ahead = PF_AHEAD_BYTES / row_bytes < 2 ? 2 : PF_AHEAD_BYTES / row_bytes / 2 * 2;
    __m512 a = _mm512_setzero_ps(), c = a;
    for (int64_t b = 0; b < k / 256; b++) {
        kq512_block u, v;
        /* the blocks of the pair ~8 KB ahead (the streamer stops at each page) */
        for (int line = 0; line < bb; line += 64) {
            _mm_prefetch((const char *)row + ahead * row_bytes + b * bb + line, _MM_HINT_T1);
            _mm_prefetch((const char *)row + (ahead + 1) * row_bytes + b * bb + line, _MM_HINT_T1);
        }
        kq512_unpack(type, row + b * bb, &u);
        kq512_dot(type, &u, xq + 256 * b, dx[b], xs + 16 * b, &a);
        kq512_unpack(type, row + row_bytes + b * bb, &v);
        kq512_dot(type, &v, xq + 256 * b, dx[b], xs + 16 * b, &c);
    }
    out[0] = _mm512_reduce_add_ps(a);
    out[1] = _mm512_reduce_add_ps(c);
}

/* Every weight row against m > 1 rows of x, KQ512_GROUP weight rows a task */
static void kq512_groups(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                         const int8_t *xq, const float *dx, const int16_t *xs16, int64_t m,
                         float *out, int64_t ldo, int threads, int *failed) {
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        __m512 *acc = aligned_alloc(64, (size_t)(KQ512_GROUP * m) * sizeof(__m512));
        if (!acc) {
#pragma omp atomic write
            *failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (n + KQ512_GROUP - 1) / KQ512_GROUP; g++) {
            if (!acc) continue;
            int64_t r0 = g * KQ512_GROUP, r1 = r0 + KQ512_GROUP < n ? r0 + KQ512_GROUP : n;
            kq512_group(type, w, row_bytes, r0, r1, k, xq, dx, xs16, m, out, ldo, acc);
        }
        free(acc);
    }
}

/* 16 x 16 int32 in registers, transposed (unpack 32 / 64-bit, then 128-bit lanes twice) */
ALWAYS_INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* ------------------------------------------------ VNNI with weight rows in the lanes: the
 * K-quants at several rows of x where there are no AMX tiles (AMD Zen 4/5; Intel before
 * Sapphire Rapids; or DUPLEX_GGUF_AMX=0)
 *
 * The loop above (kq512_group) puts 64 weights of one row in a register: per row of x and
 * block, 4 vpmaddubsw + 4 vpdpwssd, then the block's mins, conversion and fmadd, ~16
 * operations for 256 products, and the block is unpacked again for every 8 rows of x. Here
 * 16 weight rows' blocks are unpacked once and transposed into registers of 4 weights x 16
 * rows (lanes: weight rows, vn_block.w), and one vpdpbusd adds those times 4 bytes of a row
 * of x broadcast from memory (x is the signed operand as it is; Q4_K / Q5_K / Q6_K weights
 * are unsigned). A sub-block (32 weights; Q6_K 16) is 8 (4) of them into exact int32 sums,
 * then one conversion and one fmadd by d sc (a register of the 16 rows' factors): ~90
 * operations for 16 weight rows x 256 weights and a row of x, where the loop above takes
 * ~256. Q6_K's -32 starts each sub-block's sum (-32 times x's sum over it); Q4_K's and
 * Q5_K's mins close each block, dmin m times dx x's sums. Every output's operations are the
 * same whatever the other rows of x (a row's bits do not depend on the batch on this path),
 * and differ in the last bits from the one-row loop's (kq512_two), as AMX's do. */
#define VN_MIN_ROWS 8  /* below: kq512_group (measured, docs/BENCHMARKS.md) */
#define VN_STREAM_ROWS 64  /* from this many rows of x, outputs are stored past the caches */

typedef struct {
    uint8_t w[64][64];   /* the block of 16 rows: [k / 4][16 rows][4 weights] */
    float sc[16][16];    /* [sub-block][row]: d sc (Q6_K: 16 sub-blocks of 16, else 8 of 32) */
    float mn[8][16];     /* [sub-block][row]: dmin m (Q4_K, Q5_K) */
} vn_block;

static int gg_vn_off;  /* gg_set_vn(0): kq512_group at every row count (tests, measurements) */

void gg_set_vn(int on) { gg_vn_off = !on; }
int gg_vn_available(void) { return !gg_vn_off; }

/* A bit field of every byte: (v >> s) & mask (s < 0: v << -s), |s| < 8; the shifts are 16-bit,
 * and a bit that crosses into the other byte of a 16-bit lane falls outside the mask */
ALWAYS_INLINE __m512i vn_bits(__m512i v, int s, int mask) {
    return _mm512_and_si512(s >= 0 ? _mm512_srli_epi16(v, s) : _mm512_slli_epi16(v, -s),
                            _mm512_set1_epi8((char)mask));
}

/* Block b of weight rows [r0, r0 + nr) into vb (rows from nr on: zero). The 16 rows' packed
 * bits are transposed as they are in the file, 4 bytes a lane (a 4-byte group of quants is 4
 * weights of one row, so the transposed groups are vn_block.w's registers once the bit
 * fields are split), and so are their scales (one register of 16 per row). Unpacking each
 * row into bytes first and transposing those took twice the shuffles and a round trip
 * through memory (docs/BENCHMARKS.md). */
ALWAYS_INLINE void vn_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int nr,
                             int64_t b, int64_t nb, vn_block *vb) {
    const int bb = block_bytes(type), six = type == GG_Q6_K, five = type == GG_Q5_K;
    const int qs = six ? 0 : five ? 48 : 16;  /* Q6_K: ql; else qs (nibbles) */
    __m512i lo[16], hi[16], h[16], f[16];
    for (int r = 0; r < 16; r++) {
        if (r >= nr) {
            lo[r] = hi[r] = h[r] = f[r] = _mm512_setzero_si512();
            continue;
        }
        const uint8_t *blk = w + (r0 + r) * row_bytes + b * bb;
        if (b + 1 < nb)  /* the 16 rows' next blocks (their streams restart at every page) */
            for (int line = 0; line < bb; line += 64) _mm_prefetch((const char *)blk + bb + line, _MM_HINT_T0);
        lo[r] = _mm512_loadu_si512((const void *)(blk + qs));
        hi[r] = _mm512_loadu_si512((const void *)(blk + qs + 64));
        /* Q6_K: qh (64 bytes); Q5_K: qh (32) and 32 bytes of qs, unused */
        h[r] = six ? _mm512_loadu_si512((const void *)(blk + 128))
                   : five ? _mm512_loadu_si512((const void *)(blk + 16)) : _mm512_setzero_si512();
        __m512 fr;
        if (six) {
            fr = _mm512_mul_ps(_mm512_set1_ps(f16_at(blk + 208)), _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        } else {  /* lanes 0-7: d sc, 8-15: dmin m */
            __m128i m;
            __m128i s8 = k4_scales(blk + 4, &m);
            const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(f16_at(blk)),
                                                 _mm256_set1_ps(f16_at(blk + 2)), 1);
            fr = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(
                _mm512_cvtepi16_epi32(_mm256_set_m128i(m, s8))));
        }
        f[r] = _mm512_castps_si512(fr);
    }
    transpose16(f);
    for (int s = 0; s < 16; s++)  /* Q6_K: 16 scales; else 8 scales, then 8 mins */
        _mm512_store_si512((void *)(six || s < 8 ? vb->sc[s] : vb->mn[s - 8]), f[s]);
    if (six || five) transpose16(h);
    transpose16(lo);
    transpose16(hi);
    /* lane group p of lo (hi: + 128 weights): Q4_K / Q5_K byte 4 (p % 8) of 32-byte chunk c
     * = p / 8 (2 + p / 8): low nibbles weights 64c + 4 (p % 8), high ones 32 further; Q6_K
     * ql of half 0 (1): low nibbles weights 4p, high ones 64 further, and qh dword 8 half
     * + p % 8 the 2 high bits, bits 0-1 / 4-5 (p < 8) or 2-3 / 6-7 (p >= 8) */
    for (int half = 0; half < 2; half++) {
        const __m512i *v = half ? hi : lo;
        for (int p = 0; p < 16; p++) {
            __m512i a = vn_bits(v[p], 0, 0x0F), z = vn_bits(v[p], 4, 0x0F);
            int wa, wz;
            if (six) {
                const __m512i q = h[8 * half + p % 8];
                a = _mm512_or_si512(a, vn_bits(q, p < 8 ? -4 : -2, 0x30));
                z = _mm512_or_si512(z, vn_bits(q, p < 8 ? 0 : 2, 0x30));
                wa = 32 * half + p;
                wz = wa + 16;
            } else {
                const int c = 2 * half + p / 8;
                if (five) {  /* bit 2c (low nibbles) and 2c + 1 (high) of qh, to bit 4 */
                    a = _mm512_or_si512(a, vn_bits(h[p % 8], 2 * c - 4, 0x10));
                    z = _mm512_or_si512(z, vn_bits(h[p % 8], 2 * c - 3, 0x10));
                }
                wa = 16 * c + p % 8;
                wz = wa + 8;
            }
            _mm512_store_si512((void *)vb->w[wa], a);
            _mm512_store_si512((void *)vb->w[wz], z);
        }
    }
}

/* Block b of vb against rows of x [0, G) into t[c] (lanes: the 16 weight rows). xq: the
 * first row's 256 bytes of block b, the next rows' 256 bytes apart (x block-major); dx, xe:
 * the first row's; xe: Q6_K -32 x's sums per 16 [m][k / 16] (int32), else dx x's sums per 32
 * [m][nb][8] (fp32). */
ALWAYS_INLINE void vn_group(int type, const vn_block *vb, const int8_t *xq, int64_t k, int64_t b,
                            const float *dx, const void *xe, const int G, __m512 *t) {
    const int six = type == GG_Q6_K, ns = six ? 16 : 8, kg = six ? 4 : 8;
    const int64_t nb = k / 256;
    __m512 a[8];
    for (int c = 0; c < G; c++) a[c] = _mm512_setzero_ps();
    for (int s = 0; s < ns; s++) {
        __m512i W[8], acc[8];
        for (int i = 0; i < kg; i++) W[i] = _mm512_load_si512((const void *)vb->w[kg * s + i]);
        const __m512 f = _mm512_load_ps(vb->sc[s]);
        for (int c = 0; c < G; c++)
            acc[c] = six ? _mm512_set1_epi32(((const int32_t *)xe)[c * (k / 16) + 16 * b + s])
                         : _mm512_setzero_si512();
        /* the G rows' sums in turn, so G independent vpdpbusd are in flight */
        for (int i = 0; i < kg; i++)
            for (int c = 0; c < G; c++)
                acc[c] = _mm512_dpbusd_epi32(acc[c], W[i], _mm512_set1_epi32(
                    ((const int32_t *)(xq + 256 * c + 4 * kg * s))[i]));
        for (int c = 0; c < G; c++) a[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]), f, a[c]);
    }
    for (int c = 0; c < G; c++) {
        __m512 v = _mm512_fmadd_ps(a[c], _mm512_set1_ps(dx[c * nb + b]), t[c]);
        if (!six) {
            const float *xm = (const float *)xe + (c * nb + b) * 8;
            for (int s = 0; s < 8; s++) v = _mm512_fnmadd_ps(_mm512_load_ps(vb->mn[s]), _mm512_set1_ps(xm[s]), v);
        }
        t[c] = v;
    }
}

ALWAYS_INLINE void vn_task(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int nr,
                           int64_t k, const int8_t *xq, const float *dx, const uint8_t *xe,
                           size_t xe_row, int64_t m, float *out, int64_t ldo, int stream,
                           vn_block *vb, __m512 *t) {
    const int64_t nb = k / 256, mp = (m + 3) / 4 * 4;  /* x is padded with zero rows to mp */
    for (int64_t c = 0; c < mp; c++) t[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        vn_unpack(type, w, row_bytes, r0, nr, b, nb, vb);
        /* rows of x 8 at a time, then 4: a constant count keeps the sums in registers */
        int64_t c = 0;
        for (; c + 8 <= mp; c += 8)
            vn_group(type, vb, xq + (b * mp + c) * 256, k, b, dx + c * nb, xe + c * xe_row, 8, t + c);
        if (c < mp)
            vn_group(type, vb, xq + (b * mp + c) * 256, k, b, dx + c * nb, xe + c * xe_row, 4, t + c);
    }
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    if (stream && nr == 16)  /* whole strips only (vn_linear) */
        for (int64_t c = 0; c < m; c++) _mm512_stream_ps(out + c * ldo + r0, t[c]);
    else
        for (int64_t c = 0; c < m; c++) _mm512_mask_storeu_ps(out + c * ldo + r0, keep, t[c]);
}

/* out [m, n] (row stride ldo) on the lanes-as-rows kernel: weight rows 16 a task */
static int vn_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     const int8_t *xq, const float *dx, const int32_t *xs, int64_t m,
                     float *out, int64_t ldo, int threads) {
    const int64_t nb = k / 256, mp = (m + 3) / 4 * 4;  /* rows of x padded to 4 */
    const int six = type == GG_Q6_K;
    const size_t xe_row = six ? (size_t)(k / 16) * 4 : (size_t)(nb * 8) * 4;
    /* per row of x: Q6_K -32 x's sums, else dx x's sums; then x block-major ([nb][mp][256]:
     * a block's rows of x one stream, not 256 bytes of each row k apart: 1.04-1.06x at 512
     * rows, docs/BENCHMARKS.md) and dx, both padded with zero rows */
    const size_t xe_bytes = ((size_t)mp * xe_row + 63) / 64 * 64, xq_bytes = (size_t)(mp * k);
    uint8_t *xe = aligned_alloc(64, xe_bytes + xq_bytes + (size_t)(mp * nb) * 4);
    if (!xe) return -1;
    memset(xe + m * xe_row, 0, xe_bytes - (size_t)m * xe_row);  /* the padding rows' sums */
    int8_t *xp = (int8_t *)(xe + xe_bytes);
    float *dp = (float *)(xe + xe_bytes + xq_bytes);
    memcpy(dp, dx, (size_t)(m * nb) * 4);
    memset(dp + m * nb, 0, (size_t)((mp - m) * nb) * 4);
    const int8_t *xq_rows = xq;
    xq = xp;
    dx = dp;
    /* A task's outputs are a 16-column strip, one line a row of x, each row ldo apart. From
     * 64 rows (prompt steps) whole strips of an aligned output go straight to memory: a
     * normal store first reads each line in (strided, one line a row) and the strips of a
     * wide output outgrow the caches before the next op reads them; 1.02-1.05x at 64-512
     * rows (docs/BENCHMARKS.md). At decode row counts the output stays in cache for the
     * next op. */
    const int stream = m >= VN_STREAM_ROWS && ((uintptr_t)out & 63) == 0 && ldo % 16 == 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        /* x block-major and its sums, shared out too (at prompt row counts a serial copy
         * left the other threads waiting: a few % of a prompt step) */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t i = 0; i < m; i++) memcpy(xp + (b * mp + i) * 256, xq_rows + i * k + 256 * b, 256);
            memset(xp + (b * mp + m) * 256, 0, (size_t)((mp - m) * 256));
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            if (six) {
                int32_t *e = (int32_t *)(xe + i * xe_row);
                for (int64_t j = 0; j < k / 16; j++) e[j] = -32 * xs[i * (k / 16) + j];
            } else {
                float *e = (float *)(xe + i * xe_row);
                for (int64_t j = 0; j < nb * 8; j++)
                    e[j] = dx[i * nb + j / 8] * (float)(xs[i * (k / 16) + 2 * j] + xs[i * (k / 16) + 2 * j + 1]);
            }
        }
        /* per thread: the unpacked block, then the rows' sums */
        uint8_t *scratch = aligned_alloc(64, sizeof(vn_block) + (size_t)mp * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        vn_block *vb = (vn_block *)scratch;
        __m512 *t = scratch ? (__m512 *)(scratch + sizeof(vn_block)) : NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (n + 15) / 16; g++) {
            if (!scratch) continue;
            const int64_t r0 = 16 * g;
            const int nr = n - r0 < 16 ? (int)(n - r0) : 16;
            /* one copy of the task per type, its type a constant */
#define VN_TASK(T) vn_task(T, w, row_bytes, r0, nr, k, xq, dx, xe, xe_row, m, out, ldo, stream, vb, t)
            switch (type) {
            case GG_Q4_K: VN_TASK(GG_Q4_K); break;
            case GG_Q5_K: VN_TASK(GG_Q5_K); break;
            default: VN_TASK(GG_Q6_K); break;
            }
#undef VN_TASK
        }
        _mm_sfence();  /* the streamed stores are done before the region's barrier */
        free(scratch);
    }
    free(xe);
    return failed ? -1 : 0;
}

/* ------------------------------------------------ VNNI with rows of x in the lanes: the
 * K-quants at decode batch sizes (5-8, 13-16 and 29-32 rows of x: xl_rows)
 *
 * vn_linear above puts 16 weight rows in the lanes, so every block of them is transposed
 * before its dots; with 512 rows of x that is shared by 64 groups, at 16 rows by 2, and
 * reading and transposing then costs as much as the dots (docs/BENCHMARKS.md). Here the
 * roles swap: the lanes are 16 rows of x (x is transposed once per call, [k / 4][16 rows]
 * [4 bytes] a tile), and a weight row's block is only unpacked into its bytes in their order
 * (kq512_unpack: masks and shifts, no shuffles across rows), 4 of them broadcast into each
 * vpdpbusd against a register of x. A sub-block's sums of 8 weight rows are 8 (Q6_K 4)
 * vpdpbusd each, then one conversion and one fmadd by the row's d sc broadcast; Q6_K's -32
 * starts each sum (-32 times x's sums per 16, a register of the 16 rows), Q4_K's and Q5_K's
 * mins close each block (dmin m broadcast times dx x's sums per 32). The same operations
 * as vn_linear per output, in the other orientation, so the sub-blocks' bound is the same
 * (64 vpdpbusd in 81 slots); what goes is the transposition. Lane-wise too: an output's
 * bits do not depend on the other rows of x on this path. Outputs of 16 weight rows are
 * transposed once at the end of each task. */
#define XL_MAX_ROWS 32  /* at most 2 tiles; from 3 on vn_linear is as fast (docs/BENCHMARKS.md) */
#define XL_W 8          /* weight rows unpacked and dotted together (8 sums in flight) */
#if defined(__AVX512VL__)
#define XL8 1           /* tiles of 8 rows of x in 256-bit registers (xl_group8) */
#endif

typedef struct {
    uint8_t q[XL_W][256];  /* a block of each weight row, one byte a weight, in order */
    float f[XL_W][16];     /* d sc per sub-block (Q6_K: 16 of 16, else 8 of 32) */
    float mn[XL_W][8];     /* dmin m (Q4_K, Q5_K) */
} xl_block;

static int gg_xl_off;  /* gg_set_xl(0): vn_linear at these row counts (tests, measurements) */

void gg_set_xl(int on) { gg_xl_off = !on; }

/* Whether m rows of x take xl_linear: a tile's 16 lanes hold 13 to 16 of them, or 8 lanes 5
 * to 8. A tile costs the same at any count, and vn_linear's time grows with its groups of 8
 * and 4 rows: at 9-12 rows (and 17-28) it is as fast, at 13-16 (29-32) xl_linear is
 * 1.13-1.28x; below 8 rows the row loop (kq512_group) is faster up to 4, and an 8-lane tile
 * 1.16-1.55x at 5-8 (docs/BENCHMARKS.md). */
static int xl_rows(int64_t m) {
    if (gg_xl_off || m > XL_MAX_ROWS) return 0;
#if defined(XL8)
    if (m >= 5 && m <= 8) return 1;  /* one tile of 8 lanes (xl_group8) */
#endif
    return m % 16 == 0 || m % 16 > 12;
}

/* Block b of weight rows [r0, r0 + nr) (nr <= XL_W) into xb; rows from nr on: zero. */
ALWAYS_INLINE void xl_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int nr,
                             int64_t b, int64_t nb, xl_block *xb) {
    const int bb = block_bytes(type);
    for (int r = 0; r < XL_W; r++) {
        if (r >= nr) {
            memset(xb->q[r], 0, sizeof xb->q[r]);
            memset(xb->f[r], 0, sizeof xb->f[r]);
            memset(xb->mn[r], 0, sizeof xb->mn[r]);
            continue;
        }
        const uint8_t *blk = w + (r0 + r) * row_bytes + b * bb;
        if (b + 1 < nb)
            for (int line = 0; line < bb; line += 64) _mm_prefetch((const char *)blk + bb + line, _MM_HINT_T0);
        kq512_block u;
        kq512_unpack(type, blk, &u);  /* its scale registers are left unused */
        kq512_store(type, &u, xb->q[r], _mm512_setzero_si512());
        if (type == GG_Q6_K) {
            _mm512_store_ps(xb->f[r], _mm512_mul_ps(_mm512_set1_ps(f16_at(blk + 208)), _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))))));
        } else {
            __m128i m;
            __m128i s8 = k4_scales(blk + 4, &m);
            _mm256_store_ps(xb->f[r], _mm256_mul_ps(_mm256_set1_ps(f16_at(blk)),
                                                    _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(s8))));
            _mm256_store_ps(xb->mn[r], _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 2)),
                                                     _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(m))));
        }
    }
}

/* xb's XL_W weight rows against one tile of x at block b into t[XL_W] (lanes: rows of x).
 * X: the tile's block, 64 registers [k / 4 in the block][16 rows][4]; DX: dx of the 16 rows;
 * XE: Q6_K -32 x's sums per 16 (int32 [16][16 rows]), else dx x's sums per 32 (fp32 [8][16]). */
ALWAYS_INLINE void xl_group(int type, const xl_block *xb, const int8_t *X, const float *DX,
                            const void *XE, __m512 *t) {
    const int six = type == GG_Q6_K, ns = six ? 16 : 8, kg = six ? 4 : 8;
    __m512 a[XL_W];
    for (int r = 0; r < XL_W; r++) a[r] = _mm512_setzero_ps();
    for (int s = 0; s < ns; s++) {
        __m512i acc[XL_W];
        const __m512i start = six ? _mm512_load_si512((const void *)((const int32_t *)XE + 16 * s))
                                  : _mm512_setzero_si512();
        for (int r = 0; r < XL_W; r++) acc[r] = start;
        for (int i = 0; i < kg; i++) {
            const __m512i x = _mm512_load_si512((const void *)(X + 64 * (kg * s + i)));
            for (int r = 0; r < XL_W; r++)
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(
                    ((const int32_t *)xb->q[r])[kg * s + i]), x);
        }
        for (int r = 0; r < XL_W; r++)
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(xb->f[r][s]), a[r]);
    }
    const __m512 dx = _mm512_load_ps(DX);
    for (int r = 0; r < XL_W; r++) {
        __m512 v = _mm512_fmadd_ps(a[r], dx, t[r]);
        if (!six)
            for (int s = 0; s < 8; s++)
                v = _mm512_fnmadd_ps(_mm512_set1_ps(xb->mn[r][s]),
                                     _mm512_load_ps((const float *)XE + 16 * s), v);
        t[r] = v;
    }
}

#if defined(XL8)
/* xl_group on 8 lanes, a tile of 8 rows of x in 256-bit registers: Zen 4 issues two 256-bit
 * vpdpbusd a cycle (cpu_gguf.peak_ops: int8-256 at int8's rate), so 5-8 rows of x (a decode
 * step at concurrency 8) lose nothing to half-empty 512-bit lanes. X [64][8 rows][4]; DX [8];
 * XE: Q6_K int32 [16][8], else fp32 [8][8]. The same operations per output. */
ALWAYS_INLINE void xl_group8(int type, const xl_block *xb, const int8_t *X, const float *DX,
                             const void *XE, __m512 *t) {  /* t[r]'s lower 8 lanes */
    const int six = type == GG_Q6_K, ns = six ? 16 : 8, kg = six ? 4 : 8;
    __m256 a[XL_W];
    for (int r = 0; r < XL_W; r++) a[r] = _mm256_setzero_ps();
    for (int s = 0; s < ns; s++) {
        __m256i acc[XL_W];
        const __m256i start = six ? _mm256_load_si256((const __m256i *)((const int32_t *)XE + 8 * s))
                                  : _mm256_setzero_si256();
        for (int r = 0; r < XL_W; r++) acc[r] = start;
        for (int i = 0; i < kg; i++) {
            const __m256i x = _mm256_load_si256((const __m256i *)(X + 32 * (kg * s + i)));
            for (int r = 0; r < XL_W; r++)
                acc[r] = _mm256_dpbusd_epi32(acc[r], _mm256_set1_epi32(
                    ((const int32_t *)xb->q[r])[kg * s + i]), x);
        }
        for (int r = 0; r < XL_W; r++)
            a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(xb->f[r][s]), a[r]);
    }
    const __m256 dx = _mm256_load_ps(DX);
    for (int r = 0; r < XL_W; r++) {
        __m256 v = _mm256_fmadd_ps(a[r], dx, *(const __m256 *)(t + r));
        if (!six)
            for (int s = 0; s < 8; s++)
                v = _mm256_fnmadd_ps(_mm256_set1_ps(xb->mn[r][s]),
                                     _mm256_load_ps((const float *)XE + 8 * s), v);
        *(__m256 *)(t + r) = v;
    }
}
#endif

/* Weight rows [r0, r0 + nr) (nr <= 16) against every tile of L (16 or 8) rows of x into out.
 * xt [tiles][nb][64][L][4 bytes], dxt [tiles][nb][L], xet [tiles][nb][xe_floats] (see
 * xl_group); t: 16 a tile, of L lanes. */
ALWAYS_INLINE void xl_task(int type, const int L, const uint8_t *w, int64_t row_bytes, int64_t r0,
                           int nr, int64_t k, const int8_t *xt, const float *dxt,
                           const float *xet, int64_t xe_floats, int64_t tiles, int64_t m,
                           float *out, int64_t ldo, xl_block *xb, __m512 *t) {
    const int64_t nb = k / 256;
    for (int64_t i = 0; i < 16 * tiles; i++) t[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int h = 0; h < 16 / XL_W && XL_W * h < nr; h++) {
            const int rows = nr - XL_W * h < XL_W ? nr - XL_W * h : XL_W;
            xl_unpack(type, w, row_bytes, r0 + XL_W * h, rows, b, nb, xb);
            for (int64_t c = 0; c < tiles; c++) {
                const int64_t at = c * nb + b;
#if defined(XL8)
                if (L == 8) {
                    xl_group8(type, xb, xt + at * 2048, dxt + at * 8, xet + at * xe_floats,
                              t + 16 * c + XL_W * h);
                    continue;
                }
#endif
                xl_group(type, xb, xt + at * 4096, dxt + at * 16, xet + at * xe_floats,
                         t + 16 * c + XL_W * h);
            }
        }
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int64_t c = 0; c < tiles; c++) {  /* [weight row][row of x] -> rows of out */
        __m512i v[16];
        for (int r = 0; r < 16; r++)
            v[r] = L == 16 ? _mm512_castps_si512(t[16 * c + r])  /* an 8-lane tile: the upper */
                           : _mm512_zextsi256_si512(_mm256_castps_si256(  /* lanes zero */
                                 *(const __m256 *)(t + 16 * c + r)));
        transpose16(v);
        for (int64_t i = 0; i < L && L * c + i < m; i++)
            _mm512_mask_storeu_ps(out + (L * c + i) * ldo + r0, keep, _mm512_castsi512_ps(v[i]));
    }
}

/* out [m, n] (row stride ldo), m <= XL_MAX_ROWS, on the rows-of-x-in-lanes kernel: tiles of
 * 16 rows of x, or one of 8 for 8 rows or fewer (XL8) */
static int xl_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     const int8_t *xq, const float *dx, const int32_t *xs, int64_t m,
                     float *out, int64_t ldo, int threads) {
#if defined(XL8)
    const int L = m <= 8 ? 8 : 16;
#else
    const int L = 16;
#endif
    const int64_t nb = k / 256, tiles = (m + L - 1) / L;
    const int six = type == GG_Q6_K;
    const int64_t xe_floats = (six ? 16 : 8) * L;
    const size_t xt_bytes = (size_t)(tiles * nb) * 256 * L, dxt_floats = (size_t)(tiles * nb) * L;
    uint8_t *buf = aligned_alloc(64, xt_bytes + (dxt_floats + (size_t)(tiles * nb * xe_floats)) * 4);
    if (!buf) return -1;
    int8_t *xt = (int8_t *)buf;
    float *dxt = (float *)(buf + xt_bytes), *xet = dxt + dxt_floats;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
        /* x transposed a tile at a time, [64 groups of 4][L rows]; rows past m are zero (and so
         * are their sums: they add nothing). 16 rows: each 64 bytes (16 groups) -> 16 registers
         * of one group of each row; 8 rows: a dword at a time. */
#pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < tiles; c++)
            for (int64_t b = 0; b < nb; b++) {
                int8_t *xb = xt + (c * nb + b) * 256 * L;
                if (L == 16) {
                    for (int64_t g = 0; g < 4; g++) {
                        __m512i v[16];
                        for (int64_t i = 0; i < 16; i++)
                            v[i] = 16 * c + i < m ? _mm512_loadu_si512((const void *)(xq + (16 * c + i) * k + 256 * b + 64 * g))
                                                  : _mm512_setzero_si512();
                        transpose16(v);
                        for (int j = 0; j < 16; j++) _mm512_store_si512((void *)(xb + (16 * g + j) * 64), v[j]);
                    }
                } else {
                    for (int64_t i = 0; i < L; i++)
                        for (int64_t g = 0; g < 64; g++) {
                            int32_t v = 0;
                            if (L * c + i < m) memcpy(&v, xq + (L * c + i) * k + 256 * b + 4 * g, 4);
                            memcpy(xb + (g * L + i) * 4, &v, 4);
                        }
                }
                float *d = dxt + (c * nb + b) * L, *e = xet + (c * nb + b) * xe_floats;
                for (int64_t i = 0; i < L; i++) {
                    const int64_t row = L * c + i;
                    d[i] = row < m ? dx[row * nb + b] : 0.0f;
                    if (six) {
                        for (int s = 0; s < 16; s++)
                            ((int32_t *)e)[L * s + i] = row < m ? -32 * xs[row * (k / 16) + 16 * b + s] : 0;
                    } else {
                        for (int s = 0; s < 8; s++)
                            e[L * s + i] = row < m ? dx[row * nb + b] * (float)(xs[row * (k / 16) + 16 * b + 2 * s] +
                                                                             xs[row * (k / 16) + 16 * b + 2 * s + 1])
                                                   : 0.0f;
                    }
                }
            }
        /* per thread: the unpacked blocks, then the sums of each tile */
        uint8_t *scratch = aligned_alloc(64, sizeof(xl_block) + (size_t)(16 * tiles) * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        xl_block *xb = (xl_block *)scratch;
        __m512 *t = scratch ? (__m512 *)(scratch + sizeof(xl_block)) : NULL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (n + 15) / 16; g++) {
            if (!scratch) continue;
            const int64_t r0 = 16 * g;
            const int nr = n - r0 < 16 ? (int)(n - r0) : 16;
            /* one copy of the task per type and tile width, both constants */
#define XL_TASK(T, L) xl_task(T, L, w, row_bytes, r0, nr, k, xt, dxt, xet, xe_floats, tiles, m, out, ldo, xb, t)
#define XL_TASKS(T) if (L == 8) XL_TASK(T, 8); else XL_TASK(T, 16)
            switch (type) {
            case GG_Q4_K: XL_TASKS(GG_Q4_K); break;
            case GG_Q5_K: XL_TASKS(GG_Q5_K); break;
            default: XL_TASKS(GG_Q6_K); break;
            }
#undef XL_TASKS
#undef XL_TASK
        }
        free(scratch);
    }
    free(buf);
    return failed ? -1 : 0;
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#define GG_AMX 1
/* ------------------------------------------------ AMX-INT8: the K-quants at 2+ rows of x
 *
 * A tile multiply (TDPBUSD; Q6_K: TDPBSSD on q - 32) sums 16 weight rows x 16 rows of x over
 * one sub-block (Q4_K / Q5_K: 32 weights, Q6_K: 16) in int32 at once: 8192 / 4096 products
 * an instruction, where the VNNI loop above does 64 a vpmaddubsw + vpdpwssd pair (its speed
 * is that pair's port). The sub-block's integer scale then multiplies the 16 x 16 sums in
 * fp32, lane-wise (the lanes are rows of x), and the block's d and x's dx close the block:
 *
 *   out[n][r] += dx[n] d[r] sum_s sc[r][s] C_s[r][n] - dx[n] dmin[r] sum_s m[r][s] xs32[n][s]
 *
 * Each output's fp32 operations are the same whatever the other rows (lane-wise), so rows
 * of x give the same bits alone or together on this path; they differ in the last bits from
 * the VNNI path's, which one row of x takes (gg_linear_q8). Weights: 16 rows of a block are
 * unpacked into a 16 x 256 byte buffer (the A tiles); x is laid out once per call as the B
 * tiles want it (4 bytes of a row of x per column: [k / 4][16 rows][4]). */
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } gg_tilecfg;

static int gg_amx_state;  /* 0: not asked yet, 1: the kernel may use AMX tiles, -1: not */
static int gg_amx_off;    /* gg_set_amx(0): the VNNI path only (tests, measurements) */

void gg_set_amx(int on) { gg_amx_off = !on; }

/* One tile multiply in a forked child: some VMs advertise AMX and fault on it (llama.cpp's
 * AMX kernels die with SIGILL on such a VM), which must cost a child, never the worker. */
static int amx_probe(void) {
    pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) {
        gg_tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        _tile_dpbusd(0, 1, 2);
        _tile_release();
        _exit(0);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Linux gives a process AMX tile state only when asked (arch_prctl; torch's oneDNN asks
 * too); then the probe, once. */
static int amx_ok(void) {
    if (gg_amx_off) return 0;
    if (gg_amx_state == 0) {
        long rc = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
        gg_amx_state = rc == 0 && amx_probe() ? 1 : -1;
    }
    return gg_amx_state == 1;
}

int gg_amx_available(void) { return amx_ok(); }

static void amx_config(int ks) {
    gg_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  /* C: 16 x 16 int32 */
    for (int t = 4; t < 6; t++) { cfg.rows[t] = 16; cfg.colsb[t] = (uint16_t)ks; }  /* A */
    for (int t = 6; t < 8; t++) { cfg.rows[t] = (uint8_t)(ks / 4); cfg.colsb[t] = 64; }  /* B */
    _tile_loadconfig(&cfg);
}

/* One block of weight row `blk` into 256 bytes at q (Q6_K: q - 32 as int8) and its factors:
 * sc[s] per sub-block (Q6_K: per 16), mn[s] = dmin m[s] (Q4_K / Q5_K), d. */
ALWAYS_INLINE void amx_unpack(int type, const uint8_t *blk, uint8_t *q, float *sc, float *mn,
                              float *d) {
    kq512_block u;
    kq512_unpack(type, blk, &u);
    kq512_store(type, &u, q, _mm512_set1_epi8(type == GG_Q6_K ? 32 : 0));
    *d = u.d;
    if (type == GG_Q6_K) {
        _mm512_storeu_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(u.sc16)));
        return;
    }
    __m128i m;
    __m128i s8 = k4_scales(blk + 4, &m);
    _mm256_storeu_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(s8)));
    /* dmin m: the factor of x's sums, one broadcast operand each below */
    _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(u.dmin),
                                       _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(m))));
}

/* Sub-block S of the block in ub (A tile TA) against x's (B tile TB) into C tile TC */
#define AMX_SUB(SIX, KS, TC, TA, TB, S)                                                       \
    do {                                                                                      \
        _tile_loadd(TA, ub + (S) * (KS), 256);                                                \
        _tile_loadd(TB, xb + (b * 256 + (S) * (KS)) * 16, 64);                                \
        _tile_zero(TC);                                                                       \
        if (SIX) _tile_dpbssd(TC, TA, TB); else _tile_dpbusd(TC, TA, TB);                     \
    } while (0)

/* Every sub-block of the block in ub against one group of x: four tile multiplies in flight
 * (C tiles 0-3), then their sums stored to cb [sub-block][16 r][16 c] */
#define AMX_BLOCK(SIX, KS)                                                                    \
    for (int s = 0; s < 256 / (KS); s += 4) {                                                 \
        AMX_SUB(SIX, KS, 0, 4, 6, s);                                                         \
        AMX_SUB(SIX, KS, 1, 5, 7, s + 1);                                                     \
        AMX_SUB(SIX, KS, 2, 4, 6, s + 2);                                                     \
        AMX_SUB(SIX, KS, 3, 5, 7, s + 3);                                                     \
        _tile_stored(0, cb + 256 * s, 64);                                                    \
        _tile_stored(1, cb + 256 * (s + 1), 64);                                              \
        _tile_stored(2, cb + 256 * (s + 2), 64);                                              \
        _tile_stored(3, cb + 256 * (s + 3), 64);                                              \
    }

/* tot [16 r][16 c] (fp32) -> out[c * ldo + r] for r < nr, c < nc: transposed 16 x 16 */
ALWAYS_INLINE void amx_store(const float *tot, int nr, int64_t nc, float *out, int64_t ldo) {
    float t[16][16] __attribute__((aligned(64)));
    __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                    208, 224, 240);
    for (int c = 0; c < nc; c++)  /* column c of tot: a gather of 16 strided lanes */
        _mm512_store_ps(t[c], _mm512_i32gather_ps(idx, tot + c, 4));
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int c = 0; c < nc; c++) _mm512_mask_storeu_ps(out + c * ldo, keep, _mm512_load_ps(t[c]));
}

/* Weight rows [r0, r0 + nr) (nr <= 16) against every group of 16 rows of x (xg: group g at
 * xg + g * per: its B layout, then dx [nb][16], then dx times its sums per 32 [nb][8][16]):
 * each block is unpacked once for all the groups; tot: [groups][16 r][16 c]. */
ALWAYS_INLINE void amx_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int nr,
                            int64_t k, const uint8_t *xg, size_t per, int64_t groups,
                            float *tot, uint8_t *ub, int32_t *cb) {
    const int six = type == GG_Q6_K, bb = block_bytes(type);
    const int64_t nb = k / 256;
    const size_t xb_bytes = (size_t)(16 * k);
    float sc[16][16], mn[16][8], d[16];
    memset(sc, 0, sizeof sc); memset(mn, 0, sizeof mn); memset(d, 0, sizeof d);
    memset(ub, 0, 16 * 256);
    for (int64_t j = 0; j < groups * 256; j++) tot[j] = 0.0f;
    const int ns = six ? 16 : 8;
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < nr; r++) {
            const uint8_t *blk = w + (r0 + r) * row_bytes + b * bb;
            if (b + 1 < nb)  /* 16 rows' streams, one block ahead (measured: 1 beats 2, 4, 8) */
                for (int line = 0; line < bb; line += 64) _mm_prefetch((const char *)blk + bb + line, _MM_HINT_T0);
            amx_unpack(type, blk, ub + 256 * r, sc[r], mn[r], &d[r]);
        }
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *xb = (const int8_t *)(xg + (size_t)g * per);
            const float *dxv = (const float *)(xg + (size_t)g * per + xb_bytes), *xmv = dxv + nb * 16;
            float *tg = tot + g * 256;
            if (six) { AMX_BLOCK(1, 16) } else { AMX_BLOCK(0, 32) }
            const __m512 dx = _mm512_loadu_ps(dxv + 16 * b);
            __m512 xm[8];
            for (int s = 0; s < 8; s++) xm[s] = six ? dx : _mm512_loadu_ps(xmv + (b * 8 + s) * 16);
            for (int r = 0; r < nr; r++) {  /* each row: its sub-blocks' sums by their scales */
                __m512 a = _mm512_setzero_ps();
                for (int s = 0; s < ns; s++)
                    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb + 256 * s + 16 * r))),
                                        _mm512_set1_ps(sc[r][s]), a);
                __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(a, _mm512_set1_ps(d[r])), dx,
                                           _mm512_loadu_ps(tg + 16 * r));
                if (!six)
                    for (int s = 0; s < 8; s++)
                        t = _mm512_fnmadd_ps(_mm512_set1_ps(mn[r][s]), xm[s], t);
                _mm512_storeu_ps(tg + 16 * r, t);
            }
        }
    }
}

/* out [m, n] on the tiles (any m; gg_linear_q8 gives AMX_MIN_ROWS or more): x in groups of 16 rows (the last one padded with zero
 * rows), weight rows 16 a task. */
static int amx_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                      const int8_t *xq, const float *dx, const int32_t *xs, int64_t m,
                      float *out, int64_t ldo, int threads) {
    const int64_t nb = k / 256, groups = (m + 15) / 16;
    /* per group of x: B layout (16 k bytes), dx [nb][16], dx xs32 [nb][8][16] */
    const size_t xb_bytes = (size_t)(16 * k), per = xb_bytes + (size_t)(nb * 16 + nb * 128) * 4;
    uint8_t *xbuf = aligned_alloc(64, (size_t)groups * per);
    if (!xbuf) return -1;
    if (m % 16) memset(xbuf + (size_t)(groups - 1) * per, 0, per);  /* the padding rows */
    int failed = 0;
    const int ks = type == GG_Q6_K ? 16 : 32;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 16)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {  /* x into the B layout, its scales and sums */
            uint8_t *g = xbuf + (size_t)(i / 16) * per;
            int32_t *xb = (int32_t *)g;
            float *dxv = (float *)(g + xb_bytes), *xmv = dxv + nb * 16;
            const int32_t *xi = (const int32_t *)(xq + i * k);
            const int c = (int)(i % 16);
            for (int64_t q4 = 0; q4 < k / 4; q4++) xb[q4 * 16 + c] = xi[q4];
            for (int64_t b = 0; b < nb; b++) {
                float d = dx[i * nb + b];
                dxv[b * 16 + c] = d;
                for (int s = 0; s < 8; s++) {
                    const int32_t *x16 = xs + i * (k / 16) + b * 16 + 2 * s;
                    xmv[(b * 8 + s) * 16 + c] = d * (float)(x16[0] + x16[1]);
                }
            }
        }
        uint8_t *ub = aligned_alloc(64, 16 * 256 + 16 * 1024 + (size_t)groups * 1024);
        if (!ub) {
#pragma omp atomic write
            failed = 1;
        } else {
            amx_config(ks);
        }
        int32_t *cb = ub ? (int32_t *)(ub + 16 * 256) : NULL;
        float *tot = ub ? (float *)(ub + 16 * 256 + 16 * 1024) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (n + 15) / 16; t++) {
            if (!ub) continue;
            const int64_t r0 = 16 * t;
            const int nr = n - r0 < 16 ? (int)(n - r0) : 16;
            switch (type) {
            case GG_Q4_K: amx_rows(GG_Q4_K, w, row_bytes, r0, nr, k, xbuf, per, groups, tot, ub, cb); break;
            case GG_Q5_K: amx_rows(GG_Q5_K, w, row_bytes, r0, nr, k, xbuf, per, groups, tot, ub, cb); break;
            default: amx_rows(GG_Q6_K, w, row_bytes, r0, nr, k, xbuf, per, groups, tot, ub, cb); break;
            }
            for (int64_t g = 0; g < groups; g++)
                amx_store(tot + g * 256, nr, m - 16 * g < 16 ? m - 16 * g : 16,
                          out + 16 * g * ldo + r0, ldo);
        }
        if (ub) _tile_release();
        free(ub);
    }
    free(xbuf);
    return failed ? -1 : 0;
}

#endif

static void kq512_two(int type, const uint8_t *row, int64_t row_bytes, int64_t k,
                      const int8_t *xq, const float *dx, const int16_t *xs16, float *out) {
    switch (type) {
    case GG_Q4_K: kq512_two_rows(GG_Q4_K, row, row_bytes, k, xq, dx, xs16, out); break;
    case GG_Q5_K: kq512_two_rows(GG_Q5_K, row, row_bytes, k, xq, dx, xs16, out); break;
    default: kq512_two_rows(GG_Q6_K, row, row_bytes, k, xq, dx, xs16, out); break;
    }
}
#endif
#else
static int avx2_type(int type) { (void)type; return 0; }
#endif

/* The row kernels' sums of x: K-quants xs16 [m, k/16] = xs as int16 (|xs| <= 16 * 127;
 * AVX-512's Q4_K / Q5_K: per 32, below); 32-blocks xsf [m, k/32] = dx xs summed over each 32. */
static void x_sums(int type, int64_t m, int64_t k, const float *dx, const int32_t *xs,
                   float *xsf, int16_t *xs16) {
    if (block_size(type) == 256) {
        for (int64_t j = 0; j < m * (k / 16); j++) xs16[j] = (int16_t)xs[j];
#if defined(GG_AVX512)
        /* kq512_dot's Q4_K / Q5_K mins take x's sums per 32, the first 8 of each block's
         * 16 (|sum| <= 32 * 127): added once here, not again for every weight row */
        if (type != GG_Q6_K)
            for (int64_t j = 0; j < m * (k / 256); j++)
                for (int s = 0; s < 8; s++) xs16[16 * j + s] = (int16_t)(xs16[16 * j + 2 * s] + xs16[16 * j + 2 * s + 1]);
#endif
    } else {
        for (int64_t j = 0; j < m * (k / 32); j++)
            xsf[j] = dx[j] * (float)(xs[2 * j] + xs[2 * j + 1]);
    }
}

/* out [m, n] (row stride ldo) = x @ w.T from gg_quantize_x's xq, dx, xs (block types; dx
 * per x_group(type) inputs). */
/* Which kernel gg_linear_q8 gives m rows of x of a type: the K-quants' AMX tiles, rows of x
 * in the lanes, weight rows in the lanes, or the row loops below (Q8_LOOP). */
enum { Q8_LOOP, Q8_AMX, Q8_XL, Q8_VN, Q8_X8 };

/* gg_set_x8(0): AVX2 without AVX-512 keeps the row loop at every row count, and
 * gg_linear_lanes is off (tests, measurements) */
static int gg_x8_off;
void gg_set_x8(int on) { gg_x8_off = !on; }
/* whether gg_linear_lanes runs here: the AVX2 kernel with rows of x in the lanes (x8_linear) */
int gg_x8_available(void) {
#if defined(__AVX2__) && !defined(GG_AVX512)
    return !gg_x8_off;
#else
    return 0;
#endif
}

static int q8_kernel(int type, int64_t m) {
    if (!avx2_type(type) || block_size(type) != 256) return Q8_LOOP;
#if defined(GG_AMX)
    if (m >= AMX_MIN_ROWS && amx_ok()) return Q8_AMX;
#endif
#if defined(GG_AVX512)
    if (xl_rows(m)) return Q8_XL;
    if (m >= VN_MIN_ROWS && !gg_vn_off) return Q8_VN;
#elif defined(__AVX2__)
    if (m >= X8_MIN_ROWS && !gg_x8_off) return Q8_X8;
#endif
    (void)m;
    return Q8_LOOP;
}

#if defined(GG_AVX512)
/* Whether K-quant matmuls of m rows of x take xl_linear (for the tests: its bits are
 * vn_linear's, so they cannot tell) */
int gg_xl_takes(int64_t m) { return q8_kernel(GG_Q4_K, m) == Q8_XL; }
#endif

int gg_linear_q8(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                 const int8_t *xq, const float *dx, const int32_t *xs, int64_t m, float *out,
                 int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes) || m < 1 || block_size(type) < 32) return -1;
    int failed = 0, direct = avx2_type(type);
    /* one row of x against K-quants: AVX-512 takes weight rows two at a time (kq512_two);
     * AVX2 one (kq_rows: a single stream through the rows reads memory faster) */
    int64_t step = 1;
#if defined(GG_AVX512)
    if (direct && m == 1 && block_size(type) == 256) step = 2;
#endif
    switch (q8_kernel(type, m)) {
#if defined(GG_AMX)
    case Q8_AMX: return amx_linear(type, w, row_bytes, n, k, xq, dx, xs, m, out, ldo, threads);
#endif
#if defined(GG_AVX512)
    case Q8_XL: return xl_linear(type, w, row_bytes, n, k, xq, dx, xs, m, out, ldo, threads);
    case Q8_VN: return vn_linear(type, w, row_bytes, n, k, xq, dx, xs, m, out, ldo, threads);
#endif
#if defined(__AVX2__)
    case Q8_X8: return x8_linear(type, w, row_bytes, n, k, xq, dx, xs, m, out, ldo, threads);
#endif
    default: break;
    }
    float *xsf = direct ? malloc((size_t)(m * (k / 16)) * sizeof(float)) : NULL;
    int16_t *xs16 = (int16_t *)xsf;  /* the same scratch: one or the other */
    if (direct && !xsf) return -1;
    if (direct) x_sums(type, m, k, dx, xs, xsf, xs16);
#if defined(GG_AVX512)
    const int8_t *xq_in = xq;
    if (direct && block_size(type) == 256) {
        xq = kq512_x_order(type, xq, m, k);
        if (!xq) {
            free(xsf);
            return -1;
        }
    }
    if (direct && block_size(type) == 256 && m > 1) {
        kq512_groups(type, w, row_bytes, n, k, xq, dx, xs16, m, out, ldo, threads, &failed);
        if (xq != xq_in) free((void *)xq);
        free(xsf);
        return failed ? -1 : 0;
    }
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
        for (int64_t p = 0; p < (n + step - 1) / step; p++) {
            const int64_t r = p * step;
            if (!ok) continue;
#if defined(__AVX2__)
#if defined(GG_AVX512)
            if (block_size(type) == 256) {  /* one row of x (m > 1: kq512_groups) */
                __m512 acc;
                if (r + 1 < n)
                    kq512_two(type, w + r * row_bytes, row_bytes, k, xq, dx, xs16, out + r);
                else
                    kq512_group(type, w, row_bytes, r, r + 1, k, xq, dx, xs16, 1, out, ldo, &acc);
                continue;
            }
#endif
            if (direct) {
                row_avx2(type, w + r * row_bytes, k, xq, dx, xsf, xs16, m, out + r, ldo);
                continue;
            }
#endif
            row_q8(type, w + r * row_bytes, k, xq, dx, xs, m, out + r, ldo, q, f);
        }
        free(q);
        free(f);
    }
#if defined(GG_AVX512)
    if (xq != xq_in) free((void *)xq);
#endif
    free(xsf);
    return failed ? -1 : 0;
}

/* The bf16 GEMM's output blocks into rows: src [blocks][n][size] (one block of `size` rows
 * of x, transposed: what `chunk @ rows.T` writes) -> dst [m][n], dst[i][j] =
 * src[i / size][j][i % size], rows i < m (<= blocks * size). torch's strided copy of the same
 * (transpose, reshape, contiguous) took 1.7 ms for 512 x 8192, 14 % of that GEMM. */

int gg_unblock_bf16(const uint16_t *src, int64_t blocks, int64_t n, int64_t size, int64_t m,
                    uint16_t *dst, int threads) {
    if (m < 1 || m > blocks * size || size < 1 || n < 1) return -1;
    const int64_t nj = n / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(threads) collapse(2) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t rows = m - b * size < size ? m - b * size : size;
            if (rows <= 0) continue;
            const uint16_t *sb = src + b * n * size;
            uint16_t *db = dst + b * size * n;
            int64_t r0 = 0;
#if defined(GG_KQ512)
            if (j0 < nj) {
                /* 16 columns j by 32 rows r a tile: pairs of rows as int32, transposed, then
                 * each pair split into its two rows (even words, odd words) */
                const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13,
                                                       11, 9, 7, 5, 3, 1, 30, 28, 26, 24, 22,
                                                       20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                for (; r0 + 32 <= size && r0 < rows; r0 += 32) {
                    __m512i v[16];
                    for (int t = 0; t < 16; t++)
                        v[t] = _mm512_loadu_si512((const void *)(sb + (j0 + t) * size + r0));
                    transpose16(v);
                    for (int u = 0; u < 16; u++) {
                        __m512i z = _mm512_permutexvar_epi16(split, v[u]);
                        int64_t r = r0 + 2 * u;
                        if (r < rows)
                            _mm256_storeu_si256((__m256i *)(db + r * n + j0), _mm512_castsi512_si256(z));
                        if (r + 1 < rows)
                            _mm256_storeu_si256((__m256i *)(db + (r + 1) * n + j0),
                                                _mm512_extracti64x4_epi64(z, 1));
                    }
                }
            }
#endif
            const int64_t j1 = j0 + 16 < n ? j0 + 16 : n;
            for (int64_t r = r0; r < rows; r++)  /* what the tiles left (all rows past nj) */
                for (int64_t j = j0; j < j1; j++) db[r * n + j] = sb[j * size + r];
        }
    }
    return 0;
}

#if defined(GG_KQ512)
/* A buffer of this thread's, grown (never shrunk) to at least `bytes`: a call's x tiles,
 * panel and sums (megabytes a prompt step) would otherwise be mapped, faulted in and
 * unmapped on every call. NULL when out of memory. */
static void *gb_scratch(void **buf, size_t *cap, size_t bytes) {
    if (*cap < bytes) {
        free(*buf);
        *buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}
#endif

#if defined(GG_AMX) && defined(GG_KQ512) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* ------------------------------------------------ AMX-BF16: prompt steps on the file's blocks
 *
 * out [m, n] bf16 = x [m, k] bf16 @ w.T with fp32 sums. The weights are dequantized to bf16
 * a panel at a time into L2 and never written to memory: GB_NP weight rows by GB_KC inputs
 * (256 KB, dequant_row_bf16's bytes, the bf16 chunks'), rows as they are: the A tiles (16
 * weight rows by 32 inputs). x is laid out once per call as the B tiles want it ([input
 * pair][16 rows of x][2]). Four C tiles (32 weight rows by 32 rows of x) are in flight;
 * between input slices their sums wait in an fp32 buffer (stored and loaded exactly), so
 * every output is one sum over its inputs in one order, whatever m, the row's place or the
 * blocking: a prompt's rows give the same bits alone, after a prefix-cache hit or inside a
 * long prompt. */
#define GB_NP 256   /* weight rows a panel */
#define GB_KC 512   /* inputs a slice (a multiple of 256: whole K-quant blocks) */
#define GB_MC 1024  /* rows of x a pass (their sums for a panel: GB_MC x GB_NP fp32, 1 MB) */

static __thread void *gb_x, *gb_vb, *gb_acc;
static __thread size_t gb_x_cap, gb_vb_cap, gb_acc_cap;

static void gb_config(void) {
    gg_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* C tiles (+)= 32 weight rows at wa (row stride GB_KC) by the 32 rows of x whose B tiles
 * start at xb (the second 16 rows `xstep` tiles on), `steps` pairs of tiles; the sums at c
 * ([weight row][row of x], row stride ldc) */
static void gb_tiles(const uint16_t *wa, const uint16_t *xb, int64_t xstep, int64_t steps,
                     float *c, int64_t ldc, int first) {
    if (first) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, c, ldc * 4);
        _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4);
        _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
    }
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(6, xb + 512 * s, 64);
        _tile_loadd(7, xb + 512 * (xstep + s), 64);
        _tile_loadd(4, wa + 32 * s, GB_KC * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, wa + 16 * GB_KC + 32 * s, GB_KC * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

/* gg_gemm_bf16 on AMX tiles. Weight panels are split between the threads. -1: no memory. */
static int amx_gemm_bf16(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                         const uint16_t *x, int64_t ldx, int64_t m, uint16_t *out, int64_t ldo,
                         int threads) {
    const int bs = block_size(type), bb = block_bytes(type);
    const int64_t npanels = (n + GB_NP - 1) / GB_NP, ks = k / 32;
    const int64_t groups = (m + 31) / 32 * 2;  /* of 16 rows of x: whole pairs */
    uint16_t *xb = gb_scratch(&gb_x, &gb_x_cap, (size_t)(groups * ks) * 1024);
    if (!xb) return -1;
    int failed = 0;
    const int64_t mc = m < GB_MC ? groups * 16 : GB_MC;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < groups * ks; t++) {  /* x into B tiles: 16 rows' input pairs */
            const int64_t g = t / ks, s = t % ks;
            __m512i v[16];
            for (int r = 0; r < 16; r++) {
                const int64_t i = 16 * g + r;
                v[r] = i < m ? _mm512_loadu_si512((const void *)(x + i * ldx + 32 * s))
                             : _mm512_setzero_si512();
            }
            transpose16(v);  /* v[p]: input pair p of the 16 rows */
            uint16_t *tile = xb + t * 512;
            for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(tile + 32 * p), v[p]);
        }
        uint16_t *vb = gb_scratch(&gb_vb, &gb_vb_cap, (size_t)GB_NP * GB_KC * 2);
        float *acc = gb_scratch(&gb_acc, &gb_acc_cap, (size_t)(mc * GB_NP) * 4);
        if (!vb || !acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            gb_config();
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npanels; p++) {
            if (!vb || !acc) continue;
            const int64_t r0 = p * GB_NP;
            const int nr = n - r0 < GB_NP ? (int)(n - r0) : GB_NP, npairs = (nr + 31) / 32;
            for (int64_t m0 = 0; m0 < m; m0 += mc) {  /* one pass: all of k for mc rows */
                const int64_t m1 = m0 + mc < m ? m0 + mc : m;
                for (int64_t k0 = 0; k0 < k; k0 += GB_KC) {
                    const int64_t kl = k - k0 < GB_KC ? k - k0 : GB_KC;
                    for (int r = 0; r < 32 * npairs; r++) {
                        if (r < nr) {
                            const uint8_t *row = w + (r0 + r) * row_bytes + k0 / bs * bb;
                            dequant_row_bf16(type, row, kl, vb + (int64_t)r * GB_KC);
                            /* the row's next slice: 256 strided streams, which the
                             * prefetchers do not follow; in L2 when this row comes again */
                            if (k0 + GB_KC < k)
                                for (int64_t b = kl / bs * bb; b < 2 * kl / bs * bb && b < row_bytes - k0 / bs * bb; b += 64)
                                    _mm_prefetch((const char *)row + b, _MM_HINT_T1);
                        } else
                            memset(vb + (int64_t)r * GB_KC, 0, (size_t)kl * 2);
                    }
                    for (int64_t i0 = m0; i0 < m1; i0 += 32)
                        for (int wp = 0; wp < npairs; wp++)
                            gb_tiles(vb + (int64_t)32 * wp * GB_KC,
                                     xb + ((i0 / 16) * ks + k0 / 32) * 512, ks, kl / 32,
                                     acc + (int64_t)32 * wp * mc + (i0 - m0), mc, k0 == 0);
                }
                /* the sums [weight row][row of x] -> out rows, rounded once to bf16 */
                for (int64_t i0 = m0; i0 < m1; i0 += 16)
                    for (int c0 = 0; c0 < nr; c0 += 16) {
                        __m512i v[16];
                        for (int c = 0; c < 16; c++)
                            v[c] = _mm512_load_si512((const void *)(acc + (int64_t)(c0 + c) * mc + (i0 - m0)));
                        transpose16(v);  /* v[u]: row i0 + u of x, 16 weight rows */
                        const __mmask16 keep = nr - c0 >= 16 ? (__mmask16)0xFFFF
                                                             : (__mmask16)((1u << (nr - c0)) - 1);
                        for (int u = 0; u < 16 && i0 + u < m1; u++)
                            _mm256_mask_storeu_epi16(out + (i0 + u) * ldo + r0 + c0, keep,
                                                     (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(v[u])));
                    }
            }
        }
        if (vb && acc) _tile_release();
    }
    return failed ? -1 : 0;
}
#define GG_AMX_BF16 1
#endif

#if defined(GG_KQ512) && defined(__AVX512BF16__)
/* ----------------------------------------- AVX512-BF16: prompt steps on the file's blocks
 *
 * The same product as the AMX-BF16 kernel, for CPUs with AVX512-BF16 and no AMX (an AMD
 * Zen 4): out [m, n] bf16 = x [m, k] bf16 @ w.T with fp32 sums, the weights dequantized to
 * bf16 a panel at a time and never written to memory. A panel is BP_NR = 32 weight rows over
 * all of k, laid out as vdpbf16ps takes them: input pair p of the 32 rows in two registers
 * ([pair][32 rows][2], k * 64 bytes: 512 KB at k = 8192, streamed from L2). x is laid out
 * once per call in blocks of BP_MR rows ([block][pair][BP_MR rows], 32-bit pairs), each
 * pair broadcast to the 16 lanes. A tile, BP_MR rows of x by 32 weight rows, keeps its
 * 2 * BP_MR sums in registers over all of k and rounds each once to bf16: every output is one
 * fp32 sum in one order whatever m, the row's place in its block or the threads, so a
 * prompt's rows give the same bits alone, after a prefix-cache hit or inside a long prompt
 * (oneDNN's sums change with M: the chunks' reason for fixed 64-row blocks). */
#define BP_NR 32
#define BP_MR 12   /* 24 sums, 2 weight registers: 26 of the 32 registers */
#define BP_KB 256  /* inputs dequantized at a time (one K-quant block) */

static int gg_bp_off;  /* gg_set_bf16_gemm(0): the caller's dequantized chunks instead */
void gg_set_bf16_gemm(int on) { gg_bp_off = !on; }
static __thread void *bp_w, *bp_t;
static __thread size_t bp_w_cap, bp_t_cap;
static __thread void *bp_x;  /* the calling thread's: its x blocks, read by every thread */
static __thread size_t bp_x_cap;

ALWAYS_INLINE void bp_tile(const int mr, const uint16_t *wp, const uint32_t *xp, int64_t kp,
                           uint16_t *out, int64_t ldo, __mmask16 keep0, __mmask16 keep1) {
    __m512 c0[BP_MR], c1[BP_MR];
    for (int i = 0; i < mr; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; p++) {
        const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(wp + 64 * p));
        const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(wp + 64 * p + 32));
#pragma GCC unroll 12
        for (int i = 0; i < mr; i++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[p * BP_MR + i]);
            c0[i] = _mm512_dpbf16_ps(c0[i], w0, xb);
            c1[i] = _mm512_dpbf16_ps(c1[i], w1, xb);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_mask_storeu_epi16(out + i * ldo, keep0, (__m256i)_mm512_cvtneps_pbh(c0[i]));
        _mm256_mask_storeu_epi16(out + i * ldo + 16, keep1, (__m256i)_mm512_cvtneps_pbh(c1[i]));
    }
}

/* 32 weight rows from r0 (nr of them real, the rest zeros) over all of k -> wp */
static void bp_panel(int type, const uint8_t *w, int64_t row_bytes, int64_t r0, int nr,
                     int64_t k, uint16_t *tmp, uint16_t *wp) {
    const int bs = block_size(type), bb = block_bytes(type);
    for (int64_t k0 = 0; k0 < k; k0 += BP_KB) {
        const int kl = k - k0 < BP_KB ? (int)(k - k0) : BP_KB;
        for (int r = 0; r < BP_NR; r++) {
            if (r < nr) {
                const uint8_t *row = w + (r0 + r) * row_bytes;
                dequant_row_bf16(type, row + k0 / bs * bb, kl, tmp + r * BP_KB);
                /* the row's next block: 32 strided streams, which the prefetchers do not
                 * follow (a 1B ffn_down, k = 8192: 3.0 G weights/s without, at M = 1) */
                if (k0 + BP_KB < k) {
                    const int64_t b0 = (k0 + BP_KB) / bs * bb, b1 = row_bytes;
                    for (int64_t b = b0; b < b0 + BP_KB / bs * bb && b < b1; b += 64)
                        _mm_prefetch((const char *)row + b, _MM_HINT_T0);
                }
            } else
                memset(tmp + r * BP_KB, 0, (size_t)kl * 2);
        }
        for (int g = 0; g < 2; g++)
            for (int c = 0; c < kl; c += 32) {  /* 16 rows by 16 input pairs, transposed */
                __m512i v[16];
                for (int r = 0; r < 16; r++)
                    v[r] = _mm512_loadu_si512((const void *)(tmp + (16 * g + r) * BP_KB + c));
                transpose16(v);  /* v[q]: pair q of the 16 rows */
                for (int q = 0; q < 16; q++)
                    _mm512_store_si512((void *)(wp + ((k0 + c) / 2 + q) * 64 + 32 * g), v[q]);
            }
    }
}

static int bp_gemm_bf16(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                        const uint16_t *x, int64_t ldx, int64_t m, uint16_t *out, int64_t ldo,
                        int threads) {
    const int64_t kp = k / 2, blocks = (m + BP_MR - 1) / BP_MR, npanels = (n + BP_NR - 1) / BP_NR;
    uint32_t *xp = gb_scratch(&bp_x, &bp_x_cap, (size_t)(blocks * kp * BP_MR) * 4);
    if (!xp) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)  /* x into blocks of BP_MR rows, pairs interleaved */
            for (int r = 0; r < BP_MR; r++) {
                const int64_t i = b * BP_MR + r;
                const uint32_t *src = (const uint32_t *)(x + i * ldx);
                uint32_t *dst = xp + b * kp * BP_MR + r;
                if (i < m)
                    for (int64_t p = 0; p < kp; p++) dst[p * BP_MR] = src[p];
                else
                    for (int64_t p = 0; p < kp; p++) dst[p * BP_MR] = 0;
            }
        uint16_t *wp = gb_scratch(&bp_w, &bp_w_cap, (size_t)k * BP_NR * 2);
        uint16_t *tmp = gb_scratch(&bp_t, &bp_t_cap, (size_t)BP_NR * BP_KB * 2);
        if (!wp || !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < npanels; pn++) {
            if (!wp || !tmp) continue;
            const int64_t r0 = pn * BP_NR;
            const int nr = n - r0 < BP_NR ? (int)(n - r0) : BP_NR;
            bp_panel(type, w, row_bytes, r0, nr, k, tmp, wp);
            const __mmask16 keep0 = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
            const __mmask16 keep1 = nr >= 32 ? (__mmask16)0xFFFF
                                  : nr <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nr - 16)) - 1);
            for (int64_t b = 0; b < blocks; b++) {
                const int mr = m - b * BP_MR < BP_MR ? (int)(m - b * BP_MR) : BP_MR;
                const uint32_t *xb = xp + b * kp * BP_MR;
                uint16_t *o = out + b * BP_MR * ldo + r0;
                switch (mr) {  /* constant row counts: the sums stay in registers */
#define BP_CASE(R) case R: bp_tile(R, wp, xb, kp, o, ldo, keep0, keep1); break;
                    BP_CASE(1) BP_CASE(2) BP_CASE(3) BP_CASE(4) BP_CASE(5) BP_CASE(6)
                    BP_CASE(7) BP_CASE(8) BP_CASE(9) BP_CASE(10) BP_CASE(11) BP_CASE(12)
#undef BP_CASE
                }
            }
        }
    }
    return failed ? -1 : 0;
}
#define GG_BP_BF16 1
#endif

/* 1: prompt GEMMs run on AMX-BF16 tiles, 2: on AVX512-BF16 (bp_gemm_bf16), 0: neither here
 * (the caller dequantizes chunks for oneDNN) */
int gg_gemm_bf16_kind(void) {
#if defined(GG_AMX_BF16)
    if (amx_ok()) return 1;
#endif
#if defined(GG_BP_BF16)
    if (!gg_bp_off) return 2;
#endif
    return 0;
}

/* out [m, n] bf16 (row stride ldo) = x [m, k] bf16 (row stride ldx) @ w.T on the file's
 * blocks (gg_gemm_bf16_kind's kernel); k a multiple of 32. -1: refused (no such kernel
 * here, bad arguments, no memory). */
int gg_gemm_bf16(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                 const uint16_t *x, int64_t ldx, int64_t m, uint16_t *out, int64_t ldo,
                 int threads) {
    if (gg_check(type, k, row_bytes) || m < 1 || n < 1 || k % 32) return -1;
    switch (gg_gemm_bf16_kind()) {
#if defined(GG_AMX_BF16)
    case 1: return amx_gemm_bf16(type, w, row_bytes, n, k, x, ldx, m, out, ldo, threads);
#endif
#if defined(GG_BP_BF16)
    case 2: return bp_gemm_bf16(type, w, row_bytes, n, k, x, ldx, m, out, ldo, threads);
#endif
    default: return -1;
    }
}

/* ------------------------------------------------ the CPU's own limits, measured
 *
 * gg_peak: operations a second (2 per multiply-add, summed over `threads` threads) of the
 * instruction an inner loop above is built on, issued back to back into 24 independent
 * accumulators, `iters` times 24 per thread: the most that kernel's arithmetic could do on
 * this box. kind 0: vdpbf16ps on 512 bits (bp_gemm_bf16: 32 multiply-adds), 1: vpdpbusd on
 * 512 bits (vn_linear, kq512: 64), 2: vpdpbusd on 256 bits (32). -1: not built here.
 * `duplex bench gguf-linears` prints each kernel's rate beside these (on the Zen 4 VM of
 * docs/BENCHMARKS.md both issue one a cycle a core: int8 has twice the multiply-adds).
 * AVX2 (12 accumulators in registers 4-15): kind 3: vfmadd231ps on 256 bits (8 multiply-adds:
 * the fp32 GEMM of the prompt tiles), 4: AVX2's int8 dot, vpmaddubsw + vpmaddwd + vpaddd into
 * an accumulator (32 multiply-adds: kq_dot, block32_dot), 4 independent ones an iteration. */
#include <time.h>

/* 24 accumulators in registers 8-31, written in assembly: compilers copy or spill some of
 * them around a destructive instruction, which a rate probe cannot have */
#define GG_ACC24(op, r)                                                                         \
    op " %1, %0, %%" r "8\n\t" op " %1, %0, %%" r "9\n\t" op " %1, %0, %%" r "10\n\t"          \
    op " %1, %0, %%" r "11\n\t" op " %1, %0, %%" r "12\n\t" op " %1, %0, %%" r "13\n\t"        \
    op " %1, %0, %%" r "14\n\t" op " %1, %0, %%" r "15\n\t" op " %1, %0, %%" r "16\n\t"        \
    op " %1, %0, %%" r "17\n\t" op " %1, %0, %%" r "18\n\t" op " %1, %0, %%" r "19\n\t"        \
    op " %1, %0, %%" r "20\n\t" op " %1, %0, %%" r "21\n\t" op " %1, %0, %%" r "22\n\t"        \
    op " %1, %0, %%" r "23\n\t" op " %1, %0, %%" r "24\n\t" op " %1, %0, %%" r "25\n\t"        \
    op " %1, %0, %%" r "26\n\t" op " %1, %0, %%" r "27\n\t" op " %1, %0, %%" r "28\n\t"        \
    op " %1, %0, %%" r "29\n\t" op " %1, %0, %%" r "30\n\t" op " %1, %0, %%" r "31\n\t"
#define GG_CLOBBER24(r)                                                                         \
    r "8", r "9", r "10", r "11", r "12", r "13", r "14", r "15", r "16", r "17", r "18",       \
    r "19", r "20", r "21", r "22", r "23", r "24", r "25", r "26", r "27", r "28", r "29",     \
    r "30", r "31"

#if defined(GG_AVX512)
static __attribute__((noinline)) void peak_loop(int kind, int64_t iters) {
    const __m512i w = _mm512_set1_epi32(0x3f803f80);  /* bf16 1.0 pairs; bytes 0x80, 0x3f */
    const __m512i x = _mm512_set1_epi32(0x00010001);  /* small: fp32 sums stay normal */
    __asm__ volatile(GG_ACC24("vpxord", "zmm") :: "v"(w), "v"(w) : GG_CLOBBER24("zmm"));
    for (int64_t n = 0; n < iters; n++) {
        if (kind == 0) {
#if defined(GG_BP_BF16)
            __asm__ volatile(GG_ACC24("vdpbf16ps", "zmm") :: "v"(w), "v"(x) : GG_CLOBBER24("zmm"));
#endif
        } else if (kind == 1) {
            __asm__ volatile(GG_ACC24("vpdpbusd", "zmm") :: "v"(w), "v"(x) : GG_CLOBBER24("zmm"));
        } else {
            const __m256i w8 = _mm512_castsi512_si256(w), x8 = _mm512_castsi512_si256(x);
            __asm__ volatile(GG_ACC24("vpdpbusd", "ymm") :: "v"(w8), "v"(x8) : GG_CLOBBER24("ymm"));
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define GG_ACC12(op, r)                                                                         \
    op " %1, %0, %%" r "4\n\t" op " %1, %0, %%" r "5\n\t" op " %1, %0, %%" r "6\n\t"            \
    op " %1, %0, %%" r "7\n\t" op " %1, %0, %%" r "8\n\t" op " %1, %0, %%" r "9\n\t"            \
    op " %1, %0, %%" r "10\n\t" op " %1, %0, %%" r "11\n\t" op " %1, %0, %%" r "12\n\t"         \
    op " %1, %0, %%" r "13\n\t" op " %1, %0, %%" r "14\n\t" op " %1, %0, %%" r "15\n\t"
#define GG_CLOBBER12(r)                                                                         \
    r "4", r "5", r "6", r "7", r "8", r "9", r "10", r "11", r "12", r "13", r "14", r "15"
/* one int8 dot of kq_dot: products into t, pair sums by the scales into t, t into acc */
#define GG_DOT8(t, acc)                                                                         \
    "vpmaddubsw %1, %0, %%ymm" t "\n\tvpmaddwd %2, %%ymm" t ", %%ymm" t "\n\t"                   \
    "vpaddd %%ymm" t ", %%ymm" acc ", %%ymm" acc "\n\t"
static __attribute__((noinline)) void peak_loop_avx2(int kind, int64_t iters) {
    const __m256i w = _mm256_set1_epi8(1), x = _mm256_set1_epi8(1), sc = _mm256_set1_epi16(1);
    __asm__ volatile(GG_ACC12("vpxor", "ymm") :: "x"(w), "x"(w) : GG_CLOBBER12("ymm"));
    for (int64_t n = 0; n < iters; n++) {
        if (kind == 3)
            __asm__ volatile(GG_ACC12("vfmadd231ps", "ymm") :: "x"(w), "x"(x) : GG_CLOBBER12("ymm"));
        else
            __asm__ volatile(GG_DOT8("4", "8") GG_DOT8("5", "9") GG_DOT8("6", "10") GG_DOT8("7", "11")
                             :: "x"(w), "x"(x), "x"(sc) : GG_CLOBBER12("ymm"));
    }
}
#endif

double gg_peak(int kind, int threads, int64_t iters) {
    /* per iteration of peak_loop / peak_loop_avx2: 2 a multiply-add */
    static const double ops[5] = {24 * 64, 24 * 128, 24 * 64, 12 * 16, 4 * 64};
    int built = 0;
#if defined(GG_AVX512)
    built = kind == 1 || kind == 2;
#if defined(GG_BP_BF16)
    built = built || kind == 0;
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
    built = built || kind == 3 || kind == 4;
#endif
    if (!built || threads < 1 || iters < 1) return -1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
#pragma omp parallel num_threads(threads)
    {
#if defined(__AVX2__) && defined(__FMA__)
        if (kind >= 3) peak_loop_avx2(kind, iters);
#endif
#if defined(GG_AVX512)
        if (kind < 3) peak_loop(kind, iters);
#endif
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return (double)threads * (double)iters * ops[kind] / s;
}

/* x [m, k] fp32 (row stride ldx) to int8 (gg_quantize_x, x_group(type) inputs a scale), then
 * its int8 product: gg_linear_q8, or with `lanes` vn_linear (K-quants, AVX-512 VNNI). parts 2
 * (gg_linear_x2): x in two int8 parts, x = dx xq + dr rq, the second the first's rounding
 * error quantized again (rows m..2m of one 2m-row product, added after), so x is held to
 * ~1/64516 of each group's max instead of ~1/254. */
static int quantized_linear(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                            const float *x, int64_t ldx, int64_t m, float *out, int64_t ldo,
                            int threads, int lanes, int parts) {
    const int64_t mm = parts * m, group = x_group(type);
    size_t nq = (size_t)(mm * k + 63) & ~(size_t)63;
    /* 64-byte aligned: the 512-bit loads of xq then never split a cache line */
    uint8_t *buf = aligned_alloc(64, (nq + (size_t)(mm * (k / 32) + mm * (k / 16)) * 4 + 63) & ~(size_t)63);
    if (!buf) return -1;
    int8_t *xq = (int8_t *)buf;
    float *dx = (float *)(buf + nq);
    int32_t *xs = (int32_t *)(dx + mm * (k / 32));
    int rc = gg_quantize_rows(x, ldx, m, k, group, xq, dx, xs, threads);
    float *sums = out;
    int64_t lds = ldo;
    if (rc == 0 && parts == 2) {
        float *r = malloc((size_t)(m * k) * sizeof(float));
        sums = malloc((size_t)(mm * n) * sizeof(float));
        lds = n;
        if (!r || !sums) rc = -1;
        for (int64_t i = 0; rc == 0 && i < m; i++)  /* what the first part left */
            for (int64_t j = 0; j < k; j++)
                r[i * k + j] = x[i * ldx + j] - dx[i * (k / group) + j / group] * (float)xq[i * k + j];
        if (rc == 0)
            rc = gg_quantize_rows(r, k, m, k, (int)group, xq + m * k, dx + m * (k / group),
                                  xs + m * (k / 16), threads);
        free(r);
    }
#if defined(GG_AVX512)
    if (rc == 0 && lanes) rc = vn_linear(type, w, row_bytes, n, k, xq, dx, xs, mm, sums, lds, threads);
#elif defined(__AVX2__)
    if (rc == 0 && lanes) rc = x8_linear(type, w, row_bytes, n, k, xq, dx, xs, mm, sums, lds, threads);
#endif
    if (rc == 0 && !lanes) rc = gg_linear_q8(type, w, row_bytes, n, k, xq, dx, xs, mm, sums, lds, threads);
    if (parts == 2) {
        for (int64_t i = 0; rc == 0 && i < m; i++)
            for (int64_t j = 0; j < n; j++) out[i * ldo + j] = sums[i * n + j] + sums[(m + i) * n + j];
        free(sums);
    }
    free(buf);
    return rc;
}

/* gg_linear_x on the AVX-512 VNNI kernel with weight rows in the lanes (vn_linear) at every
 * row count, which gg_linear_q8 gives only from VN_MIN_ROWS rows: a row's bits are then the
 * same in any batch, however few rows it has. K-quants only; -1 where it is not built or
 * switched off (gg_set_vn). */
int gg_linear_lanes(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                    const float *x, int64_t ldx, int64_t m, float *out, int64_t ldo,
                    int threads) {
#if defined(GG_AVX512)
    if (gg_check(type, k, row_bytes) || m < 1 || block_size(type) != 256 || gg_vn_off) return -1;
    return quantized_linear(type, w, row_bytes, n, k, x, ldx, m, out, ldo, threads, 1, 1);
#elif defined(__AVX2__)
    if (gg_check(type, k, row_bytes) || m < 1 || block_size(type) != 256 || gg_x8_off) return -1;
    return quantized_linear(type, w, row_bytes, n, k, x, ldx, m, out, ldo, threads, 1, 1);
#else
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)ldx, (void)m;
    (void)out, (void)ldo, (void)threads, (void)quantized_linear;
    return -1;
#endif
}

/* gg_quantize_x then gg_linear_q8 in one call: x [m, k] fp32 (row stride ldx). */
int gg_linear_x(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                const float *x, int64_t ldx, int64_t m, float *out, int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes) || m < 1 || block_size(type) < 32) return -1;
    return quantized_linear(type, w, row_bytes, n, k, x, ldx, m, out, ldo, threads, 0, 1);
}

/* gg_linear_x with x in two int8 parts (quantized_linear): an output head's rows in a prompt
 * step, whose logits then differ from fp32 dots by ~2.5e-5 of the largest, not one part's
 * ~7e-3, at under twice the int8 product's cost (a 1B-shape Q6_K head at 16 rows: 13.2
 * against the fp32 row dequantization's 49.8 ms, docs/BENCHMARKS.md). */
int gg_linear_x2(int type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                 const float *x, int64_t ldx, int64_t m, float *out, int64_t ldo, int threads) {
    if (gg_check(type, k, row_bytes) || m < 1 || block_size(type) < 32) return -1;
    return quantized_linear(type, w, row_bytes, n, k, x, ldx, m, out, ldo, threads, 0, 2);
}
