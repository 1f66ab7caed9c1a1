/* One round of a call's messages over the TCP streams between nodes, with the GIL released.
 *
 * The Python engine (transport.progress, transport.stream_carrier) moves a call's messages
 * between nodes with a few dozen Python calls per frame; here a whole round of them runs in C:
 * every send framed and written as the kernel takes it, every receive read, checked and
 * copied or reduced into place, the streams polled together until all are done. The frames are
 * byte for byte those of transport.tcp (the peer may run either engine), and a stream is read
 * only as far as the frame in hand, never into the next one: what follows this round's frames
 * (the next call's, or those of other channels) stays in the kernel for whichever engine reads
 * next. A frame that is not the round's (another tag, an ABORT) is read whole and handed over
 * (RC_STREAM_FOREIGN) for the Python side to deliver as its carrier would; the round goes on.
 *
 * Each part's fixed frame and call header are compared with what the receive expects, as
 * wire.Inbox does: the header byte for byte, the step, the element count, the message's bytes,
 * the part's offset. A small part arrives with its header in one read and is copied after the
 * check; a large one that is copied (not reduced) is read straight into its place once its
 * header has passed. Reduced payloads land at an aligned offset of the stream's buffer.
 *
 * Waiting is first polling the streams for spin_ns, yielding the core between polls
 * (sched_yield), as the rings' waits do (progress.c): the peer's answer to a small message
 * often comes within it, where a round that sleeps in ppoll at once pays a process wake-up for
 * it (sockets the round only watches wait for the ppoll). It polls again only once a stream
 * has moved, not after every slice of a long wait. Then ppoll over the round's streams, for at
 * most the slice the caller gives: between
 * slices the caller looks for failures (a dead peer's stream ends here as RC_STREAM_CLOSED).
 * The same ppoll watches the rank's other sockets (its listener, streams the round does not
 * use): one that becomes ready is reported (RC_STREAM_WATCHED) for the caller to serve, as
 * its own wait would (a connection to accept and authenticate, a peer's early frames).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "node.h"
#include "streams.h"

/* What one stream may read or write before the others get their turn (tcp.READ_BUDGET_BYTES):
 * a peer that sends faster than this rank reads must not hold up this rank's own sends. */
#define TURN_BYTES (1 << 20)
#define PAYLOAD_ALIGN 64

static void put_le(unsigned char *at, uint64_t value, int bytes)
{
    for (int i = 0; i < bytes; i++)
        at[i] = (unsigned char)(value >> (8 * i));
}

static uint64_t get_le(const unsigned char *at, int bytes)
{
    uint64_t value = 0;
    for (int i = bytes - 1; i >= 0; i--)
        value = (value << 8) | at[i];
    return value;
}

/* The first incomplete message of a direction on stream `s` from index `from`, or -1. */
static int64_t next_message(const rc_stream_round *r, int s, int send, int64_t from)
{
    for (int64_t m = from; m < r->n_messages; m++) {
        const rc_stream_message *message = &r->messages[m];
        if (message->stream == s && message->send == send && !message->complete)
            return m;
    }
    return -1;
}

void rc_stream_round_begin(rc_stream_round *r)
{
    for (int64_t m = 0; m < r->n_messages; m++) {
        r->messages[m].done = 0;
        r->messages[m].complete = 0;
    }
    for (int s = 0; s < r->n_streams; s++) {
        rc_stream *stream = &r->streams[s];
        stream->sending = next_message(r, s, 1, 0);
        stream->receiving = next_message(r, s, 0, 0);
        stream->framed = 0;
        stream->part_at = stream->frame_sent = 0;
        stream->phase = RC_READ_LENGTH;
        stream->head_got = stream->body_got = stream->placed_got = 0;
        stream->foreign = 0;
    }
    r->foreign = NULL;
    r->foreign_len = 0;
    r->error[0] = '\0';
    r->spun = 0;
}

void rc_stream_round_end(rc_stream_round *r)
{
    for (int s = 0; s < r->n_streams; s++) {
        free(r->streams[s].body);
        r->streams[s].body = NULL;
        r->streams[s].body_capacity = 0;
    }
    free(r->foreign);
    r->foreign = NULL;
}

