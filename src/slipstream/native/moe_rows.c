/* A prefill's routed experts in one call: the CPU mixture-of-experts FFN for T > 1 rows
 * (weights/cpu/expert_rows.py),
 *     out[t] = sum_j w[t, j] (down_e(act(gate_e x_t + bg_e) * (up_e x_t + bu_e)) + bd_e)
 * over the experts e = ids[t, j] of each row, for experts packed as moe_ffn.c's (gate/up q4vnni
 * or q8vnni records or cb4, down those, q6vnni or cb4), act ss_glu_f32's (SwiGLU, GeGLU's tanh
 * form, gpt-oss's clamped SwiGLU), the biases gpt-oss's (NULL elsewhere).
 *
 * Why: through torch (model.moe.experts_ffn), each of a layer's ~128 experts was an
 * index_select, two kernel calls that each quantized their rows again and forked OpenMP, a
 * SwiGLU, a scale and an index_add_; index_add_ alone went row by row and was 0.7 of a 2.75 s
 * pp512 of a 4-layer Qwen3-30B-A3B-shaped model on the 2-core EPYC, and 5.4 of 11.5 s with
 * another process busy on one core, its thousands of small regions each waiting for a
 * descheduled thread. Here one OpenMP region does the layer:
 *
 *   1. each row of x quantized once (16-bit, two int8 digits: q4_matvec.c), rows shared out;
 *   2. work items, an expert's rows in chunks of at most MOE_ROWS_MAX, largest first, taken by
 *      the threads as they come free (dynamic): a thread descheduled by another process holds
 *      up one item, not the layer. An item gathers its rows' quantized x, runs gate/up
 *      (ss_q4_rows, or ss_cb4_qrows for cb4: the weight's blocks outer, so a block is read from
 *      RAM once for the item's rows), adds the gate/up bias and forms the gated product in
 *      float32 (ss_glu_f32), quantizes the products, runs down (ss_q4_rows, ss_q6_rows or
 *      ss_cb4_qrows), adds the down bias, and writes each row's term w y, rounded once, into
 *      that row's slot;
 *   3. each row's terms added up in ascending expert order from 0, as experts_ffn's
 *      index_add_ does expert after expert.
 *
 * Bits: every step is the per-expert path's own (native_expert_ffn: the same quantization of
 * each row, the same block sums, ss_glu_f32 with the bias added first, the down bias added
 * as torch.add(bias, y), the product y * w, then the sum in expert order), so the output
 * equals experts_ffn's over native_expert_ffn bit for bit (where that path keeps an expert's
 * rows packed: up to 256), whatever the thread count or the chunking: each output is computed
 * by one thread in one order. And a
 * row's output equals a decode token's through moe_ffn.c, which adds the same terms in the
 * same order.
 */

#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* moe_expert.h's experts; here gate/up a q4_weight or a cb4_weight and down a q4_weight, a
 * q6_weight or a cb4_weight (MOE_ROWS_LAYOUTS): iq experts go through the per-expert path */
#include "moe_expert.h"

void ss_q16_quantize_row(const float *x, int64_t k, int8_t *hi, int8_t *lo, float *dx,
                         float *sx);
void ss_q4_rows(const void *wd, const int8_t *q, const float *dx, const float *sx, int64_t m,
                float *y);
void ss_q6_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *q, float *dx, float *sx,
                         int32_t *sxi);
void ss_q6_rows(const void *wd, const int8_t *q, const float *dx, const int32_t *sxi, int64_t m,
                float *y);
void ss_glu_f32(float *gate_up, const float *bias, int64_t m, int64_t n, int64_t act,
                float *out);
void ss_cb4_group_sums(const int8_t *q, int64_t m, int64_t k, int32_t *sxi);
void ss_cb4_qrows(const void *wd, const int8_t *q, const float *dx, const int32_t *sxi,
                  int64_t m, float *y);

#define MOE_ROWS_LAYOUTS (MOE_DOWN_Q6 | MOE_GATE_UP_CB4 | MOE_DOWN_CB4)

/* Rows a work item takes at most. An expert's whole weights (2.7 MB of Qwen3-30B-A3B's, Q4_K)
 * are read once an item, about what one row's products cost on one core, so 32 rows keep the
 * reads near 3% while a layer of 512 rows x 8 experts still makes 128+ items for two threads
 * to share. */
