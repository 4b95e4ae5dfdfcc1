/* 4-bit (and 8-bit) weights times integer-quantized activations: the CPU decode matmul of the
 * q4vnni and q8vnni kinds (weights/cpu/vnni.py, Q4VnniLinear, Q8VnniLinear).
 *
 * Why: torch's int4 CPU kernel widens every code to bfloat16 and multiplies in floats, and is
 * compute-bound on a small machine. Quantizing the activation row once per call to 16-bit
 * integers held as two int8 digits (blocks of 32, one float scale each) turns each 32-group's dot
 * product into integer multiply-adds, 64 at a time with AVX-512 VNNI (vpdpbusd: unsigned bytes x
 * signed bytes, summed four by four into int32 lanes), and the float work into a few operations
 * per group.
 *
 * Math. A weight row's group g (32 columns) is w = s_g * u + z_g with u in [0, 15] (Q4_0:
 * s = d, z = -8 d; Q4_1: s = d, z = m; Q4_K: s = d sc_j, z = -dmin m_j; Q8_0's 8-bit codes:
 * u = q + 128 in [0, 255], s = d, z = -128 d). The activation's block
 * g is x ~ dx_g * X with X = round(x / dx_g) in [-32512, 32512], dx_g = max|x| / 32512 (see
 * ss_q4_matvec for the two digits). Then
 *     sum_g (s_g * (dx_g * sum(u X)) + z_g * (dx_g * sum(X)))
 * where both integer sums are exact. The min term uses the quantized block's sum, not x's own:
 * then the error is w . (x - dx X) with w centred on zero, rather than (s u) . (x - dx X) with
 * u's mean of ~7.5 left in, about four times the variance.
 *
 * Layout (made by Q4VnniLinear.from_raws): rows in blocks of 16 (the last one padded with zero
 * rows), each block's groups one after another, each group a record of
 *     Q4_F16: 256 bytes of codes | s[16] | z[16]   (float16)
 *     Q4_F32: 256 bytes of codes | s[16] | z[16]   (float32: Q4_K's d sc is not a float16)
 *     Q8_F16: 512 bytes of codes | s[16]           (float16; Q8_0: u = q + 128, z = -128 s)
 *     Q8_F32: 512 bytes of codes | s[16] | z[16]   (float32: Q5_1's and Q5_K's 5-bit codes,
 *             u = q in [0, 31], with their mins; Q5_K's d sc is not a float16)
 *     Q4_KS:  Q4_K's own scales, in runs of 8 groups behind a header (see Q4_KS below)
 * 4-bit codes: those of row r, columns 4j..4j+3 of the group (j = 0..7), are bytes 4r..4r+3 of
 * chunk j % 4 (64 bytes each), in the low nibbles for j < 4 and the high ones for j >= 4. So one
 * 64-byte load and two masks (one after a shift) give two vectors in which lane r holds 4 codes
 * of row r, and each vpdpbusd against 4 activation bytes broadcast to every lane advances 16 rows
 * by 4 columns: lane r ends up with row r's whole group sum, and the group's 16 scales are one
 * vector load, so no horizontal sums are needed. 8-bit codes: chunk j (64 bytes) holds columns
 * 4j..4j+3, bytes 4r..4r+3 for row r, each code as an unsigned byte.
 *
 * Rows are split across threads by blocks (OpenMP, below; the calling thread quantizes x
 * first). A row of x gives the same bits whatever the other rows of its call and the thread
 * count: each output element is computed by one thread in a fixed order.
 *
 * Without AVX-512 VNNI, AVX2 (q4_block_avx2: vpmaddubsw, 8 rows a vector) runs the same layout
 * and the same float operations in the same order; without either, plain C (q4_block_generic).
 * The integer sums are exact in all three, so all three give the same bits.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "half.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_VNNI 1
#define Q4_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_VNNI 0
#define Q4_AVX2 1
#include <immintrin.h>
#else
#define Q4_VNNI 0
#define Q4_AVX2 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define Q4_ROWS 16     /* rows per block: one 32-bit lane of a 512-bit vector each */
#define Q4_GROUP 32    /* columns per scale (GGUF's 4-bit formats all use 32) */
#define Q4_MAX_M 4     /* activation rows multiplied per pass over the weights */

/* the record formats (q4_weight.fmt) */
#define Q4_F16 0
#define Q4_F32 1
#define Q8_F16 2
#define Q4_KS 3
#define Q8_F32 4
#define Q4_IS_Q8(f) ((f) == Q8_F16 || (f) == Q8_F32)  /* 8-bit codes, 512 bytes a record */
#define Q4_IS_F32(f) ((f) == Q4_F32 || (f) == Q8_F32)  /* float32 s[16] and z[16] */

/* Q4_KS: Q4_K's own scales, 4.625 bits a weight against Q4_F32's 6, the same bits. A block's
 * groups go in runs of 8 (a Q4_K super-block), each run a header of d[16] and dmin[16]
 * (float16, the file's), then sc[8][16] and mn[8][16] (each group's 6-bit scales and mins as
 * bytes), 320 bytes, then the 8 groups' 256 bytes of codes: every load stays within 64-byte
 * lines (a first layout with each group's scales after its codes put every other group's
 * codes 32 bytes off a line). s = d sc and z = -dmin mn are products of a float16 and a 6-bit
 * integer, exact in float32: Q4_F32's stored values, so the same sums and the same bits, from
 * 23% fewer bytes for a CPU share that shares host memory with the copy engine. */
