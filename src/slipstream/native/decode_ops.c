/* The small operations of one CPU decode token, each fused into one call (see native/__init__.py).
 *
 * A decode step of a small model on CPU spends as long in ~25 tiny torch calls a layer (norms,
 * RoPE, the cache write, attention, SwiGLU) as in its four matmuls: each call costs a few
 * microseconds of dispatch for a few hundred floats of work. These functions do the same math on
 * raw buffers, one call for what took a dozen. The matmuls stay torch's packed kernels, which read
 * and write bfloat16 rows: the functions here produce and consume those rows.
 *
 * Activations are float32, the KV cache float32, matmul inputs and outputs bfloat16 (stored as
 * uint16 bit patterns, rounded to nearest even as torch rounds them). Sums run in vectors of the
 * CPU's width (GCC vector extensions: the same source on AVX-512, AVX2 or NEON), so the order of
 * additions differs from torch's, and between CPUs of different widths: results agree to float32
 * rounding, not bit for bit. On one machine they are the same at any thread count.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* the vector width of the CPU compiled for: a wider type on AVX2 splits into two registers and
 * its cross-half shuffles (hsum) cost more than they save */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef float vfu __attribute__((vector_size(4 * LANES), aligned(4)));  /* unaligned loads */
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));  /* bfloat16 bits */

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf v) { *(vfu *)p = v; }

/* A tree of shuffles and adds: the lanes' sum with a dependency chain of log2(LANES), not LANES. */
static inline float hsum(vf v) {
#if LANES == 16
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return v[0];
}

static inline vf splat(float f) { return (vf){0} + f; }

