/* The change digest of weight sync (ray_collective/weight_sync/digest.py holds the reference). */
#ifndef RC_DIGEST_H
#define RC_DIGEST_H

#include <stddef.h>
#include <stdint.h>

/* The 64-bit digest of n bytes at data. */
uint64_t rc_digest(const void *data, size_t n);

#endif
