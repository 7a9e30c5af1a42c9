/* kvflow's linear layers on quantized weights, read as they are stored:
 *
 *   kvflow_q_linear   y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 x and y, w quantized
 *                     (kvflow_q_linear_f32: float32 x and y)
 *   kvflow_q_dequant  w[N, K] -> bf16 (prefill: a large batch runs the bf16 matmul on it)
 *
 * The weight layout (made once by kvflow/model/quant_format.py from GGUF blocks or a float
 * checkpoint): K is cut in groups of `group` columns (a multiple of 16; K a multiple of 32);
 * w[n, k] = scales[n, k / group] * code[n, k] + mins[n, k / group], scales and mins float32.
 *   bits 8: int8 codes [N, K], column k at byte k.
 *   bits 4: unsigned 4-bit codes [N, K / 2]; each 32 columns c .. c + 31 take 16 bytes at
 *           c / 2: byte i holds column c + i in its low nibble and c + 16 + i in its high one.
 * GGUF's Q4_0, Q4_1, Q4_K map to bits 4 (group 32), Q5_K and Q8_0 to bits 8 (group 32), Q6_K
 * to bits 8 (group 16): every scale and min is the product of at most a float16 and a 6- or
 * 8-bit integer, exact in float32, so the weights are the values the file holds.
 *
 * A row's codes widen to float32 in registers (one fused multiply-add makes the weight) and
 * multiply float32 activations: at a few rows the step reads each weight byte once, which is
 * what bounds it. Rows of w are split among OpenMP threads (torch's runtime, shared).
 * Built by kvflow/model/quant_kernels.py like cpu_kernels.c (-march=native, GCC vectors: AVX-512
 * where the CPU has it, AVX2 halves elsewhere).
 */
#include <omp.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16c __attribute__((vector_size(16)));

#define MAX_ROWS 8 /* activation rows per pass over a weight row: one accumulator register each */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline v16f vload(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* The float codes of columns c .. c + 15 (lo) and c + 16 .. c + 31 (hi) of one weight row. GCC
 * turns a generic byte -> float vector conversion into one scalar conversion per lane. */
static inline __attribute__((always_inline)) void codes32(const uint8_t *row, int bits, int c,
                                                          v16f *lo, v16f *hi) {
#ifdef __AVX512F__
    if (bits == 4) {
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2)));
        *lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
        *hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
    } else {
        *lo = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
        *hi = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c + 16))));
    }
#else
    float a[16], b[16];
    if (bits == 4) {
        for (int i = 0; i < 16; i++) {
            a[i] = (float)(row[c / 2 + i] & 15);
            b[i] = (float)(row[c / 2 + i] >> 4);
        }
    } else {
        for (int i = 0; i < 16; i++) {
            a[i] = (float)(int8_t)row[c + i];
            b[i] = (float)(int8_t)row[c + 16 + i];
        }
    }
    memcpy(lo, a, sizeof a);
    memcpy(hi, b, sizeof b);
#endif
}

