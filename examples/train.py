"""A small but complete training run that checkpoints everything, and a demo that kills it.

``python examples/train.py train --save-dir DIR`` trains an MLP with dropout on seeded synthetic data
(AdamW, warmup + cosine LR, a shuffled ``StatefulDataLoader``) and resumes from DIR if a checkpoint is
there. ``python examples/train.py demo`` runs it three times to show that a run SIGKILLed mid-training
and resumed ends with exactly the same weights (bit for bit) as a run that never stopped.

Everything that makes two runs differ is part of the checkpoint: weights, optimizer moments, the LR
schedule, the global RNG (dropout masks), the data order and position, and the step counters.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from checkpoint_manager import (
    CheckpointConfig,
    LoadContext,
    SaveContext,
    TrainState,
    create_checkpoint_manager,
)

HERE = Path(__file__).resolve()
KEEP_LAST = 5  # the command line's default: a long run should not fill the disk with checkpoints
# torchdata 0.11 calls a torch API that torch itself deprecated; nothing for a user to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


@dataclass
class RunConfig:
    """Everything that defines one training run; two runs with the same config are identical."""

    save_dir: str
    steps: int = 300
    save_every: int = 25
    seed: int = 0
    samples: int = 2048
    features: int = 32
    classes: int = 10
    hidden: int = 256
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 20
    load_dir: str | None = None
    load_step: int | None = None
    async_save: bool = False
    fsync: bool = True
    step_delay: float = 0.0
    hang_at_step: int | None = None
    # Retention: the newest N checkpoints are kept (None: every one, as the library does by default;
    # the tests resume from each). From the command line the default is KEEP_LAST.
    keep_last: int | None = None
    verbose: bool = True
    skip_on_load: tuple[str, ...] = ()  # e.g. ("rng",): LoadContext(load_rng=False), to show it matters


class SyntheticClassification(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Seeded Gaussian inputs labelled by a random linear teacher; items carry their index (to log order)."""

    def __init__(self, samples: int, features: int, classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(10_000 + seed)
        self.x = torch.randn(samples, features, generator=g)
        teacher = torch.randn(features, classes, generator=g)
        noise = 0.5 * torch.randn(samples, classes, generator=g)
        self.y = (self.x @ teacher + noise).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def build(cfg: RunConfig) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR,
                                   StatefulDataLoader, int]:
    """Model, optimizer, scheduler and loader, all seeded, exactly as a fresh run starts."""
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(
        nn.Linear(cfg.features, cfg.hidden),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(cfg.hidden, cfg.hidden),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(cfg.hidden, cfg.classes),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)

    def warmup_cosine(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    dataset = SyntheticClassification(cfg.samples, cfg.features, cfg.classes, cfg.seed)
    # Two generators, for bit-exact resumes. The loader needs one: without it every iter(loader)
    # draws a seed from the global RNG, which a resumed run does at a moment the original did not,
    # shifting every later dropout mask. The sampler needs its own: sharing the loader's
    # (``shuffle=True, generator=g``) lets each epoch's iterator draw from it *after* the sampler
    # snapshotted its state, so a resumed run would shuffle later epochs differently.
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(20_000 + cfg.seed))
    loader = StatefulDataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(30_000 + cfg.seed),
    )
    return model, optimizer, scheduler, loader, len(dataset) // cfg.batch_size


