/* Batched sampling on the CPU: temperature, top-k, top-p, min-p and one categorical draw per
 * row of logits [n, vocab], in O(vocab) per row, without sorting a row.
 *
 * The kept set of a row (x = logits / temperature, m = max x, e_i = exp(x_i - m), the
 * difference and its exp in float, every sum of e in double):
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
 * walked from the top to the bucket holding the boundary; that bucket's tokens are split
 * again into SUB finer buckets the same way, and only the finer bucket holding the boundary
 * is sorted. Tokens deeper than SPAN_2 (e < 1e-35, mass below any top_p's resolution) are
 * kept when the walk ends without a boundary. Sums are in double, in a fixed order per row,
 * so a row's result does not depend on the batch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_scratch.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PER_UNIT 64
#define SPAN_1 16
#define SPAN_2 80
#define MAX_BUCKETS ((SPAN_2 - SPAN_1) * PER_UNIT)
#define SUB 64         /* finer buckets in the boundary's bucket */
#define SMALL_SORT 24  /* at most this many: insertion sort */
#define DRAW_CHUNK 512
#define TABLES 4       /* interleaved histograms: neighbouring tokens do not wait on each other */
#define CUT 2          /* the exp pass sums the mass above depths CUT, 2 CUT, ... < SPAN_1 */
#define NUM_CUTS (SPAN_1 / CUT)

struct pair {
    float x;
    float e;
};

struct work {
    const float *x;  /* the row, temperature applied */
    float *e;        /* exp(x - m) */
    int64_t vocab;
    float m;
    /* the tokens in the current window, in vocabulary order: position and bucket */
    int32_t *idx, *bin;
    int64_t num_in;
    double before;   /* the mass of the tokens x >= floor above the window */
    double kept;     /* the mass of the tokens x >= top-p's threshold, as the walk summed it */
    struct pair *pairs; /* one bucket's tokens */
    struct pair *finer; /* one finer bucket's tokens */
    uint8_t *sub;       /* each of pairs' finer bucket */
    int64_t cnt[TABLES][MAX_BUCKETS];
    double mass[TABLES][MAX_BUCKETS];
};

static __thread struct scratch scaled_buf, exp_buf, pair_buf, finer_buf, sub_buf, work_buf,
    idx_buf, bin_buf;

/* ------------------------------------------------------------------ vector passes */

#if defined(__AVX512F__)
static inline __m256 upper8(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
#endif

static float row_max(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0; /* 4 chains */
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + i));
        a1 = _mm512_max_ps(a1, _mm512_loadu_ps(x + i + 16));
        a2 = _mm512_max_ps(a2, _mm512_loadu_ps(x + i + 32));
        a3 = _mm512_max_ps(a3, _mm512_loadu_ps(x + i + 48));
    }
    for (; i + 16 <= n; i += 16) a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* y = x / temperature, and the max of y */
static float scale_and_max(const float *x, float temperature, float *y, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 t = _mm512_set1_ps(temperature);
    __m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0;
    for (; i + 32 <= n; i += 32) {
        __m512 y0 = _mm512_div_ps(_mm512_loadu_ps(x + i), t);
        __m512 y1 = _mm512_div_ps(_mm512_loadu_ps(x + i + 16), t);
        _mm512_storeu_ps(y + i, y0);
        _mm512_storeu_ps(y + i + 16, y1);
        a0 = _mm512_max_ps(a0, y0);
        a1 = _mm512_max_ps(a1, y1);
    }
    m = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
#endif
    for (; i < n; i++) {
        y[i] = x[i] / temperature;
        m = y[i] > m ? y[i] : m;
    }
    return m;
}

