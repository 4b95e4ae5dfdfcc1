/* 4-bit weights in the GPU kernels' plane layout (kernels/pack.py) times int8-quantized
 * activations, on the CPU: hybrid decode's CPU share read straight from the pinned layer image
 * that PCIe copies from (weights/plane_host.py, PlaneLinear).
 *
 * Why: the CPU's share otherwise needs a copy of its own in a CPU layout (q4vnni: 6 bits a Q4_K
 * weight, with float32 scales and zeros), packed at load (tens of seconds for a 70B) and kept
 * beside the pinned image (a 70B at 24 GiB: about 13 GB more RAM). The image already holds
 * those units ("the rest" of each split layer, for prefill) as planes of 4.625 bits a Q4_K
 * weight. Reading them in place costs no RAM and no packing, and reads 23% fewer bytes than
 * q4vnni where host memory, shared with the copy engine, is what limits hybrid decode.
 *
 * Layout read (per row of the weight, each plane row-major):
 *   lo  (n, k/2) bytes: unit u (32 columns) is 16 bytes, four little-endian int32 words; word w
 *       holds columns 32u + 4j + w (j = 0..7) at bits [4j, 4j + 4). So byte b of the unit holds
 *       column 8 (b % 4) + b / 4 in its low nibble and column 8 (b % 4) + 4 + b / 4 in its high.
 *   d   float16, (n, k/32) for Q4_0/Q4_1, (n, k/256) for Q4_K;
 *   m   float16, the same shape: Q4_1's min, Q4_K's dmin (absent for Q4_0);
 *   sc, mn  Q4_K's 6-bit scale and min of each unit, one byte each, (n, k/32).
 * A unit's weights are s u + z, u the 4-bit code: Q4_0 s = d, z = -8 d; Q4_1 s = d, z = m;
 * Q4_K s = d sc, z = -dmin mn (products of a float16 and a 6-bit integer: exact in float32).
 *
 * Math, as q4_matvec.c's: each activation row is quantized per unit of 32 (q4_quantize_row,
 * through ss_q8/ss_q16_quantize_row: 8 bits, or 16 as two int8 digits), then per unit
 *     y += s (dx sum(u X)) + z sx        (sx = dx sum(X))
 * with the integer sum exact. The units are summed in 8 lanes, lane u % 8 (a Q4_K super-block's
 * 8 units side by side), each lane's scale and zero terms in their own accumulators, and at the
 * row's end t_l = accs_l + accz_l, y = ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)). The
 * AVX2 loop and the plain-C one do the same float operations in that order, so the same bits;
 * a row's result depends neither on the other rows of x nor on the thread count.
 *
 * AVX2: a unit's 16 bytes, split into low and high nibbles, make one 256-bit vector of 32 codes;
 * the activation is permuted once per call into the same order, so one vpmaddubsw (unsigned
 * codes times signed digits, pairs summed into int16: at most 2 x 15 x 128, exact) and one
 * vpmaddwd give the unit's sum in 8 int32 lanes, and 8 units' sums are reduced to one vector
 * (horizontal adds, exact) for the float work, which runs 8 units a vector.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "parallel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PL_AVX2 1
#include <immintrin.h>
#else
#define PL_AVX2 0
#endif
/* AVX-512 VNNI (the GPU hosts' Xeons): the integer sums through vpdpbusd, 4 units a vector;
 * the float work as in the AVX2 loop */
#if PL_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PL_VNNI 1
#else
#define PL_VNNI 0
#endif
/* VNNI's sums come out in the units' own order (pl_sums8_vnni), so the float work skips the
 * permutes into the lanes' order and permutes the accumulators once a tile instead: each lane
 * still sees the same units in the same order, so the same bits. */
#define PL_NATURAL PL_VNNI
/* units whose activation digits lie side by side (see pl_x_offset) */
#define PL_XGROUP (PL_VNNI ? 4 : 2)

#define PL_UNIT 32       /* columns per unit (a code block and its scale) */
#define PL_LANES 8       /* units summed side by side: a Q4_K super-block */
#define PL_MAX_M 4       /* activation rows per pass over the weights */
#define PL_TILE 2        /* weight rows sharing each activation load (decode: one x row) */

/* the formats (plane_weight.fmt) */
#define PL_Q4_0 0
#define PL_Q4_1 1
#define PL_Q4_K 2

