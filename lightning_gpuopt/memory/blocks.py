"""A model's repeated blocks (a transformer's layers): the one rule behind FSDP2's units and the depth extrapolation.

A *run* is two or more sibling modules of one type, each holding a share of the model's parameters:
the layers of a ``ModuleList`` or ``Sequential``, or same-type attributes of one module. Only modules
that run count as blocks: a container without a ``forward`` of its own (``ModuleList``,
``ModuleDict``) is looked inside, never picked (``fully_shard`` refuses one). Runs inside a block of
another run are left out (the outermost blocks win), and a block sharing a parameter with a module
outside it (a tied embedding) is not a block. The rule is structural, so that an encoder-decoder gets
both its encoder's and its decoder's layers (``nn.Transformer``, T5, BART).

Used by :func:`lightning_gpuopt.strategy.shard_units` (FSDP2's units, planned and sharded alike) and
:func:`lightning_gpuopt.memory.predict_peak_deep` (the list of blocks it cuts to one and two).
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

__all__ = ["MIN_BLOCK_SHARE", "block_list", "repeated_blocks", "runs_forward"]

#: The share of the model's parameters each block of a run holds at least (FSDP2's units).
MIN_BLOCK_SHARE = 0.01


def runs_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own (``ModuleList`` and ``ModuleDict`` only hold modules).

    Example:
        >>> runs_forward(nn.Sequential()), runs_forward(nn.ModuleList())
        (True, False)
    """
    return type(module).forward is not nn.Module.forward


def _sizes(model: nn.Module) -> dict[int, int]:
    return {id(m): sum(p.numel() for p in m.parameters()) for m in model.modules()}


def _owners(model: nn.Module) -> dict[int, set[str]]:
    """Every qualified name of a module that holds each parameter directly (a tied parameter has several)."""
    owners: dict[int, set[str]] = defaultdict(set)
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners[id(p)].add(name)
    return owners


def _runs(model: nn.Module, min_share: float) -> list[list[tuple[str, nn.Module]]]:
    """The outermost runs, in the model's order: lists of (qualified name, block)."""
    sizes = _sizes(model)
    least = max(1, min_share * sizes[id(model)])
    owners = _owners(model)

    def owns_its_parameters(name: str, module: nn.Module) -> bool:
        return all(
            all(o == name or o.startswith(name + ".") for o in owners[id(p)]) for p in module.parameters()
        )

    runs: list[list[tuple[str, nn.Module]]] = []
    inside: set[int] = set()
    for name, parent in model.named_modules():  # parents before their children: outer runs first
        if id(parent) in inside:
            continue
        groups: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
        for child_name, child in parent.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            if (
                runs_forward(child)
                and sizes[id(child)] >= least
                and id(child) not in inside
                and owns_its_parameters(qualified, child)
            ):
                groups[type(child)].append((qualified, child))
        for members in groups.values():
            if len(members) >= 2:
                runs.append(members)
                inside.update(id(sub) for _, block in members for sub in block.modules())
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(runs, key=lambda run: order[id(run[0][1])])


def repeated_blocks(model: nn.Module, min_share: float = MIN_BLOCK_SHARE) -> list[nn.Module]:
    """The outermost repeated blocks of ``model``, in its order: each a module that runs, with at least one
    sibling of its type, holding at least ``min_share`` of the parameters and owning them.

    Example:
        >>> net = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32)
        >>> [type(b).__name__ for b in repeated_blocks(net)]
        ['TransformerEncoderLayer', 'TransformerEncoderLayer', 'TransformerDecoderLayer', 'TransformerDecoderLayer']
    """
    blocks = [block for run in _runs(model, min_share) for _, block in run]
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(blocks, key=lambda m: order[id(m)])


def block_list(model: nn.Module, min_blocks: int = 3) -> tuple[str, nn.Module] | None:
    """The ``nn.ModuleList`` whose items are all one run of at least ``min_blocks`` blocks, holding the most
    parameters (a transformer's layers), with its qualified name; ``None``: there is none.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(4)))
        >>> block_list(net)[0]
        '1'
    """
    modules = dict(model.named_modules())
    best: tuple[int, str, nn.Module] | None = None
    for run in _runs(model, 0.0):
        parent_name = run[0][0].rpartition(".")[0]
        parent = modules.get(parent_name)
        if not isinstance(parent, nn.ModuleList) or len(run) < min_blocks or len(run) != len(parent):
            continue
        size = sum(p.numel() for p in parent.parameters())
        if best is None or size > best[0]:
            best = (size, parent_name, parent)
    return (best[1], best[2]) if best else None
