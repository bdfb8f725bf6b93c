/* A whole Llama decode step's layers in one call (kernels/cpu_decode.py builds and calls it).
 *
 * A batch-1 decode step of a small model is set by the number of ops, not by arithmetic:
 * the per-op path calls ~12 kernels a layer from Python, each with its dispatch, argument
 * checks and an output allocation. This file runs the same kernels, in the same order and
 * with the same arithmetic, from C: per layer RMSNorm (+ residual), the fused q/k/v matmul,
 * neox rotary of q and k in place, the KV cache write, decode attention read from the paged
 * cache, the output projection, RMSNorm (+ residual), the fused gate/up matmul, SiLU-and-mul
 * and the down projection; then the final RMSNorm. The results are therefore bitwise those
 * of the per-op path with the fused CPU kernels on (the tests hold it to that).
 *
 * A projection is up to DEC_PARTS parts stacked along N, each with its own kernel, as the
 * per-op path's quant.FusedWeight runs them (a Q4_K_M file's q and k are Q4_K, its v Q6_K):
 * a weight in the VNNI layout (cpu_qgemv.c, AVX512-VNNI), or a GGUF file's own rows
 * (cpu_gguf.c: its AVX2 int8 kernels on every x86 CPU with AVX2, the only ones most laptops
 * have), each writing its columns of the projection's output.
 *
 * Scope: every row a one-token decode of its own sequence, quantized weights without
 * biases, fp32 or bf16 KV caches, full attention (no window, no soft cap). The Python side
 * checks that and keeps the per-op path for everything else.
 */
#include "cpu_fused.c"
#include "cpu_qgemv.c"
#include "cpu_attention.c"
#include "cpu_gguf.c"

#define DEC_GGUF 1000  /* kind DEC_GGUF + a ggml type id: a GGUF file's own rows (cpu_gguf.c) */
#define DEC_PARTS 3

typedef struct {
    int64_t kind;  /* QG_INT4, QG_INT8 or QG_INT4_HALF (cpu_qgemv.c), or DEC_GGUF + type */
    const uint8_t *w;
    const void *scale;
    const float *zero;
    int64_t n, k;
} dec_weight;

typedef struct {
    int64_t parts;  /* 1..DEC_PARTS, stacked along N */
    dec_weight part[DEC_PARTS];
} dec_proj;

typedef struct {
    const float *input_norm, *post_norm;
    dec_proj qkv, o, gate_up, down;
} dec_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *final_norm;
    const float *rope_cache;  /* [max_positions, head_dim] = cat(cos, sin) */
} dec_model;

static __thread struct scratch work;

static float *work_for(size_t n) { return scratch_grow(&work, n * sizeof(float)); }

/* out [m, N] = x [m, K] @ w.T, N the parts' rows together: each part its own kernel into
 * its columns (the per-op path's results, bit for bit: the same calls on the same x). */
static int matmul(const dec_proj *p, const float *x, float *out, int64_t m, int threads) {
    int64_t n = 0, col = 0;
    for (int64_t i = 0; i < p->parts; i++) n += p->part[i].n;
    for (int64_t i = 0; i < p->parts; i++) {
        const dec_weight *w = &p->part[i];
        int rc;
        if (w->kind >= DEC_GGUF) {
            int type = (int)(w->kind - DEC_GGUF), bs = block_size(type);
            int64_t row_bytes = bs ? w->k / bs * block_bytes(type) : 0;
            rc = bs == 1 ? gg_linear(type, w->w, row_bytes, w->n, w->k, x, w->k, m, out + col, n,
                                     threads)
                         : gg_linear_x(type, w->w, row_bytes, w->n, w->k, x, w->k, m, out + col,
                                       n, threads);
        } else {
            rc = qg_linear((int)w->kind, w->w, w->scale, w->zero, x, w->k, out + col, n, m, w->n,
                           w->k, threads);
        }
        if (rc) return -1;
        col += w->n;
    }
    return 0;
}

/* cache slots of every key each sequence sees: keys [m, max_len] */
static void key_slots(const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                      int64_t m, int64_t max_len, int64_t block_size, int64_t *keys,
                      int64_t *counts) {
    for (int64_t b = 0; b < m; b++) {
        counts[b] = seq_lens[b];
        for (int64_t p = 0; p < seq_lens[b]; p++)
            keys[b * max_len + p] =
                (int64_t)block_tables[b * table_stride + p / block_size] * block_size + p % block_size;
    }
}

