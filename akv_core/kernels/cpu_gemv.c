/* Weight-only quantized products for decode-sized inputs (a few rows) on x86 CPUs with AVX2 and FMA.
 *
 * The input rows are quantized per block of 32 to int8 with one fp32 scale (as llama.cpp's Q8 blocks),
 * so each block of weights meets its block of inputs in integer SIMD (vpmaddubsw + vpmaddwd: 32
 * products in two instructions), and the weights are read once for all input rows.
 *
 *   akv_q4_gemv: weights in 4-bit groups of 32 with a scale and an offset (Q4_1):
 *                w = scale * q + offset, q in 0..15, 16 bytes per group (byte j: q[j] low, q[j+16] high)
 *   akv_q8_gemv: int8 weights (-127..127) with one scale per output row
 *
 * y [M, N] fp32 = h(x) [M, K] times the weights [N, K] transposed (y += with `accumulate`: the
 * residual stream updated in place); K a multiple of 32, M at most AKV_MAX_ROWS. The input h(x) is x
 * itself, or with `glu` SiLU(x[:, :K]) * x[:, K:] (x [M, 2K]: the MLP's gate and up halves), then,
 * with `norm`, RMSNorm(h) * norm (fp32, as the model's own rms_norm): the small operations around a
 * product happen while its input is quantized instead of as separate tensor operations.
 *
 *   akv_decode_attention: one new token per sequence: RoPE on its q and k heads, its K/V written to
 *                its pool slot, then attention over the sequence's listed slots read in place.
 *
 * Structure: a product quantizes its input rows once (`quantize`), then an inner kernel fills one range of
 * output columns [n0, n1) (`q4_columns`, `q8_columns`); attention rotates and stores the new K/V per row range
 * (`rotate_and_store`), then attends per range of (row, head) items (`attend`). A column's or a head's result
 * does not depend on the range it was computed in.
 *
 * Built at run time by akv_core/kernels/cpu_gemv.py, only where the CPU has AVX2 and FMA.
 */
#define _POSIX_C_SOURCE 200809L
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define AKV_BLOCK 32
#define AKV_MAX_ROWS 16
#define AKV_PREFETCH 1024  /* bytes ahead of the weights being read */

int akv_max_rows(void) { return AKV_MAX_ROWS; }

/* x [M, K] -> q int8 [M, K], d [M, K/32] (q * d ~ x), s [M, K/32] (d * sum of the block's q). */
static void quantize_rows(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, float *s) {
    const int64_t blocks = k / AKV_BLOCK;
    for (int64_t i = 0; i < m_rows * blocks; i++) {
        const float *p = x + i * AKV_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < AKV_BLOCK; j++) amax = fmaxf(amax, fabsf(p[j]));
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < AKV_BLOCK; j++) {
            const int v = (int)lrintf(p[j] * inverse);
            q[i * AKV_BLOCK + j] = (int8_t)v;
            sum += v;
        }
        d[i] = scale;
        s[i] = scale * (float)sum;
    }
}

static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* 32 unsigned 4-bit weights of one group, in input order (low nibbles first). */
static inline __m256i q4_group(const uint8_t *bytes) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)bytes), low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
}

/* Sum of 32 products of unsigned weights (0..127) and signed inputs, as 8 int32 lanes in float. */
static inline __m256 dot_u8_s8(__m256i w, __m256i a) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

typedef struct { int8_t *q; float *d, *s; } Quantized;