#define MOE_ROWS_MAX 32
#define MOE_GROUP 32   /* columns per activation scale */
#define MOE_ALIGN 64

typedef struct {
    int64_t e, first, rows;  /* expert, its first pair in the expert-sorted list, how many */
} moe_item;

/* The workspace's parts, in bytes from its start, for T rows of top-k over n_experts experts
 * of width hidden and units, shared by `threads` threads. */
typedef struct {
    size_t terms, qx, dxx, sxx, sxix, pairs, offsets, next, items, thread0, per_thread, total;
} moe_layout;

static size_t moe_up(size_t n) { return (n + MOE_ALIGN - 1) / MOE_ALIGN * MOE_ALIGN; }

static moe_layout moe_plan(int64_t n_experts, int64_t T, int64_t k, int64_t hidden,
                           int64_t units, int64_t threads) {
    moe_layout L;
    const size_t R = MOE_ROWS_MAX, Gh = (size_t)hidden / MOE_GROUP, Gu = (size_t)units / MOE_GROUP;
    const size_t pairs = (size_t)(T * k), items = pairs / R + (size_t)n_experts + 1;
    size_t at = 0;
    L.terms = at;   at += moe_up(pairs * (size_t)hidden * sizeof(float));
    L.qx = at;      at += moe_up((size_t)T * 2 * (size_t)hidden);
    L.dxx = at;     at += moe_up((size_t)T * Gh * sizeof(float));
    L.sxx = at;     at += moe_up((size_t)T * Gh * sizeof(float));
    L.sxix = at;    at += moe_up((size_t)T * Gh * sizeof(int32_t));
    L.pairs = at;   at += moe_up(pairs * sizeof(int64_t));
    L.offsets = at; at += moe_up(((size_t)n_experts + 1) * sizeof(int64_t));
    L.next = at;    at += moe_up((size_t)n_experts * sizeof(int64_t));
    L.items = at;   at += moe_up(items * sizeof(moe_item));
    L.thread0 = at;
    /* per thread: gathered x digits, dx, sx, group sums (cb4 gate/up); gate/up; products;
     * their digits, dx, sx, sums per 16 columns (q6 down; cb4's per 32 in the same place);
     * down's output */
    L.per_thread = moe_up(R * 2 * (size_t)hidden) + 2 * moe_up(R * Gh * sizeof(float))
                   + moe_up(R * Gh * sizeof(int32_t))
                   + moe_up(R * 2 * (size_t)units * sizeof(float))
                   + moe_up(R * (size_t)units * sizeof(float)) + moe_up(R * 2 * (size_t)units)
                   + 2 * moe_up(R * Gu * sizeof(float))
                   + moe_up(R * ((size_t)units / 16) * sizeof(int32_t))
                   + moe_up(R * (size_t)hidden * sizeof(float));
    at += (size_t)(threads < 1 ? 1 : threads) * L.per_thread;
    L.total = at;
    return L;
}

/* The widths of the experts: hidden (gate/up's k) and units (down's k); -1 where the experts
 * disagree with each other or gate/up is not 2 * units by hidden and down hidden by units. */
static int moe_widths(const moe_expert *const *experts, int64_t n_experts, int64_t *hidden,
                      int64_t *units) {
    const moe_weight_head *gu = experts[0]->gate_up, *dn = experts[0]->down;
    *hidden = gu->k;
    *units = dn->k;
    for (int64_t e = 0; e < n_experts; e++) {
        gu = experts[e]->gate_up;
        dn = experts[e]->down;
        if (gu->k != *hidden || gu->n != 2 * *units || dn->k != *units || dn->n != *hidden
            || (experts[e]->layouts & ~(int64_t)MOE_ROWS_LAYOUTS))
            return -1;
    }
    if (*hidden % MOE_GROUP || *units % MOE_GROUP) return -1;
    return 0;
}

/* Bytes of workspace ss_moe_rows needs for T rows of top-k on `threads` threads; -1 where the
 * experts' shapes do not fit together (see moe_widths). */
int64_t ss_moe_rows_workspace(const moe_expert *const *experts, int64_t n_experts, int64_t T,
                              int64_t k, int64_t threads) {
    int64_t hidden, units;
    if (moe_widths(experts, n_experts, &hidden, &units) != 0) return -1;
    return (int64_t)moe_plan(n_experts, T, k, hidden, units, threads).total;
}

