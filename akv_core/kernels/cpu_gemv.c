/* Weight-only quantized products for decode-sized inputs (a few rows) on x86 CPUs with AVX2 and FMA.
 *
 * The input rows are quantized per block of 32 to int8 with one fp32 scale (as llama.cpp's Q8 blocks),
 * so each block of weights meets its block of inputs in integer SIMD (vpmaddubsw + vpmaddwd), and the
 * weights are read once for all input rows.
 *
 * The weights are interleaved by groups of 8 output columns (AKV_GROUP; the last group padded with
 * zero columns): one 256-bit register holds 4 consecutive weights of each of 8 columns, so its
 * products with 4 input bytes broadcast land in 8 lanes, one per column (no horizontal sums), and a
 * block's scales apply to 8 columns in one instruction. A group's weights are unpacked once per block
 * and meet up to 4 input rows while in registers. cpu_gemv.py's pack_q4 / pack_q8 write the layouts:
 *
 *   akv_q4_gemv: 4-bit weights in groups of 32 along k with a scale and an offset (Q4_1: w = scale * q
 *                + offset, q in 0..15). Group g, block b: 128 bytes, 4 registers P_j (j = 0..3); byte
 *                4c + t of P_j holds q[8g + c][32b + 4j + t] in its low nibble and q[8g + c][32b + 16 +
 *                4j + t] in its high one. Scales and offsets: [groups, blocks, 8] each.
 *   akv_q8_gemv: int8 weights (-127..127) with one scale per output column. Group g, block b: 256
 *                bytes, 8 registers R_j (j = 0..7); byte 4c + t of R_j holds q[8g + c][32b + 4j + t].
 *                Scales: [groups * 8].
 *
 * y [M, N] fp32 = h(x) [M, K] times the weights [N, K] transposed (y += with `accumulate`: the
 * residual stream updated in place); K a multiple of 32, M at most AKV_MAX_ROWS. The input h(x) is x
 * itself, or with `glu` SiLU(x[:, :K]) * x[:, K:] (x [M, 2K]: the MLP's gate and up halves), then,
 * with `norm`, RMSNorm(h) * norm (fp32, as the model's own rms_norm): the small operations around a
 * product happen while its input is quantized instead of as separate tensor operations.
 *
 *   akv_f32_product: fp32 weights [N, K] as loaded (the dense kernel of akv_f32_gemv, below) after the same
 *                prologues, computed in fp32 instead of quantized; a decode step's layers may mix it with the
 *                quantized ones (`bits` 32 in AkvProjection).
 *
 *   akv_decode_attention: one new token per sequence: RoPE on its q and k heads, its K/V written to
 *                its pool slot, then attention over the sequence's listed slots read in place; with `mass`
 *                (akv_decode_layers too) each (row, head)'s attention weights are added into it, over all
 *                layers of the call: what the tokens' queries attended to (an asked reply attribution).
 *
 *   akv_causal_attention: a prompt's new tokens against every key before them and each other (prefill),
 *                fp32 flash attention: blocks of keys stream past a block of queries with an online
 *                softmax, so no [heads, n, K] score matrix is ever held (section at the end).
 *
 *   akv_rows_prologue, akv_rotate_and_store: a prefill's rows through the prologue above (RMSNorm, SiLU(gate) *
 *                up) and through decode attention's first half (RoPE, the new K/V to the pool), around the
 *                float32 path's products; like akv_causal_attention, on torch's OpenMP threads
 *                (run_unsynchronized).
 *
 * Structure: a product quantizes its input rows once (`quantize`), then an inner kernel fills one range of
 * output columns [n0, n1) (`q4_columns`, `q8_columns`); attention rotates and stores the new K/V per row range
 * (`rotate_and_store`), then attends per range of (row, head) items (`attend`). A column's or a head's result
 * does not depend on the range it was computed in.
 *
 * Built at run time by akv_core/kernels/cpu_gemv.py, only where the CPU has AVX2 and FMA.
 */
#define _GNU_SOURCE   /* dl_iterate_phdr, RTLD_NOLOAD */
#include <dlfcn.h>
#include <immintrin.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define AKV_BLOCK 32
#define AKV_MAX_ROWS 16
#define AKV_GROUP 8        /* output columns whose weights are interleaved and computed together */
#define AKV_PREFETCH 2048  /* bytes ahead of the weights being read */
#define AKV_SLOTS_AHEAD 4  /* KV slots ahead of the one being read */

int akv_max_rows(void) { return AKV_MAX_ROWS; }

static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline float hmax(__m256 v) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* e^x for 8 floats at once (Cephes' expf polynomial, relative error about 2e-7; x below -87 gives ~1e-38). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

/* x [M, K] -> q int8 [M, K], d [M, K/32] (q * d ~ x), s [M, K/32] (d * sum of the block's q). Each value is
 * rounded to the nearest integer, ties to even (vcvtps2dq in the default rounding mode, as lrintf). */
static void quantize_rows(const float *x, int64_t m_rows, int64_t k, int8_t *q, float *d, float *s) {
    const int64_t blocks = k / AKV_BLOCK;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < m_rows * blocks; i++) {
        const float *p = x + i * AKV_BLOCK;
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(p + 8 * j);
        const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                         _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
        const float amax = hmax(top), scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i n[4];
        for (int j = 0; j < 4; j++) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse)));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
        _mm256_storeu_si256((__m256i *)(q + i * AKV_BLOCK), _mm256_permutevar8x32_epi32(bytes, order));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
        d[i] = scale;
        s[i] = scale * hsum(_mm256_cvtepi32_ps(total));
    }
}

typedef struct { int8_t *q; float *d, *s; } Quantized;

