"""A driver that declares a group and exits without destroying it (run by a test).

Prints its job id and the directory of the group on this node, as JSON.
"""

import json
import os
import sys

import ray

import ray_collective as col


class Holder:
    def directory(self):
        from ray_collective.group import current_registry
        return current_registry().get("abandoned").membership.directory


if __name__ == "__main__":
    ray.init(address=sys.argv[1], logging_level="ERROR")
    actors = [ray.remote(num_cpus=0)(Holder).remote() for _ in range(2)]
    col.declare_collective_group(actors, group_name="abandoned")
    directory = ray.get(actors[0].directory.remote())
    print(json.dumps({"job": ray.get_runtime_context().get_job_id(),
                      "directory": directory, "exists": os.path.isdir(directory)}))
