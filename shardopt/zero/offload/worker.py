"""CPU offload, the worker: the threads that run one optimizer's offloaded bucket updates.

One ``OffloadWorker`` per optimizer with bucket-by-bucket offloaded keys (offload_pipeline.py).
Its threads (the worker and its update thread, see Note: the update thread) are started by the
first step, are daemons (they never keep the interpreter alive), and are stopped by ``close()``
or when the optimizer is collected. A step hands the worker one job, the
update of every offloaded bucket in forward order (see Note: the offloaded step in
offload_pipeline.py); the job reports each bucket through a ``Progress`` as soon as its new
params are on their way into the sync space, and ``param_sync.py`` starts the bucket's
all-gather from the main thread once it is (collectives are issued by one thread only, in the
same order on every rank, so the ranks' collectives pair up whatever the timing).

The C++ kernels release the GIL (csrc/bindings.cpp), so the main thread runs the next forward,
or the rest of the step, while the worker's kernels run on the offload thread budget. An error
in the job is kept with its traceback and raised on the main thread at the next synchronisation
point (``Progress.raise_error``), after every all-gather of the step has been started, so the
other ranks' all-gathers still complete and no rank hangs.

Note: the update thread
    A bucket's update (its kernels, the update rule's Python around them) runs on the update
    thread, the bucket's bookkeeping on the worker: the copy of its grads into a staging slot,
    its hand-over (``hand``, a ``Ticket``), then, once the update has run, the copies of its new
    params up and its report to ``Progress``. The worker hands the next bucket over before it
    waits for the one updating, so the update thread finds it queued when the current one ends,
    and the bookkeeping of one bucket runs while the kernels of the next one do: run on one
    thread, it ran between the kernels, with the update's CPU threads idle. On one H200 that was
    about 40 ms of an iteration of the 1.32B GPT (0.8 ms a bucket: copy issues, staging, event
    waits; docs/benchmarks.md, ninth session). With it the update thread was busy 97% of a
    clipped job (tenth session), but the step did not measurably change against the one-thread
    pipeline on the same host: the kernels' own time in the pipeline is what is left. The
    updates run one after the other in the
    order handed, on the same host state as before, so the bits do not change; at most one
    bucket waits queued behind the one updating, so a ring of staging slots is never reused
    while an update reads or writes it (offload_slots.py).

Note: the worker and the GIL
    The kernels run without the GIL, but the threads take it back after every kernel and copy
    call (a few per bucket) to run the bucket's bookkeeping. When the training loop's thread
    holds the GIL then (launching the forward, autograd hooks), the worker waits until the
    holder is asked to drop it, which Python does after the thread switch interval (0.005 s by
    default), with the update's CPU threads idle meanwhile. While a worker runs,
    ``CPUOffload.switch_interval`` (0.0002 s by default) lowers the interval
    (``sys.setswitchinterval``, process-wide: ``_SwitchInterval``); the last worker to stop
    puts the previous value back unless something else changed it meanwhile. Measured on one
    H200 (docs/benchmarks.md, seventh session), mixed: with the interval at 0.2 ms for the whole
    process the 1.32B GPT's offloaded step took 380.3 / 410.0 ms (clip off / on) against 402.1 /
    425.8 ms at 5 ms in one call (the worker's kernel calls 272 against 299 ms); in another call
    one traced iteration each went the other way.
"""

from __future__ import annotations

import copy
import queue
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from shardopt.zero.offload import host_numa, host_state


