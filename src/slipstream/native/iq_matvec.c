/* The i-quant grid formats IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S, IQ2_XS, IQ2_S and IQ1_M times
 * 16-bit-quantized activations:
 * the CPU decode matmul of the iq kind (weights/cpu/iquant.py, IqLinear), for the experts that
 * community quants of DeepSeek-V3/R1, Kimi K2, GLM-4.5 and Qwen3-235B store in these formats.
 *
 * Why: no other layout reads them, so without this they decode through dense float weights made
 * at every call (32 bits a weight written and read again where the file holds 1.56 to 3.44).
 * Here the file's blocks are read as they are (no repack: the weight is the file's rows, bytes
 * for bytes), their grid points looked up per 4 (IQ3_XXS, IQ3_S) or 8 (the others) weights and
 * their sign patterns per 8 (IQ3_S, IQ2_S: plain sign bits), as llama.cpp's CPU backend does
 * (ggml_vec_dot_iq3_xxs_q8_K, ggml_vec_dot_iq2_xxs_q8_K, ggml_vec_dot_iq3_s_q8_K: gather the
 * points into a vector, apply the signs, integer dots).
 * The tables (grid points, ksigns patterns as +-1 bytes) are gguf-py's, handed in by the caller
 * through the weight's descriptor: none are copied here.
 *
 * Math. A row's 32-column sub-block g of a 256-column block is w = s_g v with v = +-grid point
 * values (integers: IQ3_XXS 4..62, IQ2_XXS 8, 25, 43) and s_g = d (0.5 + l) / 2 for IQ3_XXS,
 * d (0.5 + l) / 4 for IQ2_XXS, d (1 + 2 l) for IQ3_S (d the block's float16, l the 4-bit
 * scale; IQ3_S's grid values odd, 1..15): 11 + 5 bits, exact in float32, so the weights are
 * the file's exactly. IQ1_S: w = d (1 + 2 l) / 8 (8 g +- 1), g in {-1, 0, 1} from its grid, the
 * shift's sign one bit a sub-block: v = 8 g +- 1, signed, which the VNNI loop's unsigned grid
 * cannot take (IQ1_S runs the AVX2 loop there).
 * IQ2_XS, IQ2_S and IQ1_M scale each 16 weights: ggml's d (0.5 + l) / 4 (IQ2_XS, IQ2_S: grid
 * values 8, 25, 43) is s_g = d / 8 times c = 1 + 2 l, and IQ1_M's d (1 + 2 l) (g +- 1/8) is
 * d / 8 times c times v = 8 g +- 1 (its shift's sign one bit a point, its d the top nibbles
 * of its 4 scale words). The integer c multiplies each 16-weight half's integer sum, so
 * S_g = c_0 S_first + c_1 S_second stays exact (|S| <= 31 * 43 * 32512 * 32 < 2^31) and the
 * float steps below are the same; IQ1_M, signed like IQ1_S, runs the AVX2 loop. The
 * activations are q4_matvec.c's
 * (ss_q16_quantize_row: per 32 columns dx = max|x| / 32512, X = 256 hi + lo, two int8 digits):
 * the 16-bit quantization every native kernel uses, so a model's bits err as the others' do
 * and the tests' tolerances hold; its 32-column groups are the i-quants' sub-blocks. Per
 * sub-block the integer sum S_g = sum v X = 256 (v . hi) + v . lo is exact in int32
 * (|S| <= 62 * 32512 * 32 < 2^26; rounded once to float above 2^24), and a row's output is
 *     acc[g % 8] = fma((float)S_g * dx_g, s_g, acc[g % 8])    in block order,
 *     y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)),
 * the vector loops' 8 lanes and their reduction, which the plain-C loop does in the same order:
 * the same bits from all three loops, whatever the thread count.
 *
 * Why 16-bit activations rather than int8 per block (half the integer work): they are what
 * every other native kernel, and so every model test's tolerance, assumes; and the integer dots
 * are not what bounds this kernel. One thread on the 2-core AVX-512 EPYC, 1024 x 4096 IQ3_XXS
 * from cache, the AVX2 loop: 0.74 ms a call, of which 0.50 ms went to building the weight
 * vectors (8 grid loads and 4 sign-pattern loads per 32 weights) and 0.08 ms to each
 * activation digit's dots.
 *
 * The integer dots. AVX2: vpmaddubsw multiplies unsigned by signed bytes, so as in cb4 it takes
 * |X digit| (unsigned: -128 gives 128) times v carrying the digit's sign; pairs at most
 * 2 * 128 * 62 = 15872, no saturation; then vpmaddwd into int32 lanes, and the 8 sub-blocks'
 * lanes summed by a transposing hadd tree (exact integers: order free; the tree's second level
 * holds the 16-weight halves apart, where the 16-weight scales multiply them). VNNI (AVX-512 BW/VL
 * masks on 256-bit vectors): the sign pattern as a 32-bit mask made from the scale word by pdep
 * and a parity fold (no table load), the digits negated under it and vpdpbusd'd with the
 * unsigned grid points; so that negating never overflows, the digits are rewritten per call in
 * base 255 (X = 255 h + l, |h|, |l| <= 127) and S = 255 A_h + A_l: the same S. 10-15% faster
 * than the AVX2 loop here (0.60 against 0.66 ms for the call above). IQ2_XS's sign indices
 * come out of its 4 index words by one pext, IQ2_S's plain sign bits are the mask as they are.
 *
 * Threads: rows split over OpenMP threads (parallel.h); each output is computed by one thread
 * in one order, so its bits do not depend on the thread count or the other rows.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "half.h"
#include "parallel.h"

#if defined(__AVX2__) && defined(__FMA__)
#define IQ_AVX2 1
#include <immintrin.h>
#else
#define IQ_AVX2 0
#endif
/* the VNNI loop: 256-bit vectors with AVX-512's byte masks and vpdpbusd, pdep for the signs */
#if IQ_AVX2 && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__BMI2__)
#define IQ_VNNI 1
#else
#define IQ_VNNI 0
#endif

