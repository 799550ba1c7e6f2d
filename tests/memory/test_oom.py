from __future__ import annotations

import pytest
import torch

from lightning_gpuopt.memory import (
    MAYBE_SIZE_MESSAGES,
    OOM_MESSAGES,
    free_memory,
    is_maybe_size_error,
    is_oom_error,
)

# Messages as the libraries print them (one per entry of OOM_MESSAGES, in order).
REAL_OOM_MESSAGES = [
    (
        "caching-allocator",
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
        "1.20 GiB is free. Of the allocated memory 75.3 GiB is allocated by PyTorch",
    ),
    ("cuda-error", "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    ("cuda-driver", "CUDA driver error: out of memory"),
    ("cublas", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ("cudnn-alloc", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    (
        "cpu-allocator",
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 80000000000000 bytes. Error code 12 (Cannot allocate memory)",
    ),
    ("hip", "HIP out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 63.98 GiB"),
    ("hip-error", "HIP error: out of memory"),
]


def test_every_listed_message_has_a_real_example():
    assert len(REAL_OOM_MESSAGES) == len(OOM_MESSAGES)
    for (_, text), marker in zip(REAL_OOM_MESSAGES, OOM_MESSAGES):
        assert marker in text


@pytest.mark.parametrize("text", [t for _, t in REAL_OOM_MESSAGES], ids=[i for i, _ in REAL_OOM_MESSAGES])
def test_messages_are_oom_as_runtime_error(text):
    err = RuntimeError(text)
    assert is_oom_error(err)
    assert not is_maybe_size_error(err)


def test_message_counts_on_other_exception_types_too():
    # torch >= 2.8 raises some CUDA errors as torch.AcceleratorError; wrappers may use other types.
    class AcceleratorError(RuntimeError):
        pass

    assert is_oom_error(AcceleratorError("CUDA error: out of memory"))
    assert is_oom_error(Exception("CUDA out of memory. Tried to allocate 20.00 MiB"))


def test_type_alone_is_enough():
    assert is_oom_error(torch.OutOfMemoryError("allocator said no"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("allocator said no"))


def test_simulated_message_is_oom_for_lightning_too():
    from lightning.pytorch.utilities.memory import is_oom_error as lightning_is_oom_error

    err = torch.OutOfMemoryError(
        "CUDA out of memory (simulated). Tried to allocate 1.00 MiB (1048576 bytes); 0 bytes in use; limit 1.00 KiB"
    )
    assert is_oom_error(err)
    assert lightning_is_oom_error(err)


@pytest.mark.parametrize(
    "err",
    [
        ValueError("shapes (2, 3) and (4, 5) do not match"),
        RuntimeError("out of memory"),  # no device named: not one of the known wordings
        RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
        RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
        ),
        KeyboardInterrupt(),
        SystemExit("CUDA out of memory"),  # not an Exception: never swallowed as an OOM
    ],
    ids=[
        "value-error",
        "bare-wording",
        "device-mismatch",
        "cudnn-not-supported",
        "keyboard-interrupt",
        "system-exit",
    ],
)
def test_not_oom(err):
    assert not is_oom_error(err)


def test_chained_oom_is_not_followed():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as oom:
            raise ValueError("while logging the OOM") from oom
    except ValueError as err:
        assert not is_oom_error(err)


def test_broken_str_does_not_raise():
    class Weird(RuntimeError):
        def __str__(self):
            raise TypeError("no")

    assert not is_oom_error(Weird())


def test_cudnn_not_supported_is_maybe_size_related():
    text = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    assert MAYBE_SIZE_MESSAGES[0] in text
    assert is_maybe_size_error(RuntimeError(text))
    assert not is_maybe_size_error(RuntimeError("CUDA out of memory"))
    assert not is_maybe_size_error(ValueError("bad shape"))


def test_free_memory_clears_workspaces_before_emptying_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear_cublas"), raising=False
    )
    monkeypatch.setattr("gc.collect", lambda *a: calls.append("gc") or 0)
    free_memory()
    assert calls == ["gc", "clear_cublas", "empty_cache"]


def test_free_memory_without_cublas_hook(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    free_memory()
    assert calls == ["empty_cache"]


def test_free_memory_does_not_initialise_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def fail():
        raise AssertionError("empty_cache must not run (it would initialise CUDA)")

    monkeypatch.setattr(torch.cuda, "empty_cache", fail)
    free_memory()


def test_free_memory_collects_reference_cycles():
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    a.payload = torch.zeros(10)
    alive = weakref.ref(a.payload)
    del a, b
    free_memory()
    assert alive() is None