#define Q4_KS_RUN 8
#define Q4_KS_HEADER (4 * Q4_ROWS + 2 * Q4_KS_RUN * Q4_ROWS)
#define Q4_KS_RUN_BYTES (Q4_KS_HEADER + Q4_KS_RUN * 256)

static inline int64_t q4_code_bytes(int fmt) { return Q4_IS_Q8(fmt) ? 512 : 256; }

/* Bytes a group takes in a block (Q4_KS: its share of a run, header included). */
static inline int64_t q4_record_bytes(int fmt) {
    return fmt == Q4_F16 ? 256 + 64 : fmt == Q4_F32 ? 256 + 128 : fmt == Q8_F16 ? 512 + 32
           : fmt == Q8_F32 ? 512 + 128
           : Q4_KS_RUN_BYTES / Q4_KS_RUN;
}

/* Group g's record in a block (Q4_KS: its codes). */
static inline const uint8_t *q4_record(const uint8_t *blk, int64_t g, const int fmt) {
    if (fmt == Q4_KS)
        return blk + (g / Q4_KS_RUN) * Q4_KS_RUN_BYTES + Q4_KS_HEADER + (g % Q4_KS_RUN) * 256;
    return blk + g * q4_record_bytes(fmt);
}

/* Q4_KS: the header (d[16] then dmin[16]) of the run holding group g's codes p. */
static inline const uint16_t *q4_ks_header(const uint8_t *p, int64_t g) {
    return (const uint16_t *)(p - (g % Q4_KS_RUN) * 256 - Q4_KS_HEADER);
}

/* Q4_KS: group g's 16 scales (its 16 mins are Q4_KS_MINS further on). */
static inline const uint8_t *q4_ks_scales(const uint8_t *p, int64_t g) {
    return (const uint8_t *)q4_ks_header(p, g) + 4 * Q4_ROWS + (g % Q4_KS_RUN) * Q4_ROWS;
}
#define Q4_KS_MINS (Q4_KS_RUN * Q4_ROWS)

#define Q4_X_TOP 32512.0f  /* 127 * 256: the largest |X| two int8 digits hold */

#if Q4_VNNI
/* q4_quantize_row's block for a finite nonzero scale d: X = round-half-even(x / d) clamped to
 * +-Q4_X_TOP, its two digits and sx = d sum(X), with the scalar loop's operations (an IEEE
 * division, nearbyint's rounding, exact integer sums), so the same bits. The scalar loop took
 * 15-23 ns an element on the 2-core EPYC: a prefill's expert products (4096 rows of 768 a
 * Qwen3-30B-A3B layer at pp512) spent ~70 ms a layer quantizing. */
static inline void q4_quantize_block_avx512(const float *xb, float d, int8_t *q, int8_t *lo,
                                            float *sx) {
    const __m512 vd = _mm512_set1_ps(d), top = _mm512_set1_ps(Q4_X_TOP);
    const __m512 ntop = _mm512_set1_ps(-Q4_X_TOP);
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < Q4_GROUP; h += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xb + h), vd),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, ntop, _CMP_LT_OQ), v, ntop);
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, top, _CMP_GT_OQ), v, top);
        __m512i X = _mm512_cvttps_epi32(v);
        sum = _mm512_add_epi32(sum, X);
        __m512i l = _mm512_sub_epi32(
            _mm512_and_si512(_mm512_add_epi32(X, _mm512_set1_epi32(128)), _mm512_set1_epi32(0xff)),
            _mm512_set1_epi32(128));
        __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(X, l), 8);  /* exact: a multiple of 256 */
        _mm_storeu_si128((__m128i *)(lo + h), _mm512_cvtepi32_epi8(l));
        _mm_storeu_si128((__m128i *)(q + h), _mm512_cvtepi32_epi8(hi));
    }
    *sx = d * (float)_mm512_reduce_add_epi32(sum);
}
#endif

/* One activation row of k floats, per block of 32: dx = max|x| / Q4_X_TOP,
 * X = round-half-even(x / dx) clamped to [-Q4_X_TOP, Q4_X_TOP], sx = dx * sum(X); an all-zero
 * block gets dx = 0 and X = 0. X is split into two int8 digits, X = 256 hi + lo with lo in
 * [-128, 127] and hi in [-127, 127], stored as q = hi and lo. */
static void q4_quantize_row(const float *x, int64_t k, int8_t *q, int8_t *lo, float *dx,
                            float *sx) {
    const float top = Q4_X_TOP;
    for (int64_t g = 0; g < k / Q4_GROUP; g++) {
        const float *xb = x + g * Q4_GROUP;
        float amax = 0.0f;
#if Q4_VNNI
        {  /* the largest |x|, or NaN where the block holds one (as the loop below) */
            __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb));
            __m512 a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
            amax = (_mm512_cmp_ps_mask(a0, a0, _CMP_UNORD_Q)
                    | _mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q))
                   ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        }
#else
        for (int i = 0; i < Q4_GROUP; i++) {  /* not fmaxf: a libm call per element */
            float a = fabsf(xb[i]);
            amax = a > amax || a != a ? a : amax;  /* a NaN sticks */
        }
#endif
        float d = amax / top;
        /* a NaN or an infinity in the block: codes 0 and dx NaN, so that the outputs are NaN
         * (as a float matmul's would be) rather than what casting NaN to an integer gives */
        float ok = d != 0.0f && isfinite(d) ? 1.0f : 0.0f, dd = ok != 0.0f ? d : 1.0f;
        if (!isfinite(d)) d = NAN;
#if Q4_VNNI
        if (ok != 0.0f) {  /* the same operations 16 lanes at a time (a finite block) */
            q4_quantize_block_avx512(xb, d, q + g * Q4_GROUP, lo + g * Q4_GROUP, &sx[g]);
            dx[g] = d;
            continue;
        }
