/* Batched sampling on the CPU: temperature, top-k, top-p, min-p and one categorical draw per
 * row of logits [n, vocab], in O(vocab) per row, without sorting a row.
 *
 * The kept set of a row (x = logits / temperature, m = max x, e_i = exp(x_i - m) in double):
 *   top-k: x >= the k-th largest value (ties at the k-th all kept)
 *   top-p: x_j kept when the mass of the top-k-kept tokens strictly above x_j is < top_p * S,
 *          S their total mass: the smallest nucleus covering top_p, a tied group kept whole
 *   min-p: e_j >= min_p (p_j >= min_p * p_max)
 * Each is a value threshold; the row keeps x >= the largest of them. The draw picks token i
 * with probability e_i / sum of the kept e, by inverse CDF of one uniform u in [0, 1).
 *
 * How a threshold is found without a sort: the values are bucketed by depth below the max,
 * d = m - x, PER_UNIT buckets per unit of d, first over d in [0, SPAN_1) and, only when the
 * boundary lies deeper, over [SPAN_1, SPAN_2). Counts (top-k) or masses (top-p) per bucket are
 * walked from the top to the bucket holding the boundary; only that bucket's tokens are
 * sorted. Tokens deeper than SPAN_2 (e < 1e-35, mass below any top_p's resolution) are kept
 * when the walk ends without a boundary. Sums are in double, in a fixed order per row, so a
 * row's result does not depend on the batch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scratch.h"

#if defined(__AVX512F__)
#include <immintrin.h>
__m512d _ZGVeN8v_exp(__m512d);
#endif

#define PER_UNIT 64
#define SPAN_1 16
#define SPAN_2 80
#define MAX_BUCKETS ((SPAN_2 - SPAN_1) * PER_UNIT)
#define DRAW_CHUNK 512

struct pair {
    float x;
    double e;
};

struct work {
    const float *x;  /* the row, temperature applied */
    double *e;       /* exp(x - m) */
    int64_t vocab;
    float m;
    uint16_t *bk;    /* each token's bucket in the current window, or OUTSIDE */
    int32_t *inside; /* the tokens in the current window */
    struct pair *pairs; /* one bucket's tokens */
    int64_t cnt[2][MAX_BUCKETS];
    double mass[2][MAX_BUCKETS];
};

static __thread struct scratch scaled_buf, exp_buf, pair_buf, work_buf, bucket_buf, inside_buf;

/* ------------------------------------------------------------------ vector passes */

static float row_max(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(acc);
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* e[i] = exp(x[i] - m) in double */
static void exps(const float *x, float m, double *e, int64_t n) {
    const double md = m;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512d mv = _mm512_set1_pd(md);
    for (; i + 8 <= n; i += 8) {
        __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), mv);
        _mm512_storeu_pd(e + i, _ZGVeN8v_exp(d));
    }
#endif
    for (; i < n; i++) e[i] = exp((double)x[i] - md);
}

/* sum of e[i] over x[i] >= tau, i in [lo, hi), in a fixed order */
static double kept_mass(const float *x, const double *e, float tau, int64_t lo, int64_t hi) {
    double s = 0.0;
    int64_t i = lo;
#if defined(__AVX512F__)
    __m512d acc = _mm512_setzero_pd();
    const __m256 t = _mm256_set1_ps(tau);
    for (; i + 8 <= hi; i += 8) {
        __mmask8 k = (__mmask8)_mm256_cmp_ps_mask(_mm256_loadu_ps(x + i), t, _CMP_GE_OQ);
        acc = _mm512_mask_add_pd(acc, k, acc, _mm512_loadu_pd(e + i));
    }
    s = _mm512_reduce_add_pd(acc);
#endif
    for (; i < hi; i++) if (x[i] >= tau) s += e[i];
    return s;
}

/* ------------------------------------------------------------------ buckets */

#define OUTSIDE 0xFFFF

/* the bucket of x in the window starting at depth lo (num buckets), OUTSIDE when not in it
 * or below floor; float arithmetic, the same in the vector and the scalar code: monotone in
 * x, so a bucket's tokens are all larger than the next bucket's */
