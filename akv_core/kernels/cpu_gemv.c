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

static int quantize(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu,
                    Quantized *out) {
    const int64_t blocks = k / AKV_BLOCK;
    out->q = malloc((size_t)(m_rows * k));
    out->d = malloc(sizeof(float) * (size_t)(m_rows * blocks));
    out->s = malloc(sizeof(float) * (size_t)(m_rows * blocks));
    float *h = (norm || glu) ? malloc(sizeof(float) * (size_t)(m_rows * k)) : NULL;
    if (!out->q || !out->d || !out->s || ((norm || glu) && !h)) { free(h); return -1; }
    if (h) prologue(x, m_rows, k, norm, eps, glu, h);
    quantize_rows(h ? h : x, m_rows, k, out->q, out->d, out->s);
    free(h);
    return 0;
}

static void release(Quantized *a) { free(a->q); free(a->d); free(a->s); }

static inline void store(float *y, float value, int accumulate) { *y = accumulate ? *y + value : value; }

int akv_q4_gemv(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                const uint8_t *w, const float *w_scale, const float *w_offset, int64_t n, float *y) {
    if (m_rows < 1 || m_rows > AKV_MAX_ROWS || k % AKV_BLOCK) return -2;
    Quantized a;
    if (quantize(x, m_rows, k, norm, eps, glu, &a)) { release(&a); return -1; }
    const int64_t blocks = k / AKV_BLOCK;
    for (int64_t row = 0; row < n; row++) {
        const uint8_t *wr = w + row * blocks * (AKV_BLOCK / 2);
        const float *scale = w_scale + row * blocks, *offset = w_offset + row * blocks;
        if (m_rows == 1) {  /* one stream: two accumulators, so the FMA chain does not stall */
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float off = 0.0f;
            int64_t b = 0;
            for (; b + 1 < blocks; b += 2) {
                const __m256 p0 = dot_u8_s8(q4_group(wr + b * 16), _mm256_loadu_si256((const __m256i *)(a.q + b * 32)));
                const __m256 p1 = dot_u8_s8(q4_group(wr + (b + 1) * 16),
                                            _mm256_loadu_si256((const __m256i *)(a.q + (b + 1) * 32)));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a.d[b]), p0, acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(scale[b + 1] * a.d[b + 1]), p1, acc1);
                off += offset[b] * a.s[b] + offset[b + 1] * a.s[b + 1];
            }
            for (; b < blocks; b++) {
                const __m256 p = dot_u8_s8(q4_group(wr + b * 16), _mm256_loadu_si256((const __m256i *)(a.q + b * 32)));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a.d[b]), p, acc0);
                off += offset[b] * a.s[b];
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
                const __m256 p = dot_u8_s8(wv, _mm256_loadu_si256((const __m256i *)(a.q + i * 32)));
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a.d[i]), p, acc[m]);
                off[m] += offset[b] * a.s[i];
            }
        }
        for (int64_t m = 0; m < m_rows; m++) store(y + m * n + row, hsum(acc[m]) + off[m], accumulate);
    }
    release(&a);
    return 0;
}

int akv_q8_gemv(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                const int8_t *w, const float *w_scale, int64_t n, float *y) {
    if (m_rows < 1 || m_rows > AKV_MAX_ROWS || k % AKV_BLOCK) return -2;
    Quantized a;
    if (quantize(x, m_rows, k, norm, eps, glu, &a)) { release(&a); return -1; }
    const int64_t blocks = k / AKV_BLOCK;
    for (int64_t row = 0; row < n; row++) {
        const int8_t *wr = w + row * k;
        if (m_rows == 1) {  /* one stream: two accumulators, so the FMA chain does not stall */
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            int64_t b = 0;
            for (; b + 1 < blocks; b += 2) {
                _mm_prefetch((const char *)(wr + b * 32 + AKV_PREFETCH), _MM_HINT_T0);
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wr + b * 32 + 32));
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(a.q + b * 32));
                const __m256i a1 = _mm256_loadu_si256((const __m256i *)(a.q + b * 32 + 32));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(a.d[b]), dot_u8_s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0)), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(a.d[b + 1]), dot_u8_s8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(a1, w1)), acc1);
            }
            for (; b < blocks; b++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(a.q + b * 32));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(a.d[b]), dot_u8_s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0)), acc0);
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
                const __m256i av = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a.q + i * 32)), wv);
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(a.d[i]), dot_u8_s8(magnitude, av), acc[m]);
            }
        }
        for (int64_t m = 0; m < m_rows; m++) store(y + m * n + row, hsum(acc[m]) * w_scale[row], accumulate);
    }
    release(&a);
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

/* qkv [M, (H + 2 Hkv) D] (row m: sequence m's one new token, q then k then v heads), cos / ssin [M, rotary],
 * pools [slots, Hkv, D] of one layer, out_slots [M], the sequences' visible slots concatenated with
 * offsets [M + 1] -> out [M, H D]. q and k are rotated in qkv itself. */
