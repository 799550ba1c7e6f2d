"""SimulatedMemory under torch.compile: nothing of it is traced, it changes nothing compiled, compiled steps count exactly."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import traceback
import weakref
from collections.abc import Callable

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.memory import is_oom_error
from lightning_gpuopt.memory.counting_allocator import native_status
from lightning_gpuopt.testing import SimulatedMemory
from tests.testing.conftest import require_native
from tests.testing.test_simulated_memory_accuracy import simulated_phases

TOLERANCE = 0.03  # the same contract as the eager comparison (test_simulated_memory_accuracy.py)

# torch warns when a compiled module is called while global module hooks exist (SimulatedMemory's):
# the hook then also fires for the OptimizedModule wrapper, which owns no tensor of its own. Harmless here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Using `torch.compile\\(module\\)` when there are global hooks"
)


class Classifier(nn.Module):
    """An eager parent around a body that the tests compile, and a head."""

    def __init__(self, body: nn.Module, width: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.body(x)
        return self.head(h.mean(dim=1) if h.dim() == 3 else h)


def _cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    return Classifier(body, 8), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))


def _transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    body = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    return Classifier(body, 32), torch.randn(4, 12, 32), torch.randint(0, 10, (4,))


MODELS = {"cnn": _cnn, "transformer": _transformer}


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch and leaves no compiled code or counts to the next one."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _compiled_counts() -> dict[str, int]:
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph breaks": sum(counters["graph_break"].values()),
    }


def _compiled_training(model_name: str, form: str, simulation: str | None) -> dict[str, int]:
    """Two training steps of a model compiled in ``form``, under ``SimulatedMemory(backend=simulation)``."""
    torch._dynamo.reset()
    counters.clear()
    model, x, y = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # traced in the "step" form: the optimizer pre-hook runs inside compiled code
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if form == "block":
        model.body = torch.compile(model.body, backend="aot_eager")
    else:
        step = torch.compile(step, backend="aot_eager")
    simulated = SimulatedMemory(backend=simulation) if simulation else contextlib.nullcontext()
    with simulated:
        for _ in range(2):
            step(x, y)
    return _compiled_counts()


_without_simulation: dict = {}


@pytest.mark.parametrize(
    ("model_name", "form"),
    [("cnn", "block"), ("transformer", "block"), ("cnn", "step")],
    ids=["cnn-compiled-block", "transformer-compiled-block", "cnn-compiled-step"],
)
def test_compiles_the_same_graphs_and_breaks_as_without(backend, model_name, form, fresh_dynamo):
    key = (model_name, form)
    if key not in _without_simulation:  # shared by the backends
        _without_simulation[key] = _compiled_training(model_name, form, None)
    reference = _without_simulation[key]
    assert reference["graphs"] >= 1
    assert _compiled_training(model_name, form, backend) == reference


def test_a_loader_iterated_inside_compiled_code_compiles_as_without(backend, fresh_dynamo):
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

    def doubled_sum(batches):
        (x,) = next(batches)  # dynamo breaks the graph here, with or without the simulation
        return (x * 2).sum()

    results = {}
    for simulation in (None, backend):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(doubled_sum, backend="eager")
        with SimulatedMemory(backend=simulation) if simulation else contextlib.nullcontext():
            batches = iter(loader)
            values = [compiled(batches).item() for _ in range(2)]
        results[simulation] = (values, _compiled_counts())
    assert results[backend] == results[None]


def _opaque_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A dynamo backend whose compiled code is no module call, like inductor's (aot_eager calls its graph
    as a module, so the module hook sees the graph's inputs), without inductor's compile time."""
    return gm.forward


