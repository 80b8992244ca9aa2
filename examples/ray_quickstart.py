"""raysync quickstart: push a trainer actor's weights into two engine actors with WeightSync.

Runs as a plain script (`python examples/ray_quickstart.py`, starts a local Ray) or on a cluster
(`ray job submit -- python examples/ray_quickstart.py`, joins it). Steps:

1. Define the actors as you already do: raysync needs no base class, only ``self.model`` by default.
2. Start them, hand them to WeightSync: it finds where each runs and picks a transport per pair.
3. After each optimizer step, ``sync.push(version)`` moves the weights into every engine.
4. Check that the engines' weights changed and equal the trainer's.
"""

import ray
import torch

from raysync import SyncConfig, WeightSync


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(32000, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)
    )


@ray.remote(num_cpus=0.25)
class Trainer:
    def __init__(self):
        self.model = make_model()

    def train_step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.9).add_(torch.randn_like(p) * 0.1)
        return [p.detach().clone() for p in self.model.parameters()]


@ray.remote(num_cpus=0.25)
class Engine:
    def __init__(self):
        self.model = make_model()

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]


ray.init()
trainer = Trainer.remote()
engines = [Engine.remote() for _ in range(2)]
before = ray.get(engines[0].weights.remote())

with WeightSync([trainer], engines, SyncConfig(bucket_bytes=8 << 20)) as sync:
    print(sync.plan)
    for step in range(1, 4):
        expected = ray.get(trainer.train_step.remote())
        print(sync.push(version=step))

after = [ray.get(e.weights.remote()) for e in engines]
changed = not all(torch.equal(a, b) for a, b in zip(before, after[0], strict=True))
same = all(torch.equal(a, b) for engine in after for a, b in zip(engine, expected, strict=True))
print(f"engine weights changed: {changed}; equal to the trainer's: {same}")
assert changed and same
print("OK")
