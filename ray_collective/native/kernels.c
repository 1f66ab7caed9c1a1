/* Element-wise reductions of the native core, matching ray_collective.tensors.combiner (numpy's
 * ufuncs in the tensor's dtype) bit for bit.
 *
 * The rules, each measured against numpy 2.4 (tests/test_native_kernels.py checks every
 * dtype x op against combiner):
 * - integers wrap on overflow (computed in unsigned arithmetic, where C defines the wrap);
 *   bool SUM and MAX are a logical or, PRODUCT and MIN a logical and;
 * - float32/float64 MIN and MAX return the first operand when it is NaN, else the second when
 *   it is NaN or the two compare equal (np.minimum(+0.0, -0.0) is -0.0, as x86's minps);
 * - float16 goes through float32 and back to nearest, ties to even (what numpy computes; for
 *   + and * the double rounding equals a correctly rounded half operation), except MIN and MAX,
 *   which compare the halves and return one operand's bits: the first when it is NaN or they
 *   compare equal (numpy's half loops differ from its float loops there);
 * - bfloat16 bits are widened to float32, combined as float32 is, and rounded back to nearest,
 *   ties to even, a NaN becoming (bits >> 16) | 0x40: tensors._f32_to_bf16 step by step;
 * - complex SUM is per component; PRODUCT is (ar*br - ai*bi, ar*bi + ai*br), and
 *   RC_PRODUCT_FUSED computes the same with fused multiply-adds, fma(ar, br, -(ai*bi)) and
 *   fma(ar, bi, ai*br), which is what numpy's SIMD loops do on CPUs with FMA (codes.py probes
 *   numpy to pick one), except for a single element, which numpy reduces in place with its
 *   plain scalar loop (so a message's one-element last part is not fused either); MIN and
 *   MAX return the first operand if it has a NaN component, else the second if it has one,
 *   else the lexicographically smaller (larger), the first when they are equal, as numpy
 *   does.
 * NaN payloads: where a result is NaN, ours is NaN too, but after SUM or PRODUCT its payload
 * bits may differ from numpy's, which are not stable themselves (numpy's vector loop and its
 * scalar tail pick different operands' payloads within one array). MIN and MAX return an
 * operand's bits exactly.
 * Built with -ffp-contract=off, so that the compiler never fuses what numpy does not.
 */
#include "kernels.h"

#include <string.h>

