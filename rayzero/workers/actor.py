"""The Ray actor hosting one rank: a thin shim that forwards every call to `Rank`."""

from __future__ import annotations

import ray

from rayzero.config import RootConfig
from rayzero.workers.rank import Rank


class RankShim:
    """Forwards every call to a `Rank`; `RankActor` is this as a Ray actor."""

    def __init__(self, cfg: RootConfig, rank: int, world_size: int, data_path: str, factory=None):
        self.rank = Rank(cfg, rank, world_size, data_path, factory)

    # In its own thread, so the controller's watchdog gets an answer while a phase runs.
    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        return self.rank.progress()

    def address(self) -> tuple[str, int]:
        return self.rank.address(ray.util.get_node_ip_address())

    def setup(self, master_addr: str, master_port: int) -> dict:
        return self.rank.setup(master_addr, master_port)

    def gather(self, plan: dict) -> dict:
        return self.rank.gather(plan)

    def forward(self, prev: dict) -> dict:
        return self.rank.forward(prev)

    def backward(self, prev: dict) -> dict:
        return self.rank.backward(prev)

    def reduce_scatter(self, prev: dict) -> dict:
        return self.rank.reduce_scatter(prev)

    def step(self, prev: dict) -> dict:
        return self.rank.step(prev)

    def evaluate(self, prev: dict) -> dict:
        return self.rank.evaluate(prev)

    def finish_checkpoints(self) -> list[dict]:
        return self.rank.finish_checkpoints()

    def load_checkpoint(self, uri: str, manifest: dict) -> dict:
        return self.rank.load_checkpoint(uri, manifest)

    def apply_checkpoint(self) -> dict:
        return self.rank.apply_checkpoint()

    def full_state_dict(self) -> dict:
        return self.rank.full_state_dict()

    def close(self) -> None:
        self.rank.close()


def rank_actor(cls: type = RankShim):
    """`cls` (RankShim or a subclass) as a Ray actor class with the watchdog's thread."""
    return ray.remote(concurrency_groups={"control": 1})(cls)


RankActor = rank_actor()