#if defined(__AVX512F__)
/* exp(v) for v <= 0 (and -inf), 16 at a time, within 1 ulp of the correctly rounded value:
 * v = k ln 2 + r with k = round(v / ln 2) and |r| <= ln 2 / 2 (ln 2 in two parts, so r is
 * exact to float precision), e^r by its degree-7 Taylor polynomial (truncation < 2^-27
 * relative), times 2^k by vscalefps (denormal results as well; v <= -104 gives 0). Inline,
 * unlike libmvec's call, which clobbers every vector register and takes a scalar path for
 * each lane below -87 (a row at a low temperature has many). */
static inline __m512 exp_nonpositive(__m512 v) {
    v = _mm512_max_ps(v, _mm512_set1_ps(-104.0f)); /* -inf too */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), v);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
#endif

/* e[i] = exp(x[i] - m), in float (exp_nonpositive where AVX512 is, the whole row, the last
 * partial vector masked; libm's expf in the portable code), and their sum, in double in a
 * fixed order; guess[c] ~ the sum of e over depth m - x < c * CUT (c in [1, NUM_CUTS)),
 * summed in float: only a guess of where top-p's boundary lies (the walk checks it); with
 * `count`, count[c] = the number of those tokens, exactly (where top-k's boundary lies).
 * next: a row to prefetch into L2 meanwhile. always_inline: the count-free copy keeps no
 * trace of the counting */
static inline __attribute__((always_inline)) double exps_cut(const float *x, float m, float *e,
                                                             int64_t n, float *guess,
                                                             int64_t *count,
                                                             const float *next) {
    double s = 0.0;
    for (int c = 0; c < NUM_CUTS; c++) guess[c] = 0.0f;
    if (count)
        for (int c = 0; c < NUM_CUTS; c++) count[c] = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    __m512d lo = _mm512_setzero_pd(), hi = lo;
    __m512 cut[NUM_CUTS];
    for (int c = 0; c < NUM_CUTS; c++) cut[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        if (next) _mm_prefetch((const char *)(next + i), _MM_HINT_T1);
        /* masked lanes: x = -inf, so e = 0 and the depth is +inf (in no cut) */
        const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, x + i);
        const __m512 d = _mm512_sub_ps(mv, xv);
        const __m512 v = exp_nonpositive(_mm512_sub_ps(xv, mv));
        _mm512_mask_storeu_ps(e + i, lanes, v);
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(upper8(v)));
#pragma GCC unroll 8
        for (int c = 1; c < NUM_CUTS; c++) {
            __mmask16 k = _mm512_cmp_ps_mask(d, _mm512_set1_ps((float)(c * CUT)), _CMP_LT_OQ);
            cut[c] = _mm512_mask_add_ps(cut[c], k, cut[c], v);
            if (count) count[c] += __builtin_popcount(k);
        }
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
    for (int c = 1; c < NUM_CUTS; c++) guess[c] = _mm512_reduce_add_ps(cut[c]);
#else
    (void)next;
    for (int64_t i = 0; i < n; i++) {
        e[i] = expf(x[i] - m);
        s += (double)e[i];
        for (int c = 1; c < NUM_CUTS; c++)
            if (m - x[i] < (float)(c * CUT)) {
                guess[c] += e[i];
                if (count) count[c]++;
            }
    }
#endif
    return s;
}

static double exps(const float *x, float m, float *e, int64_t n, float *guess,
                   const float *next) {
    return exps_cut(x, m, e, n, guess, NULL, next);
}

static double exps_counting(const float *x, float m, float *e, int64_t n, float *guess,
                            int64_t *count, const float *next) {
    return exps_cut(x, m, e, n, guess, count, next);
}

