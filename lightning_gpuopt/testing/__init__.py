"""Test helpers: :class:`SimulatedMemory`, a CPU stand-in for a GPU's memory, so memory logic runs in CI."""

from lightning_gpuopt.testing.simulated_memory import SimulatedMemory

__all__ = ["SimulatedMemory"]
