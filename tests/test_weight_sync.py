"""Weight sync over in-process groups (every member a thread, no Ray): what the subscribers hold
after each version equals the publishers' tensors bit for bit, for replicas and shards, every
dtype, skipped buckets and wrong claims; bad input on any member is refused on every member
before anything moves, and the sync stays usable."""

import numpy as np
import pytest

import ray_collective as col
from ray_collective.errors import WeightSyncMismatchError
from support.weight_sync import FabricPerGroup, model, run_members

SIZES = {"embed": (64, 33), "layer.0.w": (300,), "layer.0.b": (5,), "layer.1.w": (17, 19),
         "head": (1,)}
BUCKET = 1024


def sync(publisher_states, subscriber_states, versions, publish_kwargs=None, between=None,
         name="w"):
    """Run ``len(versions)`` syncs; each member's list of results (versions or errors).

    ``between(step, role, index, state)`` runs in each member before each sync (the
    publishers' training step); ``publish_kwargs(step, index)`` gives extra arguments."""
    fabric = FabricPerGroup()
    P, S = len(publisher_states), len(subscriber_states)

    def publisher(i):
        def body():
            col.init_weight_sync(name, "publisher", i, P, S, backend=fabric, timeout=20,
                                 bucket_bytes=BUCKET)
            out = []
            for step, version in enumerate(versions):
                if between:
                    between(step, "publisher", i, publisher_states[i])
                extra = publish_kwargs(step, i) if publish_kwargs else {}
                try:
                    out.append(col.publish_weights(publisher_states[i], name, version=version,
                                                   **extra))
                except col.WeightSyncError as err:
                    out.append(err)
                out.append(col.weight_sync_report(name))
            col.destroy_weight_sync(name)
            return out
        return body

    def subscriber(j):
        def body():
            col.init_weight_sync(name, "subscriber", j, P, S, backend=fabric, timeout=20,
                                 bucket_bytes=BUCKET)
            out = []
            for step in range(len(versions)):
                if between:
                    between(step, "subscriber", j, subscriber_states[j])
                try:
                    out.append(col.receive_weights(subscriber_states[j], name))
                except col.WeightSyncError as err:
                    out.append(err)
                out.append(col.weight_sync_report(name))
            col.destroy_weight_sync(name)
            return out
        return body

    return run_members([publisher(i) for i in range(P)] + [subscriber(j) for j in range(S)])


def assert_equal_bits(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), key


def train(step, role, index, state):
    """A publisher's step: every tensor changes (its replicas change alike)."""
    if role == "publisher":
        for key in state:
            state[key] += np.asarray(1, state[key].dtype)


@pytest.mark.parametrize("publishers", [1, 2, 3])
def test_replicas_deliver_every_version_bit_for_bit(publishers):
    base = model(0, SIZES)
    pubs = [{k: v.copy() for k, v in base.items()} for _ in range(publishers)]
    subs = [model(10 + j, SIZES) for j in range(3)]
    results = sync(pubs, subs, [0, 5, 6], between=train)
    for member in results:
        assert member[0::2] == [0, 5, 6]
    for sub in subs:
        assert_equal_bits(sub, pubs[0])
    sent = [r[1].moved_bytes for r in results[:publishers]]
    assert sum(sent) == results[0][1].model_bytes          # each byte sent once, shared out
    if publishers > 1:
        assert max(sent) < results[0][1].model_bytes


def test_shards_deliver_the_union():
    full = model(1, SIZES)
    names = sorted(full)
    pubs = [{k: full[k].copy() for k in names[:2]}, {k: full[k].copy() for k in names[2:]}]
    subs = [model(20 + j, SIZES) for j in range(2)]
    results = sync(pubs, subs, [1, 2], between=train)
    assert all(r[0::2] == [1, 2] for r in results)
    union = {**pubs[0], **pubs[1]}
    for sub in subs:
        assert_equal_bits(sub, union)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint64,
                                   np.bool_, np.complex64])
def test_every_numpy_dtype_arrives_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    pub = {"a": (rng.standard_normal(999) * 100).astype(dtype),
           "b": (rng.standard_normal((7, 3)) * 100).astype(dtype)}
    subs = [{k: np.zeros_like(v) for k, v in pub.items()} for _ in range(2)]
    sync([pub], subs, [0])
    for sub in subs:
        assert_equal_bits(sub, pub)