/* sum of e[i] over x[i] >= tau, i in [lo, hi), in a fixed order */
static double kept_mass(const float *x, const float *e, float tau, int64_t lo, int64_t hi) {
    double s = 0.0;
    int64_t i = lo;
#if defined(__AVX512F__)
    __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0; /* 4 chains */
    const __m512 t = _mm512_set1_ps(tau);
    for (; i + 32 <= hi; i += 32) {
        __mmask16 k0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), t, _CMP_GE_OQ);
        __mmask16 k1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i + 16), t, _CMP_GE_OQ);
        __m512 e0 = _mm512_loadu_ps(e + i), e1 = _mm512_loadu_ps(e + i + 16);
        a0 = _mm512_mask_add_pd(a0, (__mmask8)k0, a0,
                                _mm512_cvtps_pd(_mm512_castps512_ps256(e0)));
        a1 = _mm512_mask_add_pd(a1, (__mmask8)(k0 >> 8), a1,
                                _mm512_cvtps_pd(upper8(e0)));
        a2 = _mm512_mask_add_pd(a2, (__mmask8)k1, a2,
                                _mm512_cvtps_pd(_mm512_castps512_ps256(e1)));
        a3 = _mm512_mask_add_pd(a3, (__mmask8)(k1 >> 8), a3,
                                _mm512_cvtps_pd(upper8(e1)));
    }
    const __m256 t8 = _mm256_set1_ps(tau);
    for (; i + 8 <= hi; i += 8) {
        __mmask8 k = (__mmask8)_mm256_cmp_ps_mask(_mm256_loadu_ps(x + i), t8, _CMP_GE_OQ);
        a0 = _mm512_mask_add_pd(a0, k, a0, _mm512_cvtps_pd(_mm256_loadu_ps(e + i)));
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
#endif
    for (; i < hi; i++) if (x[i] >= tau) s += (double)e[i];
    return s;
}

/* ------------------------------------------------------------------ buckets */

/* the bucket of x in the window starting at depth lo (num buckets), -1 when not in it or
 * below floor; float arithmetic, the same in the vector and the scalar code: monotone in x,
 * so a bucket's tokens are all larger than the next bucket's */
static inline int32_t bucket_of(float x, float m, float lo, int64_t num, float floor) {
    float t = ((m - x) - lo) * (float)PER_UNIT;
    return (x >= floor && t >= 0.0f && t < (float)num) ? (int32_t)t : -1;
}

static int by_value_desc(const void *a, const void *b) {
    float x = ((const struct pair *)a)->x, y = ((const struct pair *)b)->x;
    return (x < y) - (x > y);
}

static void sort_desc(struct pair *p, int64_t n) {
    int64_t j = 1;
    while (j < n && p[j].x == p[0].x) j++;
    if (j == n) return; /* one tied group (a bf16 model's logits have few distinct values) */
    if (n > SMALL_SORT) {
        qsort(p, n, sizeof(struct pair), by_value_desc);
        return;
    }
    for (int64_t i = 1; i < n; i++) {
        struct pair v = p[i];
        int64_t j = i;
        for (; j > 0 && p[j - 1].x < v.x; j--) p[j] = p[j - 1];
        p[j] = v;
    }
}

/* the window's tokens (x >= floor, depth in [lo, lo + num / PER_UNIT)) into w->idx and
 * bin, their count into w->num_in; with need_before the mass of those above it into
 * w->before. always_inline: the copy without a floor (top-p alone) drops its compare */
