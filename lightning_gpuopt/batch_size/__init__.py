"""MemoryAwareBatchSize's search, under the callback :mod:`lightning_gpuopt.callbacks.batch_size`.

Pure (no torch, no Lightning):

- ``peak_model.py``: a step's peak memory against its (micro-)batch size, fitted to measured steps;
- ``search.py``: the measured search (at most four real steps) and the loop that runs it.

On a Trainer (no callback):

- ``trial.py``: real training steps that leave no trace, and their peaks;
- ``modes.py``: what each mode searches over (``"micro"``: the fetched batch; ``"max"``: the dataset);
- ``find.py``: one search on this process: the budget, the trial steps, what they found.
"""
