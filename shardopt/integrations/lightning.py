"""PyTorch Lightning with DistributedFused* optimizers: ``ShardoptStrategy``.

    from shardopt.integrations.lightning import ShardoptStrategy

    class Model(lightning.pytorch.LightningModule):
        def configure_optimizers(self):                  # the optimizer line: was AdamW
            return shardopt.DistributedFusedAdam(self.parameters(), lr=1e-3, weight_decay=0.1)

    trainer = lightning.pytorch.Trainer(strategy=ShardoptStrategy(), devices=2,
                                        accumulate_grad_batches=2, gradient_clip_val=1.0)

``ShardoptStrategy`` is Lightning's ``DDPStrategy`` (same launchers, cluster environments, process
group: gloo on CPU, NCCL on GPU; same ``reduce``/``sync_dist``, ``barrier``, ``broadcast``,
distributed sampler) except that the model is **not wrapped in DistributedDataParallel**: the
optimizers' grad hooks reduce-scatter the grads during backward. What it changes:

- setup (fitting): the module's params and buffers are broadcast from rank 0 (what DDP does when
  it wraps the model); ``DistributedFused*`` optimizers of an earlier fit still holding the params
  are closed; then every trainable param must be held by a ``DistributedFused*`` optimizer
  returned by ``configure_optimizers`` (``RuntimeError`` otherwise: those grads would not be
  synced).
- accumulation: ``block_backward_sync`` (what Lightning enters on the micro-batches of
  ``accumulate_grad_batches`` before the last one, and ``LightningOptimizer.toggle_model(
  sync_grad=False)``) enters every optimizer's ``no_sync()``.
- clipping: the precision plugin's ``clip_gradients`` (``Trainer(gradient_clip_val=...)``,
  ``LightningModule.clip_gradients``) calls ``optimizer.clip_grad_norm(clip_val, grad_scaler=
  plugin.scaler)`` for these optimizers, also under ``precision="16-mixed"`` (whose plugin
  otherwise refuses optimizers that unscale in ``step()``); ``gradient_clip_algorithm="value"``
  raises ``RuntimeError``.
- checkpoints: ``optimizer_state`` calls ``optimizer.state_dict()``, a collective; Lightning's
  ``dump_checkpoint`` runs on every rank (``Trainer.save_checkpoint`` and ``ModelCheckpoint`` are
  called on every rank), so every rank gathers the full state to its CPU and rank 0 writes it.
  Loading (``ckpt_path=``) gives every rank the full state; each keeps its shard. Pending param
  all-gathers (``overlap_param_sync=True``) are waited for before the model's state dict is read
  and at teardown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from shardopt.integrations._owners import owners_of
from shardopt.zero.engine import DistributedOptimizer
from shardopt.zero.sharded_params import owner_of

log = logging.getLogger("shardopt.integrations")


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside a ``LightningOptimizer`` (``optimizer`` itself otherwise)."""
    while isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    return optimizer


def _route_clipping(plugin: Precision) -> None:
    """Makes ``plugin.clip_gradients`` clip DistributedFused* optimizers through
    ``clip_grad_norm`` (other optimizers go to the plugin's own method)."""
    if getattr(plugin, "_shardopt_clip_routed", False):
        return
    original = plugin.clip_gradients

    def clip_gradients(
        optimizer: Any,
        clip_val: float | None = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType | str = GradClipAlgorithmType.NORM,
    ) -> None:
        opt = _unwrap(optimizer)
        if not isinstance(opt, DistributedOptimizer):
            return original(optimizer, clip_val, gradient_clip_algorithm)
        if clip_val is None or clip_val <= 0:
            return None
        if GradClipAlgorithmType(gradient_clip_algorithm) != GradClipAlgorithmType.NORM:
            raise RuntimeError(
                f"{type(opt).__name__} clips by the L2 norm only (its grads are sharded, never in "
                "param.grad); use gradient_clip_algorithm='norm'"
            )
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            opt.clip_grad_norm(float(clip_val), grad_scaler=scaler)
        else:
            opt.clip_grad_norm(float(clip_val))
        return None

    plugin.clip_gradients = clip_gradients
    plugin._shardopt_clip_routed = True