static inline __attribute__((always_inline)) void assign_window(struct work *w, float lo,
                                                                int64_t num, float floor,
                                                                int need_before,
                                                                int has_floor) {
    /* locals, not w->...: the stores below could alias w, so every field would be reloaded */
    const float m = w->m;
    const float *restrict xs = w->x, *restrict es = w->e;
    int32_t *restrict idx = w->idx, *restrict bin = w->bin;
    const int64_t vocab = w->vocab;
    int64_t i = 0, n = 0;
    double before = 0.0;
#if defined(__AVX512F__)
    __m512d above_lo = _mm512_setzero_pd(), above_hi = above_lo;
    const __m512 mv = _mm512_set1_ps(m), lov = _mm512_set1_ps(lo), fl = _mm512_set1_ps(floor);
    const __m512 scale = _mm512_set1_ps((float)PER_UNIT);
    const __m512i top = _mm512_set1_epi32((int32_t)num), zero = _mm512_setzero_si512();
    const int sum_above = need_before && lo > 0.0f;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= vocab; i += 16) {
        __m512 x = _mm512_loadu_ps(xs + i);
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_sub_ps(mv, x), lov), scale);
        /* floor(t): the bucket where t >= 0 (as bucket_of's truncation), < 0 above the
         * window; for t = inf (x = -inf) or NaN the integer indefinite, INT_MIN: past every
         * bucket unsigned, "above" signed, where its e, 0, adds nothing */
        const __m512i b = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __mmask16 kept = has_floor ? _mm512_cmp_ps_mask(x, fl, _CMP_GE_OQ) : 0xffff;
        const __mmask16 in = _mm512_mask_cmplt_epu32_mask(kept, b, top);
        if (sum_above) {
            const __mmask16 up = _mm512_mask_cmplt_epi32_mask(kept, b, zero);
            const __m512 v = _mm512_loadu_ps(es + i);
            above_lo = _mm512_mask_add_pd(above_lo, (__mmask8)up, above_lo,
                                          _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
            above_hi = _mm512_mask_add_pd(above_hi, (__mmask8)(up >> 8), above_hi,
                                          _mm512_cvtps_pd(upper8(v)));
        }
        if (!in) continue;
        /* compressed in registers, stored whole (the buffers have 16 spare lanes) */
        const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)i));
        _mm512_storeu_si512(idx + n, _mm512_maskz_compress_epi32(in, at));
        _mm512_storeu_si512(bin + n, _mm512_maskz_compress_epi32(in, b));
        n += __builtin_popcount(in);
    }
    before = _mm512_reduce_add_pd(_mm512_add_pd(above_lo, above_hi));
#endif
    for (; i < vocab; i++) {
        int32_t b = bucket_of(xs[i], m, lo, num, floor);
        if (need_before && xs[i] >= floor && ((m - xs[i]) - lo) * (float)PER_UNIT < 0.0f)
            before += (double)es[i];
        if (b < 0) continue;
        idx[n] = (int32_t)i;
        bin[n++] = b;
    }
    w->num_in = n;
    w->before = before;
}

static void assign_buckets(struct work *w, float lo, int64_t num, float floor, int need_before) {
    if (floor == -INFINITY)
        assign_window(w, lo, num, floor, need_before, 0);
    else
        assign_window(w, lo, num, floor, need_before, 1);
}

/* counts (top-k) or masses (top-p) per bucket of the tokens x >= floor in the window
 * [lo, lo + num / PER_UNIT) of depth (TABLES interleaved histograms); the result in cnt[0]
 * or mass[0] */
static void fill_buckets(struct work *w, float lo, int64_t num, float floor, int need_mass) {
    assign_buckets(w, lo, num, floor, need_mass);
    const int64_t n = w->num_in;
    const int32_t *restrict bin = w->bin;
    const int32_t *restrict idx = w->idx;
    const float *restrict es = w->e; /* locals: the tables live in w */
    int64_t j = 0;
    if (need_mass) {
        double(*m)[MAX_BUCKETS] = w->mass;
        for (int t = 0; t < TABLES; t++) memset(m[t], 0, sizeof(double) * num);
        for (; j + TABLES <= n; j += TABLES)
            for (int t = 0; t < TABLES; t++) m[t][bin[j + t]] += es[idx[j + t]];
        for (; j < n; j++) m[0][bin[j]] += es[idx[j]];
        for (int64_t b = 0; b < num; b++)
            for (int t = 1; t < TABLES; t++) m[0][b] += m[t][b];
        return;
    }
    int64_t(*c)[MAX_BUCKETS] = w->cnt;
    for (int t = 0; t < TABLES; t++) memset(c[t], 0, sizeof(int64_t) * num);
    for (; j + TABLES <= n; j += TABLES)
        for (int t = 0; t < TABLES; t++) c[t][bin[j + t]]++;
    for (; j < n; j++) c[0][bin[j]]++;
    for (int64_t b = 0; b < num; b++)
        for (int t = 1; t < TABLES; t++) c[0][b] += c[t][b];
}

