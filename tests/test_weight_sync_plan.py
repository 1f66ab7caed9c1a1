"""Weight sync's pure parts: the digest (native against its numpy definition), the plan
(buckets, replicas and shards, refusals) and the layout of a state dict."""

import numpy as np
import pytest

from ray_collective import native
from ray_collective.weight_sync.digest import combine, digest, reference_digest
from ray_collective.weight_sync.layout import Layout, TensorSpec, difference, read_state_dict
from ray_collective.weight_sync.plan import (IN_PLACE_MIN_BYTES, MAX_BUCKET_BYTES,
                                             MIN_BUCKET_BYTES, PlanError, bucket_size,
                                             make_plan)

MiB = 1 << 20


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 31, 32, 33, 63, 4096, 100_003])
def test_the_native_digest_matches_the_reference_bit_for_bit(nbytes):
    if not native.available():
        pytest.skip(f"the native core is not built: {native.import_error()}")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert native.core().digest(data) == reference_digest(data)
    assert digest(data) == reference_digest(data)


def test_the_reference_digest_follows_its_definition():
    """Sum over words of mix(w_k, k), finished with the length: written out with Python ints."""
    k1, k2, mask = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, (1 << 64) - 1
    data = bytes(range(1, 20))
    padded = data + bytes(-len(data) % 8)
    total = 0
    for k in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * k:8 * k + 8], "little")
        m = ((w ^ (k * k1 & mask)) * k2) & mask
        m ^= m >> 29
        total = (total + m * k1) & mask
    h = total ^ (len(data) * k2 & mask)
    h ^= h >> 32
    h = h * k1 & mask
    h ^= h >> 29
    assert reference_digest(data) == h


def test_a_change_of_any_one_word_or_of_the_length_changes_the_digest():
    data = np.arange(4096, dtype=np.uint8)
    base = digest(data)
    for position in (0, 7, 8, 1000, 4095):
        changed = data.copy()
        changed[position] ^= 1
        assert digest(changed) != base
    assert digest(np.append(data, np.uint8(0))) != base      # same words, one more byte
    swapped = data.copy().view(np.uint64)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert digest(swapped) != base                            # the words' order counts
    assert combine([1, 2]) != combine([2, 1])


def spec(name, nbytes, dtype="uint8"):
    return TensorSpec(name, dtype, (nbytes,), nbytes)


def test_buckets_fuse_small_tensors_and_cut_large_ones_into_pieces():
    layout = Layout((spec("a", 3 * MiB), spec("b", 2 * MiB), spec("c", 9 * MiB),
                     spec("d", 1)))
    plan = make_plan([layout], bucket_bytes=4 * MiB)
    shapes = [[(plan.tensors[s.tensor].name, s.offset, s.nbytes) for s in b.segments]
              for b in plan.buckets]
    assert shapes == [[("a", 0, 3 * MiB)], [("b", 0, 2 * MiB)],
                      [("c", 0, 4 * MiB)], [("c", 4 * MiB, 4 * MiB)], [("c", 8 * MiB, MiB)],
                      [("d", 0, 1)]]
    assert [b.in_place for b in plan.buckets] == [True] * 6
    assert sum(b.nbytes for b in plan.buckets) == plan.nbytes == layout.nbytes
    fused = make_plan([Layout((spec("x", 10), spec("y", 20), spec("z", 30)))], bucket_bytes=64)
    assert len(fused.buckets) == 1 and not fused.buckets[0].in_place
    assert fused.tensors_of(fused.buckets[0]) == ("x", "y", "z")
    # A tensor of IN_PLACE_MIN_BYTES or more is never packed, even into a bucket with room.
    mixed = make_plan([Layout((spec("a", 10), spec("b", IN_PLACE_MIN_BYTES), spec("c", 20)))],
                      bucket_bytes=32 * MiB)
    assert [mixed.tensors_of(b) for b in mixed.buckets] == [("b",), ("a", "c")]


