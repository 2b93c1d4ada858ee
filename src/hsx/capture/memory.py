"""Device memory of a parallel layout, worked out before anything is loaded: from config.json, the
quantization config and the safetensors headers alone (no weight is read), so that a ~1T model that
cannot fit is refused in seconds, with the arithmetic and the smallest layout that would fit,
instead of after an hour of loading.

The inventory is the language model's weights (``hsx.target.LanguageModel``: a composite's vision
tower is not loaded, so not counted), one entry per module: its element count and, for a quantized
module, the bytes it is held in (packed values and scales). A folder with a config and no
weights (a shape folder) gets the inventory the config implies, for the DeepSeek-V3 architecture.

Per GPU of a layout (``tensor`` ranks, routed experts over ``expert`` ranks):
- routed experts: each expert rank holds its share (all of them where ``expert`` is 1: transformers'
  TP plan does not split them), packed (as stored) or dequantized (expanded to the run's dtype);
- the rest: modules transformers' TP plan splits (``base_model_tp_plan`` and the model's
  ``_tp_plan``, e.g. attention projections, shared experts, lm_head) take 1/``tensor``; the others
  are replicated (norms, the router, the embeddings, DeepSeek-V3's q_a / kv_a projections);
- expansion: with packed experts, one MoE layer's local experts expanded to the run's dtype (what
  just-in-time expansion holds at once), or with a slice budget (``--expert-slice-gb``) the whole
  experts of it that fit (``hsx.capture.quantized.experts.sliced``: the same states);
- activations for ``batch_tokens`` tokens: a stated upper bound (``activations``);
- headroom: 5% of the device for the CUDA context and allocator slack.
Weights are counted in the run's dtype except the modules transformers keeps in float32
(``_keep_in_fp32_modules``: DeepSeek-V3's router) and quantized modules kept packed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.drafts import storage_lines
from hsx.errors import LayoutTooLarge
from hsx.fidelity import LOGITS_BYTES
from hsx.interconnect import Links
from hsx.spec import RunSpec
from hsx.target import LanguageModel, decoder_layers, held_experts, int4_group

if TYPE_CHECKING:
    from hsx.capture.stages import Stages

GB = 10**9
HEADROOM = 0.05  # of the device: the CUDA context, allocator slack
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
DTYPE_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "float32": 4, "bfloat16": 2, "float16": 2}
STORED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_scale_inv")
EXPERT = re.compile(r"(^|\.)mlp\.experts\.")
LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
EMBEDDINGS = re.compile(r"(^|\.)embed_tokens\.")
SIZES = (1, 2, 4, 8, 16, 32, 64)  # the layouts the smallest-fit search tries


@dataclass(frozen=True)
class Module:
    """One module's weights as the inventory counts them."""

    name: str  # the language model's own weight name (no composite prefix), e.g. model.norm.weight
    numel: int  # elements once expanded (quantized: of the weight it stands for)
    stored: int = 0  # bytes as held, for a quantized weight (packed values + scales); 0 otherwise
    fp32: bool = False  # kept in float32 whatever the run's dtype

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def quantized(self) -> bool:
        return self.stored > 0

    @property
    def expert(self) -> bool:
        return EXPERT.search(self.name) is not None


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    expert: int = 1
    # packed: quantized weights kept as stored; dequantized: expanded at load; unquantized
    # (explain() also takes auto: as a load would hold them)
    experts: str = "packed"
    dtype: str = "bfloat16"
    batch_tokens: int = 16384
    max_length: int = 4096
    captured: int = 3  # layers whose states the hooks keep per batch (besides the final state)
    pipeline: int = 1  # stages of contiguous decoder layers, each over ``tensor`` GPUs
    slice_gb: float | None = None  # GB of a MoE layer's experts expanded at once (--expert-slice-gb); None: all
    teacher: int = 0  # bytes of one masked token's --teacher row (spec.TeacherSpec.row_bytes); 0: none
    # packed experts expanded per layer; False: read packed by the dequantizing GEMM (--quantized-compute int4)
    expands: bool = True

    def __str__(self) -> str:
        ep = f" + EP{self.expert}" if self.expert > 1 else ""
        pp = f"PP{self.pipeline} x " if self.pipeline > 1 else ""
        read = "" if self.expands or self.experts != "packed" else " (read by the dequantizing GEMM)"
        form = f"{self.experts} experts{read}, " if self.experts != "unquantized" else ""
        sliced = f", experts expanded {self.slice_gb:g} GB at a time" if self.slice_gb is not None else ""
        return f"{pp}TP{self.tensor}{ep}, {form}{self.dtype}{sliced}"

    @property
    def flags(self) -> str:
        """The extraction's options that ask for this layout."""
        out = f"--tensor-parallel {self.tensor} --expert-parallel {self.expert}"
        out += f" --pipeline-parallel {self.pipeline}" if self.pipeline > 1 else ""
        out += "" if self.expands else " --quantized-compute int4"
        return out + (f" --expert-slice-gb {self.slice_gb:g}" if self.slice_gb is not None else "")

    @property
    def gpus(self) -> int:
        return self.pipeline * self.tensor


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU of one layout, by part."""

    layout: Layout
    experts: int
    sharded: int
    replicated: int
    expansion: int
    activations: int
    quantized: bool  # the routed experts are stored quantized
    source: str  # where the shapes came from
    stage: str = ""  # a pipeline layout: the stage these figures are (its largest), e.g. "stage 0 of 8, layers 0-7"
    at_once: tuple[int, int] = (0, 0)  # (experts expanded at once, local experts a MoE layer) under a slice budget
    expert_bytes: int = 0  # one routed expert expanded to the run's dtype
    teacher: int = 0  # the --teacher's head work and rows for one batch (``teacher_bytes``)

    @property
    def total(self) -> int:
        return self.experts + self.sharded + self.replicated + self.expansion + self.activations + self.teacher

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes * (1 - HEADROOM)

    @property
    def expanded(self) -> str:
        """What the expansion figure counts, in words."""
        lo, (step, local) = self.layout, self.at_once
        if not lo.expands:
            return "routed experts expanded: none (read packed by the dequantizing GEMM)"
        if lo.slice_gb is None:
            return f"one MoE layer's local experts expanded to {lo.dtype}"
        said = f"{step} of a MoE layer's {local} local experts expanded to {lo.dtype} at a time"
        return f"{said} (--expert-slice-gb {lo.slice_gb:g})"

    def slice_to_fit(self, device_bytes: int) -> Estimate | None:
        """This layout with the largest slice budget (whole experts, in tenths of a GB) that makes it
        fit ``device_bytes``; None where the whole layer fits already or not even one expert does."""
        if self.fits(device_bytes) or not self.expert_bytes:
            return None
        room = device_bytes * (1 - HEADROOM) - (self.total - self.expansion)
        budget = math.floor(room / self.expert_bytes) * self.expert_bytes / GB
        budget = math.floor(budget * 10) / 10
        if int(budget * GB) // self.expert_bytes < 1:
            return None
        return self.sliced(budget)

    def sliced(self, budget: float) -> Estimate:
        """This estimate with at most ``budget`` GB of experts expanded at once."""
        local = self.at_once[1] or 1
        step = max(1, min(local, round(budget * GB) // self.expert_bytes))
        layout = replace(self.layout, slice_gb=budget)
        return replace(
            self, layout=layout, expansion=min(self.expansion, step * self.expert_bytes), at_once=(step, local)
        )

    def lines(self, device_bytes: int | None = None) -> list[str]:
        lo = self.layout
        form = f"{lo.experts} ({'as stored' if lo.experts == 'packed' else 'expanded to ' + lo.dtype})"
        share = f"1/{lo.expert} of them" if lo.expert > 1 else "all of them (EP1)"
        out = [
            f"memory per GPU for {lo} ({self.source}){', the largest stage: ' + self.stage if self.stage else ''}:",
            f"  routed experts, {form if self.quantized else lo.dtype}, {share}: {gb(self.experts)}",
            f"  weights split by the TP plan over {lo.tensor}: {gb(self.sharded)}",
            f"  replicated weights (norms, router, embeddings, ...): {gb(self.replicated)}",
            f"  {self.expanded}: {gb(self.expansion)}",
            f"  activations for {lo.batch_tokens} tokens (upper bound): {gb(self.activations)}",
            f"  total: {gb(self.total)}",
        ]
        if lo.teacher:
            out.insert(-1, f"  --teacher: the head's logits and the batch's rows (upper bound): {gb(self.teacher)}")
        if device_bytes is not None:
            usable = device_bytes * (1 - HEADROOM)
            verdict = "fits" if self.fits(device_bytes) else "does NOT fit"
            out.append(f"  device: {gb(device_bytes)}, {gb(usable)} usable ({HEADROOM:.0%} headroom): {verdict}")
        return out


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


@dataclass(frozen=True)
class Pace:
    """The stage that sets a layout's pace (the whole model without a pipeline): its decoder
    layers from ``first``, how many of them are dense, whether it holds the embeddings; and what
    moving data costs a token there. The one place ``hsx memory``'s advice and ``hsx.bench.node``
    count it."""

    first: int
    layers: int
    dense: int
    embeddings: bool

    def allreduces(self, ranks: int) -> int:
        """A token's all-reduces over ``ranks`` tensor-parallel ranks: one after the
        vocabulary-parallel embeddings where the stage holds them, two a dense layer (attention,
        MLP), three a MoE layer (attention, shared and routed experts); none on one rank."""
        return 0 if ranks == 1 else int(self.embeddings) + 2 * self.dense + 3 * (self.layers - self.dense)

    def allreduce_bytes(self, value: int, ranks: int) -> float:
        """Bytes those all-reduces move a token, each of ``value`` bytes (a token's state), a ring
        moving 2(T-1)/T of them."""
        return self.allreduces(ranks) * value * ring(ranks)

    @staticmethod
    def handoff_bytes(value: int, states: int) -> int:
        """Bytes a token's hand-off to the next stage moves: ``states`` states of ``value`` bytes
        (the residual stream and the aux states captured so far)."""
        return states * value


def ring(ranks: int) -> float:
    """The share of its values a ring all-reduce moves over each link: 2(T-1)/T."""
    return 2 * (ranks - 1) / ranks


@dataclass
class Inventory:
    """The language model's weights, its config and transformers' TP plan for its architecture."""

    config: dict
    modules: list[Module]
    source: str
    split: list[re.Pattern] = field(default_factory=list)  # module names the TP plan shards

    @classmethod
    def of(cls, model_dir: Path) -> Inventory | None:
        """The inventory, or None for a folder without weights whose architecture's shapes hsx
        cannot derive from its config."""
        lm = LanguageModel.of(model_dir)
        keep = _keep_fp32(lm.architecture)
        if lm.weights:
            modules, source = _from_headers(lm, keep), "safetensors headers"
        else:
            modules, source = _from_config(lm.config, lm.quantization or {}, keep), "config.json shapes"
            if modules is None:
                return None
        return cls(lm.config, modules, source, _tp_split(lm.architecture))

    def sharded(self, m: Module) -> bool:
        return any(p.fullmatch(m.module) for p in self.split)

    @property
    def routed(self) -> int:
        """Routed experts a MoE layer of the model has (0: none)."""
        from hsx.capture.transformers import EXPERT_COUNTS

        return next((int(self.config[k]) for k in EXPERT_COUNTS if self.config.get(k)), 0)

    @property
    def quantized_experts(self) -> bool:
        return any(m.quantized and m.expert for m in self.modules)

    def estimate(self, layout: Layout) -> Estimate:
        """One GPU's share of ``layout``; for a pipeline, that of its largest stage."""
        if layout.pipeline == 1:
            return self._estimate(layout, self.modules)
        stages = self.stages(layout)
        return max(
            (
                replace(self._estimate(layout, self.stage_modules(stages, s)), stage=stages.describe(s))
                for s in range(stages.size)
            ),
            key=lambda e: e.total,
        )

    def _estimate(self, layout: Layout, modules: list[Module]) -> Estimate:
        b = DTYPE_BYTES[layout.dtype]
        experts = sharded = replicated = 0
        per_layer: dict[int, int] = {}
        for m in modules:
            size = self.held(m, layout)
            if m.expert:
                experts += size
                if m.quantized and layout.experts == "packed" and layout.expands:
                    key = layer_of(m)
                    per_layer[key] = per_layer.get(key, 0) + m.numel * b
            elif layout.tensor > 1 and self.sharded(m):
                sharded += size
            else:
                replicated += size
        expansion = max(per_layer.values(), default=0) / layout.expert
        local = self.routed // layout.expert if self.routed else 0
        one = round(expansion / local) if local else 0
        est = Estimate(
            replace(layout, slice_gb=None), round(experts), round(sharded), round(replicated), round(expansion),
            activations(self.config, layout), self.quantized_experts, self.source, at_once=(local, local),
            expert_bytes=one, teacher=round(teacher_bytes(self.config, layout)),
        )  # fmt: skip
        return est.sliced(layout.slice_gb) if layout.slice_gb is not None and one else est

    def held(self, m: Module, layout: Layout) -> float:
        """Bytes of ``m`` on one GPU of ``layout``: as stored where it stays packed, else in the
        run's dtype (float32 where transformers keeps it so); split over the expert or TP ranks."""
        kept = m.quantized and layout.experts == "packed"
        size = m.stored if kept else m.numel * (4 if m.fp32 else DTYPE_BYTES[layout.dtype])
        if m.expert:
            return size / layout.expert
        return size / layout.tensor if layout.tensor > 1 and self.sharded(m) else size

    def costs(self, layout: Layout) -> tuple[list[tuple[float, float]], tuple[float, float], tuple[float, float]]:
        """What the partition of a pipeline weighs: per decoder layer (compute, bytes), compute
        being the weights a token meets (the routed experts at top-k of their number) and bytes
        those it holds on a GPU of ``layout``; then the same for the embeddings (the first stage's)
        and for the final norm and head (the last stage's). A token meets one row of the
        embeddings and the norm; hsx computes no logits."""
        from hsx.capture.transformers import EXPERT_COUNTS

        layers = decoder_layers(self.config)
        routed = next((int(self.config[k]) for k in EXPERT_COUNTS if self.config.get(k)), 0)
        met = int(self.config.get("num_experts_per_tok") or 1) / routed if routed else 1.0
        hidden = int(self.config["hidden_size"])
        per_layer = [[0.0, 0.0] for _ in range(layers)]
        ends = {"first": [0.0, 0.0], "last": [0.0, 0.0]}
        for m in self.modules:
            k = layer_of(m)
            if k >= layers:
                continue  # a checkpoint's extra layers (DeepSeek-V3's multi-token prediction): not loaded
            if k >= 0:
                cost = per_layer[k]
                cost[0] += m.numel * (met if m.expert else 1)
            else:
                cost = ends["first" if EMBEDDINGS.search(m.name) else "last"]
                cost[0] += hidden if m.numel else 0
            cost[1] += self.held(m, layout)
        return [(c, b) for c, b in per_layer], tuple(ends["first"]), tuple(ends["last"])

    def pace(self, layout: Layout) -> Pace:
        """The stage of ``layout`` that sets its pace: the most compute (``costs``) under the
        partition a run makes (``stages``); the whole model without a pipeline."""
        from hsx.capture.transformers import EXPERT_COUNTS

        layers = decoder_layers(self.config)
        routed = any(self.config.get(k) for k in EXPERT_COUNTS)
        dense = min(layers, int(self.config.get("first_k_dense_replace") or 0)) if routed else layers
        first, end = 0, layers
        if layout.pipeline > 1:
            compute = [c for c, _ in self.costs(layout)[0]]
            first, end = max(self.stages(layout).ranges, key=lambda r: sum(compute[slice(*r)]))
        return Pace(first, end - first, max(0, min(end, dense) - first), first == 0)

    def stages(self, layout: Layout) -> Stages:
        """``layout.pipeline`` stages of contiguous decoder layers, balanced by their ``costs``
        (``capture.stages.partition``): the embeddings go with the first stage, the final norm and
        the head with the last."""
        from hsx.capture.stages import Stages, partition

        layers, first, last = self.costs(layout)
        return Stages(partition(layers, layout.pipeline, first, last), layout.tensor)

    def stage_modules(self, stages: Stages, stage: int) -> list[Module]:
        """The modules stage ``stage`` holds: its layers, the embeddings on the first (and on the last
        where the head is tied to them), the final norm and the head on the last."""
        first, end = stages.ranges[stage]
        last = stage == stages.size - 1
        tied = bool(self.config.get("tie_word_embeddings"))
        out = []
        for m in self.modules:
            k = layer_of(m)
            if k >= 0:
                keep = first <= k < end
            elif EMBEDDINGS.search(m.name):
                keep = stage == 0 or (last and tied)
            else:
                keep = last
            if keep:
                out.append(m)
        return out

    def smallest(self, layout: Layout, device_bytes: int, most: int = SIZES[-1]) -> Estimate | None:
        """The layout of fewest GPUs (experts split over all of a stage's where the model has routed
        experts) that fits, keeping ``layout``'s pipeline, expert form, dtype and batch; None up to
        ``most`` GPUs a stage."""
        from hsx.capture.transformers import parallel_refusal

        routed = any(m.expert for m in self.modules)
        for n in (s for s in SIZES if s <= most):
            candidate = replace(layout, tensor=n, expert=n if routed else 1)
            if parallel_refusal(self.config, candidate.tensor, candidate.expert, candidate.pipeline) is not None:
                continue
            est = self.estimate(candidate)
            if est.fits(device_bytes):
                return est
        return None


def layer_of(m: Module) -> int:
    """The decoder layer ``m`` belongs to, -1 for none (embeddings, final norm, head)."""
    found = LAYER.search(m.name)
    return int(found.group(2)) if found else -1


def teacher_bytes(config: dict, layout: Layout) -> float:
    """Upper bound of a ``--teacher`` batch's memory on the GPU that holds the head: the logits of one
    chunk of rows (``fidelity.LOGITS_BYTES`` of float32 at most) in the dtype, in float32 and their
    log-softmax, and the rows of every token of the batch (each masked, at worst)."""
    if not layout.teacher:
        return 0
    vocab = int(config.get("vocab_size") or 0)
    chunk = min(LOGITS_BYTES, layout.batch_tokens * vocab * 4)
    return chunk * (2 + DTYPE_BYTES[layout.dtype] / 4) + layout.batch_tokens * layout.teacher


def activations(config: dict, layout: Layout) -> int:
    """Upper bound of one batch's activation memory per GPU, T = ``batch_tokens`` in the run's dtype:
    T x [ 6 H (layer input, normed input, attention output, residual, MLP output, next input)
        + captured x H (the hooked states kept until the batch is copied out) + H (final state)
        + heads/TP x (2 qk + 2 v) (queries, keys, values, attention output)
        + max(3 I/TP for a dense MLP, 3 Is/TP for the shared experts + top_k x 3 Im for the routed
          ones, every routed copy on this rank: the worst case of routing) ]
    + heads/TP x max_length^2 x 4 bytes: one sequence's attention scores in float32, for an
    attention kernel that materializes them."""
    b = DTYPE_BYTES[layout.dtype]
    hidden = int(config["hidden_size"])
    heads = int(config.get("num_attention_heads") or 1) // layout.tensor or 1
    head = int(config.get("head_dim") or hidden // int(config.get("num_attention_heads") or 1))
    qk = int(config.get("qk_nope_head_dim", 0) or 0) + int(config.get("qk_rope_head_dim", 0) or 0) or head
    v = int(config.get("v_head_dim") or qk)
    dense = 3 * int(config.get("intermediate_size") or 4 * hidden) // layout.tensor
    moe = 0
    routed = int(config.get("moe_intermediate_size") or 0)
    if routed:
        shared = routed * int(config.get("n_shared_experts") or 0)
        moe = 3 * shared // layout.tensor + int(config.get("num_experts_per_tok") or 1) * 3 * routed
    per_token = (6 + layout.captured + 1) * hidden + heads * (2 * qk + 2 * v) + max(dense, moe)
    return layout.batch_tokens * per_token * b + heads * layout.max_length**2 * 4


# ---------------------------------------------------------------- the inventory


def _keep_fp32(architecture: str) -> Callable[[str], bool]:
    import transformers

    cls = getattr(transformers, architecture, None)
    names = [
        *(getattr(cls, "_keep_in_fp32_modules", None) or []),
        *(getattr(cls, "_keep_in_fp32_modules_strict", None) or []),
    ]
    return lambda name: any(f".{n}." in f".{name}." for n in names)


def _tp_split(architecture: str) -> list[re.Pattern]:
    """Module-name patterns transformers' TP plan splits over the ranks (styles that only adapt
    gradients, such as DeepSeek-V3's ``mla_kv_a_proj``, leave the weight whole)."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None:
        return []
    base = getattr(cls, "base_model_prefix", "model")
    plan = {f"{base}.{k}": v for k, v in (getattr(cls.config_class, "base_model_tp_plan", None) or {}).items()}
    plan |= getattr(cls, "_tp_plan", None) or {}
    whole = ("mla_kv_a_proj", "replicated_with_grad_allreduce")
    return [re.compile(re.escape(k).replace(r"\*", r"\d+")) for k, v in plan.items() if v not in whole]


def _from_headers(lm: LanguageModel, keep: Callable[[str], bool]) -> list[Module]:
    """One entry per weight of the language model; a quantized weight's stored parts (packed
    values, scales, shape; FP8 values and block scales) are one entry under ``<module>.weight``."""
    bits = _bits(lm.quantization or {})
    numel: dict[str, int] = {}
    stored: dict[str, int] = {}
    for key, (_, entry) in lm.weights.items():
        if not key.startswith(lm.prefix):
            continue  # a composite's other parts: not loaded
        name = key.removeprefix(lm.prefix)
        module, part = name.rsplit(".", 1) if "." in name else ("", name)
        shape, dtype = entry.get("shape") or [], str(entry.get("dtype", ""))
        count = math.prod(shape)
        if part == "weight_shape":
            continue  # the unpacked shape, which the model's config gives: not held on the device
        if part in STORED_PARTS or (part == "weight" and dtype.startswith("F8")):
            weight = f"{module}.weight"
            stored[weight] = stored.get(weight, 0) + count * DTYPE_BYTES[dtype]
            if part == "weight_packed":
                numel[weight] = shape[0] * shape[-1] * 32 // bits
            elif part == "weight":  # FP8 values: one per element
                numel[weight] = count
        else:
            numel[name] = count
    return [Module(n, c, stored.get(n, 0), keep(n)) for n, c in numel.items()]


def _bits(quantization: dict) -> int:
    for group in (quantization.get("config_groups") or {}).values():
        return int((group.get("weights") or {}).get("num_bits") or 4)
    return 4


def _from_config(config: dict, quantization: dict, keep: Callable[[str], bool]) -> list[Module] | None:
    """The weights a DeepSeek-V3 config implies (MLA attention, a dense first part, routed and
    shared experts), quantized as its quantization config says; None for another architecture."""
    if "kv_lora_rank" not in config or "n_routed_experts" not in config:
        return None
    h, layers = int(config["hidden_size"]), decoder_layers(config)
    heads, nope, rope = (
        int(config["num_attention_heads"]),
        int(config["qk_nope_head_dim"]),
        int(config["qk_rope_head_dim"]),
    )
    v, kv, q = int(config["v_head_dim"]), int(config["kv_lora_rank"]), config.get("q_lora_rank")
    inter, moe, experts = (
        int(config["intermediate_size"]),
        int(config["moe_intermediate_size"]),
        int(config["n_routed_experts"]),
    )
    shared = int(config.get("n_shared_experts") or 0) * moe
    dense, vocab = int(config.get("first_k_dense_replace") or 0), int(config["vocab_size"])
    linear: dict[str, tuple[int, int]] = {}  # module -> (out, in)
    plain: dict[str, int] = {"model.embed_tokens.weight": vocab * h, "model.norm.weight": h}
    if not config.get("tie_word_embeddings"):
        linear["lm_head"] = (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        plain |= {p + "input_layernorm.weight": h, p + "post_attention_layernorm.weight": h}
        plain[p + "self_attn.kv_a_layernorm.weight"] = kv
        if q:
            linear |= {p + "self_attn.q_a_proj": (int(q), h), p + "self_attn.q_b_proj": (heads * (nope + rope), int(q))}
            plain[p + "self_attn.q_a_layernorm.weight"] = int(q)
        else:
            linear[p + "self_attn.q_proj"] = (heads * (nope + rope), h)
        linear |= {
            p + "self_attn.kv_a_proj_with_mqa": (kv + rope, h),
            p + "self_attn.kv_b_proj": (heads * (nope + v), kv),
        }
        linear[p + "self_attn.o_proj"] = (h, heads * v)
        if i < dense:
            linear |= {p + "mlp.gate_proj": (inter, h), p + "mlp.up_proj": (inter, h), p + "mlp.down_proj": (h, inter)}
            continue
        plain |= {p + "mlp.gate.weight": experts * h, p + "mlp.gate.e_score_correction_bias": experts}
        if shared:
            s = p + "mlp.shared_experts."
            linear |= {s + "gate_proj": (shared, h), s + "up_proj": (shared, h), s + "down_proj": (h, shared)}
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            linear |= {x + "gate_proj": (moe, h), x + "up_proj": (moe, h), x + "down_proj": (h, moe)}
    stored = _stored_bytes(quantization, config)
    out = [Module(n, c, 0, keep(n)) for n, c in plain.items()]
    out += [Module(n + ".weight", o * i, stored(n, o, i), keep(n + ".weight")) for n, (o, i) in linear.items()]
    return out


def _stored_bytes(quantization: dict, config: dict) -> Callable[[str, int, int], int]:
    """Bytes a linear module [out, in] is held in under ``quantization`` (0: not quantized).
    compressed-tensors pack-quantized: int32 words of 32/bits values, a scale per group (the
    checkpoint's dtype; the stored int32 [2] shape is not held); fine-grained FP8: a byte per value and a float32
    scale per block."""
    method = quantization.get("quant_method")
    scale_bytes = DTYPE_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"), 2)
    if method == "compressed-tensors" and quantization.get("format") == "pack-quantized":
        weights = next(iter((quantization.get("config_groups") or {}).values()), {}).get("weights") or {}
        bits, group = int(weights.get("num_bits") or 4), weights.get("group_size")
        ignore = quantization.get("ignore") or []

        def packed(name: str, rows: int, cols: int) -> int:
            if _ignored(name, ignore):
                return 0
            groups = math.ceil(cols / int(group)) if group else 1
            return rows * math.ceil(cols * bits / 32) * 4 + rows * groups * scale_bytes

        return packed
    if method == "fp8":
        block = quantization.get("weight_block_size") or [128, 128]
        skip = quantization.get("modules_to_not_convert") or ["lm_head"]

        def fp8(name: str, rows: int, cols: int) -> int:
            if _ignored(name, skip):
                return 0
            return rows * cols + math.ceil(rows / block[0]) * math.ceil(cols / block[1]) * 4

        return fp8
    return lambda name, rows, cols: 0


def _ignored(name: str, ignore: list[str]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


# ---------------------------------------------------------------- the check before loading


def check(inventory: Inventory, layout: Layout, device_bytes: int, gpus: int) -> Estimate:
    """The estimate of ``layout``; raises ``LayoutTooLarge`` with the arithmetic and the smallest
    layout that would fit where one GPU's share exceeds ``device_bytes`` (of ``gpus`` on this node)."""
    est = inventory.estimate(layout)
    if est.fits(device_bytes):
        return est
    lines = est.lines(device_bytes)
    smallest = inventory.smallest(layout, device_bytes)
    if smallest is None:
        lines.append(f"smallest layout that fits: none up to {SIZES[-1]} GPUs of {gb(device_bytes)}")
    elif smallest.layout.gpus > gpus:
        n = smallest.layout.gpus
        lines.append(f"smallest layout that fits: none on one node of {gpus} GPUs ({smallest.layout} would, on {n})")
    else:
        lines.append(f"smallest layout that fits: {smallest.layout} ({gb(smallest.total)} per GPU)")
    if layout.experts == "dequantized" and est.quantized:
        packed = inventory.estimate(replace(layout, experts="packed"))
        if packed.fits(device_bytes):
            lines.append(f"with the experts kept packed, {packed.layout} would fit ({gb(packed.total)} per GPU)")
    if (sliced := est.slice_to_fit(device_bytes)) is not None:
        step, local = sliced.at_once
        lines.append(
            f"with --expert-slice-gb {sliced.layout.slice_gb:g} ({step} of {local} experts expanded at a time, the "
            f"same states) it would fit ({gb(sliced.total)} per GPU)"
        )
    raise LayoutTooLarge(f"the model does not fit {layout} on {gpus} x {gb(device_bytes)}:\n  " + "\n  ".join(lines))


@dataclass(frozen=True)
class Candidate:
    """A layout of the node's GPUs: its memory, and what moving data costs a token at its slowest
    stage (tensor parallelism's all-reduces; a pipeline's hand-off to the next stage), in seconds."""

    estimate: Estimate
    allreduce: float
    handoff: float
    arithmetic: str

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @property
    def seconds(self) -> float:
        return self.allreduce + self.handoff


def candidates(inventory: Inventory, base: Layout, gpus: int, links: Links) -> list[Candidate]:
    """Every layout of ``gpus`` GPUs the model can be split into (a pipeline of P stages, each of
    TP = EP = gpus / P ranks), ``base``'s expert form, dtype and batch kept, with its memory and
    what moving data costs a token at its slowest stage (``Pace``): its all-reduces at the bus
    bandwidth; the hand-off, the residual stream and every aux state, at the point-to-point
    bandwidth."""
    from hsx.capture.transformers import EXPERT_COUNTS, parallel_refusal

    config = inventory.config
    routed = any(config.get(k) for k in EXPERT_COUNTS)
    value = int(config["hidden_size"]) * DTYPE_BYTES[base.dtype]  # bytes of one state of a token
    out = []
    for p in (n for n in range(1, gpus + 1) if gpus % n == 0):
        t = gpus // p
        layout = replace(base, tensor=t, expert=t if routed else 1, pipeline=p)
        if parallel_refusal(config, t, layout.expert, p) is not None:
            continue
        pace = inventory.pace(layout)
        reduces = pace.allreduces(t)
        allreduce = pace.allreduce_bytes(value, t) / (links.allreduce_gbps * 1e9)
        states = 1 + base.captured
        handoff = Pace.handoff_bytes(value, states) / (links.p2p_gbps * 1e9) if p > 1 else 0.0
        said = []
        if reduces:
            said.append(
                f"{reduces} all-reduces x {value:,} B x {ring(t):.2f} / {links.allreduce_gbps:g} GB/s = "
                f"{allreduce * 1e6:,.1f} us"
            )
        if p > 1:
            said.append(f"hand-off {states} x {value:,} B / {links.p2p_gbps:g} GB/s = {handoff * 1e6:,.2f} us")
        out.append(Candidate(inventory.estimate(layout), allreduce, handoff, "; ".join(said) or "nothing moves"))
    return out


def advise(inventory: Inventory, base: Layout, gpus: int, device_bytes: int, links: Links) -> list[str]:
    """Which layout of ``gpus`` GPUs of ``device_bytes`` to run, with the arithmetic: every layout
    the model splits into, its memory and what moving data costs a token at its slowest stage.
    Among those that fit: on NVLink tensor + expert parallel over all of them (its all-reduces are
    cheap there); on PCIe the one that moves the least a token (a pipeline, or TP within its
    stages where a pipeline alone does not fit). A layout whose whole MoE layer's expansion does
    not fit but a slice of its experts does counts as fitting with that slice (the same states)."""
    found = candidates(inventory, base, gpus, links)
    link = "NVLink" if links.nvlink else "PCIe (no NVLink)"
    lines = [
        f"layouts of {gpus} GPUs of {gb(device_bytes)} over {link}: all-reduce {links.allreduce_gbps:g} GB/s, "
        f"neighbour to neighbour {links.p2p_gbps:g} GB/s ({links.source}); per token at the slowest stage:"
    ]
    fitting = []
    for c in found:
        line = (
            f"  {c.layout}: {gb(c.estimate.total)} a GPU, {'fits' if c.estimate.fits(device_bytes) else 'does NOT fit'}"
        )
        if (sliced := c.estimate.slice_to_fit(device_bytes)) is not None:
            step, local = sliced.at_once
            line += (
                f"; with --expert-slice-gb {sliced.layout.slice_gb:g} ({step} of {local} experts expanded at a time): "
                f"{gb(sliced.total)}, fits"
            )
            c = replace(c, estimate=sliced)
        ceiling = f"the interconnect allows {1 / c.seconds:,.0f} tok/s" if c.seconds else "no interconnect limit"
        lines.append(f"{line}; {c.arithmetic}; {ceiling}")
        fitting += [c] if c.estimate.fits(device_bytes) else []
    if not fitting:
        lines.append(f"advice: no layout of {gpus} GPUs fits; see the memory of each above")
        return lines
    tp = [c for c in fitting if c.layout.pipeline == 1]
    if links.nvlink and tp:
        pick, why = tp[0], "its all-reduces run on NVLink"
    else:
        pick = min(fitting, key=lambda c: (c.seconds, c.layout.pipeline))
        why = "it moves the least a token"
        why += "" if links.nvlink else ": over PCIe the all-reduces, not the forward pass, set TP's pace"
    lines.append(f"advice: {pick.layout.flags} ({pick.layout}), since {why}")
    return lines


def expert_form(model_dir: Path, device: str, dtype: str) -> str:
    """How the loader holds quantized weights: "packed" (as stored) or "dequantized" (expanded to
    the run's dtype at load); "unquantized" for a checkpoint without them. INT4 routed experts that
    are the checkpoint's only quantized weights stay packed (``hsx.target.held_experts``, the test
    ``checkpoint.plan`` applies); FP8 stays FP8 where its kernels run; other compressed-tensors
    weights go through transformers' conversion, which expands them at load. The one place that
    says which form a load takes."""
    from hsx.capture import checkpoint

    lm = LanguageModel.of(model_dir)
    method = (lm.quantization or {}).get("quant_method")
    if method is None:
        return "unquantized"
    if lm.weights:
        held = held_experts(lm) is not None  # hsx holds them as stored, expanded per layer (capture.quantized)
    else:  # a shape folder: the same rule on the modules its config implies, quantized as it says
        inventory = Inventory.of(model_dir)
        quantized = [m for m in inventory.modules if m.quantized] if inventory else []
        held = int4_group(lm.quantization) is not None and bool(quantized) and all(m.expert for m in quantized)
    if held:
        return "packed"
    return "packed" if method == "fp8" and not checkpoint.plan(model_dir, device, dtype).dequantize else "dequantized"


def device_memory(device: str, ranks: int) -> tuple[int, int, str]:
    """(bytes one rank may use, GPUs on this node, what was measured). CUDA: the free memory of
    this process's GPU (the group's GPUs are taken to be alike); CPU: the available memory shared
    by the ranks."""
    import torch

    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return free, torch.cuda.device_count(), f"{gb(free)} free of {gb(total)} on {device}"
    import psutil

    available = psutil.virtual_memory().available
    return available // ranks, ranks, f"{gb(available)} of host memory available for {ranks} rank(s)"


def check_run(spec: RunSpec, model_dir: Path, device: str, log: Callable[[str], None]) -> Estimate | None:
    """Before the model is loaded: the run's layout worked out, logged, and refused where it cannot fit."""
    inventory = Inventory.of(model_dir)
    if inventory is None:
        log("memory: not worked out (no weights, and no DeepSeek-V3 shapes in config.json)")
        return None
    layout = Layout(
        tensor=spec.parallel.tensor,
        expert=spec.parallel.expert,
        experts=expert_form(model_dir, device, spec.dtype),
        dtype=spec.dtype,
        batch_tokens=spec.batch_tokens,
        max_length=spec.max_length,
        captured=len(spec.layers),
        pipeline=spec.parallel.pipeline,
        slice_gb=spec.expert_slice_gb,
        teacher=0 if spec.teacher is None else spec.teacher.row_bytes(spec.state_itemsize),
        expands=spec.quantized_compute != "int4",
    )
    usable, gpus, measured = device_memory(device, spec.parallel.ranks)
    try:
        est = check(inventory, layout, usable, gpus)
    except LayoutTooLarge as e:
        if spec.parallel.ranks > 1 or gpus < 2:
            raise
        from hsx.interconnect import links

        found = links(gpus)  # a run given no layout, on a node of several GPUs: which one, measured
        if found is None:
            raise
        advice = advise(inventory, layout, gpus, usable, found)
        raise LayoutTooLarge(f"{e}\n  " + "\n  ".join(advice) + "\n  (a new run, in another --out)") from e
    for line in est.lines(usable):
        log(line)
    log(f"  (device memory: {measured})")
    return est


def explain(
    model_dir: Path,
    layout: Layout | None,
    device_bytes: int | None,
    gpus: int | None,
    base: Layout = Layout(),
    stated: tuple[float | None, float | None, bool | None] = (None, None, None),
) -> list[str]:
    """``hsx memory``: the arithmetic of ``layout`` for the model in ``model_dir``, with the verdict
    for ``gpus`` devices of ``device_bytes`` each (this node's where None; none on a machine without
    GPUs); raises ``LayoutTooLarge`` where it does not fit. Experts ``auto``: held as a CUDA load
    of the run's dtype would hold them. No ``layout`` on ``gpus`` > 1: the advice of which layout
    to run (``advise``), ``base``'s experts, dtype and batch kept, judged by the bandwidths
    ``stated`` (all-reduce, point to point, NVLink) or, without them, measured on this node."""
    import torch

    if base.experts == "auto":
        base = replace(base, experts=expert_form(model_dir, "cuda", base.dtype))
    layout = replace(layout, experts=base.experts) if layout is not None else None
    inventory = Inventory.of(model_dir)
    if inventory is None:
        raise LayoutTooLarge(
            f"{model_dir}: no weights, and no DeepSeek-V3 shapes in config.json to work out memory from"
        )
    if device_bytes is None and torch.cuda.is_available():
        device_bytes = torch.cuda.mem_get_info(0)[1]
    if gpus is None:
        gpus = torch.cuda.device_count() or (layout.gpus if layout else 1)
    config = inventory.config
    lo = layout or base
    storage = storage_lines(decoder_layers(config), int(config["hidden_size"]), lo.dtype, lo.teacher)
    if layout is None and gpus > 1:
        from hsx.interconnect import links

        found = links(gpus, *stated)
        if found is None or device_bytes is None:
            return [
                f"which layout of {gpus} GPUs: give --gpu-memory, --allreduce-gbps and --p2p-gbps (and --interconnect) "
                f"to compare them; this machine cannot measure {gpus} GPUs"
            ]
        return advise(inventory, base, gpus, device_bytes, found) + storage
    layout = layout or base
    if device_bytes is None:
        return inventory.estimate(layout).lines() + storage
    return check(inventory, layout, device_bytes, gpus).lines(device_bytes) + storage