#endif
        int32_t X[Q4_GROUP], sum = 0;
        for (int i = 0; i < Q4_GROUP; i++) {
            float v = nearbyintf(xb[i] / dd) * ok;
            v = v < -top ? -top : v > top ? top : v;  /* x / d can pass top by a rounding */
            X[i] = (int32_t)v;
            sum += X[i];
        }
        for (int i = 0; i < Q4_GROUP; i++) {
            int32_t l = ((X[i] + 128) & 0xff) - 128;
            lo[g * Q4_GROUP + i] = (int8_t)l;
            q[g * Q4_GROUP + i] = (int8_t)((X[i] - l) / 256);
        }
        dx[g] = d;
        sx[g] = d * (float)sum;
    }
}

/* The 16-bit quantization as two int8 digits: hi, lo (k int8 each), dx, sx. For tests. */
void ss_q16_quantize_row(const float *x, int64_t k, int8_t *hi, int8_t *lo, float *dx,
                         float *sx) {
    q4_quantize_row(x, k, hi, lo, dx, sx);
}

/* A record's 16 scales and 16 zeros as floats (g: its group, for Q4_KS's header). */
static inline void q4_scales(const uint8_t *p, int64_t g, const int fmt, float *s, float *z) {
    const uint8_t *sp = p + q4_code_bytes(fmt);
    const uint16_t *h = fmt == Q4_KS ? q4_ks_header(p, g) : NULL;
    const uint8_t *sc = fmt == Q4_KS ? q4_ks_scales(p, g) : NULL;
    for (int i = 0; i < Q4_ROWS; i++) {
        if (fmt == Q4_KS) {
            s[i] = f16_to_f32(h[i]) * (float)sc[i];
            z[i] = -f16_to_f32(h[Q4_ROWS + i]) * (float)sc[Q4_KS_MINS + i];
        } else if (Q4_IS_F32(fmt)) {
            memcpy(&s[i], sp + 4 * i, 4);
            memcpy(&z[i], sp + 4 * Q4_ROWS + 4 * i, 4);
        } else {
            uint16_t hs, hz;
            memcpy(&hs, sp + 2 * i, 2);
            s[i] = f16_to_f32(hs);
            if (fmt == Q4_F16) {
                memcpy(&hz, sp + 2 * Q4_ROWS + 2 * i, 2);
                z[i] = f16_to_f32(hz);
            } else {
                z[i] = -128.0f * s[i];  /* exact: a power of two */
            }
        }
    }
}

/* Code t (0..3) of quad j (columns 4j..4j+3) of row i in a record. */
static inline int q4_code(const uint8_t *p, const int fmt, int i, int j, int t) {
    if (Q4_IS_Q8(fmt)) return p[64 * j + 4 * i + t];
    return (p[64 * (j & 3) + 4 * i + t] >> (4 * (j >> 2))) & 0x0f;
}

/* The outputs of one 16-row block for M activation rows: out[r * 16 + i] = row i's dot with x_r.
 * q: M rows of 2 k int8 digits (the high digits then the low ones); dx, sx: M rows of G floats. */
static inline __attribute__((always_inline)) void q4_block_generic(
        const uint8_t *blk, int64_t G, const int fmt, const int8_t *q, const float *dx,
        const float *sx, int64_t k, float *out, const int M) {
    float accs[Q4_MAX_M][Q4_ROWS], accz[Q4_MAX_M][Q4_ROWS];
    memset(accs, 0, sizeof accs);
    memset(accz, 0, sizeof accz);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = q4_record(blk, g, fmt);
        float s[Q4_ROWS], z[Q4_ROWS];
        q4_scales(p, g, fmt, s, z);
        for (int r = 0; r < M; r++) {
            const int8_t *xg = q + r * 2 * k + g * Q4_GROUP;
            float d = dx[r * G + g], sg = sx[r * G + g];
            for (int i = 0; i < Q4_ROWS; i++) {
                int32_t isum = 0, lsum = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        int c = q4_code(p, fmt, i, j, t);
                        isum += c * xg[4 * j + t];
                        lsum += c * xg[k + 4 * j + t];
                    }
                isum = isum * 256 + lsum;  /* the sum of the codes times X, exactly */
                float prod = (float)isum * d;
                accs[r][i] = fmaf(prod, s[i], accs[r][i]);
                accz[r][i] = fmaf(z[i], sg, accz[r][i]);
            }
        }
    }
    for (int r = 0; r < M; r++)
        for (int i = 0; i < Q4_ROWS; i++) out[r * Q4_ROWS + i] = accs[r][i] + accz[r][i];
}

/* Records prefetched ahead of the one being read. Weights streamed from RAM (a decode token
 * reads every layer once): on the 2-core AVX2 machine, prefetching took gate_up (3072 x 576
 * Q4_1, one row) from 80.8 to 58.6 us and down (576 x 1536) from 40.7 to 31.3. The VNNI loop
 * prefetches the same distance. */
#define Q4_PREFETCH 8
/* Q4_KS prefetches the codes a run on into L1 (and a run's header at its start) and, this many
 * runs on, into L2 (0: not). On the 2-core CI-class EPYC a 70B layer's 0.6 share decoded at
 * 35-40 Gweights/s on one thread with 4 against 28-29 without, 50-54 against 43-50 on two; 8
 * and 16 about as 4 (three runs): the L1 prefetch alone keeps too few lines in flight for one
 * core's stream. A build-time setting (SLIPSTREAM_NATIVE_DEFINES, native/__init__.py), so that
 * the distances can be timed on a GPU host, whose hybrid shares read about 7 GB/s a core with
 * a copy beside them or not: the cores' outstanding reads rather than the memory bus. */