/* flags (the same bits as ss_q4_matvec's where they mean the same) */
#define PL_GENERIC 4        /* the plain-C loop even where AVX2 is compiled in (tests) */
#define PL_X16 8            /* 16-bit activations as two int8 digits */
#define PL_CHUNKS 16        /* threads take chunks of the rows (else one equal share each) */
#define PL_THREADS_SHIFT 8  /* flags >> 8: threads sharing the rows */

/* q4_matvec.c's quantization of one activation row per block of 32 */
void ss_q8_quantize_row(const float *x, int64_t k, int8_t *q, float *dx, float *sx);
void ss_q16_quantize_row(const float *x, int64_t k, int8_t *hi, int8_t *lo, float *dx,
                         float *sx);

/* A weight's planes (what PlaneLinear passes), as one pointer: ctypes converts each argument
 * at every call. */
typedef struct {
    const uint8_t *lo;
    const uint16_t *d, *m;
    const uint8_t *sc, *mn;
    int64_t n, k, fmt;
} plane_weight;

/* Where a unit's activation digits go in the permuted row: units are taken in groups of
 * g = PL_XGROUP (pairs for AVX2, quads for VNNI), 32 g digits a group: [the g units' 16
 * low-nibble columns each | their 16 high-nibble columns each], so that one load of the group's
 * codes (16 g bytes), split into nibbles, meets two loads of digits. Units after the last whole
 * group take pairs, and a last one alone [its low-nibble columns | its high ones]. Returns the
 * offset of unit u's low-nibble digits; its high ones are `*hi_step` further on. The layout
 * only places the digits: the sums, hence the bits, are the same with either. */
static inline int64_t pl_x_offset(int64_t u, int64_t units, int64_t *hi_step) {
    int64_t g = (u | (PL_XGROUP - 1)) < units ? PL_XGROUP : (u | 1) < units ? 2 : 1;
    *hi_step = 16 * g;
    return (u & ~(g - 1)) * PL_UNIT + (u & (g - 1)) * 16;
}

/* Column (within its unit) of code position b of the 16 a unit's bytes hold, in their low
 * nibbles (hi = 0) or high ones (hi = 1) (see the layout above). */
static inline int pl_column(int b, int hi) { return 8 * (b % 4) + b / 4 + 4 * hi; }

/* The accumulator lane of unit u: the AVX2 loop's horizontal adds leave a group of 8 units'
 * sums in the order 0 2 4 6 1 3 5 7, and both loops use that order. */
static inline int pl_lane(int64_t u) {
    static const int lane[PL_LANES] = {0, 4, 1, 5, 2, 6, 3, 7};
    return lane[u % PL_LANES];
}

/* The scale s and zero z of unit u of a row (see the layout). */
static inline void pl_unit_scale(const plane_weight *w, int64_t row, int64_t u, float *s,
                                 float *z) {
    const int64_t units = w->k / PL_UNIT;
    if (w->fmt == PL_Q4_K) {
        int64_t sb = row * (w->k / 256) + u / 8;
        float d = f16_to_f32(w->d[sb]), dmin = f16_to_f32(w->m[sb]);
        *s = d * (float)w->sc[row * units + u];
        *z = -dmin * (float)w->mn[row * units + u];
    } else {
        float d = f16_to_f32(w->d[row * units + u]);
        *s = d;
        *z = w->fmt == PL_Q4_1 ? f16_to_f32(w->m[row * units + u]) : -8.0f * d;
    }
}

/* Unit u's integer sum against one activation row's permuted digits: xh (8-bit codes, or the
 * high digits) and xl (the low digits, or NULL) at the unit's offset, its high-nibble digits
 * `step` further on. */
static inline int32_t pl_unit_sum(const uint8_t *codes, const int8_t *xh, const int8_t *xl,
                                  int64_t step) {
    int32_t hs = 0, ls = 0;
    for (int b = 0; b < 16; b++) {
        int c0 = codes[b] & 15, c1 = codes[b] >> 4;
        hs += c0 * xh[b] + c1 * xh[step + b];
        if (xl) ls += c0 * xl[b] + c1 * xl[step + b];
    }
    return xl ? hs * 256 + ls : hs;
}

