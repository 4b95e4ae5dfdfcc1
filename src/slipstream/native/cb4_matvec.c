/* The 4-bit codebook formats (MXFP4, IQ4_NL, IQ4_XS) times 16-bit-quantized activations: the
 * CPU decode matmul of the cb4 kind (weights/cpu/codebook.py, Cb4Linear), gpt-oss's MXFP4
 * experts and the IQ4_XS experts of most community quants of big MoEs above all.
 *
 * Why: no other layout reads these formats, so without this they decode through dense float
 * weights (experts: dequantized at every call), 16 or 32 bits a weight read where the file holds
 * 4.25-4.5. Here the 4-bit codes stay 4-bit (decode is memory-bound: the bytes a weight decide
 * the speed) and index a 16-entry int8 grid in registers, as llama.cpp's CPU backend does
 * (ggml_vec_dot_iq4_nl_q8_0 and kin: vpshufb on the codes, then integer dot products).
 *
 * Math. A weight row's 32-column group g is w = s_g v[c] for 4-bit codes c and the format's
 * grid v (int8): IQ4_NL's and IQ4_XS's kvalues_iq4nl in [-127, 113], MXFP4's e2m1 values
 * doubled, in [-12, 12]. s_g is a float32: IQ4_NL's d (a float16), IQ4_XS's d (sc - 32) (a
 * float16 times a 6-bit integer, formed as ggml forms it and exact), MXFP4's e8m0 scale halved
 * (2^(e - 128), exact; e = 0, 1 the subnormals ggml makes). So the weights are the file's
 * exactly. The activations are q4_matvec.c's (ss_q16_quantize_row: per block of 32,
 * dx = max|x| / 32512, X = round(x / dx) = 256 hi + lo in two int8 digits): a 16-bit
 * quantization, about 1/256 of int8's error and below bfloat16's rounding of x, and what the
 * other native kernels, hence the model tests' tolerances, assume. Per group the integer sum
 *     S_g = sum v X = 256 (v . hi) + (v . lo)
 * is exact in int32 (|S| <= 127 * 32512 * 32 < 2^27; it is rounded once to float where it
 * passes 2^24, which IQ4 grids can, MXFP4's cannot), and a row's output is
 *     y = sum_g fma((float)S_g * dx_g, s_g, y)       in column order.
 * The plain-C, AVX2 and AVX-512 VNNI loops perform the same float operations in the same order
 * on the same exact integers: the same bits from all three, whatever the thread count.
 *
 * The integer sums. VNNI's vpdpbusd multiplies unsigned bytes by signed ones, so the grid is
 * looked up (vpshufb) biased, u = v + 128 in [1, 241], and S = 256 (u . hi) + (u . lo)
 * - 128 sum(X) with sum(X) per group computed once per call. AVX2's vpmaddubsw would saturate
 * pairs of u times a digit (2 * 241 * 128 > 32767), so it takes llama.cpp's sign trick instead:
 * |X digit| (unsigned, -128 giving 128) times v carrying the digit's sign, pairs at most
 * 2 * 127 * 128 = 32512, then vpmaddwd into int32 per quad.
 *
 * Layout (made by ss_cb4_rows): rows in blocks of 16 (the last one padded with zero rows),
 * each block's 32-column groups one after another, each a record of
 *     256 bytes of codes (q4_matvec.c's 4-bit order: row r's codes of columns 4j..4j+3 are
 *     bytes 4r..4r+3 of 64-byte chunk j % 4, low nibbles for j < 4, high ones for j >= 4)
 *     | s[16] float32 (row by row)
 * 320 bytes a group: 5 bits a weight, against the file's 4.25 (MXFP4, IQ4_XS) or 4.5 (IQ4_NL).
 * The float32 scale is what lets one loop read all three formats' scales exactly (MXFP4's span
 * 2^-128..2^127, IQ4_XS's d (sc - 32) is no float16); a format-specific header (IQ4_XS's d and
 * 6-bit scales, 4.375 bits) would save 13% of the bytes and is not built.
 *
 * Threads: row blocks split over OpenMP threads (parallel.h); each output is computed by one
 * thread in one order, so its bits do not depend on the thread count or the other rows.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "half.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CB_VNNI 1
#else
#define CB_VNNI 0
#endif
/* the AVX2 loop is built wherever AVX2 is, beside the VNNI one (a flag picks it: tests) */
#if defined(__AVX2__) && defined(__FMA__)
#define CB_AVX2 1
#else
#define CB_AVX2 0
#endif
#if CB_VNNI || CB_AVX2
#include <immintrin.h>
#endif