#ifndef Q4_PREFETCH_FAR_RUNS
#define Q4_PREFETCH_FAR_RUNS 4
#endif

/* Q4_KS: prefetch group g's codes `runs` runs on from p, and at a run's start that run's
 * header, with `hint` (a macro: _mm_prefetch takes a constant). */
#define Q4_KS_PREFETCH(p, g, runs, hint) do { \
        const char *at_ = (const char *)(p) + (runs) * Q4_KS_RUN_BYTES; \
        if ((g) % Q4_KS_RUN == 0) \
            for (int64_t o_ = 0; o_ < Q4_KS_HEADER; o_ += 64) \
                _mm_prefetch(at_ - Q4_KS_HEADER + o_, hint); \
        for (int64_t o_ = 0; o_ < 256; o_ += 64) _mm_prefetch(at_ + o_, hint); \
    } while (0)

#if Q4_VNNI
/* acc + the 16 rows' dot products of one group's codes u with 32 int8 activations xg. */
static inline __m512i q4_dot_vnni(const __m512i *u, const int8_t *xg, __m512i acc) {
    __m512i a1 = _mm512_setzero_si512();  /* two chains of four, so their latencies overlap */
    for (int j = 0; j < 8; j += 2) {
        int32_t x0, x1;
        memcpy(&x0, xg + 4 * j, 4);
        memcpy(&x1, xg + 4 * j + 4, 4);
        acc = _mm512_dpbusd_epi32(acc, u[j], _mm512_set1_epi32(x0));
        a1 = _mm512_dpbusd_epi32(a1, u[j + 1], _mm512_set1_epi32(x1));
    }
    return _mm512_add_epi32(acc, a1);
}

/* One record's prefetches (into the next block at its end, which this thread reads next; a
 * prefetch past the weights does not fault): a pass over the block reads it from RAM. */
static inline __attribute__((always_inline)) void q4_prefetch_vnni(
        const uint8_t *p, int64_t g, const int fmt, int64_t rec) {
    if (fmt == Q4_KS) {
        Q4_KS_PREFETCH(p, g, 1, _MM_HINT_T0);
        if (Q4_PREFETCH_FAR_RUNS > 0) Q4_KS_PREFETCH(p, g, Q4_PREFETCH_FAR_RUNS, _MM_HINT_T1);
    } else {
        const char *ahead = (const char *)(p + Q4_PREFETCH * rec);
        for (int64_t o = 0; o < rec; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    }
}

/* A record's codes as 8 vectors, u[j] lane i holding row i's codes of columns 4j..4j+3. */
static inline __attribute__((always_inline)) void q4_unpack_vnni(
        const uint8_t *p, const int fmt, __m512i *u) {
    if (Q4_IS_Q8(fmt)) {
        for (int j = 0; j < 8; j++) u[j] = _mm512_loadu_si512((const void *)(p + 64 * j));
    } else {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(p + 64 * c));
            u[c] = _mm512_and_si512(v, low);
            u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    }
}

/* A record's 16 scales s and zeros z (Q4_KS: from its run's d and -dmin, kept in ks_d and
 * ks_ndmin from the run's first group on). */
static inline __attribute__((always_inline)) void q4_scales_vnni(
        const uint8_t *p, int64_t g, const int fmt, __m512 *ks_d, __m512 *ks_ndmin,
        __m512 *s, __m512 *z) {
    const int64_t codes = q4_code_bytes(fmt);
    if (fmt == Q4_KS) {
        if (g % Q4_KS_RUN == 0) {  /* a run's d and -dmin, for its 8 records */
            const uint16_t *h = q4_ks_header(p, g);
            *ks_d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
            *ks_ndmin = _mm512_castsi512_ps(_mm512_xor_si512(  /* negated, as q4_scales */
                _mm512_castps_si512(_mm512_cvtph_ps(
                    _mm256_loadu_si256((const __m256i *)(h + Q4_ROWS)))),
                _mm512_set1_epi32((int)0x80000000)));
        }
        const uint8_t *sc = q4_ks_scales(p, g);
        *s = _mm512_mul_ps(*ks_d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)sc))));
        *z = _mm512_mul_ps(*ks_ndmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(sc + Q4_KS_MINS)))));
    } else if (Q4_IS_F32(fmt)) {
        *s = _mm512_loadu_ps((const void *)(p + codes));
        *z = _mm512_loadu_ps((const void *)(p + codes + 64));
    } else {
        *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + codes)));
        *z = fmt == Q4_F16
             ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + codes + 32)))
             : _mm512_mul_ps(*s, _mm512_set1_ps(-128.0f));
    }
}

/* acc[r] and accz[r] advanced by one group: a (the codes times row r's X, exactly) times its
 * dx, times s; z times its sx (the same float operations as q4_block_generic). */
#define Q4_ACCUMULATE(a, r) do { \
        __m512 prod_ = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(dx[(r) * G + g])); \
        accs[r] = _mm512_fmadd_ps(prod_, s, accs[r]); \
        accz[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[(r) * G + g]), accz[r]); \
    } while (0)