/* Lane-wise select (C has no vector ?:): where m is all ones, a; elsewhere b. */
static inline vf selectv(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* e^x in LANES lanes to about 2 float32 ulps (Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2,
 * e^r by a degree-6 polynomial, 2^k put into the exponent). Below -87.3 it gives 0 and above
 * 88.4 infinity, as libm's expf underflows and overflows, so that silu(-100) is 0 as torch's
 * is, and softmax's -inf scores vanish. */
static inline vf expv(vf x) {
    vf lo = splat(-87.33654f), hi = splat(88.37626f);
    vi under = x < lo, over = x > hi;
    x = selectv(under, lo, x);
    x = selectv(over, hi, x);
    vf kf = x * 1.44269504088896341f + 0.5f;
    vi k = __builtin_convertvector(kf, vi);
    k -= (vi)(__builtin_convertvector(k, vf) > kf) & 1;  /* floor, not truncation */
    vf fk = __builtin_convertvector(k, vf);
    vf r = x - fk * 0.693359375f - fk * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (vi)p + ((k) << 23);
    bits &= ~under;
    return selectv(over, splat(INFINITY), (vf)bits);
}

/* torch's float -> bfloat16 in LANES lanes (see f32_to_bf16), as the 32-bit lanes' top halves. */
static inline vu bf16_bits_v(vf f) {
    vu u = (vu)f;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (r & ~nan) | (nan & 0x7fc0u);
}

static inline vf bf16_round_v(vf f) { return (vf)(bf16_bits_v(f) << 16); }

static inline void store_bf16_v(uint16_t *out, vf f) {
    vh b = __builtin_convertvector(bf16_bits_v(f), vh);
    memcpy(out, &b, sizeof b);
}

static inline vf load_bf16_v(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}


static inline float dot(const float *a, const float *b, int64_t n) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += loadv(a + i) * loadv(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out = bf16(x * rsqrt(mean(x^2) + eps) * w), x of n floats. */
void ss_rms_norm_bf16(const float *x, const float *w, int64_t n, float eps, uint16_t *out) {
    float ss = dot(x, x, n);
    float r = (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(r * x[i] * w[i]);
}

/* out = x * rsqrt(mean(x^2) + eps) * w in float32 for `rows` rows of n floats, on the calling
 * thread: a prefill's norms (model.llama.rms_norm). torch's F.rms_norm is several ops, each an
 * OpenMP region: on the 2-core EPYC with other processes busy, Qwen3's per-head q/k norms of
 * 512 rows ((16384, 128)) took 56 ms and 19 ms of CPU on 2 threads, 2 ms of CPU on one; here
 * a row is one pass of loads. */
void ss_rms_norm_rows_f32(const float *x, const float *w, int64_t rows, int64_t n, float eps,
                          float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float ss = dot(xr, xr, n);
        float s = (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
        for (int64_t i = 0; i < n; i++) o[i] = s * xr[i] * w[i];
    }
}

/* x_out = x + y (y the bfloat16 output of a matmul, widened exactly, as torch.add promotes it),
 * then out = the RMS norm of x_out in bfloat16: the residual add after attention and the FFN's
 * norm in one call. */
void ss_add_rms_norm_bf16(const float *x, const uint16_t *y, const float *w, int64_t n,
                          float eps, float *x_out, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) x_out[i] = x[i] + bf16_to_f32(y[i]);
    ss_rms_norm_bf16(x_out, w, n, eps, out);
}

/* out = bf16(bf16(silu(gate)) * up) for gate_up = [gate | up], 2n bfloat16: torch's
 * mul(silu(gate), up) in bfloat16, each op rounding its result. */
void ss_silu_mul_bf16(const uint16_t *gate_up, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf g = load_bf16_v(gate_up + i);
        vf s = bf16_round_v(g / (1.0f + expv(-g)));
        store_bf16_v(out + i, s * load_bf16_v(gate_up + n + i));
    }
    for (; i < n; i++) {
        float g = bf16_to_f32(gate_up[i]);
        float s = bf16_to_f32(f32_to_bf16(g / (1.0f + expv(splat(-g))[0])));
        out[i] = f32_to_bf16(s * bf16_to_f32(gate_up[n + i]));
    }
}

/* The gated products ss_glu_f32 forms (its `act`). */
#define GLU_SILU 0   /* silu(gate) * up: SwiGLU */
#define GLU_GELU 1   /* gelu_tanh(gate) * up: GeGLU (Gemma) */
#define GLU_OAI 2    /* gpt-oss's clamped SwiGLU (model/moe.py swiglu_oai) */

/* One vector of act(gate) * up. SiLU is x / (1 + e^-x); GELU's tanh form, 0.5 x (1 + tanh(u)),
 * u = sqrt(2 / pi) (x + 0.044715 x^3), is x / (1 + e^(-2u)), one exponential that saturates to
 * x and to -0 as expv does at its ends. gpt-oss's: g = min(gate, 7), up clamped to [-7, 7],
 * (up + 1) * g / (1 + e^(-1.702 g)), in torch's order of operations (the clamps as selects, so
 * that a NaN passes through as torch's clamp passes it). */
static inline vf glu_v(vf x, vf u, int act) {
    const float c = 1.5957691216057308f, k = 0.044715f;  /* 2 sqrt(2 / pi), GELU's cubic */
    const float alpha = 1.702f, limit = 7.0f;
    if (act == GLU_OAI) {
        x = selectv(x > splat(limit), splat(limit), x);
        u = selectv(u > splat(limit), splat(limit), u);
        u = selectv(u < splat(-limit), splat(-limit), u);
        return (u + 1.0f) * (x / (1.0f + expv(-(alpha * x))));
    }
    vf z = act == GLU_GELU ? c * (x + k * x * x * x) : x;
    return x / (1.0f + expv(-z)) * u;
}

/* out = act(gate) * up in float32 for m rows of gate_up = [gate | up] (2n floats a row), out m
 * rows of n, act one of GLU_* above. `bias` (2n floats, or NULL): added to each row of gate_up
 * first, in place, as torch.add(bias, y) adds a linear's float32 bias (the same bits: one
 * rounded add). The product between two CPU matvecs: hybrid decode's (ss_q4_ffn) and a mixture
 * of experts' (moe_ffn.c, weights/cpu/expert_decode.py), unrounded. */
void ss_glu_f32(float *gate_up, const float *bias, int64_t m, int64_t n, int64_t act,
                float *out) {
    for (int64_t r = 0; r < m; r++) {
        float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        if (bias != NULL)
            for (int64_t i = 0; i < 2 * n; i++) g[i] = bias[i] + g[i];
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf y = glu_v(loadv(g + i), loadv(u + i), (int)act);
            memcpy(o + i, &y, sizeof y);
        }
        for (; i < n; i++) o[i] = glu_v(splat(g[i]), splat(u[i]), (int)act)[0];
    }
}

