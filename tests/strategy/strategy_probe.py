"""A hook the CLI tests attach (by import path) to see, on every rank, which strategy trained.

Each rank writes its own file in the working directory (the ranks share one stdout pipe, where
their lines can interleave).
"""

from pathlib import Path


def report(trainer, pl_module) -> None:
    line = (
        f"strategy-probe: rank {trainer.global_rank} of {trainer.world_size}, {type(trainer.strategy).__name__}, "
        f"step {trainer.global_step}"
    )
    Path(f"strategy-probe-rank{trainer.global_rank}.txt").write_text(line + "\n")


def lines(directory: Path) -> list[str]:
    """What every rank reported, sorted by rank."""
    return [p.read_text().strip() for p in sorted(Path(directory).glob("strategy-probe-rank*.txt"))]