class Progress:
    """What the worker has done of one step's offloaded buckets: ``order`` is the order their
    all-gathers start in (forward order, the same on every rank); the worker may update them in
    another (buckets updated during backward first, see offload_backward.py). The step's jobs
    are counted; it is finished once it is sealed (``step()`` submitted its last job) and every
    job has ended."""

    def __init__(self, order: list[tuple[int, int]]) -> None:
        #: (key index, bucket index) of every offloaded bucket, in all-gather order
        self.order = order
        self._events: dict[tuple[int, int], torch.cuda.Event | None] = {}
        self._jobs = 0
        self._sealed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def add_job(self) -> None:
        with self._cond:
            self._jobs += 1

    def seal(self) -> None:
        """No job of this step is submitted after this one."""
        with self._cond:
            self._sealed = True
            self._cond.notify_all()

    def publish(self, bucket_id: tuple[int, int], event: torch.cuda.Event | None) -> None:
        """The worker: ``bucket_id`` is updated; ``event`` (CUDA) marks its copy into the sync
        space."""
        with self._cond:
            self._events[bucket_id] = event
            self._cond.notify_all()

    def job_done(self, error: BaseException | None) -> None:
        """The worker: a job ended (``error``: what it raised; the first is kept)."""
        with self._cond:
            self._jobs -= 1
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        return self._sealed and self._jobs == 0

    def wait_bucket(self, n: int) -> torch.cuda.Event | None:
        """Blocks until bucket number ``n`` of ``order`` is updated (or the step's jobs ended
        without it: an error); the event its all-gather must wait for (None on a CPU job, on a
        skipped step, or after an error)."""
        bucket_id = self.order[n]
        with self._cond:
            self._cond.wait_for(lambda: bucket_id in self._events or self.finished)
            return self._events.get(bucket_id)

    def wait_finished(self) -> None:
        """Blocks until every job of the (sealed) step has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self.finished)

    def raise_error(self) -> None:
        """Raises what a job raised (once), with its original traceback."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                "CPU offload: the update of the offloaded buckets failed in the offload worker "
                f"thread ({type(error).__name__}: {error}); the params of this step are not "
                "all updated"
            ) from error


def _loop(jobs: queue.SimpleQueue) -> None:
    """The worker thread: runs jobs until the stop mark (None). Holds no reference to the
    optimizer between jobs, so the optimizer can be collected while the thread waits."""
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, progress = job
        del job
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, never lost
            error = e
        finally:
            del fn
            progress.job_done(error)
            del progress


class _SwitchInterval:
    """The interpreter's switch interval while offload workers run (see Note: the worker and
    the GIL): the smallest one asked for is in effect; the value before the first worker comes
    back when the last one stops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: float | None = None  # the interval before the first holder
        self._set: float | None = None  # the interval set here, if any

    def acquire(self, interval: float) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved = sys.getswitchinterval()
            self._holders += 1
            if interval < sys.getswitchinterval():
                sys.setswitchinterval(interval)
                self._set = sys.getswitchinterval()

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                if self._set is not None and sys.getswitchinterval() == self._set:
                    sys.setswitchinterval(self._saved)
                self._set = self._saved = None


_SWITCH = _SwitchInterval()


class Ticket:
    """One bucket's update handed to the update thread (``OffloadWorker.hand``)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None

    def wait(self):
        """Blocks until the update has run; its result, or raises what it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


def _serve(updates: queue.SimpleQueue) -> None:
    """The update thread: runs the bucket updates handed to it, one after the other, until the
    stop mark (None); a ticket always ends, also when its update raised."""
    while True:
        item = updates.get()
        if item is None:
            return
        fn, ticket = item
        del item
        try:
            ticket._result = fn()
        except BaseException as e:  # noqa: BLE001 - raised on the worker by Ticket.wait
            ticket._error = e
        finally:
            del fn
            ticket._done.set()
            del ticket


def _stop(
    jobs: queue.SimpleQueue, thread: list[threading.Thread], held: list[bool],
    updates: queue.SimpleQueue, updater: list[threading.Thread],
) -> None:  # fmt: skip
    if thread:
        jobs.put(None)
        if thread[0] is not threading.current_thread():
            thread[0].join()
        thread.clear()
    if updater:  # after the worker: its last job may still hand updates
        updates.put(None)
        if updater[0] is not threading.current_thread():
            updater[0].join()
        updater.clear()
    if held:
        held.clear()
        _SWITCH.release()


class OffloadWorker:
    """The persistent thread of one optimizer's offloaded updates (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        switch_interval: float | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.device = device
        #: the CPUs the update thread (and the intra-op threads it starts) runs on (None: any;
        #: Note: NUMA placement in host_numa.py)
        self.cpus = cpus
        #: the switch interval asked for while the thread runs (None: left as it is)
        self.switch_interval = switch_interval
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: list[threading.Thread] = []  # the thread, once started
        self._held: list[bool] = []  # [True] while this worker holds a _SWITCH request
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self._updater: list[threading.Thread] = []  # the update thread, once started
        self._finalizer = weakref.finalize(
            self, _stop, self._jobs, self._thread, self._held, self._updates, self._updater
        )

    @property
    def alive(self) -> bool:
        """Whether one of its threads (the worker, the update thread) is running."""
        return any(t.is_alive() for t in (*self._thread, *self._updater))

    def submit(self, fn: Callable[[], None], progress: Progress) -> None:
        """Runs ``fn`` on the worker thread (started on first use), as a job of ``progress``'s
        step."""
        progress.add_job()
        if not self._thread:
            device = self.device

            def run(jobs: queue.SimpleQueue = self._jobs) -> None:
                if device.type == "cuda":  # the thread's current device is the optimizer's
                    torch.cuda.set_device(device)
                _loop(jobs)

            thread = threading.Thread(target=run, name="shardopt-offload", daemon=True)
            if self.switch_interval is not None and not self._held:
                _SWITCH.acquire(self.switch_interval)
                self._held.append(True)
            thread.start()
            self._thread.append(thread)
        self._jobs.put((fn, progress))

    def hand(self, fn: Callable[[], object]) -> Ticket:
        """Runs ``fn`` (one bucket's update) on the update thread (started on first use), after
        the updates handed before it (see Note: the update thread)."""
        if not self._updater:
            device, cpus = self.device, self.cpus

            def run(updates: queue.SimpleQueue = self._updates) -> None:
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                if cpus is not None:  # before its first kernel starts the intra-op threads
                    host_numa.pin_this_thread(cpus)
                _serve(updates)

            thread = threading.Thread(target=run, name="shardopt-update", daemon=True)
            thread.start()
            self._updater.append(thread)
        ticket = Ticket()
        self._updates.put((fn, ticket))
        return ticket

    def stop(self) -> None:
        """Stops the threads after the job in hand (idempotent; a later submit starts them
        again)."""
        _stop(self._jobs, self._thread, self._held, self._updates, self._updater)


