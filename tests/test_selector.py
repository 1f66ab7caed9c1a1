"""The selector's choices, and forcing an algorithm."""

import pytest

from ray_collective.algorithms.selector import ENVIRONMENT_VARIABLE, forced_algorithms, select


@pytest.mark.parametrize("collective, count, p, node_of, expected", [
    ("allreduce", 2, 8, None, "recursive_doubling"),
    ("allreduce", 1 << 20, 8, None, "ring"),
    ("allreduce", 1 << 20, 400, None, "rabenseifner"),
    ("allreduce", 2, 4, (0, 0, 1, 1), "hierarchical"),
    ("allreduce", 2, 4, (0, 1, 2, 3), "recursive_doubling"),
    # from 16 MiB (4-byte elements) on nodes of equal size, every rank crosses with a shard
    ("allreduce", 4 << 20, 4, (0, 0, 1, 1), "hierarchical_sharded"),
    ("allreduce", (4 << 20) - 1, 4, (0, 0, 1, 1), "hierarchical"),
    ("allreduce", 4 << 20, 5, (0, 0, 1, 1, 1), "hierarchical"),
    ("broadcast", 2, 8, None, "binomial"),
    # on one node up to 8 ranks, from 16 KiB: from the root in one round
    ("broadcast", 1 << 20, 8, None, "linear"),
    ("broadcast", 1 << 12, 3, (0, 0, 0), "linear"),
    ("broadcast", (1 << 12) - 1, 8, None, "binomial"),
    ("broadcast", 1 << 20, 9, None, "scatter_allgather"),
    # past 16 ranks a 4 MiB broadcast goes binomially, unless larger than its ring's rounds
    ("broadcast", 1 << 20, 64, None, "binomial"),
    ("broadcast", 1 << 20, 400, None, "binomial"),
    ("broadcast", 16 << 20, 64, None, "scatter_allgather"),
    ("broadcast", 1 << 20, 4, ("a", "a", "b", "b"), "hierarchical"),
    # from 1 MiB over 3 nodes or more, up to 16 ranks: down the chain of nodes
    ("broadcast", 1 << 18, 6, (0, 0, 1, 1, 2, 2), "hierarchical_pipeline"),
    ("broadcast", (1 << 18) - 1, 6, (0, 0, 1, 1, 2, 2), "hierarchical"),
    ("broadcast", 1 << 18, 18, tuple(r // 2 for r in range(18)), "hierarchical"),
    ("reduce", 2, 4, (0, 0, 1, 1), "hierarchical"),
    ("allgather", 2, 8, None, "recursive_doubling"),
    ("allgather", 2, 9, None, "bruck"),
    ("allgather", 1 << 20, 8, None, "ring"),
    # blocks from 16 KiB up to 128 KiB on one node up to 8 ranks: in one round
    ("allgather", 1 << 15, 8, None, "linear"),
    ("allgather", 1 << 12, 4, (0,) * 4, "linear"),
    ("allgather", (1 << 12) - 1, 8, None, "recursive_doubling"),
    ("allgather", 1 << 15, 9, None, "ring"),
    ("allgather", 1 << 15, 4, (0, 0, 1, 1), "ring"),
    ("reducescatter", 2, 8, None, "recursive_halving"),
    ("reducescatter", 2, 9, None, "halving_fold"),
    # large blocks: pairwise on one node (reduced at their owners from the inputs), the ring
    # across nodes, and past 16 ranks the log-round algorithms
    ("reducescatter", 1 << 20, 9, None, "pairwise"),
    ("reducescatter", 1 << 20, 4, (0, 0, 1, 1), "ring"),
    ("reducescatter", 1 << 20, 9, (0,) * 9, "pairwise"),
    ("reducescatter", 1 << 20, 32, None, "recursive_halving"),
    ("alltoall", 2, 64, None, "bruck"),
    ("alltoall", 1 << 20, 64, None, "pairwise"),
    # blocks up to 128 KiB on one node up to 8 ranks: every pair's message in one round;
    # elsewhere a peer a round
    ("alltoall", 1 << 15, 8, None, "linear"),
    ("alltoall", 2, 8, (0,) * 8, "linear"),
    ("alltoall", (1 << 15) + 1, 8, None, "pairwise"),
    ("alltoall", 1 << 20, 9, None, "pairwise"),
    ("alltoall", 2, 4, (0, 0, 1, 1), "pairwise"),
    ("barrier", 0, 64, None, "dissemination"),
    ("gather", 2, 64, None, "binomial"),
    # large blocks on one node: to the root in one round, up to 16 ranks
    ("gather", 1 << 12, 4, None, "linear"),
    ("gather", (1 << 12) - 1, 4, None, "binomial"),
    ("gather", 1 << 20, 16, (0,) * 16, "linear"),
    ("gather", 1 << 20, 17, None, "binomial"),
    ("gather", 1 << 20, 4, (0, 0, 1, 1), "binomial"),
    ("scatter", 2, 64, None, "binomial"),
    # large blocks on one node: from the root in one round, up to 16 ranks
    ("scatter", 1 << 12, 4, None, "linear"),
    ("scatter", (1 << 12) - 1, 4, None, "binomial"),
    ("scatter", 1 << 20, 16, (0,) * 16, "linear"),
    ("scatter", 1 << 20, 17, None, "binomial"),
    ("scatter", 1 << 20, 4, (0, 0, 1, 1), "binomial"),
])
def test_rules(collective, count, p, node_of, expected, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    assert select(collective, count, 4, p, node_of).name == expected


def test_environment_forces_per_collective(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "allreduce=ring, broadcast=binomial")
    forced = forced_algorithms()
    assert dict(forced) == {"allreduce": "ring", "broadcast": "binomial"}
    assert select("allreduce", 2, 4, 8, forced=forced.get("allreduce")).name == "ring"
    assert select("broadcast", 1 << 20, 4, 8, forced=forced.get("broadcast")).name == "binomial"
    assert select("allgather", 2, 4, 8, forced=forced.get("allgather")).name == \
        "recursive_doubling"
    assert select("allreduce", 2, 4, 8, forced="rabenseifner").name == "rabenseifner"
    with pytest.raises(TypeError):
        forced["allreduce"] = "rabenseifner"  # read once per group, never changed after


def test_selection_ignores_the_environment_it_is_not_given(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "allreduce=ring")
    assert select("allreduce", 2, 4, 8).name == "recursive_doubling"


@pytest.mark.parametrize("value", ["ring", "allreduce=", "=ring", "allreduce=ring,,x"])
def test_malformed_environment_is_an_error(value, monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, value)
    with pytest.raises(ValueError, match=ENVIRONMENT_VARIABLE):
        forced_algorithms()


def test_forced_algorithm_must_exist_and_fit(monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    with pytest.raises(ValueError, match="no algorithm 'tree'.*available"):
        select("allreduce", 2, 4, 8, forced="tree")
    with pytest.raises(ValueError, match="power-of-two"):
        select("allgather", 2, 4, 6, forced="recursive_doubling")
    with pytest.raises(ValueError, match="rank-to-node map"):
        select("allreduce", 2, 4, 6, forced="hierarchical")


def test_a_group_on_the_core_broadcasts_down_the_leaders_tree_not_the_node_chain():
    node_of = (0, 0, 1, 1, 2, 2)
    assert select("broadcast", 1 << 18, 4, 6, node_of).name == "hierarchical_pipeline"
    assert select("broadcast", 1 << 18, 4, 6, node_of,
                  nodes_in_core=True).name == "hierarchical"
    assert select("allreduce", 4 << 20, 4, 6, node_of,
                  nodes_in_core=True).name == "hierarchical_sharded"


def test_oversubscribed_nodes_take_the_allreduce_with_fewest_messages():
    assert select("allreduce", 2, 4, 8, None, oversubscribed=True).name == "reduce_broadcast"
    assert select("allreduce", 2, 4, 8, None).name == "recursive_doubling"
    assert select("allreduce", 2, 4, 4, None, oversubscribed=True).name == "recursive_doubling"
    assert select("allreduce", 1 << 20, 4, 8, None, oversubscribed=True).name == "ring"
    assert select("broadcast", 2, 4, 8, None, oversubscribed=True).name == "binomial"


def test_a_crowded_node_of_4_ranks_reduce_scatters_small_blocks_by_halving():
    # Pairwise lost to it in the loop a user writes and in the CLI (2026-11-27 afternoon).
    for nodes in (None, (0,) * 4):
        assert select("reducescatter", 2, 4, 4, nodes, oversubscribed=True).name == \
            "recursive_halving"
        assert select("reducescatter", 256, 4, 4, nodes, oversubscribed=True).name == \
            "recursive_halving"


def test_between_crowded_nodes_allreduce_takes_fewest_messages_from_4_ranks():
    from ray_collective.algorithms.catalog import flat_choice
    crowded = flat_choice(4, oversubscribed=True)
    assert crowded("allreduce", 4, 2).name == "reduce_broadcast"
    assert crowded("allreduce", 3, 2).name == "recursive_doubling"
    assert crowded("allreduce", 2, 2).name == "recursive_doubling"
    assert crowded("allreduce", 4, 1 << 20).name == "ring"
    assert flat_choice(4)("allreduce", 4, 2).name == "recursive_doubling"


def test_oversubscription_is_judged_from_the_shared_membership():
    from ray_collective.backends.ray.rendezvous import Member
    from ray_collective.backends.ray.machines import oversubscribed as _oversubscribed
    two_cores = [Member(r, "a", 100 + r, 2) for r in range(2)]
    assert not _oversubscribed(two_cores)
    assert _oversubscribed(two_cores + [Member(2, "a", 102, 2)])
    assert not _oversubscribed(two_cores + [Member(2, "b", 102, 1)])


def test_ray_nodes_at_one_address_share_its_cores():
    from ray_collective.backends.ray.rendezvous import Member
    from ray_collective.backends.ray.machines import ranks_over_cores as _ranks_over_cores
    # Two ranks on each of two Ray nodes: apart, each node has a core per rank; at one address
    # (a local Cluster) four ranks share two cores, and no rank may spin.
    apart = [Member(r, "ab"[r // 2], 100 + r, 2, "streams", f"10.0.0.{r // 2}")
             for r in range(4)]
    assert _ranks_over_cores(apart) == {"a": False, "b": False}
    shared = [Member(r, "ab"[r // 2], 100 + r, 2, "streams", "10.0.0.1") for r in range(4)]
    assert _ranks_over_cores(shared) == {"a": True, "b": True}
    # Node c, alone at its address, keeps its own verdict.
    mixed = shared[:2] + [Member(2, "c", 102, 2, "streams", "10.0.0.3")]
    assert _ranks_over_cores(mixed) == {"a": False, "c": False}
    from ray_collective.backends.ray.machines import ranks_per_core
    assert ranks_per_core(shared) == {"a": 2.0, "b": 2.0}
    assert ranks_per_core(mixed) == {"a": 1.0, "c": 0.5}
