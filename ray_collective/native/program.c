/* The plan code: a recorded plan (ray_collective.engine.plan.Plan) as int64 words, written by
 * codes.encode_plan, checked here before a call runs anything, and its local steps.
 *
 * Layout: code[0] is the number of steps, then one record per step:
 *   ROUND  RC_STEP_ROUND, n, then n messages of RC_MESSAGE_WORDS words: flags
 *          (RC_MESSAGE_SEND, RC_MESSAGE_REDUCE), peer, step, slot, start, stop (elements);
 *   LOCAL  RC_STEP_LOCAL, kind (RC_LOCAL_COPY or RC_LOCAL_COMBINE), the target place, the
 *          source place; a place is slot, offset, ndim, shape[ndim], strides[ndim] (elements,
 *          strides possibly negative), a contiguous Place being ndim 1, stride 1.
 * The code is checked once, when a program is built from it (rc_program_build): it is refused
 * if malformed or if it reduces in a call without an op, and what it reaches is noted (the
 * elements of each slot, the slots it writes, the peers it talks to), so that starting a call
 * of it checks only that the call's slots are that large and writable, and its peers in the
 * node's world (rc_call_start): whatever the caller passes, the executor then touches only the
 * slots' memory.
 *
 * A local operation whose source and target overlap in one slot reads the source as it was
 * before the operation (as numpy's copyto and ufuncs do), through a temporary copy.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node.h"

typedef struct {
    int slot, ndim;
    int64_t offset, shape[RC_MAX_DIMS], strides[RC_MAX_DIMS];
    int64_t size, lowest, highest; /* elements, and the extreme element indices it touches */
} rc_view;

#define FAIL(...) do { snprintf(program->error, sizeof program->error, __VA_ARGS__); \
    return -1; } while (0)

/* Notes that the program reaches elements low..high of `slot` (`need` elements at least: the
 * range as an error names it), writing into them if `written`. */
static int reach(rc_program *program, int64_t slot, int64_t low, int64_t high, int64_t need,
                 int written)
{
    if (slot >= program->n_slots) {
        int64_t n = slot + 1;
        rc_slot_need *bigger = realloc(program->slot_needs, sizeof *bigger * (size_t)n);
        if (bigger == NULL)
            FAIL("out of memory");
        memset(bigger + program->n_slots, 0, sizeof *bigger * (size_t)(n - program->n_slots));
        program->slot_needs = bigger;
        program->n_slots = (int)n;
    }
    rc_slot_need *at = &program->slot_needs[slot];
    if (need > at->count)
        *at = (rc_slot_need){need, low, high, at->written};
    at->written |= written;
    return 0;
}

/* Notes that the program talks to `peer` (RC_USE_* in `use`), keeping the peers ascending. */
static int meet(rc_program *program, int64_t peer, uint8_t use)
{
    int i = 0;
    while (i < program->n_peers && program->peers[i].rank < peer)
        i++;
    if (i < program->n_peers && program->peers[i].rank == peer) {
        program->peers[i].use |= use;
        return 0;
    }
    rc_peer_use *bigger = realloc(program->peers, sizeof *bigger * (size_t)(program->n_peers + 1));
    if (bigger == NULL)
        FAIL("out of memory");
    memmove(bigger + i + 1, bigger + i, sizeof *bigger * (size_t)(program->n_peers - i));
    bigger[i] = (rc_peer_use){(int)peer, use};
    program->peers = bigger;
    program->n_peers++;
    return 0;
}

/* Reads the place at code[*at] into *view, noting what it reaches. */
static int read_place(rc_program *program, int64_t *at, rc_view *view, int written)
{
    const int64_t *code = program->code;
    int64_t p = *at, len = program->code_len;
    if (len - p < 3)
        FAIL("plan code ends inside a place");
    if (code[p] < 0 || code[p] >= RC_MAX_SLOTS)
        FAIL("a local step names slot %lld", (long long)code[p]);
    if (code[p + 2] < 1 || code[p + 2] > RC_MAX_DIMS || (len - p - 3) / 2 < code[p + 2])
        FAIL("a local step's place has %lld dimensions", (long long)code[p + 2]);
    view->slot = (int)code[p];
    view->offset = code[p + 1];
    view->ndim = (int)code[p + 2];
    view->size = 1;
    view->lowest = view->highest = view->offset;
    for (int i = 0; i < view->ndim; i++) {
        int64_t extent = code[p + 3 + i], stride = code[p + 3 + view->ndim + i], span;
        if (extent < 0)
            FAIL("a local step's place has a negative extent");
        view->shape[i] = extent;
        view->strides[i] = stride;
        if (extent == 0)
            view->size = 0;
        else if (__builtin_mul_overflow(extent - 1, stride, &span)
                 || __builtin_add_overflow(span > 0 ? view->highest : view->lowest, span,
                                           span > 0 ? &view->highest : &view->lowest)
                 || __builtin_mul_overflow(view->size, extent, &view->size))
            FAIL("a local step's place overflows");
    }
    if (view->size != 0 && view->lowest < 0)
        FAIL("a local step reaches elements %lld..%lld of slot %d", (long long)view->lowest,
             (long long)view->highest, view->slot);
    *at = p + 3 + 2 * (int64_t)view->ndim;
    if (view->size == 0)
        return reach(program, view->slot, 0, 0, 0, 0);
    return reach(program, view->slot, view->lowest, view->highest, view->highest + 1, written);
}

