/* Waiting: rc_progress runs passes of the executor until the call is over, the slice ends or
 * an alarm rang, and decides what a rank does while nothing moves.
 *
 * After a pass without progress the rank polls for spin_ns, yielding its core between polls
 * (sched_yield; for the first RC_BUSY_POLL_NS not yielding it, where busy_poll allows), then
 * sleeps on its doorbell (shm.c) until a peer publishes a frame or frees
 * room, the slice ends, or an alarm (rc_wake_all) rings. It polls again only once the call
 * has moved: not at every slice of a long wait, nor after a wake-up that brought nothing (48
 * ranks waiting in a barrier each burnt 10 ms of CPU a second re-polling at every slice). A rank whose round still has sends in
 * the caller's memory sleeps at most DETACH_GRACE_NS first; if that brought nothing either, the
 * sends are detached into overflow memory (executor.c), which keeps bounded rings free of
 * deadlocks whatever the plan; not in the call's last round with messages, where nothing
 * waits on the round to end (executor.c). A large message offered to be read in place (remote.c) is
 * taken back and detached so only once the stall has lasted OFFER_GRACE_NS; one of a
 * point-to-point send is taken back after P2P_OFFER_GRACE_NS (its message then goes over the
 * transport: remote.c).
 *
 * Why yield rather than pause between polls: where ranks outnumber cores, a rank that spins on
 * the core its peer needs delays the peer by the whole spin. Measured on the shared 2-core
 * machine (8-byte allreduce, 2 ranks, p50): a pause loop of 20 us made a call 48 us (2 us:
 * 11 us), against 7 us sleeping at once; polls separated by sched_yield made it 1.3-5 us:
 * 1.3 us with the two ranks on two CPUs, 5.6 us on one. Ranks on CPUs of their own gain by
 * not yielding at first (0.64-0.9 us), as long as each polls only while the peers it waits
 * for last waited elsewhere (busy_poll). */
#define _GNU_SOURCE
#include <sched.h>
#include <time.h>

#include "node.h"

#define DETACH_GRACE_NS 1000000
/* An offer to read a large message in place (remote.c) is taken back only after a longer
 * stall: a receiver a scheduler's time slice late should still read it in one copy. */
#define OFFER_GRACE_NS 20000000
/* How long a point-to-point send waits for its receiver to read its offer (a large message,
 * remote.c) before it takes it back and the message goes over the transport: time enough for a
 * receiver that already waits to wake up and begin reading; a send that its receiver meets
 * only later costs this much more than the transport alone. A send whose receiver waits in a
 * send of its own does not wait it out (rc_offers_cross). */
#define P2P_OFFER_GRACE_NS 1000000

int64_t rc_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int alarmed(rc_node *node)
{
    uint32_t alarm = atomic_load_explicit(&node->doorbell->alarm, memory_order_acquire);
    if (alarm == node->seen_alarm)
        return 0;
    node->seen_alarm = alarm;
    return 1;
}

/* Whether the current round's messages are small (RC_BUSY_POLL_MAX_BYTES) and the peers it
 * still waits for last waited on other CPUs than `cpu` (1 + this rank's), as their bells
 * say: a rank polling without yielding would otherwise hold the CPU the peer needs. */
static int small_and_elsewhere(rc_node *node, uint32_t cpu)
{
    const rc_call *call = &node->call;
    if (call->round == NULL)
        return 0;
    for (int64_t m = 0; m < call->round_size; m++) {
        const int64_t *message = call->round + m * RC_MESSAGE_WORDS;
        if ((message[5] - message[4]) * call->itemsize > RC_BUSY_POLL_MAX_BYTES)
            return 0;
        if (call->progress[m] < 0)
            continue;
        int peer = (int)message[1];
        uint32_t theirs = atomic_load_explicit(&node->doorbell->bells[peer].cpu,
                                               memory_order_relaxed);
        if (theirs == 0 || theirs == cpu)
            return 0;
    }
    return 1;
}

/* Whether to poll again at once, not yielding the core: for node->busy_poll_ns from the first
 * look (*until, 0 before), while small_and_elsewhere holds. The first look
 * records this rank's CPU in its bell. */