#define IQ_BLOCK 256
#define IQ_SUB 32
#define IQ_MAX_M 4          /* activation rows per pass over the weights */
#define IQ_FMT_IQ3_XXS 0    /* iq_weight.fmt */
#define IQ_FMT_IQ2_XXS 1
#define IQ_FMT_IQ3_S 2      /* d | qs[64] | qh[8] | signs[32] | scales[4] */
#define IQ_FMT_IQ1_S 3      /* d | qs[32] | qh[8] (u16: 4 x 3 index bits | scale << 12 | sign) */
#define IQ_FMT_IQ2_XS 4     /* d | qs[32] (u16: 9-bit index | 7-bit ksigns index) | scales[8] */
#define IQ_FMT_IQ2_S 5      /* d | qs[32] | signs[32] | qh[8] (2 index bits a point) | scales[8] */
#define IQ_FMT_IQ1_M 6      /* qs[32] | qh[16] (2 x 3 index bits, sign) | scales[8] (d inside) */

void ss_q16_quantize_row(const float *x, int64_t k, int8_t *hi, int8_t *lo, float *dx,
                         float *sx);

/* A weight as IqLinear holds it; its first fields are the other kernels' (moe_ffn.c reads n
 * and k through them). */
typedef struct {
    const uint8_t *w;     /* n rows of k / 256 file blocks */
    int64_t n, k;
    int64_t fmt;          /* IQ_FMT_* */
    const uint8_t *grid;  /* gguf-py's grid: 256 points of 4 (IQ3_XXS) or 8 (IQ2_XXS) bytes,
                           * 512 of 4 (IQ3_S), 512 of 8 (IQ2_XS), 1024 of 8 (IQ2_S); IQ1_S
                           * and IQ1_M: 2048 of 8 int8, 8 x their -1, 0, 1 */
    const int8_t *signs;  /* gguf-py's 128 ksigns patterns as 8 bytes of +-1 each */
} iq_weight;

static int64_t iq_block_bytes(int64_t fmt) {
    static const int64_t bytes[] = {98, 66, 110, 50, 74, 82, 56};  /* by IQ_FMT_* */
    return bytes[fmt];
}

/* Whether fmt scales each 16 weights (IQ2_XS, IQ2_S, IQ1_M): their odd integer scales 1 + 2 l
 * then multiply the integer dots (iq_half_scales), the float scale is the block's d / 8. */
static inline int iq_halves(int64_t fmt) { return fmt >= IQ_FMT_IQ2_XS; }

static inline uint32_t iq_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static uint32_t iq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The block's float16 d as float: its first 2 bytes, or IQ1_M's, whose 16 bits are the top
 * nibbles of its 4 scale words (word j's bits 12-15 are d's bits 4j..4j+3). */
static inline float iq_block_d(int64_t fmt, const uint8_t *b) {
    if (fmt == IQ_FMT_IQ1_M) {
        const uint8_t *sc = b + 48;
        return f16_to_f32((uint16_t)(iq_u16(sc) >> 12 | (iq_u16(sc + 2) >> 8 & 0x00f0) |
                                     (iq_u16(sc + 4) >> 4 & 0x0f00) | (iq_u16(sc + 6) & 0xf000)));
    }
    return f16_to_f32((uint16_t)iq_u16(b));
}

/* Sub-block ib's two 16-weight integer scales 1 + 2 l (IQ2_XS and IQ2_S: l a nibble of byte ib,
 * low first; IQ1_M: 3 bits at 6 (ib % 2) and 6 (ib % 2) + 3 of scale word ib / 2); 1 and 1
 * for the formats with one scale per 32. */
static inline void iq_half_scales(int64_t fmt, const uint8_t *b, int ib, int *c0, int *c1) {
    if (fmt == IQ_FMT_IQ2_XS || fmt == IQ_FMT_IQ2_S) {
        const int byte = b[(fmt == IQ_FMT_IQ2_XS ? 66 : 74) + ib];
        *c0 = 1 + 2 * (byte & 15);
        *c1 = 1 + 2 * (byte >> 4);
    } else if (fmt == IQ_FMT_IQ1_M) {
        const uint32_t w = iq_u16(b + 48 + 2 * (ib / 2)) >> (6 * (ib & 1));
        *c0 = 1 + 2 * (int)(w & 7);
        *c1 = 1 + 2 * (int)(w >> 3 & 7);
    } else {
        *c0 = *c1 = 1;
    }
}

