/* A rank's node: its doorbell and links, opened once; the rings of a peer, opened at the first
 * call that names the peer; a call's start (checking its code, choosing its part size) and its
 * end; the alarm. The call itself runs in executor.c and progress.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "node.h"

#define MIN_RING_BYTES 1024

int rc_node_open(rc_node *node, int dirfd, int rank, int world, uint64_t ring_bytes,
                 uint64_t part_bytes, int64_t spin_ns, uint64_t remote_min)
{
    memset(node, 0, sizeof *node);
    node->dirfd = dirfd;
    if (world < 1 || rank < 0 || rank >= world || ring_bytes < MIN_RING_BYTES
            || ring_bytes % (2 * RC_LINE) != 0 || part_bytes < 16 || spin_ns < 0) {
        snprintf(node->error, sizeof node->error,
                 "need 0 <= rank < world_size, ring_bytes a multiple of %d and at least %d, "
                 "part_bytes at least 16, spin_ns >= 0", 2 * RC_LINE, MIN_RING_BYTES);
        return RC_INVALID;
    }
    node->rank = rank;
    node->world = world;
    node->ring_bytes = ring_bytes;
    node->part_bytes = part_bytes;
    node->spin_ns = spin_ns;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    node->busy_poll_ns = world <= cores ? (spin_ns < RC_BUSY_POLL_NS ? spin_ns : RC_BUSY_POLL_NS)
                                        : 0;
    node->remote_min = remote_min;
    node->p2p_max = ring_bytes / 4 < RC_P2P_MAX_BYTES ? ring_bytes / 4 : RC_P2P_MAX_BYTES;
    node->pid = (int64_t)getpid();
    if (remote_min > 0 && getrandom(&node->cookie, sizeof node->cookie, 0)
            != (ssize_t)sizeof node->cookie) {
        snprintf(node->error, sizeof node->error, "getrandom: no cookie for remote reads");
        return RC_OS_ERROR;
    }
    node->doorbell_bytes = (size_t)RC_LINE * (1 + (size_t)world);
    void *map = NULL;
    const char *failed = rc_map_file(dirfd, "doorbell", node->doorbell_bytes, &map);
    if (failed != NULL) {
        snprintf(node->error, sizeof node->error, "doorbell: %s", failed);
        return RC_OS_ERROR;
    }
    node->doorbell = map;
    node->seen_alarm = atomic_load(&node->doorbell->alarm);
    node->links = calloc((size_t)world, sizeof *node->links);
    node->senders = malloc(sizeof(int) * (size_t)world);
    node->receiving = malloc(sizeof(int) * (size_t)world);
    node->blocked = calloc((size_t)world, sizeof *node->blocked);
    if (!node->links || !node->senders || !node->receiving || !node->blocked) {
        errno = ENOMEM;
        snprintf(node->error, sizeof node->error, "out of memory");
        return RC_OS_ERROR;
    }
    return RC_OK;
}

void rc_outgoing_recycle(rc_node *node, rc_outgoing *out)
{
    free(out->owned);
    out->owned = NULL;
    out->next = node->spare;
    node->spare = out;
}

void rc_call_end(rc_node *node)
{
    for (int i = 0; i < node->n_senders; i++) {
        rc_link *link = node->links[node->senders[i]];
        while (link->queue != NULL) {
            rc_outgoing *out = link->queue;
            link->queue = out->next;
            /* The caller may reuse its memory at once: no peer may read it any more. */
            if (out->offer != NULL)
                rc_remote_withdraw(out, 1);
            rc_outgoing_recycle(node, out);
        }
        link->queue_last = NULL;
        link->sending = 0;
    }
    node->n_senders = 0;
    if (node->doorbell != NULL)
        rc_mark_offering(node, node->rank, 0);
    node->call.active = 0;
    node->call.round = NULL;
    node->call.left = node->call.attached = 0;
}

void rc_node_close(rc_node *node)
{
    rc_call_end(node);
    for (int peer = 0; node->links != NULL && peer < node->world; peer++) {
        rc_link *link = node->links[peer];
        if (link == NULL)
            continue;
        rc_ring_close(&link->out);
        rc_ring_close(&link->in);
        while (link->stash != NULL) {
            rc_stashed *next = link->stash->next;
            free(link->stash);
            link->stash = next;
        }
        free(link);
    }
    while (node->spare != NULL) {
        rc_outgoing *next = node->spare->next;
        free(node->spare);
        node->spare = next;
    }
    if (node->doorbell != NULL)
        munmap(node->doorbell, node->doorbell_bytes);
    if (node->dirfd >= 0)
        close(node->dirfd);
    rc_call *call = &node->call;
    free(call->slots);
    free(call->header);
    free(call->progress);
    free(node->mismatch.header);
    free(node->remote_scratch);
    free(node->links);
    free(node->senders);
    free(node->receiving);
    free(node->blocked);
    memset(node, 0, sizeof *node);
    node->dirfd = -1;
}

static rc_link *link_to(rc_node *node, int peer)
{
    if (node->links[peer] == NULL)
        node->links[peer] = calloc(1, sizeof(rc_link));
    return node->links[peer];
}

