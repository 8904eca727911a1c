"""The kernel specs: one declaration per kernel of ``shardopt._C``, from which everything on the
Python side of that kernel is derived.

Each entry of ``SPECS`` is a torch operator schema (the ``native_functions.yaml`` way) listing the
kernel's arguments in the order of its C++ entry point (csrc/kernels.def), with its tensor lists
spelled out as the leading ``Tensor[]`` arguments (the C++ side takes them as one ``lists``
vector, or one ``TensorList`` when there is a single list) and the lists and tensors it writes
marked ``(a!)``. Integers are ``SymInt``, as torch infers them for Python ints, so that a traced
step count stays symbolic instead of recompiling every step. From it:

- the ``torch.library`` custom op ``shardopt::<name>`` (its schema is this one; ``custom_ops``),
  and its fake implementation: a ``Tensor`` return named ``total`` is a 0-dim tensor, every other
  return holds one value per position (``specs.fake_results``);
- the Python wrapper ``shardopt.kernels.ops.<name>`` (``ops``): its arguments, defaults and
  docstring, and what ``dispatch`` needs to fit lists to the kernel: which slots the kernel writes
  (copied back from temporaries), which slot sets the layout (``params``, else the first written
  one), and the per-tensor vectors (``Tensor`` arguments right after the lists, before the first
  scalar: one entry per position, sliced with the positions of each call, those marked ``(a!)``
  written back).

``tests/kernels/test_kernel_specs.py`` checks every spec against the C++ entry in kernels.def
(names, order, types, defaults), that each kernel has a CPU and a CUDA implementation, and runs
``torch.library.opcheck`` on every op. Adding a kernel: docs/kernels.md "Adding an optimizer".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Argument lists shared by several kernels (same C++ parameters).
_ADAM_SCALARS = (
    "float lr, float beta1, float beta2, float eps, SymInt step, bool adam_w_mode, "
    "bool bias_correction, float weight_decay, Tensor? lr_t=None, Tensor? step_t=None, "
    "Tensor? grad_scale_t=None, Tensor? found_inf_t=None"
)
_COMPACT_LISTS = (
    "Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] remainders, Tensor(c!)[] exp_avg, "
    "Tensor(d!)[] exp_avg_sq, Tensor(e!)[] exp_avg_scales, Tensor(f!)[] exp_avg_sq_scales"
)


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """One kernel: its schema (see the module docstring), what it does, and how it takes lists.

    Attributes:
        schema: ``name(args) -> returns`` in torch's schema language, arguments in the C++
            order.
        doc: one line on what the kernel computes (the wrapper's and the op's docstring).
        mixed_dtypes: the kernel dispatches per tensor, so lists that mix dtypes go in one call
            (norm, scale); otherwise ``dispatch`` makes one call per dtype signature.
        fit: ``dispatch`` fits the lists (DTensor shards, layouts, dtype groups); False for the
            compact-state kernels, whose callers pass flat shards and may leave lists empty.
    """

    schema: str
    doc: str
    mixed_dtypes: bool = False
    fit: bool = True
    # derived from the schema in __post_init__
    name: str = field(init=False)
    slots: tuple[str, ...] = field(init=False)
    vectors: tuple[str, ...] = field(init=False)
    args: tuple[str, ...] = field(init=False)
    types: dict[str, str] = field(init=False)
    defaults: dict[str, object] = field(init=False)
    mutated: tuple[str, ...] = field(init=False)
    returns: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        parsed = torch._C.parse_schema("shardopt::" + self.schema)
        arguments = list(parsed.arguments)
        n_slots = next(
            (i for i, a in enumerate(arguments) if str(a.type) != "List[Tensor]"), len(arguments)
        )
        n_vec = n_slots
        while n_vec < len(arguments) and str(arguments[n_vec].type) in (
            "Tensor",
            "Optional[Tensor]",
        ):
            n_vec += 1
        names = [a.name for a in arguments]
        put = object.__setattr__
        put(self, "name", parsed.name.split("::")[1])
        put(self, "slots", tuple(names[:n_slots]))
        put(self, "vectors", tuple(names[n_slots:n_vec]))
        put(self, "args", tuple(names[n_vec:]))
        put(self, "types", {a.name: str(a.type) for a in arguments})
        put(self, "defaults", {a.name: a.default_value for a in arguments if a.has_default_value()})
        written = tuple(a.name for a in arguments if a.alias_info and a.alias_info.is_write)
        put(self, "mutated", written)
        put(self, "returns", tuple(r.name for r in parsed.returns))
        if not self.slots:
            raise ValueError(f"kernel spec {self.name}: no leading Tensor[] argument")

    # -- what dispatch and the ops need ---------------------------------------------------------

    @property
    def op_schema(self) -> str:
        """The schema without the name, as ``torch.library.custom_op`` takes it."""
        return self.schema[self.schema.index("(") :]

    @property
    def has_out(self) -> bool:
        """Whether the last list is the optional out slot (absent, or None entries, allowed)."""
        return self.slots[-1] == "outs"

    @property
    def flat(self) -> bool:
        """Whether the C++ entry takes its one list as a ``TensorList`` rather than ``lists``."""
        return len(self.slots) == 1

    @property
    def writes(self) -> tuple[int, ...]:
        """Indices of the slots the kernel writes in place."""
        return tuple(i for i, s in enumerate(self.slots) if s in self.mutated)

    @property
    def vector_writes(self) -> tuple[int, ...]:
        """Indices of the per-tensor vectors the kernel writes in place."""
        return tuple(i for i, v in enumerate(self.vectors) if v in self.mutated)

    @property
    def param_slot(self) -> int:
        """The slot whose tensors set the layout of each position (Note: layouts)."""
        if "params" in self.slots:
            return self.slots.index("params")
        return self.writes[0] if self.writes else 0

    def bind(self, name: str, args: tuple, kwargs: dict) -> tuple[list, list]:
        """(vectors, arguments) of a call, in the C++ order, defaults filled in: ``args`` are
        positional after the lists, ``kwargs`` by name. A TypeError names what is wrong."""
        names = self.vectors + self.args
        if len(args) > len(names):
            raise TypeError(f"{name}() takes {len(names)} arguments after the lists")
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
            if key in values:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            values[key] = value
        missing = [n for n in names if n not in values and n not in self.defaults]
        if missing:
            raise TypeError(f"{name}() missing required arguments: {', '.join(missing)}")
        full = [values[n] if n in values else self.defaults[n] for n in names]
        return full[: len(self.vectors)], full[len(self.vectors) :]

    def fake_results(self, positions: int, dtype: torch.dtype, device: torch.device) -> tuple:
        """Uninitialised results of the kernel's shapes (``total`` 0-dim, else one per position)."""
        return tuple(
            torch.empty(() if r == "total" else (positions,), dtype=dtype, device=device)
            for r in self.returns
        )

    def empty_results(self) -> tuple | None:
        """What a call over no tensors returns: zeros of the result shapes (fp32), or None."""
        if not self.returns:
            return None
        return tuple(
            torch.zeros(() if r == "total" else (0,), dtype=torch.float32) for r in self.returns
        )