/* Sub-block ib's float scale (d the block's float16 as float): exact, as ggml forms it (for
 * IQ2_XS and IQ2_S ggml's d (0.5 + l) / 4 is d / 8 times iq_half_scales' 1 + 2 l; for IQ1_M
 * d (1 + 2 l) (g +- 1/8) is d / 8 times 1 + 2 l times 8 g +- 1). */
static inline float iq_scale(int64_t fmt, const uint8_t *b, int ib, float d) {
    if (iq_halves(fmt)) return d * 0.125f;
    if (fmt == IQ_FMT_IQ3_XXS) return d * (0.5f + (float)(iq_u32(b + 66 + 4 * ib) >> 28)) * 0.5f;
    if (fmt == IQ_FMT_IQ2_XXS) return d * (0.5f + (float)(iq_u32(b + 6 + 8 * ib) >> 28)) * 0.25f;
    if (fmt == IQ_FMT_IQ3_S) return d * (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib & 1))) & 15));
    return d * (float)(2 * ((iq_u16(b + 34 + 2 * ib) >> 12) & 7) + 1) * 0.125f;  /* IQ1_S */
}

/* IQ1_S sub-block ib's grid index of point l (0..3, 8 weights each): a qs byte, 3 qh bits. */
static inline int iq1s_index(const uint8_t *b, int ib, int l) {
    return b[2 + 4 * ib + l] | ((iq_u16(b + 34 + 2 * ib) >> (3 * l)) & 7) << 8;
}

/* IQ2_XS sub-block ib's point l (0..3): its 9-bit grid index and 7-bit ksigns index. */
static inline int iq2xs_index(const uint8_t *b, int ib, int l) {
    return (int)(iq_u16(b + 2 + 8 * ib + 2 * l) & 511);
}

static inline int iq2xs_sign(const uint8_t *b, int ib, int l) {
    return (int)(iq_u16(b + 2 + 8 * ib + 2 * l) >> 9);
}

/* IQ2_S sub-block ib's grid index of point l (0..3): a qs byte and 2 bits of qh byte ib. */
static inline int iq2s_index(const uint8_t *b, int ib, int l) {
    return b[2 + 4 * ib + l] | ((b[66 + ib] >> (2 * l)) & 3) << 8;
}

/* IQ1_M sub-block ib's point l (0..3): its qh nibble (3 index bits, the shift's sign at 8). */
static inline int iq1m_nibble(const uint8_t *b, int ib, int l) {
    return (b[32 + 2 * ib + (l >> 1)] >> (4 * (l & 1))) & 15;
}

static inline int iq1m_index(const uint8_t *b, int ib, int l) {
    return b[4 * ib + l] | (iq1m_nibble(b, ib, l) & 7) << 8;
}

/* IQ3_S sub-block ib's grid index of point p (0..7): a qs byte and a ninth bit from qh. */
static inline int iq3s_index(const uint8_t *b, int ib, int p) {
    return b[2 + 8 * ib + p] | ((b[66 + ib] >> p) & 1) << 8;
}

/* Sub-block ib's 32 signed grid values and its float scale, of the block at b (its integer
 * 16-weight scales: iq_half_scales). */
