/* kvflow's native CPU kernels, for the decode steps of small batches, where a step is bound by
 * reading memory (weights, then K/V) once:
 *
 *   kvflow_bf16_linear       y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 in and out
 *   kvflow_decode_attention  one query token per request over a paged KV cache, in place
 *
 * Both accumulate in float32. bf16 -> float32 is exact (a 16-bit shift); results are rounded to
 * nearest even. Built at run time by kvflow/model/cpu_kernels.py with the system C compiler
 * (-march=native: AVX-512 where the CPU has it, through GCC's vector extensions) and loaded with
 * ctypes; it links the OpenMP runtime torch already loaded, so both share one thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f load_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

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

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline float hsum(v16f v) {  /* a tree: 4 adds instead of a chain of 15 */
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline v16f vload(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* e^x for x <= 0 (softmax after subtracting the max): 2^n * 2^f with f in [-0.5, 0.5] and a
 * degree-6 Taylor polynomial of 2^f (relative error < 2e-7); 0 below -87. */
static inline v16f vexp(v16f x) {
    v16i below = x < -87.0f; /* lanes: -1 where true */
    v16i bits;
    memcpy(&bits, &x, sizeof bits);
    const float floor_value = -87.0f;
    int32_t floor_bits;
    memcpy(&floor_bits, &floor_value, sizeof floor_bits);
    bits = (bits & ~below) | (floor_bits & below);
    memcpy(&x, &bits, sizeof x);
    v16f t = x * 1.44269504088896341f;
    v16i n = __builtin_convertvector(t - 0.5f, v16i); /* t <= 0: truncation rounds to nearest */
    v16f f = (t - __builtin_convertvector(n, v16f)) * 0.69314718055994531f;
    v16f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 +
                                                                                  f * (1.0f / 720))))));
    v16i scale = (n + 127) << 23;
    v16f s;
    memcpy(&s, &scale, sizeof s);
    v16f r = p * s;
    memcpy(&bits, &r, sizeof bits);
    bits &= ~below; /* e^x = 0 below -87, as float32 underflows (no denormals) */
    memcpy(&r, &bits, sizeof r);
    return r;
}

/* Linear layer, y[M, N] = x[M, K] @ w[N, K]^T (+ bias), on a weight packed once at load time
 * (kvflow/model/cpu_kernels.py `pack_linear_weight`) as [N / NB][K / 2][NB][2]: for each tile of
 * NB = 32 output columns, one contiguous run over k in pairs. A tile's MT <= 8 rows of x keep
 * MT x 2 vectors of 16 float32 accumulators (one per output column) in registers; each k pair
 * loads 2 vectors of weights and broadcasts one (x[m, k], x[m, k + 1]) pair per row, so the
 * weights stream from memory exactly once per call for up to 8 rows (more rows re-read the tile,
 * which stays in L2) and no horizontal sums are needed. Threads split the column tiles.
 *
 * With AVX512_BF16 one instruction does 32 multiply-adds of bf16 pairs into float32 (what oneDNN
 * uses on such CPUs); elsewhere a 32-bit lane holding a pair widens to two floats with a shift
 * and a mask. N is padded to a multiple of NB in the packed weight; K must be even. */
#define NB 32
#define MT 8

#ifdef __AVX512BF16__
#include <immintrin.h>
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline acc_t pair_fma(acc_t acc, uint32_t xpair, const uint16_t *w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)xpair),
                            (__m512bh)_mm512_loadu_si512(w));
}
#else
typedef v16f acc_t;
static inline acc_t acc_zero(void) { return (v16f){0}; }
static inline acc_t pair_fma(acc_t acc, uint32_t xpair, const uint16_t *w) {
    v16u u;
    memcpy(&u, w, sizeof u);
    v16u lo = u << 16, hi = u & 0xffff0000u;
    v16f wlo, whi;
    memcpy(&wlo, &lo, sizeof wlo);
    memcpy(&whi, &hi, sizeof whi);
    return acc + bf16_to_float((uint16_t)xpair) * wlo + bf16_to_float((uint16_t)(xpair >> 16)) * whi;
}
#endif