static int check_round(rc_program *program, int64_t at, int64_t n)
{
    for (int64_t m = 0; m < n; m++) {
        const int64_t *message = program->code + at + 2 + m * RC_MESSAGE_WORDS;
        int64_t flags = message[0], peer = message[1], slot = message[3];
        if (flags != 0 && flags != RC_MESSAGE_SEND && flags != RC_MESSAGE_REDUCE)
            FAIL("a message has flags %lld", (long long)flags);
        if (peer < 0 || peer > INT32_MAX)
            FAIL("a message names rank %lld", (long long)peer);
        if (slot < 0 || slot >= RC_MAX_SLOTS)
            FAIL("a message names slot %lld", (long long)slot);
        if (message[4] < 0 || message[4] > message[5])
            FAIL("a message names elements %lld..%lld of slot %lld", (long long)message[4],
                 (long long)message[5], (long long)slot);
        if ((flags & RC_MESSAGE_REDUCE) && program->kernel == NULL)
            FAIL("a receive reduces in a call without a reduce op");
        int sends = (flags & RC_MESSAGE_SEND) != 0;
        if (reach(program, slot, message[4], message[5], message[5],
                  !sends && message[5] > message[4]) != 0
                || meet(program, peer, sends ? RC_USE_SEND : RC_USE_RECEIVE) != 0)
            return -1;
    }
    return 0;
}

/* Marks RC_MESSAGE_FAN_OUT on the sends of the checked round at `at` (n messages) that carry
 * the same range of the same slot as RC_FAN_OUT_MIN_RECEIVERS sends of the round or more (a
 * linear broadcast's root). */
static void mark_fan_out(rc_program *program, int64_t at, int64_t n)
{
    int64_t *round = program->code + at + 2;
    for (int64_t m = 0; m < n; m++) {
        int64_t *message = round + m * RC_MESSAGE_WORDS, same = 0;
        if (!(message[0] & RC_MESSAGE_SEND))
            continue;
        for (int64_t k = 0; k < n && same < RC_FAN_OUT_MIN_RECEIVERS; k++) {
            const int64_t *other = round + k * RC_MESSAGE_WORDS;
            same += (other[0] & RC_MESSAGE_SEND) && other[3] == message[3]
                    && other[4] == message[4] && other[5] == message[5];
        }
        if (same >= RC_FAN_OUT_MIN_RECEIVERS)
            message[0] |= RC_MESSAGE_FAN_OUT;
    }
}

static int check_local(rc_program *program, int64_t *at, int64_t s)
{
    int64_t kind = program->code[*at + 1];
    rc_view target, source;
    if (kind != RC_LOCAL_COPY && kind != RC_LOCAL_COMBINE)
        FAIL("step %lld is a local step of kind %lld", (long long)s, (long long)kind);
    if (kind == RC_LOCAL_COMBINE && program->kernel == NULL)
        FAIL("a local step combines in a call without a reduce op");
    *at += 2;
    if (read_place(program, at, &target, 1) != 0 || read_place(program, at, &source, 0) != 0)
        return -1;
    if (target.ndim != source.ndim
            || memcmp(target.shape, source.shape, sizeof(int64_t) * target.ndim) != 0)
        FAIL("step %lld's target and source differ in shape", (long long)s);
    return 0;
}

/* Checks the copied code of `program` step by step, noting what its calls need. */
static int check_code(rc_program *program)
{
    const int64_t *code = program->code;
    int64_t len = program->code_len, at = 1;
    if (len < 1 || code[0] < 0)
        FAIL("plan code without a step count");
    for (int64_t s = 0; s < code[0]; s++) {
        if (len - at < 2)
            FAIL("plan code ends before step %lld", (long long)s);
        if (code[at] == RC_STEP_ROUND) {
            int64_t n = code[at + 1];
            if (n < 0 || n > (len - at - 2) / RC_MESSAGE_WORDS)
                FAIL("step %lld is a round of %lld messages", (long long)s, (long long)n);
            if (check_round(program, at, n) != 0)
                return -1;
            if (n >= RC_FAN_OUT_MIN_RECEIVERS)
                mark_fan_out(program, at, n);
            if (n > 0)
                program->last_round_at = at;
            at += 2 + n * RC_MESSAGE_WORDS;
            program->biggest = n > program->biggest ? n : program->biggest;
        } else if (code[at] == RC_STEP_LOCAL) {
            if (check_local(program, &at, s) != 0)
                return -1;
        } else {
            FAIL("step %lld has kind %lld", (long long)s, (long long)code[at]);
        }
    }
    if (at != len)
        FAIL("plan code has %lld words after its steps", (long long)(len - at));
    return 0;
}