static inline void iq_sub(const iq_weight *wd, const uint8_t *b, int ib, int8_t *v, float *s) {
    const float d = iq_block_d(wd->fmt, b);
    if (iq_halves(wd->fmt)) *s = iq_scale(wd->fmt, b, ib, d);
    if (wd->fmt == IQ_FMT_IQ2_XS) {
        for (int l = 0; l < 4; l++) {
            const int8_t *sg = wd->signs + 8 * iq2xs_sign(b, ib, l);
            const uint8_t *g = wd->grid + 8 * iq2xs_index(b, ib, l);
            for (int j = 0; j < 8; j++) v[8 * l + j] = (int8_t)(g[j] * sg[j]);
        }
    } else if (wd->fmt == IQ_FMT_IQ2_S) {  /* plain sign bytes, bit j for weight j */
        for (int l = 0; l < 4; l++) {
            const int neg = b[34 + 4 * ib + l];
            const uint8_t *g = wd->grid + 8 * iq2s_index(b, ib, l);
            for (int j = 0; j < 8; j++) {  /* (g ^ -s) + s: -g where s = 1, branch-free */
                const int sj = neg >> j & 1;
                v[8 * l + j] = (int8_t)((g[j] ^ -sj) + sj);
            }
        }
    } else if (wd->fmt == IQ_FMT_IQ1_M) {  /* 8 g +- 1: the shift's sign one bit a point */
        for (int l = 0; l < 4; l++) {
            const int8_t *g = (const int8_t *)wd->grid + 8 * iq1m_index(b, ib, l);
            const int delta = (iq1m_nibble(b, ib, l) & 8) ? -1 : 1;
            for (int j = 0; j < 8; j++) v[8 * l + j] = (int8_t)(g[j] + delta);
        }
    } else if (wd->fmt == IQ_FMT_IQ3_XXS) {
        const uint8_t *qs = b + 2 + 8 * ib;
        const uint32_t aux = iq_u32(b + 66 + 4 * ib);
        *s = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            const int8_t *sg = wd->signs + 8 * ((aux >> (7 * l)) & 127);
            const uint8_t *g0 = wd->grid + 4 * qs[2 * l], *g1 = wd->grid + 4 * qs[2 * l + 1];
            for (int j = 0; j < 4; j++) {
                v[8 * l + j] = (int8_t)(g0[j] * sg[j]);
                v[8 * l + 4 + j] = (int8_t)(g1[j] * sg[4 + j]);
            }
        }
    } else if (wd->fmt == IQ_FMT_IQ1_S) {  /* w = s (8 g +- 1): the shift's sign in bit 15 */
        const int delta = (iq_u16(b + 34 + 2 * ib) & 0x8000) ? -1 : 1;
        *s = iq_scale(IQ_FMT_IQ1_S, b, ib, d);
        for (int l = 0; l < 4; l++) {
            const int8_t *g = (const int8_t *)wd->grid + 8 * iq1s_index(b, ib, l);
            for (int j = 0; j < 8; j++) v[8 * l + j] = (int8_t)(g[j] + delta);
        }
    } else if (wd->fmt == IQ_FMT_IQ3_S) {  /* plain sign bits: bit i for weight i */
        const uint32_t neg = iq_u32(b + 74 + 4 * ib);
        *s = iq_scale(IQ_FMT_IQ3_S, b, ib, d);
        for (int p = 0; p < 8; p++) {
            const uint8_t *g = wd->grid + 4 * iq3s_index(b, ib, p);
            for (int j = 0; j < 4; j++)
                v[4 * p + j] = (int8_t)((neg >> (4 * p + j) & 1) ? -g[j] : g[j]);
        }
    } else {
        const uint8_t *q2 = b + 2 + 8 * ib;
        const uint32_t aux = iq_u32(q2 + 4);
        *s = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) {
            const int8_t *sg = wd->signs + 8 * ((aux >> (7 * l)) & 127);
            const uint8_t *g = wd->grid + 8 * q2[l];
            for (int j = 0; j < 8; j++) v[8 * l + j] = (int8_t)(g[j] * sg[j]);
        }
    }
}

/* The 8 lanes' fixed reduction (the AVX2 loop's: high half onto low, then movehl, then 1). */
static inline float iq_reduce8(const float *a) {
    const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
    return (t0 + t2) + (t1 + t3);
}

/* Row `row`'s outputs for M activation rows (q: 2k digits a row, high then low; dx: G a row). */
static inline __attribute__((always_inline)) void iq_row_generic(
        const iq_weight *wd, int64_t row, const int8_t *q, const float *dx, float *out,
        const int M) {
    const int64_t k = wd->k, nb = k / IQ_BLOCK, G = k / IQ_SUB, bb = iq_block_bytes(wd->fmt);
    const uint8_t *r = wd->w + row * nb * bb;
    float acc[IQ_MAX_M][8];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nb; b++) {
        for (int ib = 0; ib < 8; ib++) {
            int8_t v[IQ_SUB];
            float s;
            int c[2];
            iq_sub(wd, r + b * bb, ib, v, &s);
            iq_half_scales(wd->fmt, r + b * bb, ib, &c[0], &c[1]);
            const int64_t g = 8 * b + ib;
            for (int m = 0; m < M; m++) {
                const int8_t *xh = q + m * 2 * k + g * IQ_SUB, *xl = xh + k;
                int32_t hs = 0, ls = 0;
                for (int h = 0; h < 2; h++) {  /* each 16 weights' sums times their scale */
                    int32_t hh = 0, lh = 0;
                    for (int i = 16 * h; i < 16 * h + 16; i++) {
                        hh += v[i] * xh[i];
                        lh += v[i] * xl[i];
                    }
                    hs += c[h] * hh;
                    ls += c[h] * lh;
                }
                acc[m][ib] = fmaf((float)(hs * 256 + ls) * dx[m * G + g], s, acc[m][ib]);
            }
        }
    }
    for (int m = 0; m < M; m++) out[m] = iq_reduce8(acc[m]);
}

#if IQ_AVX2
/* v (32 signed values) . x (32 digits) into 8 int32 lanes (see the header): lanes 0-3 the
 * first 16 weights', 4-7 the second 16's. */
static inline __m256i iq_dot32(__m256i v, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(v, xv));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* 8 vectors' lane sums as one vector: [sum S0, ..., sum S7]. With c (IQ2_XS, IQ2_S, IQ1_M;
 * else NULL): the tree's second level holds each sub-block's two 16-weight sums apart (ab:
 * S0..S3's first halves, then their second; cd: S4..S7's), so they are multiplied there by
 * their integer scales (c[0] for ab, c[1] for cd, as iq_half_lanes lays them out): 2
 * multiplies a block rather than one a sub-block. Exact: |S| < 2^31 (see the header). */
