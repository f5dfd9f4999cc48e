"""mp.spawn for the multi-process tests, with workers that leave without C++ teardown."""

import os
import sys

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
