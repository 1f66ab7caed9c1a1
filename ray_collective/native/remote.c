/* Single-copy reads of large messages between the ranks of a node.
 *
 * Through the ring a message is copied twice: into the ring by its sender, out of it by its
 * receiver. For a large message of a collective, the sender instead frames a REMOTE frame
 * whose payload says where the message lies in its own memory, and the receiver copies it
 * from there into its place with process_vm_readv: one copy, as MPI's CMA path does. A
 * receive that reduces reads the message a piece at a time into a scratch buffer that stays in
 * cache, and reduces each piece from there.
 *
 * The offer's state word lives in the frame, in the ring both processes map, and settles who
 * holds the message (RC_REMOTE_* in node.h), with compare-and-swaps only:
 * - the receiver moves OFFERED to TAKING, reads, then TAKING to TAKEN; the sender's send is
 *   done once it sees TAKEN (its memory is no longer read);
 * - the sender may take an offer back while it is OFFERED (WITHDRAWN: a stalled round detaches
 *   its sends, executor.c), and then frames the message as DATA parts after it;
 * - a point-to-point message (tag >= 0) larger than the node's p2p_max goes only this way: a
 *   send waits a grace for its receiver (progress.c), then takes its offer back (at once
 *   where the receiver's own offer to it waits in its ring: rc_offers_cross); whatever
 *   ends an offer other than TAKEN, both ends then move the message over their transport
 *   (RC_REROUTED), so a send never waits for its receiver for long, whatever its size. While
 *   such a send waits, its rank's bell says so (`offering`, cleared by the rank or by its
 *   reader once TAKEN): a rank that sends to it takes its own offer back at once, since the
 *   rank cannot read before its own send ends (a ring of ranks that all send first). Where
 *   this process cannot be read (remote reads off, or DENIED before), the offer is framed
 *   WITHDRAWN at once: it only carries the header ahead, which the receiver checks;
 * - the receiver may refuse it (DECLINED: a frame met by another channel's call and stashed;
 *   DENIED: this process may not read the sender's, and the sender offers
 *   that peer nothing more), and the DATA parts follow likewise;
 * - a sender that abandons its call while the receiver reads moves TAKING to POISONED and
 *   returns: the receiver's TAKING to TAKEN then fails and it throws away what it read.
 *
 * The receiver first checks it reads the right process: the sender's node holds a random
 * cookie, whose value and address the offer carries; a process reached through another PID
 * namespace, or a reused PID, does not have it there. Reading another process needs the
 * kernel's ptrace permission (same user; Yama's ptrace_scope 0, or CAP_SYS_PTRACE): where it
 * is refused, the offer is DENIED and the messages go through the ring, as before.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "node.h"

static int swap(rc_remote *offer, uint32_t from, uint32_t to)
{
    return atomic_compare_exchange_strong_explicit(&offer->state, &from, to,
                                                   memory_order_acq_rel, memory_order_acquire);
}

int rc_remote_offer(rc_node *node, int peer, rc_link *link, rc_outgoing *out, uint32_t state)
{
    rc_call *call = &node->call;
    uint64_t bytes = rc_frame_bytes(call->header_len, sizeof(rc_remote));
    unsigned char *at = rc_ring_reserve(&link->out, bytes);
    if (at == NULL)
        return 0;
    rc_frame *frame = (rc_frame *)at;
    *frame = (rc_frame){RC_FRAME_REMOTE, call->header_len, bytes, out->step, call->tag,
                        out->count, out->nbytes, 0, (int64_t)sizeof(rc_remote)};
    memcpy(at + sizeof(rc_frame), call->header, call->header_len);
    rc_remote *offer = (rc_remote *)(at + rc_payload_offset(call->header_len));
    offer->unused = 0;
    offer->pid = node->pid;
    offer->address = (uint64_t)(uintptr_t)out->data;
    offer->cookie = node->cookie;
    offer->cookie_address = (uint64_t)(uintptr_t)&node->cookie;
    atomic_store_explicit(&offer->state, state, memory_order_relaxed);
    if (call->tag >= 0 && state == RC_REMOTE_OFFERED) /* before its reader can clear it */
        rc_mark_offering(node, node->rank, 1);
    rc_ring_publish(&link->out, bytes);
    rc_bell_ring(node->doorbell, peer);
    out->offer = offer;
    out->offered = 1;
    return 1;
}

int rc_remote_state(const rc_outgoing *out)
{
    return (int)atomic_load_explicit(&out->offer->state, memory_order_acquire);
}

int rc_remote_withdraw(rc_outgoing *out, int abandon)
{
    if (swap(out->offer, RC_REMOTE_OFFERED, RC_REMOTE_WITHDRAWN))
        return 1;
    if (abandon && swap(out->offer, RC_REMOTE_TAKING, RC_REMOTE_POISONED))
        return 1;
    return 0;
}