static inline float pl_lanes_total(const float *accs, const float *accz) {
    float t[PL_LANES];
    for (int l = 0; l < PL_LANES; l++) t[l] = accs[l] + accz[l];
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

/* Units [u0, u1) of a row into the lane accumulators, plain C: M activation rows, each with its
 * permuted digits at xq + r * xstride (X16: the low digits k further on), dx and sx at
 * r * units. */
static inline void pl_units_generic(const plane_weight *w, int64_t row, int64_t u0, int64_t u1,
                                    const int8_t *xq, int64_t xstride, const float *dx,
                                    const float *sx, int M, int X16,
                                    float accs[][PL_LANES], float accz[][PL_LANES]) {
    const int64_t units = w->k / PL_UNIT;
    const uint8_t *codes = w->lo + row * (w->k / 2);
    for (int64_t u = u0; u < u1; u++) {
        float s, z;
        pl_unit_scale(w, row, u, &s, &z);
        int l = pl_lane(u);
        int64_t step, off = pl_x_offset(u, units, &step);
        for (int r = 0; r < M; r++) {
            const int8_t *xr = xq + r * xstride + off;
            int32_t isum = pl_unit_sum(codes + u * 16, xr, X16 ? xr + w->k : NULL, step);
            float prod = (float)isum * dx[r * units + u];
            accs[r][l] = fmaf(prod, s, accs[r][l]);
            accz[r][l] = fmaf(z, sx[r * units + u], accz[r][l]);
        }
    }
}

#if PL_AVX2
/* The lanes' order (pl_lane) of 8 units in their own order, as a permute: lane-order position l
 * holds unit PL_ORDER[l]. */
#define PL_ORDER _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)

/* A vector of 8 units' values in their own order, in the order the sums come in. */
static inline __m256 pl_to_sums_order(__m256 v) {
    return PL_NATURAL ? v : _mm256_permutevar8x32_ps(v, PL_ORDER);
}

/* The scales and zeros of units [u, u + 8) of a row as vectors in the sums' order (the lanes'
 * order, or the units' own with PL_NATURAL), each the same value as pl_unit_scale's, computed
 * the same way. */
static inline void pl_scales8(const plane_weight *w, int64_t row, int64_t u, __m256 *s,
                              __m256 *z) {
    const int64_t units = w->k / PL_UNIT;
    if (w->fmt == PL_Q4_K) {
        int64_t sb = row * (w->k / 256) + u / 8;
        __m256 d = _mm256_set1_ps(f16_to_f32(w->d[sb]));
        __m256 ndmin = _mm256_set1_ps(-f16_to_f32(w->m[sb]));
        __m128i scb = _mm_loadl_epi64((const __m128i *)(w->sc + row * units + u));
        __m128i mnb = _mm_loadl_epi64((const __m128i *)(w->mn + row * units + u));
        *s = _mm256_mul_ps(d, pl_to_sums_order(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scb))));
        *z = _mm256_mul_ps(ndmin, pl_to_sums_order(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mnb))));
    } else {
        *s = pl_to_sums_order(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + row * units + u))));
        *z = w->fmt == PL_Q4_1
             ? pl_to_sums_order(_mm256_cvtph_ps(
                   _mm_loadu_si128((const __m128i *)(w->m + row * units + u))))
             : _mm256_mul_ps(*s, _mm256_set1_ps(-8.0f));
    }
}

/* Split 32 bytes of codes (a pair of units) into their low and high nibbles. */
static inline void pl_nibbles(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_and_si256(v, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

/* A pair of units' sums in int32 lanes [u: 4 | u + 1: 4] for codes split into lo and hi against
 * the pair's digits x (8-bit: x[0] low-nibble columns, x[1] high; X16: then the low digits'
 * x[2], x[3]). The two int16 products a lane are each at most 2 x 15 x 128: exact. */
static inline __m256i pl_pair_sums(__m256i lo, __m256i hi, const __m256i *x, const int X16) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x[0]), _mm256_maddubs_epi16(hi, x[1]));
    if (!X16) return _mm256_madd_epi16(ph, ones);
    /* 256 (u . hi) + u . lo, exact in int32 */
    __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x[2]), _mm256_maddubs_epi16(hi, x[3]));
    return _mm256_add_epi32(_mm256_madd_epi16(ph, _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(pl, ones));
}

/* The integer sums of a group of 8 units [u, u + 8) of R consecutive rows (codes: the first
 * row's) against one activation row's digits at xr, in the lanes' order (pl_lane), with AVX2:
 * each digit vector loaded once for the R rows (a row's codes are 4 bits a weight, its
 * activation digits 8 or 16: read for every row alone, x would be most of the bytes the loop
 * moves). Each pair's sums are [u+2i: 4 lanes | u+2i+1: 4]; horizontal adds (within 128-bit
 * halves) of pairs 0,1 and 2,3, then of those, leave [u, u+2, u+4, u+6 | u+1, u+3, u+5, u+7]. */
