"""CPU offload of the ZeRO engine's masters and optimizer states (docs/offload.md).

The engine (``shardopt.zero.engine``) uses this package through three doors: the plan
(``plan.CPUOffload``, ``auto.build``: which keys live on the host, with which threads and
slots), the step (``pipeline``: the bucketwise update on the host, ``backward``: updates during
backward) and the state I/O (``host_state``: the host-side shards the state-I/O interface
reads and writes). Everything else here is private to those three: ``worker`` (the worker and
update threads), ``slots`` (pinned staging slots), ``replan`` and ``measure``
(``fraction="auto"``), ``host_memory`` and ``host_numa`` (pinned, first-touched, NUMA-placed
host memory). This package imports the engine's lower layers (``comm``, ``layout``,
``flat_buffer``, ``amp``, ``lockstep``), never ``engine`` or ``optimizers``.
"""