static inline __m256i iq_hsum8(const __m256i *S, const __m256i *c) {
    const __m256i a = _mm256_hadd_epi32(S[0], S[1]), b = _mm256_hadd_epi32(S[2], S[3]);
    const __m256i c4 = _mm256_hadd_epi32(S[4], S[5]), d = _mm256_hadd_epi32(S[6], S[7]);
    __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c4, d);
    if (c != NULL) {
        ab = _mm256_mullo_epi32(ab, c[0]);
        cd = _mm256_mullo_epi32(cd, c[1]);
    }
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* A block's 16 integer scales 1 + 2 l (iq_half_scales') in iq_hsum8's order: c[0] =
 * sub-blocks 0-3's first-half scales, then their second-half ones; c[1] the same of
 * sub-blocks 4-7. Made in vectors from the scale fields: gathered from iq_half_scales through
 * two int arrays instead, 1024 x 4096 IQ2_XS took 0.90 ms a call against 0.77 (one thread). */
static inline void iq_half_lanes(int64_t fmt, const uint8_t *b, __m256i *c) {
    __m128i lo4, hi4;  /* the 4 sub-blocks' fields, one an int32 lane */
    __m256i shift, mask;
    if (fmt == IQ_FMT_IQ1_M) {  /* sub-block ib: bits 6 (ib % 2) .. + 5 of word ib / 2 */
        const __m128i w = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(b + 48)));
        lo4 = _mm_unpacklo_epi32(w, w);
        hi4 = _mm_unpackhi_epi32(w, w);
        shift = _mm256_setr_epi32(0, 6, 0, 6, 3, 9, 3, 9);
        mask = _mm256_set1_epi32(7);
    } else {  /* IQ2_XS, IQ2_S: byte ib, low nibble then high */
        const __m128i v = _mm_loadl_epi64((const __m128i *)(b + (fmt == IQ_FMT_IQ2_XS ? 66 : 74)));
        lo4 = _mm_cvtepu8_epi32(v);
        hi4 = _mm_cvtepu8_epi32(_mm_srli_si128(v, 4));
        shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
        mask = _mm256_set1_epi32(15);
    }
    const __m256i one = _mm256_set1_epi32(1);
    c[0] = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set_m128i(lo4, lo4), shift), mask), 1), one);
    c[1] = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set_m128i(hi4, hi4), shift), mask), 1), one);
}

/* Sub-block ib's 32 signed values as a vector: the points gathered, the signs applied. */
static inline __m256i iq_sub_avx2(const iq_weight *wd, const uint8_t *b, int ib) {
    const int8_t *S = wd->signs;
    int64_t s0, s1, s2, s3;
    __m256i g;
    uint32_t aux;
    if (wd->fmt == IQ_FMT_IQ1_M) {  /* 8 g + the point's +-1 (0x01 or 0xff in each byte) */
        const uint64_t *G = (const uint64_t *)wd->grid;
        /* point l's shift sign: bit 4 l + 3 of the sub-block's 2 qh bytes, tested in 64-bit
         * lane l of the 16-bit word broadcast */
        const __m256i bit = _mm256_setr_epi64x(0x0008000800080008ll, 0x0080008000800080ll,
                                               0x0800080008000800ll,
                                               (int64_t)0x8000800080008000ull);
        const __m256i neg = _mm256_cmpeq_epi16(
            _mm256_and_si256(_mm256_set1_epi16((short)iq_u16(b + 32 + 2 * ib)), bit), bit);
        g = _mm256_set_epi64x((int64_t)G[iq1m_index(b, ib, 3)], (int64_t)G[iq1m_index(b, ib, 2)],
                              (int64_t)G[iq1m_index(b, ib, 1)], (int64_t)G[iq1m_index(b, ib, 0)]);
        return _mm256_add_epi8(g, _mm256_or_si256(neg, _mm256_set1_epi8(1)));
    }
    if (wd->fmt == IQ_FMT_IQ1_S) {
        const uint64_t *G = (const uint64_t *)wd->grid;
        g = _mm256_set_epi64x((int64_t)G[iq1s_index(b, ib, 3)], (int64_t)G[iq1s_index(b, ib, 2)],
                              (int64_t)G[iq1s_index(b, ib, 1)], (int64_t)G[iq1s_index(b, ib, 0)]);
        return _mm256_add_epi8(g, _mm256_set1_epi8(
            (iq_u16(b + 34 + 2 * ib) & 0x8000) ? (char)-1 : (char)1));
    }
    if (wd->fmt == IQ_FMT_IQ3_S || wd->fmt == IQ_FMT_IQ2_S) {
        if (wd->fmt == IQ_FMT_IQ3_S) {
            const uint32_t *G = (const uint32_t *)wd->grid;
            g = _mm256_set_epi32((int)G[iq3s_index(b, ib, 7)], (int)G[iq3s_index(b, ib, 6)],
                                 (int)G[iq3s_index(b, ib, 5)], (int)G[iq3s_index(b, ib, 4)],
                                 (int)G[iq3s_index(b, ib, 3)], (int)G[iq3s_index(b, ib, 2)],
                                 (int)G[iq3s_index(b, ib, 1)], (int)G[iq3s_index(b, ib, 0)]);
        } else {
            const uint64_t *G = (const uint64_t *)wd->grid;
            g = _mm256_set_epi64x((int64_t)G[iq2s_index(b, ib, 3)],
                                  (int64_t)G[iq2s_index(b, ib, 2)],
                                  (int64_t)G[iq2s_index(b, ib, 1)],
                                  (int64_t)G[iq2s_index(b, ib, 0)]);
        }
        /* byte i of the sign word's bit i % 8 of byte i / 8, as +-1 (llama.cpp's way) */
        const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)iq_u32(b + (wd->fmt == IQ_FMT_IQ3_S ? 74 : 34) + 4 * ib)),
            _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll,
                               0x0303030303030303ll));
        const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        return _mm256_sign_epi8(g, _mm256_or_si256(neg, _mm256_set1_epi8(1)));
    }
    if (wd->fmt == IQ_FMT_IQ3_XXS) {
        const uint8_t *qs = b + 2 + 8 * ib;
        const uint32_t *G = (const uint32_t *)wd->grid;
        aux = iq_u32(b + 66 + 4 * ib);
        g = _mm256_set_epi32((int)G[qs[7]], (int)G[qs[6]], (int)G[qs[5]], (int)G[qs[4]],
                             (int)G[qs[3]], (int)G[qs[2]], (int)G[qs[1]], (int)G[qs[0]]);
    } else if (wd->fmt == IQ_FMT_IQ2_XS) {  /* the 4 points' 7-bit sign indices as one word */
        const uint64_t *G = (const uint64_t *)wd->grid;
        aux = 0;
        for (int l = 0; l < 4; l++) aux |= (uint32_t)iq2xs_sign(b, ib, l) << (7 * l);
        g = _mm256_set_epi64x((int64_t)G[iq2xs_index(b, ib, 3)], (int64_t)G[iq2xs_index(b, ib, 2)],
                              (int64_t)G[iq2xs_index(b, ib, 1)], (int64_t)G[iq2xs_index(b, ib, 0)]);
    } else {
        const uint8_t *q2 = b + 2 + 8 * ib;
        const uint64_t *G = (const uint64_t *)wd->grid;
        aux = iq_u32(q2 + 4);
        g = _mm256_set_epi64x((int64_t)G[q2[3]], (int64_t)G[q2[2]], (int64_t)G[q2[1]],
                              (int64_t)G[q2[0]]);
    }
    memcpy(&s0, S + 8 * (aux & 127), 8);
    memcpy(&s1, S + 8 * ((aux >> 7) & 127), 8);
    memcpy(&s2, S + 8 * ((aux >> 14) & 127), 8);
    memcpy(&s3, S + 8 * ((aux >> 21) & 127), 8);
    return _mm256_sign_epi8(g, _mm256_set_epi64x(s3, s2, s1, s0));
}