def train(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Train to ``cfg.steps`` (resuming if a checkpoint exists) and return what a comparison needs."""
    model, optimizer, scheduler, loader, steps_per_epoch = build(cfg)
    state = TrainState()
    loss_fn = nn.CrossEntropyLoss()
    trace_steps: list[int] = []
    trace_batches: list[torch.Tensor] = []
    trace_loss: list[torch.Tensor] = []
    trace_lr: list[float] = []
    resumed_from = -1

    config = CheckpointConfig(
        save_dir=cfg.save_dir,
        load_dir=cfg.load_dir,
        load_step=cfg.load_step,
        save_every_n_steps=cfg.save_every,
        keep_last=cfg.keep_last,
        async_save=cfg.async_save,
        fsync=cfg.fsync,
    )
    with create_checkpoint_manager(config) as manager:
        skip = {f"load_{part}": False for part in cfg.skip_on_load}
        ctx = LoadContext(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          train_state=state, **skip)
        if manager.should_load(ctx):
            result = manager.load(ctx)
            resumed_from = result.step
            say(cfg, f"resumed from step {result.step} ({result.path})")
        model.train()
        batches = iter(loader)  # after a load, this continues the saved epoch at the saved batch
        while state.step < cfg.steps:
            try:
                x, y, index = next(batches)
            except StopIteration:  # end of an epoch: the sampler reshuffles for the next one
                batches = iter(loader)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            trace_lr.append(scheduler.get_last_lr()[0])
            scheduler.step()
            state.step += 1
            state.consumed_samples += len(index)
            state.epoch = state.step // steps_per_epoch
            trace_steps.append(state.step)
            trace_batches.append(index.clone())
            trace_loss.append(loss.detach().clone())
            say(cfg, f"step {state.step} loss {loss.item():.6f}")
            if cfg.hang_at_step is not None and state.step >= cfg.hang_at_step:
                say(cfg, f"hanging at step {state.step} until killed")
                while True:
                    time.sleep(3600)
            saved = manager.save(SaveContext(
                model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                train_state=state, metrics={"loss": loss.item()}, final=state.step >= cfg.steps,
            ))
            if saved is not None:
                say(cfg, f"saved step {saved.step} {saved.path}")
            manager.finalize_async_saves(blocking=False)
            if cfg.step_delay:
                time.sleep(cfg.step_delay)

    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        out[f"model/{name}"] = tensor.detach().clone()
    for index, param_state in optimizer.state_dict()["state"].items():
        for key, value in param_state.items():
            out[f"optim/{index}/{key}"] = torch.as_tensor(value).clone()
    out["sched/last_lr"] = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    out["state/counters"] = torch.tensor([state.step, state.epoch, state.consumed_samples])
    out["state/resumed_from"] = torch.tensor([resumed_from])
    out["trace/steps"] = torch.tensor(trace_steps, dtype=torch.int64)
    out["trace/batches"] = (torch.stack(trace_batches) if trace_batches
                            else torch.empty(0, cfg.batch_size, dtype=torch.int64))
    out["trace/loss"] = torch.stack(trace_loss) if trace_loss else torch.empty(0)
    out["trace/lr"] = torch.tensor(trace_lr, dtype=torch.float64)
    # What the run would do next: the global RNG (dropout) and the loader's next batch.
    out["next/rng"] = torch.rand(8)
    try:
        out["next/batch"] = next(batches)[2]
    except StopIteration:
        out["next/batch"] = next(iter(loader))[2]
    return out


def say(cfg: RunConfig, line: str) -> None:
    if cfg.verbose:
        print(line, flush=True)


def make_deterministic() -> None:
    """One thread and deterministic kernels: the same config must give the same bits in any process."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


# -- comparing two runs -----------------------------------------------------------------------------

def final_state_keys(result: dict[str, torch.Tensor]) -> list[str]:
    """Keys that describe the end state (not the per-step trace of one process)."""
    return sorted(k for k in result if not k.startswith(("trace/", "state/resumed_from")))


def compare(reference: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor]) -> list[str]:
    """Every difference between a reference run and a resumed one, as readable lines (empty: identical).

    End state must match exactly; the resumed process's trace (steps it ran itself) must equal the
    reference's trace for the same steps: same batches, same losses, same learning rates.
    """
    problems: list[str] = []
    ref_keys, res_keys = final_state_keys(reference), final_state_keys(resumed)
    if ref_keys != res_keys:
        problems.append(f"different keys: {sorted(set(ref_keys) ^ set(res_keys))}")
    for key in ref_keys:
        if key in resumed and not bitwise_equal(reference[key], resumed[key]):
            problems.append(f"{key} differs")
    steps = resumed["trace/steps"]
    if len(steps) == 0:
        problems.append("the resumed run trained no steps")
        return problems
    ref_steps = reference["trace/steps"].tolist()
    first = ref_steps.index(int(steps[0])) if int(steps[0]) in ref_steps else -1
    if first < 0 or ref_steps[first:first + len(steps)] != steps.tolist():
        problems.append(f"resumed steps {steps[0]}..{steps[-1]} are not a stretch of the reference run")
        return problems
    window = slice(first, first + len(steps))
    for key in ("trace/batches", "trace/loss", "trace/lr"):
        if not bitwise_equal(reference[key][window], resumed[key]):
            problems.append(f"{key} differs on steps {int(steps[0])}..{int(steps[-1])}")
    return problems


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.contiguous().view(_int_view(a.dtype)), b.contiguous().view(_int_view(b.dtype)))
    return torch.equal(a, b)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[dtype.itemsize]