/* h [width] = SiLU(gate) * up (width a multiple of 8). */
static void silu_times(const float *gate, const float *up, int64_t width, float *h) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < width; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
}

/* The product's input rows h(x) [M, K] (see the header), into `h`; K a multiple of 32. */
static void prologue(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, float *h) {
    for (int64_t m = 0; m < m_rows; m++) {
        float *row = h + m * k;
        if (glu) silu_times(x + m * 2 * k, x + m * 2 * k + k, k, row);
        else memcpy(row, x + m * k, sizeof(float) * (size_t)k);
        if (norm) {
            __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
            for (int64_t i = 0; i < k; i += 16) {
                const __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + i + 8);
                sum0 = _mm256_fmadd_ps(a, a, sum0);
                sum1 = _mm256_fmadd_ps(b, b, sum1);
            }
            const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum(_mm256_add_ps(sum0, sum1)) / (float)k + eps));
            for (int64_t i = 0; i < k; i += 8)
                _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(norm + i), _mm256_mul_ps(_mm256_loadu_ps(row + i), scale)));
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
            silu_times(gate, up, width, h);
            row = h;
        }
        quantize_rows(row, 1, width, r->a.q + m * k + i0, r->a.d + m * blocks + b0, r->a.s + m * blocks + b0);
    }
}

/* y[m][c] for the output columns c in [n0, n1) of one group of 8 (`c0` its first) from the group's results
 * r[m][8]: written, or added with `accumulate`. */
static inline void store_group(float *y, int64_t m_rows, int64_t n, int64_t c0, int64_t n0, int64_t n1,
                               const float (*r)[AKV_GROUP], int accumulate) {
    const int64_t lo = c0 > n0 ? c0 : n0, hi = c0 + AKV_GROUP < n1 ? c0 + AKV_GROUP : n1;
    for (int64_t m = 0; m < m_rows; m++)
        for (int64_t c = lo; c < hi; c++) {
            float *out = y + m * n + c;
            *out = accumulate ? *out + r[m][c - c0] : r[m][c - c0];
        }
}

static inline __m256i broadcast4(const int8_t *p) {  /* 4 input bytes in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Rows [m0, m0 + rows) (rows <= 4, a constant once inlined) times one Q4 group of 8 columns: acc[r] lane c =
 * row m0 + r times column c. Per block the group's weights are unpacked once and meet every row: a row's 8
 * products per column stay in 16-bit lanes (each at most 8 * 2 * 15 * 127 < 2^15) until one vpmaddwd, and
 * the block's scales and offsets are applied to the 8 columns at once. */
static inline __attribute__((always_inline)) void q4_rows(const Quantized *a, int64_t m0, int rows, int64_t k,
                                                          const uint8_t *w, const float *scale, const float *offset,
                                                          __m256 *acc) {
    const int64_t blocks = k / AKV_BLOCK;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * 4 * AKV_BLOCK;
        _mm_prefetch((const char *)(wb + AKV_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + AKV_PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(scale + b * AKV_GROUP + AKV_PREFETCH / 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(offset + b * AKV_GROUP + AKV_PREFETCH / 8), _MM_HINT_T0);
        __m256i sum[4];
        for (int j = 0; j < 4; j++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(wb + j * AKV_BLOCK));
            const __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = a->q + (m0 + r) * k + b * AKV_BLOCK + 4 * j;
                const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(x)),
                                                   _mm256_maddubs_epi16(hi, broadcast4(x + 16)));
                sum[r] = j ? _mm256_add_epi16(sum[r], t) : t;
            }
        }
        const __m256 s = _mm256_loadu_ps(scale + b * AKV_GROUP), o = _mm256_loadu_ps(offset + b * AKV_GROUP);
        for (int r = 0; r < rows; r++) {
            const int64_t i = (m0 + r) * blocks + b;
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r], ones));
            acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(s, _mm256_set1_ps(a->d[i])), acc[r]);
            acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(a->s[i]), acc[r]);
        }
    }
}

/* Rows [m0, m0 + rows) times one int8 group of 8 columns (before the columns' scales). |w| meets the input
 * with w's sign (vpsignb), so vpmaddubsw's pairs stay below 2^15; they are widened per 4 inputs. */
static inline __attribute__((always_inline)) void q8_rows(const Quantized *a, int64_t m0, int rows, int64_t k,
                                                          const int8_t *w, __m256 *acc) {
    const int64_t blocks = k / AKV_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *wb = w + b * AKV_GROUP * AKV_BLOCK;
        for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(wb + AKV_PREFETCH + 64 * line), _MM_HINT_T0);
        __m256i sum[4];
        for (int j = 0; j < 8; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wb + j * AKV_BLOCK));
            const __m256i magnitude = _mm256_sign_epi8(wv, wv);
            for (int r = 0; r < rows; r++) {
                const __m256i x = _mm256_sign_epi8(broadcast4(a->q + (m0 + r) * k + b * AKV_BLOCK + 4 * j), wv);
                const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones);
                sum[r] = j ? _mm256_add_epi32(sum[r], t) : t;
            }
        }
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(a->d[(m0 + r) * blocks + b]), acc[r]);
    }
}

/* Columns [n0, n1) of y [M, N] for the 4-bit weights: the inner kernel of akv_q4_gemv, over one range of output
 * columns so that ranges can run on different threads (the groups of 8 that overlap the range are computed
 * whole: each column's sum is the same whatever the range). */
