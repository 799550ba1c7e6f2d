"""``python -m lightning_gpuopt``: the same as the ``gpuopt`` command."""

from lightning_gpuopt.cli import main

if __name__ == "__main__":
    main()