/* q4_block_generic with VNNI: the same sums and the same float operations, 16 rows a vector. */
static inline __attribute__((always_inline)) void q4_block_vnni(
        const uint8_t *blk, int64_t G, const int fmt, const int8_t *q, const float *dx,
        const float *sx, int64_t k, float *out, const int M) {
    __m512 accs[Q4_MAX_M], accz[Q4_MAX_M];
    for (int r = 0; r < M; r++) { accs[r] = _mm512_setzero_ps(); accz[r] = _mm512_setzero_ps(); }
    const int64_t rec = q4_record_bytes(fmt);
    __m512 ks_d = _mm512_setzero_ps(), ks_ndmin = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = q4_record(blk, g, fmt);
        q4_prefetch_vnni(p, g, fmt, rec);
        __m512i u[8];
        q4_unpack_vnni(p, fmt, u);
        __m512 s, z;
        q4_scales_vnni(p, g, fmt, &ks_d, &ks_ndmin, &s, &z);
        for (int r = 0; r < M; r++) {
            const int8_t *xg = q + r * 2 * k + g * Q4_GROUP;
            __m512i a = q4_dot_vnni(u, xg, _mm512_setzero_si512());
            /* 256 (u . hi) + u . lo: the codes times X, exactly */
            a = q4_dot_vnni(u, xg + k, _mm512_slli_epi32(a, 8));
            Q4_ACCUMULATE(a, r);
        }
    }
    for (int r = 0; r < M; r++)
        _mm512_storeu_ps(out + r * Q4_ROWS, _mm512_add_ps(accs[r], accz[r]));
}
#endif

#if Q4_AVX2

/* x's 4 int8 codes of quad j broadcast to every 32-bit lane. */
static inline __m256i q4_quad_avx2(const int8_t *xg, int j) {
    int32_t v;
    memcpy(&v, xg + 4 * j, 4);
    return _mm256_set1_epi32(v);
}

/* q4_block_generic with AVX2, for machines without AVX-512 VNNI (a 2-core AMD EPYC decoded the
 * default model at 10.8 tok/s through the plain-C loop). A 256-bit vector holds 8
 * rows' lanes, so a block is two halves, each over all of the block's groups (the block's records
 * are re-read from cache for the second half).
 *
 * vpmaddubsw multiplies unsigned bytes by signed bytes and sums pairs into int16 lanes, saturating;
 * with codes u <= 15 and |x| <= 128 a pair is at most 3840 and the eight quads of a group at most
 * 30720, so the int16 sums are exact, and one vpmaddwd against ones sums each row's 4-byte lane
 * into int32. 8-bit codes (up to 255) would saturate: they go through as two nibbles,
 * u = 16 uh + ul, each summed the same way. So every integer sum equals the generic loop's, and
 * the float operations follow it one for one (fmadd is fused like fmaf). */
static inline __attribute__((always_inline)) void q4_block_avx2(
        const uint8_t *blk, int64_t G, const int fmt, const int8_t *q, const float *dx,
        const float *sx, int64_t k, float *out, const int M) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int64_t rec = q4_record_bytes(fmt), codes = q4_code_bytes(fmt);
    for (int h = 0; h < 2; h++) {
        __m256 accs[Q4_MAX_M], accz[Q4_MAX_M];
        for (int r = 0; r < M; r++) { accs[r] = _mm256_setzero_ps(); accz[r] = _mm256_setzero_ps(); }
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *p = q4_record(blk, g, fmt);
            /* the first half's pass reads the block from RAM: prefetch Q4_PREFETCH records
             * ahead of it; the second reads it from cache: prefetch the next block's record */
            const char *ahead = (const char *)(h == 0 ? p + Q4_PREFETCH * rec : p + G * rec);
            for (int64_t o = 0; o < rec; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
            /* per activation row: int16 sums of the codes (Q8: of their low nibbles) times the
             * high digits of x, of the Q8 codes' high nibbles, and both again for x's low digits */
            __m256i sl[Q4_MAX_M], sh[Q4_MAX_M], tl[Q4_MAX_M], th[Q4_MAX_M];
            for (int r = 0; r < M; r++) {
                sl[r] = sh[r] = tl[r] = th[r] = _mm256_setzero_si256();
            }
            if (Q4_IS_Q8(fmt)) {
                for (int j = 0; j < 8; j++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * h));
                    __m256i ul = _mm256_and_si256(v, low);
                    __m256i uh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int r = 0; r < M; r++) {
                        const int8_t *xg = q + r * 2 * k + g * Q4_GROUP;
                        __m256i xb = q4_quad_avx2(xg, j);
                        sl[r] = _mm256_add_epi16(sl[r], _mm256_maddubs_epi16(ul, xb));
                        sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(uh, xb));
                        __m256i xl = q4_quad_avx2(xg + k, j);
                        tl[r] = _mm256_add_epi16(tl[r], _mm256_maddubs_epi16(ul, xl));
                        th[r] = _mm256_add_epi16(th[r], _mm256_maddubs_epi16(uh, xl));
                    }
                }
            } else {
                for (int c = 0; c < 4; c++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * c + 32 * h));
                    __m256i u0 = _mm256_and_si256(v, low);                         /* quad c */
                    __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);   /* quad c+4 */
                    for (int r = 0; r < M; r++) {
                        const int8_t *xg = q + r * 2 * k + g * Q4_GROUP;
                        sl[r] = _mm256_add_epi16(sl[r], _mm256_add_epi16(
                            _mm256_maddubs_epi16(u0, q4_quad_avx2(xg, c)),
                            _mm256_maddubs_epi16(u1, q4_quad_avx2(xg, c + 4))));
                        tl[r] = _mm256_add_epi16(tl[r], _mm256_add_epi16(
                            _mm256_maddubs_epi16(u0, q4_quad_avx2(xg + k, c)),
                            _mm256_maddubs_epi16(u1, q4_quad_avx2(xg + k, c + 4))));
                    }
                }
            }
            __m256 s, z;
            if (fmt == Q4_KS) {
                const uint16_t *hd = q4_ks_header(p, g) + 8 * h;
                const uint8_t *sc = q4_ks_scales(p, g) + 8 * h;
                s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd)),
                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                      _mm_loadl_epi64((const __m128i *)sc))));
                z = _mm256_mul_ps(_mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_cvtph_ps(
                                      _mm_loadu_si128((const __m128i *)(hd + Q4_ROWS)))),
                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                      (const __m128i *)(sc + Q4_KS_MINS)))));
            } else if (Q4_IS_F32(fmt)) {
                s = _mm256_loadu_ps((const float *)(p + codes + 32 * h));
                z = _mm256_loadu_ps((const float *)(p + codes + 64 + 32 * h));
            } else {
                s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + codes + 16 * h)));
                z = fmt == Q4_F16
                    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + codes + 32 + 16 * h)))
                    : _mm256_mul_ps(s, _mm256_set1_ps(-128.0f));
            }
            for (int r = 0; r < M; r++) {
                __m256i a = _mm256_madd_epi16(sl[r], ones);
                if (Q4_IS_Q8(fmt))
                    a = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(sh[r], ones), 4), a);
                /* 256 (u . hi) + u . lo, as the generic loop */
                __m256i b = _mm256_madd_epi16(tl[r], ones);
                if (Q4_IS_Q8(fmt))
                    b = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(th[r], ones), 4), b);
                a = _mm256_add_epi32(_mm256_slli_epi32(a, 8), b);
                __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(dx[r * G + g]));
                accs[r] = _mm256_fmadd_ps(prod, s, accs[r]);
                accz[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(sx[r * G + g]), accz[r]);
            }
        }
        for (int r = 0; r < M; r++)
            _mm256_storeu_ps(out + r * Q4_ROWS + 8 * h, _mm256_add_ps(accs[r], accz[r]));
    }
}
#endif