static inline __attribute__((always_inline)) void iq_row_avx2(
        const iq_weight *wd, int64_t row, const int8_t *q, const float *dx, float *out,
        const int M) {
    const int64_t k = wd->k, nb = k / IQ_BLOCK, G = k / IQ_SUB, bb = iq_block_bytes(wd->fmt);
    const uint8_t *r = wd->w + row * nb * bb;
    __m256 acc[IQ_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = r + b * bb;
        __m256i v[8], c[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        float sc[8];
        const float d = iq_block_d(wd->fmt, blk);
        const int halves = iq_halves(wd->fmt);
        for (int ib = 0; ib < 8; ib++) {
            v[ib] = iq_sub_avx2(wd, blk, ib);
            sc[ib] = iq_scale(wd->fmt, blk, ib, d);
        }
        if (halves) iq_half_lanes(wd->fmt, blk, c);
        const __m256 s = _mm256_loadu_ps(sc);
        for (int m = 0; m < M; m++) {
            const int8_t *xh = q + m * 2 * k + b * IQ_BLOCK, *xl = xh + k;
            __m256i S[8];
            for (int ib = 0; ib < 8; ib++)
                S[ib] = _mm256_add_epi32(_mm256_slli_epi32(iq_dot32(v[ib], xh + IQ_SUB * ib), 8),
                                         iq_dot32(v[ib], xl + IQ_SUB * ib));
            const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(iq_hsum8(S, halves ? c : NULL)),
                                              _mm256_loadu_ps(dx + m * G + 8 * b));
            acc[m] = _mm256_fmadd_ps(prod, s, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float a[8];
        _mm256_storeu_ps(a, acc[m]);
        out[m] = iq_reduce8(a);
    }
}
#endif

#if IQ_VNNI
/* A sub-block's 32 sign bits (bit i: weight i negative) from its word's four 7-bit ksigns
 * indices: each index in a byte (pdep), bit 7 the parity of its 7 bits (ksigns' rule). */
static inline __mmask32 iq_sign_mask(uint32_t aux) {
    const uint32_t f = (uint32_t)_pdep_u32(aux, 0x7f7f7f7fu);
    uint32_t p = f ^ (f >> 4);
    p ^= p >> 2;
    p ^= p >> 1;  /* bit 0 of each byte: the parity of that byte */
    return _cvtu32_mask32(f | (p & 0x01010101u) << 7);
}

/* iq_row_avx2 with VNNI: the grid's unsigned points times the digits with the weights' signs
 * (digits in base 255, |digit| <= 127, so negating one never overflows), vpdpbusd into int32
 * lanes; S = 255 A_hi + A_lo, the same exact integers, then the same float steps. */
static inline __attribute__((always_inline)) void iq_row_vnni(
        const iq_weight *wd, int64_t row, const int8_t *q, const float *dx, float *out,
        const int M) {
    const int64_t k = wd->k, nb = k / IQ_BLOCK, G = k / IQ_SUB, bb = iq_block_bytes(wd->fmt);
    const int fmt = (int)wd->fmt, halves = iq_halves(fmt);
    const uint8_t *r = wd->w + row * nb * bb;
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc[IQ_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = r + b * bb;
        __m256i g[8], c[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        __mmask32 neg[8];
        float sc[8];
        const float d = iq_block_d(fmt, blk);
        if (halves) iq_half_lanes(fmt, blk, c);
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux;
            if (fmt == IQ_FMT_IQ2_S) {
                const uint64_t *P = (const uint64_t *)wd->grid;
                g[ib] = _mm256_set_epi64x(
                    (int64_t)P[iq2s_index(blk, ib, 3)], (int64_t)P[iq2s_index(blk, ib, 2)],
                    (int64_t)P[iq2s_index(blk, ib, 1)], (int64_t)P[iq2s_index(blk, ib, 0)]);
                neg[ib] = _cvtu32_mask32(iq_u32(blk + 34 + 4 * ib));
                sc[ib] = iq_scale(fmt, blk, ib, d);
                continue;
            }
            if (fmt == IQ_FMT_IQ3_S) {
                const uint32_t *P = (const uint32_t *)wd->grid;
                g[ib] = _mm256_set_epi32(
                    (int)P[iq3s_index(blk, ib, 7)], (int)P[iq3s_index(blk, ib, 6)],
                    (int)P[iq3s_index(blk, ib, 5)], (int)P[iq3s_index(blk, ib, 4)],
                    (int)P[iq3s_index(blk, ib, 3)], (int)P[iq3s_index(blk, ib, 2)],
                    (int)P[iq3s_index(blk, ib, 1)], (int)P[iq3s_index(blk, ib, 0)]);
                neg[ib] = _cvtu32_mask32(iq_u32(blk + 74 + 4 * ib));
                sc[ib] = iq_scale(fmt, blk, ib, d);
                continue;
            }
            if (fmt == IQ_FMT_IQ3_XXS) {
                const uint8_t *qs = blk + 2 + 8 * ib;
                const uint32_t *P = (const uint32_t *)wd->grid;
                aux = iq_u32(blk + 66 + 4 * ib);
                g[ib] = _mm256_set_epi32((int)P[qs[7]], (int)P[qs[6]], (int)P[qs[5]],
                                         (int)P[qs[4]], (int)P[qs[3]], (int)P[qs[2]],
                                         (int)P[qs[1]], (int)P[qs[0]]);
            } else if (fmt == IQ_FMT_IQ2_XS) {  /* 4 words: 9 index bits, 7 ksigns bits */
                const uint64_t *P = (const uint64_t *)wd->grid;
                uint64_t q;
                memcpy(&q, blk + 2 + 8 * ib, 8);
                aux = (uint32_t)_pext_u64(q, 0xfe00fe00fe00fe00ull);
                g[ib] = _mm256_set_epi64x((int64_t)P[q >> 48 & 511], (int64_t)P[q >> 32 & 511],
                                          (int64_t)P[q >> 16 & 511], (int64_t)P[q & 511]);
            } else {
                const uint8_t *q2 = blk + 2 + 8 * ib;
                const uint64_t *P = (const uint64_t *)wd->grid;
                aux = iq_u32(q2 + 4);
                g[ib] = _mm256_set_epi64x((int64_t)P[q2[3]], (int64_t)P[q2[2]],
                                          (int64_t)P[q2[1]], (int64_t)P[q2[0]]);
            }
            neg[ib] = iq_sign_mask(aux);
            sc[ib] = iq_scale(fmt, blk, ib, d);
        }
        const __m256 s = _mm256_loadu_ps(sc);
        for (int m = 0; m < M; m++) {
            const int8_t *xh = q + m * 2 * k + b * IQ_BLOCK, *xl = xh + k;
            __m256i S[8];
            for (int ib = 0; ib < 8; ib++) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(xh + IQ_SUB * ib));
                const __m256i l = _mm256_loadu_si256((const __m256i *)(xl + IQ_SUB * ib));
                const __m256i ah = _mm256_dpbusd_epi32(
                    zero, g[ib], _mm256_mask_sub_epi8(h, neg[ib], zero, h));
                const __m256i al = _mm256_dpbusd_epi32(
                    zero, g[ib], _mm256_mask_sub_epi8(l, neg[ib], zero, l));
                S[ib] = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(ah, 8), ah), al);
            }
            const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(iq_hsum8(S, halves ? c : NULL)),
                                              _mm256_loadu_ps(dx + m * G + 8 * b));
            acc[m] = _mm256_fmadd_ps(prod, s, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float a[8];
        _mm256_storeu_ps(a, acc[m]);
        out[m] = iq_reduce8(a);
    }
}
#endif

