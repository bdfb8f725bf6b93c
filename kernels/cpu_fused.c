/* Fused CPU ops for the decode step (kernels/cpu_fused.py builds and calls them).
 *
 * Each replaces a chain of small torch ops whose per-op overhead, not arithmetic, sets the
 * cost of a batch-1 step. The fp32 entries are single-threaded: a batch-1 step's rows are a
 * few thousand floats, less than a thread's wake-up costs. The `_mixed` entries, which the
 * batched steps call, share their rows out over `threads` OpenMP threads (the same libgomp
 * as torch's) when there are enough of them; rows are independent, so the split changes
 * no result.
 * Every function has a torch reference in kernels/ (rms_norm_ref, rotary_embedding_ref,
 * silu * mul, store_kv_ref) that the tests hold it to.
 *
 * The arithmetic is fp32. The `_mixed` entries also read bf16 inputs (widened exactly) and
 * write bf16 outputs (rounded to nearest even, as torch's conversion), so a step whose
 * matmuls run in bf16 passes their outputs straight in and out without a conversion op: the
 * results are bitwise those of the fp32 entry followed by torch's `.to(torch.bfloat16)`.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "cpu_scratch.h"

/* each thread's rows of widened inputs and unrounded outputs for the `_mixed` entries */
static __thread struct scratch row_scratch;

static float *rows_for(size_t floats) { return scratch_grow(&row_scratch, floats * sizeof(float)); }

/* bf16 -> fp32, exact */
static void from_bf16(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i)));
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
    }
#endif
    for (; i < n; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        memcpy(out + i, &u, sizeof u);
    }
}

/* fp32 -> bf16 rounded to nearest even, as torch's conversion does (NaN -> a quiet NaN) */
static void to_bf16(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0),
                                    _mm512_srli_epi32(r, 16));
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        out[i] = x[i] != x[i] ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* 1 / sqrt(mean(h^2) + eps) over one row */
static float rms_inv(const float *h, int64_t n, float eps) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += h[i + j] * h[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += acc[j];
    for (; i < n; i++) sum += h[i] * h[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* out = weight * (h * 1/sqrt(mean(h^2) + eps)), h = x (+ residual, then stored to
 * new_residual). Rows are contiguous of length n. */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out,
                  float *new_residual, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *outr = out + r * n;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + r * n;
            float *nr = new_residual + r * n;
            for (int64_t i = 0; i < n; i++) nr[i] = xr[i] + rr[i];
            h = nr;
        }
        float inv = rms_inv(h, n, eps);
        for (int64_t k = 0; k < n; k++) outr[k] = weight[k] * (h[k] * inv);
    }
}

#define MIN_PARALLEL_ROWS 8  /* the `_mixed` and `_rows` entries share rows out from this many */

/* rms_norm_f32 with x in bf16 when x_bf16 and out written as bf16 when out_bf16 (residual
 * and new_residual stay fp32; they may be the same buffer). Returns 0, -1 out of memory. */
int rms_norm_mixed(const void *x, int x_bf16, const float *residual, const float *weight,
                   void *out, int out_bf16, float *new_residual, int64_t rows, int64_t n,
                   float eps, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= MIN_PARALLEL_ROWS) reduction(|:failed)
    {
    float *tmp = rows_for((size_t)(2 * n));
    failed = tmp == NULL;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!tmp) continue;
        const float *h;
        if (x_bf16) {
            from_bf16((const uint16_t *)x + r * n, tmp, n);
            h = tmp;
        } else {
            h = (const float *)x + r * n;
        }
        if (residual) {
            const float *rr = residual + r * n;
            float *nr = new_residual + r * n;
            for (int64_t i = 0; i < n; i++) nr[i] = h[i] + rr[i];
            h = nr;
        }
        float inv = rms_inv(h, n, eps);
        float *o = out_bf16 ? tmp + n : (float *)out + r * n;
        for (int64_t k = 0; k < n; k++) o[k] = weight[k] * (h[k] * inv);
        if (out_bf16) to_bf16(o, (uint16_t *)out + r * n, n);
    }
    }
    return failed ? -1 : 0;
}

/* Neox rotary in place on `heads` heads of head_dim d per token row (row stride in floats):
 * x1 = x[i], x2 = x[i + d/2] -> (x1 cos - x2 sin, x2 cos + x1 sin), i < d/2, with cos and sin
 * from cache[pos] = cat(cos, sin) (length d). */
