"""A user's job, as ``tests/test_first_hour_status.py`` starts it from a clean environment:
``ray.init()`` with Ray's defaults (a local cluster of its own, token authentication on),
a group of two actors declared on it; prints the cluster's address and waits until its
standard input closes."""

import sys

import ray

import ray_collective as col


@ray.remote(num_cpus=0)
class Member:
    def ready(self):
        return True


def main() -> None:
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    actors = [Member.remote() for _ in range(2)]
    ray.get([actor.ready.remote() for actor in actors])
    col.declare_collective_group(actors, group_name="first-hour-status")
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()
    col.destroy_collective_group("first-hour-status")
    ray.shutdown()


if __name__ == "__main__":
    main()