/* ------------------------------------------------------------------------------- sending */

/* Writes the length and fixed part of the DATA frame of the part at stream->part_at, as
 * tcp.frame_pieces cuts a message: one part up to part_max bytes, else parts of part_max. */
static void frame_part(const rc_stream_round *r, rc_stream *stream,
                       const rc_stream_message *m)
{
    int64_t left = m->nbytes - stream->part_at;
    stream->part_len = left < r->part_max ? left : r->part_max;
    unsigned char *h = stream->out_head;
    put_le(h, (uint64_t)(RC_DATA_FRAME_BYTES + r->header_len + stream->part_len), 4);
    h += RC_STREAM_LENGTH_BYTES;
    h[0] = RC_WIRE_DATA;
    put_le(h + 1, (uint32_t)(int32_t)m->step, 4);
    put_le(h + 5, (uint64_t)r->tag, 8);
    put_le(h + 13, (uint64_t)m->count, 8);
    put_le(h + 21, (uint64_t)m->nbytes, 8);
    put_le(h + 29, (uint64_t)stream->part_at, 8);
    put_le(h + 37, (uint64_t)stream->part_len, 8);
    put_le(h + 45, (uint32_t)(int32_t)RC_WIRE_INLINE, 4);
    put_le(h + 49, 0, 8);
    put_le(h + 57, r->header_len, 2);
    stream->frame_sent = 0;
    stream->framed = 1;
}

/* Adds the piece [at, at + len) of a frame to `iov`, less the `*skip` bytes already sent. */
static void add_piece(struct iovec *iov, int *n, const unsigned char *at, int64_t len,
                      int64_t *skip)
{
    if (*skip >= len) {
        *skip -= len;
        return;
    }
    iov[*n].iov_base = (void *)(at + *skip);
    iov[*n].iov_len = (size_t)(len - *skip);
    *skip = 0;
    (*n)++;
}

/* Hands the stream's queued frames to the kernel until it is full: 1 if any byte left, 0 if
 * none could, -1 if the stream failed. */
static int pump_send(rc_stream_round *r, int s)
{
    rc_stream *stream = &r->streams[s];
    int moved = 0;
    int64_t turn = 0;
    while (stream->sending >= 0 && turn < TURN_BYTES) {
        rc_stream_message *m = &r->messages[stream->sending];
        if (!stream->framed)
            frame_part(r, stream, m);
        int64_t total = (int64_t)sizeof stream->out_head + r->header_len + stream->part_len;
        struct iovec iov[3];
        int n = 0;
        int64_t skip = stream->frame_sent;
        add_piece(iov, &n, stream->out_head, sizeof stream->out_head, &skip);
        add_piece(iov, &n, r->header, r->header_len, &skip);
        add_piece(iov, &n, m->data + stream->part_at, stream->part_len, &skip);
        struct msghdr message = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t sent = sendmsg(stream->fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return moved;
            return -1;
        }
        moved = 1;
        turn += sent;
        stream->frame_sent += sent;
        if (stream->frame_sent < total)
            continue;
        stream->framed = 0;
        stream->part_at += stream->part_len;
        m->done = stream->part_at;
        if (stream->part_at >= m->nbytes) {
            m->complete = 1;
            stream->part_at = 0;
            stream->sending = next_message(r, s, 1, stream->sending + 1);
        }
    }
    return moved;
}

/* ----------------------------------------------------------------------------- receiving */

/* Reads into the pieces `iov`: bytes read, 0 when the kernel has none now, -1 when the stream
 * ended or failed. */
static int64_t read_into(int fd, struct iovec *iov, int n)
{
    for (;;) {
        struct msghdr message = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t got = recvmsg(fd, &message, MSG_DONTWAIT);
        if (got > 0)
            return got;
        if (got == 0)
            return -1;
        if (errno == EINTR)
            continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    }
}

static int64_t read_some(int fd, unsigned char *at, int64_t len)
{
    struct iovec iov = {at, (size_t)len};
    return read_into(fd, &iov, 1);
}