void rope_neox_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                   const float *cache, const int64_t *positions) {
    int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *cs = cache + positions[r] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + r * row_stride + h * d;
            for (int64_t i = 0; i < half; i++) {
                float x1 = xh[i], x2 = xh[i + half], c = cs[i], s = cs[half + i];
                xh[i] = x1 * c - x2 * s;
                xh[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

/* rope_neox_f32 with its rows shared out over `threads` (each row's arithmetic the one-thread
 * call's, which cpu_decode.c's step keeps between its parallel matmuls) */
void rope_neox_f32_rows(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                        const float *cache, const int64_t *positions, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= MIN_PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        rope_neox_f32(x + r * row_stride, row_stride, 1, heads, d, cache, positions + r);
}

/* One fused q/k/v matmul's output rows (fp32, or bf16 when qkv_bf16; row stride in
 * elements; q is heads * d wide, then k and v kv_heads * d each): rotate q into q_out
 * [rows, heads, d] (fp32), rotate k and write k and v into the caches' slots (slot < 0: not
 * written), each [num_slots, kv_heads, d] of fp32, or bf16 when cache_bf16. Returns 0, -1
 * out of memory, or -2 when a position is past the cos/sin cache's max_positions rows or a
 * slot past num_slots (nothing is read or written out of bounds; rows before it are done). */
int rope_store_kv(const void *qkv, int qkv_bf16, int64_t row_stride, int64_t rows,
                  int64_t heads, int64_t kv_heads, int64_t d, const float *cache,
                  int64_t max_positions, const int64_t *positions, const int64_t *slots,
                  int64_t num_slots, float *q_out, void *k_cache, void *v_cache, int cache_bf16,
                  int threads) {
    int64_t q_size = heads * d, kv_size = kv_heads * d, width = q_size + 2 * kv_size;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= MIN_PARALLEL_ROWS) reduction(|:failed)
    {
    float *row = rows_for((size_t)width);
    failed = row == NULL;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!row) continue;
        if (positions[r] < 0 || positions[r] >= max_positions || slots[r] >= num_slots) {
            failed |= 2;
            continue;
        }
        if (qkv_bf16)
            from_bf16((const uint16_t *)qkv + r * row_stride, row, width);
        else
            memcpy(row, (const float *)qkv + r * row_stride, (size_t)width * sizeof(float));
        rope_neox_f32(row, width, 1, heads + kv_heads, d, cache, positions + r);
        memcpy(q_out + r * q_size, row, (size_t)q_size * sizeof(float));
        int64_t slot = slots[r];
        if (slot < 0) continue;
        if (cache_bf16) {
            to_bf16(row + q_size, (uint16_t *)k_cache + slot * kv_size, kv_size);
            to_bf16(row + q_size + kv_size, (uint16_t *)v_cache + slot * kv_size, kv_size);
        } else {
            memcpy((float *)k_cache + slot * kv_size, row + q_size, (size_t)kv_size * sizeof(float));
            memcpy((float *)v_cache + slot * kv_size, row + q_size + kv_size,
                   (size_t)kv_size * sizeof(float));
        }
    }
    }
    return failed & 2 ? -2 : failed ? -1 : 0;
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]; gate_up rows have 2n floats. With
 * AVX512, 16 at a time through glibc's vector expf (libmvec, a few ulps from expf). */
#if defined(__AVX512F__)
__m512 _ZGVeN16v_expf(__m512);
#endif

static void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(zero, x));
        __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n;
        silu_mul_row(g, g + n, out + r * n, n);
    }
}

/* silu_mul_f32 with gate_up in bf16 when in_bf16 and out written as bf16 when out_bf16.
 * Returns 0, -1 out of memory. */
int silu_mul_mixed(const void *gate_up, int in_bf16, void *out, int out_bf16, int64_t rows,
                   int64_t n, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows >= MIN_PARALLEL_ROWS) reduction(|:failed)
    {
    float *tmp = rows_for((size_t)(3 * n));
    failed = tmp == NULL;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!tmp) continue;
        const float *g = (const float *)gate_up + r * 2 * n;
        if (in_bf16) {
            from_bf16((const uint16_t *)gate_up + r * 2 * n, tmp, 2 * n);
            g = tmp;
        }
        float *o = out_bf16 ? tmp + 2 * n : (float *)out + r * n;
        silu_mul_row(g, g + n, o, n);
        if (out_bf16) to_bf16(o, (uint16_t *)out + r * n, n);
    }
    }
    return failed ? -1 : 0;
}
