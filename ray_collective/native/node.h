/* One rank's native node: its shared memory, its links to peers and the call it runs (the
 * node in node.c, the plan code's format in program.c, the executor in executor.c, waiting in
 * progress.c, the Python face in module_node.c). Plain C, no Python. */
#ifndef RC_NODE_H
#define RC_NODE_H

#include <sched.h>
#include <stdint.h>

#include "kernels.h"
#include "shm.h"

/* What rc_progress returns; RC_FAILED (out of memory, text in node->error) ends the call.
 * RC_REROUTED: done, but the large point-to-point message the call sends or receives was not
 * read in place (remote.c), and both ends now move it over their transport. */
enum rc_status { RC_DONE = 0, RC_PENDING = 1, RC_MISMATCH = 2, RC_FAILED = 3, RC_REROUTED = 4 };

/* Point-to-point messages (tag >= 0) of more than a node's p2p_max bytes (this, or a quarter
 * of a ring if less) are only ever offered to be read in place, never framed as DATA: a ring
 * must keep room for the small ones behind them, and a send must not wait for its receiver
 * longer than RC_P2P_OFFER_GRACE_NS (progress.c). */
#define RC_P2P_MAX_BYTES (64 << 10)

/* Plan code records (encode_plan in codes.py writes them). */
enum { RC_STEP_ROUND = 1, RC_STEP_LOCAL = 2 };
enum { RC_LOCAL_COPY = 0, RC_LOCAL_COMBINE = 1 };
/* RC_MESSAGE_FAN_OUT is never in a plan code as given: a program marks with it the sends of a
 * round that carry one range of one slot to RC_FAN_OUT_MIN_RECEIVERS peers or more. */
enum { RC_MESSAGE_SEND = 1, RC_MESSAGE_REDUCE = 2, RC_MESSAGE_FAN_OUT = 4 };
#define RC_FAN_OUT_MIN_RECEIVERS 3
/* A fan-out's message is offered to be read in place from this size on (or from the node's
 * remote_min where that is lower): its sender would otherwise copy the same bytes into every
 * receiver's ring, one after the other, while each receiver's read in place runs beside the
 * others'. Linear broadcast of 8 MiB buckets (weight sync, 256 MiB to 4 receivers on 2 cores):
 * the sender's CPU 0.227 -> 0.136 s, the call 12 % shorter, with 2 MiB; below it, pinning the
 * sender's pages costs more than the copies it saves. */
#define RC_FAN_OUT_REMOTE_MIN_BYTES (2u << 20)
#define RC_MESSAGE_WORDS 6 /* flags, peer, step, slot, start, stop */
#define RC_MAX_DIMS 8

/* Where the packed call header (wire.CallHeader.pack) holds the call's sequence number. */
#define RC_HEADER_SEQ_OFFSET 10

/* A message on its way to a peer: in the caller's memory until its round is over, or in an
 * owned overflow copy once detached. */
typedef struct rc_outgoing {
    struct rc_outgoing *next;
    const unsigned char *data; /* the next byte to frame */
    unsigned char *owned;      /* the overflow copy, or NULL */
    int64_t step, count, nbytes, framed; /* framed: bytes already in the ring */
    int64_t message;           /* its index in the current round, -1 once detached */
    struct rc_remote *offer;   /* its REMOTE frame's offer while the receiver may read it */
    int offered;               /* it was offered once (a refused offer is not made again) */
    int fan_out;               /* one of a fan-out's sends (RC_MESSAGE_FAN_OUT) */
} rc_outgoing;

/* The payload of a REMOTE frame (remote.c): the receiver reads the message from the sender's
 * memory itself; `state` (RC_REMOTE_*) is where both sides agree on who has it. */
typedef struct rc_remote {
    _Atomic uint32_t state;
    uint32_t unused;
    int64_t pid;
    uint64_t address;      /* the message's first byte in the sender's memory */
    uint64_t cookie;       /* the sender node's cookie ... */
    uint64_t cookie_address; /* ... and where it lies in the sender's memory */
} rc_remote;