#define CB_ROWS 16        /* rows per block: one 32-bit lane of a 512-bit vector each */
#define CB_GROUP 32       /* columns per scale */
#define CB_CODES 256      /* code bytes of a record: 16 rows x 32 columns x 4 bits */
#define CB_RECORD (CB_CODES + 4 * CB_ROWS)
#define CB_MAX_M 4        /* activation rows multiplied per pass over the weights */

/* the grids (cb4_weight.grid) and the file formats ss_cb4_rows reads */
#define CB_GRID_NL 0      /* kvalues_iq4nl: IQ4_NL, IQ4_XS */
#define CB_GRID_MX 1      /* kvalues_mxfp4: e2m1 doubled */
#define CB_FMT_MXFP4 0
#define CB_FMT_IQ4_NL 1
#define CB_FMT_IQ4_XS 2

static const int8_t cb_grids[2][16] = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},
};

void ss_q16_quantize_row(const float *x, int64_t k, int8_t *hi, int8_t *lo, float *dx,
                         float *sx);

/* --- packing ------------------------------------------------------------------------------ */

/* ggml_e8m0_to_fp32_half: 2^(e - 128) from its float32 bits, subnormals for e = 0, 1. */
static float cb_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Group g's 32 codes (column order) and its scale, of one file row. */
static void cb_group(const uint8_t *row, int fmt, int64_t g, uint8_t *c, float *s) {
    const uint8_t *qs;
    if (fmt == CB_FMT_MXFP4) {
        const uint8_t *b = row + g * 17;
        *s = cb_e8m0_half(b[0]);
        qs = b + 1;
    } else if (fmt == CB_FMT_IQ4_NL) {
        const uint8_t *b = row + g * 18;
        uint16_t d;
        memcpy(&d, b, 2);
        *s = f16_to_f32(d);
        qs = b + 2;
    } else {  /* IQ4_XS: d | scales_h (u16) | scales_l[4] | qs[128], 8 groups a block */
        const uint8_t *b = row + (g / 8) * 136;
        const int ib = (int)(g % 8);
        uint16_t d, sh;
        memcpy(&d, b, 2);
        memcpy(&sh, b + 2, 2);
        int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((sh >> (2 * ib)) & 3) << 4);
        *s = f16_to_f32(d) * (float)(ls - 32);  /* ggml's float, exact */
        qs = b + 8 + 16 * ib;
    }
    for (int i = 0; i < 16; i++) {
        c[i] = qs[i] & 0x0f;
        c[i + 16] = qs[i] >> 4;
    }
}

/* Rows [0, rows) of a matrix in file format fmt (row_bytes apart, cols a multiple of 32, of
 * 256 for IQ4_XS) into rows [row0, row0 + rows) of the packed weight (ceil(total / 16) blocks
 * of cols / 32 records), whose padding rows the caller zeroed. Rows split over `threads`. */
void ss_cb4_rows(const uint8_t *raw, int64_t row_bytes, int fmt, int64_t rows, int64_t cols,
                 int64_t row0, uint8_t *packed, int threads) {
    const int64_t G = cols / CB_GROUP, block_bytes = G * CB_RECORD;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
#endif
    for (int64_t i = 0; i < rows; i++) {
        const int64_t row = row0 + i, r = row % CB_ROWS;
        uint8_t *blk = packed + (row / CB_ROWS) * block_bytes;
        for (int64_t g = 0; g < G; g++) {
            uint8_t c[CB_GROUP];
            float s;
            cb_group(raw + i * row_bytes, fmt, g, c, &s);
            uint8_t *p = blk + g * CB_RECORD;
            for (int j = 0; j < 4; j++)  /* quads j and j + 4 share bytes */
                for (int t = 0; t < 4; t++)
                    p[64 * j + 4 * r + t] = (uint8_t)(c[4 * j + t] | c[4 * (j + 4) + t] << 4);
            memcpy(p + CB_CODES + 4 * r, &s, 4);
        }
    }
}

/* --- the product --------------------------------------------------------------------------- */

/* The outputs of one 16-row block for M activation rows: out[r * 16 + i].
 * q: M rows of 2 k int8 digits (high then low); dx: M rows of G scales. */
