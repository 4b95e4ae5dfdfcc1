/* GGUF blocks of the legacy 32-element formats (Q4_0, Q4_1, Q8_0) and of Q4_K and Q6_K
 * (256-element super-blocks) to float16 or float32: the dense weights a CPU prefill multiplies (quant.dequantize_as; weights/linear.py's
 * LazyDenseLinear makes them after the load).
 *
 * Why: in torch ops (quant/legacy.py: nibbles widened to float32, the multiply and the add
 * each a pass, then a narrowing copy) the default model's 106M layer weights took about 0.7 s
 * of one core, which the first token of a `run` waited for on a 2-core machine. Here each
 * weight is made in one pass from its block.
 *
 * The bits are quant/legacy.py's and quant/kquants.py's, whose float operations mirror
 * gguf-py's: in float32,
 *     Q4_0: (q - 8) * d      Q4_1: q * d + m      Q8_0: q * d
 *     Q4_K: (d * sc_j) * q - (dmin * m_j)          Q6_K: (d * sc_j) * (q - 32)
 * A mixture of experts' prefill makes each routed expert's dense weights per pass (weights/
 * linear.py's OnDemandDenseLinear), so Q4_K's and Q6_K's, the K-quant files' expert formats,
 * come here too.
 * (d and m the block's float16 fields widened exactly, q - 8 exact, each product and sum
 * rounded once: this file is built with -ffp-contract=off, so no fused multiply-add), then
 * rounded once to float16 to nearest even (half.h) where float16 is asked for. */

#include <stdint.h>
#include <string.h>

#include "half.h"

#if defined(__AVX512F__)
#define DQ_AVX512 1
#include <immintrin.h>
#else
#define DQ_AVX512 0
#endif

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define DQ_F16C 1  /* 8 floats to float16 in one instruction, rounded as f32_to_f16 rounds */
#else
#define DQ_F16C 0
#endif

enum { DQ_Q4_0 = 0, DQ_Q4_1 = 1, DQ_Q8_0 = 2, DQ_Q4_K = 3, DQ_Q6_K = 4 };

static inline int dq_block_bytes(int fmt) {
    return fmt == DQ_Q8_0 ? 34 : fmt == DQ_Q4_1 ? 20 : fmt == DQ_Q4_0 ? 18
           : fmt == DQ_Q4_K ? 144 : 210;
}

static inline int dq_block_elems(int fmt) { return fmt >= DQ_Q4_K ? 256 : 32; }

/* One Q4_K super-block's 256 float32 weights: d | dmin | scales[12] | qs[128], sub-block j's
 * 6-bit scale and min unpacked as quant/kquants.py's _k_scale_min; bytes 32i..32i+31 of qs
 * hold sub-block 2i in their low nibbles and 2i + 1 in their high ones. */
static inline void dq_q4_k(const uint8_t *b, float *w) {
    const float d = f16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
    const float dmin = f16_to_f32((uint16_t)(b[2] | (b[3] << 8)));
    const uint8_t *p = b + 4, *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = p[j] & 63;
            m = p[j + 4] & 63;
        } else {
            sc = (p[j + 4] & 0x0f) | ((p[j - 4] >> 2) & 0x30);
            m = (p[j + 4] >> 4) | ((p[j] >> 2) & 0x30);
        }
        const float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
#if DQ_AVX512
        /* the same two roundings, 16 weights a vector: a scalar loop took 1.35 ns a weight
         * (4.2 ms for a Qwen3-30B-A3B expert's gate/up), which a prefill pays per routed
         * expert */
        const __m512 vdl = _mm512_set1_ps(dl), vml = _mm512_set1_ps(ml);
        for (int h = 0; h < 2; h++) {
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
            c = _mm512_and_si512(_mm512_srli_epi32(c, shift), _mm512_set1_epi32(0x0f));
            __m512 t = _mm512_mul_ps(vdl, _mm512_cvtepi32_ps(c));
            _mm512_storeu_ps(w + 32 * j + 16 * h, _mm512_sub_ps(t, vml));
        }