/* out[r * mb + m] = sum_k w[n + r, k] x[m, k] for r < nr weight rows (of `row_bytes` bytes,
 * `groups` scales each) and m < mb activation rows (float32, stride ldx). Two accumulators per
 * output (columns c.. and c + 16..) and several weight rows at a time at one or two activation
 * rows: independent chains of fused multiply-adds, which a single chain's latency would bound. */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *row, long row_bytes,
                                                           int bits, const float *sc,
                                                           const float *mn, int groups,
                                                           int group, const float *x, long ldx,
                                                           int k, int nr, int mb, float *out) {
    v16f acc[4][MAX_ROWS][2];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) acc[r][m][0] = acc[r][m][1] = (v16f){0};
    for (int c = 0; c < k; c += 32) {
        int g0 = c / group, g1 = (c + 16) / group;
        for (int r = 0; r < nr; r++) {
            v16f lo, hi;
            codes32(row + r * row_bytes, bits, c, &lo, &hi);
            const float *s = sc + r * groups, *o = mn + r * groups;
            v16f w0 = lo * s[g0] + o[g0];
            v16f w1 = hi * s[g1] + o[g1];
            for (int m = 0; m < mb; m++) {
                acc[r][m][0] += w0 * vload(x + m * ldx + c);
                acc[r][m][1] += w1 * vload(x + m * ldx + c + 16);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) out[r * mb + m] = hsum(acc[r][m][0] + acc[r][m][1]);
}

#define TILE(NR, MB) tile_dot(row, row_bytes, bits, sc, mn, groups, group, x, ldx, k, NR, MB, out)

/* One tile: `nr` weight rows (4 at one activation row, 2 at two, else 1) by `mb` rows of x. */
static void tile(const uint8_t *row, long row_bytes, int bits, const float *sc, const float *mn,
                 int groups, int group, const float *x, long ldx, int k, int nr, int mb,
                 float *out) {
    if (nr == 4) TILE(4, 1);
    else if (nr == 2) TILE(2, 2);
    else switch (mb) { /* a copy per row count: the accumulators stay in registers */
    case 1: TILE(1, 1); break;
    case 2: TILE(1, 2); break;
    case 3: TILE(1, 3); break;
    case 4: TILE(1, 4); break;
    case 5: TILE(1, 5); break;
    case 6: TILE(1, 6); break;
    case 7: TILE(1, 7); break;
    default: TILE(1, MAX_ROWS); break;
    }
}

/* y[M, N] (row stride N) = xf[M, K] (float32) @ w^T + bias: y and bias bf16 (f32 == 0) or
 * float32 (f32 == 1; bias may be NULL either way). */
static void q_linear(const float *xf, const uint8_t *codes, const float *scales, const float *mins,
                     int bits, int group, const void *bias, void *y, int f32, int M, int N,
                     int K) {
    long row_bytes = bits == 4 ? K / 2 : K;
    int groups = K / group;
    int nr = M == 1 ? 4 : M == 2 ? 2 : 1; /* weight rows a tile */
    int tiles = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * nr, rows = N - n0 < nr ? N - n0 : nr;
        int r_n = rows == nr ? nr : 1; /* a last partial tile: its rows one by one */
        float out[4 * MAX_ROWS];
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
            int mb = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            for (int r0 = 0; r0 < rows; r0 += r_n) {
                long n = n0 + r0;
                tile(codes + n * row_bytes, row_bytes, bits, scales + n * groups, mins + n * groups,
                     groups, group, xf + (long)m0 * K, K, K, r_n, mb, out);
                for (int r = 0; r < r_n; r++) {
                    float b = bias == NULL ? 0.0f
                              : f32        ? ((const float *)bias)[n + r]
                                           : bf16_to_float(((const uint16_t *)bias)[n + r]);
                    for (int m = 0; m < mb; m++) {
                        long at = (long)(m0 + m) * N + n + r;
                        if (f32) ((float *)y)[at] = out[r * mb + m] + b;
                        else ((uint16_t *)y)[at] = float_to_bf16(out[r * mb + m] + b);
                    }
                }
            }
        }
    }
}

/* y[M, N] (bf16, row stride N) = x[M, K] (bf16) @ w^T + bias (bf16 or NULL). */
void kvflow_q_linear(const uint16_t *x, const uint8_t *codes, const float *scales,
                     const float *mins, int bits, int group, const uint16_t *bias, uint16_t *y,
                     int M, int N, int K) {
    float *xf = (float *)aligned_alloc(64, ((size_t)M * K * sizeof(float) + 63) / 64 * 64);
    if (xf == NULL) return;
    for (long i = 0; i < (long)M * K; i++) xf[i] = bf16_to_float(x[i]);
    q_linear(xf, codes, scales, mins, bits, group, bias, y, 0, M, N, K);
    free(xf);
}

/* The same in float32: x, bias (or NULL) and y float32. */
void kvflow_q_linear_f32(const float *x, const uint8_t *codes, const float *scales,
                         const float *mins, int bits, int group, const float *bias, float *y,
                         int M, int N, int K) {
    q_linear(x, codes, scales, mins, bits, group, bias, y, 1, M, N, K);
}

/* w[N, K] as bf16 (f32 == 0: rounded to nearest even; exact for codes and scales that fit
 * bf16) or float32 (f32 == 1). */