/* Blocks [b0, b1) for M activation rows, into y (rows of n outputs, float32 or bfloat16). */
static inline __attribute__((always_inline)) void q4_blocks(
        const uint8_t *w, int64_t b0, int64_t b1, int64_t n, int64_t G, const int fmt,
        const int8_t *q, const float *dx, const float *sx, int64_t k, void *y, int y_f32,
        int generic, const int M) {
    const int64_t block_bytes = G * q4_record_bytes(fmt);
    float out[Q4_MAX_M * Q4_ROWS];
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = w + b * block_bytes;
#if Q4_VNNI
        if (!generic) q4_block_vnni(blk, G, fmt, q, dx, sx, k, out, M);
        else
#elif Q4_AVX2
        if (!generic) q4_block_avx2(blk, G, fmt, q, dx, sx, k, out, M);
        else
#endif
        q4_block_generic(blk, G, fmt, q, dx, sx, k, out, M);
        int64_t r0 = b * Q4_ROWS, rows = n - r0 < Q4_ROWS ? n - r0 : Q4_ROWS;
        for (int r = 0; r < M; r++) {
            const float *o = out + r * Q4_ROWS;
            if (y_f32) {
                memcpy((float *)y + r * n + r0, o, (size_t)rows * sizeof(float));
            } else {
                uint16_t *yb = (uint16_t *)y + r * n + r0;
                for (int64_t i = 0; i < rows; i++) yb[i] = f32_to_bf16(o[i]);
            }
        }
    }
}

/* Rows a tile of q4_share: the tile's digits (128 rows of a 2048-wide x: 512 KB) stay in L2
 * while each of the share's blocks is read once for them. */
#define Q4_TILE_ROWS 128

/* One thread's share: blocks [b0, b1) for all m activation rows, in tiles of Q4_TILE_ROWS
 * rows, and within a tile block after block, each block for the tile's rows in passes of up
 * to Q4_MAX_M (the block read from RAM once, from L1 for the other passes: streaming the
 * share once a pass, a prefill of 512 rows read its weights 128 times). A row's sums are the
 * same whatever the passes or the tiles: each output element is one block's, computed in one
 * go. */
static void q4_share(const uint8_t *w, int64_t b0, int64_t b1, int64_t n, int64_t G,
                     int fmt, const int8_t *q, const float *dx, const float *sx, int64_t k,
                     int64_t m, void *y, int y_f32, int generic) {
    size_t out_elem = y_f32 ? sizeof(float) : sizeof(uint16_t);
    /* one pass (decode: up to Q4_MAX_M rows): the share's blocks in one loop, as before tiles */
    const int64_t per = m <= Q4_MAX_M ? b1 - b0 : 1;
    for (int64_t t0 = 0; t0 < m; t0 += Q4_TILE_ROWS) {
        const int64_t t1 = m - t0 < Q4_TILE_ROWS ? m : t0 + Q4_TILE_ROWS;
        for (int64_t b = b0; b < b1; b += per) {
            for (int64_t r0 = t0; r0 < t1; r0 += Q4_MAX_M) {
                const int8_t *qr = q + r0 * 2 * k;
                const float *dr = dx + r0 * G, *sr = sx + r0 * G;
                void *yr = (char *)y + (size_t)(r0 * n) * out_elem;
                int left = (int)(t1 - r0 < Q4_MAX_M ? t1 - r0 : Q4_MAX_M);
#define Q4_CASE(M_, F_) q4_blocks(w, b, b + per, n, G, F_, qr, dr, sr, k, yr, y_f32, generic, M_)
#define Q4_FMTS(M_) \
    if (fmt == Q4_F16) { Q4_CASE(M_, Q4_F16); } \
    else if (fmt == Q4_F32) { Q4_CASE(M_, Q4_F32); } \
    else if (fmt == Q4_KS) { Q4_CASE(M_, Q4_KS); } \
    else if (fmt == Q8_F32) { Q4_CASE(M_, Q8_F32); } \
    else { Q4_CASE(M_, Q8_F16); }
                /* each (rows, format) its own copy, so that both are constants */
                switch (left) {
                case 1: Q4_FMTS(1); break;
                case 2: Q4_FMTS(2); break;
                case 3: Q4_FMTS(3); break;
                default: Q4_FMTS(4); break;
                }
#undef Q4_FMTS
#undef Q4_CASE
            }
        }
    }
}