static inline __attribute__((always_inline)) void pl_group_sums_avx2(
        const uint8_t *codes, int64_t row_bytes, int64_t u, const int8_t *xr, int64_t k,
        const int R, const int X16, __m256i *sums) {
    __m256i half[PL_TILE][2];
    for (int h = 0; h < 2; h++) {
        __m256i x[2][4];  /* pair 2h + p's digits: low-nibble columns, high; X16 too */
        for (int p = 0; p < 2; p++) {
            const int8_t *xp = xr + 64 * (2 * h + p);
            for (int c = 0; c < 2 + 2 * X16; c++)
                x[p][c] = _mm256_loadu_si256((const __m256i *)(xp + (c >> 1) * k + 32 * (c & 1)));
        }
        for (int q = 0; q < R; q++) {
            __m256i pr[2];
            for (int p = 0; p < 2; p++) {
                __m256i lo, hi;
                pl_nibbles(codes + q * row_bytes + (u + 2 * (2 * h + p)) * 16, &lo, &hi);
                pr[p] = pl_pair_sums(lo, hi, x[p], X16);
            }
            half[q][h] = _mm256_hadd_epi32(pr[0], pr[1]);
        }
    }
    for (int q = 0; q < R; q++) sums[q] = _mm256_hadd_epi32(half[q][0], half[q][1]);
}

#if PL_VNNI
/* A group of 8 units' integer sums, in the units' own order, for one row's codes (at its unit
 * u) against x: the group's digits, x[0..1] units u..u+3's low- and high-nibble columns,
 * x[2..3] u+4..u+7's (X16: x[4..7] the low digits likewise). vpdpbusd sums each unit's
 * 4-column products into its 128-bit lane's 4 int32s (exact: no saturation), then two adds
 * within the lanes and one permute leave the 8 totals in order. */
static inline __m256i pl_sums8_vnni(const uint8_t *codes, const __m512i *x, const int X16) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13,
                                            0, 0, 0, 0, 0, 0, 0, 0);
    __m512i a[2];
    for (int half = 0; half < 2; half++) {
        __m512i v = _mm512_loadu_si512((const void *)(codes + 64 * half));
        __m512i lo = _mm512_and_si512(v, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        const __m512i *xh = x + 2 * half;
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xh[0]);
        acc = _mm512_dpbusd_epi32(acc, hi, xh[1]);
        if (X16) {  /* 256 (u . hi) + u . lo, exact in int32 */
            __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xh[4]);
            acc = _mm512_add_epi32(_mm512_slli_epi32(acc, 8), _mm512_dpbusd_epi32(l, hi, xh[5]));
        }
        a[half] = acc;
    }
    /* 128-bit lane j: a[0]'s 4 partials of unit u+j (A), a[1]'s of u+4+j (B) */
    __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]),
                                 _mm512_unpackhi_epi32(a[0], a[1]));  /* A02 B02 A13 B13 */
    t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));  /* A B A B */
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, t));
}

/* pl_group_sums_avx2 through VNNI (the same sums): the group's digits loaded once for the R
 * rows. */
static inline __attribute__((always_inline)) void pl_group_sums_vnni(
        const uint8_t *codes, int64_t row_bytes, int64_t u, const int8_t *xr, int64_t k,
        const int R, const int X16, __m256i *sums) {
    __m512i x[8];
    for (int c = 0; c < 4 + 4 * X16; c++)  /* 64 bytes each; the low digits k further on */
        x[c] = _mm512_loadu_si512((const void *)(xr + (c >> 2) * k + 64 * (c & 3)));
    for (int q = 0; q < R; q++) sums[q] = pl_sums8_vnni(codes + q * row_bytes + u * 16, x, X16);
}
#define PL_GROUP_SUMS pl_group_sums_vnni
#else
#define PL_GROUP_SUMS pl_group_sums_avx2
#endif

/* pl_units_generic for whole groups of 8 units [u0, u1) of R consecutive rows at once, with
 * vectors: the integer sums by PL_GROUP_SUMS (AVX2 or VNNI), the float work 8 units a vector
 * in the lanes' order. acc*_out[q * M + r]: row q's accumulators for activation row r. */