static inline uint16_t bucket_of(float x, float m, float lo, int64_t num, float floor) {
    float t = ((m - x) - lo) * (float)PER_UNIT;
    return (x >= floor && t >= 0.0f && t < (float)num) ? (uint16_t)(int32_t)t : OUTSIDE;
}

static int by_value_desc(const void *a, const void *b) {
    float x = ((const struct pair *)a)->x, y = ((const struct pair *)b)->x;
    return (x < y) - (x > y);
}

/* every token's bucket into w->bk, the window's tokens' indices into w->inside; their count */
static int64_t assign_buckets(struct work *w, float lo, int64_t num, float floor) {
    const float m = w->m;
    int64_t i = 0, n = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m), lov = _mm512_set1_ps(lo), fl = _mm512_set1_ps(floor);
    const __m512 scale = _mm512_set1_ps((float)PER_UNIT), top = _mm512_set1_ps((float)num);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= w->vocab; i += 16) {
        __m512 x = _mm512_loadu_ps(w->x + i);
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_sub_ps(mv, x), lov), scale);
        __mmask16 in = _mm512_cmp_ps_mask(x, fl, _CMP_GE_OQ)
                       & _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GE_OQ)
                       & _mm512_cmp_ps_mask(t, top, _CMP_LT_OQ);
        __m512i b = _mm512_mask_mov_epi32(_mm512_set1_epi32(OUTSIDE), in,
                                          _mm512_cvttps_epi32(t));
        _mm256_storeu_si256((__m256i *)(w->bk + i), _mm512_cvtepi32_epi16(b));
        _mm512_mask_compressstoreu_epi32(w->inside + n, in,
                                         _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));
        n += __builtin_popcount(in);
    }
#endif
    for (; i < w->vocab; i++) {
        w->bk[i] = bucket_of(w->x[i], m, lo, num, floor);
        if (w->bk[i] != OUTSIDE) w->inside[n++] = (int32_t)i;
    }
    return n;
}

/* counts (top-k) or masses (top-p) per bucket of the tokens x >= floor in the window
 * [lo, lo + num / PER_UNIT) of depth (two interleaved histograms, so neighbouring tokens in
 * one bucket do not wait on each other); the result in cnt[0] or mass[0] */
static void fill_buckets(struct work *w, float lo, int64_t num, float floor, int need_mass) {
    const int64_t n = assign_buckets(w, lo, num, floor);
    const int32_t *in = w->inside;
    const uint16_t *bk = w->bk;
    int64_t j = 0;
    if (need_mass) {
        double *m0 = w->mass[0], *m1 = w->mass[1];
        memset(m0, 0, sizeof(double) * num);
        memset(m1, 0, sizeof(double) * num);
        for (; j + 2 <= n; j += 2) {
            m0[bk[in[j]]] += w->e[in[j]];
            m1[bk[in[j + 1]]] += w->e[in[j + 1]];
        }
        if (j < n) m0[bk[in[j]]] += w->e[in[j]];
        for (int64_t b = 0; b < num; b++) m0[b] += m1[b];
        return;
    }
    int64_t *c0 = w->cnt[0], *c1 = w->cnt[1];
    memset(c0, 0, sizeof(int64_t) * num);
    memset(c1, 0, sizeof(int64_t) * num);
    for (; j + 2 <= n; j += 2) {
        c0[bk[in[j]]]++;
        c1[bk[in[j + 1]]]++;
    }
    if (j < n) c0[bk[in[j]]]++;
    for (int64_t b = 0; b < num; b++) c0[b] += c1[b];
}

/* the tokens of bucket b (as assigned last) into w->pairs, sorted by value (largest first);
 * their count */
