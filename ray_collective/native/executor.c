/* The executor: the messages and local steps of one rank's call, one pass at a time (rc_pass;
 * progress.c decides when to pass again and when to wait). No Python: the module releases the
 * GIL around it.
 *
 * Rounds: the plan's steps run in order. A round posts its messages at once: each send is
 * queued on its peer's link and framed into the ring as room allows (parts of at most
 * part_max bytes), each receive takes the frames of its peer in posting order, checking every
 * part against what it expects (the packed call header byte for byte, the step, the element
 * count, the message's bytes and the part's offset) and copying or reducing the part straight
 * out of the ring into its place. A round is over when all its receives have their bytes and
 * all its sends are out of the caller's memory; then the local steps up to the next round run.
 * Frames of another tag (point-to-point channels) met on the way are copied aside (the link's
 * stash) for the receive that will want them.
 *
 * Eager sends over bounded rings: a send whose ring is full would make a plan that relies on
 * buffered sends deadlock. So when waiting brought no progress (progress.c), the sends of the
 * round that still read the caller's memory are detached (rc_detach): their remaining bytes are
 * copied into overflow memory of the node and the sends count as done; the link keeps framing
 * them into the ring as room appears (an offer taken back is offered again from its copy, so
 * its receiver still reads it in one copy). A call is DONE only when every queued byte is in a
 * ring or read (nothing is left for a later call to push), so a rank never leaves data behind a
 * peer waits for. For the same reason the sends of the call's last round with messages are
 * never detached: the call waits for them either way, and nothing a peer waits for comes after
 * them, so a copy would only cost time (a node-mate that comes late to a hierarchical
 * allreduce's last round made every 64 MiB call on 4 nodes x 2 ranks copy 32 MiB and stream it
 * through the ring: 12% slower than the Python engine).
 *
 * Large point-to-point messages are only offered (remote.c): one that is not read in place
 * ends its call on both sides as RC_REROUTED, and the caller moves it over the transport.
 *
 * Early mismatches (rc_early_mismatch, before a collective call, tag < 0, sleeps): the first
 * frame of every ring this rank has opened to read, if it has this tag and call number but
 * another header, is a mismatch even when no receive from that peer is posted (ranks that
 * disagree about the root disagree about who sends). Rings of peers this rank never received
 * from are not opened for that: such a disagreement shows as a timeout instead.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node.h"

static int fail_mismatch(rc_node *node, int peer, const char *reason, const rc_frame *frame,
                         const unsigned char *header, const int64_t *message)
{
    rc_mismatch *m = &node->mismatch;
    free(m->header);
    memset(m, 0, sizeof *m);
    m->peer = peer;
    m->reason = reason;
    m->expected_step = message ? message[2] : -1;
    m->expected_count = message ? message[5] - message[4] : -1;
    if (frame != NULL) {
        m->step = frame->step;
        m->tag = frame->tag;
        m->count = frame->count;
        m->nbytes = frame->nbytes;
        m->part_offset = frame->part_offset;
        m->part_bytes = frame->part_bytes;
        m->header = malloc(frame->header_len ? frame->header_len : 1);
        if (m->header != NULL) {
            m->header_len = frame->header_len;
            memcpy(m->header, header, frame->header_len);
        }
    }
    return RC_MISMATCH;
}

static int queue_send(rc_node *node, int64_t index, const int64_t *message)
{
    rc_call *call = &node->call;
    rc_outgoing *out = node->spare; /* the pool grows to the most sends queued at once */
    if (out != NULL)
        node->spare = out->next;
    else if ((out = malloc(sizeof *out)) == NULL)
        return -1;
    int peer = (int)message[1];
    int64_t count = message[5] - message[4];
    rc_link *link = node->links[peer];
    *out = (rc_outgoing){NULL, call->slots[message[3]].base + message[4] * call->itemsize, NULL,
                         message[2], count, count * call->itemsize, 0, index, NULL, 0,
                         (message[0] & RC_MESSAGE_FAN_OUT) != 0};
    if (link->queue_last != NULL)
        link->queue_last->next = out;
    else
        link->queue = out;
    link->queue_last = out;
    if (!link->sending) {
        link->sending = 1;
        node->senders[node->n_senders++] = peer;
    }
    call->attached++;
    return 0;
}