/* Rows m0 .. m0 + rows - 1 of x against column tile `t` (rows <= MT, a constant per call). */
static inline __attribute__((always_inline)) void linear_tile(
    const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y, int N, int K,
    int t, int m0, const int rows) {
    acc_t acc[MT][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = acc_zero();
    const uint16_t *w = wp + (size_t)t * K * NB;
    for (int kp = 0; kp < K / 2; kp++, w += 2 * NB) {
        for (int m = 0; m < rows; m++) {
            uint32_t xpair;
            memcpy(&xpair, x + (size_t)(m0 + m) * K + 2 * kp, sizeof xpair);
            acc[m][0] = pair_fma(acc[m][0], xpair, w);
            acc[m][1] = pair_fma(acc[m][1], xpair, w + NB);
        }
    }
    int n0 = t * NB, cols = N - n0 < NB ? N - n0 : NB;
    for (int m = 0; m < rows; m++) {
        float out[NB];
        memcpy(out, &acc[m][0], sizeof(float) * 16);
        memcpy(out + 16, &acc[m][1], sizeof(float) * 16);
        uint16_t *yrow = y + (size_t)(m0 + m) * N + n0;
        for (int c = 0; c < cols; c++)
            yrow[c] = float_to_bf16(out[c] + (bias ? bf16_to_float(bias[n0 + c]) : 0.0f));
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX: one tile instruction multiplies x rows [M <= 16, 32 k] by a weight tile [16 k pairs,
 * 16 columns, 2] into 16 x 16 float32 accumulators; the packed layout above is exactly two such
 * weight tiles side by side per 16 k pairs (rows 128 bytes apart). Linux hands out the tile
 * state only on request (arch_prctl), so `kvflow_amx_init` asks once; without it the AVX-512
 * path runs. */
#include <sys/syscall.h>
#include <unistd.h>

static int amx_ok = 0;

int kvflow_amx_init(void) {
    amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ok;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void linear_amx(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                       int M, int N, int K) {
    int tiles = (N + NB - 1) / NB;
#pragma omp parallel
    {
        struct tile_config cfg = {.palette = 1};
        for (int i = 0; i < 2; i++) cfg.rows[i] = (uint8_t)M, cfg.colsb[i] = 64;  /* C halves */
        cfg.rows[2] = (uint8_t)M, cfg.colsb[2] = 64;                          /* A: x rows */
        for (int i = 3; i < 5; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;      /* B halves */
        _tile_loadconfig(&cfg);
        float out[16][NB];
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const uint16_t *w = wp + (size_t)t * K * NB;
            _tile_zero(0);
            _tile_zero(1);
            for (int k = 0; k < K; k += 32, w += 32 * NB) {
                _tile_loadd(2, x + k, K * 2);
                _tile_loadd(3, w, NB * 4);
                _tile_loadd(4, w + 32, NB * 4);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, out, NB * 4);
            _tile_stored(1, &out[0][16], NB * 4);
            int n0 = t * NB, cols = N - n0 < NB ? N - n0 : NB;
            for (int m = 0; m < M; m++)
                for (int c = 0; c < cols; c++)
                    y[(size_t)m * N + n0 + c] =
                        float_to_bf16(out[m][c] + (bias ? bf16_to_float(bias[n0 + c]) : 0.0f));
        }
        _tile_release();
    }
}
#else
int kvflow_amx_init(void) { return 0; }
#endif

void kvflow_bf16_linear(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                        int M, int N, int K) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_ok && M <= 16 && K % 32 == 0) {
        linear_amx(x, wp, bias, y, M, N, K);
        return;
    }
#endif

    int tiles = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        for (int m0 = 0; m0 < M; m0 += MT) {
            switch (M - m0 < MT ? M - m0 : MT) {  /* constant row counts: fully unrolled */
                case 8: linear_tile(x, wp, bias, y, N, K, t, m0, 8); break;
                case 7: linear_tile(x, wp, bias, y, N, K, t, m0, 7); break;
                case 6: linear_tile(x, wp, bias, y, N, K, t, m0, 6); break;
                case 5: linear_tile(x, wp, bias, y, N, K, t, m0, 5); break;
                case 4: linear_tile(x, wp, bias, y, N, K, t, m0, 4); break;
                case 3: linear_tile(x, wp, bias, y, N, K, t, m0, 3); break;
                case 2: linear_tile(x, wp, bias, y, N, K, t, m0, 2); break;
                default: linear_tile(x, wp, bias, y, N, K, t, m0, 1); break;
            }
        }
    }
}

/* x . bf16 row y over D elements (vectorised by 16, scalar tail). */
static inline float dot(const float *x, const uint16_t *y, int D) {
    v16f acc = {0};
    int d = 0;
    for (; d + 16 <= D; d += 16) acc += vload(x + d) * load_bf16(y + d);
    float s = hsum(acc);
    for (; d < D; d++) s += x[d] * bf16_to_float(y[d]);
    return s;
}

/* acc[0 .. D) += w * bf16 row v. */
static inline void axpy(float *acc, float w, const uint16_t *v, int D) {
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        v16f a = vload(acc + d) + w * load_bf16(v + d);
        memcpy(acc + d, &a, sizeof a);
    }
    for (; d < D; d++) acc[d] += w * bf16_to_float(v[d]);
}