void kvflow_q_dequant(const uint8_t *codes, const float *scales, const float *mins, int bits,
                      int group, void *w, int f32, int N, int K) {
    long row_bytes = bits == 4 ? K / 2 : K;
    int groups = K / group;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = codes + n * row_bytes;
        const float *sc = scales + (long)n * groups, *mn = mins + (long)n * groups;
        for (int c = 0; c < K; c += 32) {
            v16f lo, hi;
            codes32(row, bits, c, &lo, &hi);
            int g0 = c / group, g1 = (c + 16) / group;
            v16f w0 = lo * sc[g0] + mn[g0];
            v16f w1 = hi * sc[g1] + mn[g1];
            long at = (long)n * K + c;
            if (f32) {
                memcpy((float *)w + at, &w0, sizeof w0);
                memcpy((float *)w + at + 16, &w1, sizeof w1);
                continue;
            }
            for (int i = 0; i < 16; i++) {
                ((uint16_t *)w)[at + i] = float_to_bf16(w0[i]);
                ((uint16_t *)w)[at + 16 + i] = float_to_bf16(w1[i]);
            }
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* Small batches on AMX (kvflow_q_linear_amx), the codes kept exact: every code (|code| <= 128)
 * is a bf16 integer, so a weight tile of 16 output rows x 32 columns of codes, made in a
 * thread's buffer, multiplies bf16 activations on the bf16 tile unit with exact products and
 * float32 sums. The tile unit sums over k; the scale and min of a group apply afterwards:
 *   y[m, n] = sum_g (scale[n, g] * sum_{k in g} code[n, k] x[m, k] + min[n, g] * xsum[m, g])
 * one tile operation per 32 columns and one scaling pass per group (per 16 columns for groups
 * of 16, once per row for one group a row, as int8's per-channel scales). The weights are the
 * tile's rows (A) and the activations its columns (B, as pairs of k), so a tile of output is
 * 16 weight rows x 16 activation rows and a weight tile serves up to 32 activation rows (two
 * accumulator tiles) before the next is made: what the float32 path cannot, as it pays the
 * multiply-adds per activation row. Linux grants the tile state on request (arch_prctl), once
 * per process: kvflow_q_amx_init asks and says whether it may run. */
#include <sys/syscall.h>
#include <unistd.h>

static int amx_ok = 0;

int kvflow_q_amx_init(void) {
    amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ok;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* bf16 bit patterns of the integers 0..15 (a 4-bit code's value), indexed by a word's low five
 * bits: entry i is bf16(i & 15), so a byte holding two codes indexes its low one directly. */
static const uint16_t BF16_NIBBLE[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
    0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Columns c .. c + 31 of one weight row's codes as 32 bf16 integers, in column order. */
static inline __m512i codes_bf16(const uint8_t *row, int bits, int c, __m512i nibble) {
    if (bits == 4) {
        __m512i w = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(
            _mm_loadu_si128((const __m128i *)(row + c / 2)))); /* words 0..15: the bytes */
        w = _mm512_mask_mov_epi16(w, 0xffff0000u, _mm512_srli_epi16(
            _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 1, 0, 3, 2, 1, 0), w), 4));
        return _mm512_permutexvar_epi16(w, nibble);
    }
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
    __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* Columns c .. c + 63 (two 32-column blocks) of a row of 4-bit codes: the bytes widen to words
 * once, each word's low and high code look up their bf16 value, and two-source permutes put
 * each block's 16 low and 16 high codes side by side (columns c + i and c + 16 + i). */
static inline void codes_bf16_x2(const uint8_t *row, int c, __m512i nibble, __m512i *b0,
                                 __m512i *b1) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + c / 2)));
    __m512i lo = _mm512_permutexvar_epi16(w, nibble);
    __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), nibble);
    const __m512i first = _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35,
                                           34, 33, 32, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                           3, 2, 1, 0);
    *b0 = _mm512_permutex2var_epi16(lo, first, hi);
    *b1 = _mm512_permutex2var_epi16(lo, _mm512_add_epi16(first, _mm512_set1_epi16(16)), hi);
}

/* Byte ranges to bring into the cache a line at a time while the current tile converts: the
 * next tile's codes, scales and mins (the hardware prefetcher, left alone, leaves the conversion
 * waiting on memory for most of its time). */
struct ahead {
    const char *at[3];
    long left[3];
};

static inline void prefetch_line(struct ahead *p) {
    for (int i = 0; i < 3; i++)
        if (p->left[i] > 0) {
            _mm_prefetch(p->at[i], _MM_HINT_T0);
            p->at[i] += 64, p->left[i] -= 64;
            return;
        }
}

/* Rows n0 .. n0 + rows - 1 of the codes as A tiles: a[K / 32][16][32] bf16, rows past `rows`
 * zero. */