@pytest.fixture
def one_process_group():
    """A gloo process group of one rank in this process, destroyed afterwards."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_collective_inside_compiled_code_compiles_as_without(backend, one_process_group, fresh_dynamo):
    # SimulatedMemory wraps torch.distributed's collectives (their allocations never raise in eager
    # code); inside compiled code the wrapper hands dynamo the original, which it makes traceable.
    layer = nn.Linear(16, 16)
    x = torch.randn(4, 16)

    @torch.no_grad()
    def reduced(x):
        y = layer(x).relu() * 2
        dist.all_reduce(y)
        return y.sum()

    results = {}
    for simulation in (None, backend):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(reduced, backend="aot_eager")
        with SimulatedMemory(backend=simulation) if simulation else contextlib.nullcontext():
            value = [compiled(x) for _ in range(2)][-1].item()
        results[simulation] = (value, _compiled_counts())
    assert results[backend] == results[None]
    assert results[None][1] == {"graphs": 1, "graph breaks": 0}


def _forward_backward_state(model: nn.Module, x: torch.Tensor, y: torch.Tensor, backend: str) -> int:
    """What stays counted after a forward and a backward of a model made before entering (no track)."""
    with SimulatedMemory(backend=backend) as mem:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        del loss
        return mem.allocated_bytes


@pytest.mark.parametrize("form", ["compiled model", "compiled block", "block.compile()"])
def test_tensors_made_before_entering_count_in_compiled_code(backend, form, fresh_dynamo):
    # Dynamo inlines the submodules' calls, so their hooks never run eagerly: the eager call around
    # them (the OptimizedModule's, the parent's) counts its whole module tree, as eager code does.
    # The opaque backend: inductor's case, where no module hook sees the compiled graph's inputs.
    model, x, y = _cnn()
    eager = _forward_backward_state(model, x, y, backend)
    model.zero_grad(set_to_none=True)
    state = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    gradients = sum(p.nbytes for p in model.parameters())
    assert eager == state + gradients + x.nbytes  # parameters, buffers, gradients, the module's input

    if form == "compiled model":
        compiled = torch.compile(model, backend=_opaque_backend)
    else:
        compiled = model
        if form == "compiled block":
            model.body = torch.compile(model.body, backend=_opaque_backend)
        else:
            model.body.compile(backend=_opaque_backend)
    assert _forward_backward_state(compiled, x, y, backend) == eager
    assert counters["stats"]["unique_graphs"] >= 1  # it did run compiled


class LitCNN(L.LightningModule):
    """The CNN as a LightningModule that records what is counted at two moments of its first step."""

    def __init__(self):
        super().__init__()
        self.model, x, y = _cnn()
        self.data = TensorDataset(x.repeat(2, 1, 1, 1), y.repeat(2))
        self.allocated: dict[str, int] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def on_before_backward(self, loss):  # eager, between the compiled forward and the backward
        self.allocated.setdefault("first backward", _probe_allocated())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.allocated.setdefault("first step end", _probe_allocated())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)


def _probe_allocated() -> int:
    from lightning_gpuopt.memory import get_probe

    return get_probe().allocated


def test_a_compiled_lightning_module_counts_its_parameters_from_the_first_step(
    native, tmp_path, fresh_dynamo
):
    # trainer.fit(torch.compile(model)): Lightning compiles training_step, so on one device no module
    # call is eager. The optimizer's pre-hook, which Lightning runs before the first training_step
    # (the step runs in the optimizer's closure), counts the parameters; buffers only reached inside
    # compiled code count with track().
    allocated = {}
    for tracked in (False, True):
        torch._dynamo.reset()
        counters.clear()
        lit = LitCNN()
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        with SimulatedMemory(backend="allocator") as mem:
            if tracked:
                mem.track(lit)
            trainer.fit(torch.compile(lit, backend=_opaque_backend))
        assert counters["stats"]["unique_graphs"] >= 1
        allocated[tracked] = lit.allocated
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in lit.buffers())
    assert buffer_bytes > 0
    for moment in ("first backward", "first step end"):
        assert allocated[True][moment] - allocated[False][moment] == buffer_bytes, moment


def test_the_dispatch_backend_says_what_it_misses_under_compile(caplog, fresh_dynamo):
    model, x, _ = _cnn()
    model.body = torch.compile(model.body, backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="lightning_gpuopt.testing.simulated_memory"):
        mem = SimulatedMemory(backend="dispatch")
        with mem:
            for _ in range(2):
                model(x).sum().backward()  # compiles the forward, then the backward
        gone = weakref.ref(mem)
        del mem
        gc.collect()
        assert gone() is None  # exit removed its listener to dynamo's compilations
        if native_status() is None:  # the allocator backend has no such note
            with SimulatedMemory(backend="allocator"):
                torch.compile(lambda t: t + 1, backend="aot_eager")(x)
    notes = [r.getMessage() for r in caplog.records if "under torch.compile" in r.getMessage()]
    assert len(notes) == 1  # once, at the first compilation
    assert "backend='allocator'" in notes[0]


# --- inductor: one model, one form (a compiled block), fp32 -------------------------------------


@pytest.fixture(scope="module")
def inductor_mlp():
    """An MLP whose body is compiled by inductor: compiled once plainly and once under SimulatedMemory.

    Yields the model warm (compiled), its Adam optimizer, a batch, and the graph counts of both compilations.
    """
    require_native()  # inductor's CPU kernels need the C++ compiler that builds the counting allocator
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU())
    model = Classifier(torch.compile(body, backend="inductor"), 256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    counts = {}
    # Last compiled outside: that code runs under SimulatedMemory without recompiling. (Code compiled
    # under it guards on its module hook and recompiles once outside.)
    for simulated in (True, False):
        torch._dynamo.reset()
        counters.clear()
        with SimulatedMemory() if simulated else contextlib.nullcontext():
            for _ in range(2):
                _full_step(model, opt, x, y)
        counts[simulated] = _compiled_counts()
    yield model, opt, x, y, counts
    torch.set_num_threads(threads)
    torch._dynamo.reset()
    counters.clear()


def _phases(model, opt, x, y, upto: str, keep: list | None = None) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    if keep is not None:
        keep.append(loss)
    if upto == "forward":
        return
    loss.backward()
    if upto == "step":
        opt.step()


def _full_step(model, opt, x, y) -> None:
    opt.zero_grad(set_to_none=True)
    _phases(model, opt, x, y, "step")


def test_inductor_compiles_the_same_graphs_under_simulation(inductor_mlp):
    *_, counts = inductor_mlp
    assert counts[False]["graphs"] >= 1
    assert counts[True] == counts[False]


def test_inductor_step_peak_matches_the_profiler(inductor_mlp, profiler_peak):
    model, opt, x, y, _ = inductor_mlp
    graphs = counters["stats"]["unique_graphs"]
    reference = {}
    for upto in ("forward", "backward", "step"):
        opt.zero_grad(set_to_none=True)  # the profiler cannot size frees of blocks made before it started
        reference[upto] = profiler_peak(lambda upto=upto: _phases(model, opt, x, y, upto, []))

    opt.zero_grad(set_to_none=True)
    simulated, end = simulated_phases(model, opt, x, y)
    assert counters["stats"]["unique_graphs"] == graphs  # all of it ran the warm compiled code
    for upto, (peak, _) in reference.items():
        print(
            f"inductor MLP {upto}: simulated {simulated[upto]} / profiler {peak} = {simulated[upto] / peak:.5f}"
        )
        assert abs(simulated[upto] - peak) <= TOLERANCE * peak, upto
    reference_end = reference["step"][1]
    assert abs(end - reference_end) <= TOLERANCE * reference_end


def test_an_oom_inside_inductor_code_is_a_cuda_like_oom(inductor_mlp):
    model, opt, x, y, _ = inductor_mlp
    graphs = counters["stats"]["unique_graphs"]
    opt.zero_grad(set_to_none=True)
    with SimulatedMemory() as mem:
        mem.track(model, opt, x, y)
        mem.limit_bytes = mem.allocated_bytes + 1024  # the compiled forward's first buffer does not fit
        with pytest.raises(torch.OutOfMemoryError) as caught:
            model(x)
        err = caught.value
        assert is_oom_error(err)
        assert str(err).startswith("CUDA out of memory (simulated).")
        # Raised where inductor's generated code allocates: its innermost Python frame is that code's.
        innermost = traceback.extract_tb(err.__traceback__)[-1]
        assert not innermost.filename.startswith(os.path.dirname(torch.__file__)), innermost
        assert innermost.name == "call", innermost
        del caught, err
        mem.limit_bytes = None  # recovered: the same compiled code runs on
        _full_step(model, opt, x, y)
    assert counters["stats"]["unique_graphs"] == graphs