/* The product's input rows h(x) [M, K] (see the header), into `h`. */
static void prologue(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, float *h) {
    for (int64_t m = 0; m < m_rows; m++) {
        float *row = h + m * k;
        if (glu) {
            const float *gate = x + m * 2 * k, *up = gate + k;
            for (int64_t i = 0; i < k; i++) row[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        } else {
            for (int64_t i = 0; i < k; i++) row[i] = x[m * k + i];
        }
        if (norm) {
            float sum = 0.0f;
            for (int64_t i = 0; i < k; i++) sum += row[i] * row[i];
            const float scale = 1.0f / sqrtf(sum / (float)k + eps);
            for (int64_t i = 0; i < k; i++) row[i] = norm[i] * (row[i] * scale);
        }
    }
}

/* Room for the quantized input rows of a product of up to `k` columns: q [M, K], d and s [M, K / 32], and the
 * prologue's rows h [M, K] (2K: the glu's gate and up halves are read from x, not copied). */
typedef struct { Quantized a; float *h; } Scratch;

static int reserve(Scratch *r, int64_t m_rows, int64_t k) {
    r->a.q = malloc((size_t)(m_rows * k));
    r->a.d = malloc(sizeof(float) * (size_t)(m_rows * (k / AKV_BLOCK)));
    r->a.s = malloc(sizeof(float) * (size_t)(m_rows * (k / AKV_BLOCK)));
    r->h = malloc(sizeof(float) * (size_t)(m_rows * k));
    return r->a.q && r->a.d && r->a.s && r->h ? 0 : -1;
}

static void release(Scratch *r) { free(r->a.q); free(r->a.d); free(r->a.s); free(r->h); }

/* Rows [m0, m1) of h(x) [M, K] (see the header) quantized into r->a (rows are independent: ranges of rows can
 * run on different threads). */
static void quantize(const float *x, int64_t m0, int64_t m1, int64_t k, const float *norm, float eps, int glu,
                     Scratch *r) {
    const int64_t blocks = k / AKV_BLOCK;
    const float *xs = x + m0 * (glu ? 2 * k : k);
    float *h = r->h + m0 * k;
    if (norm || glu) prologue(xs, m1 - m0, k, norm, eps, glu, h);
    quantize_rows((norm || glu) ? h : xs, m1 - m0, k, r->a.q + m0 * k, r->a.d + m0 * blocks, r->a.s + m0 * blocks);
}

/* Blocks [b0, b1) of every row of h(x) [M, K] without a norm (x itself, or with `glu` SiLU(gate) * up)
 * quantized into r->a: blocks are independent, so ranges of blocks can run on different threads. */
static void quantize_blocks(const float *x, int64_t m_rows, int64_t b0, int64_t b1, int64_t k, int glu, Scratch *r) {
    const int64_t blocks = k / AKV_BLOCK, i0 = b0 * AKV_BLOCK, width = (b1 - b0) * AKV_BLOCK;
    for (int64_t m = 0; m < m_rows; m++) {
        const float *row = x + m * k + i0;
        if (glu) {
            const float *gate = x + m * 2 * k + i0, *up = gate + k;
            float *h = r->h + m * k + i0;
            for (int64_t i = 0; i < width; i++) h[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            row = h;
        }
        quantize_rows(row, 1, width, r->a.q + m * k + i0, r->a.d + m * blocks + b0, r->a.s + m * blocks + b0);
    }
}

static inline void store(float *y, float value, int accumulate) { *y = accumulate ? *y + value : value; }

/* Columns [n0, n1) of y [M, N] for the 4-bit weights: the inner kernel of akv_q4_gemv, over one range of output
 * columns so that ranges can run on different threads (each column's sum is the same whatever the range). */
static void q4_columns(const Quantized *a, int64_t m_rows, int64_t k, int accumulate, const uint8_t *w,
                       const float *w_scale, const float *w_offset, int64_t n, int64_t n0, int64_t n1, float *y) {
    const int64_t blocks = k / AKV_BLOCK;
    for (int64_t row = n0; row < n1; row++) {
        const uint8_t *wr = w + row * blocks * (AKV_BLOCK / 2);
        const float *scale = w_scale + row * blocks, *offset = w_offset + row * blocks;
        if (m_rows == 1) {  /* one stream: two accumulators, so the FMA chain does not stall */
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float off = 0.0f;
            int64_t b = 0;
            for (; b + 1 < blocks; b += 2) {
                const __m256 p0 = dot_u8_s8(q4_group(wr + b * 16), _mm256_loadu_si256((const __m256i *)(a->q + b * 32)));
                const __m256 p1 = dot_u8_s8(q4_group(wr + (b + 1) * 16),
                                            _mm256_loadu_si256((const __m256i *)(a->q + (b + 1) * 32)));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a->d[b]), p0, acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(scale[b + 1] * a->d[b + 1]), p1, acc1);
                off += offset[b] * a->s[b] + offset[b + 1] * a->s[b + 1];
            }
            for (; b < blocks; b++) {
                const __m256 p = dot_u8_s8(q4_group(wr + b * 16), _mm256_loadu_si256((const __m256i *)(a->q + b * 32)));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a->d[b]), p, acc0);
                off += offset[b] * a->s[b];
            }
            store(y + row, hsum(_mm256_add_ps(acc0, acc1)) + off, accumulate);
            continue;
        }
        __m256 acc[AKV_MAX_ROWS];
        float off[AKV_MAX_ROWS];
        for (int64_t m = 0; m < m_rows; m++) { acc[m] = _mm256_setzero_ps(); off[m] = 0.0f; }
        for (int64_t b = 0; b < blocks; b++) {
            const __m256i wv = q4_group(wr + b * 16);
            for (int64_t m = 0; m < m_rows; m++) {
                const int64_t i = m * blocks + b;
                const __m256 p = dot_u8_s8(wv, _mm256_loadu_si256((const __m256i *)(a->q + i * 32)));
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a->d[i]), p, acc[m]);
                off[m] += offset[b] * a->s[i];
            }
        }
        for (int64_t m = 0; m < m_rows; m++) store(y + m * n + row, hsum(acc[m]) + off[m], accumulate);
    }
}

