"""The ``ray`` backend: groups of Ray actors over Unix sockets and shared memory on a node, and
authenticated TCP streams (or Ray's object store) between nodes.

One concern a module:

- ``factory``: joining a group (:class:`RayBackendFactory`), declaring one from the driver;
- ``membership``: a rank's membership, and what leaving undoes;
- ``elastic``: a membership's shrink and grow (the members' agreement, the new incarnation's
  join), on what it reads of the membership (``elastic.Reforming``);
- ``rendezvous``: how the ranks find each other in Ray's key-value store;
- ``private_dirs``: where a group's files live on a node, and the checks that keep them ours;
- ``post_offices`` and ``post_office``: the one helper actor per node of a group that spans
  nodes;
- ``machines``: whether a machine runs more ranks than it has cores;
- ``environment``: Ray's runtime and the environment variables the backend reads.
- ``status``: ``python -m ray_collective status``, what it reads of the groups of a cluster.
"""

from .factory import RayBackendFactory

__all__ = ["RayBackendFactory"]