static int grow_body(rc_stream *stream, int64_t bytes)
{
    if (bytes <= stream->body_capacity)
        return 0;
    unsigned char *body = malloc((size_t)bytes);
    if (body == NULL)
        return -1;
    free(stream->body);
    stream->body = body;
    stream->body_capacity = bytes;
    return 0;
}

static int protocol_error(rc_stream_round *r, int s, const char *what, long long value)
{
    snprintf(r->error, sizeof r->error, what, value);
    r->event_stream = s;
    return RC_STREAM_PROTOCOL;
}

static int out_of_memory(rc_stream_round *r, int s)
{
    snprintf(r->error, sizeof r->error, "out of memory for a frame on stream %d", s);
    r->event_stream = s;
    return RC_STREAM_FAILED;
}

/* Where a part's payload lies in the stream's buffer (after its header, aligned). */
static int64_t payload_at(const rc_stream *stream)
{
    return ((int64_t)stream->in_header_len + PAYLOAD_ALIGN - 1) / PAYLOAD_ALIGN * PAYLOAD_ALIGN;
}

/* The frame's fixed part is in: decides how the rest is read. 0 to go on, or an event. */
static int begin_body(rc_stream_round *r, int s, const rc_stream_message *m)
{
    rc_stream *stream = &r->streams[s];
    const unsigned char *h = stream->in_head + RC_STREAM_LENGTH_BYTES;
    stream->foreign = stream->fixed_len < RC_DATA_FRAME_BYTES || h[0] != RC_WIRE_DATA;
    if (!stream->foreign) {
        stream->in_step = (int32_t)get_le(h + 1, 4);
        stream->in_tag = (int64_t)get_le(h + 5, 8);
        stream->in_count = (int64_t)get_le(h + 13, 8);
        stream->in_nbytes = (int64_t)get_le(h + 21, 8);
        stream->in_part_offset = (int64_t)get_le(h + 29, 8);
        stream->in_part_bytes = (int64_t)get_le(h + 37, 8);
        stream->in_segment = (int32_t)get_le(h + 45, 4);
        stream->in_header_len = (uint32_t)get_le(h + 57, 2);
        stream->foreign = stream->in_tag != r->tag;
    }
    if (stream->foreign) {
        /* Read whole, fixed part included, and handed over. */
        if (grow_body(stream, stream->length) != 0)
            return out_of_memory(r, s);
        memcpy(stream->body, h, (size_t)stream->fixed_len);
        stream->body_got = stream->fixed_len;
        stream->body_len = stream->length;
        stream->phase = RC_READ_BODY;
        return 0;
    }
    if (stream->in_segment != RC_WIRE_INLINE)
            return protocol_error(r, s, "a shared-memory part on a stream (segment %lld)",
                              (long long)stream->in_segment);
    if (stream->in_part_bytes < 0 || stream->length
            != RC_DATA_FRAME_BYTES + (int64_t)stream->in_header_len + stream->in_part_bytes)
        return protocol_error(r, s, "inline part of %lld bytes does not fill its frame",
                              (long long)stream->in_part_bytes);
    int placed = !m->reduce && stream->in_part_bytes >= RC_STREAM_PLACED_BYTES;
    stream->body_len = stream->in_header_len + (placed ? 0 : stream->in_part_bytes);
    if (grow_body(stream, payload_at(stream) + (placed ? 0 : stream->in_part_bytes) + 1) != 0)
        return out_of_memory(r, s);
    stream->body_got = 0;
    stream->phase = placed ? RC_READ_HEADER : RC_READ_BODY;
    return 0;
}

/* Whether the part whose header is in the buffer is the next one `m` expects (else the
 * mismatch event is set up). */
static int expected(rc_stream_round *r, int s, const rc_stream_message *m)
{
    rc_stream *stream = &r->streams[s];
    if (stream->in_header_len == r->header_len
            && memcmp(stream->body, r->header, r->header_len) == 0
            && stream->in_step == m->step && stream->in_count == m->count
            && stream->in_nbytes == m->nbytes && stream->in_part_offset == m->done
            && stream->in_part_bytes % r->itemsize == 0
            && stream->in_part_bytes <= m->nbytes - m->done)
        return 1;
    r->event_stream = s;
    r->event_message = stream->receiving;
    return 0;
}