/* The send at the head of the link's queue has left: its round may end without it. */
static void sent(rc_call *call, rc_link *link, rc_outgoing *out)
{
    link->queue = out->next;
    if (link->queue == NULL)
        link->queue_last = NULL;
    if (out->message >= 0) {
        call->progress[out->message] = -1;
        call->left--;
        call->attached--;
    }
}

/* Where the offer of `out` stands for its sender: RC_REMOTE_OFFERED while the receiver may
 * still read it (OFFERED or TAKING), RC_REMOTE_TAKEN once read; otherwise the offer is
 * dropped (withdrawn or refused, the message to be framed as DATA) and 0 is returned. */
static int offer_outcome(rc_link *link, rc_outgoing *out)
{
    int state = rc_remote_state(out);
    if (state == RC_REMOTE_OFFERED || state == RC_REMOTE_TAKING)
        return RC_REMOTE_OFFERED;
    if (state == RC_REMOTE_TAKEN)
        return RC_REMOTE_TAKEN;
    if (state == RC_REMOTE_DENIED)
        link->remote_denied = 1;
    out->offer = NULL;
    return 0;
}

/* Whether `out` goes as an offer to read it in place (remote.c): a large message of a
 * collective (remote_min, or RC_FAN_OUT_REMOTE_MIN_BYTES for a fan-out's), in the caller's
 * memory or in the overflow copy of an offer taken back, to a peer that can read this process;
 * and every point-to-point message larger than p2p_max. */
static int to_offer(const rc_node *node, const rc_link *link, const rc_outgoing *out)
{
    const rc_call *call = &node->call;
    if (out->offered || out->framed != 0)
        return 0;
    if (call->tag >= 0)
        return (uint64_t)out->nbytes > node->p2p_max;
    uint64_t least = node->remote_min;
    if (out->fan_out && least > RC_FAN_OUT_REMOTE_MIN_BYTES)
        least = RC_FAN_OUT_REMOTE_MIN_BYTES;
    return node->remote_min > 0 && (uint64_t)out->nbytes >= least
           && (out->message >= 0 || out->owned != NULL) && !link->remote_denied;
}

/* The state a new offer of the current call starts in: a point-to-point one that cannot be
 * read in place starts taken back (it only carries the header ahead of the transport's). */
static uint32_t offer_state(const rc_node *node, const rc_link *link)
{
    return node->call.tag >= 0 && (node->remote_min == 0 || link->remote_denied)
               ? RC_REMOTE_WITHDRAWN : RC_REMOTE_OFFERED;
}

/* Frames what the link's queue holds into its ring while there is room. */
static int pump(rc_node *node, int peer, rc_link *link)
{
    rc_call *call = &node->call;
    int moved = 0;
    uint64_t payload_at = rc_payload_offset(call->header_len);
    while (link->queue != NULL) {
        rc_outgoing *out = link->queue;
        if (out->offer != NULL) {
            int outcome = offer_outcome(link, out);
            if (outcome == RC_REMOTE_OFFERED)
                break; /* later messages of the link wait behind it */
            moved = 1;
            if (outcome == RC_REMOTE_TAKEN || call->tag >= 0) {
                call->rerouted |= outcome != RC_REMOTE_TAKEN;
                if (call->tag >= 0)
                    rc_mark_offering(node, node->rank, 0);
                sent(call, link, out);
                rc_outgoing_recycle(node, out);
                continue;
            }
        } else if (to_offer(node, link, out)) {
            if (!rc_remote_offer(node, peer, link, out, offer_state(node, link)))
                break;
            moved = 1;
            continue;
        }
        uint64_t part = (uint64_t)(out->nbytes - out->framed);
        part = part < call->part_max ? part : call->part_max;
        uint64_t bytes = rc_frame_bytes(call->header_len, part);
        unsigned char *at = rc_ring_reserve(&link->out, bytes);
        if (at == NULL)
            break;
        rc_frame *frame = (rc_frame *)at;
        *frame = (rc_frame){RC_FRAME_DATA, call->header_len, bytes, out->step, call->tag,
                            out->count, out->nbytes, out->framed, (int64_t)part};
        memcpy(at + sizeof(rc_frame), call->header, call->header_len);
        memcpy(at + payload_at, out->data, part);
        rc_ring_publish(&link->out, bytes);
        rc_bell_ring(node->doorbell, peer);
        moved = 1;
        out->data += part;
        out->framed += (int64_t)part; /* a message of 0 bytes goes as one frame of 0 */
        if (out->framed == out->nbytes) {
            sent(call, link, out);
            rc_outgoing_recycle(node, out);
        }
    }
    return moved;
}