/* Columns [n0, n1) of y [M, N] for int8 weights: the inner kernel of akv_q8_gemv (see q4_columns). */
static void q8_columns(const Quantized *a, int64_t m_rows, int64_t k, int accumulate, const int8_t *w,
                       const float *w_scale, int64_t n, int64_t n0, int64_t n1, float *y) {
    const int64_t blocks = k / AKV_BLOCK;
    for (int64_t row = n0; row < n1; row++) {
        const int8_t *wr = w + row * k;
        if (m_rows == 1) {  /* one stream: two accumulators, so the FMA chain does not stall */
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            int64_t b = 0;
            for (; b + 1 < blocks; b += 2) {
                _mm_prefetch((const char *)(wr + b * 32 + AKV_PREFETCH), _MM_HINT_T0);
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wr + b * 32 + 32));
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(a->q + b * 32));
                const __m256i a1 = _mm256_loadu_si256((const __m256i *)(a->q + b * 32 + 32));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(a->d[b]), dot_u8_s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0)), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(a->d[b + 1]), dot_u8_s8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(a1, w1)), acc1);
            }
            for (; b < blocks; b++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(a->q + b * 32));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(a->d[b]), dot_u8_s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0)), acc0);
            }
            store(y + row, hsum(_mm256_add_ps(acc0, acc1)) * w_scale[row], accumulate);
            continue;
        }
        __m256 acc[AKV_MAX_ROWS];
        for (int64_t m = 0; m < m_rows; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
            const __m256i magnitude = _mm256_sign_epi8(wv, wv);  /* |w|, and the sign moves to the input */
            for (int64_t m = 0; m < m_rows; m++) {
                const int64_t i = m * blocks + b;
                const __m256i av = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a->q + i * 32)), wv);
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(a->d[i]), dot_u8_s8(magnitude, av), acc[m]);
            }
        }
        for (int64_t m = 0; m < m_rows; m++) store(y + m * n + row, hsum(acc[m]) * w_scale[row], accumulate);
    }
}

/* x [D] rotated in place by one row of cos / signed sin [rotary] (rotate-half: x * cos + roll(x, half) * sin). */
static void rotate(float *x, int rotary, const float *cos, const float *ssin) {
    const int half = rotary / 2;
    float rolled[512];
    for (int i = 0; i < rotary; i++) rolled[i] = x[i < half ? i + half : i - half];
    for (int i = 0; i < rotary; i++) x[i] = x[i] * cos[i] + rolled[i] * ssin[i];
}