def params_sha256(result: dict[str, torch.Tensor]) -> str:
    """A hash of the final model parameters (names, dtypes, shapes and raw bytes)."""
    digest = hashlib.sha256()
    for key in sorted(k for k in result if k.startswith("model/")):
        tensor = result[key].contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_result(path: str | Path, result: dict[str, torch.Tensor]) -> None:
    """Hand results between processes as safetensors (no pickle)."""
    tmp = Path(f"{path}.tmp")
    save_file({k: v.contiguous() for k, v in result.items()}, str(tmp))
    os.replace(tmp, path)


def load_result(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


# -- the demo ---------------------------------------------------------------------------------------

def committed_steps(save_dir: Path) -> list[int]:
    """Steps of committed checkpoints, read from their ``checkpoint.json`` (pending saves have none)."""
    steps = []
    for entry in save_dir.glob("*/checkpoint.json"):
        if entry.parent.name.startswith("."):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            steps.append(int(json.loads(entry.read_text())["step"]))
    return sorted(steps)


def child_command(cfg: RunConfig, result_path: Path | None, *, quiet: bool = False) -> list[str]:
    """The command line that runs ``cfg`` in a fresh Python process."""
    cmd = [sys.executable, str(HERE), "train", "--save-dir", cfg.save_dir, "--steps", str(cfg.steps),
           "--save-every", str(cfg.save_every), "--seed", str(cfg.seed), "--hidden", str(cfg.hidden),
           "--samples", str(cfg.samples), "--keep-last", str(cfg.keep_last or 0)]
    if result_path is not None:
        cmd += ["--out", str(result_path)]
    if cfg.load_dir is not None:
        cmd += ["--load-dir", cfg.load_dir]
    if cfg.load_step is not None:
        cmd += ["--load-step", str(cfg.load_step)]
    if cfg.step_delay:
        cmd += ["--step-delay", str(cfg.step_delay)]
    if cfg.hang_at_step is not None:
        cmd += ["--hang-at-step", str(cfg.hang_at_step)]
    if cfg.async_save:
        cmd += ["--async-save"]
    if not cfg.fsync:
        cmd += ["--no-fsync"]
    if quiet:
        cmd += ["--quiet"]
    return cmd


class LastStep:
    """Reads a child's stdout in the background and remembers the last step it reported."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.step = 0
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "step" and parts[1].isdigit():
                self.step = int(parts[1])

    def join(self) -> None:
        self._thread.join(timeout=10)


def run_until_killed(cfg: RunConfig, kill_after: int, *, lag: int = 0, timeout: float = 120.0) -> Killed:
    """Start a training child and SIGKILL it once a checkpoint beyond ``kill_after`` is committed.

    With ``lag``, the kill waits until the child reports ``lag`` more steps past that checkpoint, so
    it lands mid-training and the steps since the checkpoint are lost (the resumed run redoes them).
    """
    proc = subprocess.Popen(child_command(cfg, None), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=child_env())
    reader = LastStep(proc)
    deadline = time.monotonic() + timeout
    try:
        while True:
            steps = committed_steps(Path(cfg.save_dir))
            if steps and steps[-1] > kill_after and reader.step >= steps[-1] + lag:
                os.kill(proc.pid, signal.SIGKILL)
                killed = Killed(committed=steps[-1], reported=reader.step, lines=reader.lines)
                break
            if proc.poll() is not None:
                raise RuntimeError("the child exited before it could be killed:\n" + "\n".join(reader.lines))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no checkpoint beyond step {kill_after} within {timeout} s")
            time.sleep(0.001)
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join()
    if returncode != -signal.SIGKILL:
        raise RuntimeError(f"the child ended with status {returncode}, not by SIGKILL")
    return killed


@dataclass
class Killed:
    """What the parent knew when it sent SIGKILL."""

    committed: int  # newest committed checkpoint
    reported: int  # last step the child had printed
    lines: list[str]


def run_child(cfg: RunConfig, result_path: Path, timeout: float = 300.0) -> None:
    """Run a training child to the end; raise with its output if it fails."""
    proc = subprocess.run(child_command(cfg, result_path, quiet=True), capture_output=True, text=True,
                          timeout=timeout, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"training child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(HERE.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def demo(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="checkpoint-manager-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = dict(steps=args.steps, save_every=args.save_every, seed=args.seed, hidden=args.hidden,
                async_save=args.async_save, keep_last=args.keep_last or None)
    kill_after = args.kill_after if args.kill_after is not None else args.steps // 3
    lag = max(1, args.save_every // 3)
    reference_cfg = RunConfig(save_dir=str(workdir / "reference"), **base)
    # The step delay keeps the child busy training while the parent watches; the hang is a guard so
    # the child cannot finish before the kill arrives even on a badly overloaded machine.
    crashed_cfg = RunConfig(save_dir=str(workdir / "crashed"), step_delay=0.005,
                            hang_at_step=min(args.steps - 1, kill_after + 3 * args.save_every), **base)
    started = time.monotonic()

    print("checkpoint-manager demo: a training run is SIGKILLed, resumed, and ends bit-identical")
    print(f"  model: MLP {reference_cfg.features}-{args.hidden}-{args.hidden}-{reference_cfg.classes} "
          "with dropout, AdamW, warmup+cosine LR, shuffled StatefulDataLoader")
    print(f"  {args.steps} steps, a checkpoint every {args.save_every} steps"
          f"{' (async saves)' if args.async_save else ''}, work dir {workdir}")
    print()
    print("[1/3] reference run, never interrupted ...", flush=True)
    t0 = time.monotonic()
    run_child(reference_cfg, workdir / "reference.safetensors")
    reference = load_result(workdir / "reference.safetensors")
    print(f"      done in {time.monotonic() - t0:.1f} s, final loss {float(reference['trace/loss'][-1]):.4f}")

    print(f"[2/3] same run again, SIGKILLed mid-training after a checkpoint past step {kill_after} ...",
          flush=True)
    killed = run_until_killed(crashed_cfg, kill_after, lag=lag)
    crashed_dir = Path(crashed_cfg.save_dir)
    print(f"      os.kill(pid, SIGKILL) while the child was at step {killed.reported}; newest checkpoint: "
          f"step {killed.committed}")
    print(f"      committed checkpoints on disk: {committed_steps(crashed_dir)}; unfinished saves left in "
          f".pending: {len(pending_entries(crashed_dir))}")

    print("[3/3] a new process resumes from the newest checkpoint and trains to the end ...", flush=True)
    t0 = time.monotonic()
    run_child(replace(crashed_cfg, step_delay=0.0, hang_at_step=None), workdir / "resumed.safetensors")
    resumed = load_result(workdir / "resumed.safetensors")
    resumed_from = int(resumed["state/resumed_from"][0])
    print(f"      resumed from step {resumed_from}, trained steps {resumed_from + 1}..{args.steps} "
          f"in {time.monotonic() - t0:.1f} s (steps {killed.committed + 1}..{killed.reported} done twice)")
    print()

    problems = compare(reference, resumed)
    if resumed_from < 0:
        problems.append("the third run did not resume from a checkpoint")
    ref_hash, res_hash = params_sha256(reference), params_sha256(resumed)
    if ref_hash != res_hash:
        problems.append("model/ parameter hashes differ")

    def row(label: str, detail: str, *prefixes: str) -> None:
        verdict = "DIFFER" if any(line.startswith(prefixes) for line in problems) else "equal"
        print(f"  {label:<26}{detail:<24}{verdict}")

    print("resumed run vs. uninterrupted run, torch.equal on the raw bits of every tensor:")
    row("model parameters", f"{sum(k.startswith('model/') for k in reference)} tensors", "model/")
    row("AdamW state", f"{sum(k.startswith('optim/') for k in reference)} tensors", "optim/")
    row("LR schedule, counters", "", "sched/", "state/")
    row("data order, loss, LR", f"steps {resumed_from + 1}..{args.steps}", "trace/")
    row("next RNG draw, next batch", "", "next/")
    print(f"  sha256 of final params    reference {ref_hash[:16]}  resumed {res_hash[:16]}")
    print()
    if problems:
        print("FAIL: the resumed run differs from the uninterrupted one:")
        for line in problems:
            print(f"  - {line}")
        print(f"(runs kept in {workdir})")
        return 1
    print(f"PASS: the killed-and-resumed run is bit-identical to the run that never stopped "
          f"({time.monotonic() - started:.0f} s).")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def pending_entries(save_dir: Path) -> list[str]:
    """What interrupted saves left in ``.pending`` (the next manager start removes it)."""
    pending = save_dir / ".pending"
    return sorted(p.name for p in pending.iterdir()) if pending.is_dir() else []


# -- command line -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train (resuming from --save-dir if it holds a checkpoint)")
    tr.add_argument("--save-dir", required=True)
    tr.add_argument("--load-dir", default=None, help="resume from here instead of --save-dir")
    tr.add_argument("--load-step", type=int, default=None, help="resume from exactly this step")
    tr.add_argument("--out", default=None, help="write final state and trace here (safetensors)")
    tr.add_argument("--step-delay", type=float, default=0.0, help="sleep this long after each step")
    tr.add_argument("--hang-at-step", type=int, default=None,
                    help="stop making progress at this step and wait to be killed")
    tr.add_argument("--async-save", action="store_true", help="checkpoint with async saves")
    tr.add_argument("--no-fsync", action="store_true")
    tr.add_argument("--quiet", action="store_true")
    de = sub.add_parser("demo", help="reference run, SIGKILLed run, resumed run, bit-exact comparison")
    de.add_argument("--workdir", default=None, help="keep runs here (default: a temp dir, removed on PASS)")
    de.add_argument("--kill-after", type=int, default=None, help="kill once a later checkpoint exists")
    de.add_argument("--async-save", action="store_true", help="checkpoint with async saves")
    for p in (tr, de):
        p.add_argument("--steps", type=int, default=300)
        p.add_argument("--save-every", type=int, default=25)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--hidden", type=int, default=256)
        p.add_argument("--keep-last", type=int, default=KEEP_LAST,
                       help=f"keep the newest N checkpoints (default {KEEP_LAST}; 0 keeps every one)")
    tr.add_argument("--samples", type=int, default=2048)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "demo":
        return demo(args)
    make_deterministic()
    cfg = RunConfig(
        save_dir=args.save_dir, steps=args.steps, save_every=args.save_every, seed=args.seed,
        hidden=args.hidden, samples=args.samples, load_dir=args.load_dir, load_step=args.load_step,
        async_save=args.async_save, fsync=not args.no_fsync, step_delay=args.step_delay, keep_last=args.keep_last or None,
        hang_at_step=args.hang_at_step, verbose=not args.quiet,
    )
    result = train(cfg)
    if args.out:
        save_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
