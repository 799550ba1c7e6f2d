"""Deprecated: this module is :mod:`lightning_gpuopt.batch_split` now (its job: splitting a batch into
micro-batches and merging their results). Importing it from here works for one release, with a
``DeprecationWarning``.
"""

import warnings

from lightning_gpuopt.batch_split import *  # noqa: F403
from lightning_gpuopt.batch_split import __all__  # noqa: F401

warnings.warn(
    "lightning_gpuopt.batching is lightning_gpuopt.batch_split now; the old path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