class ShardoptStrategy(DDPStrategy):
    """``DDPStrategy`` without the DDP wrapper, for ``DistributedFused*`` optimizers (see the
    module docstring). Arguments as ``DDPStrategy``'s, without the DDP-only ones
    (``find_unused_parameters``, comm hooks, model averaging, ...)."""

    strategy_name = "shardopt"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers nothing (``DDPStrategy``'s would re-register the "ddp" names to this class)."""

    # -- which optimizers -----------------------------------------------------------------------

    def shardopt_optimizers(self) -> list[DistributedOptimizer]:
        """The ``DistributedFused*`` optimizers of this fit (unwrapped from Lightning's wrapper)."""
        out: list[DistributedOptimizer] = []
        for opt in self.optimizers:
            opt = _unwrap(opt)
            if isinstance(opt, DistributedOptimizer) and all(opt is not o for o in out):
                out.append(opt)
        return out

    def _trainable(self) -> list[torch.nn.Parameter]:
        assert self.lightning_module is not None
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    # -- setup: no DDP wrapper ------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        current = self.shardopt_optimizers()
        trainable = self._trainable()
        loose = [p for p in trainable if all(owner_of(p) is not o for o in current)]
        if loose:
            assert self.lightning_module is not None
            names = {id(p): n for n, p in self.lightning_module.named_parameters()}
            shown = ", ".join(names.get(id(p), "?") for p in loose[:5])
            more = f" and {len(loose) - 5} more" if len(loose) > 5 else ""
            raise RuntimeError(
                f"ShardoptStrategy: {len(loose)} of the model's {len(trainable)} trainable params "
                f"({shown}{more}) are not held by a DistributedFused* optimizer returned by "
                "configure_optimizers. This strategy does not wrap the model in "
                "DistributedDataParallel, so their grads would not be synced; build the optimizer "
                "with shardopt.DistributedFused*(self.parameters(), ...) or use strategy='ddp' "
                "with torch.optim optimizers"
            )
        _route_clipping(self.precision_plugin)

    def setup_optimizers(self, trainer: Any) -> None:
        """Closes the ``DistributedFused*`` optimizers of an earlier fit that still hold the
        module's params (their grad hooks would take the grads, and a param is sharded by one
        optimizer only), then calls ``configure_optimizers``."""
        for opt in owners_of(self._trainable()):
            log.info("shardopt: closing the %s of an earlier fit", type(opt).__name__)
            opt.close()
        super().setup_optimizers(trainer)
        if any(opt.closed for opt in self.shardopt_optimizers()):
            raise RuntimeError(
                "ShardoptStrategy: configure_optimizers returned a DistributedFused* optimizer of "
                "an earlier fit, which was closed at the start of this one; build a new optimizer "
                "in configure_optimizers (carry its state over with a checkpoint: ckpt_path=...)"
            )

    def configure_ddp(self) -> None:
        """No wrapper: every rank starts from rank 0's params and buffers (as DDP's constructor
        makes it); the optimizers built next sync the grads."""
        assert self.model is not None
        _sync_module_states(self.model)

    # -- accumulation ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate locally (every optimizer's ``no_sync()``); the next
        one outside syncs the sum, as under DDP's ``no_sync``."""
        with contextlib.ExitStack() as stack:
            for opt in self.shardopt_optimizers():
                stack.enter_context(opt.no_sync())
            yield None

    # -- checkpoints ----------------------------------------------------------------------------

    def _wait_param_sync(self) -> None:
        for opt in self.shardopt_optimizers():
            opt.wait_param_sync()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._wait_param_sync()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The full state dict on every rank: a collective, which every rank reaches because
        Lightning dumps the checkpoint on every rank (rank 0 writes it)."""
        opt = _unwrap(optimizer)
        if isinstance(opt, DistributedOptimizer):
            return opt.state_dict()
        return super().optimizer_state(optimizer)

    def teardown(self) -> None:
        self._wait_param_sync()
        super().teardown()
