/* One CPU decode token's mixture-of-experts layer (Qwen3-MoE, Mixtral) in one call, from the
 * block's input to its output (model/cpu_native_moe.py):
 *
 *     norm -> qkv -> per-head q/k norms -> RoPE + cache write + attention -> o
 *          -> residual, FFN norm (float32) -> router, softmax, top k -> the k experts -> residual
 *
 * Why: through torch a Qwen3-30B-A3B-shaped layer made ~40 calls around its matvecs (the q/k
 * norms and their cat, RoPE, the cache writes, attention, the norms, the router's linear,
 * softmax, topk, argsort, gather, tolist) and on the 2-core EPYC they cost ~0.4 ms of a
 * ~1.3 ms layer: a third of a 12-layer file's decode token, the head aside.
 *
 * Where `experts` is NULL (a bank that places its experts elsewhere: weights.expert_tiers) the
 * call stops after the routing and returns 0 with the residual `mid`, the experts' input `hf`
 * and the chosen ids and weights (ascending ids), for the caller to sum the experts through
 * its bank; moe_ffn.c gives a resident bank's sum the same bits, so the two agree bit for bit.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "moe_expert.h"

/* decode_ops.c, q4_matvec.c and moe_ffn.c (compiled into the same library) */
void ss_rms_norm_bf16(const float *x, const float *w, int64_t n, float eps, uint16_t *out);
void ss_rms_norm_rows_f32(const float *x, const float *w, int64_t rows, int64_t n, float eps,
                          float *out);
void ss_decode_attention(const void *qkv, int qkv_f32, const float *ang, const float *ang_sin,
                         int64_t rope_dim, int style, int64_t pos, float *k_cache,
                         float *v_cache, int64_t max_ctx, int64_t n_q, int64_t n_kv, int64_t d,
                         float scale, float *scratch, uint16_t *out);
void ss_q4_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);
void ss_q6_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);
int ss_moe_ffn(const moe_expert *const *experts, int64_t k, const float *x, const float *w,
               float *out, int64_t threads, int64_t act);

#define MAX_TOP_K 64
#define MAX_QKV_PARTS 3

/* A matvec's weight: a q4_matvec.c one (q4vnni or q8vnni records) or, with `q6` set, a
 * q6_matvec.c one; `rows` its output rows. */
typedef struct {
    const void *w;
    int64_t rows, q6;
} moe_matvec;

/* A layer, made once (cpu_native_moe.MoeNativeLayer). q/k/v are one matvec where their
 * formats share a layout, else one per part (Q4_K_M's Q6_K v beside Q4_K q and k:
 * weights/cpu/parts.py), their outputs side by side. */
typedef struct {
    moe_matvec qkv[MAX_QKV_PARTS];
    int64_t n_qkv;
    moe_matvec o;
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm;  /* per-head (d,) weights, or NULL: no q/k norms */
    const float *router;           /* (n_experts, hidden) float32 */
    const moe_expert *const *experts;  /* n_experts descriptors, or NULL (see the top) */
    int64_t hidden, n_q, n_kv, d, rope_dim, rope_style, q4_flags;
    int64_t n_experts, top_k, normalize, act;
    float eps, scale;
} ss_moe_layer;

/* The router's choice for the float32 input hf: logits = router . hf, p = softmax(logits),
 * the top_k largest p (the lower id first on a tie), w = p[top] (renormalised to sum 1 where
 * `normalize`), both written in ascending id order, as model/moe.py's experts_ffn orders a
 * token's experts. */
static void route(const ss_moe_layer *L, const float *hf, float *logits, unsigned char *tk,
                  int64_t *ids, float *w) {
    const int64_t n = L->n_experts, k = L->top_k, hidden = L->hidden;
    float mx = -INFINITY;
    for (int64_t e = 0; e < n; e++) {
        const float *r = L->router + e * hidden;
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += r[i + j] * hf[i + j];
        float s = 0.0f;
        for (int j = 0; j < 16; j++) s += acc[j];
        for (; i < hidden; i++) s += r[i] * hf[i];
        logits[e] = s;
        mx = s > mx ? s : mx;
    }
    float sum = 0.0f;
    for (int64_t e = 0; e < n; e++) {
        logits[e] = expf(logits[e] - mx);
        sum += logits[e];
    }
    for (int64_t e = 0; e < n; e++) logits[e] /= sum;
    /* the k largest, by repeated selection (n * k compares: 1024 for Qwen3-30B-A3B); tk
     * marks those taken */
    memset(tk, 0, (size_t)n);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!tk[e] && (best < 0 || logits[e] > logits[best])) best = e;
        tk[best] = 1;
    }
    int64_t m = 0;
    float top = 0.0f;
    for (int64_t e = 0; e < n && m < k; e++)
        if (tk[e]) {
            ids[m] = e;
            w[m] = logits[e];
            top += logits[e];
            m++;
        }
    if (L->normalize)
        for (int64_t j = 0; j < k; j++) w[j] /= top;
}

