/* Element-wise reductions of the native core: acc[i] = op(acc[i], in[i]) for every dtype and op
 * of ray_collective.tensors.combiner, bit for bit (see kernels.c for the rules and the one
 * exception, NaN payloads). */
#ifndef RC_KERNELS_H
#define RC_KERNELS_H

#include <stdint.h>

/* dtype codes: the order of tensors.SUPPORTED_DTYPES (codes.py holds the same table). */
enum rc_dtype {
    RC_BOOL, RC_INT8, RC_INT16, RC_INT32, RC_INT64, RC_UINT8, RC_UINT16, RC_UINT32, RC_UINT64,
    RC_FLOAT16, RC_BFLOAT16, RC_FLOAT32, RC_FLOAT64, RC_COMPLEX64, RC_COMPLEX128, RC_DTYPES
};

/* op codes; RC_OP_NONE is a call that reduces nothing. RC_PRODUCT_FUSED is complex PRODUCT
 * computed the way numpy does on CPUs where it fuses the multiply-add (codes.py asks numpy). */
enum rc_op { RC_OP_NONE = -1, RC_SUM, RC_PRODUCT, RC_MIN, RC_MAX, RC_PRODUCT_FUSED, RC_OPS };

/* Reduces n elements: acc[i*acc_step] = op(acc[i*acc_step], in[i*in_step]); steps in
 * elements, possibly negative. */
typedef void (*rc_kernel)(void *acc, const void *in, int64_t n, int64_t acc_step,
                          int64_t in_step);

/* Bytes per element of a dtype code, or 0 for an unknown code. */
int rc_itemsize(int dtype);

/* The kernel of (dtype, op), or NULL when the pair has none (an unknown code, or the fused
 * product on a dtype that is not complex). */
rc_kernel rc_kernel_for(int dtype, int op);

#endif