static int64_t collect(struct work *w, int64_t b) {
    int64_t i = 0, n = 0;
#if defined(__AVX512F__)
    const __m512i want = _mm512_set1_epi16((short)b);
    for (; i + 32 <= w->vocab; i += 32) {
        __mmask32 hit = _mm512_cmpeq_epi16_mask(_mm512_loadu_si512(w->bk + i), want);
        while (hit) {
            int64_t k = i + __builtin_ctz(hit);
            hit &= hit - 1;
            w->pairs[n].x = w->x[k];
            w->pairs[n++].e = w->e[k];
        }
    }
#endif
    for (; i < w->vocab; i++) {
        if (w->bk[i] == b) {
            w->pairs[n].x = w->x[i];
            w->pairs[n++].e = w->e[i];
        }
    }
    qsort(w->pairs, n, sizeof(struct pair), by_value_desc);
    return n;
}

/* ------------------------------------------------------------------ thresholds */

struct window {
    float lo;    /* depth where it starts */
    int64_t num; /* buckets */
};

static const struct window WINDOWS[2] = {{0.0f, SPAN_1 * PER_UNIT}, {SPAN_1, MAX_BUCKETS}};

/* the k-th largest value of the row; -inf when fewer than k values are finite */
static float kth_value(struct work *w, int64_t k) {
    int64_t above = 0;
    for (int win = 0; win < 2; win++) {
        const struct window v = WINDOWS[win];
        fill_buckets(w, v.lo, v.num, -INFINITY, 0);
        for (int64_t b = 0; b < v.num; b++) {
            if (above + w->cnt[0][b] >= k) {
                collect(w, b);
                return w->pairs[k - above - 1].x;
            }
            above += w->cnt[0][b];
        }
    }
    /* deeper than both windows: every finite value, sorted */
    int64_t n = 0;
    for (int64_t i = 0; i < w->vocab; i++)
        if (w->x[i] > -INFINITY) w->pairs[n++].x = w->x[i];
    if (n < k) return -INFINITY;
    qsort(w->pairs, n, sizeof(struct pair), by_value_desc);
    return w->pairs[k - 1].x;
}

/* top-p's threshold over the tokens x >= tau_k, whose mass is `total` */
static float nucleus(struct work *w, double top_p, float tau_k, double total) {
    const double target = top_p * total;
    double above = 0.0; /* the mass of the tokens above the current one */
    float tau = -INFINITY;
    for (int win = 0; win < 2; win++) {
        const struct window v = WINDOWS[win];
        fill_buckets(w, v.lo, v.num, tau_k, 1);
        for (int64_t b = 0; b < v.num; b++) {
            if (above + w->mass[0][b] < target) {
                above += w->mass[0][b];
                continue;
            }
            /* the boundary is in this bucket: walk its tied groups, largest first (if the
             * walk's own sum falls short of the bucket's, go on to the next bucket) */
            int64_t n = collect(w, b);
            for (int64_t j = 0; j < n; j++) {
                if (j == 0 || w->pairs[j].x != w->pairs[j - 1].x) {
                    if (above >= target) return tau;
                    tau = w->pairs[j].x;
                }
                above += w->pairs[j].e;
            }
            if (above >= target) return tau;
        }
    }
    return -INFINITY; /* the boundary is below every window: keep the rest */
}

/* min-p's threshold: the smallest x with e >= min_p */
static float min_p_floor(const struct work *w, double min_p) {
    float tau = INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512d mp = _mm512_set1_pd(min_p);
    __m256 acc = _mm256_set1_ps(INFINITY);
    for (; i + 8 <= w->vocab; i += 8) {
        __mmask8 k = _mm512_cmp_pd_mask(_mm512_loadu_pd(w->e + i), mp, _CMP_GE_OQ);
        acc = _mm256_mask_min_ps(acc, k, acc, _mm256_loadu_ps(w->x + i));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) tau = lanes[j] < tau ? lanes[j] : tau;
#endif
    for (; i < w->vocab; i++)
        if (w->e[i] >= min_p && w->x[i] < tau) tau = w->x[i];
    return tau;
}

/* ------------------------------------------------------------------ the draw */

/* inverse CDF over the kept tokens (x >= tau) with uniform u; the last kept token when
 * rounding leaves the target past the end */