static inline __attribute__((always_inline)) void pl_tile_simd(
        const plane_weight *w, int64_t row, int64_t u0, int64_t u1, const int8_t *xq,
        int64_t xstride, const float *dx, const float *sx, const int R, const int M,
        const int X16, float accs_out[][PL_LANES], float accz_out[][PL_LANES]) {
    const int64_t units = w->k / PL_UNIT, row_bytes = w->k / 2;
    const uint8_t *codes = w->lo + row * row_bytes;
    /* the accumulators in the sums' order: PL_NATURAL's units' own order comes from the lanes'
     * by the inverse of PL_ORDER, and goes back by PL_ORDER */
    const __m256i from_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 accs[PL_TILE][PL_MAX_M], accz[PL_TILE][PL_MAX_M];
    for (int q = 0; q < R; q++)
        for (int r = 0; r < M; r++) {
            accs[q][r] = _mm256_loadu_ps(accs_out[q * M + r]);
            accz[q][r] = _mm256_loadu_ps(accz_out[q * M + r]);
            if (PL_NATURAL) {
                accs[q][r] = _mm256_permutevar8x32_ps(accs[q][r], from_lanes);
                accz[q][r] = _mm256_permutevar8x32_ps(accz[q][r], from_lanes);
            }
        }
    for (int64_t u = u0; u < u1; u += PL_LANES) {
        __m256 s[PL_TILE], z[PL_TILE];
        for (int q = 0; q < R; q++) pl_scales8(w, row + q, u, &s[q], &z[q]);
        for (int r = 0; r < M; r++) {
            __m256i sums[PL_TILE];
            PL_GROUP_SUMS(codes, row_bytes, u, xq + r * xstride + u * PL_UNIT, w->k, R, X16,
                          sums);
            __m256 d = pl_to_sums_order(_mm256_loadu_ps(dx + r * units + u));
            __m256 t = pl_to_sums_order(_mm256_loadu_ps(sx + r * units + u));
            for (int q = 0; q < R; q++) {
                __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[q]), d);
                accs[q][r] = _mm256_fmadd_ps(prod, s[q], accs[q][r]);
                accz[q][r] = _mm256_fmadd_ps(z[q], t, accz[q][r]);
            }
        }
    }
    for (int q = 0; q < R; q++)
        for (int r = 0; r < M; r++) {
            if (PL_NATURAL) {
                accs[q][r] = _mm256_permutevar8x32_ps(accs[q][r], PL_ORDER);
                accz[q][r] = _mm256_permutevar8x32_ps(accz[q][r], PL_ORDER);
            }
            _mm256_storeu_ps(accs_out[q * M + r], accs[q][r]);
            _mm256_storeu_ps(accz_out[q * M + r], accz[q][r]);
        }
}
#endif

/* Rows [r0, r1) for M activation rows into y (rows of n floats): with AVX2, in tiles of R rows
 * (the last rows of the range one at a time), the units past the last whole group of 8 by the
 * plain-C loop. */
static inline __attribute__((always_inline)) void pl_rows(
        const plane_weight *w, int64_t r0, int64_t r1, const int8_t *xq, int64_t xstride,
        const float *dx, const float *sx, float *y, const int R, const int M, const int X16,
        int generic) {
    const int64_t units = w->k / PL_UNIT;
#if PL_AVX2
    const int64_t whole = units / PL_LANES * PL_LANES;
#else
    (void)generic;
    (void)R;
#endif
    for (int64_t row = r0; row < r1;) {
        float accs[PL_TILE * PL_MAX_M][PL_LANES], accz[PL_TILE * PL_MAX_M][PL_LANES];
        memset(accs, 0, sizeof accs);
        memset(accz, 0, sizeof accz);
        int tile = 1;
        int64_t done = 0;
#if PL_AVX2
        if (!generic) {
            if (R > 1 && row + R <= r1) {
                tile = R;
                pl_tile_simd(w, row, 0, whole, xq, xstride, dx, sx, R, M, X16, accs, accz);
            } else {
                pl_tile_simd(w, row, 0, whole, xq, xstride, dx, sx, 1, M, X16, accs, accz);
            }
            done = whole;
        }
#endif
        for (int q = 0; q < tile; q++) {
            pl_units_generic(w, row + q, done, units, xq, xstride, dx, sx, M, X16,
                             accs + q * M, accz + q * M);
            for (int r = 0; r < M; r++)
                y[r * w->n + row + q] = pl_lanes_total(accs[q * M + r], accz[q * M + r]);
        }
        row += tile;
    }
}