int rc_program_build(rc_program *program, const int64_t *code, int64_t len, int itemsize,
                     rc_kernel kernel)
{
    memset(program, 0, sizeof *program);
    program->itemsize = itemsize;
    program->kernel = kernel;
    program->code = malloc(sizeof(int64_t) * (size_t)(len > 0 ? len : 1));
    if (program->code == NULL)
        FAIL("out of memory");
    memcpy(program->code, code, sizeof(int64_t) * (size_t)len);
    program->code_len = len;
    return check_code(program);
}

void rc_program_free(rc_program *program)
{
    free(program->code);
    free(program->slot_needs);
    free(program->peers);
    memset(program, 0, sizeof *program);
}

int64_t rc_step_words(const int64_t *record)
{
    if (record[0] == RC_STEP_ROUND)
        return 2 + record[1] * RC_MESSAGE_WORDS;
    int64_t target_ndim = record[4];
    int64_t source_ndim = record[2 + 3 + 2 * target_ndim + 2];
    return 2 + 3 + 2 * target_ndim + 3 + 2 * source_ndim;
}

/* A place already checked by rc_program_check. */
static const int64_t *view_of(const int64_t *p, rc_view *view)
{
    view->slot = (int)p[0];
    view->offset = p[1];
    view->ndim = (int)p[2];
    view->size = 1;
    view->lowest = view->highest = view->offset;
    for (int i = 0; i < view->ndim; i++) {
        view->shape[i] = p[3 + i];
        view->strides[i] = p[3 + view->ndim + i];
        view->size *= view->shape[i];
        int64_t reach = (view->shape[i] - 1) * view->strides[i];
        if (reach > 0)
            view->highest += reach;
        else
            view->lowest += reach;
    }
    return p + 3 + 2 * view->ndim;
}

static void copy_strided(unsigned char *to, int64_t to_step, const unsigned char *from,
                         int64_t from_step, int64_t n, int itemsize)
{
    if (to_step == 1 && from_step == 1) {
        memmove(to, from, (size_t)(n * itemsize));
        return;
    }
    int64_t to_bytes = to_step * itemsize, from_bytes = from_step * itemsize;
    for (int64_t i = 0; i < n; i++, to += to_bytes, from += from_bytes) {
        switch (itemsize) { /* fixed sizes, so that each copy is one move */
        case 1: memcpy(to, from, 1); break;
        case 2: memcpy(to, from, 2); break;
        case 4: memcpy(to, from, 4); break;
        case 8: memcpy(to, from, 8); break;
        default: memcpy(to, from, 16); break;
        }
    }
}

/* Applies the local operation over every dimension, the innermost by the kernel or a copy. */
static void apply(const rc_call *call, int64_t kind, unsigned char *to, const int64_t *to_steps,
                  const unsigned char *from, const int64_t *from_steps, const int64_t *shape,
                  int ndim)
{
    if (ndim == 1) {
        if (kind == RC_LOCAL_COMBINE)
            call->kernel(to, from, shape[0], to_steps[0], from_steps[0]);
        else
            copy_strided(to, to_steps[0], from, from_steps[0], shape[0], call->itemsize);
        return;
    }
    int64_t to_bytes = to_steps[0] * call->itemsize, from_bytes = from_steps[0] * call->itemsize;
    for (int64_t i = 0; i < shape[0]; i++)
        apply(call, kind, to + i * to_bytes, to_steps + 1, from + i * from_bytes, from_steps + 1,
              shape + 1, ndim - 1);
}

int rc_program_local(rc_call *call, const int64_t *record)
{
    rc_view target, source;
    int64_t kind = record[1];
    view_of(view_of(record + 2, &target), &source);
    if (target.size == 0)
        return 0;
    unsigned char *to = call->slots[target.slot].base + target.offset * call->itemsize;
    const unsigned char *from = call->slots[source.slot].base + source.offset * call->itemsize;
    unsigned char *copy = NULL;
    int64_t copy_steps[RC_MAX_DIMS];
    if (target.slot == source.slot && target.lowest <= source.highest
            && source.lowest <= target.highest) {
        copy = malloc((size_t)(source.size * call->itemsize));
        if (copy == NULL)
            return -1;
        copy_steps[source.ndim - 1] = 1;
        for (int i = source.ndim - 1; i > 0; i--)
            copy_steps[i - 1] = copy_steps[i] * source.shape[i];
        apply(call, RC_LOCAL_COPY, copy, copy_steps, from, source.strides, source.shape,
              source.ndim);
        from = copy;
    }
    apply(call, kind, to, target.strides, from, copy ? copy_steps : source.strides, target.shape,
          target.ndim);
    free(copy);
    return 0;
}