#define IQ_X_F32 1    /* flags: x is float32 (else bfloat16); as q4_matvec.c's */
#define IQ_Y_F32 2    /* y is float32 (else bfloat16) */
#define IQ_GENERIC 4  /* the plain-C loop even where a vector loop is compiled in (tests) */
#define IQ_USE_AVX2 16  /* the AVX2 loop even where the VNNI one is compiled in (tests) */
#define IQ_THREADS_SHIFT 8

typedef struct {
    const iq_weight *wd;
    int64_t m;
    int y_f32, path;  /* path: 0 the best compiled loop, 1 plain C, 2 AVX2 */
    const int8_t *q;
    const float *dx;
    void *y;
} iq_job;

static inline __attribute__((always_inline)) void iq_rows(const iq_job *j, int64_t r0,
                                                         int64_t r1, int64_t m0, const int M) {
    const int64_t k = j->wd->k, n = j->wd->n, G = k / IQ_SUB;
    const int8_t *q = j->q + m0 * 2 * k;
    const float *dx = j->dx + m0 * G;
    for (int64_t row = r0; row < r1; row++) {
        float out[IQ_MAX_M];
#if IQ_VNNI
        if (j->path == 0) iq_row_vnni(j->wd, row, q, dx, out, M);
        else
#endif
#if IQ_AVX2
        if (j->path != 1) iq_row_avx2(j->wd, row, q, dx, out, M);
        else
#endif
        iq_row_generic(j->wd, row, q, dx, out, M);
        for (int m = 0; m < M; m++) {
            if (j->y_f32) ((float *)j->y)[(m0 + m) * n + row] = out[m];
            else ((uint16_t *)j->y)[(m0 + m) * n + row] = f32_to_bf16(out[m]);
        }
    }
}