/* the tokens of bucket b (as assigned last) into w->pairs, in vocabulary order; their count */
static int64_t collect(struct work *w, int64_t b) {
    const float *restrict xs = w->x, *restrict es = w->e;
    const int32_t *restrict idx = w->idx, *restrict bin = w->bin;
    struct pair *restrict pairs = w->pairs;
    const int64_t num_in = w->num_in;
    int64_t j = 0, n = 0;
#if defined(__AVX512F__)
    /* the hits' positions compressed and stored whole (the buffer has 16 spare pairs: two
     * positions fit in a pair), then their x and e fetched */
    int32_t *restrict at = (int32_t *)pairs;
    const __m512i want = _mm512_set1_epi32((int)b);
    for (; j + 16 <= num_in; j += 16) {
        const __mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(bin + j), want);
        _mm512_storeu_si512(at + n, _mm512_maskz_compress_epi32(hit, _mm512_loadu_si512(idx + j)));
        n += __builtin_popcount(hit);
    }
    for (; j < num_in; j++)
        if (bin[j] == b) at[n++] = idx[j];
    /* in place, from the last: pair k (8 bytes) overwrites positions 2k and 2k + 1, read */
    for (int64_t k = n - 1; k >= 0; k--) {
        const int32_t i = at[k];
        pairs[k].x = xs[i];
        pairs[k].e = es[i];
    }
    return n;
#else
    for (; j < num_in; j++) {
        if (bin[j] == b) {
            pairs[n].x = xs[idx[j]];
            pairs[n++].e = es[idx[j]];
        }
    }
    return n;
#endif
}

/* the finer bucket of each of the n tokens of bucket b (window starting at depth lo) into
 * w->sub: the same float arithmetic as bucket_of, so monotone in x as well */
static void split_finer(struct work *w, int64_t n, float lo, int64_t b) {
    for (int64_t j = 0; j < n; j++) {
        float t = ((w->m - w->pairs[j].x) - lo) * (float)PER_UNIT;
        float f = (t - (float)b) * (float)SUB;
        w->sub[j] = f <= 0.0f ? 0 : f >= (float)SUB ? SUB - 1 : (uint8_t)(int32_t)f;
    }
}

/* the tokens of finer bucket s of the n in w->pairs into w->finer, sorted by value (largest
 * first); their count */
static int64_t take_finer(struct work *w, int64_t n, int s) {
    int64_t k = 0;
    for (int64_t j = 0; j < n; j++)
        if (w->sub[j] == s) w->finer[k++] = w->pairs[j];
    sort_desc(w->finer, k);
    return k;
}

/* the k-th largest value (k >= 1) among the n tokens of bucket b */
static float kth_in_bucket(struct work *w, int64_t n, float lo, int64_t b, int64_t k) {
    int64_t cnt[SUB] = {0}, above = 0;
    split_finer(w, n, lo, b);
    for (int64_t j = 0; j < n; j++) cnt[w->sub[j]]++;
    for (int s = 0; s < SUB; s++) {
        if (above + cnt[s] >= k) {
            take_finer(w, n, s);
            return w->finer[k - above - 1].x;
        }
        above += cnt[s];
    }
    return -INFINITY; /* unreachable: the bucket holds at least k tokens */
}

/* ------------------------------------------------------------------ thresholds */

struct window {
    float lo;    /* depth where it starts */
    int64_t num; /* buckets */
};

static const struct window WINDOWS[2] = {{0.0f, SPAN_1 * PER_UNIT}, {SPAN_1, MAX_BUCKETS}};

/* the windows of a walk that starts at cut c: its 2-unit slice, the rest of the first span
 * (when any is left), then the deep window; their count */