/* the rows' k and v into their cache slots, as fp32 or rounded to bf16 */
static void store_kv(const float *qkv, int64_t width, int64_t q_size, int64_t kv_size,
                     const int64_t *slots, int64_t m, void *k_cache, void *v_cache, int kv_bf16) {
    for (int64_t r = 0; r < m; r++) {
        const float *row = qkv + r * width + q_size;
        if (kv_bf16) {
            to_bf16(row, (uint16_t *)k_cache + slots[r] * kv_size, kv_size);
            to_bf16(row + kv_size, (uint16_t *)v_cache + slots[r] * kv_size, kv_size);
        } else {
            memcpy((float *)k_cache + slots[r] * kv_size, row, (size_t)kv_size * sizeof(float));
            memcpy((float *)v_cache + slots[r] * kv_size, row + kv_size, (size_t)kv_size * sizeof(float));
        }
    }
}

/* h [m, hidden]: the embeddings in, the final normed hidden states out. caches: per layer
 * (k, v), each [num_slots, kv_heads, head_dim] of fp32, or bf16 when kv_bf16. positions / slots: per row; block_tables
 * [m, table_stride] int32; seq_lens [m] int32 (context including the new token).
 * Returns 0, or -1 when a kernel refuses the shapes or memory runs out. */
int decode_forward(const dec_model *md, const dec_layer *layers, void *const *caches, int kv_bf16,
                   float *h,
                   int64_t m, const int64_t *positions, const int64_t *slots,
                   const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                   int64_t block_size, int threads) {
    int64_t hidden = md->hidden, d = md->head_dim;
    int64_t q_size = md->heads * d, kv_size = md->kv_heads * d, width = q_size + 2 * kv_size;
    int64_t max_len = 1;
    for (int64_t b = 0; b < m; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    size_t floats = (size_t)(m * (2 * hidden + width + q_size + 3 * md->intermediate));
    float *buf = work_for(floats + (size_t)(m * max_len + m) * 2);  /* int64 keys: 2 floats */
    if (!buf) return -1;
    float *residual = buf, *x = residual + m * hidden, *qkv = x + m * hidden;
    float *attn = qkv + m * width, *gate_up = attn + m * q_size;
    float *act = gate_up + 2 * m * md->intermediate;
    int64_t *keys = (int64_t *)(act + m * md->intermediate), *counts = keys + m * max_len;
    key_slots(block_tables, table_stride, seq_lens, m, max_len, block_size, keys, counts);
    for (int64_t l = 0; l < md->num_layers; l++) {
        const dec_layer *ly = layers + l;
        if (l == 0) {
            if (rms_norm_mixed(h, 0, NULL, ly->input_norm, x, 0, NULL, m, hidden, md->eps, threads)) return -1;
            memcpy(residual, h, (size_t)(m * hidden) * sizeof(float));
        } else {
            if (rms_norm_mixed(h, 0, residual, ly->input_norm, x, 0, residual, m, hidden, md->eps, threads)) return -1;
        }
        if (matmul(&ly->qkv, x, qkv, m, threads)) return -1;
        rope_neox_f32_rows(qkv, width, m, md->heads + md->kv_heads, d, md->rope_cache, positions, threads);
        store_kv(qkv, width, q_size, kv_size, slots, m, caches[2 * l], caches[2 * l + 1], kv_bf16);
        int rc = kv_bf16
            ? decode_attention_bf16(qkv, NULL, width, caches[2 * l], caches[2 * l + 1], keys,
                                    counts, m, max_len, md->heads, md->kv_heads, d, md->scale,
                                    attn, threads)
            : decode_attention_f32(qkv, NULL, width, caches[2 * l], caches[2 * l + 1], keys,
                                   counts, m, max_len, md->heads, md->kv_heads, d, md->scale,
                                   attn, threads);
        if (rc) return -1;
        if (matmul(&ly->o, attn, h, m, threads)) return -1;
        if (rms_norm_mixed(h, 0, residual, ly->post_norm, x, 0, residual, m, hidden, md->eps, threads)) return -1;
        if (matmul(&ly->gate_up, x, gate_up, m, threads)) return -1;
        if (silu_mul_mixed(gate_up, 0, act, 0, m, md->intermediate, threads)) return -1;
        if (matmul(&ly->down, act, h, m, threads)) return -1;
    }
    if (rms_norm_mixed(h, 0, residual, md->final_norm, x, 0, residual, m, hidden, md->eps, threads)) return -1;
    memcpy(h, x, (size_t)(m * hidden) * sizeof(float));
    return 0;
}