static inline float dot(const float *a, const float *b, int d) {  /* d a multiple of 8 */
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* o [D] = sum over t of p[t] * v_t, v_t the rows `stride` floats apart selected by `seen` (o in registers). */
static void weighted_sum(const float *p, int64_t count, const float *v_pool, const int64_t *seen, int64_t stride,
                         int64_t d, float *o) {
    if (d == 64) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t t = 0; t < count; t++) {
            const __m256 w = _mm256_set1_ps(p[t]);
            const float *v = v_pool + seen[t] * stride;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2); a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), a4); a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), a5);
            a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), a6); a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), a7);
        }
        _mm256_storeu_ps(o, a0);      _mm256_storeu_ps(o + 8, a1);  _mm256_storeu_ps(o + 16, a2); _mm256_storeu_ps(o + 24, a3);
        _mm256_storeu_ps(o + 32, a4); _mm256_storeu_ps(o + 40, a5); _mm256_storeu_ps(o + 48, a6); _mm256_storeu_ps(o + 56, a7);
        return;
    }
    for (int64_t i = 0; i < d; i += 8) {  /* other head sizes: one 8-wide strip of o at a time */
        __m256 a = _mm256_setzero_ps();
        for (int64_t t = 0; t < count; t++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v_pool + seen[t] * stride + i), a);
        _mm256_storeu_ps(o + i, a);
    }
}

/* One layer's decode attention: qkv [M, (H + 2 Hkv) D] (row m: sequence m's one new token, q then k then v
 * heads), cos / ssin [M, rotary], pools [slots, Hkv, D], out_slots [M], the sequences' visible slots
 * concatenated with offsets [M + 1]. */
typedef struct {
    int64_t m_rows, heads, kv_heads, d, rotary;
    const float *cos, *ssin;
    float *k_pool, *v_pool;
    const int64_t *out_slots, *slots, *offsets;
    float scale;
} Attention;

/* Rows [m0, m1): q and k rotated in qkv itself, the new K/V written to their pool slots. */
static void rotate_and_store(float *qkv, const Attention *at, int64_t m0, int64_t m1) {
    const int64_t d = at->d, heads = at->heads, kv_heads = at->kv_heads;
    const int64_t width = (heads + 2 * kv_heads) * d, stride = kv_heads * d;
    for (int64_t m = m0; m < m1; m++) {
        float *row = qkv + m * width;
        const float *cos = at->cos + m * at->rotary, *ssin = at->ssin + m * at->rotary;
        for (int64_t h = 0; h < heads + kv_heads; h++) rotate(row + h * d, (int)at->rotary, cos, ssin);
        for (int64_t i = 0; i < stride; i++) {
            at->k_pool[at->out_slots[m] * stride + i] = row[heads * d + i];
            at->v_pool[at->out_slots[m] * stride + i] = row[(heads + kv_heads) * d + i];
        }
    }
}

/* Query heads [i0, i1) of all rows' heads (item m * H + h: head h of row m) -> out [M, H D], once every new
 * K/V is in the pool. scores: H * offsets[M] floats, head h of row m at H * offsets[m] + h * count. Each key
 * row is read once for the heads of its group within the range; a head's result is the same whatever the range. */
static void attend(const float *qkv, const Attention *at, int64_t i0, int64_t i1, float *scores, float *out) {
    const int64_t d = at->d, heads = at->heads, group = heads / at->kv_heads, stride = at->kv_heads * d;
    const int64_t width = (heads + 2 * at->kv_heads) * d;
    for (int64_t i = i0; i < i1;) {
        const int64_t m = i / heads, h0 = i % heads, g = h0 / group;
        const int64_t h1 = (g + 1) * group < h0 + (i1 - i) ? (g + 1) * group : h0 + (i1 - i);  /* this group's heads */
        const int64_t *seen = at->slots + at->offsets[m], count = at->offsets[m + 1] - at->offsets[m];
        float *row_scores = scores + heads * at->offsets[m];
        for (int64_t t = 0; t < count; t++) {
            const float *key = at->k_pool + seen[t] * stride + g * d;
            for (int64_t h = h0; h < h1; h++)
                row_scores[h * count + t] = dot(qkv + m * width + h * d, key, (int)d) * at->scale;
        }
        for (int64_t h = h0; h < h1; h++) {
            float *p = row_scores + h * count, top = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < count; t++) top = fmaxf(top, p[t]);
            for (int64_t t = 0; t < count; t++) { p[t] = expf(p[t] - top); total += p[t]; }
            const float norm = total > 0.0f ? 1.0f / total : 0.0f;
            for (int64_t t = 0; t < count; t++) p[t] *= norm;
            weighted_sum(p, count, at->v_pool + g * d, seen, stride, d, out + m * heads * d + h * d);
        }
        i += h1 - h0;
    }
}

