/* One CPU decode token's whole layer in one call: model/cpu_native.py's decode_layer made its
 * eight native calls (norm, qkv matvec, attention, o matvec, residual + norm, gate_up matvec,
 * SwiGLU, down matvec) and a torch add from Python, and on the default model on 2 cores the
 * Python between them cost about 30 us of a layer's ~230. The same calls in the
 * same order on the same buffers, so the same bits.
 *
 *     norm -> qkv -> RoPE + cache write + attention -> o -> residual + norm
 *          -> gate_up -> SwiGLU -> down -> residual
 */

#include <stdint.h>

#include "bf16.h"

/* decode_ops.c and q4_matvec.c (compiled into the same library) */
void ss_rms_norm_bf16(const float *x, const float *w, int64_t n, float eps, uint16_t *out);
void ss_add_rms_norm_bf16(const float *x, const uint16_t *y, const float *w, int64_t n,
                          float eps, float *x_out, uint16_t *out);
void ss_silu_mul_bf16(const uint16_t *gate_up, int64_t n, uint16_t *out);
void ss_decode_attention(const void *qkv, int qkv_f32, const float *ang, const float *ang_sin,
                         int64_t rope_dim, int style, int64_t pos, float *k_cache,
                         float *v_cache, int64_t max_ctx, int64_t n_q, int64_t n_kv, int64_t d,
                         float scale, float *scratch, uint16_t *out);
void ss_q4_matvec(const void *wd, const void *x, void *y, int64_t m, int64_t flags);

/* A layer, made once (cpu_native.NativeLayer): its four q4_matvec.c weight descriptors, its
 * norms, and the shape. */
typedef struct {
    const void *qkv, *o, *gate_up, *down;
    const float *attn_norm, *ffn_norm;
    int64_t hidden, n_q, n_kv, d, ffn, rope_dim, rope_style, q4_flags;
    float eps, scale;
} ss_layer;

/* One thread's buffers (cpu_native._Scratch): bfloat16 rows but `work` (the queries and
 * scores) and `mid` (the residual after attention). */
typedef struct {
    uint16_t *h;
    float *work;
    uint16_t *attn;
    float *mid;
    uint16_t *act, *qkv, *o, *gate_up, *down;
} ss_scratch;

/* x_out (hidden floats) = the layer applied to x at slot pos; the token's key and value are
 * written at slot pos of the (n_kv, max_ctx, d) caches. threads: the matvecs' OpenMP team. */
void ss_decode_layer(const ss_layer *L, const ss_scratch *S, const float *x, float *x_out,
                     const float *ang, const float *ang_sin, int64_t pos, float *k_cache,
                     float *v_cache, int64_t max_ctx, int64_t threads) {
    const int64_t flags = L->q4_flags | threads << 8;  /* q4_matvec.c's Q4_THREADS_SHIFT */
    ss_rms_norm_bf16(x, L->attn_norm, L->hidden, L->eps, S->h);
    ss_q4_matvec(L->qkv, S->h, S->qkv, 1, flags);
    ss_decode_attention(S->qkv, 0, ang, ang_sin, L->rope_dim, (int)L->rope_style, pos, k_cache,
                        v_cache, max_ctx, L->n_q, L->n_kv, L->d, L->scale, S->work, S->attn);
    ss_q4_matvec(L->o, S->attn, S->o, 1, flags);
    ss_add_rms_norm_bf16(x, S->o, L->ffn_norm, L->hidden, L->eps, S->mid, S->h);
    ss_q4_matvec(L->gate_up, S->h, S->gate_up, 1, flags);
    ss_silu_mul_bf16(S->gate_up, L->ffn, S->act);
    ss_q4_matvec(L->down, S->act, S->down, 1, flags);
    /* torch.add(mid, down): the bfloat16 widened exactly, one float32 add */
    for (int64_t i = 0; i < L->hidden; i++) x_out[i] = S->mid[i] + bf16_to_f32(S->down[i]);
}