/* OFFERED: the sender waits. TAKING: the receiver reads. TAKEN: the bytes are in place.
 * WITHDRAWN (sender) and DECLINED, DENIED (receiver; DENIED: it cannot read that process):
 * the message follows as DATA frames, or for a point-to-point message over the transport
 * (RC_REROUTED). POISONED: the sender abandoned its call while the receiver read, which then
 * throws away what it read. */
#define RC_REMOTE_PIECE_BYTES (64 << 10)
enum { RC_REMOTE_OFFERED = 1, RC_REMOTE_TAKING, RC_REMOTE_TAKEN, RC_REMOTE_WITHDRAWN,
       RC_REMOTE_DECLINED, RC_REMOTE_DENIED, RC_REMOTE_POISONED };

/* A frame taken out of a ring early because it belongs to another tag (channel). */
typedef struct rc_stashed {
    struct rc_stashed *next;
    unsigned char frame[];
} rc_stashed;

typedef struct {
    rc_ring out, in;
    rc_outgoing *queue, *queue_last;
    rc_stashed *stash, *stash_last;
    int sending; /* listed in node->senders */
    int remote_denied; /* the peer cannot read this process: offer it nothing more */
    int64_t verified_pid; /* the peer process whose cookie this rank has read (0: none) */
    uint64_t verified_cookie;
} rc_link;

typedef struct {
    int peer;
    const char *reason;
    int64_t step, tag, count, nbytes, part_offset, part_bytes;
    int64_t expected_step, expected_count;
    uint32_t header_len;
    unsigned char *header;
} rc_mismatch;

/* One of the call's arrays: the caller's buffers, then scratch memory. */
typedef struct {
    unsigned char *base;
    int64_t count; /* elements */
    int writable;  /* a read-only slot (a reduce's input on a rank that gets no result) may
                      only be sent from: the plan check refuses a write into it */
} rc_slot;

/* What a program needs of one slot of a call: `count` elements (an error names them as
 * low..high), written into if `written`. */
typedef struct {
    int64_t count, low, high;
    int written;
} rc_slot_need;

typedef struct {
    int rank;
    uint8_t use; /* RC_USE_* */
} rc_peer_use;

#define RC_MAX_SLOTS (1 << 20)

/* A plan code checked once and kept (program.c): what every call of it shares. */
typedef struct rc_program {
    int64_t *code, code_len;
    int itemsize;
    rc_kernel kernel;          /* NULL: the calls reduce nothing */
    rc_slot_need *slot_needs;  /* per slot it names */
    int n_slots;
    rc_peer_use *peers;        /* the ranks it names, ascending */
    int n_peers;
    int64_t biggest;           /* messages in its largest round */
    int64_t last_round_at;     /* where its last round with messages starts in `code` (0:
                                  none): that round's sends are never detached */
    char error[256];           /* why the build failed */
} rc_program;

typedef struct {
    int active;
    const rc_program *program;
    const int64_t *code;       /* the program's */
    int64_t pc;          /* the next step record */
    int64_t steps_left;
    rc_slot *slots;
    int n_slots;
    int64_t slot_capacity;
    int itemsize;
    rc_kernel kernel;
    unsigned char *header;
    uint32_t header_len;
    int64_t header_capacity;
    int64_t tag;
    uint64_t part_max;
    const int64_t *round; /* the current round's message records, or NULL */
    int64_t round_size, left;
    int64_t *progress;    /* per message of the round: bytes received, -1 once done */
    int64_t progress_capacity;
    int64_t attached;     /* sends of the round still reading the caller's memory */
    int detach_armed;     /* a stall has waited its grace; the next one detaches sends */
    int64_t stalled_since; /* when the current stall of a call with attached sends began */
    int spun;             /* polled for spin_ns since it last moved: later waits sleep at once */
    int rerouted;         /* its point-to-point message goes over the transport (RC_REROUTED) */
} rc_call;

