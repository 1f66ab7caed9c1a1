/* One round of a call's messages over the TCP streams between nodes, in C (streams.c); the
 * stream round's Python face is module_streams.c's stream_round, its caller
 * engine/stream_rounds.py. Plain C, no Python. */
#ifndef RC_STREAMS_H
#define RC_STREAMS_H

#include <poll.h>
#include <stdint.h>

#include "kernels.h"

/* The wire format of transport.tcp and transport.wire: a little-endian u32 length, then the
 * frame. A DATA frame's fixed part (wire.DATA_FRAME, "<BiqqqqqiQH") is followed by the packed
 * call header, then the part's payload (inline). */
#define RC_STREAM_LENGTH_BYTES 4
#define RC_DATA_FRAME_BYTES 59
#define RC_WIRE_DATA 2
#define RC_WIRE_INLINE (-1)
#define RC_STREAM_MAX_HEADER_BYTES 4096
/* From this many payload bytes on, a part that is copied (not reduced) is read straight into
 * its place (tcp.LARGE_PAYLOAD_BYTES); a smaller one comes with its header in one read. */
#define RC_STREAM_PLACED_BYTES (64 << 10)

/* What rc_stream_round_run returns besides RC_DONE and RC_PENDING (node.h's values). The
 * event's stream is `event_stream`; the round goes on at the next call. */
enum {
    RC_STREAM_FOREIGN = 10,  /* a whole frame that is not this round's: `foreign` */
    RC_STREAM_CLOSED = 11,   /* the stream ended or failed */
    RC_STREAM_PROTOCOL = 12, /* a frame the protocol forbids: `error` says how */
    RC_STREAM_MISMATCH = 13, /* a DATA frame of the round's tag unlike what it expects:
                                `mismatch_*`, the message `event_message` */
    RC_STREAM_FAILED = 14,   /* out of memory, or polling failed: `error` says which */
    RC_STREAM_WATCHED = 15,  /* the watched socket `event_stream` is ready (it is left out of
                                the round's polls from then on) */
};

typedef struct {
    int stream;             /* its index in the round's streams */
    int send, reduce;
    int64_t step, count;    /* the wire's step and element count */
    unsigned char *data;    /* its first byte in the caller's memory */
    int64_t nbytes;
    int64_t done;           /* payload bytes sent, or received (and reduced) */
    int complete;
} rc_stream_message;

/* Reading a frame goes LENGTH -> FIXED (the DATA frame's fixed part, or less of a shorter
 * frame) -> BODY (header and small payload, or a foreign frame's rest) or HEADER -> PLACE (a
 * large payload straight into its place). */
enum { RC_READ_LENGTH, RC_READ_FIXED, RC_READ_BODY, RC_READ_HEADER, RC_READ_PLACE };

typedef struct {
    int fd;
    int64_t sending, receiving; /* the message being sent, received on it; -1: none */
    /* the frame being written: its length and fixed part, and how much of it is out */
    unsigned char out_head[RC_STREAM_LENGTH_BYTES + RC_DATA_FRAME_BYTES];
    int64_t part_at, part_len, frame_sent;
    int framed;                 /* out_head holds the frame of the part at part_at */
    /* the frame being read */
    int phase;
    unsigned char in_head[RC_STREAM_LENGTH_BYTES + RC_DATA_FRAME_BYTES];
    int64_t head_got, length, fixed_len;
    int64_t in_step, in_tag, in_count, in_nbytes, in_part_offset, in_part_bytes;
    int32_t in_segment;
    uint32_t in_header_len;
    int foreign;                /* the frame being read is handed over whole */
    unsigned char *body;
    int64_t body_len, body_got, body_capacity, placed_got;
} rc_stream;

typedef struct {
    rc_stream *streams;
    int n_streams;
    /* Sockets the round does not read but polls with its own, for the caller to serve while
     * the round waits (a listener, other streams): -1 once reported. */
    int *watched;
    int n_watched;
    struct pollfd *polls; /* one per stream, then one per watched socket */
    rc_stream_message *messages;
    int64_t n_messages;
    const unsigned char *header;
    uint32_t header_len;
    int64_t tag, part_max, max_frame; /* bytes of a part sent, of a frame accepted */
    /* How long the round polls, yielding its core, before it sleeps in ppoll; it polls
     * again only once a stream has moved (progress.c's policy for the rings). */
    int64_t spin_ns;
    int spun;
    rc_kernel kernel;
    int itemsize;
    /* the last event's */
    int event_stream;
    int64_t event_message;
    unsigned char *foreign;     /* RC_STREAM_FOREIGN: the frame, without its length */
    int64_t foreign_len;
    char error[160];
} rc_stream_round;

/* Sets the streams' and messages' progress for a new round (every message's `done` 0). */
void rc_stream_round_begin(rc_stream_round *round);
/* Moves the round on for at most slice_ns: RC_DONE once every message is complete (every
 * send wholly handed to the kernel), RC_PENDING when the slice ended first, or an event. */
int rc_stream_round_run(rc_stream_round *round, int64_t slice_ns);
/* Frees what the round's streams allocated (after its last run). */
void rc_stream_round_end(rc_stream_round *round);

#endif