static int windows_from_cut(int c, struct window *windows) {
    const float lo = (float)(c * CUT);
    int n = 0;
    windows[n++] = (struct window){lo, CUT * PER_UNIT};
    if (lo + CUT < SPAN_1) windows[n++] = (struct window){lo + CUT, (SPAN_1 - lo - CUT) * PER_UNIT};
    windows[n++] = WINDOWS[1];
    return n;
}

/* the k-th largest value of the row by a walk through windows in order, `above` the number
 * of tokens above the first; -inf when fewer than k values are finite */
static float kth_in_windows(struct work *w, int64_t k, int64_t above,
                            const struct window *windows, int num_windows) {
    for (int win = 0; win < num_windows; win++) {
        const struct window v = windows[win];
        fill_buckets(w, v.lo, v.num, -INFINITY, 0);
        for (int64_t b = 0; b < v.num; b++) {
            if (above + w->cnt[0][b] >= k)
                return kth_in_bucket(w, collect(w, b), v.lo, b, k - above);
            above += w->cnt[0][b];
        }
    }
    /* deeper than every window: every finite value, sorted */
    int64_t n = 0;
    for (int64_t i = 0; i < w->vocab; i++)
        if (w->x[i] > -INFINITY) w->pairs[n++].x = w->x[i];
    if (n < k) return -INFINITY;
    qsort(w->pairs, n, sizeof(struct pair), by_value_desc);
    return w->pairs[k - 1].x;
}

/* the k-th largest value of the row (-inf when fewer than k values are finite), from the exp
 * pass's exact counts above each cut: only the tokens of the 2-unit slice past the deepest cut
 * with fewer than k tokens above it are bucketed first */
static float kth_value(struct work *w, int64_t k, const int64_t *count) {
    int c = NUM_CUTS - 1;
    while (c > 0 && count[c] >= k) c--;
    struct window windows[3];
    const int n = windows_from_cut(c, windows);
    return kth_in_windows(w, k, count[c], windows, n);
}

/* the walk of top-p's boundary into bucket b (window starting at depth lo): over its finer
 * buckets, then over the tied groups of the one holding it, largest first. 1 with *tau set
 * when the boundary is in it; 0 when the walk's own sum falls short of the bucket's (go on to
 * the next bucket) */
static int walk_bucket(struct work *w, float lo, int64_t b, double target, double *above,
                       float *tau) {
    const int64_t n = collect(w, b);
    double fine[SUB] = {0.0};
    split_finer(w, n, lo, b);
    for (int64_t j = 0; j < n; j++) fine[w->sub[j]] += w->pairs[j].e;
    for (int s = 0; s < SUB; s++) {
        if (*above + fine[s] < target) {
            *above += fine[s];
            continue;
        }
        const int64_t nf = take_finer(w, n, s);
        for (int64_t j = 0; j < nf; j++) {
            if (j == 0 || w->finer[j].x != w->finer[j - 1].x) {
                if (*above >= target) return 1;
                *tau = w->finer[j].x;
            }
            *above += w->finer[j].e;
        }
        if (*above >= target) return 1;
    }
    return 0;
}

/* top-p's threshold over the tokens x >= tau_k: the walk from the top through windows in
 * order, from the mass above the first; NAN when that mass is already past the target (the
 * first window starts too deep) */
static float nucleus(struct work *w, double target, float tau_k, const struct window *windows,
                     int num_windows) {
    float tau = -INFINITY;
    double above = 0.0;
    for (int win = 0; win < num_windows; win++) {
        const struct window v = windows[win];
        fill_buckets(w, v.lo, v.num, tau_k, 1);
        if (win == 0) above = w->before;
        if (above >= target) return NAN;
        for (int64_t b = 0; b < v.num; b++) {
            if (above + w->mass[0][b] < target) {
                above += w->mass[0][b];
                continue;
            }
            if (walk_bucket(w, v.lo, b, target, &above, &tau)) {
                w->kept = above; /* the walk's sum runs over every token x >= tau */
                return tau;
            }
        }
    }
    return -INFINITY; /* the boundary is below every window: keep the rest */
}