static void code_tiles(const uint8_t *codes, long row_bytes, int bits, int rows, int K,
                       uint16_t *a, struct ahead *next) {
    __m512i nibble = _mm512_loadu_si512(BF16_NIBBLE);
    for (int r = 0; r < 16; r++) {
        const uint8_t *row = codes + r * row_bytes;
        int c = 0;
        if (r < rows && bits == 4)
            for (; c + 64 <= K; c += 64) {
                __m512i b0, b1;
                codes_bf16_x2(row, c, nibble, &b0, &b1);
                _mm512_store_si512(a + ((long)(c / 32) * 16 + r) * 32, b0);
                _mm512_store_si512(a + ((long)(c / 32 + 1) * 16 + r) * 32, b1);
                prefetch_line(next);
                prefetch_line(next);
            }
        for (; c < K; c += 32) {
            __m512i v = r < rows ? codes_bf16(row, bits, c, nibble) : _mm512_setzero_si512();
            _mm512_store_si512(a + ((long)(c / 32) * 16 + r) * 32, v);
            prefetch_line(next);
        }
    }
}

/* x [M, K] bf16 -> B tiles xt[M / 16][K / 2][16][2] (pairs of k per activation row; rows past
 * M zero) and xs[M / 16][groups][16]: each activation row's float sum over each group. */
static void activation_tiles(const uint16_t *x, int M, int K, int group, uint32_t *xt,
                             float *xs) {
    int chunks = (M + 15) / 16, groups = K / group;
    memset(xt, 0, (size_t)chunks * K * 32);
    memset(xs, 0, (size_t)chunks * groups * 16 * sizeof(float));
    for (int m = 0; m < M; m++) {
        const uint16_t *row = x + (long)m * K;
        uint32_t *t = xt + (long)(m / 16) * (K / 2) * 16 + m % 16;
        float *s = xs + (long)(m / 16) * groups * 16 + m % 16;
        for (int kp = 0; kp < K / 2; kp++) memcpy(t + kp * 16, row + 2 * kp, 4);
        for (int k = 0; k < K; k++) s[(k / group) * 16] += bf16_to_float(row[k]);
    }
}

/* acc[r] += scale[r] * tile row r + min[r] * xsum (a group's pass; rows past `rows` skip). */
static inline void scale_pass(const float cbuf[16][16], const float *sc, const float *mn,
                              long groups, int g, int rows, const float *xsum, v16f acc[16]) {
    v16f xv = vload(xsum);
    for (int r = 0; r < rows; r++)
        acc[r] += sc[r * groups + g] * vload(cbuf[r]) + mn[r * groups + g] * xv;
}

/* Output rows c * 16 .. of the tile (columns n0 .. n0 + rows - 1): acc + bias, rounded. */
static void store_tile(const v16f acc[16], int rows, int mrows, const uint16_t *bias,
                       uint16_t *y, int N, int n0) {
    for (int r = 0; r < rows; r++) {
        float b = bias ? bf16_to_float(bias[n0 + r]) : 0.0f;
        for (int m = 0; m < mrows; m++) y[(long)m * N + n0 + r] = float_to_bf16(acc[r][m] + b);
    }
}