static void iq_run_part(const void *job, int part, int parts) {
    const iq_job *j = job;
    const int64_t n = j->wd->n, r0 = n * part / parts, r1 = n * (part + 1) / parts;
    for (int64_t m0 = 0; m0 < j->m; m0 += IQ_MAX_M) {
        switch (j->m - m0 < IQ_MAX_M ? j->m - m0 : IQ_MAX_M) {
        case 1: iq_rows(j, r0, r1, m0, 1); break;
        case 2: iq_rows(j, r0, r1, m0, 2); break;
        case 3: iq_rows(j, r0, r1, m0, 3); break;
        default: iq_rows(j, r0, r1, m0, 4); break;
        }
    }
}

/* y (m, n) = x (m, k) @ W^T for W (n, k) in file rows of an IQ_FMT_* format; x and y rows
 * contiguous; k a multiple of 256. */
void ss_iq_matvec(const iq_weight *wd, const void *x, void *y, int64_t m, int64_t flags) {
    const int64_t n = wd->n, k = wd->k, G = k / IQ_SUB;
    size_t fbytes = (size_t)k * sizeof(float);
    size_t qbytes = (size_t)(m * k * 2 + 63) / 64 * 64;
    char *scratch = malloc(fbytes + qbytes + 2 * (size_t)(m * G) * sizeof(float));
    if (scratch == NULL) return;  /* the caller's output stays as it was */
    float *xf = (float *)scratch;
    int8_t *q = (int8_t *)(scratch + fbytes);
    float *dx = (float *)(scratch + fbytes + qbytes), *sx = dx + m * G;
    for (int64_t r = 0; r < m; r++) {
        const float *row = row_as_f32(x, r, k, (flags & IQ_X_F32) != 0, xf);
        int8_t *qr = q + r * k * 2;
        ss_q16_quantize_row(row, k, qr, qr + k, dx + r * G, sx + r * G);
    }
    int path = (flags & IQ_GENERIC) ? 1 : (flags & IQ_USE_AVX2) && IQ_AVX2 ? 2 : 0;
    if (path == 0 && (wd->fmt == IQ_FMT_IQ1_S || wd->fmt == IQ_FMT_IQ1_M) && IQ_AVX2)
        path = 2;  /* signed grid: no VNNI loop */
    int8_t *qv = q;
#if IQ_VNNI
    if (path == 0) {  /* the VNNI loop's digits: X = 255 h + l, |h|, |l| <= 127 */
        qv = malloc(qbytes);
        if (qv == NULL) {
            free(scratch);
            return;
        }
        for (int64_t r = 0; r < m; r++) {
            const int8_t *hi = q + r * k * 2, *lo = hi + k;
            int8_t *h2 = qv + r * k * 2, *l2 = h2 + k;
            for (int64_t i = 0; i < k; i++) {
                const int32_t X = 256 * hi[i] + lo[i];
                const int32_t h = (X + (X >= 0 ? 127 : -127)) / 255;
                h2[i] = (int8_t)h;
                l2[i] = (int8_t)(X - 255 * h);
            }
        }
    }
#endif
    iq_job j = {wd, m, (flags & IQ_Y_F32) != 0, path, qv, dx, y};
    int64_t threads = flags >> IQ_THREADS_SHIFT;
    if (threads > n / 16) threads = n / 16;  /* at least 16 rows a thread */
    ss_parallel(iq_run_part, &j, threads < 1 ? 1 : (int)threads, n);
    if (qv != q) free(qv);
    free(scratch);
}

/* Which loops this build has: 1 VNNI, 2 AVX2 (bits; 0: plain C alone). */
int ss_iq_loops(void) { return IQ_VNNI | IQ_AVX2 << 1; }
