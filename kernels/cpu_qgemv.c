/* Quantized-weight GEMV/GEMM for a few rows on x86 with AVX512-VNNI (kernels/cpu_qgemv.py
 * lays the weights out, builds and calls this).
 *
 * A batch-1 decode step reads every weight once, so its matmuls are bound by bytes and by
 * how many instructions each weight costs. Dequantizing to float costs ~0.3 instructions a
 * weight; here activations are quantized instead (int8, one scale per group of 32, as
 * llama.cpp's Q8_0), and `vpdpbusd` multiplies 64 weight bytes by 4 broadcast activation
 * bytes and adds into 16 int32 lanes, one lane per output row: ~0.06 instructions a weight.
 *
 * Layout (per block of 16 output rows, per group g of 32 inputs): the operand for step c
 * (inputs 32g + 4c .. +3) is 64 bytes, byte 4r + j = weight of row r at input 32g + 4c + j.
 *   int4: 4 x 64 bytes per group, low nibbles = steps 0..3, high nibbles = steps 4..7;
 *         q in [0, 16), w = (q - 8) * scale[row, g] + zero[row, g]
 *   int8: 8 x 64 bytes per group, stored as q + 128 in [0, 256); w = q * scale[row]
 * With xq = round(x / dx) per group: sum_k w x = scale * dx * (sum q xq - off * sum xq)
 * (+ zero * sum x for int4), where off = 8 or 128 makes the weights unsigned for vpdpbusd.
 *   int4, half scales (QG_INT4_HALF): the same bytes and the same arithmetic, with scale and
 *         min = zero - 8 * scale stored as IEEE halves, interleaved per block and group as
 *         [scale x 16, min x 16] (64 bytes); zero = min + 8 * scale is rebuilt in fp32. A
 *         GGUF Q4_0 / Q4_1 file's own fp16 d and m are exactly these (its zero is m + 8 d in
 *         fp32, as rebuilt here), so a decode step reads 20 bytes per 32 weights instead of
 *         24 and gets bitwise the fp32-scale result.
 *
 * Rows of x are done together (up to QG_MAX_ROWS), so each weight is loaded and unpacked
 * once per call. Output row blocks are split across threads with OpenMP; the library links
 * the libgomp that torch loaded, so both share one thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scratch.h"

#define QG_GROUP 32
#define QG_MAX_ROWS 8
#define QG_INT4 4
#define QG_INT8 8
#define QG_INT4_HALF 14

int qg_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

/* x [m, k] fp32 -> xq int8 [m, k], dx [m, k/32], xqsum [m, k/32] (int32), xsum [m, k/32].
 * Rounds to nearest even, as lrintf (and torch.round) do. */
static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *xq,
                          float *dx, int32_t *xqsum, float *xsum) {
    int64_t groups = k / QG_GROUP;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + r * ldx + g * QG_GROUP;
            __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            __m512 s = _mm512_set1_ps(inv);
            __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, s),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, s),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            int8_t *out = xq + r * k + g * QG_GROUP;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qb));
            dx[r * groups + g] = d;
            xqsum[r * groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
            xsum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
    }
}

/* Per-thread scratch for the quantized activations, grown as needed (never shrunk). */
static __thread struct scratch activations;

static void *scratch_for(size_t bytes) { return scratch_grow(&activations, bytes); }

/* One block of 16 output rows, all m rows of x. kind: QG_INT4, QG_INT8 or QG_INT4_HALF;
 * sb / zb: the block's scales and zeros (fp32), or its interleaved half scales and mins. */