static void q4_columns(const Quantized *a, int64_t m_rows, int64_t k, int accumulate, const uint8_t *w,
                       const float *w_scale, const float *w_offset, int64_t n, int64_t n0, int64_t n1, float *y) {
    const int64_t blocks = k / AKV_BLOCK;
    for (int64_t g = n0 / AKV_GROUP; g * AKV_GROUP < n1; g++) {
        const uint8_t *wg = w + g * blocks * 4 * AKV_BLOCK;
        const float *scale = w_scale + g * blocks * AKV_GROUP, *offset = w_offset + g * blocks * AKV_GROUP;
        float r[AKV_MAX_ROWS][AKV_GROUP];
        for (int64_t m0 = 0; m0 < m_rows; m0 += 4) {
            __m256 acc[4];
            switch (m_rows - m0 < 4 ? m_rows - m0 : 4) {
                case 1: q4_rows(a, m0, 1, k, wg, scale, offset, acc); break;
                case 2: q4_rows(a, m0, 2, k, wg, scale, offset, acc); break;
                case 3: q4_rows(a, m0, 3, k, wg, scale, offset, acc); break;
                default: q4_rows(a, m0, 4, k, wg, scale, offset, acc); break;
            }
            for (int64_t i = 0; i < 4 && m0 + i < m_rows; i++) _mm256_storeu_ps(r[m0 + i], acc[i]);
        }
        store_group(y, m_rows, n, g * AKV_GROUP, n0, n1, (const float (*)[AKV_GROUP])r, accumulate);
    }
}

/* Columns [n0, n1) of y [M, N] for int8 weights: the inner kernel of akv_q8_gemv (see q4_columns). */
static void q8_columns(const Quantized *a, int64_t m_rows, int64_t k, int accumulate, const int8_t *w,
                       const float *w_scale, int64_t n, int64_t n0, int64_t n1, float *y) {
    for (int64_t g = n0 / AKV_GROUP; g * AKV_GROUP < n1; g++) {
        const int8_t *wg = w + g * AKV_GROUP * k;
        const __m256 scale = _mm256_loadu_ps(w_scale + g * AKV_GROUP);
        float r[AKV_MAX_ROWS][AKV_GROUP];
        for (int64_t m0 = 0; m0 < m_rows; m0 += 4) {
            __m256 acc[4];
            switch (m_rows - m0 < 4 ? m_rows - m0 : 4) {
                case 1: q8_rows(a, m0, 1, k, wg, acc); break;
                case 2: q8_rows(a, m0, 2, k, wg, acc); break;
                case 3: q8_rows(a, m0, 3, k, wg, acc); break;
                default: q8_rows(a, m0, 4, k, wg, acc); break;
            }
            for (int64_t i = 0; i < 4 && m0 + i < m_rows; i++) _mm256_storeu_ps(r[m0 + i], _mm256_mul_ps(acc[i], scale));
        }
        store_group(y, m_rows, n, g * AKV_GROUP, n0, n1, (const float (*)[AKV_GROUP])r, accumulate);
    }
}

/* x [D] rotated in place by one row of cos / signed sin [rotary] (rotate-half: x * cos + roll(x, half) * sin). */
static void rotate(float *x, int rotary, const float *cos, const float *ssin) {
    const int half = rotary / 2;
    float rolled[512];
    for (int i = 0; i < rotary; i++) rolled[i] = x[i < half ? i + half : i - half];
    for (int i = 0; i < rotary; i++) x[i] = x[i] * cos[i] + rolled[i] * ssin[i];
}

static inline float dot(const float *a, const float *b, int d) {  /* d a multiple of 8; two chains of FMAs */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    if (i < d) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* p [count] <- softmax(p) in place (the exponentials 8 at a time). */
static void softmax(float *p, int64_t count) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t t = 0; t < count; t++) top = fmaxf(top, p[t]);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= count; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), shift));
        _mm256_storeu_ps(p + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    for (; t < count; t++) { p[t] = expf(p[t] - top); total += p[t]; }
    total += hsum(sum);
    const float norm = total > 0.0f ? 1.0f / total : 0.0f;
    for (t = 0; t < count; t++) p[t] *= norm;
}

/* The `width` floats of pool row seen[t] asked for a cache line at a time, if t < count (a sequence's slots are
 * gathered, and the K/V of all layers and sequences rarely fits in cache). */
static inline void prefetch_row(const float *pool, const int64_t *seen, int64_t t, int64_t count, int64_t width) {
    if (t >= count) return;
    const char *row = (const char *)(pool + seen[t] * width);
    for (int64_t i = 0; i < width * (int64_t)sizeof(float); i += 64) _mm_prefetch(row + i, _MM_HINT_T0);
}

/* o [D] += p * v [D] (D a multiple of 8). */
static inline void add_scaled(float *o, float p, const float *v, int64_t d) {
    const __m256 w = _mm256_set1_ps(p);
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
}