def test_every_byte_of_the_model_is_in_exactly_one_bucket():
    rng = np.random.default_rng(0)
    layout = Layout(tuple(spec(f"t{i:03d}", int(n)) for i, n in
                          enumerate(rng.integers(1, 3 * MiB, 200))))
    for publishers in (1, 2, 3):
        plan = make_plan([layout] * publishers, bucket_bytes=2 * MiB)
        covered = {t.name: np.zeros(t.nbytes, np.int8) for t in plan.tensors}
        for bucket in plan.buckets:
            assert bucket.nbytes <= 2 * MiB
            for s in bucket.segments:
                covered[plan.tensors[s.tensor].name][s.offset:s.offset + s.nbytes] += 1
        assert all((c == 1).all() for c in covered.values())
        loads = [sum(b.nbytes for b in plan.buckets_of(p)) for p in range(publishers)]
        assert max(loads) - min(loads) <= 2 * MiB     # replicas share the sending


def test_shards_send_their_own_tensors_and_overlap_is_refused():
    a = Layout((spec("a", 100), spec("b", 100)))
    b = Layout((spec("c", 100),))
    plan = make_plan([a, b])
    assert not plan.replicas
    assert [plan.tensors_of(x) for x in plan.buckets_of(0)] == [("a", "b")]
    assert [plan.tensors_of(x) for x in plan.buckets_of(1)] == [("c",)]
    with pytest.raises(PlanError, match=r"'b' is held by publishers \[0, 1\] but not by \[2\]"):
        make_plan([a, Layout((spec("b", 100),)), b])
    with pytest.raises(PlanError, match=r"'a' is uint8\[100\] in publisher 0 but uint8\[99\] in "
                                        r"publisher 1"):
        make_plan([a, Layout((spec("a", 99), spec("b", 100)))])


def test_the_bucket_size_follows_the_model_within_bounds():
    assert bucket_size(1000) == MIN_BUCKET_BYTES
    assert bucket_size(256 * MiB) == 8 * MiB
    assert bucket_size(1 << 30) == MAX_BUCKET_BYTES
    assert bucket_size(1 << 40) == MAX_BUCKET_BYTES


def test_a_state_dict_is_read_as_bytes_that_share_its_memory():
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.int64)}
    layout, views = read_state_dict(state, writable=True, what="receive_weights")
    assert [t.name for t in layout.tensors] == ["b", "w"]
    assert layout.tensors[1] == TensorSpec("w", "float32", (2, 3), 24)
    views["w"][:4] = np.frombuffer(np.float32(7).tobytes(), np.uint8)
    assert state["w"][0, 0] == 7
    assert Layout.decode(layout.encode()) == layout
    assert layout.fingerprint() != Layout(layout.tensors[:1]).fingerprint()


@pytest.mark.parametrize("state, message", [
    ([1, 2], "must be a mapping"),
    ({}, "is empty"),
    ({"": np.zeros(1)}, "non-empty string"),
    ({3: np.zeros(1)}, "non-empty string"),
    ({"a": [1.0]}, r"state_dict\['a'\] must be"),
    ({"a": np.zeros((4, 4))[:, 1]}, "non-contiguous"),
])
def test_bad_state_dicts_become_an_error_in_the_layout(state, message):
    layout, views = read_state_dict(state, writable=True, what="receive_weights")
    assert views == {} and layout.tensors == ()
    assert message in layout.error or __import__("re").search(message, layout.error)


def test_the_difference_names_the_tensor_and_both_sides():
    model = Layout((spec("a", 4), TensorSpec("b", "float32", (2,), 8)))
    assert difference(model, model, "publisher 0", "subscriber 1") is None
    assert difference(model, Layout((spec("a", 4),)), "publisher 0", "subscriber 1") == (
        "tensor 'b' (float32[2] in publisher 0) is missing from subscriber 1's state_dict")
    assert "'c' (uint8[1] in subscriber 1) is not in publisher 0" in difference(
        model, Layout(model.tensors + (spec("c", 1),)), "publisher 0", "subscriber 1")
    assert difference(model, Layout((spec("a", 4), TensorSpec("b", "float16", (2,), 4))),
                      "publisher 0", "subscriber 1") == (
        "tensor 'b' is float32[2] in publisher 0 but float16[2] in subscriber 1")
