/* Shared memory between the ranks of one node: the doorbell file and the byte rings (see
 * shm.c for the layout, the frames and the wake-up protocol). */
#ifndef RC_SHM_H
#define RC_SHM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RC_LINE 64
#define RC_RING_DATA_OFFSET 128 /* the head and the tail lines precede a ring's data */
#define RC_FRAME_DATA 1
#define RC_FRAME_PAD 2
#define RC_FRAME_REMOTE 3 /* an offer to read a message from the sender's memory (remote.c) */

/* The fixed head of every frame, one cache line. A DATA frame continues with the packed call
 * header (padded to 8 bytes) and the part's payload; a REMOTE frame likewise, its payload an
 * rc_remote (remote.c); a PAD frame only says how far to skip. */
typedef struct {
    uint32_t kind;
    uint32_t header_len;
    uint64_t frame_bytes; /* the whole frame, a multiple of RC_LINE */
    int64_t step;
    int64_t tag;
    int64_t count;       /* elements of the whole message */
    int64_t nbytes;      /* bytes of the whole message */
    int64_t part_offset; /* where this part starts in the message, in bytes */
    int64_t part_bytes;
} rc_frame;

typedef struct {
    _Atomic uint64_t head; /* bytes ever published by the producer */
    char head_pad[RC_LINE - 8];
    _Atomic uint64_t tail; /* bytes ever released by the consumer */
    char tail_pad[RC_LINE - 8];
} rc_ring_control;

/* One side's view of a ring: the producer's or the consumer's. */
typedef struct {
    rc_ring_control *control; /* NULL until the file is opened */
    unsigned char *data;
    uint64_t capacity;
    uint64_t position; /* the producer's head, or the consumer's tail */
    uint64_t seen;     /* the consumer's last reading of head */
    size_t map_bytes;
} rc_ring;

typedef struct {
    _Atomic uint32_t word;     /* the futex a rank sleeps on */
    _Atomic uint32_t sleeping; /* set while it may sleep: posters then wake it */
    _Atomic uint32_t rings_made; /* bumped by a peer that made a ring towards this rank */
    _Atomic uint32_t offering; /* set while the rank's point-to-point send waits for its offer
                                  to be read (remote.c); cleared by the rank or its reader */
    _Atomic uint32_t cpu;      /* 1 + the CPU the rank last waited on (0: not yet) */
    char pad[RC_LINE - 20];
} rc_bell;

typedef struct {
    _Atomic uint32_t alarm; /* bumped by wake_all */
    char pad[RC_LINE - 4];
    rc_bell bells[];
} rc_doorbell;

/* Opens (creating it if needed) the file `name` in the directory `dirfd` and maps `size`
 * bytes of it. Returns NULL on success, else what failed (errno tells why). */
const char *rc_map_file(int dirfd, const char *name, size_t size, void **map);

/* Maps the ring file of src -> dst with `capacity` data bytes, as its producer (src) or its
 * consumer. Returns NULL or what failed. */
const char *rc_ring_open(rc_ring *ring, int dirfd, int src, int dst, uint64_t capacity,
                         int producer);
void rc_ring_close(rc_ring *ring);

/* Producer: room for a frame of `frame_bytes` (a multiple of RC_LINE, at most half the
 * capacity): where to write it, or NULL when the ring is too full. Call rc_ring_publish
 * after writing. */
unsigned char *rc_ring_reserve(rc_ring *ring, uint64_t frame_bytes);
void rc_ring_publish(rc_ring *ring, uint64_t frame_bytes);

/* Consumer: the next DATA or REMOTE frame (pads skipped), its head copied into *frame. Returns 1 and
 * sets *at to the frame's first byte; 0 when the ring is empty; -1 when the ring holds
 * something that is not a well-formed frame. */
int rc_ring_peek(rc_ring *ring, rc_frame *frame, const unsigned char **at);
void rc_ring_release(rc_ring *ring, uint64_t frame_bytes);

/* The bytes a frame takes for a call header of header_len and a payload of part_bytes. */
uint64_t rc_frame_bytes(uint64_t header_len, uint64_t part_bytes);
/* Where the payload starts in a frame with a call header of header_len. */
uint64_t rc_payload_offset(uint64_t header_len);

/* Wakes `rank` if it is about to sleep or sleeping; call after publishing something. */
void rc_bell_ring(rc_doorbell *doorbell, int rank);
/* Bumps the alarm and wakes every rank of `world` that sleeps. */
void rc_alarm(rc_doorbell *doorbell, int world);

/* The waiting side of a bell: rc_bell_arm before the last check of what one waits for, then
 * rc_bell_wait (which returns at once if anything rang since the arm), then rc_bell_disarm. */
uint32_t rc_bell_arm(rc_doorbell *doorbell, int rank);
void rc_bell_wait(rc_doorbell *doorbell, int rank, uint32_t armed, int64_t timeout_ns);
void rc_bell_disarm(rc_doorbell *doorbell, int rank);

#endif