static int64_t draw(const struct work *w, float tau, double u) {
    const int64_t n = w->vocab, num_chunks = (n + DRAW_CHUNK - 1) / DRAW_CHUNK;
    double sums[num_chunks];
    double total = 0.0;
    for (int64_t c = 0; c < num_chunks; c++) {
        int64_t hi = (c + 1) * DRAW_CHUNK < n ? (c + 1) * DRAW_CHUNK : n;
        sums[c] = kept_mass(w->x, w->e, tau, c * DRAW_CHUNK, hi);
        total += sums[c];
    }
    const double target = u * total;
    double acc = 0.0;
    for (int64_t c = 0; c < num_chunks; c++) {
        if (acc + sums[c] <= target) {
            acc += sums[c];
            continue;
        }
        int64_t lo = c * DRAW_CHUNK, hi = lo + DRAW_CHUNK < n ? lo + DRAW_CHUNK : n;
        for (int64_t i = lo; i < hi; i++) {
            if (w->x[i] >= tau && w->e[i] > 0.0) {
                acc += w->e[i];
                if (acc > target) return i;
            }
        }
    }
    for (int64_t i = n - 1; i > 0; i--)
        if (w->x[i] >= tau && w->e[i] > 0.0) return i;
    return 0;
}

/* ------------------------------------------------------------------ rows */

static int one_row(const float *logits, int64_t vocab, float temperature, int64_t top_k,
                   double top_p, double min_p, double u, int64_t *token, float *threshold) {
    float *scaled = NULL;
    const float *x = logits;
    if (temperature != 1.0f) {
        scaled = scratch_grow(&scaled_buf, sizeof(float) * vocab);
        if (!scaled) return -1;
        for (int64_t i = 0; i < vocab; i++) scaled[i] = logits[i] / temperature;
        x = scaled;
    }
    struct work *w = scratch_grow(&work_buf, sizeof(struct work));
    double *e = scratch_grow(&exp_buf, sizeof(double) * vocab);
    struct pair *pairs = scratch_grow(&pair_buf, sizeof(struct pair) * vocab);
    uint16_t *bk = scratch_grow(&bucket_buf, sizeof(uint16_t) * (vocab + 32));
    int32_t *inside = scratch_grow(&inside_buf, sizeof(int32_t) * (vocab + 16));
    if (!w || !e || !pairs || !bk || !inside) return -1;
    w->bk = bk;
    w->inside = inside;
    w->x = x;
    w->e = e;
    w->vocab = vocab;
    w->pairs = pairs;
    w->m = row_max(x, vocab);
    if (w->m == -INFINITY) { /* nothing allowed: the caller guarantees this never happens */
        *threshold = -INFINITY;
        *token = 0;
        return 0;
    }
    exps(x, w->m, e, vocab);
    float tau_k = -INFINITY, tau_p = -INFINITY, tau_m = -INFINITY;
    if (top_k > 0 && top_k < vocab) tau_k = kth_value(w, top_k);
    if (top_p < 1.0) {
        double total = kept_mass(x, e, tau_k, 0, vocab);
        tau_p = nucleus(w, top_p, tau_k, total);
    }
    if (min_p > 0.0) tau_m = min_p_floor(w, min_p);
    float tau = tau_k > tau_p ? tau_k : tau_p;
    tau = tau > tau_m ? tau : tau_m;
    *threshold = tau;
    if (u >= 0.0) *token = draw(w, tau, u);
    return 0;
}

/* rows of logits [n, vocab]; per row: temperature (fp32), top_k (0: off), top_p (>= 1: off),
 * min_p (0: off), uniform (< 0: no draw). Writes token [n] and threshold [n]. Returns 0, or
 * -1 when out of memory. */
int sample_rows_f32(const float *logits, int64_t n, int64_t vocab, const float *temperature,
                    const int64_t *top_k, const double *top_p, const double *min_p,
                    const double *uniform, int64_t *token, float *threshold, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n > 1) \
    reduction(|: failed)
    for (int64_t r = 0; r < n; r++)
        failed |= one_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r],
                          min_p[r], uniform[r], token + r, threshold + r) != 0;
    return failed ? -1 : 0;
}