/* mass [count] += weights [count]: a (row, head) item's attention weights, owned by the one thread attending it. */
static void add_weights(float *mass, const float *weights, int64_t count) {
    int64_t t = 0;
    for (; t + 8 <= count; t += 8)
        _mm256_storeu_ps(mass + t, _mm256_add_ps(_mm256_loadu_ps(mass + t), _mm256_loadu_ps(weights + t)));
    for (; t < count; t++) mass[t] += weights[t];
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
    float *mass;   /* NULL, or laid out as the scores: each (row, head)'s weights added in, layer after layer */
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
 * K/V is in the pool. scores: H * offsets[M] floats, head h of row m at H * offsets[m] + h * count. A row's
 * heads within the range are done together: each slot's key row, then its value row, is read once for all
 * of them, in slot order. A head's result is the same whatever the range. */
static void attend(const float *qkv, const Attention *at, int64_t i0, int64_t i1, float *scores, float *out) {
    const int64_t d = at->d, heads = at->heads, group = heads / at->kv_heads, stride = at->kv_heads * d;
    const int64_t width = (heads + 2 * at->kv_heads) * d;
    for (int64_t i = i0; i < i1;) {
        const int64_t m = i / heads, h0 = i % heads, h1 = heads < h0 + (i1 - i) ? heads : h0 + (i1 - i);
        const int64_t *seen = at->slots + at->offsets[m], count = at->offsets[m + 1] - at->offsets[m];
        float *row_scores = scores + heads * at->offsets[m], *o = out + m * heads * d;
        const float *q = qkv + m * width;
        for (int64_t t = 0; t < count; t++) {
            prefetch_row(at->k_pool, seen, t + AKV_SLOTS_AHEAD, count, stride);
            const float *key = at->k_pool + seen[t] * stride;
            for (int64_t h = h0; h < h1; h++) row_scores[h * count + t] = dot(q + h * d, key + h / group * d, (int)d) * at->scale;
        }
        for (int64_t h = h0; h < h1; h++) softmax(row_scores + h * count, count);
        if (at->mass) add_weights(at->mass + heads * at->offsets[m] + h0 * count, row_scores + h0 * count,
                                  (h1 - h0) * count);
        memset(o + h0 * d, 0, sizeof(float) * (size_t)((h1 - h0) * d));
        for (int64_t t = 0; t < count; t++) {
            prefetch_row(at->v_pool, seen, t + AKV_SLOTS_AHEAD, count, stride);
            const float *value = at->v_pool + seen[t] * stride;
            for (int64_t h = h0; h < h1; h++) add_scaled(o + h * d, row_scores[h * count + t], value + h / group * d, d);
        }
        i += h1 - h0;
    }
}

/* What the loops below rely on (cpu_gemv.py checks these, and the slot indices against the pool, before the call;
 * kv_heads is tested before it divides). */
static int attention_valid(const Attention *at) {
    return at->m_rows >= 0 && at->heads >= 1 && at->kv_heads >= 1 && at->d >= 8 && at->rotary >= 0
           && !(at->d % 8 || at->rotary > 512 || at->rotary > at->d || at->heads % at->kv_heads);
}

/* Dense fp32 products for a few rows: y [M, N] = x [M, K] times w [N, K] transposed (the weights as loaded,
 * row-major; K a multiple of 8). A strip of 3 weight rows is read from memory once and stays in L1 while
 * every 4 input rows meet it (12 accumulators), so the weights stream once for all rows (a strip's first
 * pass prefetches the strip F32_AHEAD later, so the reads go on while passes compute); each output
 * is one row's own chain of FMAs over k, whatever M and the column range (a row's result does not depend on
 * the rows beside it). */
#define F32_ROWS 4   /* input rows per pass over a strip */
#define F32_COLS 3   /* weight rows (output columns) per strip: 12 accumulators, 3 weights and 1 input in registers */
#define F32_AHEAD 2  /* strips ahead of the one being computed that its first pass prefetches */

static inline __attribute__((always_inline)) void f32_strip(const float *x, int rows, int64_t k, const float *w,
                                                              int cols, float *y, int64_t n, const float *ahead,
                                                              int accumulate) {
    __m256 acc[F32_ROWS][F32_COLS];
    for (int r = 0; r < F32_ROWS; r++)
        for (int j = 0; j < F32_COLS; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[F32_COLS];
        if (ahead && (i & 15) == 0)
            for (int j = 0; j < F32_COLS; j++) _mm_prefetch((const char *)(ahead + j * k + i), _MM_HINT_T0);
        for (int j = 0; j < F32_COLS; j++) wv[j] = j < cols ? _mm256_loadu_ps(w + j * k + i) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + i);
            for (int j = 0; j < F32_COLS; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) y[r * n + j] = accumulate ? y[r * n + j] + hsum(acc[r][j]) : hsum(acc[r][j]);
}

/* The strip for constant row and column counts, so that the accumulators stay in registers. */
static void f32_strip_full(const float *x, int rows, int64_t k, const float *w, float *y, int64_t n,
                           const float *ahead, int accumulate) {
    switch (rows) {
    case 4: f32_strip(x, 4, k, w, F32_COLS, y, n, ahead, accumulate); break;
    case 3: f32_strip(x, 3, k, w, F32_COLS, y, n, ahead, accumulate); break;
    case 2: f32_strip(x, 2, k, w, F32_COLS, y, n, ahead, accumulate); break;
    default: f32_strip(x, 1, k, w, F32_COLS, y, n, ahead, accumulate); break;
    }
}

/* Columns [n0, n1) of y [M, N] = x [M, K] times w transposed (added into y with `accumulate`). */
static void f32_columns(const float *x, int64_t m_rows, int64_t k, const float *w, int64_t n, int64_t n0, int64_t n1,
                        float *y, int accumulate) {
    for (int64_t c = n0; c < n1; c += F32_COLS) {
        const int cols = n1 - c < F32_COLS ? (int)(n1 - c) : F32_COLS;
        for (int64_t m = 0; m < m_rows; m += F32_ROWS) {
            const int rows = m_rows - m < F32_ROWS ? (int)(m_rows - m) : F32_ROWS;
            /* With several input rows, the first pass over a strip prefetches a later one, so that memory
             * keeps streaming while the passes compute from L1 (one row: a single pass, bound by memory, which
             * the hardware prefetcher already streams). */
            const float *ahead = m == 0 && m_rows > 1 && c + (F32_AHEAD + 1) * F32_COLS <= n1
                                 ? w + (c + F32_AHEAD * F32_COLS) * k : NULL;
            if (cols == F32_COLS) f32_strip_full(x + m * k, rows, k, w + c * k, y + m * n + c, n, ahead, accumulate);
            else f32_strip(x + m * k, rows, k, w + c * k, cols, y + m * n + c, n, ahead, accumulate);
        }
    }
}

/* One projection of a layer in the layouts above: `bits` 4 (w, scale and offset), 8 (w and scale; offset
 * unused) or 32 (w: the fp32 weight [N, K] as loaded, row-major; scale and offset unused). */
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
    return (p->bits == 4 || p->bits == 8 || p->bits == 32) && m_rows >= 1 && m_rows <= AKV_MAX_ROWS
           && p->k % AKV_BLOCK == 0;
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
    int (*thread_of)(void);          /* a member's index, on OpenMP's threads (run_unsynchronized) */
    int joined;                      /* how many OpenMP threads ran the job (run_unsynchronized) */
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

static int forked;   /* in a forked child: OpenMP's threads, which the child lacks, are never asked for */

static void forget_workers(void) {   /* in a forked child, which has only the forking thread */
    forked = 1;
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.started = 0;
}

static void once(void) { pthread_atfork(NULL, NULL, forget_workers); }

static void watch_forks(void) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, once);
}

