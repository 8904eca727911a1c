"""shardopt.algorithms: the one definition of each optimizer algorithm.

Each algorithm is defined here once and used by both of its classes, the single-process
``FusedX`` (shardopt/optimizers/) and the ZeRO-sharded ``DistributedFusedX`` (shardopt/zero/):

- ``adam``, ``lamb``, ``mixed_precision_lamb``, ``novograd``, ``sgd``, ``adagrad``: one module per
  algorithm, each with its ``Hyperparams`` (a frozen dataclass: the constructor's hyperparameters
  with their defaults, which both classes' signatures take, and ``validate``), the names of its
  per-element state, ``kernel_args`` (the kernel's scalar arguments of one step, from a param
  group, its step and its lr) and the update of a set of tensor lists (the kernel call). The math
  itself is the algorithm's header in ``csrc/optim/``; what is computed between kernel calls (LAMB's
  clipping switch, NovoGrad's second-moment blend) is here too.
- ``hyperparams``: the base of the ``Hyperparams`` dataclasses.
- ``validation``: torch.optim's constructor checks with its messages, shared by every algorithm.
- ``step_args``: how a step count and an lr reach a kernel (host number or device tensor).

Nothing here imports shardopt.optimizers or shardopt.zero (tests/project/test_import_graph.py
checks it): the layer sits between those two and shardopt.kernels. Adding an algorithm:
docs/kernels.md.
"""
