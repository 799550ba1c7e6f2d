"""Data loading: the DataModule base and its loader tuning."""

from lightning_gpuopt.data.datamodule import GPUOptDataModule, auto_num_workers

__all__ = ["GPUOptDataModule", "auto_num_workers"]