/* Start workers (signals blocked: they stay with Python's threads) until `threads` can run; the count that can. */
static int grow(int threads) {
    watch_forks();
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

/* A prompt's attention runs for tens of milliseconds right after torch's own operators, whose OpenMP threads
 * keep spinning on the cores for a while once an operator ends: a job of our pool started then shares a core with
 * a spinning thread (a 2,048-token layer's attention: 35.3 ms on the pool against 30.1 ms on OpenMP's threads, on 2
 * cores, `python benchmarks/prefill_attention.py --parts attention`; docs/benchmarks.md).
 * Such a job runs on torch's OpenMP threads instead: the runtime torch loaded (libgomp, or LLVM's / Intel's,
 * which export the same GOMP_parallel entry point) is found among the loaded libraries, never loaded anew. Its
 * jobs claim work as the pool's do and end without a barrier (the runtime joins its threads). Without such a
 * runtime, after akv_use_openmp(0), and in a forked child (libgomp would wait there for the parent's threads,
 * which the child does not have), the job runs on the pool. */
typedef void (*OmpParallel)(void (*)(void *), void *, unsigned, unsigned);

static struct {
    OmpParallel parallel;
    int (*thread_num)(void), (*num_threads)(void);
    char name[128];
} omp;
static _Atomic int omp_wanted = 1;

static int find_omp(struct dl_phdr_info *info, size_t size, void *unused) {
    (void)size; (void)unused;
    const char *path = info->dlpi_name, *base = path ? strrchr(path, '/') : NULL;
    base = base ? base + 1 : path;
    if (!base || (strncmp(base, "libgomp", 7) && strncmp(base, "libiomp", 7) && strncmp(base, "libomp", 6))) return 0;
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!handle) return 0;
    omp.parallel = (OmpParallel)dlsym(handle, "GOMP_parallel");
    omp.thread_num = (int (*)(void))dlsym(handle, "omp_get_thread_num");
    omp.num_threads = (int (*)(void))dlsym(handle, "omp_get_num_threads");
    if (!omp.parallel || !omp.thread_num || !omp.num_threads) { omp.parallel = NULL; return 0; }
    strncpy(omp.name, base, sizeof(omp.name) - 1);
    return 1;
}

static void look_for_omp(void) { dl_iterate_phdr(find_omp, NULL); }

static int omp_found(void) {
    static pthread_once_t looked = PTHREAD_ONCE_INIT;
    pthread_once(&looked, look_for_omp);
    return omp.parallel != NULL;
}

/* The OpenMP runtime's file name, or "" when none is loaded (or it lacks the entry points). */
const char *akv_openmp_runtime(void) { return omp_found() ? omp.name : ""; }

/* 0: barrier-free jobs run on the pool too (to compare the two, and for tests); 1 (the default): on OpenMP. */
void akv_use_openmp(int wanted) { atomic_store(&omp_wanted, wanted != 0); }

static void omp_member(void *team) {
    Team *t = team;
    Member me = {t, t->thread_of(), 0};
    if (me.thread == 0) t->joined = omp.num_threads();
    t->job(&me);
}

/* Run a barrier-free `job` on `threads` of torch's OpenMP threads where they can be had, else on the pool. */
static void run_unsynchronized(Job job, void *context, int64_t threads) {
    watch_forks();
    if (threads < 2 || forked || !atomic_load(&omp_wanted) || !omp_found()) {
        run_team(job, context, threads);
        return;
    }
    const int asked = (int)(threads < AKV_MAX_THREADS ? threads : AKV_MAX_THREADS);
    Team team = {.threads = asked, .job = job, .context = context, .thread_of = omp.thread_num};
    omp.parallel(omp_member, &team, (unsigned)asked, 0);
    last_threads = team.joined;
}

/* h(x) [M, K] of a prefill-sized input (the header's prologue: RMSNorm, or SiLU(gate) * up, of each row), rows
 * shared in pieces of 16 between the threads: the norms and the MLP's gate around oneDNN's products in one pass
 * over the rows instead of torch's several. */
typedef struct { const float *x, *norm; int64_t m_rows, k; float eps; int glu; float *h; } RowsPrologue;

#define AKV_THREADED_ROWS 64   /* fewer rows run on the calling thread alone: a team costs more than it saves */

static void rows_prologue_job(Member *me) {
    const RowsPrologue *c = me->team->context;
    const int64_t width = c->glu ? 2 * c->k : c->k;
    for (int64_t m0, m1; claim(me, c->m_rows, 16, &m0, &m1);)
        prologue(c->x + m0 * width, m1 - m0, c->k, c->norm, c->eps, c->glu, c->h + m0 * c->k);
}

