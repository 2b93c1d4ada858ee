"""Routed experts kept in their stored form in device memory, expanded just in time.

transformers fuses a MoE layer's routed experts into two 3D parameters (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]); its quantizers reach ``nn.Linear`` modules only, so a quantized checkpoint's
experts are expanded to the model's dtype at load (for Kimi-K2 that is ~2 TB in bf16, more than one
8-GPU node). Here each MoE layer holds its local experts as the checkpoint stores them (for INT4:
packed int32 values and bf16 scales) as buffers, and ``StoredExperts.forward`` expands them to the
run's dtype, hands them to transformers' own experts function (eager / grouped_mm, as configured)
and drops them: peak memory is the stored model plus one layer's expanded experts, and the numbers
are those of the same model with its experts expanded at load (the expansion is exact: see int4.py).

A format plugs in as an ``ExpertFormat``: ``name``, the ``stored`` tensor names of one projection
(``weight_packed``, ``weight_scale``...) and ``expand(stored, dtype)`` from those tensors, stacked
over experts ([E, out, ...]), to [E, out, in]. gate and up are stored apart and fused here by
concatenating their stored tensors along the output rows (dim -2), which is the fused weight's
stored form for any format whose scales are per row (group-wise INT4) or per row block (FP8
blocks, when the intermediate size is a whole number of blocks).

A layer too large to expand at once (Kimi-K2.5's 384 experts: 33.8 GB in bf16) is expanded a slice
of experts at a time under a byte budget (``slice_bytes``, ``sliced``): each (token, expert) pair's
output is kept in its place and the pairs are weighted and added once, in the order the experts
function adds them, so the states are those of the whole layer's expansion bit for bit (tested on
CPU for each of transformers' experts functions; summing per-slice outputs would round each slice's
sum and change them). The slice path runs eagerly (which pairs a slice gets is known only once
routed); in a compiled layer the whole-layer path is traced and its fused kernels may round
differently, so a run records its budget in the spec.

Loading (``load``): the model is built with the architecture's experts class swapped for a
``StoredExperts`` of it (no expert parameters, so transformers neither reads, expands nor allocates
them), then each layer's buffers are filled from the safetensors files, only this rank's experts
when they are split. Expert parallelism is hsx's own here, as transformers' ``AllReduceEP`` does it
(every rank of the group holds the same batch): each rank runs its experts on the whole batch, the
routes to other ranks' experts masked, and a sum over the group adds the partial outputs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class ExpertFormat(Protocol):
    name: str  # how the spec and log name it, e.g. "int4-packed"
    stored: tuple[str, ...]  # the tensors one projection is stored as, by their suffix in the checkpoint
    compile: bool  # on CUDA, compile ``expand`` (one fused pass per layer)
    cast: bool  # stored tensors are cast to the run's dtype when loaded (dense weights)

    def expand(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class DenseExperts:
    """Unquantized experts, loaded in the run's dtype: the format through which hsx splits dense
    experts over EP ranks itself (each rank reads only its own), on every transformers version
    (5.19 wraps its own EP experts in FSDP2, which hsx's forward of the base model cannot drive)."""

    name: str = "dense"
    stored: tuple[str, ...] = ("weight",)
    compile: bool = False
    cast: bool = True

    def expand(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return stored["weight"]


DENSE = DenseExperts()


class StoredExperts(nn.Module):
    """A MoE layer's routed experts in stored form; stands in for the architecture's experts module
    (``experts_class``: the module it replaces, whose forward it runs on the expanded weights)."""

    experts_class: type[nn.Module]  # set on the per-architecture subclass (``stored_class``)
    fmt: ExpertFormat
    dtype: torch.dtype
    ep_rank: int = 0
    ep_size: int = 1
    group: object = None  # the ranks that hold the other experts (None: the whole world; a pipeline stage's)
    compiled: bool = False  # CUDA: each layer's expansion is one compiled (fused) pass
    slice_bytes: int | None = None  # expanded experts held at once (``sliced``); None: the whole layer's
    # INT4 on CUDA: the packed weights go straight into a grouped GEMM that dequantizes them as it loads
    # them (``int4_kernel``), nothing expanded; the states are another GEMM's sums (``describe``)
    dequantizing: bool = False

    def __init__(self, config):
        super().__init__()
        with torch.device("meta"):
            template = self.experts_class(config)
        for key, value in vars(template).items():  # the attributes transformers' experts functions read
            if key in ("_parameters", "_buffers", "_modules") or key.startswith("_forward") or key.startswith("_back"):
                continue
            self.__dict__[key] = value
        for key, module in template.named_children():
            self.add_module(key, module)
        self._is_hf_initialized = True  # transformers has nothing to initialise: ``fill`` reads the weights
        self.num_global_experts = int(template.num_experts)
        if self.ep_size > 1:
            self.num_experts = self.num_global_experts // self.ep_size  # local ids; num_experts is the sentinel
            self._is_expert_parallel = True

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_experts

    def set_stored(self, name: str, stored: dict[str, torch.Tensor]) -> None:
        """The stored tensors of projection ``name`` (gate_up_proj / down_proj), stacked over local experts."""
        for key, t in stored.items():
            self.register_buffer(f"{name}__{key}", t, persistent=False)

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        return {key: getattr(self, f"{name}__{key}") for key in self.fmt.stored}

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) of the local experts in the run's dtype: new tensors each call.
        Inside a compiled layer the expansion is traced into the layer's graph; eager on CUDA it is
        one compiled pass of its own."""
        eager_compiled = self.compiled and not torch.compiler.is_compiling()
        fn = _compiled_expand() if eager_compiled else _expand
        return fn(self.fmt, self.stored("gate_up_proj"), self.stored("down_proj"), self.dtype)

    def expand_slice(self, experts: slice) -> dict[str, torch.Tensor]:
        """The expanded weights of local experts ``experts`` alone (``sliced``'s expansion)."""
        fn = _compiled_expand() if self.compiled else _expand
        part = {name: {k: t[experts] for k, t in self.stored(name).items()} for name in PROJECTIONS}
        return dict(zip(PROJECTIONS, fn(self.fmt, part["gate_up_proj"], part["down_proj"], self.dtype), strict=True))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Traceable: a compiled decoder layer holds the expansion, routing and weighting in its own
        graph (no graph break per MoE layer). The experts function reads the expanded weights from
        an ``Expanded`` view of this module, never from state set on it. With a ``slice_bytes``
        budget smaller than the layer's expansion the experts are expanded a slice at a time
        (``sliced``: one graph break)."""
        if self.ep_size > 1:
            off = (top_k_index // self.num_experts) != self.ep_rank
            top_k_index = torch.where(off, self.num_experts, top_k_index % self.num_experts)
            top_k_weights = top_k_weights.masked_fill(off, 0.0)
        step = per_slice(self, self.slice_bytes, self.dtype)
        routing = (hidden_states, top_k_index, top_k_weights)
        if self.dequantizing:  # grouped_mm's rows and sums, the weights read packed by the kernel
            from hsx.capture.quantized import int4_kernel

            whole = {name: int4_kernel.Packed.of(self.stored(name), self.fmt.group_size) for name in PROJECTIONS}
            fused = int4_kernel.grouped_linear
            out = sliced(self, None, "grouped_mm", lambda _: whole, self.num_experts, *routing, linear=fused)
        elif step < self.num_experts:
            out = sliced(self, self.experts_class.forward, implementation(self), self.expand_slice, step, *routing)
        else:
            gate_up, down = self.expand()
            expanded = Expanded(self, gate_up_proj=gate_up, down_proj=down)
            out = self.experts_class.forward(expanded, hidden_states, top_k_index, top_k_weights)
        if self.ep_size > 1:
            torch.distributed.all_reduce(out, group=self.group)
        return out


class Expanded:
    """An experts module seen with its weights expanded: what transformers' experts functions read
    (``gate_up_proj``, ``down_proj``...) from ``weights``, every other attribute the module's own.
    A plain object, so that the compiler traces it and the module keeps no per-call state."""

    def __init__(self, module: nn.Module, **weights: torch.Tensor):
        self.module = module
        for name, weight in weights.items():
            setattr(self, name, weight)

    def __getattr__(self, name):
        return getattr(self.module, name)


# How each of transformers' experts functions that ``sliced`` runs adds up a token's (token, expert)
# outputs: "sum" over the top-k in float32 (the weighted outputs in the routing weights' dtype),
# "ordered" one expert after another in ascending id, each output rounded to the states' dtype first
# (eager's index_add_). Not batched_mm: its one batched product of every pair does not give a pair
# the same bits as a batch of a slice's pairs (float32 on CPU).
COMBINE = {"grouped_mm": "sum", "eager": "ordered"}
COMBINED = 2048  # tokens whose pairs are weighted and added at once (each a token's own reduction: any count)


def implementation(module: nn.Module) -> str:
    """Which of transformers' experts functions ``module`` runs (hsx's FP8 experts: grouped_mm; None
    configured: the class's own, eager)."""
    if not isinstance(module, StoredExperts):
        return "grouped_mm"
    return module.config._experts_implementation or "eager"


def expert_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes one expert takes expanded to ``dtype``: gate and up (or up alone) and down."""
    projections = 3 if getattr(module, "has_gate", True) else 2
    return projections * int(module.intermediate_dim) * int(module.hidden_dim) * dtype.itemsize


def per_slice(module: nn.Module, budget: int | None, dtype: torch.dtype) -> int:
    """How many of ``module``'s local experts are expanded to ``dtype`` at once under ``budget``
    bytes (at least one); all of them where there is no budget or it holds the whole layer."""
    count = int(module.num_experts)
    return count if budget is None else max(1, min(count, budget // expert_bytes(module, dtype)))


def pair_order(implementation: str, top_k_index: torch.Tensor) -> torch.Tensor:
    """The (token, expert) pairs (flat ids, token-major) by expert, each expert's in the order
    ``implementation`` stacks its rows for one GEMM: a GEMM's rows on CPU do not come out the same
    bits in another order. grouped_mm: its own sort of the pairs' expert ids (the same call on the
    same ids, ties included); eager: top-k position first, then token (its ``torch.where`` over the
    expert's [top_k, tokens] mask)."""
    if implementation == "grouped_mm":
        return torch.sort(top_k_index.reshape(-1)).indices
    tokens, top_k = top_k_index.shape
    by_position = torch.sort(top_k_index.t().reshape(-1), stable=True).indices  # k * tokens + t
    return (by_position % tokens) * top_k + by_position // tokens


def grouped_rows(view, rows: torch.Tensor, counts: torch.Tensor, linear: Callable | None = None) -> torch.Tensor:
    """Unweighted outputs of ``rows`` (states stacked by expert, ``counts`` of each) through the
    experts of ``view``, as transformers' grouped_mm function computes its sorted rows: its grouped
    GEMMs (or ``linear`` in their place) and gate, on these rows in this order (its own function
    would sort them again, and its sort does not keep the order of equal ids)."""
    from transformers.integrations.moe import _grouped_linear

    linear = linear or _grouped_linear
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up = view.gate_up_proj if view.has_gate else view.up_proj
    out = linear(rows, up, offsets, is_transposed=view.is_transposed)
    out = view._apply_gate(out) if view.has_gate else view.act_fn(out)
    out = linear(out, view.down_proj, offsets, is_transposed=view.is_transposed)
    # the norm after the experts is newer than the lowest transformers the pin admits
    return view.post_expert_norm(out) if getattr(view, "has_post_expert_norm", False) else out


@torch.compiler.disable
def sliced(
    module: nn.Module,
    function: Callable,
    implementation: str,
    expand: Callable[[slice], dict[str, torch.Tensor]],
    step: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    linear: Callable | None = None,
) -> torch.Tensor:
    """``function`` (transformers' experts function ``implementation``) over ``module``'s experts
    expanded ``step`` at a time by ``expand``, with the numbers of one call over all of them (or, for
    grouped_mm, with ``linear`` in its GEMMs' place, taking what ``expand`` gives as weights): each
    slice computes the outputs of the (token, expert) pairs routed to it, unweighted, each expert's
    rows in the order the function stacks them (``pair_order``), and keeps them in their pairs'
    places; once every slice has run, the pairs are weighted and added up as the function adds them
    (``COMBINE``), in the original order. A pair routed to no local expert (an EP sentinel, id
    ``num_experts``) adds zero, as it does there. Run eagerly: which pairs a slice gets is known only
    once routed (one host sync a layer)."""
    combine = COMBINE.get(implementation)
    if combine is None:
        raise ValueError(
            f"experts implementation {implementation!r}: hsx slices the expansion for {', '.join(COMBINE)} only"
        )
    count = int(module.num_experts)
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    order = pair_order(implementation, top_k_index)
    ends = torch.bincount(ids, minlength=count + 1).cumsum(0).tolist()
    pairs = hidden_states.new_zeros(ids.numel(), hidden_states.shape[-1])
    for start in range(0, count, step):
        stop = min(start + step, count)
        lo, hi = ends[start - 1] if start else 0, ends[stop - 1]
        if lo == hi:
            continue  # no token routed here: nothing expanded
        rows = order[lo:hi]
        local = ids[rows] - start
        view = Expanded(module, num_experts=stop - start, _is_expert_parallel=False, **expand(slice(start, stop)))
        if implementation == "grouped_mm":
            pairs[rows] = grouped_rows(
                view, hidden_states[rows // top_k], torch.bincount(local, minlength=stop - start), linear
            )
        else:  # eager: one pair a row (top 1, unit weight: its output exactly), each expert's rows in order
            unit = top_k_weights.new_ones(hi - lo, 1)
            pairs[rows] = function(view, hidden_states[rows // top_k], local[:, None], unit)
        del view
    out = torch.zeros_like(hidden_states)
    by_id = torch.sort(top_k_index, dim=1, stable=True).indices  # eager adds a token's experts in ascending id
    for lo in range(0, tokens, COMBINED):  # a few tokens at a time: the weighted pairs' transient stays small
        hi = min(lo + COMBINED, tokens)
        weighted = (pairs[lo * top_k : hi * top_k] * top_k_weights[lo:hi].reshape(-1, 1)).view(hi - lo, top_k, -1)
        if combine == "sum":
            out[lo:hi] = weighted.sum(dim=1).to(hidden_states.dtype)
            continue
        ordered = weighted.to(hidden_states.dtype)
        ordered = ordered.gather(1, by_id[lo:hi, :, None].expand_as(ordered))
        for k in range(top_k):
            out[lo:hi] += ordered[:, k]
    return out


def set_slice(model: nn.Module, budget: int, dtype: torch.dtype) -> str:
    """Every MoE layer whose experts hsx expands (held stored, or FP8) expands at most ``budget``
    bytes of them at once from now on; what that makes, in words for the log."""
    from hsx.errors import UnsupportedModel

    layers = [m for m in model.modules() if hasattr(m, "slice_bytes")]
    for module in layers:
        how = implementation(module)
        if how not in COMBINE:
            raise UnsupportedModel(
                f"--expert-slice-gb: the experts run transformers' {how!r}; a slice at a time runs "
                f"{' and '.join(COMBINE)} only"
            )
        module.slice_bytes = budget
    if not layers:
        return f"--expert-slice-gb {budget / 1e9:g}: no routed experts here are expanded by hsx, nothing to slice"
    one = layers[0]
    step, count, each = per_slice(one, budget, dtype), int(one.num_experts), expert_bytes(one, dtype) / 1e9
    return (
        f"routed experts expanded {step} of a MoE layer's {count} at a time ({step * each:.1f} GB under "
        f"--expert-slice-gb {budget / 1e9:g}; the whole layer's: {count * each:.1f} GB), the same states"
    )


def _expand(fmt: ExpertFormat, gate_up: dict, down: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return fmt.expand(gate_up, dtype), fmt.expand(down, dtype)


@functools.cache
def _compiled_expand():
    """``_expand`` compiled, made on first use: importing the compiler costs each process about a
    second, and most (every CPU run, every test's) never compile."""
    return torch.compile(_expand, dynamic=False)


def stored_class(
    experts_class: type[nn.Module],
    fmt: ExpertFormat,
    dtype: torch.dtype,
    ep_rank: int = 0,
    ep_size: int = 1,
    group: object = None,
) -> type[StoredExperts]:
    """The ``StoredExperts`` standing in for ``experts_class`` (its gate and forward functions kept)."""
    attrs = dict(experts_class=experts_class, fmt=fmt, dtype=dtype, ep_rank=ep_rank, ep_size=ep_size, group=group)
    if hasattr(experts_class, "_apply_gate"):
        attrs["_apply_gate"] = experts_class._apply_gate
    return type(f"Stored{experts_class.__name__}", (StoredExperts,), attrs)


def experts_classes(model_class: type[nn.Module]) -> dict[str, type[nn.Module]]:
    """The fused routed-experts classes of an architecture's modeling module, by their name there
    (those built for transformers' experts functions: 3D ``gate_up_proj`` / ``down_proj``)."""
    module = sys.modules[model_class.__module__]
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and issubclass(obj, nn.Module)
        and name.endswith("Experts")
        and hasattr(obj, "_apply_gate")
    }


@contextlib.contextmanager
def swapped(
    model_class: type[nn.Module],
    fmt: ExpertFormat,
    dtype: torch.dtype,
    ep_rank: int = 0,
    ep_size: int = 1,
    group: object = None,
):
    """While open, the architecture builds ``StoredExperts`` in place of its experts modules;
    ``group``: the ranks the experts are split over (None: the whole world)."""
    module = sys.modules[model_class.__module__]
    originals = experts_classes(model_class)
    if not originals:
        raise ValueError(f"{model_class.__name__} has no fused routed-experts module to keep in stored form")
    try:
        for name, cls in originals.items():
            setattr(module, name, stored_class(cls, fmt, dtype, ep_rank, ep_size, group))
        yield
    finally:
        for name, cls in originals.items():
            setattr(module, name, cls)


def stored_modules(model: nn.Module) -> Iterator[tuple[str, StoredExperts]]:
    for name, module in model.named_modules():
        if isinstance(module, StoredExperts):
            yield name, module


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index where there is one)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def fill(model: nn.Module, model_dir: Path, device: torch.device, prefix: str = "") -> None:
    """Each ``StoredExperts`` buffers its local experts' stored tensors, read from the checkpoint
    (``prefix``: what the checkpoint's names have before the model's module names)."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:

        def read(key: str) -> torch.Tensor:
            if key not in files:
                raise KeyError(f"{model_dir}: the checkpoint has no {key}")
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, "pt"))
            return handles[path].get_tensor(key)

        for name, experts in stored_modules(model):
            local = range(experts.first_expert, experts.first_expert + experts.num_experts)
            for fused, parts in PROJECTIONS.items():
                stored = {}
                for key in experts.fmt.stored:
                    per_expert = [
                        torch.cat([read(f"{prefix}{name}.{e}.{part}.{key}") for part in parts], dim=-2) for e in local
                    ]
                    stored[key] = torch.stack(per_expert).to(device, experts.dtype if experts.fmt.cast else None)
                experts.set_stored(fused, stored)


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the routed experts as held: stored buffers, or dense expert parameters."""
    total = 0
    for module in model.modules():
        if isinstance(module, StoredExperts):
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
        elif type(module).__name__.endswith("Experts") and hasattr(type(module), "_apply_gate"):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def from_dense(model: nn.Module, fmt: ExpertFormat, quantize, compiled: bool = False) -> None:
    """Replace each fused experts module of a loaded model by a ``StoredExperts`` of its weights as
    ``quantize`` stores them (e.g. ``int4.quantize``): a quantized model built in memory (benchmarks)."""
    for name, module in list(model.named_modules()):
        if not (type(module).__name__.endswith("Experts") and hasattr(type(module), "_apply_gate")):
            continue
        if isinstance(module, StoredExperts):
            continue
        dtype = module.gate_up_proj.dtype
        cls = stored_class(type(module), fmt, dtype)
        with torch.device(module.gate_up_proj.device):
            stored = cls(module.config)
        stored.compiled = compiled
        for fused in PROJECTIONS:
            stored.set_stored(fused, quantize(getattr(module, fused).detach()))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, stored)
        del module


def describe(fmt: ExpertFormat, dtype: torch.dtype, ep_size: int, dequantizing: bool = False) -> str:
    """One line for the log: how the routed experts are held and run."""
    where = f", each of {ep_size} ranks holding its own experts" if ep_size > 1 else ""
    name = str(dtype).removeprefix("torch.")
    if dequantizing:
        return f"{fmt.name}, read packed by a grouped GEMM that dequantizes them to {name} as it loads them{where}"
    if not fmt.compile and fmt.cast:
        return f"{fmt.name} in {name}{where}"
    return f"{fmt.name}, expanded per layer to {name}{where}"
