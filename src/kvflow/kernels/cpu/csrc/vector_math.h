/* Vector math shared by cpu_kernels.c and quant_kernels.c (GCC vector extensions: AVX-512
 * where the CPU has it): e^x, SiLU and rounding to bf16, 16 float32 lanes at a time. Included by
 * both; kvflow/kernels/cpu/build.py keys each library's build on this file too. */
#ifndef KVFLOW_VECTOR_MATH_H
#define KVFLOW_VECTOR_MATH_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

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

/* silu(x) = x * sigmoid(x), with e = e^-|x| <= 1 so no overflow: sigmoid = 1 / (1 + e) for
 * x >= 0, e / (1 + e) below. */
static inline v16f vsilu(v16f x) {
    v16i neg = x < 0.0f, bits;
    memcpy(&bits, &x, sizeof bits);
    bits |= (v16i){0} + (int32_t)0x80000000; /* -|x|: e^-|x| cannot overflow */
    v16f e;
    memcpy(&e, &bits, sizeof e);
    e = vexp(e);
    v16i one, num; /* sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below: one division */
    v16f ones = (v16f){0} + 1.0f;
    memcpy(&one, &ones, sizeof one);
    memcpy(&num, &e, sizeof num);
    num = (num & neg) | (one & ~neg);
    v16f sig;
    memcpy(&sig, &num, sizeof sig);
    return x * (sig / (1.0f + e));
}

/* 16 floats rounded to bf16 (nearest even), kept as float32. */
static inline v16f vround_bf16(v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