int akv_rows_prologue(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, float *h,
                      int64_t threads) {
    if (m_rows < 1 || k < 16 || k % 16 || threads < 1) return -2;
    RowsPrologue c = {x, norm, m_rows, k, eps, glu, h};
    run_unsynchronized(rows_prologue_job, &c, m_rows < AKV_THREADED_ROWS ? 1 : threads);
    return 0;
}

/* A prompt's rows: rotate_and_store alone (the rows then attend in akv_causal_attention), rows shared in pieces of
 * 16. */
typedef struct { float *qkv; const Attention *at; } Rotation;

static void rotation_job(Member *me) {
    const Rotation *c = me->team->context;
    for (int64_t m0, m1; claim(me, c->at->m_rows, 16, &m0, &m1);) rotate_and_store(c->qkv, c->at, m0, m1);
}

int akv_rotate_and_store(float *qkv, int64_t m_rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t rotary,
                         const float *cos, const float *ssin, float *k_pool, float *v_pool, const int64_t *out_slots,
                         int64_t threads) {
    const Attention at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, k_pool, v_pool, out_slots, NULL, NULL, 0.0f,
                          NULL};
    if (m_rows < 1 || threads < 1 || !attention_valid(&at)) return -2;
    Rotation c = {qkv, &at};
    run_unsynchronized(rotation_job, &c, m_rows < AKV_THREADED_ROWS ? 1 : threads);
    return 0;
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

/* A product of fp32 weights: h(x) into the scratch rows (each row by one thread) where there is a prologue,
 * then its columns, read from h or from x itself. */
static void f32_product(Member *me, const Product *c) {
    const AkvProjection *p = c->p;
    const float *rows = c->x;
    int64_t m0, m1, n0, n1;
    if (c->norm || c->glu) {
        share_rows(me, c->m_rows, &m0, &m1);
        if (m0 < m1) prologue(c->x + m0 * (c->glu ? 2 * p->k : p->k), m1 - m0, p->k, c->norm, c->eps, c->glu,
                              c->r->h + m0 * p->k);
        barrier(me);
        rows = c->r->h;
    }
    while (claim_columns(me, p->n, &n0, &n1)) {
        f32_columns(rows, c->m_rows, p->k, p->w, p->n, n0, n1, c->y, c->accumulate);
        if (c->bias) add_bias(c->y, c->bias, c->m_rows, p->n, n0, n1);
    }
    barrier(me);
}