int akv_decode_attention(float *qkv, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                         const float *cos, const float *ssin, float *k_pool, float *v_pool, const int64_t *out_slots,
                         const int64_t *slots, const int64_t *offsets, float scale, float *out) {
    if (d % 8 || rotary > 512 || rotary > d || heads % kv_heads) return -2;
    const int64_t width = (heads + 2 * kv_heads) * d, group = heads / kv_heads, stride = kv_heads * d;
    for (int64_t m = 0; m < m_rows; m++) {  /* every new K/V is in the pool before anyone attends */
        float *row = qkv + m * width;
        for (int64_t h = 0; h < heads + kv_heads; h++) rotate(row + h * d, (int)rotary, cos + m * rotary, ssin + m * rotary);
        for (int64_t i = 0; i < stride; i++) {
            k_pool[out_slots[m] * stride + i] = row[heads * d + i];
            v_pool[out_slots[m] * stride + i] = row[(heads + kv_heads) * d + i];
        }
    }
    for (int64_t m = 0; m < m_rows; m++) {
        const int64_t *seen = slots + offsets[m], count = offsets[m + 1] - offsets[m];
        float *scores = malloc(sizeof(float) * (size_t)(group * (count > 0 ? count : 1)));
        if (!scores) return -1;
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *q = qkv + m * width + g * group * d;
            for (int64_t t = 0; t < count; t++) {  /* each key row is read once for the group's heads */
                const float *key = k_pool + seen[t] * stride + g * d;
                for (int64_t j = 0; j < group; j++) scores[j * count + t] = dot(q + j * d, key, (int)d) * scale;
            }
            for (int64_t j = 0; j < group; j++) {
                float *p = scores + j * count, top = -INFINITY, total = 0.0f;
                for (int64_t t = 0; t < count; t++) top = fmaxf(top, p[t]);
                for (int64_t t = 0; t < count; t++) { p[t] = expf(p[t] - top); total += p[t]; }
                const float norm = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t t = 0; t < count; t++) p[t] *= norm;
                weighted_sum(p, count, v_pool + g * d, seen, stride, d, out + m * heads * d + (g * group + j) * d);
            }
        }
        free(scores);
    }
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

static int project(const AkvProjection *p, const float *x, int64_t m_rows, const float *norm, float eps, int glu,
                   int accumulate, float *y) {
    if (p->bits == 4)
        return akv_q4_gemv(x, m_rows, p->k, norm, eps, glu, accumulate, p->w, p->scale, p->offset, p->n, y);
    if (p->bits == 8) return akv_q8_gemv(x, m_rows, p->k, norm, eps, glu, accumulate, p->w, p->scale, p->n, y);
    return -3;
}

/* A whole decode step through every layer, the residual stream x [M, hidden] updated in place: per layer
 * RMSNorm + qkv, RoPE + K/V write + attention, o added into x, RMSNorm + gate/up, SwiGLU + down added
 * into x. k_pools / v_pools: each layer's pool [slots, Hkv, D]. */
int akv_decode_layers(const AkvLayer *layers, int64_t num_layers, float *const *k_pools, float *const *v_pools,
                      float *x, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                      float eps, const float *cos, const float *ssin, const int64_t *out_slots,
                      const int64_t *slots, const int64_t *offsets, float scale) {
    if (num_layers < 1) return 0;
    const int64_t width = layers[0].qkv.n, intermediate2 = layers[0].gate_up.n;
    float *qkv = malloc(sizeof(float) * (size_t)(m_rows * width));
    float *attended = malloc(sizeof(float) * (size_t)(m_rows * heads * d));
    float *gate_up = malloc(sizeof(float) * (size_t)(m_rows * intermediate2));
    int status = (qkv && attended && gate_up) ? 0 : -1;
    for (int64_t i = 0; i < num_layers && !status; i++) {
        const AkvLayer *l = layers + i;
        status = project(&l->qkv, x, m_rows, l->attn_norm, eps, 0, 0, qkv);
        if (!status && l->qkv_bias)
            for (int64_t m = 0; m < m_rows; m++)
                for (int64_t j = 0; j < width; j++) qkv[m * width + j] += l->qkv_bias[j];
        if (!status)
            status = akv_decode_attention(qkv, m_rows, heads, kv_heads, d, rotary, cos, ssin, k_pools[i], v_pools[i],
                                          out_slots, slots, offsets, scale, attended);
        if (!status) status = project(&l->o, attended, m_rows, NULL, 0.0f, 0, 1, x);
        if (!status) status = project(&l->gate_up, x, m_rows, l->mlp_norm, eps, 0, 0, gate_up);
        if (!status) status = project(&l->down, gate_up, m_rows, NULL, 0.0f, 1, 1, x);
    }
    free(qkv); free(attended); free(gate_up);
    return status;
}