static int busy_poll(rc_node *node, int64_t *until, int64_t now)
{
    if (node->busy_poll_ns <= 0)
        return 0;
    rc_bell *bell = &node->doorbell->bells[node->rank];
    uint32_t cpu = atomic_load_explicit(&bell->cpu, memory_order_relaxed);
    if (*until == 0) {
        *until = now + node->busy_poll_ns;
        uint32_t here = (uint32_t)sched_getcpu() + 1;
        if (here != cpu) /* written only when it changed: posters read this line */
            atomic_store_explicit(&bell->cpu, cpu = here, memory_order_relaxed);
    }
    if (now >= *until || !small_and_elsewhere(node, cpu))
        return 0;
    rc_cpu_relax();
    return 1;
}

/* What a pass's result means for rc_progress: a status to return, or -1 to go on. */
static int settle(rc_node *node, int result)
{
    if (result == RC_DONE || result == RC_REROUTED)
        node->call.active = 0;
    if (result == RC_MISMATCH || result == RC_FAILED)
        rc_call_end(node);
    return result >= 0 ? result : -1;
}

int rc_progress_started(rc_node *node)
{
    /* An alarm is left for rc_progress to take: the call goes back to its caller at once. */
    if (atomic_load_explicit(&node->doorbell->alarm, memory_order_acquire) != node->seen_alarm)
        return RC_PENDING;
    int result;
    do
        result = rc_pass(node);
    while (result == RC_PASS_PROGRESS);
    return settle(node, result) >= 0 ? result : RC_PENDING;
}

int rc_progress(rc_node *node, int64_t slice_ns)
{
    rc_call *call = &node->call;
    int64_t deadline = rc_now_ns() + slice_ns, spin_until = 0, busy_until = 0;
    int result = RC_PASS_IDLE;
    for (;;) {
        if (result == RC_PASS_PROGRESS) {
            spin_until = busy_until = 0;
            call->spun = 0;
            call->detach_armed = 0;
            call->stalled_since = 0;
        }
        if (alarmed(node))
            return RC_PENDING;
        result = rc_pass(node);
        if (result == RC_PASS_PROGRESS)
            continue;
        if (settle(node, result) >= 0)
            return result;
        int64_t now = rc_now_ns();
        if (now >= deadline)
            return RC_PENDING;
        /* Before polling: two ranks that both send first gain nothing by waiting. */
        if (call->tag >= 0 && call->attached > 0 && rc_offers_cross(node)
                && rc_reroute_offers(node) == RC_PASS_PROGRESS)
            continue;
        if (!call->spun && busy_poll(node, &busy_until, now))
            continue;
        if (rc_spin_on(node->spin_ns, &call->spun, &spin_until, now))
            continue;
        int64_t timeout = deadline - now;
        if (call->attached > 0 && !rc_in_last_round(call)) {
            if (call->stalled_since == 0)
                call->stalled_since = now;
            if (call->detach_armed) {
                result = rc_detach(node, now - call->stalled_since >= OFFER_GRACE_NS);
                if (settle(node, result) >= 0)
                    return result;
                /* Nothing to detach (offers wait for their readers): wait the grace again
                 * rather than retry at once. */
                call->detach_armed = result == RC_PASS_PROGRESS;
                continue;
            }
            call->detach_armed = 1;
            timeout = timeout < DETACH_GRACE_NS ? timeout : DETACH_GRACE_NS;
        } else if (call->attached > 0 && call->tag >= 0) {
            if (call->stalled_since == 0)
                call->stalled_since = now;
            int64_t grace_left = call->stalled_since + P2P_OFFER_GRACE_NS - now;
            if (grace_left <= 0 && rc_reroute_offers(node) == RC_PASS_PROGRESS)
                continue;
            if (grace_left > 0 && grace_left < timeout)
                timeout = grace_left;
        }
        result = rc_early_mismatch(node);
        if (settle(node, result) >= 0)
            return result;
        uint32_t armed = rc_bell_arm(node->doorbell, node->rank);
        int alarm = alarmed(node);
        result = alarm ? RC_PASS_IDLE : rc_pass(node);
        if (!alarm && result == RC_PASS_IDLE)
            rc_bell_wait(node->doorbell, node->rank, armed, timeout);
        rc_bell_disarm(node->doorbell, node->rank);
        if (alarm)
            return RC_PENDING;
        if (settle(node, result) >= 0)
            return result;
        spin_until = 0;
    }
}