/* The part is in place: the message moves on, and the stream reads its next frame. */
static void part_done(rc_stream_round *r, int s, rc_stream_message *m)
{
    rc_stream *stream = &r->streams[s];
    m->done += stream->in_part_bytes;
    stream->phase = RC_READ_LENGTH;
    stream->head_got = stream->body_got = stream->placed_got = 0;
    if (m->done == m->nbytes) {
        m->complete = 1;
        stream->receiving = next_message(r, s, 0, stream->receiving + 1);
    }
}

/* What a step of a stream's receive did, besides -1 (the stream ended or failed) and the
 * events: STEP_ON, go on; STEP_DRY, the kernel has no more bytes for now. */
enum { STEP_ON = 0, STEP_DRY = 2 };

/* The step's outcome of a read of `got` bytes (<= 0: none, or the stream ended). */
static int counted(int64_t got, int64_t *turn)
{
    if (got <= 0)
        return got < 0 ? -1 : STEP_DRY;
    *turn += got;
    return STEP_ON;
}

/* LENGTH, then FIXED: reads the frame's length prefix, then its fixed part. */
static int read_start(rc_stream_round *r, int s, const rc_stream_message *m, int64_t *turn)
{
    rc_stream *stream = &r->streams[s];
    int64_t want = RC_STREAM_LENGTH_BYTES
                   + (stream->phase == RC_READ_FIXED ? stream->fixed_len : 0);
    int64_t got = read_some(stream->fd, stream->in_head + stream->head_got,
                            want - stream->head_got);
    int step = counted(got, turn);
    if (step != STEP_ON)
        return step;
    stream->head_got += got;
    if (stream->head_got < want)
        return STEP_ON;
    if (stream->phase == RC_READ_FIXED)
        return begin_body(r, s, m);
    stream->length = (int64_t)get_le(stream->in_head, 4);
    if (stream->length > r->max_frame || stream->length == 0)
        return protocol_error(r, s, "stream frame of %lld bytes", (long long)stream->length);
    stream->fixed_len = stream->length < RC_DATA_FRAME_BYTES ? stream->length
                                                             : RC_DATA_FRAME_BYTES;
    stream->phase = RC_READ_FIXED;
    return STEP_ON;
}

/* PLACE: reads a large part's payload straight into the message. */
static int read_placed(rc_stream_round *r, int s, rc_stream_message *m, int64_t *turn)
{
    rc_stream *stream = &r->streams[s];
    int64_t at = stream->in_part_offset + stream->placed_got;
    int64_t got = read_some(stream->fd, m->data + at, stream->in_part_bytes - stream->placed_got);
    int step = counted(got, turn);
    if (step != STEP_ON)
        return step;
    stream->placed_got += got;
    if (stream->placed_got == stream->in_part_bytes)
        part_done(r, s, m);
    return STEP_ON;
}

/* BODY or HEADER: reads the header (with a small payload, aligned after it), or a foreign
 * frame's rest. */
static int read_body(rc_stream *stream, int64_t *turn)
{
    struct iovec iov[2];
    int n = 0;
    int64_t header_len = stream->foreign ? stream->body_len : stream->in_header_len;
    if (stream->body_got < header_len) {
        iov[n].iov_base = stream->body + stream->body_got;
        iov[n++].iov_len = (size_t)(header_len - stream->body_got);
    }
    if (stream->body_len > header_len) {
        int64_t from = stream->body_got > header_len ? stream->body_got - header_len : 0;
        iov[n].iov_base = stream->body + payload_at(stream) + from;
        iov[n++].iov_len = (size_t)(stream->body_len - header_len - from);
    }
    int64_t got = read_into(stream->fd, iov, n);
    int step = counted(got, turn);
    if (step == STEP_ON)
        stream->body_got += got;
    return step;
}

/* The body is in: a foreign frame is handed over; a part is checked, then read into place
 * (a large one) or copied or reduced from the buffer. */