typedef struct rc_node {
    int dirfd, rank, world;
    uint64_t ring_bytes, part_bytes;
    int64_t spin_ns;
    int64_t busy_poll_ns;       /* of each wait's polling, this much first without yielding
                                   (progress.c): 0 where the node's ranks outnumber its cores */
    rc_doorbell *doorbell;
    size_t doorbell_bytes;
    uint32_t seen_alarm;
    uint32_t rings_seen;        /* this rank's rings_made at its last rc_scan_incoming */
    rc_link **links;
    int *senders, n_senders;    /* peers with messages queued */
    int *receiving, n_receiving; /* peers whose inbound ring is open */
    uint64_t *blocked, pass;    /* per peer: the pass in which a receive from it waited */
    rc_outgoing *spare;         /* finished outgoing records, for reuse */
    uint64_t remote_min;        /* offer messages of this many bytes or more (0: never) */
    uint64_t p2p_max;           /* larger point-to-point messages are offered (RC_P2P_MAX_BYTES) */
    uint64_t cookie;            /* a random word a reader checks it reads the right process */
    int64_t pid;
    int64_t remote_reads;       /* messages this rank has read in place, ever */
    unsigned char *remote_scratch; /* RC_REMOTE_PIECE_BYTES, for reads that reduce */
    rc_call call;
    rc_mismatch mismatch;
    char error[256];            /* why the last start or open failed */
} rc_node;

enum { RC_USE_SEND = 1, RC_USE_RECEIVE = 2 };
enum { RC_OK = 0, RC_INVALID = 1, RC_OS_ERROR = 2 }; /* errors: the text is node->error */

/* node.c. Opening: the caller has opened `dirfd`, which the node then owns. */
int rc_node_open(rc_node *node, int dirfd, int rank, int world, uint64_t ring_bytes,
                 uint64_t part_bytes, int64_t spin_ns, uint64_t remote_min);
void rc_node_close(rc_node *node);
/* Starts the call the caller has put in node->call (program, code, slots, header, itemsize,
 * kernel, tag): checks its slots and peers against the program's needs, opens the rings it
 * needs. */
int rc_call_start(rc_node *node);
/* Forgets the call (a failed one): drops its queued sends and its round. */
void rc_call_end(rc_node *node);
void rc_wake_all(rc_node *node);
/* Returns a finished outgoing record to the node's pool. */
void rc_outgoing_recycle(rc_node *node, rc_outgoing *out);

/* progress.c: runs the call for at most slice_ns; returns an rc_status. */
int rc_progress(rc_node *node, int64_t slice_ns);
/* progress.c: runs passes of a call just started while they move it, never waiting: an
 * rc_status (RC_PENDING when it must wait, or at once when an alarm rang: rc_progress then
 * returns at once too). */
int rc_progress_started(rc_node *node);
/* CLOCK_MONOTONIC in nanoseconds (progress.c; streams.c waits by it too). */
int64_t rc_now_ns(void);

/* executor.c: what a pass returns besides the rc_status values. */
enum { RC_PASS_IDLE = -1, RC_PASS_PROGRESS = -2 };
/* One pass over everything pending. */
int rc_pass(rc_node *node);
/* Copies what the round's sends have not framed yet into overflow memory; they count as done.
 * Offers (remote.c) are taken back first only when `offers_too`; one being read stays.
 * RC_PASS_IDLE when nothing could be detached. */
int rc_detach(rc_node *node, int offers_too);
/* Takes back the point-to-point call's offers that no receiver has begun to read, so that
 * its message goes over the transport: RC_PASS_PROGRESS, or RC_PASS_IDLE if none was. */
int rc_reroute_offers(rc_node *node);
/* Whether a peer the point-to-point call offers a message to waits in a send of its own, so
 * that it cannot read before that send ends and waiting out the grace would gain nothing:
 * its offer to this rank waits at the head of its ring (both send first; that offer is then
 * declined, so that both messages go over the transport side by side rather than one read in
 * place after the other), or its bell says it is offering (to another rank: a ring of ranks
 * that all send first). */
int rc_offers_cross(rc_node *node);
/* Opens, to read, every ring a peer has made towards this rank that this rank has not opened
 * (RC_OK, or RC_OS_ERROR with node->error): the early mismatch check then sees the messages
 * of peers this rank never expects (ranks that disagree about a root disagree about who
 * sends). A file system look per peer, only when a peer made a ring towards this rank since
 * the last scan (its doorbell's rings_made): called between slices of a waiting call. */
int rc_scan_incoming(rc_node *node);

/* RC_MISMATCH if a ring holds a frame of this call number with another header, else
 * RC_PASS_IDLE. */
int rc_early_mismatch(rc_node *node);