static int pump_all(rc_node *node)
{
    int moved = 0;
    for (int i = 0; i < node->n_senders;) {
        int peer = node->senders[i];
        rc_link *link = node->links[peer];
        moved |= pump(node, peer, link);
        if (link->queue == NULL) {
            link->sending = 0;
            node->senders[i] = node->senders[--node->n_senders];
        } else {
            i++;
        }
    }
    return moved;
}

/* Copies a frame of another tag out of the ring, for a later receive. */
static int stash(rc_node *node, int peer, rc_link *link, const rc_frame *frame,
                 const unsigned char *at)
{
    rc_stashed *kept = malloc(sizeof *kept + frame->frame_bytes);
    if (kept == NULL) {
        snprintf(node->error, sizeof node->error, "out of memory");
        return RC_FAILED;
    }
    kept->next = NULL;
    if (frame->kind == RC_FRAME_REMOTE) /* its state would not be shared once copied */
        rc_remote_decline(node, peer, (rc_remote *)(at + rc_payload_offset(frame->header_len)));
    memcpy(kept->frame, at, frame->frame_bytes);
    memcpy(kept->frame, frame, sizeof *frame); /* the head as checked */
    if (link->stash_last != NULL)
        link->stash_last->next = kept;
    else
        link->stash = kept;
    link->stash_last = kept;
    rc_ring_release(&link->in, frame->frame_bytes);
    rc_bell_ring(node->doorbell, peer);
    return RC_PASS_PROGRESS;
}

/* The next frame of the call's tag from the link: from the stash, else from the ring (frames
 * of other tags stashed on the way). Returns 1 (and *kept when it came from the stash), 0 when
 * there is none yet, or an rc_status. */
static int next_frame(rc_node *node, int peer, rc_link *link, rc_frame *frame,
                      const unsigned char **at, rc_stashed ***kept)
{
    int64_t tag = node->call.tag;
    for (rc_stashed **p = &link->stash; *p != NULL; p = &(*p)->next) {
        if (((rc_frame *)(*p)->frame)->tag == tag) {
            memcpy(frame, (*p)->frame, sizeof *frame);
            *at = (*p)->frame;
            *kept = p;
            return 1;
        }
    }
    *kept = NULL;
    for (;;) {
        int found = rc_ring_peek(&link->in, frame, at);
        if (found < 0)
            return fail_mismatch(node, peer, "a malformed frame", NULL, NULL, NULL);
        if (found == 0 || frame->tag == tag)
            return found;
        int stashed = stash(node, peer, link, frame, *at);
        if (stashed != RC_PASS_PROGRESS)
            return stashed;
    }
}

/* Lets go of a frame that has been used: out of the stash, or released in the ring. */
static void drop_frame(rc_node *node, int peer, rc_link *link, const rc_frame *frame,
                       rc_stashed **kept)
{
    if (kept != NULL) {
        rc_stashed *used = *kept;
        *kept = used->next;
        if (link->stash_last == used) {
            link->stash_last = NULL;
            for (rc_stashed *p = link->stash; p != NULL; p = p->next)
                link->stash_last = p;
        }
        free(used);
    } else {
        rc_ring_release(&link->in, frame->frame_bytes);
        rc_bell_ring(node->doorbell, peer);
    }
}