static int take_body(rc_stream_round *r, int s, rc_stream_message *m)
{
    rc_stream *stream = &r->streams[s];
    if (stream->foreign) {
        r->foreign = stream->body;
        r->foreign_len = stream->length;
        stream->body = NULL;
        stream->body_capacity = 0;
        stream->phase = RC_READ_LENGTH;
        stream->head_got = stream->body_got = 0;
        r->event_stream = s;
        return RC_STREAM_FOREIGN;
    }
    if (!expected(r, s, m))
        return RC_STREAM_MISMATCH;
    if (stream->phase == RC_READ_HEADER) {
        stream->phase = RC_READ_PLACE;
        stream->placed_got = 0;
        return STEP_ON;
    }
    if (stream->in_part_bytes > 0) {
        unsigned char *target = m->data + stream->in_part_offset;
        const unsigned char *payload = stream->body + payload_at(stream);
        if (m->reduce)
            r->kernel(target, payload, stream->in_part_bytes / r->itemsize, 1, 1);
        else
            memcpy(target, payload, (size_t)stream->in_part_bytes);
    }
    part_done(r, s, m);
    return STEP_ON;
}

/* Reads the stream's frames for its receives until the kernel has none: 1 if any byte came,
 * 0 if none, -1 if the stream ended or failed, or an event. */
static int pump_receive(rc_stream_round *r, int s)
{
    rc_stream *stream = &r->streams[s];
    int64_t turn = 0;
    while (stream->receiving >= 0 && turn < TURN_BYTES) {
        rc_stream_message *m = &r->messages[stream->receiving];
        int step;
        if (stream->phase == RC_READ_LENGTH || stream->phase == RC_READ_FIXED)
            step = read_start(r, s, m, &turn);
        else if (stream->phase == RC_READ_PLACE)
            step = read_placed(r, s, m, &turn);
        else if (stream->body_got < stream->body_len)
            step = read_body(stream, &turn);
        else
            step = take_body(r, s, m);
        if (step == STEP_DRY)
            break;
        if (step != STEP_ON)
            return step;
    }
    return turn > 0;
}

/* ------------------------------------------------------------------------------- the round */

int rc_stream_round_run(rc_stream_round *r, int64_t slice_ns)
{
    int64_t deadline = rc_now_ns() + slice_ns, spin_until = 0;
    for (;;) {
        int moved = 0, busy = 0;
        for (int s = 0; s < r->n_streams; s++) {
            rc_stream *stream = &r->streams[s];
            int result;
            if (stream->sending >= 0) {
                if ((result = pump_send(r, s)) < 0) {
                    r->event_stream = s;
                    return RC_STREAM_CLOSED;
                }
                moved |= result;
            }
            if (stream->receiving >= 0) {
                if ((result = pump_receive(r, s)) < 0) {
                    r->event_stream = s;
                    return RC_STREAM_CLOSED;
                }
                if (result >= RC_STREAM_FOREIGN)
                    return result;
                moved |= result;
            }
            r->polls[s].fd = stream->fd;
            r->polls[s].events = (short)((stream->sending >= 0 ? POLLOUT : 0)
                                         | (stream->receiving >= 0 ? POLLIN : 0));
            r->polls[s].revents = 0;
            if (r->polls[s].events == 0)
                r->polls[s].fd = -1;
            else
                busy = 1;
        }
        if (!busy)
            return RC_DONE;
        if (moved) {
            spin_until = 0;
            r->spun = 0;
            continue;
        }
        int64_t now = rc_now_ns(), left = deadline - now;
        if (left <= 0)
            return RC_PENDING;
        if (rc_spin_on(r->spin_ns, &r->spun, &spin_until, now))
            continue;
        struct pollfd *watched = r->polls + r->n_streams;
        for (int w = 0; w < r->n_watched; w++)
            watched[w] = (struct pollfd){r->watched[w], POLLIN, 0};
        struct timespec wait = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        int ready = ppoll(r->polls, (nfds_t)(r->n_streams + r->n_watched), &wait, NULL);
        if (ready < 0 && errno != EINTR) {
            snprintf(r->error, sizeof r->error, "ppoll failed (errno %d)", errno);
            return RC_STREAM_FAILED;
        }
        for (int w = 0; ready > 0 && w < r->n_watched; w++) {
            if (watched[w].revents != 0) {
                r->watched[w] = -1;
                r->event_stream = w;
                return RC_STREAM_WATCHED;
            }
        }
    }
}