/* In place: row[j] = e^(row[j] - max) / sum over j < n. */
static inline void softmax(float *row, int n) {
    float mx = row[0], sum = 0.0f;
    for (int j = 1; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    int j = 0;
    v16f vsum = {0};
    for (; j + 16 <= n; j += 16) {
        v16f e = vexp(vload(row + j) - mx);
        memcpy(row + j, &e, sizeof e);
        vsum += e;
    }
    for (; j < n; j++) {
        row[j] = __builtin_expf(row[j] - mx);
        sum += row[j];
    }
    float inv = 1.0f / (sum + hsum(vsum));
    for (j = 0; j < n; j++) row[j] *= inv;
}

/* One decode step of attention over a paged bf16 KV cache, reading K/V where they lie.
 *
 * Request b has one new token: its query q[b] (Hq heads of D, rows `q_stride` elements apart)
 * and its key/value k[b], v[b] (Hkv heads, rows `kv_stride` apart) are first written to slot
 * slot_mapping[b], then the query attends over positions max(0, seq_lens[b] - window) ..
 * seq_lens[b] - 1. Position p lives in slot block_tables[b][p / block_size] * block_size +
 * p % block_size; head h of slot s starts at cache + (s * Hkv + h) * D (the layout
 * [num_blocks, block_size, Hkv, D]). Work item = (request, KV head): it writes that head's K/V,
 * then its G = Hq / Hkv query heads share every K/V row loaded. Softmax in float32 over the whole
 * row of scores (scratch per thread), then the V sum; out is [B, Hq, D].
 */
void kvflow_decode_attention(const uint16_t *q, int q_stride, const uint16_t *k,
                             const uint16_t *v, int kv_stride, const int64_t *slot_mapping,
                             uint16_t *kc, uint16_t *vc, const int32_t *block_tables,
                             int max_blocks, const int32_t *seq_lens, int B, int Hq, int Hkv,
                             int D, int block_size, int window, float scale, int max_seq_len,
                             uint16_t *out) {
    int G = Hq / Hkv;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)G * (max_seq_len > 0 ? max_seq_len : 1));
        float *qf = malloc(sizeof(float) * (size_t)G * D);
        float *acc = malloc(sizeof(float) * (size_t)G * D);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < B * Hkv; item++) {
            int b = item / Hkv, h = item % Hkv;
            size_t new_slot = (size_t)slot_mapping[b] * Hkv + h;
            memcpy(kc + new_slot * D, k + (size_t)b * kv_stride + (size_t)h * D, 2 * (size_t)D);
            memcpy(vc + new_slot * D, v + (size_t)b * kv_stride + (size_t)h * D, 2 * (size_t)D);
            int len = seq_lens[b], start = window > 0 && len > window ? len - window : 0;
            int n = len - start;
            const int32_t *table = block_tables + (size_t)b * max_blocks;
            const uint16_t *qb = q + (size_t)b * q_stride + (size_t)h * G * D;
            for (int i = 0; i < G * D; i++) qf[i] = bf16_to_float(qb[i]) * scale;
            for (int j = 0; j < n; j++) {
                int p = start + j;
                size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                const uint16_t *key = kc + (slot * Hkv + h) * D;
                for (int g = 0; g < G; g++) scores[(size_t)g * n + j] = dot(qf + g * D, key, D);
            }
            for (int g = 0; g < G; g++) softmax(scores + (size_t)g * n, n);
            memset(acc, 0, sizeof(float) * (size_t)G * D);
            for (int j = 0; j < n; j++) {
                int p = start + j;
                size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                const uint16_t *val = vc + (slot * Hkv + h) * D;
                for (int g = 0; g < G; g++) axpy(acc + g * D, scores[(size_t)g * n + j], val, D);
            }
            uint16_t *ob = out + ((size_t)b * Hq + (size_t)h * G) * D;
            for (int i = 0; i < G * D; i++) ob[i] = float_to_bf16(acc[i]);
        }
        free(scores);
        free(qf);
        free(acc);
    }
}