static inline void block_rows(int kind, const uint8_t *wb, const void *sb, const float *zb,
                              const int8_t *xq, const float *dx, const int32_t *xqsum,
                              const float *xsum, int64_t m, int64_t groups, int64_t k,
                              float *out, int64_t ldo) {
    __m512 acc[QG_MAX_ROWS];
    for (int64_t r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const int int4 = kind != QG_INT8, half = kind == QG_INT4_HALF;
    const int off = int4 ? 8 : 128;
    const int64_t gbytes = int4 ? 256 : 512;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *w = wb + g * gbytes;
        __m512i op[8];
        if (int4) {
            for (int h = 0; h < 4; h++) {
                __m512i v = _mm512_loadu_si512((const void *)(w + 64 * h));
                op[h] = _mm512_and_si512(v, nib);
                op[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            }
        } else {
            for (int c = 0; c < 8; c++) op[c] = _mm512_loadu_si512((const void *)(w + 64 * c));
        }
        __m512 scale = _mm512_setzero_ps(), zero = _mm512_setzero_ps();
        if (half) {
            const uint16_t *sm = (const uint16_t *)sb + 32 * g;
            scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sm));
            __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + 16)));
            zero = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), scale, low);  /* exact 8 * scale */
        } else if (int4) {
            scale = _mm512_loadu_ps((const float *)sb + 16 * g);
            zero = _mm512_loadu_ps(zb + 16 * g);
        }
        for (int64_t r = 0; r < m; r++) {
            const int8_t *xr = xq + r * k + g * QG_GROUP;
            __m512i ai = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) {
                int32_t four;
                memcpy(&four, xr + 4 * c, 4);
                ai = _mm512_dpbusd_epi32(ai, op[c], _mm512_set1_epi32(four));
            }
            int64_t rg = r * groups + g;
            ai = _mm512_sub_epi32(ai, _mm512_set1_epi32(off * xqsum[rg]));
            __m512 f = _mm512_cvtepi32_ps(ai);
            if (int4) {
                acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(dx[rg])), acc[r]);
                acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[rg]), acc[r]);
            } else {
                acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(dx[rg]), acc[r]);
            }
        }
    }
    for (int64_t r = 0; r < m; r++) {
        __m512 v = int4 ? acc[r] : _mm512_mul_ps(acc[r], _mm512_loadu_ps((const float *)sb));
        _mm512_storeu_ps(out + r * ldo, v);
    }
}

/* where block b's scales start */
static inline const void *block_scales(int kind, const void *scale, int64_t b, int64_t groups) {
    if (kind == QG_INT4_HALF) return (const uint16_t *)scale + b * groups * 32;
    if (kind == QG_INT4) return (const float *)scale + b * groups * 16;
    return (const float *)scale + b * 16;
}
#endif

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ w.T for a packed weight.
 * QG_INT4: scale/zero are [n/16, k/32, 16] fp32; QG_INT4_HALF: scale is [n/16, k/32, 2, 16]
 * half (scales, then mins), zero unused; QG_INT8: scale is [n] fp32, zero unused.
 * Returns 0, or -1 when the shapes are not supported (the caller keeps its fallback). */
int qg_linear(int kind, const uint8_t *w, const void *scale, const float *zero,
              const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m, int64_t n,
              int64_t k, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if ((kind != QG_INT4 && kind != QG_INT8 && kind != QG_INT4_HALF) || n % 16 || k % QG_GROUP
        || m < 1)
        return -1;
    int64_t groups = k / QG_GROUP;
    size_t rows_groups = (size_t)(QG_MAX_ROWS * groups);
    char *buf = scratch_for((size_t)(QG_MAX_ROWS * k) + rows_groups * 12);
    if (!buf) return -1;
    float *dx = (float *)buf;
    int32_t *xqsum = (int32_t *)(dx + rows_groups);
    float *xsum = (float *)(xqsum + rows_groups);
    int8_t *xq = (int8_t *)(xsum + rows_groups);
    int64_t blocks = n / 16;
    int64_t wblock = kind == QG_INT8 ? groups * 512 : groups * 256;
    for (int64_t r0 = 0; r0 < m; r0 += QG_MAX_ROWS) {
        int64_t mr = m - r0 < QG_MAX_ROWS ? m - r0 : QG_MAX_ROWS;
        quantize_rows(x + r0 * ldx, ldx, mr, k, xq, dx, xqsum, xsum);
        float *o = out + r0 * ldo;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
        for (int64_t b = 0; b < blocks; b++) {
            const void *sb = block_scales(kind, scale, b, groups);
            const float *zb = kind == QG_INT4 ? zero + b * groups * 16 : NULL;
            block_rows(kind, w + b * wblock, sb, zb, xq, dx, xqsum, xsum, mr, groups, k,
                       o + b * 16, ldo);
        }
    }
    return 0;
#else
    (void)kind; (void)w; (void)scale; (void)zero; (void)x; (void)ldx; (void)out; (void)ldo;
    (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