/* Reads `nbytes` at `address` of process `pid` into `target`: 0, or the errno that stopped it. */
static int read_process(int64_t pid, unsigned char *target, uint64_t address, int64_t nbytes)
{
    int64_t done = 0;
    while (done < nbytes) {
        struct iovec local = {target + done, (size_t)(nbytes - done)};
        struct iovec remote = {(void *)(uintptr_t)(address + (uint64_t)done),
                               (size_t)(nbytes - done)};
        ssize_t got = process_vm_readv((pid_t)pid, &local, 1, &remote, 1, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (got == 0)
            return EFAULT;
        done += got;
    }
    return 0;
}

/* Reduces the offered message into `target` a piece at a time, each piece read into the
 * node's scratch (which stays in cache) first: 0, or the errno that stopped it. Only the first
 * piece may fail with EPERM (the cookie was read already): a later failure leaves `target`
 * partly reduced, and the caller then ends the call as a failure, never as DATA frames. */
static int read_and_reduce(rc_node *node, const rc_remote *offer, unsigned char *target,
                           int64_t nbytes, rc_kernel kernel, int itemsize)
{
    if (node->remote_scratch == NULL
            && (node->remote_scratch = malloc(RC_REMOTE_PIECE_BYTES)) == NULL)
        return ENOMEM;
    for (int64_t done = 0; done < nbytes; done += RC_REMOTE_PIECE_BYTES) {
        int64_t piece = nbytes - done < RC_REMOTE_PIECE_BYTES ? nbytes - done
                                                               : RC_REMOTE_PIECE_BYTES;
        int failed = read_process(offer->pid, node->remote_scratch,
                                  offer->address + (uint64_t)done, piece);
        if (failed != 0)
            return done == 0 ? failed : EFAULT;
        kernel(target + done, node->remote_scratch, piece / itemsize, 1, 1);
    }
    return 0;
}

/* Whether the offer's process is the sender's node (its cookie where the offer says). */
static int verified(rc_link *link, const rc_remote *offer)
{
    if (link->verified_pid == offer->pid && link->verified_cookie == offer->cookie)
        return 1;
    uint64_t cookie = 0;
    if (offer->pid <= 0 || read_process(offer->pid, (unsigned char *)&cookie,
                                        offer->cookie_address, sizeof cookie) != 0
            || cookie != offer->cookie)
        return 0;
    link->verified_pid = offer->pid;
    link->verified_cookie = cookie;
    return 1;
}

void rc_remote_decline(rc_node *node, int peer, rc_remote *offer)
{
    if (swap(offer, RC_REMOTE_OFFERED, RC_REMOTE_DECLINED))
        rc_bell_ring(node->doorbell, peer);
}

int rc_remote_take(rc_node *node, int peer, rc_link *link, rc_remote *offer,
                   unsigned char *target, int64_t nbytes, rc_kernel kernel, int itemsize,
                   int stashed)
{
    uint32_t state = atomic_load_explicit(&offer->state, memory_order_acquire);
    if (stashed || state == RC_REMOTE_WITHDRAWN || state == RC_REMOTE_DECLINED
            || state == RC_REMOTE_DENIED)
        return 0; /* a stashed offer was declined when it was stashed */
    if (state != RC_REMOTE_OFFERED)
        return -1; /* this rank's read failed before: the call ends by a failure check */
    if (!verified(link, offer)) {
        if (swap(offer, RC_REMOTE_OFFERED, RC_REMOTE_DENIED))
            rc_bell_ring(node->doorbell, peer);
        return 0;
    }
    if (!swap(offer, RC_REMOTE_OFFERED, RC_REMOTE_TAKING))
        return 0; /* withdrawn meanwhile */
    int failed = kernel == NULL ? read_process(offer->pid, target, offer->address, nbytes)
                                : read_and_reduce(node, offer, target, nbytes, kernel,
                                                  itemsize);
    if (failed == EPERM || failed == EACCES || failed == ENOSYS) {
        if (!swap(offer, RC_REMOTE_TAKING, RC_REMOTE_DENIED))
            return -1;
        rc_bell_ring(node->doorbell, peer);
        return 0;
    }
    /* Another error (the sender died, or freed the memory after poisoning the offer) leaves
     * it TAKING: the rank's failure check names the dead peer or the abort. */
    if (failed != 0 || !swap(offer, RC_REMOTE_TAKING, RC_REMOTE_TAKEN))
        return -1;
    rc_bell_ring(node->doorbell, peer);
    node->remote_reads++;
    return 1;
}