/* ---- small fused ops: one call instead of a chain of torch ops (each a dispatch) ----------
 * Each rounds to bf16 where transformers' bf16 modules do, so results match torch's path. */

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* RMSNorm of T rows of D, as transformers: n = bf16(h * rsqrt(mean(h^2) + eps)), out = bf16(w * n).
 * With `residual`, h = bf16(x + residual) first, and h is written back to `residual` (the
 * residual stream carried between layers). */
void kvflow_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *w, float eps,
                     uint16_t *out, int T, int D) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const uint16_t *xr = x + (size_t)t * D;
        uint16_t *rr = residual ? residual + (size_t)t * D : NULL;
        uint16_t *orow = out + (size_t)t * D;
        float sum = 0.0f;
        for (int d = 0; d < D; d++) {
            float h = bf16_to_float(xr[d]);
            if (rr) {
                h = round_bf16(h + bf16_to_float(rr[d]));
                rr[d] = float_to_bf16(h);
            }
            sum += h * h;
        }
        float inv = 1.0f / __builtin_sqrtf(sum / D + eps);
        const uint16_t *hr = rr ? rr : xr;
        for (int d = 0; d < D; d++)
            orow[d] = float_to_bf16(bf16_to_float(w[d]) * round_bf16(bf16_to_float(hr[d]) * inv));
    }
}

/* Rotary embedding in place on x [T, H, D] (rows `stride` elements apart, heads packed), as
 * transformers: x * cos + rotate_half(x) * sin with each product and the sum rounded to bf16;
 * cos/sin are [T, D] bf16. */
void kvflow_rotary(uint16_t *x, int stride, int T, int H, int D, const uint16_t *cos,
                   const uint16_t *sin) {
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const uint16_t *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int h = 0; h < H; h++) {
            uint16_t *v = x + (size_t)t * stride + (size_t)h * D;
            for (int i = 0; i < half; i++) {
                float a = bf16_to_float(v[i]), b = bf16_to_float(v[i + half]);
                float lo = round_bf16(a * bf16_to_float(c[i])) +
                           round_bf16(-b * bf16_to_float(s[i]));
                float hi = round_bf16(b * bf16_to_float(c[i + half])) +
                           round_bf16(a * bf16_to_float(s[i + half]));
                v[i] = float_to_bf16(lo);
                v[i + half] = float_to_bf16(hi);
            }
        }
    }
}

/* 16 floats rounded to bf16 (nearest even) and stored. */
static inline void store_bf16(uint16_t *p, v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, sizeof h);
}

/* silu(x) = x * sigmoid(x), with e = e^-|x| <= 1 so no overflow: sigmoid = 1 / (1 + e) for
 * x >= 0, e / (1 + e) below. */
static inline v16f vsilu(v16f x) {
    v16i neg = x < 0.0f;
    v16f e = vexp(-__builtin_convertvector(neg, v16f) * x * 2.0f - x);  /* -|x| */
    v16f pos_sig = 1.0f / (1.0f + e), neg_sig = e / (1.0f + e);
    v16i a, b;
    memcpy(&a, &pos_sig, sizeof a);
    memcpy(&b, &neg_sig, sizeof b);
    a = (a & ~neg) | (b & neg);
    v16f sig;
    memcpy(&sig, &a, sizeof sig);
    return x * sig;
}

/* out[T, I] = bf16(silu(gate)) * up, rounded, for gate_up [T, 2I] = gate | up per row. */
void kvflow_silu_mul(const uint16_t *gate_up, uint16_t *out, int T, int I) {
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (size_t)t * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            v16f act = vsilu(load_bf16(g + i));
            store_bf16(o + i, act);  /* round the activation to bf16 first, as torch */
            store_bf16(o + i, load_bf16(o + i) * load_bf16(u + i));
        }
        for (; i < I; i++) {
            float x = bf16_to_float(g[i]);
            float act = round_bf16(x / (1.0f + __builtin_expf(-x)));
            o[i] = float_to_bf16(act * bf16_to_float(u[i]));
        }
    }
}
