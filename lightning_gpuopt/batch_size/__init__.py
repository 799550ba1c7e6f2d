"""MemoryAwareBatchSize's search, under the callback :mod:`lightning_gpuopt.callbacks.batch_size`.

Pure (no torch, no Lightning):

- ``peak_model.py``: a step's peak memory against its (micro-)batch size, fitted to measured steps;
- ``search.py``: the measured search (at most four real steps) and the loop that runs any search;
- ``predicted.py``: the search started from traced steps (at most three real steps).

On a Trainer (no callback):

- ``trial.py``: real training steps that leave no trace, and their peaks;
- ``trace.py``: the training step traced on fake tensors, the start of the predicted search;
- ``modes.py``: what each mode searches over (``"micro"``: the fetched batch; ``"max"``: the dataset);
- ``find.py``: one search on this process: the budget, how it starts, the trial steps, what it found.
"""
