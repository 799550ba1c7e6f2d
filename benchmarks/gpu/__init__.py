"""The GPU check (``bash benchmarks/gpu_check.sh all OUT_DIR``): its runner ``check.py``, the device layer, the sections."""
