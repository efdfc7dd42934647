"""Data parallelism for lm-eval under the launchers users already run (``torchrun``,
``accelerate launch``): each process is one rank with its own model, lm-eval's evaluator gives it
its share of the requests and gathers the results on rank 0.

The launchers set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:class:`DataParallel` joins (or reuses) the default ``torch.distributed`` process group from
them: NCCL when the model is on a CUDA device, gloo on the CPU. Without a launcher (or with one
process) there is nothing to join and nothing changes.
"""

from __future__ import annotations

import os

__all__ = ["DataParallel", "launcher_ranks"]


def launcher_ranks() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` that a launcher put in the environment; ``(0, 1, 0)``
    without one.

    Raises:
        ValueError: a variable that is not a whole number, or a rank outside the world.
    """
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as exc:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be whole numbers: {exc}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    return rank, world, local


class DataParallel:
    """This process's place among the ranks, and lm-eval's communication primitives over the
    default process group.

    Args:
        device: where this rank's model lives (``"cpu"``, ``"cuda:1"``, ...): the collective
            backend follows it (NCCL for CUDA, gloo otherwise), and so does the device of the
            tensors lm-eval gathers.
    """

    def __init__(self, device: str = "cpu"):
        self.rank, self.world_size, self.local_rank = launcher_ranks()
        self.device = str(device)
        if self.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                backend = "nccl" if self.device.startswith("cuda") else "gloo"
                dist.init_process_group(backend=backend)  # env://: the launcher's variables
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @staticmethod
    def rank_device(local_rank: int) -> str:
        """``cuda:LOCAL_RANK`` when CUDA is available, else ``"cpu"``."""
        import torch

        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"

    def all_gather(self, tensor):
        """Every rank's ``tensor``, concatenated in rank order (a 0-d tensor gives a 1-d one of
        length ``world_size``), as ``accelerate``'s ``gather`` returns it."""
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        tensor = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        """Every rank's ``obj`` as a list in rank order on rank ``dst``; ``None`` on the others."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == dst else None
        if self.device.startswith("cuda"):  # NCCL moves the pickled bytes through this device
            import torch

            torch.cuda.set_device(self.device)
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