def test_torch_tensors_bfloat16_and_float32_arrive_bit_for_bit():
    torch = pytest.importorskip("torch", reason="torch tensors need torch (a test extra)")
    gen = torch.Generator().manual_seed(0)
    pub = {"w": torch.randn(513, generator=gen).to(torch.bfloat16),
           "b": torch.randn(4, 4, generator=gen), "n": torch.tensor(float("nan"))}
    subs = [{k: torch.zeros_like(v) for k, v in pub.items()} for _ in range(2)]
    sync([pub], subs, [3])
    for sub in subs:
        for key in pub:
            assert sub[key].dtype == pub[key].dtype
            assert torch.equal(sub[key].view(torch.uint8) if sub[key].dim() else
                               sub[key].reshape(1).view(torch.uint8),
                               pub[key].view(torch.uint8) if pub[key].dim() else
                               pub[key].reshape(1).view(torch.uint8))


def test_unchanged_buckets_are_skipped_and_changed_ones_sent():
    pub = model(4, SIZES)
    subs = [model(30 + j, SIZES) for j in range(2)]

    def touch_one(step, role, index, state):
        if role == "publisher" and step == 1:
            state["head"][0] += 1

    results = sync([pub], subs, [0, 1, 2], between=touch_one)
    reports = results[0][1::2]
    assert reports[0].full and reports[0].moved_bytes == reports[0].model_bytes
    assert not reports[1].full and 0 < reports[1].moved_bytes <= BUCKET     # only head's bucket
    assert reports[2].moved_bytes == 0                                     # nothing changed
    for sub in subs:
        assert_equal_bits(sub, pub)
        assert results[1][3].moved_bytes == reports[1].moved_bytes


def test_a_wrong_claim_of_unchanged_is_caught_by_the_digest():
    pub = model(5, SIZES)
    subs = [model(40, SIZES)]

    def change_all(step, role, index, state):
        if role == "publisher" and step == 1:
            for v in state.values():
                v *= 2

    results = sync([pub], subs, [0, 1], between=change_all,
                   publish_kwargs=lambda step, i: {"unchanged": list(SIZES)})
    assert results[0][3].moved_bytes == results[0][3].model_bytes
    assert_equal_bits(subs[0], pub)


def test_without_the_digest_a_claim_is_taken_at_its_word():
    pub = model(6, SIZES)
    subs = [model(50, SIZES)]
    old_embed = {}

    def change_embed(step, role, index, state):
        if role == "publisher" and step == 1:
            old_embed["value"] = state["embed"].copy()
            state["embed"] += 1

    sync([pub], subs, [0, 1], between=change_embed,
         publish_kwargs=lambda step, i: {"unchanged": ["embed"], "digest": False})
    assert subs[0]["embed"].tobytes() == old_embed["value"].tobytes()   # as the caller said
    rest = {k: v for k, v in pub.items() if k != "embed"}
    assert_equal_bits({k: subs[0][k] for k in rest}, rest)


def test_a_new_version_must_go_forward_on_every_member():
    pub = model(7, SIZES)
    subs = [model(60, SIZES)]
    results = sync([pub], subs, [4, 4, 3, 5], between=train)
    for member in results:
        outcomes = member[0::2]
        assert outcomes[0] == 4 and outcomes[3] == 5
        for err in outcomes[1:3]:
            assert isinstance(err, WeightSyncMismatchError)
            assert "does not go forward: version 4 was published last" in str(err)
    assert_equal_bits(subs[0], pub)


def test_a_subscriber_with_a_wrong_shape_is_refused_on_every_member_naming_both_sides():
    pub = model(8, SIZES)
    wrong = model(70, {**SIZES, "layer.0.w": (301,)})
    good = model(71, SIZES)
    before = {k: v.copy() for k, v in good.items()}
    results = sync([pub], [good, wrong], [0])
    for member in results:
        err = member[0]
        assert isinstance(err, WeightSyncMismatchError), err
        assert ("tensor 'layer.0.w' is float32[300] in publisher 0 but float32[301] in "
                "subscriber 1") in str(err)
    assert_equal_bits(good, before)                      # nothing moved


