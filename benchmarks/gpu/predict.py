"""GPU check section ``predict``: predict_peak against max_memory_allocated / max_memory_reserved.

For an MLP, a ResNet-18 and a tiny GPT-2 (AdamW, fp32 and bf16-mixed): two real steps from an empty cache
against ``predict_peak(..., device="cuda")``: within ±5 % of ``max_memory_allocated`` and at most 15 % under
``max_memory_reserved`` (cuBLAS's workspace taken first, left out of both). Writes ``predict/predict.json``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import figure, labelled, mlp, write_json
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

ALLOCATED_BAND = 0.05
RESERVED_UNDER = 0.15


def _models() -> dict[str, Any]:
    import torchvision

    def classify(m: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    def mlp4096() -> tuple:
        return mlp(1024, 4096, 4096, 10), lambda n: labelled(n, 1024), classify

    def resnet() -> tuple:
        return torchvision.models.resnet18(num_classes=10), lambda n: labelled(n, 3, 64, 64), classify

    models = {"mlp": mlp4096, "resnet18": resnet}
    try:
        import transformers
    except ImportError:
        return models

    def gpt2() -> tuple:
        config = transformers.GPT2Config(n_layer=4, n_head=8, n_embd=512, vocab_size=8000, n_positions=512)

        def batch(n: int) -> dict:
            ids = torch.randint(0, 8000, (n, 256))
            return {"input_ids": ids, "labels": ids}

        return transformers.GPT2LMHeadModel(config), batch, lambda m, b: m(**b).loss

    models["gpt2"] = gpt2
    return models


def _measure(make: Any, n: int, precision: str) -> tuple[int, int]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model, make_batch, step = make()
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        batch = move_data_to_device(make_batch(n), "cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = step(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss, batch
    torch.cuda.synchronize()
    result = torch.cuda.max_memory_allocated() - base_alloc, torch.cuda.max_memory_reserved() - base_reserved
    del model, opt
    torch.cuda.empty_cache()
    return result


def section(sizes: dict[str, Any]) -> dict[str, Any]:
    """Every model at ``sizes["batches"]`` and ``sizes["precisions"]``; a figure per row."""
    from lightning_gpuopt.memory import predict_peak

    rows = []
    # A first matmul takes cuBLAS's workspace for the process: take it before measuring, so that
    # every measurement counts it as the prediction does (allocated through the allocator, kept).
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    workspace_taken = torch.cuda.memory_allocated()
    for name, make in _models().items():
        for precision in sizes["precisions"]:
            for n in sizes["batches"]:
                torch.manual_seed(0)
                allocated, reserved = _measure(make, n, precision)
                model, make_batch, step = make()
                start = time.perf_counter()
                optimizer = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
                options = dict(step=step, precision=precision, device="cuda", workspace_bytes=0)
                p = predict_peak(model, make_batch(n), optimizer, **options)
                row = dict(model=name, precision=precision, batch=n, predicted=p.peak_bytes)
                row.update(max_memory_allocated=allocated, max_memory_reserved=reserved)
                error, under = p.peak_bytes / allocated - 1, 1 - p.peak_bytes / reserved
                row.update(error_allocated=error, under_reserved=under)
                row.update(seconds=time.perf_counter() - start, peak_at=f"{p.phase} of step {p.step}")
                rows.append({**row, "ok": abs(error) <= ALLOCATED_BAND and under <= RESERVED_UNDER})
                mib = [f"{b / 2**20:8.1f}" for b in (p.peak_bytes, allocated, reserved)]
                line = f"{name:9s} {precision:10s} n={n:3d} predicted {mib[0]} MiB  allocated {mib[1]} ({error:+.1%})"
                line += f"  reserved {mib[2]} (under by {under:.1%})  {'ok' if rows[-1]['ok'] else 'MISS'}"
                print(line, flush=True)
    result = dict(torch=torch.__version__, device=torch.cuda.get_device_name())
    result.update(workspace_taken_before=workspace_taken, rows=rows, ok=all(r["ok"] for r in rows))
    write_json(sizes["out"], "predict/predict.json", result)
    target = f"within +-{ALLOCATED_BAND:.0%}, at most {RESERVED_UNDER:.0%} under reserved"
    what = "predicted peak vs max_memory_allocated, {model} {precision} batch {batch}"
    unit = "relative error"
    figures = [figure(what.format(**r), r["error_allocated"], unit, target, r["ok"]) for r in rows]
    return {"figures": figures, "details": result, "skipped": {}}