typedef struct {
    const plane_weight *w;
    const int8_t *xq;
    const float *dx, *sx;
    float *y;
    int64_t m, xstride;
    int x16, generic;
} pl_job;

/* One thread's rows, every activation row, in passes of up to PL_MAX_M (a pass reads the
 * weights once). */
static void pl_run_part(const void *job, int part, int parts) {
    const pl_job *j = job;
    const int64_t n = j->w->n, units = j->w->k / PL_UNIT;
    int64_t r0 = n * part / parts, r1 = n * (part + 1) / parts;
    for (int64_t a = 0; a < j->m; a += PL_MAX_M) {
        const int8_t *xq = j->xq + a * j->xstride;
        const float *dx = j->dx + a * units, *sx = j->sx + a * units;
        float *y = j->y + a * n;
        int left = (int)(j->m - a < PL_MAX_M ? j->m - a : PL_MAX_M);
#define PL_CASE(M_) \
    if (j->x16) pl_rows(j->w, r0, r1, xq, j->xstride, dx, sx, y, PL_TILE / M_, M_, 1, \
                        j->generic); \
    else pl_rows(j->w, r0, r1, xq, j->xstride, dx, sx, y, PL_TILE / M_, M_, 0, j->generic)
        /* each (rows, digits) its own copy, so that both are constants */
        switch (left) {
        case 1: PL_CASE(1); break;
        case 2: PL_CASE(2); break;
        case 3: PL_CASE(3); break;
        default: PL_CASE(4); break;
        }
#undef PL_CASE
    }
}

/* y (m, n) = x (m, k) @ W^T, float32 in and out, rows contiguous; W's planes as above.
 * Returns 0, or -1 where the scratch could not be had (y is then left as it was). */
int ss_plane_matvec(const plane_weight *w, const float *x, float *y, int64_t m, int64_t flags) {
    const int64_t k = w->k, units = k / PL_UNIT;
    const int x16 = (flags & PL_X16) != 0;
    const int64_t xstride = k * (1 + x16);
    size_t qbytes = (size_t)(m * xstride + 63) / 64 * 64, tbytes = (size_t)xstride;
    char *scratch = malloc(qbytes + tbytes + 2 * (size_t)(m * units) * sizeof(float));
    if (scratch == NULL) return -1;
    int8_t *xq = (int8_t *)scratch, *tmp = (int8_t *)(scratch + qbytes);
    float *dx = (float *)(scratch + qbytes + tbytes), *sx = dx + m * units;
    for (int64_t r = 0; r < m; r++) {
        /* quantized in column order, then each unit's digits permuted into the codes' order */
        if (x16)
            ss_q16_quantize_row(x + r * k, k, tmp, tmp + k, dx + r * units, sx + r * units);
        else
            ss_q8_quantize_row(x + r * k, k, tmp, dx + r * units, sx + r * units);
        int8_t *xr = xq + r * xstride;
        for (int64_t dgt = 0; dgt < 1 + x16; dgt++)
            for (int64_t u = 0; u < units; u++) {
                int64_t step, off = pl_x_offset(u, units, &step);
                for (int b = 0; b < 16; b++)
                    for (int hi = 0; hi < 2; hi++)
                        xr[dgt * k + off + hi * step + b] =
                            tmp[dgt * k + u * PL_UNIT + pl_column(b, hi)];
            }
    }
    pl_job j = {w, xq, dx, sx, y, m, xstride, x16, (flags & PL_GENERIC) != 0};
    int64_t threads = flags >> PL_THREADS_SHIFT;
    /* at least 16 rows a thread: below that a hand-off costs more than it saves */
    if (threads > w->n / 16) threads = w->n / 16;
    if (threads < 1) threads = 1;
    /* PL_CHUNKS: the threads take chunks of the rows as they finish (parallel.h), each
     * chunk at least 16 rows */
    ss_parallel(pl_run_part, &j, (int)threads, w->n / 16, (flags & PL_CHUNKS) != 0);
    free(scratch);
    return 0;
}

/* Whether this build has a vector loop, AVX2 or VNNI (else every call takes the plain-C one). */
int ss_plane_has_simd(void) { return PL_AVX2; }

/* Whether this build's vector loop sums through AVX-512 VNNI. */
int ss_plane_has_vnni(void) { return PL_VNNI; }
