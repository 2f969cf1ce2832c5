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
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* h(x) [M, K] (see the header) quantized into r->a. */
static void quantize(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, Scratch *r) {
    if (norm || glu) prologue(x, m_rows, k, norm, eps, glu, r->h);
    quantize_rows((norm || glu) ? r->h : x, m_rows, k, r->a.q, r->a.d, r->a.s);
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

int akv_q4_gemv(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                const uint8_t *w, const float *w_scale, const float *w_offset, int64_t n, float *y) {
    if (m_rows < 1 || m_rows > AKV_MAX_ROWS || k % AKV_BLOCK) return -2;
    Scratch r;
    if (reserve(&r, m_rows, k)) { release(&r); return -1; }
    quantize(x, m_rows, k, norm, eps, glu, &r);
    q4_columns(&r.a, m_rows, k, accumulate, w, w_scale, w_offset, n, 0, n, y);
    release(&r);
    return 0;
}

int akv_q8_gemv(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                const int8_t *w, const float *w_scale, int64_t n, float *y) {
    if (m_rows < 1 || m_rows > AKV_MAX_ROWS || k % AKV_BLOCK) return -2;
    Scratch r;
    if (reserve(&r, m_rows, k)) { release(&r); return -1; }
    quantize(x, m_rows, k, norm, eps, glu, &r);
    q8_columns(&r.a, m_rows, k, accumulate, w, w_scale, n, 0, n, y);
    release(&r);
    return 0;
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

/* The Attention fields as arguments -> out [M, H D]. q and k are rotated in qkv itself. */
int akv_decode_attention(float *qkv, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                         const float *cos, const float *ssin, float *k_pool, float *v_pool, const int64_t *out_slots,
                         const int64_t *slots, const int64_t *offsets, float scale, float *out) {
    const Attention at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, k_pool, v_pool, out_slots, slots, offsets, scale};
    if (!attention_valid(&at)) return -2;
    float *scores = malloc(sizeof(float) * (size_t)(heads * (offsets[m_rows] > 0 ? offsets[m_rows] : 1)));
    if (!scores) return -1;
    rotate_and_store(qkv, &at, 0, m_rows);   /* every new K/V is in the pool before anyone attends */
    attend(qkv, &at, 0, m_rows * heads, scores, out);
    free(scores);
    return 0;
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

/* One product of a layer: h(x) quantized into r, then all its columns into y. */
static void project(const AkvProjection *p, const float *x, int64_t m_rows, const float *norm, float eps, int glu,
                    int accumulate, Scratch *r, float *y) {
    quantize(x, m_rows, p->k, norm, eps, glu, r);
    project_columns(p, &r->a, m_rows, accumulate, 0, p->n, y);
}

/* Columns [n0, n1) of y [M, N] plus the bias [N]. */
static void add_bias(float *y, const float *bias, int64_t m_rows, int64_t n, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t j = n0; j < n1; j++) y[m * n + j] += bias[j];
}

/* A whole decode step through every layer, the residual stream x [M, hidden] updated in place: per layer
 * RMSNorm + qkv, RoPE + K/V write + attention, o added into x, RMSNorm + gate/up, SwiGLU + down added
 * into x. k_pools / v_pools: each layer's pool [slots, Hkv, D]. */
int akv_decode_layers(const AkvLayer *layers, int64_t num_layers, float *const *k_pools, float *const *v_pools,
                      float *x, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                      float eps, const float *cos, const float *ssin, const int64_t *out_slots,
                      const int64_t *slots, const int64_t *offsets, float scale) {
    if (num_layers < 1) return 0;
    Attention at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, NULL, NULL, out_slots, slots, offsets, scale};
    int64_t widest = 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const AkvProjection *ps[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
        for (int j = 0; j < 4; j++) {
            if (!projection_valid(ps[j], m_rows)) return -2;
            if (ps[j]->k > widest) widest = ps[j]->k;
        }
    }
    if (!attention_valid(&at)) return -2;
    const int64_t width = layers[0].qkv.n, intermediate2 = layers[0].gate_up.n;
    float *qkv = malloc(sizeof(float) * (size_t)(m_rows * width));
    float *attended = malloc(sizeof(float) * (size_t)(m_rows * heads * d));
    float *gate_up = malloc(sizeof(float) * (size_t)(m_rows * intermediate2));
    float *scores = malloc(sizeof(float) * (size_t)(heads * (offsets[m_rows] > 0 ? offsets[m_rows] : 1)));
    Scratch r;
    int status = (reserve(&r, m_rows, widest) == 0 && qkv && attended && gate_up && scores) ? 0 : -1;
    for (int64_t i = 0; i < num_layers && !status; i++) {
        const AkvLayer *l = layers + i;
        at.k_pool = k_pools[i];
        at.v_pool = v_pools[i];
        project(&l->qkv, x, m_rows, l->attn_norm, eps, 0, 0, &r, qkv);
        if (l->qkv_bias) add_bias(qkv, l->qkv_bias, m_rows, width, 0, width);
        rotate_and_store(qkv, &at, 0, m_rows);
        attend(qkv, &at, 0, m_rows * heads, scores, attended);
        project(&l->o, attended, m_rows, NULL, 0.0f, 0, 1, &r, x);
        project(&l->gate_up, x, m_rows, l->mlp_norm, eps, 0, 0, &r, gate_up);
        project(&l->down, gate_up, m_rows, NULL, 0.0f, 1, 1, &r, x);
    }
    free(qkv); free(attended); free(gate_up); free(scores);
    release(&r);
    return status;
}
