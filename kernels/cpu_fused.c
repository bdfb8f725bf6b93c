/* Fused fp32 CPU ops for the decode step (kernels/cpu_fused.py builds and calls them).
 *
 * Each replaces a chain of small torch ops whose per-op overhead, not arithmetic, sets the
 * cost of a batch-1 step. Single-threaded on purpose: a decode step's rows are a few
 * thousand floats, and a second OpenMP runtime beside torch's would fight it for cores.
 * Every function has a torch reference in kernels/ (rms_norm_ref, rotary_embedding_ref,
 * silu * mul) that the tests hold it to.
 */
#include <math.h>
#include <stdint.h>

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
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += h[i + j] * h[i + j];
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += acc[j];
        for (; i < n; i++) sum += h[i] * h[i];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t k = 0; k < n; k++) outr[k] = weight[k] * (h[k] * inv);
    }
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

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]; gate_up rows have 2n floats. With
 * AVX512, 16 at a time through glibc's vector expf (libmvec, a few ulps from expf). */
#if defined(__AVX512F__)
#include <immintrin.h>
__m512 _ZGVeN16v_expf(__m512);
#endif

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
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
}
