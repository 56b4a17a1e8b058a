"""CPU intra-op threads: the scheduler's thread alone runs torch ops on several threads; every other thread, one.

torch's CPU ops run on OpenMP (libgomp), which keeps one pool of worker threads for each thread that ever ran a
parallel op on more than one thread, for that thread's life. Once the process's pooled threads outnumber the
cores, libgomp lets its workers spin only briefly at each barrier before they sleep, so every parallel op waits
on a wake-up. On 2 cores a forward on two threads then ran up to 1.9x slower than on one: the pool of the thread
that loaded the model, idle, was enough (benchmarks/cpu_threads.py measures it). So the engine makes sure
the step loop's thread is the only one with a pool:

- `one_thread()`: the thread that builds an engine loads and allocates on one thread (it makes no pool), and
  afterwards torch's process default is one thread: every thread that starts running torch ops later (gRPC
  handlers, callers' threads) runs them on one. A thread that already ran torch ops keeps its own count (torch's
  setting is per thread once it is set), the builder's included;
- `claim(n)`: in the step loop's thread, before its first op: n threads there;
- `serving_thread(device)`: a deployment's thread that made the engine and then serves requests runs on one too.

Two engines in one process each have a pool, so only one of them should have several threads (a server runs
one engine per process).

Nothing here is used on CUDA.
"""

import threading
from contextlib import contextmanager

import torch


@contextmanager
def one_thread():
    """Run the block on one intra-op thread in this thread (so it makes no pool), then give this thread back its
    count and set the process default to one, for threads that start torch work later. (The block may start the
    scheduler's thread: its `claim` is made before the block ends, see Scheduler.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)  # (this thread's count, and the process default: set back to one below)
        _default_one()


def claim(n: int) -> None:
    """(In the scheduler's thread, before its first torch op.) This thread's ops on `n` intra-op threads; the
    process default back to one (threads that start torch work while the engine is still being built included)."""
    torch.get_num_threads()  # (torch sets a thread's count from the process default at its first use: now)
    torch.set_num_threads(n)  # (this thread's count, and the process default: set back to one next)
    _default_one()


def serving_thread(device: str | torch.device) -> None:
    """(In a server's thread that made an engine and now serves its callers: a deployment's.) On CPU, one
    intra-op thread here too, so that the scheduler's thread stays the only one with a pool."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)


def _default_one() -> None:
    """Set torch's process default to one thread, from a thread of its own (torch.set_num_threads also sets the
    calling thread's count)."""
    helper = threading.Thread(target=torch.set_num_threads, args=(1,), name="braid-threads-default")
    helper.start()
    helper.join()