/* top-p's threshold without top-k: the walk starts at the deepest cut that the exp pass's
 * guess puts above the boundary, so only the tokens past it are bucketed (a shallower cut
 * when the guess was wrong) */
static float nucleus_from_cuts(struct work *w, double top_p, double total, const float *guess) {
    const double target = top_p * total;
    int c = NUM_CUTS - 1;
    while (c > 0 && !((double)guess[c] < target * (1.0 - 1e-3))) c--;
    for (;; c--) {
        struct window windows[3];
        const int n = windows_from_cut(c, windows);
        const float tau = nucleus(w, target, -INFINITY, windows, n);
        if (!isnan(tau) || c == 0) return tau;
    }
}

/* min-p's threshold: the smallest x with e >= min_p */
static float min_p_floor(const struct work *w, double min_p) {
    float tau = INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512d mp = _mm512_set1_pd(min_p);
    __m256 acc = _mm256_set1_ps(INFINITY);
    for (; i + 8 <= w->vocab; i += 8) {
        __mmask8 k = _mm512_cmp_pd_mask(_mm512_cvtps_pd(_mm256_loadu_ps(w->e + i)), mp,
                                        _CMP_GE_OQ);
        acc = _mm256_mask_min_ps(acc, k, acc, _mm256_loadu_ps(w->x + i));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) tau = lanes[j] < tau ? lanes[j] : tau;
#endif
    for (; i < w->vocab; i++)
        if ((double)w->e[i] >= min_p && w->x[i] < tau) tau = w->x[i];
    return tau;
}

/* ------------------------------------------------------------------ the draw */

/* inverse CDF over the kept tokens (x >= tau) with uniform u, their mass `total` when known
 * (< 0: summed here first); a chunk's mass is summed only when the walk reaches it, so a
 * known total saves half a pass on average. The last kept token when rounding leaves the
 * target past the end */
static int64_t draw(const struct work *w, float tau, double u, double total) {
    const int64_t n = w->vocab, num_chunks = (n + DRAW_CHUNK - 1) / DRAW_CHUNK;
    double sums[num_chunks];
    const int known = total >= 0.0;
    if (!known) {
        total = 0.0;
        for (int64_t c = 0; c < num_chunks; c++) {
            int64_t hi = (c + 1) * DRAW_CHUNK < n ? (c + 1) * DRAW_CHUNK : n;
            sums[c] = kept_mass(w->x, w->e, tau, c * DRAW_CHUNK, hi);
            total += sums[c];
        }
    }
    const double target = u * total;
    double acc = 0.0;
    for (int64_t c = 0; c < num_chunks; c++) {
        int64_t lo = c * DRAW_CHUNK, hi = lo + DRAW_CHUNK < n ? lo + DRAW_CHUNK : n;
        const double sum = known ? kept_mass(w->x, w->e, tau, lo, hi) : sums[c];
        if (acc + sum <= target) {
            acc += sum;
            continue;
        }
        for (int64_t i = lo; i < hi; i++) {
            if (w->x[i] >= tau && w->e[i] > 0.0f) {
                acc += w->e[i];
                if (acc > target) return i;
            }
        }
    }
    for (int64_t i = n - 1; i > 0; i--)
        if (w->x[i] >= tau && w->e[i] > 0.0f) return i;
    return 0;
}

/* ------------------------------------------------------------------ rows */