/* --- threads --------------------------------------------------------------------------------
 *
 * OpenMP, which in a process that has imported torch is torch's own libgomp (native/__init__.py)
 * and so torch's own worker threads. A pool of our own (pthreads, workers spinning ~100 us after
 * each job, then parking on a futex) was tried first: alone it handed off in well under a
 * microsecond, against ~3.5 us for a libgomp fork and join, but in a decode step its spinning
 * worker fought torch's libgomp workers, which spin after every torch parallel op (the head's
 * matmul), for the same 2 cores: the default model decoded at 86-98 tok/s with it against
 * 150-161 with OpenMP (int4pack: 119-122), alternating runs. Without OpenMP the caller runs
 * every block. */

typedef struct {
    const uint8_t *w;
    int64_t n, k, nb, G, m;
    int fmt, y_f32, generic;
    const int8_t *q;
    const float *dx, *sx;
    void *y;
} q4_job;

/* part `part` of `parts` equal ranges of the row blocks (parallel.h's run) */
static void q4_run_part(const void *job, int part, int parts) {
    const q4_job *j = job;
    int64_t b0 = j->nb * part / parts, b1 = j->nb * (part + 1) / parts;
    q4_share(j->w, b0, b1, j->n, j->G, j->fmt, j->q, j->dx, j->sx, j->k, j->m, j->y,
             j->y_f32, j->generic);
}

/* An empty parallel region of `threads`: the calling thread's OpenMP team wakes up if it slept,
 * and stays spinning for libgomp's spin count after it. Hybrid decode's CPU worker calls it in a
 * loop while it waits for the next split layer's input (hybrid/host_io.py): on the H200's
 * host the CPU share's chain took 4.14 ms back to back and 4.74 / 4.91 ms after a pause of
 * 0.2 / 1 ms, as long as the GPU's work between two split layers, the team having gone to
 * sleep. */
void ss_omp_touch(int threads) {
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        { }
    }
#else
    (void)threads;
#endif
}

/* A packed weight (what Q4VnniLinear holds), passed as one pointer: ctypes converts each
 * argument at every call, ~0.2 us apiece. */
typedef struct {
    const uint8_t *w;
    int64_t n, k;
    int64_t fmt;  /* Q4_F16, Q4_F32, Q8_F16, Q4_KS or Q8_F32 */
} q4_weight;

#define Q4_X_F32 1   /* flags: x is float32 (else bfloat16) */
#define Q4_Y_F32 2   /* y is float32 (else bfloat16) */
#define Q4_GENERIC 4 /* the plain-C loop even where a vector loop is compiled in (tests) */
#define Q4_GELU 8    /* ss_q4_ffn: GeGLU (GELU, tanh form) between the matvecs, not SwiGLU */
#define Q4_THREADS_SHIFT 8  /* flags >> 8: threads sharing the rows (0 or 1: the caller alone) */

/* y (m, n) = x (m, k) @ W^T for W (n, k) packed as above (ceil(n / 16) blocks of k / 32
 * records). x rows contiguous, y likewise, written for the n real rows only.
 *
 * Each block of x is quantized to 16 bits (X = round(x / dx), |X| <= 32512, dx = max|x| / 32512,
 * so |x - dx X| <= dx / 2, ~1/256 of an int8 quantization's error and below bfloat16's rounding
 * of x) and X split into two int8 digits, X = 256 hi + lo: the group sum is
 * 256 (u . hi) + u . lo, two vpdpbusd chains over the same unpacked codes, with the float work
 * of one. The exact sum stays below 2^24 for 4-bit codes (15 * 32512 * 32), so its conversion to
 * float is exact too; for 8-bit codes it is rounded once. */
void ss_q4_matvec(const q4_weight *wd, const void *x, void *y, int64_t m, int64_t flags) {
    int64_t n = wd->n, k = wd->k, G = k / Q4_GROUP, nb = (n + Q4_ROWS - 1) / Q4_ROWS;
    /* one allocation: the float row (bf16 widened), then the codes, dx and sx of all rows */
    size_t fbytes = (size_t)k * sizeof(float);
    size_t qbytes = (size_t)(m * k * 2 + 63) / 64 * 64;
    char *scratch = malloc(fbytes + qbytes + 2 * (size_t)(m * G) * sizeof(float));
    if (scratch == NULL) return;  /* the caller's output stays as it was: see Q4VnniLinear */
    float *xf = (float *)scratch;
    int8_t *q = (int8_t *)(scratch + fbytes);
    float *dx = (float *)(scratch + fbytes + qbytes), *sx = dx + m * G;
    int64_t threads = flags >> Q4_THREADS_SHIFT;
    if ((flags & Q4_X_F32) && m >= 64 && threads > 1) {
        /* a prefill's float32 rows quantized by the threads too (512 rows of 2048 were ~2 ms
         * on one core). Entered only then: an OpenMP construct with a false `if` before each
         * decode matvec took a 5120 x 2048 one from 1.3 to 4.7 ms on 2 threads */
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
#endif
        for (int64_t r = 0; r < m; r++)
            q4_quantize_row((const float *)x + r * k, k, q + r * k * 2, q + r * k * 2 + k,
                            dx + r * G, sx + r * G);
    } else {
        for (int64_t r = 0; r < m; r++) {
            const float *row = row_as_f32(x, r, k, (flags & Q4_X_F32) != 0, xf);
            int8_t *qr = q + r * k * 2;
            q4_quantize_row(row, k, qr, qr + k, dx + r * G, sx + r * G);
        }
    }
    q4_job j = {wd->w, n, k, nb, G, m, (int)wd->fmt, (flags & Q4_Y_F32) != 0,
                (flags & Q4_GENERIC) != 0, q, dx, sx, y};
    /* at least 4 blocks a thread: below that a hand-off costs more than it saves */
    if (threads > nb / 4) threads = nb / 4;
    ss_parallel(q4_run_part, &j, threads < 1 ? 1 : (int)threads, nb);
    free(scratch);
}