def frozen_view(optimizer, steps_ahead: int = 0, unused: frozenset[int] | None = None):
    """The optimizer as the worker sees it: its attributes, except the step's hyperparameters
    (shallow copies of the param groups) and skipped-step counts, frozen as they are now, so a
    scheduler or ``update_calls.end`` on the main thread while the worker runs does not change
    this step (the next step waits for the worker before it writes them). ``steps_ahead``: the
    groups' step counts to add (an update during backward, before ``step()`` counts it);
    ``unused``: this step's params without grads, when ``step()`` has not set them yet."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = [dict(g) for g in optimizer.param_groups]
    for group in view.param_groups:  # on the host once per step, not once per kernel call,
        # shaped as the kernels take it (``Call.step_t`` then calls no torch op)
        group["step"] = (host_state.to_host(group["step"]) + steps_ahead).reshape(1)
    calls = copy.copy(optimizer.update_calls)
    calls.offsets = list(calls.offsets)
    calls.window = None
    if unused is not None:
        calls.unused = unused
    view.update_calls = calls
    # what the update writes once per step (SGD's momentum flags): the worker's own copies,
    # reset to the values before the step ahead of each bucket (``restart``)
    saved = {}
    for name in getattr(type(optimizer), "per_step_attributes", ()):
        saved[name] = [t.clone() for t in getattr(optimizer, name)]
        setattr(view, name, [t.clone() for t in saved[name]])
    view._offload_saved = saved
    return view


def restart(view) -> None:
    """Before each bucket's update on the worker: the per-step attributes as before the step."""
    for name, saved in view._offload_saved.items():
        for t, s in zip(getattr(view, name), saved):
            t.copy_(s)


def forward_order(keys: list) -> list:
    """(key, bucket) of every bucket of ``keys`` in forward order (param_sync.py's)."""
    return [(key, b) for key in keys for b in reversed(key.layout.buckets)]
