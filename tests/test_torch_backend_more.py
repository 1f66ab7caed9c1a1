"""The rest of torch's collectives over ``ray_collective`` (4 ranks in Ray actors): reduce,
gather, scatter, all_to_all, all_to_all_single (even and with split sizes), batch_isend_irecv,
subgroups (``new_group``, ``new_subgroups``: groups of the library of their own), and the
barriers; each result against what every rank's input says it must be."""

import pytest

torch = pytest.importorskip("torch")

from support.torch_ranks import four, run_torch_ranks  # noqa: E402,F401 - four: a fixture

SIZE = 4


def _rooted(rank, size):
    import torch.distributed as dist
    out = {}
    x = torch.full((3,), float(rank + 1))
    dist.reduce(x, dst=2, op=dist.ReduceOp.PRODUCT)
    out["reduce"] = x.tolist()
    mine = torch.tensor([rank, 10 * rank], dtype=torch.int64)
    listed = [torch.empty(2, dtype=torch.int64) for _ in range(size)] if rank == 1 else None
    dist.gather(mine, gather_list=listed, dst=1)
    out["gather"] = [t.tolist() for t in listed] if listed else None
    parts = [torch.full((2,), float(100 + j)) for j in range(size)] if rank == 3 else None
    got = torch.empty(2)
    dist.scatter(got, scatter_list=parts, src=3)
    out["scatter"] = got.tolist()
    outputs = [torch.empty(2, dtype=torch.int32) for _ in range(size)]
    dist.all_to_all(outputs, [torch.tensor([rank, j], dtype=torch.int32) for j in range(size)])
    out["all_to_all"] = [t.tolist() for t in outputs]
    even_out = torch.empty(size * 2)
    dist.all_to_all_single(even_out, torch.arange(size * 2, dtype=torch.float32) + 100 * rank)
    out["all_to_all_single"] = even_out.tolist()
    # Rank r sends j + 1 rows to rank j, each row [r, j].
    send = torch.cat([torch.tensor([[rank, j]] * (j + 1)) for j in range(size)])
    receive = torch.empty((rank + 1) * size, 2, dtype=torch.int64)
    dist.all_to_all_single(receive, send, output_split_sizes=[rank + 1] * size,
                           input_split_sizes=[j + 1 for j in range(size)])
    out["all_to_all_single_splits"] = receive.tolist()
    # all_to_all of tensors of several sizes: rank r sends j + 1 values to rank j.
    uneven = [torch.empty(rank + 1) for _ in range(size)]
    dist.all_to_all(uneven, [torch.full((j + 1,), float(10 * rank + j)) for j in range(size)])
    out["all_to_all_uneven"] = [t.tolist() for t in uneven]
    gathered = [[torch.empty(2), torch.empty(1)] for _ in range(size)]
    dist.all_gather_coalesced(gathered, [torch.full((2,), float(rank)),
                                         torch.full((1,), -float(rank))])
    out["all_gather_coalesced"] = [[t.tolist() for t in listed] for listed in gathered]
    dist.barrier()
    dist.group.WORLD.monitored_barrier()
    return out


def test_rooted_collectives_and_all_to_all_equal_the_reference(ray_session, four):
    results = run_torch_ranks(ray_session, four, _rooted)
    product = 1.0 * 2.0 * 3.0 * 4.0
    for rank, out in enumerate(results):
        assert out["reduce"] == ([product] * 3 if rank == 2 else [float(rank + 1)] * 3)
        assert out["gather"] == ([[r, 10 * r] for r in range(SIZE)] if rank == 1 else None)
        assert out["scatter"] == [float(100 + rank)] * 2
        assert out["all_to_all"] == [[r, rank] for r in range(SIZE)]
        assert out["all_to_all_single"] == [float(100 * r + 2 * rank + i)
                                            for r in range(SIZE) for i in range(2)]
        assert out["all_to_all_single_splits"] == [[r, rank] for r in range(SIZE)
                                                   for _ in range(rank + 1)]
        assert out["all_to_all_uneven"] == [[float(10 * r + rank)] * (rank + 1)
                                            for r in range(SIZE)]
        assert out["all_gather_coalesced"] == [[[float(r)] * 2, [-float(r)]]
                                               for r in range(SIZE)]


def _batched_and_subgroups(rank, size):
    import torch.distributed as dist
    out = {}
    right, left = (rank + 1) % size, (rank - 1) % size
    to_right, from_left = torch.full((2,), float(rank)), torch.empty(2)
    to_left, from_right = torch.full((2,), float(-rank)), torch.empty(2)
    ops = [dist.P2POp(dist.irecv, from_left, left, tag=3),
           dist.P2POp(dist.irecv, from_right, right, tag=4),
           dist.P2POp(dist.isend, to_right, right, tag=3),
           dist.P2POp(dist.isend, to_left, left, tag=4)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch"] = (from_left.tolist(), from_right.tolist())
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        x = torch.full((2,), float(rank))
        dist.all_reduce(x, group=odd)
        out["new_group"] = (x.tolist(), dist.get_rank(odd), odd.library_group)
    mine, groups = dist.new_subgroups(group_size=2)
    y = torch.full((1,), float(rank))
    dist.all_reduce(y, group=mine)
    dist.broadcast(y, group=mine, group_src=1)
    out["subgroup"] = (y.tolist(), dist.get_world_size(mine), dist.get_backend(mine))
    for group in [odd] + groups:
        if group != dist.GroupMember.NON_GROUP_MEMBER and rank in dist.get_process_group_ranks(group):
            dist.destroy_process_group(group)
    return out


def test_batch_isend_irecv_and_subgroups(ray_session, four):
    results = run_torch_ranks(ray_session, four, _batched_and_subgroups)
    for rank, out in enumerate(results):
        assert out["batch"] == ([float((rank - 1) % SIZE)] * 2, [float(-((rank + 1) % SIZE))] * 2)
        pair = rank // 2 * 2
        assert out["subgroup"] == ([float(pair + pair + 1)], 2, "ray_collective")
    assert results[1]["new_group"][:2] == ([4.0, 4.0], 0)
    assert results[3]["new_group"][:2] == ([4.0, 4.0], 1)
    assert results[1]["new_group"][2] == results[3]["new_group"][2]