/* w's buffers for a row of vocab values x; -1 when out of memory */
static int setup(struct work *w, const float *x, int64_t vocab) {
    w->x = x;
    w->vocab = vocab;
    w->e = scratch_grow(&exp_buf, sizeof(float) * vocab);
    w->pairs = scratch_grow(&pair_buf, sizeof(struct pair) * (vocab + 16)); /* + 16: collect */
    w->finer = scratch_grow(&finer_buf, sizeof(struct pair) * vocab);
    w->sub = scratch_grow(&sub_buf, vocab);
    w->idx = scratch_grow(&idx_buf, sizeof(int32_t) * (vocab + 16)); /* + 16: whole vectors */
    w->bin = scratch_grow(&bin_buf, sizeof(int32_t) * (vocab + 16));
    return w->e && w->pairs && w->finer && w->sub && w->idx && w->bin ? 0 : -1;
}

/* one row; next: the row this thread has claimed to take after it (NULL: none), prefetched
 * into L2 while this one's exps are computed, so its max pass does not wait on memory */
static int one_row(const float *logits, int64_t vocab, float temperature, int64_t top_k,
                   double top_p, double min_p, double u, int64_t *token, float *threshold,
                   const float *next) {
    const float *x = logits;
    float *scaled = NULL;
    if (temperature != 1.0f) {
        scaled = scratch_grow(&scaled_buf, sizeof(float) * vocab);
        if (!scaled) return -1;
        x = scaled;
    }
    struct work *w = scratch_grow(&work_buf, sizeof(struct work));
    if (!w || setup(w, x, vocab) != 0) return -1;
    w->m = scaled ? scale_and_max(logits, temperature, scaled, vocab) : row_max(x, vocab);
    if (w->m == -INFINITY) { /* nothing allowed: the caller guarantees this never happens */
        *threshold = -INFINITY;
        *token = 0;
        return 0;
    }
    float guess[NUM_CUTS];
    int64_t count[NUM_CUTS];
    const int has_k = top_k > 0 && top_k < vocab;
    const double total = has_k ? exps_counting(x, w->m, w->e, vocab, guess, count, next)
                               : exps(x, w->m, w->e, vocab, guess, next);
    float tau_k = -INFINITY, tau_p = -INFINITY, tau_m = -INFINITY;
    w->kept = -1.0;
    if (has_k) tau_k = kth_value(w, top_k, count);
    if (top_p < 1.0) {
        if (tau_k == -INFINITY)
            tau_p = nucleus_from_cuts(w, top_p, total, guess);
        else
            tau_p = nucleus(w, top_p * kept_mass(x, w->e, tau_k, 0, vocab), tau_k, WINDOWS, 2);
    }
    if (min_p > 0.0) tau_m = min_p_floor(w, min_p);
    float tau = tau_k > tau_p ? tau_k : tau_p;
    tau = tau > tau_m ? tau : tau_m;
    *threshold = tau;
    /* the kept mass is the walk's when top-p's threshold is the row's */
    const double kept = top_p < 1.0 && tau == tau_p && tau_p > -INFINITY ? w->kept : -1.0;
    if (u >= 0.0) *token = draw(w, tau, u, kept);
    return 0;
}

/* rows of logits [n, vocab]; params [n, PARAMS] per row: temperature (rounded to fp32 here),
 * top_k (0: off), top_p (>= 1: off), min_p (0: off), uniform (< 0: no draw); one array, so
 * a caller builds one buffer per call. Writes token [n] and threshold [n]. Returns 0, or -1
 * when out of memory. */
#define PARAMS 5
int sample_rows(const float *logits, int64_t n, int64_t vocab, const double *params,
                int64_t *token, float *threshold, int threads) {
    int failed = 0;
    int64_t claimed = 0; /* rows handed out so far: each thread claims its next row ahead */
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1) reduction(|: failed)
    {
        int64_t r = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (r < n) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const double *p = params + r * PARAMS;
            failed |= one_row(logits + r * vocab, vocab, (float)p[0], (int64_t)p[1], p[2], p[3],
                              p[4], token + r, threshold + r,
                              next < n ? logits + next * vocab : NULL) != 0;
            r = next;
        }
    }
    return failed ? -1 : 0;
}
