"""Weight sync on Ray actors that know nothing of it, formed from the driver: versions reach
every subscriber bit for bit; subscribers added and removed between versions; a subscriber
killed in the middle of a sync is named to every other member, which return, and the next
version reaches the survivors with no call to repair anything; a killed publisher fails the
sync on every subscriber, naming it."""

import pytest

import ray_collective as col
from support import weight_sync as ws
from support.helpers import Member

SIZES = {"embed": (256, 64), "layer.w": (200_000,), "layer.b": (10,), "head": (3, 3)}
BUCKET = 64 * 1024


def start(ray, n):
    return [ray.remote(num_cpus=0)(Member).remote() for _ in range(n)]


def form(ray, publishers, subscribers, name):
    """Start the actors, give each a model of its own, declare the sync around them."""
    pubs, subs = start(ray, publishers), start(ray, subscribers)
    for i, actor in enumerate(pubs + subs):
        ray.get(actor.__ray_call__.remote(ws.hold_model, SIZES, seed=i))
    col.declare_weight_sync(pubs, subs, name=name, timeout=60, bucket_bytes=BUCKET)
    return pubs, subs


def call_all(ray, actors, function, *args, **kwargs):
    return ray.get([a.__ray_call__.remote(function, *args, **kwargs) for a in actors],
                   timeout=120)


def sync_once(ray, publishers, subscribers, name, version):
    refs = [a.__ray_call__.remote(ws.step_and_publish, name, version) for a in publishers]
    refs += [a.__ray_call__.remote(ws.receive, name) for a in subscribers]
    return ray.get(refs, timeout=120)


def test_versions_reach_subscribers_that_come_and_go(ray_session):
    ray = ray_session
    publishers, subscribers = form(ray, 1, 3, "w")
    extra = start(ray, 1)
    ray.get(extra[0].__ray_call__.remote(ws.hold_model, SIZES, seed=9))
    actors = publishers + subscribers + extra
    try:
        assert sync_once(ray, publishers, subscribers, "w", 1) == [1] * 4
        assert sync_once(ray, publishers, subscribers, "w", 2) == [2] * 4
        truth = call_all(ray, publishers, ws.fingerprint)[0]
        assert call_all(ray, subscribers, ws.fingerprint) == [truth] * 3

        col.add_weight_subscribers("w", extra)
        members = subscribers + extra
        assert sync_once(ray, publishers, members, "w", 3) == [3] * 5
        truth = call_all(ray, publishers, ws.fingerprint)[0]
        assert call_all(ray, members, ws.fingerprint) == [truth] * 4
        reports = call_all(ray, publishers + extra, ws.report, "w")
        assert reports[0][3] and reports[1][3]          # a new subscriber: the whole model

        col.remove_weight_subscribers("w", subscribers[:1])
        members = subscribers[1:] + extra
        assert sync_once(ray, publishers, members, "w", 4) == [4] * 4
        truth = call_all(ray, publishers, ws.fingerprint)[0]
        assert call_all(ray, members, ws.fingerprint) == [truth] * 3
        with pytest.raises(col.WeightSyncNotInitializedError):      # it left
            ray.get(subscribers[0].__ray_call__.remote(ws.report, "w"))
        col.destroy_weight_sync("w")
        with pytest.raises(col.WeightSyncNotInitializedError):
            col.add_weight_subscribers("w", extra)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_subscriber_killed_mid_sync_is_named_and_the_next_version_reaches_the_rest(
        ray_session):
    ray = ray_session
    publishers, subscribers = form(ray, 1, 3, "k")
    actors = publishers + subscribers
    try:
        assert sync_once(ray, publishers, subscribers, "k", 1) == [1] * 4
        victim = subscribers[1]
        ray.get(victim.__ray_call__.remote(ws.die_at_bucket, 2))
        refs = [publishers[0].__ray_call__.remote(ws.try_sync, "publisher", "k", 2)]
        refs += [a.__ray_call__.remote(ws.try_sync, "subscriber", "k", 2)
                 for a in subscribers]
        outcomes = [ray.get(refs[i], timeout=120) for i in (0, 1, 3)]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs[2], timeout=120)
        for kind, message, dead, _ in outcomes:
            assert kind == "WeightSyncMemberDiedError", message
            assert dead == ("subscriber 1",)
            assert "subscriber 1 died; the next sync goes on without it" in message
        survivors = [subscribers[0], subscribers[2]]
        assert sync_once(ray, publishers, survivors, "k", 3) == [3] * 3
        truth = call_all(ray, publishers, ws.fingerprint)[0]
        assert call_all(ray, survivors, ws.fingerprint) == [truth] * 2
        # The driver's record still names the dead one: adding a subscriber drops it.
        newcomer = start(ray, 1)
        actors += newcomer
        ray.get(newcomer[0].__ray_call__.remote(ws.hold_model, SIZES, seed=7))
        col.add_weight_subscribers("k", newcomer)
        members = survivors + newcomer
        assert sync_once(ray, publishers, members, "k", 4) == [4] * 4
        truth = call_all(ray, publishers, ws.fingerprint)[0]
        assert call_all(ray, members, ws.fingerprint) == [truth] * 3
        col.destroy_weight_sync("k")
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_publisher_killed_mid_sync_fails_the_sync_on_every_subscriber(ray_session):
    ray = ray_session
    publishers, subscribers = form(ray, 1, 2, "p")
    actors = publishers + subscribers
    try:
        ray.get(publishers[0].__ray_call__.remote(ws.die_at_bucket, 3))
        refs = [publishers[0].__ray_call__.remote(ws.try_sync, "publisher", "p", 1)]
        refs += [a.__ray_call__.remote(ws.try_sync, "subscriber", "p", 1) for a in subscribers]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(refs[0], timeout=120)
        for kind, message, dead, _ in ray.get(refs[1:], timeout=120):
            assert kind == "WeightSyncMemberDiedError", message
            assert dead == ("publisher 0",)
            assert "cannot go on without a publisher" in message
        again = call_all(ray, subscribers, ws.try_sync, "subscriber", "p", 2)
        for kind, message, _, _ in again:
            assert kind == "WeightSyncError" and "destroy it and declare it again" in message
        col.destroy_weight_sync("p")
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_subscriber_that_never_comes_times_the_sync_out_and_is_left_out(ray_session):
    """No clock waited on: the absent subscriber's receive is simply never called until the
    others have their error; the sync's own deadline (3 s) ends their wait."""
    ray = ray_session
    publishers, subscribers = form(ray, 1, 3, "t")
    actors = publishers + subscribers
    try:
        refs = [publishers[0].__ray_call__.remote(ws.try_sync, "publisher", "t", 1, timeout=3)]
        refs += [a.__ray_call__.remote(ws.try_sync, "subscriber", "t", 1, timeout=3)
                 for a in subscribers[:2]]
        for kind, message, dead, _ in ray.get(refs, timeout=120):
            assert kind == "WeightSyncError", message
            assert "timed out" in message and "the next sync shrinks the groups" in message
        assert sync_once(ray, publishers, subscribers[:2], "t", 2) == [2] * 3
        truth = call_all(ray, publishers, ws.fingerprint)[0]
        assert call_all(ray, subscribers[:2], ws.fingerprint) == [truth] * 2
        late = ray.get(subscribers[2].__ray_call__.remote(ws.try_sync, "subscriber", "t", 2,
                                                          timeout=3), timeout=120)
        assert late[0] == "WeightSyncError", late      # the others went on without it
    finally:
        for actor in actors:
            ray.kill(actor)