/* One work item: rows pairs[first .. first + rows) of expert e, into their slots of terms. */
static void moe_item_run(const moe_expert *ex, const moe_item *it, const int64_t *pairs,
                         const int64_t *ids, const float *w, int64_t k, int64_t hidden,
                         int64_t units, int64_t act, const int8_t *qx, const float *dxx,
                         const float *sxx, const int32_t *sxix, char *scratch, float *terms) {
    const int64_t R = MOE_ROWS_MAX, Gh = hidden / MOE_GROUP, Gu = units / MOE_GROUP;
    const int64_t m = it->rows;
    int8_t *qg = (int8_t *)scratch;
    float *dxg = (float *)(scratch + moe_up((size_t)(R * 2 * hidden)));
    float *sxg = (float *)((char *)dxg + moe_up((size_t)(R * Gh) * sizeof(float)));
    int32_t *sxig = (int32_t *)((char *)sxg + moe_up((size_t)(R * Gh) * sizeof(float)));
    float *gu = (float *)((char *)sxig + moe_up((size_t)(R * Gh) * sizeof(int32_t)));
    float *prod = (float *)((char *)gu + moe_up((size_t)(R * 2 * units) * sizeof(float)));
    int8_t *qa = (int8_t *)((char *)prod + moe_up((size_t)(R * units) * sizeof(float)));
    float *dxa = (float *)((char *)qa + moe_up((size_t)(R * 2 * units)));
    float *sxa = (float *)((char *)dxa + moe_up((size_t)(R * Gu) * sizeof(float)));
    int32_t *sxia = (int32_t *)((char *)sxa + moe_up((size_t)(R * Gu) * sizeof(float)));
    float *y = (float *)((char *)sxia + moe_up((size_t)(R * (units / 16)) * sizeof(int32_t)));
    for (int64_t r = 0; r < m; r++) {  /* the rows' quantized x, gathered */
        const int64_t t = pairs[it->first + r] / k;
        memcpy(qg + r * 2 * hidden, qx + t * 2 * hidden, (size_t)(2 * hidden));
        memcpy(dxg + r * Gh, dxx + t * Gh, (size_t)Gh * sizeof(float));
        memcpy(sxg + r * Gh, sxx + t * Gh, (size_t)Gh * sizeof(float));
        memcpy(sxig + r * Gh, sxix + t * Gh, (size_t)Gh * sizeof(int32_t));
    }
    if (ex->layouts & MOE_GATE_UP_CB4) ss_cb4_qrows(ex->gate_up, qg, dxg, sxig, m, gu);
    else ss_q4_rows(ex->gate_up, qg, dxg, sxg, m, gu);
    ss_glu_f32(gu, ex->gate_up_bias, m, units, act, prod);  /* the bias added in place first */
    if (ex->layouts & MOE_DOWN_Q6) {
        ss_q6_quantize_rows(prod, m, units, qa, dxa, sxa, sxia);
        ss_q6_rows(ex->down, qa, dxa, sxia, m, y);
    } else {
        for (int64_t r = 0; r < m; r++)
            ss_q16_quantize_row(prod + r * units, units, qa + r * 2 * units,
                                qa + r * 2 * units + units, dxa + r * Gu, sxa + r * Gu);
        if (ex->layouts & MOE_DOWN_CB4) {
            ss_cb4_group_sums(qa, m, units, sxia);
            ss_cb4_qrows(ex->down, qa, dxa, sxia, m, y);
        } else {
            ss_q4_rows(ex->down, qa, dxa, sxa, m, y);
        }
    }
    if (ex->down_bias != NULL)  /* bias + y, as torch.add(bias, y) (native_expert_ffn) */
        for (int64_t r = 0; r < m; r++) {
            float *yr = y + r * hidden;
            for (int64_t i = 0; i < hidden; i++) yr[i] = ex->down_bias[i] + yr[i];
        }
    for (int64_t r = 0; r < m; r++) {
        const int64_t p = pairs[it->first + r], t = p / k, e = ids[p];
        int64_t slot = 0;  /* the expert's rank among the row's: ascending ids, then j */
        for (int64_t j = 0; j < k; j++) {
            const int64_t o = ids[t * k + j];
            slot += o < e || (o == e && t * k + j < p);
        }
        const float wj = w[p], *yr = y + r * hidden;
        float *dst = terms + (t * k + slot) * hidden;
        for (int64_t i = 0; i < hidden; i++) dst[i] = yr[i] * wj;
    }
}