/* SwiGLU's product (Llama and most families). */
void ss_silu_mul_f32(const float *gate_up, int64_t m, int64_t n, float *out) {
    ss_glu_f32((float *)gate_up, NULL, m, n, GLU_SILU, out);
}

/* GeGLU's product (Gemma). */
void ss_gelu_mul_f32(const float *gate_up, int64_t m, int64_t n, float *out) {
    ss_glu_f32((float *)gate_up, NULL, m, n, GLU_GELU, out);
}

/* Rotate one head's first rope_dim dims in place, by the angles RopeTable.angles gives.
 * style 0 ("normal"): pairs (2i, 2i+1), angles interleaved as (cos_i, sin_i) in `ang` (the
 * complex table's bytes; `ang_sin` unused); style 1 ("neox"): pairs (i, i + rope_dim/2), cos_i
 * in ang[i] and sin_i in ang_sin[i]. */
static void rope_head(float *h, const float *ang, const float *ang_sin, int64_t rope_dim,
                      int style) {
    int64_t half = rope_dim / 2;
    if (style == 0) {
        for (int64_t i = 0; i < half; i++) {
            float c = ang[2 * i], s = ang[2 * i + 1];
            float re = h[2 * i], im = h[2 * i + 1];
            h[2 * i] = re * c - im * s;
            h[2 * i + 1] = re * s + im * c;
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            float c = ang[i], s = ang_sin[i];
            float x1 = h[i], x2 = h[i + half];
            h[i] = x1 * c - x2 * s;
            h[i + half] = x2 * c + x1 * s;
        }
    }
}

/* softmax of n scores in place: e^(s - max) / sum, the exponentials LANES at a time. */
static void softmax(float *sc, int64_t n) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) m = sc[t] > m ? sc[t] : m;
    vf acc = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        vf e = expv(loadv(sc + t) - m);
        storev(sc + t, e);
        acc += e;
    }
    sum = hsum(acc);
    for (; t < n; t++) {
        sc[t] = expv(splat(sc[t] - m))[0];
        sum += sc[t];
    }
    float inv = 1.0f / sum;
    for (t = 0; t < n; t++) sc[t] *= inv;
}

#define MAX_GROUP 8  /* query heads per KV head held in registers at once */

/* Scores, softmax and the weighted sum of values for G query heads q (G, d) sharing one KV
 * head's rows K, V (span, d), into out (G, d) bfloat16. G is a constant at each call site
 * (see attend_heads), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_group(
        const float *q, const float *K, const float *V, int64_t span, int64_t d, float scale,
        float *scores, uint16_t *out, const int G) {
    for (int64_t t = 0; t < span; t++) {
        const float *kr = K + t * d;
        vf acc[MAX_GROUP];
        float tail[MAX_GROUP];
        for (int g = 0; g < G; g++) { acc[g] = (vf){0}; tail[g] = 0.0f; }
        int64_t i = 0;
        for (; i + LANES <= d; i += LANES) {
            vf k16 = loadv(kr + i);
            for (int g = 0; g < G; g++) acc[g] += loadv(q + g * d + i) * k16;
        }
        for (; i < d; i++)
            for (int g = 0; g < G; g++) tail[g] += q[g * d + i] * kr[i];
        for (int g = 0; g < G; g++) scores[g * span + t] = (hsum(acc[g]) + tail[g]) * scale;
    }
    for (int g = 0; g < G; g++) softmax(scores + g * span, span);
    for (int64_t i = 0; i < d; i += LANES) {  /* LANES output dims of the G heads at once */
        int64_t w = d - i < LANES ? d - i : LANES;
        vf acc[MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = (vf){0};
        if (w == LANES) {
            for (int64_t t = 0; t < span; t++) {
                vf vr = loadv(V + t * d + i);
                for (int g = 0; g < G; g++) acc[g] += scores[g * span + t] * vr;
            }
        } else {
            for (int64_t t = 0; t < span; t++) {
                vf vr = {0};
                for (int64_t j = 0; j < w; j++) vr[j] = V[t * d + i + j];
                for (int g = 0; g < G; g++) acc[g] += scores[g * span + t] * vr;
            }
        }
        for (int g = 0; g < G; g++) {
            vu b = bf16_bits_v(acc[g]);
            for (int64_t j = 0; j < w; j++) out[g * d + i + j] = (uint16_t)b[j];
        }
    }
}