/* remote.c: single-copy reads of large messages. */
/* Sender: frames the offer of `out` into the link's ring, in `state` (RC_REMOTE_OFFERED, or
 * RC_REMOTE_WITHDRAWN for a point-to-point message that cannot be read in place); 1, or 0 when
 * the ring is full. */
int rc_remote_offer(rc_node *node, int peer, rc_link *link, rc_outgoing *out, uint32_t state);
/* Sender: what the receiver did with the offer (an RC_REMOTE_* state). */
int rc_remote_state(const rc_outgoing *out);
/* Sender: takes the offer back (1), or cannot while the receiver reads (0); when `abandon`,
 * a read in progress is poisoned instead (its reader throws it away). */
int rc_remote_withdraw(rc_outgoing *out, int abandon);
/* Receiver: reads the message offered by the REMOTE frame `offer` into `target` (nbytes), or
 * reduces it into `target` with `kernel` (elements of `itemsize` bytes) unless it is NULL:
 * 1 once done; 0 when it was not taken (its DATA frames follow, or for a point-to-point
 * message its transport message); -1 when it cannot go on
 * (the sender died or abandoned its call: the rank's failure check will tell). `stashed`:
 * the offer is a copy taken out of the ring (its state no longer shared). */
int rc_remote_take(rc_node *node, int peer, rc_link *link, rc_remote *offer,
                   unsigned char *target, int64_t nbytes, rc_kernel kernel, int itemsize,
                   int stashed);
/* Receiver: declines an offer met while another channel's call runs (the frame is stashed). */
void rc_remote_decline(rc_node *node, int peer, rc_remote *offer);

/* program.c: builds `program` from a copy of `code` (len words) for calls of elements of
 * `itemsize` bytes reduced by `kernel` (NULL: none): checks it once and notes what its calls
 * need. 0, or -1 with the reason in program->error (free it either way). */
int rc_program_build(rc_program *program, const int64_t *code, int64_t len, int itemsize,
                     rc_kernel kernel);
void rc_program_free(rc_program *program);
/* Sets (1) or clears (0) the `offering` word of `rank`'s bell (remote.c says what it is for). */
static inline void rc_mark_offering(rc_node *node, int rank, uint32_t on)
{
    atomic_store_explicit(&node->doorbell->bells[rank].offering, on, memory_order_release);
}
/* How long a waiting rank polls without yielding its core, before it polls yielding it
 * (rc_spin_on), where the node has a core for each of its ranks (rc_node_open) and the peers
 * it waits for last waited on other CPUs than its own (progress.c): a peer's answer to a
 * small message usually comes within it, and a sched_yield costs a system call on the path
 * of every small call. Two ranks on one CPU must yield it to each other at once: polling
 * without yielding there made an allreduce of 8 B at 2 ranks 13.7 us instead of 5.6 us. */
#define RC_BUSY_POLL_NS 4000
/* Not in a round with a message larger than this: a large message's waits are for its parts
 * streaming through the ring, a few per part of hundreds of microseconds, where what a yield
 * costs is lost in the copies. */
#define RC_BUSY_POLL_MAX_BYTES (64 << 10)
static inline void rc_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
/* A waiter that has not moved: whether to poll again, having yielded its core, rather than
 * sleep. It polls for `spin_ns` from its first look (`*spin_until`, 0 before), once: `*spun`
 * is set when that time is over, and later waits sleep at once. */
static inline int rc_spin_on(int64_t spin_ns, int *spun, int64_t *spin_until, int64_t now)
{
    if (spin_ns <= 0 || *spun)
        return 0;
    if (*spin_until == 0)
        *spin_until = now + spin_ns;
    if (now < *spin_until) {
        sched_yield();
        return 1;
    }
    *spun = 1;
    return 0;
}

/* Whether the call's current round is its last with messages. */
static inline int rc_in_last_round(const rc_call *call)
{
    return call->round != NULL && call->round == call->code + call->program->last_round_at + 2;
}
/* Words of the step record at `record`, which rc_program_build has accepted. */
int64_t rc_step_words(const int64_t *record);
/* Runs a LOCAL record; returns 0, or -1 if out of memory. */
int rc_program_local(rc_call *call, const int64_t *record);

#endif
