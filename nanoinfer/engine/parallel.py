"""Tensor-parallel processes and their control plane: rank 0 (the caller) schedules and broadcasts each step's
model inputs to the other ranks. torch.distributed carries everything; nanoinfer opens no sockets of its own.

A plain process spawns its workers itself, meeting them on a TCPStore bound to a free port; under torchrun every
rank builds the engine and the engine joins the launcher's process group."""
import copy
import datetime
import io
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from nanoinfer.config import Config

# Between steps, workers wait on the control group for as long as the LLM lives (rank 0's waits are bounded by
# step_timeout(); a peer that dies is noticed at once, its sockets close).
IDLE_TIMEOUT = datetime.timedelta(days=365)
# Ranks may reach the process group far apart (imports, loading) on a busy machine.
START_TIMEOUT = datetime.timedelta(seconds=300)
# NCCL's watchdog ends the process when a collective has not finished this long after the host queued it (the host
# runs a whole forward pass ahead of the GPU; the KV sizing's warm-up of a long prompt on a large model takes long):
# torch's default, not step_timeout(), which is for gloo's waits on the host.
NCCL_TIMEOUT = datetime.timedelta(minutes=10)
_WORKER_COMMAND = "from nanoinfer.engine.parallel import worker_main; worker_main()"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class TPGroup:
    """This process's place in the tensor-parallel group. Size 1 is a plain single process: nothing is sent."""

    def __init__(self, rank: int = 0, size: int = 1, local_size: int = 1, local_rank: int = 0,
                 torchrun: bool = False):
        self.rank, self.size, self.local_size, self.local_rank = rank, size, local_size, local_rank
        self.torchrun = torchrun  # ranks > 0 serve rank 0's steps inside their own generate() calls
        self.group: dist.ProcessGroup | None = None  # the model's collectives
        self.control: dist.ProcessGroup | None = None  # gloo: step inputs are pickled CPU objects
        self.workers: list[subprocess.Popen] = []  # spawned by this process, ranks 1..size-1
        self.owns_process_group = False
        self.closed = False
        self._caller_threads: int | None = None
        self.step_timeout = step_timeout() if size > 1 else None

    def broadcast(self, obj: object = None) -> object:
        """Rank 0 sends obj (of any size: its length goes first); every rank returns it."""
        if self.size == 1:
            return obj
        if self.rank == 0:
            data = _dumps(obj)
            self._send(torch.tensor([len(data)]))
            self._send(torch.frombuffer(data, dtype=torch.uint8))
            return obj
        length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, 0, group=self.control)
        buf = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.control)
        return pickle.loads(buf.numpy())

    def share(self, tensor: torch.Tensor) -> None:
        """Rank 0's tensor into every rank's (same shape and dtype, on each rank's device), over the model's group:
        queued on the device like the model's collectives."""
        if self.size > 1:
            dist.broadcast(tensor, 0, group=self.group)

    def _send(self, tensor: torch.Tensor) -> None:
        """Rank 0's side of a control broadcast: a worker that stopped reading fails it after the step timeout."""
        dist.broadcast(tensor, 0, group=self.control, async_op=True).wait(self.step_timeout)

    def meet(self) -> None:
        """Wait here for every rank, however long each takes to get here (loading the checkpoint runs at each rank's
        own pace): the model's collectives, and rank 0's step broadcasts, then wait at most step_timeout."""
        if self.size > 1:
            dist.barrier(group=self.control)

    def all_min(self, value: int) -> int:
        """The smallest value over all ranks, so that every rank makes the same choice (e.g. KV cache blocks)."""
        if self.size == 1:
            return value
        t = torch.tensor([value])
        dist.all_reduce(t, dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def abort(self, error: BaseException | None = None) -> str | None:
        """Shut everything down at once after a failure; which workers failed (died, stopped, or, after a timeout,
        silent), if any."""
        deadline = time.monotonic() + 1  # a worker killed a moment ago may not have been reaped yet
        while self.workers and not any(map(_failure, self.workers)) and time.monotonic() < deadline:
            time.sleep(0.02)
        failed = [f"worker rank {r} (pid {p.pid}) {f}" for r, p in enumerate(self.workers, 1) if (f := _failure(p))]
        if not failed and "timed out" in str(error).lower():  # gloo's words for it
            failed = [f"worker rank {r} (pid {p.pid}) did not answer within {self.step_timeout.total_seconds():g} s"
                      for r, p in enumerate(self.workers, 1)]
        self.close(abort=True)
        return ", ".join(failed) or None

    def close(self, abort: bool = False) -> None:
        """Stop the workers (politely, unless aborting after a failure) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.workers and not abort:
            try:
                self.broadcast(None)  # workers leave serve() and exit
            except Exception:  # noqa: BLE001 - a worker already gone: stopped below either way
                pass
        for p in self.workers:
            if abort:
                p.kill()  # it may be stopped or stuck in a collective: only SIGKILL is sure to end it
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()  # ours go with it
        elif self.control is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            dist.destroy_process_group(self.control)
        if self._caller_threads is not None:
            torch.set_num_threads(self._caller_threads)

    def _set_threads(self) -> None:
        # Ranks on one host share its cores: one rank each (at most what this process was already using).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._caller_threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(self._caller_threads, cores // self.local_size)))

    def _init_process_groups(self, cuda: bool, **kwargs) -> None:
        """Create the default process group if there is none yet, then ours: every rank is in all of them. `cuda`:
        the engine runs on CUDA (else on the CPU, with gloo, even where GPUs are visible)."""
        if not dist.is_initialized():
            if cuda:
                torch.cuda.set_device(self.local_rank)
            # NCCL for CUDA tensors, gloo for CPU ones.
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
            dist.init_process_group(backend, rank=self.rank, world_size=self.size, timeout=START_TIMEOUT, **kwargs)
        self.group = dist.new_group(timeout=NCCL_TIMEOUT if cuda else self.step_timeout)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def step_timeout() -> datetime.timedelta:
    """How long rank 0 waits for a worker within a step: $NANOINFER_TP_TIMEOUT seconds, 30 by default."""
    raw = os.environ.get("NANOINFER_TP_TIMEOUT", "30")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"NANOINFER_TP_TIMEOUT must be a number of seconds > 0, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def start_tensor_parallel(config: Config) -> TPGroup:
    """The caller's group, with freshly spawned workers, or this rank's place in a torchrun launch."""
    size = config.tensor_parallel_size
    if size == 1:
        return TPGroup()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _join_torchrun(size, config.torch_device.type == "cuda")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process (is another tensor-parallel "
                           "LLM alive? close() it first); to use an existing process group, launch with torchrun")
    return _spawn_workers(config)


def _join_torchrun(size: int, cuda: bool) -> TPGroup:
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} but torchrun started {world} processes; they must match")
    group = TPGroup(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                    int(os.environ.get("LOCAL_RANK", 0)), torchrun=True)
    if dist.is_initialized() and dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} but the process group has {dist.get_world_size()} ranks")
    group._set_threads()
    try:
        # The default process group stays for the process's lifetime (the script's, or created here): a re-created
        # one would meet stale addresses in the launcher's store. Each LLM makes and removes groups of its own.
        group._init_process_groups(cuda, init_method="env://")
    except BaseException:
        group.close()
        raise
    return group


def _spawn_workers(config: Config) -> TPGroup:
    """Start ranks 1..size-1 as `python -c` subprocesses (nothing of the caller's __main__ is re-run)."""
    size = config.tensor_parallel_size
    group = TPGroup(0, size, size)
    group._set_threads()
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT)
    # Without the custom logits processors, which rank 0 alone runs, and hf_overrides, already in hf_config: their
    # classes and functions may live where a worker cannot import them (the caller's __main__, a lambda).
    worker_config = copy.copy(config)
    worker_config.logits_processors, worker_config.logits_processor_classes, worker_config.hf_overrides = None, (), None
    args = pickle.dumps(dict(config=worker_config, port=store.port, size=size, threads=torch.get_num_threads(),
                             parent=os.getpid()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    try:
        for rank in range(1, size):
            # A LOCAL_RANK of the caller's (a launcher's, a notebook's) would put every worker on its GPU.
            env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
            p = subprocess.Popen([sys.executable, "-c", _WORKER_COMMAND, str(rank)], stdin=subprocess.PIPE, env=env)
            group.workers.append(p)
            p.stdin.write(args)
            p.stdin.close()
        _wait_until_ready(store, group.workers)
        group._init_process_groups(config.torch_device.type == "cuda", store=store)
        group.owns_process_group = True  # it lives on this LLM's store: it goes when the LLM does
    except BaseException:
        group.close(abort=True)
        raise
    return group


def _wait_until_ready(store: dist.Store, workers: list[subprocess.Popen]) -> None:
    """Fail fast, with the worker named, if one dies while starting (an import error, say)."""
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    for rank, p in enumerate(workers, 1):
        while not store.check([f"ready{rank}"]):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} {_exit_status(p.returncode)} while starting "
                                   "(its error is printed above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker rank {rank} did not start within {START_TIMEOUT}")
            time.sleep(0.02)


def worker_main() -> None:
    """A spawned rank: join rank 0, receive the config, build this rank's shard and serve steps until closed."""
    from nanoinfer.engine.model_runner import ModelRunner  # model_runner imports this module

    rank = int(sys.argv[1])
    args = pickle.load(sys.stdin.buffer)
    _exit_with_parent(args["parent"])
    torch.set_num_threads(args["threads"])
    store = dist.TCPStore("127.0.0.1", args["port"], args["size"], is_master=False, timeout=START_TIMEOUT)
    store.set(f"ready{rank}", "1")
    group = TPGroup(rank, args["size"], args["size"], rank)
    group._init_process_groups(args["config"].torch_device.type == "cuda", store=store)
    group.owns_process_group = True
    runner = None
    try:
        runner = ModelRunner(args["config"], group)
        runner.serve()
    finally:
        if runner is not None:  # its decode graphs before the process group (see LLMEngine.close)
            runner.close()
        dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """Never outlive rank 0, even if it is killed before it can stop us."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _failure(p: subprocess.Popen) -> str | None:
    """How a worker process failed: exited, killed, or stopped (SIGSTOP: alive but never answering); None if not."""
    if p.poll() is not None:
        return _exit_status(p.returncode)
    try:
        with open(f"/proc/{p.pid}/stat") as f:  # Linux: the state follows the parenthesized command name
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None
    return "is stopped (not responding)" if state in ("T", "t") else None


def _exit_status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class _Pickler(pickle.Pickler):
    # Tensors go as numpy arrays: pickle's default for a tensor is torch.save, ~10x slower for small ones.
    def reducer_override(self, obj: object) -> object:
        if type(obj) is torch.Tensor:
            try:
                return torch.from_numpy, (obj.detach().cpu().numpy(),)
            except TypeError:  # no numpy dtype (bfloat16): the default way
                pass
        return NotImplemented


def _dumps(obj: object) -> bytearray:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return bytearray(buf.getbuffer())