/* Group g's tile products into accumulator tiles C0 (activation chunk c) and C1 (c + 1). */
#define GROUP_PRODUCTS(C0, C1)                                                                 \
    do {                                                                                       \
        _tile_zero(C0);                                                                        \
        _tile_zero(C1);                                                                        \
        for (int k = g * group; k < (g + 1) * group; k += kb) {                                \
            _tile_loadd(2, a + (k / 32) * 16 * 32 + k % 32, 64);                               \
            _tile_loadd(3, b0 + (k / 2) * 16, 64);                                             \
            _tile_dpbf16ps(C0, 2, 3);                                                          \
            if (two) {                                                                         \
                _tile_loadd(4, b1 + (k / 2) * 16, 64);                                         \
                _tile_dpbf16ps(C1, 2, 4);                                                      \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* Group G's sums out of tiles C0, C1, scaled into the float32 accumulators. */
#define GROUP_SCALE(C0, C1, G)                                                                 \
    do {                                                                                       \
        _tile_stored(C0, cbuf, 64);                                                            \
        scale_pass(cbuf, sc, mn, groups, G, rows, xs + ((long)c * groups + G) * 16, acc[0]);   \
        if (two) {                                                                             \
            _tile_stored(C1, cbuf, 64);                                                        \
            scale_pass(cbuf, sc, mn, groups, G, rows, xs + ((long)(c + 1) * groups + G) * 16,  \
                       acc[1]);                                                                \
        }                                                                                      \
    } while (0)

/* One tile of 16 weight rows (A tiles in `a`) against activation chunks c and c + 1 (`two`).
 * Groups alternate between tiles 0, 1 and 5, 6, so a group's scaling pass runs while the tile
 * unit computes the next group. */
static void amx_rows(const uint16_t *a, const uint32_t *xt, const float *xs, const float *sc,
                     const float *mn, int group, int rows, int M, int K, int c, int two,
                     const uint16_t *bias, uint16_t *y, int N, int n0) {
    int kb = group == 16 ? 16 : 32, groups = K / group;
    float cbuf[16][16] __attribute__((aligned(64)));
    v16f acc[2][16];
    memset(acc, 0, sizeof acc);
    const uint32_t *b0 = xt + (long)c * (K / 2) * 16, *b1 = b0 + (long)(K / 2) * 16;
    for (int g = 0; g < groups; g++) {
        if (g % 2 == 0) {
            GROUP_PRODUCTS(0, 1);
            if (g > 0) GROUP_SCALE(5, 6, g - 1);
        } else {
            GROUP_PRODUCTS(5, 6);
            GROUP_SCALE(0, 1, g - 1);
        }
    }
    if (groups % 2) GROUP_SCALE(0, 1, groups - 1);
    else GROUP_SCALE(5, 6, groups - 1);
    int left = M - c * 16;
    store_tile(acc[0], rows, left < 16 ? left : 16, bias, y + (long)c * 16 * N, N, n0);
    if (two) store_tile(acc[1], rows, left - 16 < 16 ? left - 16 : 16, bias,
                        y + (long)(c + 1) * 16 * N, N, n0);
}

static void amx_config(int kb) {
    struct tile_config cfg = {.palette = 1};
    for (int i = 0; i < 7; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* C (0, 1, 5, 6): n x m */
    cfg.colsb[2] = (uint16_t)(kb * 2);                                /* A: n x k bf16 */
    cfg.rows[3] = cfg.rows[4] = (uint8_t)(kb / 2);                    /* B: k pairs x m */
    _tile_loadconfig(&cfg);
}

/* y[M, N] (bf16) = x[M, K] (bf16) @ w^T + bias (bf16 or NULL), w's codes read as exact bf16 on
 * AMX. Needs group 16 or a multiple of 32; returns 0 (nothing written) when it cannot run. */
int kvflow_q_linear_amx(const uint16_t *x, const uint8_t *codes, const float *scales,
                        const float *mins, int bits, int group, const uint16_t *bias, uint16_t *y,
                        int M, int N, int K) {
    if (!amx_ok || K % 32 || (group != 16 && group % 32) || K % group) return 0;
    int chunks = (M + 15) / 16, groups = K / group, tiles = (N + 15) / 16;
    long row_bytes = bits == 4 ? K / 2 : K;
    uint32_t *xt = aligned_alloc(64, (size_t)chunks * K * 32);
    float *xs = aligned_alloc(64, (size_t)chunks * groups * 64);
    if (xt == NULL || xs == NULL) return free(xt), free(xs), 0;
    activation_tiles(x, M, K, group, xt, xs);
#pragma omp parallel
    {
        amx_config(group == 16 ? 16 : 32);
        uint16_t *a = aligned_alloc(64, (size_t)K * 32);
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int n0 = t * 16, rows = N - n0 < 16 ? N - n0 : 16;
            long following = t + 1 < tiles ? (N - n0 - 16 < 16 ? N - n0 - 16 : 16) : 0;
            struct ahead next = {
                {(const char *)(codes + (n0 + 16) * row_bytes),
                 (const char *)(scales + (long)(n0 + 16) * groups),
                 (const char *)(mins + (long)(n0 + 16) * groups)},
                {following * row_bytes, following * groups * 4, following * groups * 4}};
            code_tiles(codes + n0 * row_bytes, row_bytes, bits, rows, K, a, &next);
            for (int c = 0; c < chunks; c += 2)
                amx_rows(a, xt, xs, scales + (long)n0 * groups, mins + (long)n0 * groups, group,
                         rows, M, K, c, c + 1 < chunks, bias, y, N, n0);
        }
        free(a);
        _tile_release();
    }
    free(xt);
    free(xs);
    return 1;
}

/* EXPERIMENT: weights dequantized to bf16 per tile (values rounded), whole K in the tile. */
static void value_tiles(const uint8_t *codes, long row_bytes, int bits, const float *sc,
                        const float *mn, int groups, int group, int rows, int K, uint16_t *a) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < K; c += 32) {
            __m512i v = _mm512_setzero_si512();
            if (r < rows) {
                v16f lo, hi;
                codes32(codes + r * row_bytes, bits, c, &lo, &hi);
                const float *s = sc + (long)r * groups, *o = mn + (long)r * groups;
                int g0 = c / group, g1 = (c + 16) / group;
                v16f w0 = lo * s[g0] + o[g0], w1 = hi * s[g1] + o[g1];
                v = (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0);
            }
            _mm512_store_si512(a + ((long)(c / 32) * 16 + r) * 32, v);
        }
}

static void amx_rows_values(const uint16_t *a, const uint32_t *xt, int rows, int M, int K, int c,
                            int two, const uint16_t *bias, uint16_t *y, int N, int n0) {
    float cbuf[16][16] __attribute__((aligned(64)));
    v16f acc[16];
    const uint32_t *b0 = xt + (long)c * (K / 2) * 16, *b1 = b0 + (long)(K / 2) * 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int k = 0; k < K; k += 32) {
        _tile_loadd(2, a + (k / 32) * 16 * 32, 64);
        _tile_loadd(3, b0 + (k / 2) * 16, 64);
        _tile_dpbf16ps(0, 2, 3);
        if (two) {
            _tile_loadd(4, b1 + (k / 2) * 16, 64);
            _tile_dpbf16ps(1, 2, 4);
        }
    }
    int left = M - c * 16;
    _tile_stored(0, cbuf, 64);
    for (int r = 0; r < 16; r++) acc[r] = vload(cbuf[r]);
    store_tile(acc, rows, left < 16 ? left : 16, bias, y + (long)c * 16 * N, N, n0);
    if (two) {
        _tile_stored(1, cbuf, 64);
        for (int r = 0; r < 16; r++) acc[r] = vload(cbuf[r]);
        store_tile(acc, rows, left - 16 < 16 ? left - 16 : 16, bias, y + (long)(c + 1) * 16 * N,
                   N, n0);
    }
}

