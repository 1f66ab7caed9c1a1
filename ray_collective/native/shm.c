/* Shared memory between the ranks of one node, in a private directory the caller gives.
 *
 * Files (all opened relative to the directory's descriptor, O_NOFOLLOW, mode 0600, refused
 * unless they are regular files of this process's user with no group or other permissions;
 * created by whichever rank needs them first: both sides open with O_CREAT and truncate to the
 * same size, so creation is idempotent and a fresh file, all zeros, is an empty ring):
 * - `doorbell`: one cache line holding the alarm counter, then one line per rank: the 32-bit
 *   futex word the rank sleeps on, its "sleeping" flag, and how many rings peers have opened
 *   towards it as their producer (so that it looks for new ones only when that changed).
 * - `ring-<src>-<dst>`: the single-producer single-consumer byte ring from src to dst: the
 *   head counter (bytes ever published, written by src) and the tail counter (bytes ever
 *   released, written by dst) on cache lines of their own, then `capacity` bytes of data.
 *
 * Frames: a ring holds frames of whole cache lines (rc_frame, then for DATA the packed call
 * header padded to 8 bytes, then the payload, so payloads are 8-byte aligned). A frame never
 * wraps: a PAD frame fills the rest of the ring and the next frame starts at offset 0. No frame
 * exceeds half the capacity, so a frame always fits once the ring is empty.
 *
 * Memory: tmpfs gives a page only when it is first touched. A producer whose next frame would
 * cross out of the first page restarts at offset 0 (behind a PAD) whenever the frames still in
 * flight leave room there, so a pair that trades small messages touches one page however large
 * its ring; large messages use as much of the ring as they keep in flight.
 *
 * Wake-ups, without lost ones: a waiter reads its futex word, sets its sleeping flag, fences
 * (seq_cst), re-checks what it waits for, and only then waits on the word (FUTEX_WAIT on a
 * shared mapping, so not the private variant) unless the word changed. A poster publishes
 * (release), fences, and wakes the peer only if its flag is set, bumping the word first. One of
 * the two fences comes first: either the poster sees the flag or the waiter's re-check sees
 * what was published.
 */
#define _GNU_SOURCE
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* A producer keeps appending while its frames stay within the first page of the ring's file,
 * and restarts at offset 0 when they would not and the frames in flight leave room there. */
#define RESTART_BEYOND (4096 - RC_RING_DATA_OFFSET)