typedef struct { float re, im; } complex64;
typedef struct { double re, im; } complex128;

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu, bits;
    float value;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        value = (float)mantissa * 0x1p-24f; /* a subnormal half is exact in float32 */
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint16_t f32_to_f16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) /* NaN: stays a quiet NaN with its sign */
        return (uint16_t)(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) /* 65520 and up round to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (magnitude >= 0x38800000u) { /* a normal half: rebias, round to nearest even */
        uint32_t rebiased = magnitude - 0x38000000u;
        return (uint16_t)(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
    }
    if (magnitude <= 0x33000000u) /* at most half the smallest subnormal: ties to zero */
        return sign;
    uint32_t exponent = magnitude >> 23, mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exponent, half = 1u << (shift - 1);
    uint32_t result = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u);
    if (rest > half || (rest == half && (result & 1u)))
        result++;
    return (uint16_t)(sign | result);
}

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint16_t f32_to_bf16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if (value != value)
        return (uint16_t)((bits >> 16) | 0x0040u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#define IS_NAN(v) ((v) != (v))

/* The loop every kernel shares: x is acc's element, y is in's, EXPR the result. */
#define KERNEL(NAME, T, EXPR)                                                                \
    static void NAME(void *acc, const void *in, int64_t n, int64_t acc_step,                \
                     int64_t in_step)                                                       \
    {                                                                                       \
        T *a = acc;                                                                         \
        const T *b = in;                                                                    \
        if (acc_step == 1 && in_step == 1) {                                                \
            for (int64_t i = 0; i < n; i++) {                                               \
                T x = a[i], y = b[i];                                                       \
                a[i] = (EXPR);                                                              \
            }                                                                               \
        } else {                                                                            \
            for (int64_t i = 0; i < n; i++) {                                               \
                T x = a[i * acc_step], y = b[i * in_step];                                  \
                a[i * acc_step] = (EXPR);                                                   \
            }                                                                               \
        }                                                                                   \
    }

#define INTEGER_KERNELS(SUFFIX, T)                                                          \
    KERNEL(sum_##SUFFIX, T, (T)((uint64_t)x + (uint64_t)y))                                 \
    KERNEL(product_##SUFFIX, T, (T)((uint64_t)x * (uint64_t)y))                             \
    KERNEL(min_##SUFFIX, T, y < x ? y : x)                                                  \
    KERNEL(max_##SUFFIX, T, y > x ? y : x)

INTEGER_KERNELS(int8, int8_t)
INTEGER_KERNELS(int16, int16_t)
INTEGER_KERNELS(int32, int32_t)
INTEGER_KERNELS(int64, int64_t)
INTEGER_KERNELS(uint8, uint8_t)
INTEGER_KERNELS(uint16, uint16_t)
INTEGER_KERNELS(uint32, uint32_t)
INTEGER_KERNELS(uint64, uint64_t)

KERNEL(or_bool, uint8_t, (uint8_t)((x | y) != 0))
KERNEL(and_bool, uint8_t, (uint8_t)(x != 0 && y != 0))

#define FLOAT_KERNELS(SUFFIX, T)                                                            \
    KERNEL(sum_##SUFFIX, T, x + y)                                                          \
    KERNEL(product_##SUFFIX, T, x * y)                                                      \
    KERNEL(min_##SUFFIX, T, IS_NAN(x) ? x : (x < y ? x : y))                                \
    KERNEL(max_##SUFFIX, T, IS_NAN(x) ? x : (x > y ? x : y))

FLOAT_KERNELS(float32, float)
FLOAT_KERNELS(float64, double)

static inline uint16_t half_min(uint16_t x, uint16_t y)
{
    float fx = f16_to_f32(x), fy = f16_to_f32(y);
    return IS_NAN(fx) ? x : (IS_NAN(fy) || fy < fx) ? y : x;
}

static inline uint16_t half_max(uint16_t x, uint16_t y)
{
    float fx = f16_to_f32(x), fy = f16_to_f32(y);
    return IS_NAN(fx) ? x : (IS_NAN(fy) || fy > fx) ? y : x;
}

KERNEL(sum_float16, uint16_t, f32_to_f16(f16_to_f32(x) + f16_to_f32(y)))
KERNEL(product_float16, uint16_t, f32_to_f16(f16_to_f32(x) * f16_to_f32(y)))
KERNEL(min_float16, uint16_t, half_min(x, y))
KERNEL(max_float16, uint16_t, half_max(x, y))

static inline float float_min(float x, float y) { return IS_NAN(x) ? x : (x < y ? x : y); }
static inline float float_max(float x, float y) { return IS_NAN(x) ? x : (x > y ? x : y); }

KERNEL(sum_bfloat16, uint16_t, f32_to_bf16(bf16_to_f32(x) + bf16_to_f32(y)))
KERNEL(product_bfloat16, uint16_t, f32_to_bf16(bf16_to_f32(x) * bf16_to_f32(y)))
KERNEL(min_bfloat16, uint16_t, f32_to_bf16(float_min(bf16_to_f32(x), bf16_to_f32(y))))
KERNEL(max_bfloat16, uint16_t, f32_to_bf16(float_max(bf16_to_f32(x), bf16_to_f32(y))))

#define COMPLEX_HAS_NAN(v) (IS_NAN((v).re) || IS_NAN((v).im))
#define COMPLEX_KERNELS(SUFFIX, T)                                                          \
    KERNEL(sum_##SUFFIX, T, ((T){x.re + y.re, x.im + y.im}))                                \
    KERNEL(product_##SUFFIX, T,                                                             \
           ((T){x.re * y.re - x.im * y.im, x.re * y.im + x.im * y.re}))                     \
    KERNEL(min_##SUFFIX, T, COMPLEX_HAS_NAN(x) ? x : COMPLEX_HAS_NAN(y) ? y                 \
           : (x.re < y.re || (x.re == y.re && x.im <= y.im)) ? x : y)                       \
    KERNEL(max_##SUFFIX, T, COMPLEX_HAS_NAN(x) ? x : COMPLEX_HAS_NAN(y) ? y                 \
           : (x.re > y.re || (x.re == y.re && x.im >= y.im)) ? x : y)

COMPLEX_KERNELS(complex64, complex64)
COMPLEX_KERNELS(complex128, complex128)

/* Only called where numpy itself fused (codes.py), so the CPU has the instruction; on x86 it
 * must be enabled for these two functions alone, elsewhere (aarch64) it is in the base ISA. */
#if defined(__x86_64__) || defined(__i386__)
#define FUSED __attribute__((target("fma")))
#else
#define FUSED
#endif

FUSED KERNEL(fused_loop_complex64, complex64,
             ((complex64){__builtin_fmaf(x.re, y.re, -(x.im * y.im)),
                          __builtin_fmaf(x.re, y.im, x.im * y.re)}))
FUSED KERNEL(fused_loop_complex128, complex128,
             ((complex128){__builtin_fma(x.re, y.re, -(x.im * y.im)),
                           __builtin_fma(x.re, y.im, x.im * y.re)}))

/* numpy takes its scalar loop, which does not fuse, for one element reduced in place. */
#define FUSED_PRODUCT(SUFFIX)                                                               \
    static void fused_product_##SUFFIX(void *acc, const void *in, int64_t n,                \
                                       int64_t acc_step, int64_t in_step)                   \
    {                                                                                       \
        (n == 1 ? product_##SUFFIX : fused_loop_##SUFFIX)(acc, in, n, acc_step, in_step);   \
    }

FUSED_PRODUCT(complex64)
FUSED_PRODUCT(complex128)

#define ROW(SUFFIX) {sum_##SUFFIX, product_##SUFFIX, min_##SUFFIX, max_##SUFFIX, NULL}

static const rc_kernel KERNELS[RC_DTYPES][RC_OPS] = {
    [RC_BOOL] = {or_bool, and_bool, and_bool, or_bool, NULL},
    [RC_INT8] = ROW(int8),
    [RC_INT16] = ROW(int16),
    [RC_INT32] = ROW(int32),
    [RC_INT64] = ROW(int64),
    [RC_UINT8] = ROW(uint8),
    [RC_UINT16] = ROW(uint16),
    [RC_UINT32] = ROW(uint32),
    [RC_UINT64] = ROW(uint64),
    [RC_FLOAT16] = ROW(float16),
    [RC_BFLOAT16] = ROW(bfloat16),
    [RC_FLOAT32] = ROW(float32),
    [RC_FLOAT64] = ROW(float64),
    [RC_COMPLEX64] = {sum_complex64, product_complex64, min_complex64, max_complex64,
                      fused_product_complex64},
    [RC_COMPLEX128] = {sum_complex128, product_complex128, min_complex128, max_complex128,
                       fused_product_complex128},
};

static const int ITEMSIZES[RC_DTYPES] = {
    [RC_BOOL] = 1, [RC_INT8] = 1, [RC_INT16] = 2, [RC_INT32] = 4, [RC_INT64] = 8,
    [RC_UINT8] = 1, [RC_UINT16] = 2, [RC_UINT32] = 4, [RC_UINT64] = 8, [RC_FLOAT16] = 2,
    [RC_BFLOAT16] = 2, [RC_FLOAT32] = 4, [RC_FLOAT64] = 8, [RC_COMPLEX64] = 8,
    [RC_COMPLEX128] = 16,
};

int rc_itemsize(int dtype)
{
    return dtype >= 0 && dtype < RC_DTYPES ? ITEMSIZES[dtype] : 0;
}

rc_kernel rc_kernel_for(int dtype, int op)
{
    if (dtype < 0 || dtype >= RC_DTYPES || op < 0 || op >= RC_OPS)
        return NULL;
    return KERNELS[dtype][op];
}