static void attend_heads(const float *q, const float *K, const float *V, int64_t span,
                         int64_t d, float scale, float *scores, uint16_t *out, int64_t group) {
    for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
        int64_t left = group - g0;
        const float *qg = q + g0 * d;
        uint16_t *og = out + g0 * d;
        switch (left < MAX_GROUP ? left : MAX_GROUP) {
        case 1: attend_group(qg, K, V, span, d, scale, scores, og, 1); break;
        case 2: attend_group(qg, K, V, span, d, scale, scores, og, 2); break;
        case 3: attend_group(qg, K, V, span, d, scale, scores, og, 3); break;
        case 4: attend_group(qg, K, V, span, d, scale, scores, og, 4); break;
        case 5: attend_group(qg, K, V, span, d, scale, scores, og, 5); break;
        case 6: attend_group(qg, K, V, span, d, scale, scores, og, 6); break;
        case 7: attend_group(qg, K, V, span, d, scale, scores, og, 7); break;
        default: attend_group(qg, K, V, span, d, scale, scores, og, 8); break;
        }
    }
}

/* Attention of one causal token at slot `pos` over slots 0..pos of one layer:
 *   qkv      [q (n_q d) | k (n_kv d) | v (n_kv d)], bfloat16 (qkv_f32 = 0) or float32 (1)
 *   ang, ang_sin  the token's rotary angles (see rope_head)
 *   k_cache, v_cache  (n_kv, max_ctx, d) float32: the token's rotated key and its value are
 *            written at slot pos
 *   scratch  (n_q d) + (n_q / n_kv) * (pos + 1) floats
 *   out      (n_q d) bfloat16: head h_q = kv * group + g at [h_q d, (h_q + 1) d)
 * Scores are (q . k) * scale, as torch.baddbmm's alpha applies it. Each key and value row is
 * read once for all the query heads that share it. */
void ss_decode_attention(const void *qkv, int qkv_f32, const float *ang, const float *ang_sin,
                         int64_t rope_dim, int style, int64_t pos, float *k_cache,
                         float *v_cache, int64_t max_ctx, int64_t n_q, int64_t n_kv, int64_t d,
                         float scale, float *scratch, uint16_t *out) {
    int64_t n = n_q + 2 * n_kv, group = n_q / n_kv, span = pos + 1;
    float *q = scratch;  /* the query heads, rotated */
    float *scores = scratch + n_q * d;  /* (group, span) */
    for (int64_t h = 0; h < n; h++) {
        float *dst;
        if (h < n_q) dst = q + h * d;
        else if (h < n_q + n_kv) dst = k_cache + ((h - n_q) * max_ctx + pos) * d;
        else dst = v_cache + ((h - n_q - n_kv) * max_ctx + pos) * d;
        if (qkv_f32) memcpy(dst, (const float *)qkv + h * d, (size_t)d * sizeof(float));
        else for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(((const uint16_t *)qkv)[h * d + i]);
        if (h < n_q + n_kv) rope_head(dst, ang, ang_sin, rope_dim, style);
    }
    for (int64_t kv = 0; kv < n_kv; kv++)
        attend_heads(q + kv * group * d, k_cache + kv * max_ctx * d, v_cache + kv * max_ctx * d,
                     span, d, scale, scores, out + kv * group * d, group);
}
