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


def call_all(ray, actors, function, *args, **kwargs):
    return ray.get([a.__ray_call__.remote(function, *args, **kwargs) for a in actors],
                   timeout=120)


def sync_once(ray, publishers, subscribers, name, version):
    refs = [a.__ray_call__.remote(ws.step_and_publish, name, version) for a in publishers]
    refs += [a.__ray_call__.remote(ws.receive, name) for a in subscribers]
    return ray.get(refs, timeout=120)


def test_versions_reach_subscribers_that_come_and_go(ray_session):
    ray = ray_session
    publishers, subscribers, extra = start(ray, 1), start(ray, 3), start(ray, 1)
    actors = publishers + subscribers + extra
    try:
        for i, actor in enumerate(actors):
            ray.get(actor.__ray_call__.remote(ws.hold_model, SIZES, seed=i))
        col.declare_weight_sync(publishers, subscribers, name="w", timeout=60,
                                bucket_bytes=BUCKET)
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
    publishers, subscribers = start(ray, 1), start(ray, 3)
    actors = publishers + subscribers
    try:
        for i, actor in enumerate(actors):
            ray.get(actor.__ray_call__.remote(ws.hold_model, SIZES, seed=i))
        col.declare_weight_sync(publishers, subscribers, name="k", timeout=60,
                                bucket_bytes=BUCKET)
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
        col.destroy_weight_sync("k")
    finally:
        for actor in actors:
            ray.kill(actor)


def test_a_publisher_killed_mid_sync_fails_the_sync_on_every_subscriber(ray_session):
    ray = ray_session
    publishers, subscribers = start(ray, 1), start(ray, 2)
    actors = publishers + subscribers
    try:
        for i, actor in enumerate(actors):
            ray.get(actor.__ray_call__.remote(ws.hold_model, SIZES, seed=i))
        col.declare_weight_sync(publishers, subscribers, name="p", timeout=60,
                                bucket_bytes=BUCKET)
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