/* Takes what has arrived for receive `index` of the round. */
static int receive(rc_node *node, int64_t index, const int64_t *message)
{
    rc_call *call = &node->call;
    int peer = (int)message[1];
    rc_link *link = node->links[peer];
    int64_t count = message[5] - message[4], nbytes = count * call->itemsize;
    int moved = 0;
    while (call->progress[index] >= 0) {
        rc_frame frame;
        const unsigned char *at;
        rc_stashed **kept;
        int found = next_frame(node, peer, link, &frame, &at, &kept);
        if (found != 1)
            return found == 0 ? (moved ? RC_PASS_PROGRESS : RC_PASS_IDLE) : found;
        const unsigned char *header = at + sizeof(rc_frame);
        if (frame.header_len != call->header_len
                || memcmp(header, call->header, call->header_len) != 0)
            return fail_mismatch(node, peer, "header", &frame, header, message);
        if (frame.step != message[2] || frame.count != count)
            return fail_mismatch(node, peer, frame.step != message[2] ? "step" : "count", &frame,
                                 header, message);
        int64_t received = call->progress[index], part = frame.part_bytes;
        if (frame.kind == RC_FRAME_REMOTE) {
            if (frame.nbytes != nbytes || frame.part_offset != 0 || received != 0
                    || part != (int64_t)sizeof(rc_remote))
                return fail_mismatch(node, peer, "part", &frame, header, message);
            rc_remote *offer = (rc_remote *)(at + rc_payload_offset(frame.header_len));
            int taken = rc_remote_take(node, peer, link, offer,
                                       call->slots[message[3]].base
                                       + message[4] * call->itemsize, nbytes,
                                       message[0] & RC_MESSAGE_REDUCE ? call->kernel : NULL,
                                       call->itemsize, kept != NULL);
            if (taken < 0)
                return moved ? RC_PASS_PROGRESS : RC_PASS_IDLE;
            drop_frame(node, peer, link, &frame, kept);
            moved = 1;
            if (taken == 1 || call->tag >= 0) {
                call->rerouted |= taken != 1;
                if (taken == 1 && call->tag >= 0) /* its sender's send is over */
                    rc_mark_offering(node, peer, 0);
                call->progress[index] = -1;
                call->left--;
            }
            continue;
        }
        if (frame.nbytes != nbytes || frame.part_offset != received || part % call->itemsize
                || part > nbytes - received || (part == 0 && nbytes != 0))
            return fail_mismatch(node, peer, "part", &frame, header, message);
        unsigned char *target = call->slots[message[3]].base + message[4] * call->itemsize
                                + received;
        const unsigned char *payload = at + rc_payload_offset(frame.header_len);
        if (message[0] & RC_MESSAGE_REDUCE)
            call->kernel(target, payload, part / call->itemsize, 1, 1);
        else
            memcpy(target, payload, (size_t)part);
        drop_frame(node, peer, link, &frame, kept);
        moved = 1;
        received += part;
        if (received == nbytes) {
            call->progress[index] = -1;
            call->left--;
        } else {
            call->progress[index] = received;
        }
    }
    return RC_PASS_PROGRESS;
}

static int post_round(rc_node *node)
{
    rc_call *call = &node->call;
    const int64_t *record = call->code + call->pc;
    call->round = record + 2;
    call->round_size = call->left = record[1];
    call->pc += rc_step_words(record);
    call->steps_left--;
    for (int64_t m = 0; m < call->round_size; m++) {
        const int64_t *message = call->round + m * RC_MESSAGE_WORDS;
        call->progress[m] = 0;
        if ((message[0] & RC_MESSAGE_SEND) && queue_send(node, m, message) != 0) {
            snprintf(node->error, sizeof node->error, "out of memory");
            return RC_FAILED;
        }
    }
    return RC_PASS_PROGRESS;
}

/* One pass over everything pending; returns RC_PASS_IDLE, RC_PASS_PROGRESS or an rc_status. */
int rc_pass(rc_node *node)
{
    rc_call *call = &node->call;
    int moved = 0;
    for (;;) {
        moved |= pump_all(node);
        if (call->round != NULL) {
            uint64_t stamp = ++node->pass;
            for (int64_t m = 0; m < call->round_size; m++) {
                const int64_t *message = call->round + m * RC_MESSAGE_WORDS;
                int peer = (int)message[1];
                if (call->progress[m] < 0 || (message[0] & RC_MESSAGE_SEND)
                        || node->blocked[peer] == stamp)
                    continue;
                int got = receive(node, m, message);
                if (got >= 0)
                    return got;
                moved |= got == RC_PASS_PROGRESS;
                if (call->progress[m] >= 0)
                    node->blocked[peer] = stamp; /* later receives from it wait their turn */
            }
            if (call->left != 0)
                return moved ? RC_PASS_PROGRESS : RC_PASS_IDLE;
            call->round = NULL;
        }
        while (call->steps_left > 0 && call->code[call->pc] == RC_STEP_LOCAL) {
            if (rc_program_local(call, call->code + call->pc) != 0) {
                snprintf(node->error, sizeof node->error, "out of memory");
                return RC_FAILED;
            }
            call->pc += rc_step_words(call->code + call->pc);
            call->steps_left--;
        }
        if (call->steps_left == 0 && node->n_senders == 0)
            return call->rerouted ? RC_REROUTED : RC_DONE;
        if (call->steps_left == 0)
            return moved ? RC_PASS_PROGRESS : RC_PASS_IDLE;
        if (post_round(node) == RC_FAILED)
            return RC_FAILED;
        moved = 1;
    }
}