@pytest.mark.parametrize("bad, message", [
    ("publisher", "publisher 0: publish_weights: state_dict must be a mapping"),
    ("version", "publisher 0: publish_weights: version must be an int"),
    ("claim", "unchanged names 'nope', which is not in state_dict"),
    ("versions", "the publishers publish different versions: publisher 0 version 0, "
                 "publisher 1 version 1"),
])
def test_bad_input_on_one_publisher_is_refused_on_every_member(bad, message):
    pubs = [model(9, SIZES), model(9, SIZES)]
    if bad == "publisher":
        pubs[0] = [1, 2, 3]
    subs = [model(80, SIZES)]

    def kwargs(step, i):
        if bad == "version" and i == 0:
            return {"version": -1}
        if bad == "claim":
            return {"unchanged": ["nope"]}
        if bad == "versions":
            return {"version": i}
        return {}

    fabric = FabricPerGroup()

    def publisher(i):
        def body():
            col.init_weight_sync("w", "publisher", i, 2, 1, backend=fabric, timeout=20)
            args = {"version": 0, **kwargs(0, i)}
            with pytest.raises(WeightSyncMismatchError) as first:
                col.publish_weights(pubs[i], "w", **args)
            return str(first.value), col.publish_weights(model(9, SIZES), "w", version=7)
        return body

    def subscriber():
        with pytest.raises(WeightSyncMismatchError) as first:
            col.init_weight_sync("w", "subscriber", 0, 2, 1, backend=fabric, timeout=20)
            col.receive_weights(subs[0], "w")
        return str(first.value), col.receive_weights(subs[0], "w")

    results = run_members([publisher(0), publisher(1), subscriber])
    for result in results:
        assert not isinstance(result, BaseException), result
        text, version = result
        assert message in text and version == 7


def test_a_member_calling_the_other_roles_function_is_refused_everywhere():
    fabric = FabricPerGroup()
    pub, sub = model(10, SIZES), model(11, SIZES)

    def publisher():
        col.init_weight_sync("w", "publisher", 0, 1, 1, backend=fabric, timeout=20)
        with pytest.raises(WeightSyncMismatchError, match="subscriber 0 called publish_weights; "
                                                          "a subscriber calls receive_weights"):
            col.publish_weights(pub, "w", version=1)
        return "ok"

    def subscriber():
        col.init_weight_sync("w", "subscriber", 0, 1, 1, backend=fabric, timeout=20)
        with pytest.raises(WeightSyncMismatchError, match="subscriber 0 called publish_weights"):
            col.publish_weights(sub, "w", version=1)
        return "ok"

    assert run_members([publisher, subscriber]) == ["ok", "ok"]


def test_async_syncs_return_a_handle_whose_wait_gives_the_version():
    fabric = FabricPerGroup()
    pub, sub = model(12, SIZES), model(13, SIZES)

    def publisher():
        col.init_weight_sync("w", "publisher", 0, 1, 1, backend=fabric, timeout=20)
        work = col.publish_weights(pub, "w", version=9, async_op=True)
        return work.wait(30)

    def subscriber():
        col.init_weight_sync("w", "subscriber", 0, 1, 1, backend=fabric, timeout=20)
        work = col.receive_weights(sub, "w", async_op=True)
        version = work.wait(30)
        return version, work.is_completed()

    assert run_members([publisher, subscriber]) == [9, (9, True)]
    assert_equal_bits(sub, pub)


@pytest.mark.parametrize("call, message", [
    (lambda: col.publish_weights({}, "nowhere", version=1), "not a member of weight sync"),
    (lambda: col.receive_weights({}, "nowhere"), "not a member of weight sync"),
    (lambda: col.destroy_weight_sync("nowhere"), "neither a member"),
    (lambda: col.init_weight_sync("w", "trainer", 0, 1, 1), "role must be"),
    (lambda: col.init_weight_sync("w", "publisher", 1, 1, 1), r"index must be an int in \[0, 1\)"),
    (lambda: col.init_weight_sync("w", "publisher", 0, 0, 1), "num_publishers must be"),
    (lambda: col.init_weight_sync("w", "publisher", 0, 1, 1, bucket_bytes=0), "bucket_bytes"),
    (lambda: col.init_weight_sync("", "publisher", 0, 1, 1), "group name|name"),
])
def test_bad_arguments_are_refused_before_anything_is_sent(call, message):
    with pytest.raises((col.ArgumentError, col.GroupNotInitializedError), match=message):
        call()