def results_dtype(tensors: list[torch.Tensor], every: bool) -> torch.dtype:
    """The kernels' sums and norms: fp64 for fp64 CPU tensors (all of them when ``every``, the
    kernel dispatching per tensor; else any: one call per dtype, results promoted), else fp32."""
    fp64 = [t.dtype == torch.float64 for t in tensors]
    cpu = bool(tensors) and tensors[0].device.type == "cpu"
    return torch.float64 if cpu and fp64 and (all(fp64) if every else any(fp64)) else torch.float32


SPECS: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        KernelSpec(
            "adam(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avg, "
            f"Tensor(c!)[] exp_avg_sq, Tensor(d!)[] outs, {_ADAM_SCALARS}) -> ()",
            "Adam/AdamW over [grads, params, exp_avg, exp_avg_sq(, outs)].",
        ),
        KernelSpec(
            f"adam_compact({_COMPACT_LISTS}, {_ADAM_SCALARS}) -> ()",
            "Adam/AdamW over elementwise compact state (fp32/bf16/fp16 moments, int16 "
            "remainders); the scale lists empty. Called by shardopt.kernels.compact.",
            fit=False,
        ),
        KernelSpec(
            f"adam_blockwise({_COMPACT_LISTS}, {_ADAM_SCALARS}) -> ()",
            "Adam/AdamW over blockwise compact state: scaled_fp16 or int8 codes with one fp32 "
            "scale per 256 elements. Called by shardopt.kernels.compact.",
            fit=False,
        ),
        KernelSpec(
            "sgd(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] momentum_buffers, "
            "Tensor(c!)[] outs, float lr, float momentum, float dampening, float weight_decay, "
            "bool nesterov, bool first_run, bool wd_after_momentum, float scale, "
            "Tensor? lr_t=None, Tensor? grad_scale_t=None, Tensor? found_inf_t=None, "
            "Tensor? first_run_t=None) -> ()",
            "SGD with momentum over [grads, params, momentum_buffers(, outs)].",
        ),
        KernelSpec(
            "adagrad(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] sums, Tensor(c!)[] outs, "
            "float lr, float eps, float weight_decay, bool adagrad_w_mode, Tensor? lr_t=None, "
            "Tensor? grad_scale_t=None, Tensor? found_inf_t=None) -> ()",
            "Adagrad over [grads, params, sums(, outs)].",
        ),
        KernelSpec(
            "lamb_stage1(Tensor[] grads, Tensor[] params, Tensor(a!)[] exp_avg, "
            "Tensor(b!)[] exp_avg_sq, float beta1, float beta2, float eps, SymInt step, "
            "bool bias_correction, float weight_decay, bool grad_averaging, bool adam_w_mode, "
            "Tensor? step_t=None, Tensor? grad_scale_t=None, Tensor? found_inf_t=None, "
            "Tensor? grad_norm_sq_t=None, float max_grad_norm=0.0, bool cuda_order=False) -> "
            "(Tensor w_sq, Tensor u_sq)",
            "LAMB's moments over [grads, params, exp_avg, exp_avg_sq]; returns the per-tensor "
            "sums of squares of the params (before the update) and of the update terms (fp32; "
            "fp64 on CPU when a param is fp64; zeros for a skipped step). With grad_norm_sq_t "
            "and max_grad_norm > 0 the grads are clipped to max_grad_norm in the kernel. "
            "cuda_order: the CPU kernel sums in the CUDA kernel's order (its bits, for CPU "
            "offload on a CUDA job); the CUDA kernel ignores it.",
        ),
        KernelSpec(
            "lamb_stage2(Tensor(a!)[] params, Tensor[] exp_avg, Tensor[] exp_avg_sq, "
            "Tensor(b!)[] outs, Tensor w_norm, Tensor u_norm, float lr, float beta1, "
            "float beta2, float eps, SymInt step, bool bias_correction, float weight_decay, "
            "bool adam_w_mode, bool use_nvlamb, Tensor? lr_t=None, Tensor? step_t=None, "
            "Tensor? found_inf_t=None, bool squared=False) -> ()",
            "LAMB's trust-ratio update over [params, exp_avg, exp_avg_sq(, outs)] from the "
            "per-tensor norms (sums of squares with squared=True).",
        ),
        KernelSpec(
            "novograd(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avg, "
            "Tensor(c!)[] outs, Tensor v_norm, float lr, float beta1, float beta2, float eps, "
            "SymInt step, bool bias_correction, float weight_decay, bool grad_averaging, "
            "SymInt moment_mode, Tensor? lr_t=None, Tensor? step_t=None, "
            "Tensor? grad_scale_t=None, Tensor? found_inf_t=None) -> ()",
            "NovoGrad over [grads, params, exp_avg(, outs)] with the per-tensor second moment.",
        ),
        KernelSpec(
            "novograd_step(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avg, "
            "Tensor(c!)[] outs, Tensor(d!) v, Tensor? fresh, float lr, float beta1, float beta2, "
            "float eps, SymInt step, bool bias_correction, float weight_decay, "
            "bool grad_averaging, SymInt moment_mode, SymInt norm_type, bool init_zero, "
            "Tensor? lr_t=None, Tensor? step_t=None) -> ()",
            "NovoGrad's whole step over [grads, params, exp_avg(, outs)]: the per-tensor grad "
            "norms (norm_type 2 or 0), the second moments v blended with them in place (fresh: "
            "nonzero where a param has its first update), then the update. Nothing is written "
            "unless every argument passes the checks.",
        ),
        KernelSpec(
            "muon_momentum(Tensor[] grads, Tensor(a!)[] bufs, Tensor(b!)[] mixes, "
            "float momentum, bool nesterov) -> ()",
            "Muon's momentum over [grads, bufs, mixes]: bufs = lerp(bufs, grads, 1 - momentum), "
            "mixes = lerp(grads, bufs, momentum) with nesterov, else bufs; rounded to the bufs' "
            "dtype as torch.optim.Muon's tensors, stored in the mixes' (ns_dtype).",
        ),
        KernelSpec(
            "muon_apply(Tensor(a!)[] params, Tensor[] updates, Tensor(b!)[] outs, float lr, "
            "float weight_decay, float lr_ratio, Tensor? lr_t=None) -> ()",
            "Muon's decay and apply over [params, updates(, outs)]: params = params * (1 - lr * "
            "weight_decay), then params += -lr * lr_ratio * updates (torch.optim.Muon's two "
            "roundings; lr_t replaces lr on the device); outs get the rounded params.",
        ),
        KernelSpec(
            "norm(Tensor[] tensors, bool max_norm=False) -> (Tensor total, Tensor per_tensor)",
            "Deterministic (total, per_tensor) sums of squares, or max |x| with max_norm: fp32 "
            "(fp64 when every tensor is fp64); the tensors may mix dtypes and layouts.",
            mixed_dtypes=True,
        ),
        KernelSpec(
            "scale(Tensor[] src, Tensor(a!)[] dst, float scale, Tensor? scale_t, "
            "Tensor(b!) found_inf) -> ()",
            "dst = src * scale (scale_t when given) over [src, dst], which may mix dtypes; sets "
            "found_inf to 1 on any inf/nan in src.",
            mixed_dtypes=True,
        ),
    )
}