/* Copies what the round's sends have not framed yet into overflow memory. */
int rc_detach(rc_node *node, int offers_too)
{
    rc_call *call = &node->call;
    int detached = 0;
    for (int i = 0; i < node->n_senders; i++) {
        rc_link *link = node->links[node->senders[i]];
        for (rc_outgoing *out = link->queue; out; out = out->next) {
            if (out->message < 0)
                continue;
            if (out->offer != NULL) {
                int withdrawn = offers_too && rc_remote_withdraw(out, 0);
                if (!withdrawn && offer_outcome(link, out) != 0)
                    continue; /* still offered, being read, or read: the pump finishes it */
            }
            if (out->offer != NULL)
                out->offered = 0; /* taken back: its copy is offered in its place */
            out->offer = NULL;
            detached = 1;
            size_t rest = (size_t)(out->nbytes - out->framed);
            if (rest != 0) {
                out->owned = malloc(rest);
                if (out->owned == NULL) {
                    snprintf(node->error, sizeof node->error, "out of memory");
                    return RC_FAILED;
                }
                memcpy(out->owned, out->data, rest);
                out->data = out->owned;
            }
            call->progress[out->message] = -1;
            call->left--;
            call->attached--;
            out->message = -1;
        }
    }
    return detached ? RC_PASS_PROGRESS : RC_PASS_IDLE;
}

int rc_reroute_offers(rc_node *node)
{
    int withdrawn = 0;
    for (int i = 0; i < node->n_senders; i++) {
        rc_link *link = node->links[node->senders[i]];
        for (rc_outgoing *out = link->queue; out; out = out->next)
            if (out->offer != NULL && rc_remote_withdraw(out, 0))
                withdrawn = 1; /* the pump sees it taken back and ends the send */
    }
    return withdrawn ? RC_PASS_PROGRESS : RC_PASS_IDLE;
}

int rc_offers_cross(rc_node *node)
{
    int crossed = 0;
    for (int i = 0; i < node->n_senders; i++) {
        int peer = node->senders[i];
        rc_link *link = node->links[peer];
        if (link->queue == NULL || link->queue->offer == NULL)
            continue;
        /* The peer sends to this rank first: decline its offer, so both go side by side. */
        rc_frame frame;
        const unsigned char *at;
        if (link->in.control != NULL && rc_ring_peek(&link->in, &frame, &at) == 1
                && frame.kind == RC_FRAME_REMOTE && frame.tag >= 0) {
            rc_remote *offer = (rc_remote *)(at + rc_payload_offset(frame.header_len));
            if (atomic_load_explicit(&offer->state, memory_order_acquire)
                    == RC_REMOTE_OFFERED) {
                rc_remote_decline(node, peer, offer);
                crossed = 1;
                continue;
            }
        }
        crossed |= atomic_load_explicit(&node->doorbell->bells[peer].offering,
                                        memory_order_acquire) != 0;
    }
    return crossed;
}

/* A first frame of this call's tag and number whose header differs from ours. */
int rc_early_mismatch(rc_node *node)
{
    rc_call *call = &node->call;
    const uint32_t end = RC_HEADER_SEQ_OFFSET + 8;
    /* Only collective numbers are shared by every rank; point-to-point ones count per peer. */
    if (call->tag >= 0 || call->header_len < end)
        return RC_PASS_IDLE;
    for (int i = 0; i < node->n_receiving; i++) {
        int peer = node->receiving[i];
        rc_link *link = node->links[peer];
        rc_frame frame;
        const unsigned char *at;
        int found = rc_ring_peek(&link->in, &frame, &at);
        if (found < 0)
            return fail_mismatch(node, peer, "a malformed frame", NULL, NULL, NULL);
        const unsigned char *header = at + sizeof(rc_frame);
        if (found == 1 && frame.tag == call->tag && frame.header_len >= end
                && memcmp(header + RC_HEADER_SEQ_OFFSET, call->header + RC_HEADER_SEQ_OFFSET,
                          8) == 0
                && (frame.header_len != call->header_len
                    || memcmp(header, call->header, call->header_len) != 0))
            return fail_mismatch(node, peer, "header", &frame, header, NULL);
    }
    return RC_PASS_IDLE;
}