static inline __attribute__((always_inline)) void cb_block_generic(
        const uint8_t *blk, int64_t k, const int8_t *v, const int8_t *q, const float *dx,
        float *out, const int M) {
    float acc[CB_MAX_M][CB_ROWS];
    memset(acc, 0, sizeof acc);
    const int64_t G = k / CB_GROUP;
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = blk + g * CB_RECORD;
        for (int r = 0; r < M; r++) {
            const int8_t *xh = q + r * 2 * k + g * CB_GROUP, *xl = xh + k;
            for (int i = 0; i < CB_ROWS; i++) {
                int32_t hs = 0, ls = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) {
                        int w = v[(p[64 * (j & 3) + 4 * i + t] >> (4 * (j >> 2))) & 0x0f];
                        hs += w * xh[4 * j + t];
                        ls += w * xl[4 * j + t];
                    }
                float s;
                memcpy(&s, p + CB_CODES + 4 * i, 4);
                acc[r][i] = fmaf((float)(hs * 256 + ls) * dx[r * G + g], s, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < M; r++) memcpy(out + r * CB_ROWS, acc[r], sizeof acc[r]);
}

#if CB_VNNI
/* cb_block_generic with VNNI: 16 rows a vector, the biased grid u = v + 128 looked up by
 * vpshufb, S = 256 (u . hi) + u . lo - 128 sum(X); sxi: M rows of G integer sums of X. */
static inline __attribute__((always_inline)) void cb_block_vnni(
        const uint8_t *blk, int64_t k, const int8_t *v, const int8_t *q, const float *dx,
        const int32_t *sxi, float *out, const int M) {
    __m512 acc[CB_MAX_M];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(_mm_xor_si128(
        _mm_loadu_si128((const __m128i *)v), _mm_set1_epi8((char)0x80)));  /* v + 128 */
    const int64_t G = k / CB_GROUP;
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = blk + g * CB_RECORD;
        __m512i u[8];
        for (int c = 0; c < 4; c++) {
            __m512i b = _mm512_loadu_si512((const void *)(p + 64 * c));
            u[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(b, low));
            u[c + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(b, 4), low));
        }
        const __m512 s = _mm512_loadu_ps((const void *)(p + CB_CODES));
        for (int r = 0; r < M; r++) {
            const int8_t *xh = q + r * 2 * k + g * CB_GROUP, *xl = xh + k;
            __m512i hs = _mm512_setzero_si512(), ls = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t a, b;
                memcpy(&a, xh + 4 * j, 4);
                memcpy(&b, xl + 4 * j, 4);
                hs = _mm512_dpbusd_epi32(hs, u[j], _mm512_set1_epi32(a));
                ls = _mm512_dpbusd_epi32(ls, u[j], _mm512_set1_epi32(b));
            }
            __m512i S = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hs, 8), ls),
                                         _mm512_set1_epi32(128 * sxi[r * G + g]));
            __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(S), _mm512_set1_ps(dx[r * G + g]));
            acc[r] = _mm512_fmadd_ps(prod, s, acc[r]);
        }
    }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(out + r * CB_ROWS, acc[r]);
}
#endif

#if CB_AVX2
/* v . (4 digits broadcast) summed into int32 lanes: |digits| times v with the digits' signs
 * (vpmaddubsw pairs at most 2 * 127 * 128), then pairs of pairs (vpmaddwd). */
static inline __m256i cb_dot4_avx2(__m256i w, const int8_t *x4, __m256i acc) {
    int32_t a;
    memcpy(&a, x4, 4);
    const __m256i xb = _mm256_set1_epi32(a);
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(w, xb));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* cb_block_generic with AVX2: 8 rows a vector, the block in two halves (the second re-reads
 * the block's records from cache), the grid's signed values looked up by vpshufb. */
static inline __attribute__((always_inline)) void cb_block_avx2(
        const uint8_t *blk, int64_t k, const int8_t *v, const int8_t *q, const float *dx,
        float *out, const int M) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)v));
    const int64_t G = k / CB_GROUP;
    for (int h = 0; h < 2; h++) {
        __m256 acc[CB_MAX_M];
        for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *p = blk + g * CB_RECORD;
            __m256i w[8];
            for (int c = 0; c < 4; c++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(p + 64 * c + 32 * h));
                w[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(b, low));
                w[c + 4] = _mm256_shuffle_epi8(table,
                                               _mm256_and_si256(_mm256_srli_epi16(b, 4), low));
            }
            const __m256 s = _mm256_loadu_ps((const float *)(p + CB_CODES + 32 * h));
            for (int r = 0; r < M; r++) {
                const int8_t *xh = q + r * 2 * k + g * CB_GROUP, *xl = xh + k;
                __m256i hs = _mm256_setzero_si256(), ls = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    hs = cb_dot4_avx2(w[j], xh + 4 * j, hs);
                    ls = cb_dot4_avx2(w[j], xl + 4 * j, ls);
                }
                __m256i S = _mm256_add_epi32(_mm256_slli_epi32(hs, 8), ls);
                __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(dx[r * G + g]));
                acc[r] = _mm256_fmadd_ps(prod, s, acc[r]);
            }
        }
        for (int r = 0; r < M; r++) _mm256_storeu_ps(out + r * CB_ROWS + 8 * h, acc[r]);
    }
}
#endif