static int attention_valid(const Attention *at) {
    return !(at->d % 8 || at->rotary > 512 || at->rotary > at->d || at->heads % at->kv_heads);
}

/* One projection of a layer: `bits` 4 (w: packed groups, scale and offset [N, K / 32]) or 8 (w: int8
 * [N, K], scale [N], offset unused). */
typedef struct {
    int64_t bits, n, k;
    const void *w;
    const float *scale, *offset;
} AkvProjection;

typedef struct {
    const float *attn_norm, *mlp_norm, *qkv_bias;  /* qkv_bias may be NULL */
    AkvProjection qkv, o, gate_up, down;
} AkvLayer;

static int projection_valid(const AkvProjection *p, int64_t m_rows) {
    return (p->bits == 4 || p->bits == 8) && m_rows >= 1 && m_rows <= AKV_MAX_ROWS && p->k % AKV_BLOCK == 0;
}

/* Columns [n0, n1) of the projection of the quantized rows `a` into y [M, N] (added with `accumulate`). */
static void project_columns(const AkvProjection *p, const Quantized *a, int64_t m_rows, int accumulate,
                            int64_t n0, int64_t n1, float *y) {
    if (p->bits == 4) q4_columns(a, m_rows, p->k, accumulate, p->w, p->scale, p->offset, p->n, n0, n1, y);
    else q8_columns(a, m_rows, p->k, accumulate, p->w, p->scale, p->n, n0, n1, y);
}

/* Columns [n0, n1) of y [M, N] plus the bias [N]. */
static void add_bias(float *y, const float *bias, int64_t m_rows, int64_t n, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t j = n0; j < n1; j++) y[m * n + j] += bias[j];
}

/* Threads. A call runs as one team: the caller and `threads - 1` workers of a pool started on first use and
 * grown to the largest count asked for, all running the same job, which splits each phase's work (rows,
 * ranges of columns, ranges of heads) and meets at a barrier between phases. A waiting thread spins for
 * AKV_SPIN_NS (a decode step's phases are microseconds apart: no wake-up per product), then sleeps. One
 * caller uses the pool at a time; another caller meanwhile runs its call on its own thread. */
#define AKV_MAX_THREADS 64
#ifndef AKV_SPIN_NS
#define AKV_SPIN_NS 100000
#endif
#define AKV_TILE 16  /* column ranges start at multiples of this (the last one ends at N, whatever N) */

typedef struct Member Member;
typedef void (*Job)(Member *me);

typedef struct {
    int threads;
    Job job;
    void *context;
    _Atomic unsigned running;        /* workers not yet done with the job */
    _Atomic int arrived;             /* at the current barrier */
    _Atomic unsigned generation;     /* barriers passed */
    _Atomic int64_t next[2];         /* pieces claimed in even / odd phases */
} Team;

struct Member { Team *team; int thread; int64_t phase; };

typedef struct {
    _Alignas(64) _Atomic unsigned ticket;   /* raised by the caller: join `team` */
    Team *_Atomic team;
    int index;
} Worker;

