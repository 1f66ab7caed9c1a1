"""The engine: how a call of a known shape runs on the CPU, from its recorded plan to the bytes.

- ``plan``: an algorithm recorded once per call shape (:class:`~.plan.Plan`), to replay.
- ``executor``: replays a plan over a transport, round by round (and posts the simulator's
  rounds).
- ``cpu``: the CPU engine, ``TransportMembership``: prepares a call shape once (algorithm,
  plan, reduction, header, layout) and runs each call of it on the native core or the executor.
- ``native_runner``: ``NativeRunner`` drives the native core (``ray_collective.native``) for
  one rank: a whole plan over the node's shared-memory rings, with the failure checks between
  slices.
- ``stream_rounds``: ``StreamRounds`` runs a plan's rounds between nodes on the core, over the
  streams.

Every module but ``cpu`` sits below the backends (it knows no membership); ``cpu`` is a
membership (``backends.base``), which the in-process and Ray backends build on their
transports.
"""