#define CB_X_F32 1    /* flags: x is float32 (else bfloat16); as q4_matvec.c's */
#define CB_Y_F32 2    /* y is float32 (else bfloat16) */
#define CB_GENERIC 4  /* the plain-C loop even where a vector loop is compiled in (tests) */
#define CB_USE_AVX2 16  /* the AVX2 loop even where the VNNI one is compiled in (tests) */
#define CB_THREADS_SHIFT 8

typedef struct {
    const uint8_t *w;
    int64_t n, k, nb, m;
    int y_f32, path;  /* path: 0 the best compiled loop, 1 plain C, 2 AVX2 */
    const int8_t *v, *q;
    const float *dx;
    const int32_t *sxi;
    void *y;
} cb_job;

/* Blocks [b0, b1) for M activation rows at once. */
static inline __attribute__((always_inline)) void cb_blocks(const cb_job *j, int64_t b0,
                                                           int64_t b1, int64_t r0, const int M) {
    const int64_t k = j->k, G = k / CB_GROUP, block_bytes = G * CB_RECORD;
    const int8_t *q = j->q + r0 * 2 * k;
    const float *dx = j->dx + r0 * G;
    const int32_t *sxi = j->sxi + r0 * G;
    float out[CB_MAX_M * CB_ROWS];
    (void)sxi;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = j->w + b * block_bytes;
#if CB_VNNI
        if (j->path == 0) cb_block_vnni(blk, k, j->v, q, dx, sxi, out, M);
        else
#endif
#if CB_AVX2
        if (j->path != 1) cb_block_avx2(blk, k, j->v, q, dx, out, M);
        else
#endif
        cb_block_generic(blk, k, j->v, q, dx, out, M);
        const int64_t n = j->n, row = b * CB_ROWS, rows = n - row < CB_ROWS ? n - row : CB_ROWS;
        for (int r = 0; r < M; r++) {
            const float *o = out + r * CB_ROWS;
            if (j->y_f32) {
                memcpy((float *)j->y + (r0 + r) * n + row, o, (size_t)rows * sizeof(float));
            } else {
                uint16_t *yb = (uint16_t *)j->y + (r0 + r) * n + row;
                for (int64_t i = 0; i < rows; i++) yb[i] = f32_to_bf16(o[i]);
            }
        }
    }
}

/* part `part` of `parts` equal ranges of the row blocks, all activation rows, in passes of up
 * to CB_MAX_M rows (each pass reads the blocks once) */
static void cb_run_part(const void *job, int part, int parts) {
    const cb_job *j = job;
    int64_t b0 = j->nb * part / parts, b1 = j->nb * (part + 1) / parts;
    for (int64_t r0 = 0; r0 < j->m; r0 += CB_MAX_M) {
        switch (j->m - r0 < CB_MAX_M ? j->m - r0 : CB_MAX_M) {
        case 1: cb_blocks(j, b0, b1, r0, 1); break;
        case 2: cb_blocks(j, b0, b1, r0, 2); break;
        case 3: cb_blocks(j, b0, b1, r0, 3); break;
        default: cb_blocks(j, b0, b1, r0, 4); break;
        }
    }
}

/* sxi (m, k / 32) = sum(X) per 32-column group of m rows of quantized activations q (2 k
 * digits a row, high then low: ss_q16_quantize_row's), exactly: what the VNNI loop subtracts. */
void ss_cb4_group_sums(const int8_t *q, int64_t m, int64_t k, int32_t *sxi) {
    const int64_t G = k / CB_GROUP;
    for (int64_t r = 0; r < m; r++) {
        const int8_t *qr = q + r * k * 2;
        for (int64_t g = 0; g < G; g++) {
            int32_t t = 0;
            for (int i = 0; i < CB_GROUP; i++)
                t += 256 * qr[g * CB_GROUP + i] + qr[k + g * CB_GROUP + i];
            sxi[r * G + g] = t;
        }
    }
}

