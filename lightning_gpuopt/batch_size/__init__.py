"""MemoryAwareBatchSize's search, under the callback :mod:`lightning_gpuopt.callbacks.batch_size`."""
