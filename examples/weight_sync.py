"""Weight sync: a trainer publishes its model after every step; four inference actors receive
each version into their own arrays and answer queries with it; a fifth joins half way.

    python examples/weight_sync.py

The actor classes know nothing of collectives: the driver forms the weight sync around them
(``declare_weight_sync``), and each step calls ``publish_weights`` in the trainer and
``receive_weights`` in every engine. Each engine checks the version it got and answers a
query; the driver checks every answer against the trainer's own.
"""

import numpy as np
import ray

import ray_collective as col

SHAPES = {"hidden.w": (32, 64), "hidden.b": (64,), "out.w": (64, 4), "out.b": (4,)}


def forward(weights, x):
    hidden = np.maximum(x @ weights["hidden.w"] + weights["hidden.b"], 0)
    return hidden @ weights["out.w"] + weights["out.b"]


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.weights = {k: rng.standard_normal(s).astype(np.float32) * 0.1
                        for k, s in SHAPES.items()}
        self.data = rng.standard_normal((256, 32)).astype(np.float32)
        self.target = rng.standard_normal((256, 4)).astype(np.float32)

    def step_and_publish(self, version):
        # One step of gradient descent on the output layer (the rest stays put, so later
        # versions send only the buckets that changed).
        hidden = np.maximum(self.data @ self.weights["hidden.w"] + self.weights["hidden.b"], 0)
        error = hidden @ self.weights["out.w"] + self.weights["out.b"] - self.target
        self.weights["out.w"] -= 0.01 * hidden.T @ error / len(error)
        self.weights["out.b"] -= 0.01 * error.mean(axis=0)
        return col.publish_weights(self.weights, "policy", version=version)

    def answer(self, query):
        return forward(self.weights, query)


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self):
        self.weights = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        self.version = None

    def refresh(self):
        self.version = col.receive_weights(self.weights, "policy")
        return self.version

    def answer(self, query):
        return self.version, forward(self.weights, query)


def main():
    ray.init()
    trainer, engines = Trainer.remote(), [Engine.remote() for _ in range(4)]
    col.declare_weight_sync([trainer], engines, name="policy")
    query = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    for version in range(1, 7):
        if version == 4:
            newcomer = Engine.remote()
            col.add_weight_subscribers("policy", [newcomer])
            engines.append(newcomer)
        refs = [trainer.step_and_publish.remote(version)]
        refs += [engine.refresh.remote() for engine in engines]
        got = ray.get(refs)
        expected = ray.get(trainer.answer.remote(query))
        answers = ray.get([engine.answer.remote(query) for engine in engines])
        same = all(v == version and np.array_equal(a, expected) for v, a in answers)
        print(f"version {version}: delivered {got[1:]} to {len(engines)} engines, "
              f"answers match the trainer's: {same}")
    col.destroy_weight_sync("policy")
    ray.shutdown()


if __name__ == "__main__":
    main()
