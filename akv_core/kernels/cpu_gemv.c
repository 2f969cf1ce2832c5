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

/* qkv [M, (H + 2 Hkv) D] (row m: sequence m's one new token, q then k then v heads), cos / ssin [M, rotary],
 * pools [slots, Hkv, D] of one layer, out_slots [M], the sequences' visible slots concatenated with
 * offsets [M + 1] -> out [M, H D]. q and k are rotated in qkv itself. */
int akv_decode_attention(float *qkv, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                         const float *cos, const float *ssin, float *k_pool, float *v_pool, const int64_t *out_slots,
                         const int64_t *slots, const int64_t *offsets, float scale, float *out) {
    if (d % 8 || rotary > 512 || rotary > d || heads % kv_heads) return -2;
    const int64_t width = (heads + 2 * kv_heads) * d, group = heads / kv_heads;
    for (int64_t m = 0; m < m_rows; m++) {  /* every new K/V is in the pool before anyone attends */
        float *row = qkv + m * width;
        for (int64_t h = 0; h < heads + kv_heads; h++) rotate(row + h * d, (int)rotary, cos + m * rotary, ssin + m * rotary);
        for (int64_t i = 0; i < kv_heads * d; i++) {
            k_pool[out_slots[m] * kv_heads * d + i] = row[heads * d + i];
            v_pool[out_slots[m] * kv_heads * d + i] = row[(heads + kv_heads) * d + i];
        }
    }
    for (int64_t m = 0; m < m_rows; m++) {
        const int64_t *seen = slots + offsets[m], count = offsets[m + 1] - offsets[m];
        float *scores = malloc(sizeof(float) * (size_t)(group * (count > 0 ? count : 1)));
        if (!scores) return -1;
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = g * group + j;
                const float *q = qkv + m * width + h * d;
                float *p = scores + j * count, top = -INFINITY, total = 0.0f;
                for (int64_t t = 0; t < count; t++) {
                    p[t] = dot(q, k_pool + (seen[t] * kv_heads + g) * d, (int)d) * scale;
                    top = fmaxf(top, p[t]);
                }
                for (int64_t t = 0; t < count; t++) { p[t] = expf(p[t] - top); total += p[t]; }
                float *o = out + m * heads * d + h * d;
                for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
                const float norm = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t t = 0; t < count; t++) {
                    const __m256 weight = _mm256_set1_ps(p[t] * norm);
                    const float *v = v_pool + (seen[t] * kv_heads + g) * d;
                    for (int64_t i = 0; i < d; i += 8)
                        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
                }
            }
        }
        free(scores);
    }
    return 0;
}