/* y (m, n) float32 = m rows already quantized (q: m rows of 2 k digits, dx and sx: m rows of
 * k / 32, as ss_q16_quantize_row writes them) times W^T, every block on the calling thread (as
 * q4_share: a 16-row block, 19 KB of a 2048-wide Q4_KS one, read from RAM once for a tile's
 * rows). For a worker that splits its own work (native/moe_rows.c: the routed experts of a
 * prefill). ss_q4_matvec's bits. */
void ss_q4_rows(const q4_weight *wd, const int8_t *q, const float *dx, const float *sx,
                int64_t m, float *y) {
    const int64_t nb = (wd->n + Q4_ROWS - 1) / Q4_ROWS;
    q4_share(wd->w, 0, nb, wd->n, wd->k / Q4_GROUP, (int)wd->fmt, q, dx, sx, wd->k, m, y, 1, 0);
}

void ss_silu_mul_f32(const float *gate_up, int64_t m, int64_t n, float *out);  /* decode_ops.c */
void ss_gelu_mul_f32(const float *gate_up, int64_t m, int64_t n, float *out);  /* decode_ops.c */

/* The CPU's share of a split FFN (hybrid/share.py, HostFFN) in one call: gu = x gate_up^T (m rows
 * of [gate | up]), act = silu(gate) * up (gelu_tanh(gate) * up with Q4_GELU), out = act down^T,
 * float32 throughout. One call rather than four is one release of Python's GIL rather than four hand-backs: hybrid decode's worker
 * otherwise waits for the GIL between them while the main thread enqueues CUDA work, and its
 * OpenMP team idles meanwhile (on an H100 host the four calls ran 17% slower, with about two
 * cores fewer busy, while the main thread was enqueueing). gu and act: scratch of m * 2 *
 * units and m * units floats (units = down's k). flags as ss_q4_matvec's, less the X/Y types. */
void ss_q4_ffn(const q4_weight *gate_up, const q4_weight *down, const float *x, float *gu,
               float *act, float *out, int64_t m, int64_t flags) {
    int64_t f32 = Q4_X_F32 | Q4_Y_F32;
    ss_q4_matvec(gate_up, x, gu, m, flags | f32);
    if (flags & Q4_GELU) ss_gelu_mul_f32(gu, m, down->k, act);
    else ss_silu_mul_f32(gu, m, down->k, act);
    ss_q4_matvec(down, act, out, m, flags | f32);
}

/* Seconds on a monotonic clock. */
static double ss_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ss_q4_ffn once the GPU says its input is in host memory, with no Python between the wait and
 * the hand-back (hybrid decode's worker, SLIPSTREAM_HOST_SIGNAL=1): spin until *arrived >=
 * seq (the GPU writes it after the input, kernels.send_to_host), keeping `threads` OpenMP
 * threads awake meanwhile as ss_omp_touch does, compute, then store seq into *done, which the
 * GPU's wait kernel polls (kernels.wait_host_add). The worker otherwise needs Python's GIL to
 * notice the input (a CUDA event's query) and again to bump the counter, and waits for it while
 * the main thread enqueues: on an H100 host an 8B's split layer spent 0.32 ms from its GPU
 * start to the CPU starting its share. Returns 0, or -1 where the input did not arrive within
 * timeout_s (nothing computed, *done untouched). *waited_s: the seconds spent waiting. */
int ss_q4_ffn_on_signal(const q4_weight *gate_up, const q4_weight *down, const float *x,
                        float *gu, float *act, float *out, int64_t m, int64_t flags,
                        const int64_t *arrived, int64_t seq, int64_t *done, int64_t threads,
                        double timeout_s, double *waited_s) {
    double t0 = ss_now(), t = t0;
    int64_t polls = 0;
    while (__atomic_load_n(arrived, __ATOMIC_ACQUIRE) < seq) {
        ss_omp_touch((int)threads);
        if (++polls % 64 == 0) {  /* the clock a few times a microsecond's worth of touches */
            t = ss_now();
            if (t - t0 > timeout_s) {
                *waited_s = t - t0;
                return -1;
            }
        }
    }
    *waited_s = ss_now() - t0;
    ss_q4_ffn(gate_up, down, x, gu, act, out, m, flags);
    __atomic_store_n(done, seq, __ATOMIC_RELEASE);
    return 0;
}

/* Whether this build has the VNNI loop. */
int ss_q4_has_vnni(void) { return Q4_VNNI; }

/* Whether this build has a vector loop, VNNI or AVX2 (else every call takes the plain-C one). */
int ss_q4_has_simd(void) { return Q4_VNNI || Q4_AVX2; }