/* y = W x for one bfloat16 row x, into bfloat16 y (flags: q4_matvec.c's, which q6_matvec.c
 * reads alike) */
static void matvec(const moe_matvec *m, const uint16_t *x, uint16_t *y, int64_t flags) {
    if (m->q6) ss_q6_matvec(m->w, x, y, 1, flags);
    else ss_q4_matvec(m->w, x, y, 1, flags);
}

/* The layer on x (hidden floats) at slot pos, writing the token's key and value at slot pos of
 * the (n_kv, max_ctx, d) float32 caches. threads: the matvecs' and the experts' OpenMP team.
 * Returns 1 with x_out written; 0 (L->experts NULL) with mid (the residual after attention),
 * hf (the experts' input), ids and w (top_k each) written and x_out untouched; -1 where
 * scratch could not be allocated (nothing written but the caches). */
int ss_decode_moe_layer(const ss_moe_layer *L, const float *x, float *x_out, const float *ang,
                        const float *ang_sin, int64_t pos, float *k_cache, float *v_cache,
                        int64_t max_ctx, int64_t threads, float *mid, float *hf, int64_t *ids,
                        float *w) {
    const int64_t hidden = L->hidden, d = L->d, n_q = L->n_q, n_kv = L->n_kv;
    const int64_t rows = (n_q + 2 * n_kv) * d, group = n_q / n_kv;
    if (L->top_k > MAX_TOP_K || L->top_k > L->n_experts) return -1;
    /* floats: qkv, attention's work (queries, scores), router logits, experts' sum;
     * bfloat16 (as uint16, counted in floats): the normed input, qkv, attention, o */
    const int64_t floats = rows + n_q * d + group * (pos + 1) + L->n_experts + hidden +
                           (hidden + rows + n_q * d + hidden + 1) / 2 + L->n_experts / 4 + 8;
    float *buf = malloc((size_t)floats * sizeof(float));
    if (buf == NULL) return -1;
    float *qkv = buf, *work = qkv + rows, *logits = work + n_q * d + group * (pos + 1);
    float *sum = logits + L->n_experts;
    uint16_t *h = (uint16_t *)(sum + hidden), *qkv_b = h + hidden, *attn = qkv_b + rows;
    uint16_t *o = attn + n_q * d;
    unsigned char *taken = (unsigned char *)(o + hidden);
    const int64_t flags = L->q4_flags | threads << 8;  /* q4_matvec.c's Q4_THREADS_SHIFT */

    ss_rms_norm_bf16(x, L->attn_norm, hidden, L->eps, h);
    for (int64_t p = 0, r0 = 0; p < L->n_qkv; r0 += L->qkv[p].rows, p++)
        matvec(&L->qkv[p], h, qkv_b + r0, flags);
    /* widened exactly, as the torch path's float32 q/k/v (PackedDecodeLinear's finish) */
    for (int64_t i = 0; i < rows; i++) qkv[i] = bf16_to_f32(qkv_b[i]);
    if (L->q_norm != NULL) {  /* model/llama.py qk_normed: one RMSNorm per head, in place */
        ss_rms_norm_rows_f32(qkv, L->q_norm, n_q, d, L->eps, qkv);
        ss_rms_norm_rows_f32(qkv + n_q * d, L->k_norm, n_kv, d, L->eps, qkv + n_q * d);
    }
    ss_decode_attention(qkv, 1, ang, ang_sin, L->rope_dim, (int)L->rope_style, pos, k_cache,
                        v_cache, max_ctx, n_q, n_kv, d, L->scale, work, attn);
    matvec(&L->o, attn, o, flags);
    /* x + o (o's bfloat16 widened exactly, one float32 add, as torch.add), then the FFN's
     * RMSNorm in float32 (model/llama.py rms_norm's native call, the same function) */
    for (int64_t i = 0; i < hidden; i++) mid[i] = x[i] + bf16_to_f32(o[i]);
    ss_rms_norm_rows_f32(mid, L->ffn_norm, 1, hidden, L->eps, hf);
    route(L, hf, logits, taken, ids, w);
    if (L->experts == NULL) {
        free(buf);
        return 0;
    }
    const moe_expert *chosen[MAX_TOP_K];
    for (int64_t j = 0; j < L->top_k; j++) chosen[j] = L->experts[ids[j]];
    if (ss_moe_ffn(chosen, L->top_k, hf, w, sum, threads, L->act) != 0) {
        free(buf);
        return -1;
    }
    /* mid + y, as torch's x + y after moe_ffn's float32 sum */
    for (int64_t i = 0; i < hidden; i++) x_out[i] = mid[i] + sum[i];
    free(buf);
    return 1;
}