static struct {
    pthread_mutex_t busy, lock;  /* busy: one caller's team at a time; lock and wake: sleeping threads */
    pthread_cond_t wake;
    _Atomic int sleepers;
    int started;
    Worker workers[AKV_MAX_THREADS];
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static _Thread_local int last_threads = 1;

int akv_last_threads(void) { return last_threads; }   /* the thread count of this thread's last call */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait until *word differs from `seen` and return its new value: spin, yielding the core every few
 * microseconds (a teammate that was preempted gets it back), then sleep. */
static unsigned wait_change(_Atomic unsigned *word, unsigned seen) {
    unsigned now;
    int64_t until = 0;
    for (int i = 1; (now = atomic_load_explicit(word, memory_order_acquire)) == seen; i++) {
        _mm_pause();
        if (i % 256) continue;
        if (!until) until = now_ns() + AKV_SPIN_NS;
        else if (now_ns() < until) sched_yield();
        else {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((now = atomic_load(word)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
            break;
        }
    }
    return now;
}

/* After a word changed: wake the sleeping threads (each checks its own word). */
static void wake_sleepers(void) {
    if (atomic_load(&pool.sleepers) == 0) return;
    pthread_mutex_lock(&pool.lock);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
}

/* Every member waits here until all have arrived; the last one re-arms the next phase's piece counter. */
static void barrier(Member *me) {
    Team *t = me->team;
    const int64_t phase = me->phase++;
    if (t->threads == 1) { atomic_store(&t->next[(phase + 1) & 1], 0); return; }
    const unsigned generation = atomic_load(&t->generation);
    if (atomic_fetch_add(&t->arrived, 1) == t->threads - 1) {
        atomic_store(&t->next[(phase + 1) & 1], 0);
        atomic_store(&t->arrived, 0);
        atomic_fetch_add(&t->generation, 1);
        wake_sleepers();
    } else {
        wait_change(&t->generation, generation);
    }
}

/* The next unclaimed piece [*i0, *i1) of this phase's `count` items, in pieces of `per`; 0 when all are claimed. */
static int claim(Member *me, int64_t count, int64_t per, int64_t *i0, int64_t *i1) {
    *i0 = atomic_fetch_add_explicit(&me->team->next[me->phase & 1], 1, memory_order_relaxed) * per;
    *i1 = *i0 + per < count ? *i0 + per : count;
    return *i0 < count;
}

/* This member's next range of columns [*n0, *n1) of n: about four pieces per thread, whole tiles. */
static int claim_columns(Member *me, int64_t n, int64_t *n0, int64_t *n1) {
    const int64_t pieces = 4 * (int64_t)me->team->threads, tiles = (n + AKV_TILE - 1) / AKV_TILE;
    return claim(me, n, (me->team->threads == 1 ? tiles : (tiles + pieces - 1) / pieces) * AKV_TILE, n0, n1);
}

/* This member's share [*m0, *m1) of `count` rows (one row: the caller's, which is already running). */
static void share_rows(const Member *me, int64_t count, int64_t *m0, int64_t *m1) {
    const int64_t threads = me->team->threads;
    *m0 = (count * me->thread + threads - 1) / threads;
    *m1 = (count * (me->thread + 1) + threads - 1) / threads;
}

static void *work(void *arg) {
    Worker *self = arg;
    unsigned seen = 0;
    for (;;) {
        seen = wait_change(&self->ticket, seen);
        Team *team = atomic_load(&self->team);
        Member me = {team, self->index, 0};
        team->job(&me);
        atomic_fetch_sub(&team->running, 1);   /* the last touch of the team: the caller may return now */
        wake_sleepers();
    }
    return NULL;
}

static void forget_workers(void) {   /* in a forked child, which has only the forking thread */
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.started = 0;
}

static void once(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* Start workers (signals blocked: they stay with Python's threads) until `threads` can run; the count that can. */
static int grow(int threads) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, once);
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    while (pool.started + 1 < threads) {
        Worker *w = &pool.workers[pool.started + 1];
        atomic_store(&w->ticket, 0);
        w->index = pool.started + 1;
        pthread_t id;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&id, &attributes, work, w);
        pthread_attr_destroy(&attributes);
        if (failed) break;
        pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    return pool.started + 1 < threads ? pool.started + 1 : threads;
}

/* Run `job` on `threads` threads (fewer when the pool is busy with another caller or cannot grow). */
static void run_team(Job job, void *context, int64_t threads) {
    Team team = {.threads = 1, .job = job, .context = context};
    const int pooled = threads > 1 && pthread_mutex_trylock(&pool.busy) == 0;
    if (pooled) team.threads = grow(threads < AKV_MAX_THREADS ? (int)threads : AKV_MAX_THREADS);
    atomic_store(&team.running, (unsigned)team.threads - 1);
    for (int w = 1; w < team.threads; w++) {
        atomic_store(&pool.workers[w].team, &team);
        atomic_fetch_add(&pool.workers[w].ticket, 1);
    }
    if (team.threads > 1) wake_sleepers();
    Member me = {&team, 0, 0};
    job(&me);
    for (unsigned left; (left = atomic_load(&team.running)) != 0;) wait_change(&team.running, left);
    if (pooled) pthread_mutex_unlock(&pool.busy);
    last_threads = team.threads;
}

/* One product: rows of h(x) quantized once into the shared scratch r (each row by one thread), then its columns
 * (with the bias, if any, added to each range) into y [M, N]. */
typedef struct {
    const AkvProjection *p;
    const float *x, *norm, *bias;
    int64_t m_rows;
    float eps;
    int glu, accumulate;
    Scratch *r;
    float *y;
} Product;

static void product(Member *me, const Product *c) {
    int64_t m0, m1, n0, n1;
    if (c->norm) {   /* a norm needs its whole row: rows */
        share_rows(me, c->m_rows, &m0, &m1);
        if (m0 < m1) quantize(c->x, m0, m1, c->p->k, c->norm, c->eps, c->glu, c->r);
    } else {         /* blocks of every row (a SwiGLU's exponentials are a decode step's longest serial work) */
        share_rows(me, c->p->k / AKV_BLOCK, &m0, &m1);
        if (m0 < m1) quantize_blocks(c->x, c->m_rows, m0, m1, c->p->k, c->glu, c->r);
    }
    barrier(me);
    while (claim_columns(me, c->p->n, &n0, &n1)) {
        project_columns(c->p, &c->r->a, c->m_rows, c->accumulate, n0, n1, c->y);
        if (c->bias) add_bias(c->y, c->bias, c->m_rows, c->p->n, n0, n1);
    }
    barrier(me);
}

static void product_job(Member *me) { product(me, me->team->context); }

static int run_product(const AkvProjection *p, const float *x, int64_t m_rows, const float *norm, float eps, int glu,
                       int accumulate, float *y, int64_t threads) {
    if (!projection_valid(p, m_rows)) return -2;
    Scratch r;
    if (reserve(&r, m_rows, p->k)) { release(&r); return -1; }
    Product c = {p, x, norm, NULL, m_rows, eps, glu, accumulate, &r, y};
    run_team(product_job, &c, threads);
    release(&r);
    return 0;
}

/* y [M, N] = h(x) [M, K] times the weights (see the header), on `threads` threads. */
int akv_q4_gemv(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                const uint8_t *w, const float *w_scale, const float *w_offset, int64_t n, float *y, int64_t threads) {
    const AkvProjection p = {4, n, k, w, w_scale, w_offset};
    return run_product(&p, x, m_rows, norm, eps, glu, accumulate, y, threads);
}

int akv_q8_gemv(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                const int8_t *w, const float *w_scale, int64_t n, float *y, int64_t threads) {
    const AkvProjection p = {8, n, k, w, w_scale, NULL};
    return run_product(&p, x, m_rows, norm, eps, glu, accumulate, y, threads);
}

/* One layer's attention: rows' new K/V stored (each row by one thread), then pieces of the (row, head) items. */
static void attention(Member *me, float *qkv, const Attention *at, float *scores, float *out) {
    int64_t m0, m1, i0, i1;
    const int64_t items = at->m_rows * at->heads, per = items / (2 * (int64_t)me->team->threads);
    share_rows(me, at->m_rows, &m0, &m1);
    if (m0 < m1) rotate_and_store(qkv, at, m0, m1);   /* every new K/V is in the pool before anyone attends */
    barrier(me);
    while (claim(me, items, per > 0 ? per : 1, &i0, &i1)) attend(qkv, at, i0, i1, scores, out);
    barrier(me);
}

typedef struct { float *qkv; const Attention *at; float *scores, *out; } AttentionCall;

static void attention_job(Member *me) {
    const AttentionCall *c = me->team->context;
    attention(me, c->qkv, c->at, c->scores, c->out);
}

/* The Attention fields as arguments -> out [M, H D], on `threads` threads. q and k are rotated in qkv itself. */
int akv_decode_attention(float *qkv, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                         const float *cos, const float *ssin, float *k_pool, float *v_pool, const int64_t *out_slots,
                         const int64_t *slots, const int64_t *offsets, float scale, float *out, int64_t threads) {
    const Attention at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, k_pool, v_pool, out_slots, slots, offsets, scale};
    if (!attention_valid(&at)) return -2;
    AttentionCall c = {qkv, &at, malloc(sizeof(float) * (size_t)(heads * (offsets[m_rows] > 0 ? offsets[m_rows] : 1))),
                       out};
    if (!c.scores) return -1;
    run_team(attention_job, &c, threads);
    free(c.scores);
    return 0;
}

/* A decode step's buffers and arguments, shared by the team. */
typedef struct {
    const AkvLayer *layers;
    int64_t num_layers;
    float *const *k_pools, *const *v_pools;
    float *x;
    float eps;
    Attention at;   /* pools set per layer */
    float *qkv, *attended, *gate_up, *scores;
    Scratch r;
} Decode;

static void decode_job(Member *me) {
    const Decode *c = me->team->context;
    const int64_t m_rows = c->at.m_rows;
    Attention at = c->at;
    for (int64_t i = 0; i < c->num_layers; i++) {
        const AkvLayer *l = c->layers + i;
        Scratch *r = (Scratch *)&c->r;
        at.k_pool = c->k_pools[i];
        at.v_pool = c->v_pools[i];
        const Product qkv = {&l->qkv, c->x, l->attn_norm, l->qkv_bias, m_rows, c->eps, 0, 0, r, c->qkv};
        const Product o = {&l->o, c->attended, NULL, NULL, m_rows, 0.0f, 0, 1, r, c->x};
        const Product gate_up = {&l->gate_up, c->x, l->mlp_norm, NULL, m_rows, c->eps, 0, 0, r, c->gate_up};
        const Product down = {&l->down, c->gate_up, NULL, NULL, m_rows, 0.0f, 1, 1, r, c->x};
        product(me, &qkv);
        attention(me, c->qkv, &at, c->scores, c->attended);
        product(me, &o);
        product(me, &gate_up);
        product(me, &down);
    }
}

/* A whole decode step through every layer on `threads` threads, the residual stream x [M, hidden] updated in
 * place: per layer RMSNorm + qkv, RoPE + K/V write + attention, o added into x, RMSNorm + gate/up, SwiGLU +
 * down added into x. k_pools / v_pools: each layer's pool [slots, Hkv, D]. */
int akv_decode_layers(const AkvLayer *layers, int64_t num_layers, float *const *k_pools, float *const *v_pools,
                      float *x, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                      float eps, const float *cos, const float *ssin, const int64_t *out_slots,
                      const int64_t *slots, const int64_t *offsets, float scale, int64_t threads) {
    if (num_layers < 1) return 0;
    Decode c = {.layers = layers, .num_layers = num_layers, .k_pools = k_pools, .v_pools = v_pools, .x = x, .eps = eps,
                .at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, NULL, NULL, out_slots, slots, offsets, scale}};
    int64_t widest = 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const AkvProjection *ps[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
        for (int j = 0; j < 4; j++) {
            if (!projection_valid(ps[j], m_rows)) return -2;
            if (ps[j]->k > widest) widest = ps[j]->k;
        }
    }
    if (!attention_valid(&c.at)) return -2;
    c.qkv = malloc(sizeof(float) * (size_t)(m_rows * layers[0].qkv.n));
    c.attended = malloc(sizeof(float) * (size_t)(m_rows * heads * d));
    c.gate_up = malloc(sizeof(float) * (size_t)(m_rows * layers[0].gate_up.n));
    c.scores = malloc(sizeof(float) * (size_t)(heads * (offsets[m_rows] > 0 ? offsets[m_rows] : 1)));
    const int status = (reserve(&c.r, m_rows, widest) == 0 && c.qkv && c.attended && c.gate_up && c.scores) ? 0 : -1;
    if (!status) run_team(decode_job, &c, threads);
    free(c.qkv); free(c.attended); free(c.gate_up); free(c.scores);
    release(&c.r);
    return status;
}
