/* The change digest of weight sync: tells a publisher whether a bucket's bytes changed since it
 * last sent them, without keeping a copy. The buffer is read as 8-byte little-endian words w_k
 * (the tail padded with zero bytes); each word is mixed with its index by a bijection of the word
 * (xor, odd multiply, xorshift, odd multiply) and the mixed words are summed modulo 2^64, so that
 * a change to any one word always changes the sum and the words are summed without a chain from
 * one to the next (four lanes run side by side; the multiplies, not the reads, bound it). The sum is finished with the length.
 * ray_collective/weight_sync/digest.py holds the reference in numpy, which this must match bit
 * for bit. Not a cryptographic hash: it detects training's changes, not an adversary's. */
#include "digest.h"

#include <string.h>

#define RC_DIGEST_K1 0x9E3779B185EBCA87ULL
#define RC_DIGEST_K2 0xC2B2AE3D27D4EB4FULL

static inline uint64_t mix(uint64_t word, uint64_t index)
{
    uint64_t m = (word ^ (index * RC_DIGEST_K1)) * RC_DIGEST_K2;
    m ^= m >> 29;
    return m * RC_DIGEST_K1;
}

uint64_t rc_digest(const void *data, size_t n)
{
    const unsigned char *bytes = data;
    size_t words = n / 8;
    uint64_t sums[4] = {0, 0, 0, 0};
    size_t k = 0;
    for (; k + 4 <= words; k += 4)
        for (int lane = 0; lane < 4; lane++) {
            uint64_t w;
            memcpy(&w, bytes + 8 * (k + lane), 8);
            sums[lane] += mix(w, k + lane);
        }
    for (; k < words; k++) {
        uint64_t w;
        memcpy(&w, bytes + 8 * k, 8);
        sums[0] += mix(w, k);
    }
    if (n % 8) {
        uint64_t w = 0;
        memcpy(&w, bytes + 8 * words, n % 8);
        sums[0] += mix(w, words);
    }
    uint64_t h = sums[0] + sums[1] + sums[2] + sums[3];
    h ^= (uint64_t)n * RC_DIGEST_K2;
    h ^= h >> 32;
    h *= RC_DIGEST_K1;
    h ^= h >> 29;
    return h;
}