/* A packed weight (what Cb4Linear holds), passed as one pointer; its first fields are
 * q4_matvec.c's and q6_matvec.c's (moe_ffn.c reads n and k through them). */
typedef struct {
    const uint8_t *w;
    int64_t n, k;
    int64_t grid;  /* CB_GRID_NL or CB_GRID_MX */
} cb4_weight;

/* y (m, n) = x (m, k) @ W^T for W (n, k) packed as above; x and y rows contiguous. */
void ss_cb4_matvec(const cb4_weight *wd, const void *x, void *y, int64_t m, int64_t flags) {
    const int64_t n = wd->n, k = wd->k, G = k / CB_GROUP;
    const int64_t nb = (n + CB_ROWS - 1) / CB_ROWS;
    size_t fbytes = (size_t)k * sizeof(float);
    size_t qbytes = (size_t)(m * k * 2 + 63) / 64 * 64;
    size_t dbytes = 2 * (size_t)(m * G) * sizeof(float);
    char *scratch = malloc(fbytes + qbytes + dbytes + (size_t)(m * G) * sizeof(int32_t));
    if (scratch == NULL) return;  /* the caller's output stays as it was */
    float *xf = (float *)scratch;
    int8_t *q = (int8_t *)(scratch + fbytes);
    float *dx = (float *)(scratch + fbytes + qbytes), *sx = dx + m * G;
    int32_t *sxi = (int32_t *)(scratch + fbytes + qbytes + dbytes);
    for (int64_t r = 0; r < m; r++) {
        const float *row = row_as_f32(x, r, k, (flags & CB_X_F32) != 0, xf);
        int8_t *qr = q + r * k * 2;
        ss_q16_quantize_row(row, k, qr, qr + k, dx + r * G, sx + r * G);
    }
    ss_cb4_group_sums(q, m, k, sxi);
    int path = (flags & CB_GENERIC) ? 1 : (flags & CB_USE_AVX2) && CB_AVX2 ? 2 : 0;
    cb_job j = {wd->w, n, k, nb, m, (flags & CB_Y_F32) != 0, path,
                cb_grids[wd->grid == CB_GRID_MX], q, dx, sxi, y};
    int64_t threads = flags >> CB_THREADS_SHIFT;
    if (threads > nb / 4) threads = nb / 4;  /* at least 4 blocks a thread */
    ss_parallel(cb_run_part, &j, threads < 1 ? 1 : (int)threads, nb);
    free(scratch);
}

/* y (m, n) float32 = x @ W^T for m rows already quantized (q, dx as ss_q16_quantize_row makes
 * them, 2 k digits and k / 32 scales a row; sxi ss_cb4_group_sums'), on the calling thread, by
 * the best compiled loop: the bits ss_cb4_matvec gives the same rows (its rows are quantized
 * the same way and each output is summed in the same order). moe_rows.c's expert products.
 * The blocks outer, the passes of CB_MAX_M rows inner: a block (16 rows of gpt-oss's 2880
 * columns: 28.8 kB) is read from RAM once for all m rows and re-read from L1/L2 by the next
 * pass, where ss_cb4_matvec's passes each stream the whole weight (a gpt-oss gate/up, 10.4
 * MB, 8 times for 32 rows). */
void ss_cb4_qrows(const cb4_weight *wd, const int8_t *q, const float *dx, const int32_t *sxi,
                  int64_t m, float *y) {
    const int64_t nb = (wd->n + CB_ROWS - 1) / CB_ROWS;
    cb_job j = {wd->w, wd->n, wd->k, nb, m, 1, 0, cb_grids[wd->grid == CB_GRID_MX], q, dx, sxi,
                y};
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r0 = 0; r0 < m; r0 += CB_MAX_M) {
            switch (m - r0 < CB_MAX_M ? m - r0 : CB_MAX_M) {
            case 1: cb_blocks(&j, b, b + 1, r0, 1); break;
            case 2: cb_blocks(&j, b, b + 1, r0, 2); break;
            case 3: cb_blocks(&j, b, b + 1, r0, 3); break;
            default: cb_blocks(&j, b, b + 1, r0, 4); break;
            }
        }
}

/* Which loops this build has: 1 VNNI, 2 AVX2 (bits; 0: plain C alone). */
int ss_cb4_loops(void) { return CB_VNNI | CB_AVX2 << 1; }
