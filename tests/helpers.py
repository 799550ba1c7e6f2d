"""What many test files share: small real LightningModules and datasets, a metrics logger, the "same
training" measure, and the environment for test scripts run as subprocesses.

``tests`` is a package: import these as ``from tests.helpers import ...`` (pytest puts the repository root
on ``sys.path``, see ``pythonpath`` in pyproject.toml); a subprocess gets it from :func:`subprocess_env`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from lightning_gpuopt import GPUOptDataModule

#: The repository root: on ``sys.path`` in tests, so that ``tests`` and ``examples`` import as packages.
REPO = Path(__file__).resolve().parents[1]

TRAINER_QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "accelerator": "cpu",
    "devices": 1,
    "num_sanity_val_steps": 0,
}


class IndexedRegression(Dataset):
    """Sample i is (i, x_i, y_i) with y a fixed linear function of x: ids let tests count deliveries."""

    def __init__(self, length: int = 64, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, dim, generator=g)
        self.w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ self.w

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class IndexedData40(GPUOptDataModule):
    """A GPUOptDataModule over 40 samples of :class:`IndexedRegression` (ids 0-39)."""

    def train_dataset(self):
        return IndexedRegression(40)


class RecordingRegressor(pl.LightningModule):
    """A small MLP regressor that records the sample ids of every training and validation batch."""

    def __init__(self, dim: int = 8, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr
        self.train_ids: list[list[int]] = []
        self.val_ids: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        if self.training:  # OOMRecovery's one-time loss-weighting check runs this step in eval mode, no grad
            self.train_ids.append(ids.tolist())
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        ids, x, y = batch
        self.val_ids.append(ids.tolist())
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MetricsLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)`` in ``rows``."""

    name, version = "collect", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def experiment(self) -> None:
        return None

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


#: What a launcher tells a process about its place in a distributed run (torchrun's and Lightning's names).
LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)


def free_port() -> int:
    """A TCP port free now, below the kernel's ephemeral range (32768 and up on Linux).

    A port from that range (what binding port 0 gives, and Lightning's own choice) can be handed to any
    outgoing connection in the meantime: with gloo processes coming and going through the suite, CI saw a
    rank's store fail with EADDRINUSE on such a port.
    """
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port between 20000 and 32000")


def run_as_two_nodes(argv: list[str], cwd, timeout: float = 400) -> list[str]:
    """Run ``argv`` twice at once as the two nodes of one job on 127.0.0.1 (``NODE_RANK`` 0 and 1); each
    node's output. Both must succeed; on a timeout every process of both is killed."""
    import signal
    import subprocess

    env = {**subprocess_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            argv,
            cwd=cwd,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: the launcher's children go with it on a timeout
        )
        for node in (0, 1)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    for node, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"node {node} exited with {proc.returncode}:\n{log[-4000:]}"
    return logs


def subprocess_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a test script run as a subprocess: the repository root first on ``PYTHONPATH`` (so
    that it imports ``tests.helpers`` and the other test modules as a package, whatever its working
    directory), Lightning's tips off, plus ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # A script run is a launch of its own: none of this process's place in a distributed run goes with it.
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {
        **inherited,
        "PYTHONPATH": path,
        "LIGHTNING_DISABLE_TIPS": "1",
        "MASTER_PORT": str(free_port()),
        **extra,
    }


# --- "Same training": the one measure every parity test uses (docs/oom-recovery.md, "Guarantees").


def parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached float64 copy of every parameter, by name: a θ to compare."""
    return {name: p.detach().to("cpu", torch.float64).clone() for name, p in module.named_parameters()}


def _flat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).to(torch.float64) for n in names])


def training_distance(
    theta0: dict[str, torch.Tensor], theta: dict[str, torch.Tensor], theta_ref: dict[str, torch.Tensor]
) -> float:
    """‖Δθ − Δθ_ref‖ / ‖Δθ_ref‖ with Δθ = θ_N − θ_0, over all parameters (a run against its reference).

    Both runs must start from the same θ_0. The measure ignores how far training moved in absolute terms:
    0 is identical training, 1 is as far off as not training at all.
    """
    if set(theta) != set(theta_ref) or set(theta0) != set(theta):
        raise ValueError("the three parameter sets must name the same parameters")
    names = sorted(theta)
    start = _flat(theta0, names)
    delta, delta_ref = _flat(theta, names) - start, _flat(theta_ref, names) - start
    norm = delta_ref.norm()
    if norm == 0:
        raise ValueError("the reference run did not move its parameters: nothing to compare against")
    return float((delta - delta_ref).norm() / norm)


def gradient_distance(grads: dict[str, torch.Tensor], grads_ref: dict[str, torch.Tensor]) -> float:
    """‖g − g_ref‖ / ‖g_ref‖ over all gradients (the first batch's, which scale-invariant optimizers hide)."""
    names = sorted(grads_ref)
    ref = _flat(grads_ref, names)
    return float((_flat(grads, names) - ref).norm() / ref.norm())


def assert_same_training(
    theta0: dict[str, torch.Tensor],
    theta: dict[str, torch.Tensor],
    theta_ref: dict[str, torch.Tensor],
    floor: float,
    factor: float = 2.0,
    elementwise: bool = False,
) -> float:
    """Assert the run trained like its reference: distance ≤ ``factor`` × the case's own ``floor``.

    ``floor`` is the distance the case reaches with k = 2 and the exact weighting (measured, not guessed);
    it is clamped to at least 1e-12 so a bit-exact floor still leaves rounding room. ``elementwise`` adds
    an allclose per parameter (64-true runs). Returns the distance so tests can report it.
    """
    distance = training_distance(theta0, theta, theta_ref)
    bound = factor * max(floor, 1e-12)
    assert distance <= bound, f"training distance {distance:.3g} > {factor} x floor {floor:.3g}"
    if elementwise:
        for name in theta_ref:
            torch.testing.assert_close(theta[name], theta_ref[name], rtol=1e-9, atol=1e-12, msg=name)
    return distance


def run_script(main: Callable[[], object]) -> NoReturn:
    """Run a multi-process test script's ``main`` and end the process with its status at once.

    A script's result is what it saved and its exit status. The teardown after a run is not under
    test, and there gloo's threads race the destruction of the process group: in full-suite runs a
    script ended "terminate called without an active exception" (SIGABRT) after a run that had
    succeeded and saved its results, also with the group destroyed before the interpreter's exit (as
    `gpuopt` does, ``lightning_gpuopt.cli._close_process_group``). Every collective has completed when
    ``main`` returns, so the streams are flushed and the process ends with ``os._exit``, leaving the
    connections to the kernel: 0, the code of a ``SystemExit``, or 1 after an exception (its traceback
    printed; Lightning has already stopped the other ranks).
    """
    import traceback

    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- The one multi-process harness: a script launches its ranks (Lightning's DDP/FSDP2 launcher does), each rank
# writes down what it ended with (RankRecorder), the test runs the script (run_ranks) and reads every rank's file.


def run_ranks(
    script: Path,
    out: Path,
    *args: object,
    ranks: int = 2,
    timeout: float = 300,
    expect_failure: bool = False,
    result: str = "rank{rank}.pt",
) -> list:
    """Run ``python script out *args`` in its own process group and return each rank's saved result.

    The script's exit status must say failure exactly when ``expect_failure``. On a timeout every process of
    the group (the ranks the script launched too) is killed and the test fails: ranks that disagree end the
    test, never hang it. ``result`` names a rank's file (``.pt``: ``torch.load``; ``.json``: ``json``).
    """
    import json
    import signal
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), *map(str, args)],
        cwd=out,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired as err:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        raise AssertionError(
            f"{script.name} still ran after {timeout:.0f} s: killed with its ranks\n{log[-4000:]}"
        ) from err
    finally:
        try:  # a rank left behind by a failed launch goes with its group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert (proc.returncode != 0) == expect_failure, (
        f"{script.name} exited with {proc.returncode}:\n{log[-4000:]}"
    )
    paths = [out / result.format(rank=r) for r in range(ranks)]
    if result.endswith(".json"):
        return [json.loads(p.read_text()) for p in paths]
    return [torch.load(p, weights_only=False) for p in paths]


class RankRecorder(pl.Callback):
    """Writes what a rank of a multi-process test ended with to ``out_dir/file``, also when its fit raises.

    Each rank trains under its own :class:`~lightning_gpuopt.testing.SimulatedMemory` (``self.mem``) when
    ``simulate_memory``. Subclasses say what to record in :meth:`result`. A spawned rank's exception skips
    ``on_exception`` (only the launching process calls it), so the fit loop is wrapped to record it; a rank in
    ``lingering_ranks`` then waits a moment, so that the others reach their own error and write it down before
    the launcher stops them.
    """

    file = "rank{rank}.pt"
    lingering_ranks: tuple[int, ...] = ()

    def __init__(self, out_dir: str, simulate_memory: bool = True) -> None:
        self.out_dir, self.simulate_memory = out_dir, simulate_memory
        self.mem = None

    def setup(self, trainer, pl_module, stage):
        if self.simulate_memory:
            from lightning_gpuopt.testing import SimulatedMemory

            self.mem = SimulatedMemory()
            self.mem.__enter__()
        run = trainer.fit_loop.run

        def run_and_record():
            try:
                return run()
            except BaseException as error:
                self.save(trainer, pl_module, error)
                if trainer.global_rank in self.lingering_ranks:
                    import time

                    time.sleep(3)
                raise

        trainer.fit_loop.run = run_and_record

    def result(self, trainer, pl_module, error: BaseException | None) -> dict:
        raise NotImplementedError

    def save(self, trainer, pl_module, error: BaseException | None = None) -> None:
        if self.mem is not None:
            self.mem.limit_bytes = None  # writing the results down is not part of the test
        result = self.result(trainer, pl_module, error)
        result["error"] = None if error is None else (type(error).__name__, str(error))
        torch.save(result, os.path.join(self.out_dir, self.file.format(rank=trainer.global_rank)))
        if self.mem is not None:
            self.mem.__exit__(None, None, None)
            self.mem = None

    def on_fit_end(self, trainer, pl_module):
        self.save(trainer, pl_module)
