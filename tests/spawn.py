"""mp.spawn for the multi-process tests, with workers that leave without C++ teardown."""

import contextlib
import faulthandler
import os
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(worker, args: tuple, nprocs: int) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` processes and join them. A worker that returns
    leaves through ``os._exit(0)``: the interpreter's C++ teardown after gloo (threads still
    joinable at static destruction) sometimes aborted a finished worker with "terminate called
    without an active exception", failing a test that had passed. Errors propagate as before."""
    mp.spawn(_run_then_exit, args=(worker, *args), nprocs=nprocs, join=True)


def _run_then_exit(rank, worker, *args):
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


TEARDOWN_S = 60  # a rank whose destroy_process_group() takes longer fails with its stack printed


@contextlib.contextmanager
def process_group(backend: str, init_file: str, rank: int, world: int):
    """``init_process_group`` for the body; on an error the rank prints its traceback and leaves at
    once (``os._exit(1)``): tearing the group down would wait for a peer still inside a collective,
    and the error would never be printed. A teardown that hangs fails the rank after TEARDOWN_S
    (stack printed) instead of stalling the test run."""
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
    except BaseException:
        print(f"rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    faulthandler.dump_traceback_later(TEARDOWN_S, exit=True)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