static void product(Member *me, const Product *c) {
    int64_t m0, m1, n0, n1;
    if (c->p->bits == 32) {
        f32_product(me, c);
        return;
    }
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

int akv_f32_product(const float *x, int64_t m_rows, int64_t k, const float *norm, float eps, int glu, int accumulate,
                    const float *w, int64_t n, float *y, int64_t threads) {
    const AkvProjection p = {32, n, k, w, NULL, NULL};
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
                         const int64_t *slots, const int64_t *offsets, float scale, float *out, float *mass,
                         int64_t threads) {
    const Attention at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, k_pool, v_pool, out_slots, slots, offsets, scale,
                          mass};
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
                      const int64_t *slots, const int64_t *offsets, float scale, float *mass, int64_t threads) {
    if (num_layers < 1) return 0;
    Decode c = {.layers = layers, .num_layers = num_layers, .k_pools = k_pools, .v_pools = v_pools, .x = x, .eps = eps,
                .at = {m_rows, heads, kv_heads, d, rotary, cos, ssin, NULL, NULL, out_slots, slots, offsets, scale,
                       mass}};
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

typedef struct { const float *x, *w; int64_t m_rows, k, n; float *y; } DenseProduct;

static void dense_job(Member *me) {
    const DenseProduct *c = me->team->context;
    int64_t n0, n1;
    while (claim_columns(me, c->n, &n0, &n1)) f32_columns(c->x, c->m_rows, c->k, c->w, c->n, n0, n1, c->y, 0);
    barrier(me);
}

/* y [M, N] = x [M, K] times w [N, K] transposed, all fp32, on `threads` threads; K a multiple of 8. */
int akv_f32_gemv(const float *x, int64_t m_rows, int64_t k, const float *w, int64_t n, float *y, int64_t threads) {
    if (k % 8 || m_rows < 1 || m_rows > AKV_MAX_ROWS) return -2;
    DenseProduct c = {x, w, m_rows, k, n, y};
    run_team(dense_job, &c, threads);
    return 0;
}

/* ---- Causal attention of a prompt's new tokens (prefill), fp32 ----
 *
 * q [n, H, D] (row stride q_stride floats) against keys / values [K, Hk, D] (row strides k_stride, v_stride;
 * K >= n): query i sees keys 0 .. K - n + i (the new tokens are the last n keys). out [n, H, D] contiguous.
 * A flash attention: per unit of work (one key head, one block of CA_QUERIES query positions), the queries of
 * every head sharing that key head are stacked into one matrix of rows, so each block of keys is read once for
 * them all; scores for CA_KEYS keys at a time (a 6 x 16 register tile of FMAs over D), a running max and sum per
 * row (online softmax), and the weighted values added into the rows' outputs (the same tile shape over D).
 * Units are claimed latest block first (they see the most keys). D a multiple of 16, at most CA_MAX_D. */
#define CA_QUERIES 32
#define CA_KEYS 64
#define CA_TILE_ROWS 6
#define CA_MAX_D 256

typedef struct {
    const float *q, *k, *v;
    int64_t q_stride, k_stride, v_stride, n, total, heads, kv_heads, d;
    float scale;
    float *out, *scratch;   /* scratch: ca_scratch_floats per thread */
    float *kt;              /* the keys transposed per block: [Hk, keys_pad / CA_KEYS, D, CA_KEYS] */
    int64_t keys_pad;       /* K rounded up to whole blocks of CA_KEYS */
} CausalAttention;

/* s [rows_pad, CA_KEYS] = qs [rows_pad, d] times kt [d, CA_KEYS] (rows_pad a multiple of 6), the first `count`
 * keys' columns (rounded up to 16) only: the softmax reads no further. */
static void ca_scores(const float *qs, int64_t rows_pad, int64_t d, const float *kt, int64_t count, float *s) {
    for (int64_t r = 0; r < rows_pad; r += CA_TILE_ROWS)
        for (int64_t c = 0; c < count; c += 16) {
            __m256 acc[CA_TILE_ROWS][2];
            for (int i = 0; i < CA_TILE_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
            for (int64_t t = 0; t < d; t++) {
                const __m256 b0 = _mm256_loadu_ps(kt + t * CA_KEYS + c), b1 = _mm256_loadu_ps(kt + t * CA_KEYS + c + 8);
                for (int i = 0; i < CA_TILE_ROWS; i++) {
                    const __m256 a = _mm256_broadcast_ss(qs + (r + i) * d + t);
                    acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
                }
            }
            for (int i = 0; i < CA_TILE_ROWS; i++) {
                _mm256_storeu_ps(s + (r + i) * CA_KEYS + c, acc[i][0]);
                _mm256_storeu_ps(s + (r + i) * CA_KEYS + c + 8, acc[i][1]);
            }
        }
}

/* o [rows_pad, d] = o * alpha (per row) + p [rows_pad, CA_KEYS] times the `count` value rows at v (stride). */
static void ca_values(const float *p, int64_t rows_pad, int64_t count, const float *v, int64_t v_stride, int64_t d,
                      const float *alpha, float *o) {
    for (int64_t r = 0; r < rows_pad; r += CA_TILE_ROWS)
        for (int64_t c = 0; c < d; c += 16) {
            __m256 acc[CA_TILE_ROWS][2];
            for (int i = 0; i < CA_TILE_ROWS; i++) {
                const __m256 a = _mm256_broadcast_ss(alpha + r + i);
                acc[i][0] = _mm256_mul_ps(a, _mm256_loadu_ps(o + (r + i) * d + c));
                acc[i][1] = _mm256_mul_ps(a, _mm256_loadu_ps(o + (r + i) * d + c + 8));
            }
            for (int64_t j = 0; j < count; j++) {
                const float *row = v + j * v_stride + c;
                const __m256 b0 = _mm256_loadu_ps(row), b1 = _mm256_loadu_ps(row + 8);
                for (int i = 0; i < CA_TILE_ROWS; i++) {
                    const __m256 a = _mm256_broadcast_ss(p + (r + i) * CA_KEYS + j);
                    acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
                }
            }
            for (int i = 0; i < CA_TILE_ROWS; i++) {
                _mm256_storeu_ps(o + (r + i) * d + c, acc[i][0]);
                _mm256_storeu_ps(o + (r + i) * d + c + 8, acc[i][1]);
            }
        }
}

/* Row r's scores -> its weights: its first `visible` of the block's scores seen (the rest zeroed), the running
 * max m and sum l updated, alpha the factor its earlier output is kept with. */
static void ca_softmax_row(float *s, int64_t visible, float *m, float *l, float *alpha) {
    if (visible <= 0) {   /* nothing in this block for this row */
        memset(s, 0, sizeof(float) * CA_KEYS);
        *alpha = 1.0f;
        return;
    }
    const int64_t whole = visible / 8 * 8;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < whole; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
    float top = hmax(top8);
    for (int64_t j = whole; j < visible; j++) top = s[j] > top ? s[j] : top;
    const float m_new = top > *m ? top : *m;
    *alpha = m_new == *m ? 1.0f : *m == -INFINITY ? 0.0f : expf(*m - m_new);
    __m256 sum = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(m_new);
    for (int64_t j = 0; j < whole; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float tail = 0.0f;
    for (int64_t j = whole; j < visible; j++) { s[j] = expf(s[j] - m_new); tail += s[j]; }
    for (int64_t j = visible; j < CA_KEYS; j++) s[j] = 0.0f;
    *l = *l * *alpha + hsum(sum) + tail;
    *m = m_new;
}

typedef struct { float *qs, *s, *o, *m, *l, *alpha; } CaScratch;

/* One unit: key head `kh`, query positions [i0, i1). */
static void ca_unit(const CausalAttention *a, const CaScratch *w, int64_t kh, int64_t i0, int64_t i1) {
    const int64_t group = a->heads / a->kv_heads, span = i1 - i0, rows = group * span, d = a->d;
    const int64_t rows_pad = (rows + CA_TILE_ROWS - 1) / CA_TILE_ROWS * CA_TILE_ROWS, prefix = a->total - a->n;
    const float *kt = a->kt + kh * d * a->keys_pad;
    for (int64_t g = 0; g < group; g++)   /* row g * span + t: head kh * group + g, position i0 + t; scaled */
        for (int64_t t = 0; t < span; t++) {
            const float *src = a->q + (i0 + t) * a->q_stride + (kh * group + g) * d;
            for (int64_t e = 0; e < d; e++) w->qs[(g * span + t) * d + e] = src[e] * a->scale;
        }
    memset(w->qs + rows * d, 0, sizeof(float) * (size_t)((rows_pad - rows) * d));
    memset(w->o, 0, sizeof(float) * (size_t)(rows_pad * d));
    for (int64_t r = 0; r < rows_pad; r++) { w->m[r] = -INFINITY; w->l[r] = 0.0f; w->alpha[r] = 1.0f; }
    const int64_t keys = prefix + i1;   /* the last position's keys: 0 .. prefix + i1 - 1 */
    for (int64_t j0 = 0; j0 < keys; j0 += CA_KEYS) {
        const int64_t count = keys - j0 < CA_KEYS ? keys - j0 : CA_KEYS;
        ca_scores(w->qs, rows_pad, d, kt + j0 * d, count, w->s);
        for (int64_t r = 0; r < rows_pad; r++) {   /* row r sees keys up to its position (padding rows: all) */
            const int64_t seen = (r < rows ? prefix + i0 + r % span : keys - 1) - j0 + 1;
            ca_softmax_row(w->s + r * CA_KEYS, seen < count ? seen : count, w->m + r, w->l + r, w->alpha + r);
        }
        ca_values(w->s, rows_pad, count, a->v + j0 * a->v_stride + kh * d, a->v_stride, d, w->alpha, w->o);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < span; t++) {
            const int64_t r = g * span + t;
            const float inverse = 1.0f / w->l[r];
            float *dst = a->out + ((i0 + t) * a->heads + kh * group + g) * d;
            for (int64_t e = 0; e < d; e++) dst[e] = w->o[r * d + e] * inverse;
        }
}

static int64_t ca_rows_pad(int64_t heads, int64_t kv_heads) {
    return (heads / kv_heads * CA_QUERIES + CA_TILE_ROWS - 1) / CA_TILE_ROWS * CA_TILE_ROWS;
}

static int64_t ca_scratch_floats(int64_t rows_pad, int64_t d) {   /* qs, o, s, m, l, alpha */
    return rows_pad * d * 2 + rows_pad * CA_KEYS + rows_pad * 3;
}

/* Key block `block` of key head kh transposed into kt [Hk, blocks, D, CA_KEYS] (zeros past the last key): each
 * block's [D, CA_KEYS] contiguous, so a tile's rows do not alias in the caches. */
static void ca_transpose_keys(const CausalAttention *a, int64_t kh, int64_t block) {
    float *kt = a->kt + (kh * a->keys_pad + block * CA_KEYS) * a->d;
    for (int64_t j = 0; j < CA_KEYS; j++) {
        const int64_t key = block * CA_KEYS + j;
        const float *row = key < a->total ? a->k + key * a->k_stride + kh * a->d : NULL;
        for (int64_t e = 0; e < a->d; e++) kt[e * CA_KEYS + j] = row ? row[e] : 0.0f;
    }
}

static void transpose_keys_job(Member *me) {   /* every (key head, block), shared in pieces of 8 blocks */
    const CausalAttention *a = me->team->context;
    const int64_t blocks = a->keys_pad / CA_KEYS;
    for (int64_t i0, i1; claim(me, a->kv_heads * blocks, 8, &i0, &i1);)
        for (int64_t i = i0; i < i1; i++) ca_transpose_keys(a, i / blocks, i % blocks);
}

static void causal_attention_job(Member *me) {
    const CausalAttention *a = me->team->context;
    const int64_t rows_pad = ca_rows_pad(a->heads, a->kv_heads);
    const int64_t blocks = (a->n + CA_QUERIES - 1) / CA_QUERIES, units = blocks * a->kv_heads;
    int64_t u0, u1;
    CaScratch w;
    w.qs = a->scratch + me->thread * ca_scratch_floats(rows_pad, a->d);
    w.o = w.qs + rows_pad * a->d; w.s = w.o + rows_pad * a->d;
    w.m = w.s + rows_pad * CA_KEYS; w.l = w.m + rows_pad; w.alpha = w.l + rows_pad;
    while (claim(me, units, 1, &u0, &u1)) {
        const int64_t block = blocks - 1 - u0 / a->kv_heads, kh = u0 % a->kv_heads;
        const int64_t i0 = block * CA_QUERIES, i1 = i0 + CA_QUERIES < a->n ? i0 + CA_QUERIES : a->n;
        ca_unit(a, &w, kh, i0, i1);
    }   /* no barrier: run_unsynchronized */
}

/* See the section's header; returns 0, -2 for shapes it cannot take, -1 when out of memory. */
int akv_causal_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                         int64_t v_stride, int64_t n, int64_t total, int64_t heads, int64_t kv_heads, int64_t d,
                         float scale, float *out, int64_t threads) {
    if (n < 1 || total < n || kv_heads < 1 || heads % kv_heads || d % 16 || d > CA_MAX_D || threads < 1) return -2;
    if (threads > AKV_MAX_THREADS) threads = AKV_MAX_THREADS;
    const int64_t keys_pad = (total + CA_KEYS - 1) / CA_KEYS * CA_KEYS;
    float *scratch = malloc(sizeof(float) * (size_t)(threads * ca_scratch_floats(ca_rows_pad(heads, kv_heads), d)));
    float *kt = malloc(sizeof(float) * (size_t)(kv_heads * d * keys_pad));
    if (!scratch || !kt) { free(scratch); free(kt); return -1; }
    CausalAttention a = {q, k, v, q_stride, k_stride, v_stride, n, total, heads, kv_heads, d, scale, out, scratch, kt,
                         keys_pad};
    run_unsynchronized(transpose_keys_job, &a, threads);   /* two runs: the keys are all transposed before any */
    run_unsynchronized(causal_attention_job, &a, threads);  /* unit reads them */
    free(scratch); free(kt);
    return 0;
}