const char *rc_map_file(int dirfd, const char *name, size_t size, void **map)
{
    int fd = openat(dirfd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return "cannot open";
    struct stat st;
    const char *failed = NULL;
    if (fstat(fd, &st) != 0) {
        failed = "cannot stat";
    } else if (!S_ISREG(st.st_mode)) {
        errno = EPERM;
        failed = "refused (not a regular file)";
    } else if (st.st_uid != geteuid()) {
        errno = EPERM;
        failed = "refused (owned by another user)";
    } else if (st.st_mode & 077) {
        errno = EPERM;
        failed = "refused (open to group or others)";
    } else if (st.st_size != 0 && (size_t)st.st_size != size) {
        errno = EINVAL;
        failed = "has another size than this rank expects (do all ranks give the same "
                 "world size and ring size?)";
    } else if (st.st_size == 0 && ftruncate(fd, (off_t)size) != 0) {
        failed = "cannot size";
    }
    if (failed == NULL) {
        void *address = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (address == MAP_FAILED)
            failed = "cannot map";
        else
            *map = address;
    }
    int saved = errno;
    close(fd);
    errno = saved;
    return failed;
}

const char *rc_ring_open(rc_ring *ring, int dirfd, int src, int dst, uint64_t capacity,
                         int producer)
{
    char name[64];
    snprintf(name, sizeof name, "ring-%d-%d", src, dst);
    void *map = NULL;
    size_t bytes = RC_RING_DATA_OFFSET + capacity;
    const char *failed = rc_map_file(dirfd, name, bytes, &map);
    if (failed != NULL)
        return failed;
    ring->control = map;
    ring->data = (unsigned char *)map + RC_RING_DATA_OFFSET;
    ring->capacity = capacity;
    ring->map_bytes = bytes;
    /* A side that opens a ring the other has used already starts where it stands. */
    ring->position = atomic_load_explicit(producer ? &ring->control->head : &ring->control->tail,
                                          memory_order_acquire);
    ring->seen = ring->position;
    return NULL;
}

void rc_ring_close(rc_ring *ring)
{
    if (ring->control != NULL)
        munmap(ring->control, ring->map_bytes);
    memset(ring, 0, sizeof *ring);
}

static inline uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

uint64_t rc_payload_offset(uint64_t header_len)
{
    return sizeof(rc_frame) + round_up(header_len, 8);
}

uint64_t rc_frame_bytes(uint64_t header_len, uint64_t part_bytes)
{
    return round_up(rc_payload_offset(header_len) + part_bytes, RC_LINE);
}

unsigned char *rc_ring_reserve(rc_ring *ring, uint64_t frame_bytes)
{
    uint64_t capacity = ring->capacity, position = ring->position;
    uint64_t tail = atomic_load_explicit(&ring->control->tail, memory_order_acquire);
    uint64_t offset = position % capacity, used = position - tail, skip = 0;
    if (offset + frame_bytes > capacity)
        skip = capacity - offset; /* wrap */
    else if (offset + frame_bytes > RESTART_BEYOND && used + frame_bytes <= offset)
        skip = capacity - offset; /* back to the first page, which the frames in flight leave
                                     free (they lie just before offset) */
    if (used + skip + frame_bytes > capacity)
        return NULL;
    if (skip != 0) {
        rc_frame *pad = (rc_frame *)(ring->data + offset);
        pad->kind = RC_FRAME_PAD;
        pad->frame_bytes = skip;
        ring->position = position + skip;
    }
    return ring->data + ring->position % capacity;
}

void rc_ring_publish(rc_ring *ring, uint64_t frame_bytes)
{
    ring->position += frame_bytes;
    atomic_store_explicit(&ring->control->head, ring->position, memory_order_release);
}

int rc_ring_peek(rc_ring *ring, rc_frame *frame, const unsigned char **at)
{
    uint64_t capacity = ring->capacity;
    for (;;) {
        if (ring->position == ring->seen) {
            ring->seen = atomic_load_explicit(&ring->control->head, memory_order_acquire);
            if (ring->position == ring->seen)
                return 0;
        }
        uint64_t available = ring->seen - ring->position;
        uint64_t offset = ring->position % capacity;
        if (available > capacity || available < sizeof(rc_frame))
            return -1;
        /* One copy of the head: the checks below hold for what is used afterwards. */
        memcpy(frame, ring->data + offset, sizeof *frame);
        uint64_t bytes = frame->frame_bytes;
        if (bytes < sizeof(rc_frame) || bytes % RC_LINE != 0 || bytes > available
                || offset + bytes > capacity)
            return -1;
        if (frame->kind == RC_FRAME_PAD) {
            if (offset + bytes != capacity)
                return -1;
            ring->position += bytes; /* released with the frame that follows */
            continue;
        }
        if ((frame->kind != RC_FRAME_DATA && frame->kind != RC_FRAME_REMOTE)
                || frame->part_bytes < 0
                || rc_payload_offset(frame->header_len) + (uint64_t)frame->part_bytes > bytes)
            return -1;
        *at = ring->data + offset;
        return 1;
    }
}

void rc_ring_release(rc_ring *ring, uint64_t frame_bytes)
{
    ring->position += frame_bytes;
    atomic_store_explicit(&ring->control->tail, ring->position, memory_order_release);
}

static long futex(_Atomic uint32_t *word, int op, uint32_t value, const struct timespec *timeout)
{
    return syscall(SYS_futex, (uint32_t *)word, op, value, timeout, NULL, 0);
}

void rc_bell_ring(rc_doorbell *doorbell, int rank)
{
    rc_bell *bell = &doorbell->bells[rank];
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&bell->sleeping, memory_order_relaxed)) {
        atomic_fetch_add_explicit(&bell->word, 1, memory_order_seq_cst);
        futex(&bell->word, FUTEX_WAKE, INT_MAX, NULL);
    }
}

void rc_alarm(rc_doorbell *doorbell, int world)
{
    atomic_fetch_add_explicit(&doorbell->alarm, 1, memory_order_seq_cst);
    for (int rank = 0; rank < world; rank++)
        rc_bell_ring(doorbell, rank);
}

uint32_t rc_bell_arm(rc_doorbell *doorbell, int rank)
{
    rc_bell *bell = &doorbell->bells[rank];
    uint32_t armed = atomic_load_explicit(&bell->word, memory_order_acquire);
    atomic_store_explicit(&bell->sleeping, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    return armed;
}

void rc_bell_wait(rc_doorbell *doorbell, int rank, uint32_t armed, int64_t timeout_ns)
{
    if (timeout_ns <= 0)
        return;
    struct timespec timeout = {timeout_ns / 1000000000, timeout_ns % 1000000000};
    futex(&doorbell->bells[rank].word, FUTEX_WAIT, armed, &timeout);
}

void rc_bell_disarm(rc_doorbell *doorbell, int rank)
{
    atomic_store_explicit(&doorbell->bells[rank].sleeping, 0, memory_order_relaxed);
}
