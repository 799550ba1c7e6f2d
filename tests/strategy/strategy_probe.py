"""A hook the CLI tests attach (by import path) to see, on every rank, which strategy trained."""


def report(trainer, pl_module) -> None:
    print(f"strategy-probe: rank {trainer.global_rank} of {trainer.world_size}, {type(trainer.strategy).__name__}, "
          f"step {trainer.global_step}", flush=True)