/* out (T, hidden) float32 = each row's routed experts' outputs weighted by w and summed, for
 * x (T, hidden) float32, ids (T, k) int64 and w (T, k) float32, the experts' descriptors in
 * `experts` (n_experts of them), `act` ss_glu_f32's (0 SiLU, 1 GELU tanh, 2 gpt-oss's), on
 * `threads` threads, in `workspace` (at least ss_moe_rows_workspace bytes). Returns 0; -1
 * where the experts' shapes do not fit together; -2 - i where ids[i] is not an expert
 * (nothing written to out in either case). */
int ss_moe_rows(const moe_expert *const *experts, int64_t n_experts, const float *x, int64_t T,
                const int64_t *ids, const float *w, int64_t k, float *out, void *workspace,
                int64_t threads, int64_t act) {
    int64_t hidden, units;
    if (moe_widths(experts, n_experts, &hidden, &units) != 0) return -1;
    for (int64_t p = 0; p < T * k; p++)
        if (ids[p] < 0 || ids[p] >= n_experts) return (int)(-2 - p);
    if (threads < 1) threads = 1;
    const moe_layout L = moe_plan(n_experts, T, k, hidden, units, threads);
    char *ws = workspace;
    float *terms = (float *)(ws + L.terms);
    int8_t *qx = (int8_t *)(ws + L.qx);
    float *dxx = (float *)(ws + L.dxx), *sxx = (float *)(ws + L.sxx);
    int32_t *sxix = (int32_t *)(ws + L.sxix);
    int64_t *pairs = (int64_t *)(ws + L.pairs), *offsets = (int64_t *)(ws + L.offsets);
    moe_item *items = (moe_item *)(ws + L.items);
    const int64_t Gh = hidden / MOE_GROUP, R = MOE_ROWS_MAX;

    /* the (row, slot) pairs grouped by expert, in row order within one (a counting sort) */
    memset(offsets, 0, (size_t)(n_experts + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < T * k; p++) offsets[ids[p] + 1]++;
    for (int64_t e = 0; e < n_experts; e++) offsets[e + 1] += offsets[e];
    int64_t *next = (int64_t *)(ws + L.next);
    memcpy(next, offsets, (size_t)n_experts * sizeof(int64_t));
    for (int64_t p = 0; p < T * k; p++) pairs[next[ids[p]]++] = p;
    /* work items: each expert's rows in near-equal chunks of at most R, the largest first
     * (a counting sort by size), so that the last items taken are the short ones */
    int64_t n_items = 0;
    for (int64_t size = R; size >= 1; size--) {
        for (int64_t e = 0; e < n_experts; e++) {
            const int64_t c = offsets[e + 1] - offsets[e];
            if (c == 0) continue;
            const int64_t chunks = (c + R - 1) / R;
            for (int64_t i = 0, first = offsets[e]; i < chunks; i++) {
                const int64_t rows = c / chunks + (i < c % chunks);
                if (rows == size) items[n_items++] = (moe_item){e, first, rows};
                first += rows;
            }
        }
    }

    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads((int)threads) if (threads > 1)
#endif
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        char *scratch = ws + L.thread0 + (size_t)me * L.per_thread;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 16)
#endif
        for (int64_t t = 0; t < T; t++) {
            ss_q16_quantize_row(x + t * hidden, hidden, qx + t * 2 * hidden,
                                qx + t * 2 * hidden + hidden, dxx + t * Gh, sxx + t * Gh);
            ss_cb4_group_sums(qx + t * 2 * hidden, 1, hidden, sxix + t * Gh);  /* cb4's */
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < n_items; i++)
            moe_item_run(experts[items[i].e], &items[i], pairs, ids, w, k, hidden, units, act,
                         qx, dxx, sxx, sxix, scratch, terms);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 16)
#endif
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * hidden;
            for (int64_t i = 0; i < hidden; i++) o[i] = 0.0f;
            for (int64_t s = 0; s < k; s++) {  /* experts_ffn's order: ascending experts */
                const float *src = terms + (t * k + s) * hidden;
                for (int64_t i = 0; i < hidden; i++) o[i] = o[i] + src[i];
            }
        }
    }
    return 0;
}