#else
        for (int l = 0; l < 32; l++) {
            const float t = dl * (float)((q[l] >> shift) & 0x0f);
            w[32 * j + l] = t - ml;
        }
#endif
    }
}

/* One Q6_K super-block's 256 float32 weights: ql[128] | qh[64] | scales[16] int8 | d (see
 * q6_matvec.c's q6k_codes for the code order). */
static inline void dq_q6_k(const uint8_t *b, float *w) {
    const float d = f16_to_f32((uint16_t)(b[208] | (b[209] << 8)));
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        float *o = w + 128 * half;
        for (int l = 0; l < 32; l++) {
            const int q[4] = {(ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                              (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                              (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                              (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
            for (int s = 0; s < 4; s++) {
                const int e = 32 * s + l;  /* element of this half */
                const float dl = d * (float)sc[(128 * half + e) / 16];
                o[e] = dl * (float)(q[s] - 32);
            }
        }
    }
}

/* One block's 32 (256: Q4_K, Q6_K) float32 weights. */
static inline void dq_block(const uint8_t *b, int fmt, float *w) {
    if (fmt == DQ_Q4_K) {
        dq_q4_k(b, w);
        return;
    }
    if (fmt == DQ_Q6_K) {
        dq_q6_k(b, w);
        return;
    }
    if (fmt == DQ_Q8_0) {
        const float d = f16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
        for (int i = 0; i < 32; i++) w[i] = (float)(int8_t)b[2 + i] * d;
        return;
    }
    const float d = f16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
    if (fmt == DQ_Q4_0) {
        const uint8_t *qs = b + 2;
        for (int i = 0; i < 16; i++) {
            w[i] = (float)((int)(qs[i] & 0x0f) - 8) * d;
            w[i + 16] = (float)((int)(qs[i] >> 4) - 8) * d;
        }
        return;
    }
    const float m = f16_to_f32((uint16_t)(b[2] | (b[3] << 8)));
    const uint8_t *qs = b + 4;
    for (int i = 0; i < 16; i++) {
        w[i] = (float)(qs[i] & 0x0f) * d + m;
        w[i + 16] = (float)(qs[i] >> 4) * d + m;
    }
}

/* Blocks [0, n) of `fmt` (block_bytes each, end to end at raw) into out: n * 32 (Q4_K, Q6_K:
 * n * 256) values, in order: float16 (out_f16 = 1), float32 (0), or float32 rounded through
 * float16 (2: float(half(w)), what a float16 weight widened for a float32 GEMM holds, in one
 * pass instead of two). Blocks are shared out over `threads` OpenMP threads (one: no
 * region); each value is made by one thread from its own block, so any count gives the same
 * bits. */
void ss_dequant_blocks(const uint8_t *raw, int fmt, int64_t n, void *out, int out_f16,
                       int threads) {
    const int64_t bytes = dq_block_bytes(fmt), elems = dq_block_elems(fmt);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t k = 0; k < n; k++) {
        float w[256];
        dq_block(raw + k * bytes, fmt, w);
        if (out_f16 == 1) {
            uint16_t *o = (uint16_t *)out + k * elems;
#if DQ_F16C
            /* IEEE round to nearest even, NaNs kept quiet with their sign: f32_to_f16's bits
             * (the conversion dominated the pass in plain C) */
            for (int i = 0; i < elems; i += 8)
                _mm_storeu_si128((__m128i *)(o + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(w + i), _MM_FROUND_TO_NEAREST_INT));
#else
            for (int i = 0; i < elems; i++) o[i] = f32_to_f16(w[i]);
#endif
        } else if (out_f16 == 2) {
            float *o = (float *)out + k * elems;
#if DQ_F16C
            for (int i = 0; i < elems; i += 8)
                _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm256_cvtps_ph(
                    _mm256_loadu_ps(w + i), _MM_FROUND_TO_NEAREST_INT)));
#else
            for (int i = 0; i < elems; i++) o[i] = f16_to_f32(f32_to_f16(w[i]));
#endif
        } else {
            memcpy((float *)out + k * elems, w, (size_t)elems * sizeof(float));
        }
    }
}