/* Opens the rings of every peer the call names that this rank has not used yet. */
static int open_rings(rc_node *node)
{
    const rc_program *program = node->call.program;
    for (int i = 0; i < program->n_peers; i++) {
        int peer = program->peers[i].rank;
        uint8_t use = program->peers[i].use;
        rc_link *link = link_to(node, peer);
        if (link == NULL) {
            errno = ENOMEM;
            snprintf(node->error, sizeof node->error, "out of memory");
            return RC_OS_ERROR;
        }
        const char *failed = NULL;
        int src = node->rank, dst = peer;
        if ((use & RC_USE_SEND) && link->out.control == NULL) {
            failed = rc_ring_open(&link->out, node->dirfd, src, dst, node->ring_bytes, 1);
            if (failed == NULL) /* after the file exists: its reader's next scan finds it */
                atomic_fetch_add_explicit(&node->doorbell->bells[dst].rings_made, 1,
                                          memory_order_release);
        }
        if (failed == NULL && (use & RC_USE_RECEIVE) && link->in.control == NULL) {
            src = peer;
            dst = node->rank;
            failed = rc_ring_open(&link->in, node->dirfd, src, dst, node->ring_bytes, 0);
            if (failed == NULL)
                node->receiving[node->n_receiving++] = peer;
        }
        if (failed != NULL) {
            snprintf(node->error, sizeof node->error, "ring-%d-%d: %s", src, dst, failed);
            return RC_OS_ERROR;
        }
    }
    return RC_OK;
}

int rc_scan_incoming(rc_node *node)
{
    uint32_t made = atomic_load_explicit(&node->doorbell->bells[node->rank].rings_made,
                                         memory_order_acquire);
    if (made == node->rings_seen)
        return RC_OK;
    /* Taken before the scan: a ring made during it bumps the count again for the next one. */
    node->rings_seen = made;
    for (int peer = 0; peer < node->world; peer++) {
        rc_link *link = node->links[peer];
        if (peer == node->rank || (link != NULL && link->in.control != NULL))
            continue;
        char name[64];
        struct stat st;
        snprintf(name, sizeof name, "ring-%d-%d", peer, node->rank);
        if (fstatat(node->dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
            continue; /* the peer never sent to this rank */
        link = link_to(node, peer);
        if (link == NULL) {
            errno = ENOMEM;
            snprintf(node->error, sizeof node->error, "out of memory");
            return RC_OS_ERROR;
        }
        const char *failed = rc_ring_open(&link->in, node->dirfd, peer, node->rank,
                                          node->ring_bytes, 0);
        if (failed != NULL) {
            snprintf(node->error, sizeof node->error, "ring-%d-%d: %s", peer, node->rank,
                     failed);
            return RC_OS_ERROR;
        }
        node->receiving[node->n_receiving++] = peer;
    }
    return RC_OK;
}

#define REFUSE(...) do { snprintf(node->error, sizeof node->error, __VA_ARGS__); \
    return RC_INVALID; } while (0)

/* Whether the call's slots and this node's world are what its program needs. */
static int check_call(rc_node *node)
{
    const rc_call *call = &node->call;
    const rc_program *program = call->program;
    if (program->n_peers > 0) {
        int highest = program->peers[program->n_peers - 1].rank;
        if (highest >= node->world)
            REFUSE("a message names rank %d (this is rank %d of %d)", highest, node->rank,
                   node->world);
        for (int i = 0; i < program->n_peers; i++)
            if (program->peers[i].rank == node->rank)
                REFUSE("a message names rank %d (this is rank %d of %d)", node->rank,
                       node->rank, node->world);
    }
    if (program->n_slots > call->n_slots)
        REFUSE("the plan names slot %d of %d", program->n_slots - 1, call->n_slots);
    for (int slot = 0; slot < program->n_slots; slot++) {
        const rc_slot_need *need = &program->slot_needs[slot];
        if (need->count > call->slots[slot].count)
            REFUSE("the plan reaches elements %lld..%lld of slot %d, which has %lld",
                   (long long)need->low, (long long)need->high, slot,
                   (long long)call->slots[slot].count);
        if (need->written && !call->slots[slot].writable)
            REFUSE("the plan writes into slot %d, which is read-only", slot);
    }
    return RC_OK;
}

int rc_call_start(rc_node *node)
{
    rc_call *call = &node->call;
    if (check_call(node) != RC_OK)
        return RC_INVALID;
    int64_t biggest = call->program->biggest;
    uint64_t half = node->ring_bytes / 2, payload = rc_payload_offset(call->header_len);
    if (payload + 16 > half) {
        snprintf(node->error, sizeof node->error,
                 "ring_bytes %llu is too small for frames with a call header of %u bytes",
                 (unsigned long long)node->ring_bytes, call->header_len);
        return RC_INVALID;
    }
    uint64_t part = node->part_bytes < half - payload ? node->part_bytes : half - payload;
    call->part_max = part & ~(uint64_t)15; /* a multiple of every itemsize */
    int opened = open_rings(node);
    if (opened != RC_OK)
        return opened;
    if (biggest > call->progress_capacity) {
        int64_t *progress = realloc(call->progress, sizeof(int64_t) * (size_t)biggest);
        if (progress == NULL) {
            errno = ENOMEM;
            snprintf(node->error, sizeof node->error, "out of memory");
            return RC_OS_ERROR;
        }
        call->progress = progress;
        call->progress_capacity = biggest;
    }
    call->pc = 1;
    call->steps_left = call->code[0];
    call->round = NULL;
    call->left = call->attached = 0;
    call->detach_armed = 0;
    call->stalled_since = 0;
    call->spun = 0;
    call->rerouted = 0;
    call->active = 1;
    return RC_OK;
}

void rc_wake_all(rc_node *node)
{
    rc_alarm(node->doorbell, node->world);
}