int kvflow_q_linear_amx_values(const uint16_t *x, const uint8_t *codes, const float *scales,
                               const float *mins, int bits, int group, const uint16_t *bias,
                               uint16_t *y, int M, int N, int K) {
    if (!amx_ok || K % 32) return 0;
    int chunks = (M + 15) / 16, groups = K / group, tiles = (N + 15) / 16;
    long row_bytes = bits == 4 ? K / 2 : K;
    uint32_t *xt = aligned_alloc(64, (size_t)chunks * K * 32);
    float *xs = aligned_alloc(64, (size_t)chunks * groups * 64);
    activation_tiles(x, M, K, group, xt, xs);
#pragma omp parallel
    {
        struct tile_config cfg = {.palette = 1};
        for (int i = 0; i < 5; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
        _tile_loadconfig(&cfg);
        uint16_t *a = aligned_alloc(64, (size_t)K * 32);
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int n0 = t * 16, rows = N - n0 < 16 ? N - n0 : 16;
            value_tiles(codes + n0 * row_bytes, row_bytes, bits, scales + (long)n0 * groups,
                        mins + (long)n0 * groups, groups, group, rows, K, a);
            for (int c = 0; c < chunks; c += 2)
                amx_rows_values(a, xt, rows, M, K, c, c + 1 < chunks, bias, y, N, n0);
        }
        free(a);
        _tile_release();
    }
    free(xt);
    free(xs);
    return 1;
}
#else
int kvflow_q_amx_init(void) { return 0; }
int kvflow_q_linear_amx(const uint16_t *x, const uint8_t *codes, const float *scales,
                        const float *mins, int bits, int group, const uint16_t *bias, uint16_t *y,
                        int M, int N, int K) {
    (void)x, (void)codes, (void)scales, (void)mins, (void)bits, (void)group, (void)bias, (void)y;
    (void)M, (void)N, (void)K;
    return 0;
}
#endif
