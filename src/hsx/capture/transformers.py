"""Capture with Hugging Face transformers: forward hooks on the chosen decoder layers and the final norm.

Never ``output_hidden_states=True`` (it keeps every layer alive) and never the lm_head on every
token (a [tokens, vocab] logits tensor we do not need): the base model runs with hooks and its
outputs are discarded; the fidelity check runs the model's own head on the sampled tokens only
(``hsx.fidelity``). Two batch layouts:
- padded: one sample per row, right-padded, with an attention mask (causal attention means a real
  token never sees padding); works for every model;
- packed: all samples in one row, per-sample ``position_ids``, attention confined to each sample
  by ``hsx_varlen`` (see varlen.py); computes no padding.

Optionally each decoder layer's forward is compiled (``torch.compile``, dynamic shapes): on an 8B
model about a quarter of an eager forward is element-wise kernels (RMSNorm's five passes, rotary,
SiLU, residual adds) that the compiler fuses. Inductor runs in its deterministic mode, no pointwise
or reduction kernel is timed to pick its configs, and every graph is first traced on the same
canonical batches (``_warm_up``), so that every process that compiles the same layer gets the same
kernels: a resumed run or another scale-out worker computes bit-identical states.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hsx import certify, fidelity, target
from hsx.capture import CapturedBatch, check_layers, checkpoint, textlm, varlen
from hsx.capture.locate import locate
from hsx.errors import OptionError

if TYPE_CHECKING:
    from hsx.capture.stages import Stages
    from hsx.spec import CertifyCheck
    from hsx.teacher import Work

NAME = "transformers"

log = logging.getLogger("hsx.checkpoint")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise OptionError(f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return dtype


def packing_supported(architecture: str) -> bool:
    """Whether the architecture's attention goes through transformers' pluggable functions."""
    import transformers

    cls = getattr(transformers, architecture, None)
    return cls is not None and varlen.supported(cls)


def _head_dims(config: dict) -> tuple[int, int]:
    """(q/k, v) head dims of the attention layers, the largest where layer kinds differ. MLA configs
    (DeepSeek-V2/V3, Kimi-K2) split q/k into a rotary and a plain part; their ``head_dim``, where
    present, is the rotary part only."""
    if "qk_nope_head_dim" in config and "qk_rope_head_dim" in config:
        qk = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
    else:
        qk = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        qk = max(qk, int(config.get("swa_head_dim") or 0))
    v = max(int(config.get("v_head_dim") or qk), int(config.get("swa_v_head_dim") or 0))
    return qk, v


def _unimplemented_feature(config: dict) -> str | None:
    """Attention the packed path does not compute (it refuses such layers at run time, or, for a
    sparse-attention indexer, transformers' own layer fails on the mask packed rows do not have)."""
    if config.get("index_topk"):  # DeepSeek-V3.2, GLM-5, DeepSeek-V4: the indexer reads the padded rows' mask
        return "the sparse-attention indexer (it reads the attention mask, and packed rows have none)"
    if config.get("model_type") == "gpt_oss":
        return "attention sinks"
    if config.get("rel_extent"):  # Inkling
        return "a relative position bias"
    if config.get("attn_logit_softcapping"):
        return "attention logit softcapping"
    layer_types = config.get("layer_types") or []
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and (not layer_types or "sliding_attention" in layer_types):
        return f"sliding-window attention ({window} tokens)"
    if config.get("attention_chunk_size") or "chunked_attention" in layer_types:
        return "chunked attention"
    return None


def packing_refusal(config: dict) -> str | None:
    """Why packed rows cannot compute this model at all (one line), or None."""
    architecture = config.get("architectures", ["?"])[0]
    if not packing_supported(architecture):
        return f"{architecture} does not take a pluggable attention function"
    feature = _unimplemented_feature(config)
    return None if feature is None else f"hsx_varlen does not implement {feature}"


def varlen_blocker(config: dict, device: str, dtype: str = "auto") -> str | None:
    """Why packed rows of this model would not run the varlen kernel on every attention layer on
    ``device`` (one line), or None when they would. ``config`` is the model's config.json as
    ``hsx.target.load_config`` returns it; ``dtype`` as ``--dtype`` takes it. Where this is not
    None, packing is per-sample attention (slower than padded rows) or refused, so ``--packing
    auto`` should pad. Reads the config's standard fields; ``varlen.CALLS`` counts what really ran."""
    refusal = packing_refusal(config)
    if refusal is not None:
        return refusal
    qk, v = _head_dims(config)
    reason = varlen.blocker(max(qk, v), DTYPES[resolve_dtype(dtype, device)], device)
    return None if reason is None else f"{reason} (q/k head dim {qk}, v head dim {v})"


EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")

# Sample lengths of the canonical batches a compiled layout is first traced on (``_warm_up``): a
# dynamic-shape graph keeps the sizes of the batch it was traced on as the "hints" its kernels are
# configured by. Two samples of 2047 and 2046 tokens: a packed row of 4093 tokens (prime, so equal to
# no model dimension: duck sizing would tie it to one) whose longest sample is not the row, and the
# 2-row padded batch; one sample of 2047 (the 1-row padded batch: a size of 1 is specialised, so
# it is a graph of its own); five one-token samples (sizes of 1 the other way round).
WARM_UP_LENGTHS = ((2047, 2046), (2047,), (1, 1, 1, 1, 1))


def parallel_refusal(config: dict, tensor: int, expert: int, pipeline: int = 1) -> str | None:
    """Why this model cannot be split ``tensor`` ways (experts ``expert`` ways) in each of
    ``pipeline`` stages, or None.

    hsx runs one replica per group, every rank of a stage on the same batch: the experts may be
    split over the same ranks as the dense layers (EP = TP) or not at all; more expert ranks than
    that would need ranks with their own batches (data parallel), which is what ``--workers`` is for.
    A pipeline needs a decoder layer a stage at least."""
    if tensor < 1 or expert < 1 or pipeline < 1:
        return "parallel sizes are at least 1"
    if pipeline > 1 and pipeline > (layers := target.decoder_layers(config)):
        return f"{pipeline} pipeline stages need as many decoder layers, and the model has {layers}"
    if pipeline > 1 and config.get("hc_mult"):
        return "hsx does not split a model with hyper-connection streams (DeepSeek-V4, GLM-5-next) into pipeline stages"
    if expert not in (1, tensor):
        return f"the expert-parallel size must be 1 or the tensor-parallel size ({tensor}), not {expert}"
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = config.get(key)
        if heads and int(heads) % tensor:
            return f"{key} = {heads} does not split over {tensor} ranks"
    experts = next((int(config[k]) for k in EXPERT_COUNTS if config.get(k)), 0)
    if expert > 1 and not experts:
        return f"{config.get('architectures', ['this model'])[0]} has no routed experts to split"
    if expert > 1 and experts % expert:
        return f"{experts} routed experts do not split over {expert} ranks"
    method = (config.get("quantization_config") or {}).get("quant_method")
    if pipeline > 1 and expert > 1 and method in checkpoint.FP8_METHODS:
        return "FP8 routed experts are split by transformers' own EP plan, which hsx has not run in a pipeline"
    if expert > 1 and method in checkpoint.FP8_METHODS and (found := _older_transformers(FP8_EP_TRANSFORMERS)):
        return (
            f"FP8 routed experts are split by transformers' own EP plan, which fails on transformers {found} "
            f"(FSDP2 under inference mode) and runs on {FP8_EP_TRANSFORMERS} and newer: upgrade transformers, "
            "or run without --expert-parallel"
        )
    return None


FP8_EP_TRANSFORMERS = "5.25"  # the oldest transformers FP8 + --expert-parallel was tested to run on


def _older_transformers(than: str) -> str | None:
    """The installed transformers' version where it is older than ``than``, else None."""
    import transformers
    from packaging.version import Version

    return transformers.__version__ if Version(transformers.__version__) < Version(than) else None


def padded_attention(model_class) -> str:
    """The attention implementation of padded rows: SDPA, or eager where the class refuses SDPA
    (gpt-oss's sinks, DeepSeek-V4's compressed attention); both exact."""
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def _causal_lm_class(config, trust_remote_code: bool):
    """transformers' own causal-LM class for a config object or a model folder, None where it has none."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if isinstance(config, (str, Path)):
        config = AutoConfig.from_pretrained(config, trust_remote_code=trust_remote_code)
    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def refuse_unloadable(model_dir: Path, trust_remote_code: bool, device: str = "cpu", dtype: str = "float32") -> None:
    """Refuse, before a run is made of it, a model this backend cannot load: a config.json
    transformers cannot read, or a model type with no causal-LM class, unless the repository's own
    code is allowed to run. A composite whose text config names a causal LM (Kimi-K2.5) is its
    language model (``target.LanguageModel``); one whose text model transformers implements
    without a head (GLM-5-next) is that text model with its head (``textlm``)."""
    import transformers

    from hsx.errors import UnsupportedModel

    try:
        native = checkpoint.plan(model_dir, device, dtype).config  # as ``load`` reads it
        found = _causal_lm_class(native or model_dir, trust_remote_code)
    except UnsupportedModel:
        raise
    except Exception as e:
        version = transformers.__version__
        raise UnsupportedModel(f"{model_dir}/config.json: transformers {version} cannot read it ({e})") from e
    if found is None and not trust_remote_code and textlm.TextLM.of(model_dir) is None:
        top, text = checkpoint.read_config(model_dir), target.load_config(model_dir)
        kinds = [str(c.get("model_type")) for c in (top, text) if c.get("model_type")]
        raise UnsupportedModel(
            f"{model_dir}: transformers {transformers.__version__} has no causal-LM class for model type "
            f"{' / '.join(dict.fromkeys(kinds))!r}, and hsx runs a causal LM's decoder: no language model of "
            "this checkpoint can be loaded alone"
        )


def deterministic_compile() -> None:
    """The compiler's settings under which every process that compiles the same layers on the same
    batches gets the same kernels (and so the same bits)."""
    import torch._dynamo.config
    import torch._inductor.config

    torch._inductor.config.deterministic = True
    # Deterministic mode still times the candidate configs of a pointwise kernel on its
    # first call and keeps the fastest (it takes block sizes not to change the numbers).
    # A choice made by timing noise may differ in another process: with the warm-up (``_warm_up``)
    # alone, compiling the same layers afresh on the same batches in one process still gave
    # other bits for the same batch now and then; with this off too, it did not (which
    # timed choice made the difference was not isolated). Each pointwise kernel then runs
    # the first config of its heuristic, chosen from the sizes alone.
    torch._inductor.config.triton.autotune_pointwise = False
    # Reductions (RMSNorm's sum of squares) are the same story, and torch 2.11's
    # deterministic mode does not yet filter their candidate configs down to one, so it
    # times them: recompiling the same layers 14 times on the H200 gave 2 or 3 different
    # bit patterns for 20 of 24 batches. This switch makes the filter run (newer torch
    # does it in deterministic mode anyway); with it, every recompile gave the same bits.
    torch._inductor.config.test_configs.force_filter_reduction_configs = True
    # past the limit dynamo would fall back to eager for new shapes without a word: the
    # same batch would then give other bits in another process. Fail instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)


class TransformersBackend:
    name = NAME

    def __init__(
        self,
        model,
        layers: list[int],
        packed: bool = False,
        compiled: bool = False,
        prenorm: bool = False,
        owned: range | None = None,
    ):
        """Wrap a loaded model; ``load`` is the usual way in. ``prenorm``: the final state is the final
        norm's input (the last layer's raw output) instead of its output. ``owned``: the decoder layers
        this process runs, where the model is one pipeline stage (``capture.stages``): only they are
        hooked and compiled, and the final state (and the fidelity check's head) only where the last
        of them is the model's."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.packed = packed
        self.prenorm = prenorm
        config = self.model.config.get_text_config()
        self.num_layers = target.decoder_layers(config)
        self.hidden_size = int(config.hidden_size)
        self.streams = int(getattr(config, "hc_mult", 0) or 0)  # hyper-connection streams (DeepSeek-V4)
        # the LM head's input is the normed state over this (Inkling): a post-norm final state is that input
        self.divisor = float(getattr(config, "logits_mup_width_multiplier", None) or 1.0)
        check_layers(layers, self.num_layers)
        self.owned = owned or range(self.num_layers)
        self.taps = list(layers)  # the run's: a pipeline stage hooks its own share (``layers``)
        self.layers = [k for k in layers if k in self.owned]
        self.parts = locate(self.model, self.num_layers)
        last = self.owned.stop == self.num_layers  # the model's last layer is ours: so are its norm and head
        self.head = fidelity.Head.of_model(self.model, self.parts.norm) if last else None
        from hsx.capture.quantized.experts import stored_modules

        for _, experts in stored_modules(self.model):  # on CUDA a layer's expansion is one fused kernel pass
            experts.compiled = self.device.type == "cuda" and experts.fmt.compile
        self._outputs: dict[object, torch.Tensor] = {}
        for k in self.layers:
            self.parts.layers[k].register_forward_hook(self._keep(k))
        if last and prenorm:
            self.parts.norm.register_forward_pre_hook(lambda _module, args: self._outputs.__setitem__("final", args[0]))
        elif last:
            self.parts.norm.register_forward_hook(self._keep("final"))
        self.compiled = False
        self._cold: set[bool] = set()  # layouts (packed or not) not yet traced since compiling
        self.set_compiled(compiled)
        self.checks: CertifyCheck | None = None  # the run's tap checks (``certifies``); None: none
        self.routed = any(getattr(config, k, None) for k in EXPERT_COUNTS)
        from hsx.capture.quantized import fp8

        self.quantized = fp8.installed(self.model)  # inputs rounded to e4m3 on the fly: a wider shadow bound

    def certifies(self, checks: CertifyCheck | None) -> None:
        """Check every sample's taps as it is captured, and recompute the samples ``checks`` picks
        through the plain path (``hsx.certify``); None: neither."""
        self.checks = checks
        self._first = True  # this session's first batch is still to come: its first sample is recomputed

    def set_packed(self, packed: bool) -> None:
        """Switch between padded rows and one packed row (same weights, other attention function)."""
        attention = varlen.register(self.compiled) if packed else padded_attention(type(self.model))
        self.model.set_attn_implementation(attention)
        self.packed = packed

    def set_compiled(self, compiled: bool) -> None:
        """Compile each decoder layer's forward, or go back to eager. The hooks sit on the modules,
        outside the compiled forwards, so capture is unchanged."""
        if compiled:
            deterministic_compile()
        varlen.register(compiled)  # the packed rows' attention kept out of the graphs where they are compiled
        for k in self.owned:
            layer = self.parts.layers[k]
            layer.__dict__.pop("forward", None)  # the class's own forward again
            if compiled:
                layer.forward = torch.compile(layer.forward, dynamic=True)
        self.compiled = compiled
        self._cold = {False, True} if compiled else set()

    def _warm_up(self) -> None:
        """Trace the compiled layers of the current layout on canonical batches before any real one.

        Why: with dynamic shapes, Inductor configures each generated kernel from the sizes of the
        example it traced first (its size hints). Which configs a persistent reduction such as
        RMSNorm's may use (XBLOCK, num_warps) depends on the token count's hint, and they can sum a
        row in another order, hence round it otherwise: on the GPU, the same batch got other bits
        depending on the batch the process had traced first, and the norm kernel's candidate
        configs differed with it. So a resume, whose first batch is another, wrote other bits for
        a sample, from the first token whose norm rounded the other way on, through the causal
        attention. Traced here first on batches that depend on nothing but the model's config,
        every process has the same graphs with the same hints, and the real batches reuse them
        (one more graph only for a single one-token batch, whose static sizes need no hints). The
        token ids are fixed too, so that data-dependent paths (routers) trace the same way."""
        for batch in self.warm_up_batches():
            self.forward(self.inputs(batch))
        self._outputs.clear()

    def warm_up_batches(self) -> list[list[np.ndarray]]:
        """The canonical batches of ``_warm_up``: lengths ``WARM_UP_LENGTHS``, fixed token ids."""
        config = self.model.config.get_text_config()
        vocab = int(config.vocab_size)
        longest = int(getattr(config, "max_position_embeddings", 0) or 0) or max(map(max, WARM_UP_LENGTHS))
        seqs, out = 0, []
        for lengths in WARM_UP_LENGTHS:
            batch = []
            for n in (min(n, longest) for n in lengths):
                batch.append((np.arange(seqs, seqs + n, dtype=np.int64) * 7919 + 13) % vocab)
                seqs += n
            out.append(batch)
        return out

    def mark_warm(self) -> None:
        """Take the layout as traced: a pipeline stage is warmed up by batches through the pipe
        (``capture.stages.PipelineCapture``), since it cannot run a batch alone."""
        self._cold.clear()

    @classmethod
    def load(
        cls,
        model_dir: Path,
        layers: list[int],
        dtype: str,
        device: str,
        packed: bool = False,
        trust_remote_code: bool = False,
        compiled: bool = False,
        tensor: int = 1,
        expert: int = 1,
        quantized_compute: str | None = None,
        prenorm: bool = False,
        stages: Stages | None = None,
        slice_gb: float | None = None,
    ) -> TransformersBackend:
        """Load the model onto ``device``; with ``tensor`` > 1 this process is one rank of an
        initialised torch.distributed group and holds its share (transformers' TP/EP plans).
        ``quantized_compute``: how an FP8 checkpoint or INT4-packed experts compute (None: the default).
        ``stages``: a pipeline; this rank loads its stage's layers alone (``capture.stages``).
        ``slice_gb``: GB of a MoE layer's experts expanded at once (None: the whole layer's)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        from hsx.capture.quantized import experts

        how = checkpoint.prepared(model_dir, device, dtype, quantized_compute)  # quantized / native-class checkpoints
        fmt = how.experts
        model_class = _causal_lm_class(how.config or model_dir, trust_remote_code)
        alone = textlm.TextLM.of(model_dir, trust_remote_code) if model_class is None and how.config is None else None
        if alone is not None:  # a composite's language model that transformers puts no head on (GLM-5-next)
            model_class = alone.model_class
        unquantized = how.quantization_config is None and not target.quantization_of(model_dir)
        if fmt is None and expert > 1 and unquantized and model_class and experts.experts_classes(model_class):
            fmt = experts.DENSE  # dense experts split by hsx too: the same on every transformers version
        placement: dict = {}
        pipeline = stages.size if stages is not None else 1
        if tensor > 1 or pipeline > 1:
            from transformers.distributed import DistributedConfig

            # experts hsx holds itself are split by hsx (capture.quantized.experts), not transformers
            placement["distributed_config"] = DistributedConfig(
                tp_size=tensor, pp_size=pipeline, ep_size=1 if fmt else expert
            )
        rank = torch.distributed.get_rank() if expert > 1 or stages is not None else 0
        loader = model_class if alone else AutoModelForCausalLM
        owned, group = None, None  # group: the ranks the experts are split over
        with contextlib.ExitStack() as stack:
            if stages is not None:
                from hsx.capture.stages import stage_groups, stage_loader

                groups = stage_groups(stages)  # every rank makes every stage's group, in the same order
                group = groups[stages.stage_of(rank)] if expert > 1 else None
                loader = stack.enter_context(stage_loader(model_class, stages, rank))
                owned = range(*stages.ranges[stages.stage_of(rank)])
            if fmt is not None:
                ep_rank = rank % tensor if expert > 1 else 0
                stack.enter_context(experts.swapped(model_class, fmt, DTYPES[dtype], ep_rank, expert, group))
            model = loader.from_pretrained(
                model_dir,
                dtype=DTYPES[dtype],
                trust_remote_code=trust_remote_code,
                attn_implementation=varlen.register(compiled) if packed else padded_attention(model_class),
                **placement,
                **(how.kwargs() | (alone.kwargs() if alone else {})),
            )
        if tensor == 1 and pipeline == 1:
            model = model.to(device)
        if fmt is not None:
            prefix = target.LanguageModel.of(model_dir).prefix  # a composite's language model: its weights' names
            experts.fill(model, Path(model_dir), next(model.parameters()).device, prefix)
            reading = quantized_compute == "int4"  # the packed weights read by a dequantizing GEMM
            for _, module in experts.stored_modules(model):
                module.dequantizing = reading
            held = experts.describe(fmt, DTYPES[dtype], expert, dequantizing=reading)
            log.warning("checkpoint: routed experts held as %s", held)
        if how.fp8:
            from hsx.capture.quantized import fp8

            log.warning("checkpoint: %s", fp8.install(model))
        if slice_gb is not None:
            log.warning("checkpoint: %s", experts.set_slice(model, round(slice_gb * 1e9), DTYPES[dtype]))
        return cls(model, layers, packed, compiled, prenorm, owned)

    def _keep(self, key):
        """A hook that keeps a module's output. A decoder layer of a model with hyper-connections
        (DeepSeek-V4) puts out its ``hc_mult`` residual streams, [..., streams, hidden]: its tap is
        their mean, as SGLang captures it for the drafts trained on V4."""

        def hook(_module, _inputs, output):
            self._outputs[key] = self._as_captured(key, output[0] if isinstance(output, tuple) else output)

        return hook

    def _as_captured(self, key, out: torch.Tensor) -> torch.Tensor:
        """A module's output as the run stores it (``_keep``): a tap's streams averaged, the final
        state over the head's divisor."""
        if self.streams and key != "final" and out.dim() == 4:
            out = out.mean(dim=-2)
        if key == "final" and self.divisor != 1.0:
            out = out / self.divisor
        return out

    def keep_output(self, layer: int) -> None:
        """Also keep decoder layer ``layer``'s output (a pipeline stage's last: what it hands on)."""
        if layer not in self.layers:
            self.parts.layers[layer].register_forward_hook(self._keep(layer))

    def take(self, keys: list) -> list[torch.Tensor]:
        """The kept outputs of the last forward (layer ids, or "final"), forgetting them all."""
        out = [self._outputs[k] for k in keys]
        self._outputs.clear()
        return out

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """An input's copy to the device that does not stop the host: from pageable memory a CUDA
        copy first waits for the device to finish all queued work, so the GPU would run dry while
        the host prepared the next batch; from pinned memory it is queued like a kernel."""
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def pad(self, sequences: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to the longest; returns (input_ids, attention_mask) on the device."""
        longest = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), longest), dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
            mask[row, : len(seq)] = 1
        return self._to_device(ids), self._to_device(mask)

    def pack(self, sequences: list[np.ndarray]) -> dict:
        """One row of all samples, per-sample positions and the cu_seqlens the attention reads."""
        lengths = [len(s) for s in sequences]
        ids = torch.from_numpy(np.concatenate(sequences).astype(np.int64))[None]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        cu = self._to_device(cu)
        return {
            "input_ids": self._to_device(ids),
            "position_ids": self._to_device(pos),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
        }

    @torch.inference_mode()
    def inputs(self, sequences: list[np.ndarray]) -> dict:
        """Made in inference mode, like ``capture`` makes them: a compiled layer's guards tell
        inference tensors from plain ones, so a mix would compile everything twice."""
        if self.packed:
            return self.pack(sequences)
        ids, mask = self.pad(sequences)
        return {"input_ids": ids, "attention_mask": mask}

    @torch.inference_mode()
    def forward(self, inputs: dict) -> None:
        """The bare forward pass (the benchmark's reference): embeddings -> layers -> final norm.
        The first one of a compiled layout traces it on the canonical batches first (``_warm_up``)."""
        if self.packed in self._cold:
            self._cold.discard(self.packed)
            self._warm_up()
        self.parts.body(**inputs, use_cache=False)

    @torch.inference_mode()
    def capture(
        self,
        sample_ids: list[int],
        sequences: list[np.ndarray],
        checks: list[np.ndarray] | None = None,
        teach: Work | None = None,
    ) -> CapturedBatch:
        """The batch's states; with ``checks`` (each sample's positions to check) its fidelity too,
        and with ``teach`` the target's distribution at its masked positions, both on the device
        after the forward, through the same head (every rank of a group computes them together)."""
        lengths = [len(s) for s in sequences]
        self._outputs.clear()
        self.forward(self.inputs(sequences))
        final = self._outputs["final"]
        aux = torch.cat([self._outputs[k] for k in self.layers], dim=-1) if self.layers else final[..., :0]
        self._outputs.clear()
        if self.packed:
            rows, offsets = [0] * len(lengths), np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        else:
            rows, offsets = list(range(len(lengths))), [0] * len(lengths)
        batch = CapturedBatch(list(sample_ids), lengths, aux, final, rows, offsets)
        if checks is not None:
            batch.fidelity = fidelity.measure(
                self.head, final, rows, offsets, sequences, checks, normed=not self.prenorm
            )
        if teach is not None:
            batch.teacher = teach.compute(self.head, final, rows, offsets, normed=not self.prenorm)
        if self.checks is not None:
            plain = {i: self.plain(sequences[i]) for i in self.shadow_rows(batch.sample_ids)}
            batch.taps = self.tap_checks(batch, plain)
        return batch

    def shadows(self, sample_id: int) -> bool:
        """Whether the run's rule picks this sample for the shadow (``hsx.certify``): its file keeps the figures."""
        return self.checks is not None and certify.shadowed(sample_id, self.checks.every, self.checks.first)

    def shadow_rows(self, sample_ids: list[int]) -> list[int]:
        """The rows of a batch the shadow recomputes: those the rule picks, and in the session's first
        batch, where it picks none, its last sample (judged only: a fault present from the start
        stops the session before it writes anything). Every rank of a group, and a pipeline's lead,
        ask it of the same batches."""
        rows = [i for i, sid in enumerate(sample_ids) if self.shadows(sid)]
        if self.checks is not None and self.checks.every and self._first and sample_ids and sample_ids[0] >= 0:
            self._first = False
            rows = rows or [len(sample_ids) - 1]  # packed: the sample most exposed to its neighbours
        return rows

    def tap_checks(
        self, batch: CapturedBatch, plain: dict[int, list[torch.Tensor]], slack: float = 0.0
    ) -> torch.Tensor:
        """A captured batch's per-tap figures, with the shadow's for the samples recomputed
        (``certify``: [samples, taps + 1, FIELDS + SHADOW_FIELDS], the shadow's -1 elsewhere).
        ``plain``: by row, a sample's states through the plain path (``plain``; a pipeline's, through
        its stages: ``capture.stages``). ``slack``: added to each bound (stored states a lossy
        codec rounded: ``assess.reference``)."""
        measured = certify.measure(batch.aux, batch.final, batch.rows, batch.offsets, batch.lengths)
        shadow = measured.new_full((*measured.shape[:2], certify.SHADOW_FIELDS), -1.0)
        dtype = str(self.dtype).removeprefix("torch.")
        config = self.model.config.get_text_config()
        width = max(self.hidden_size, int(getattr(config, "intermediate_size", 0) or 0))
        depths = certify.depths(self.taps, self.num_layers)
        bounds = [certify.bound(dtype, d, width, self.quantized) + slack for d in depths]
        h = self.hidden_size
        for i, states in plain.items():
            aux, final = batch.sample(i)
            got = [aux[:, k * h : (k + 1) * h] for k in range(aux.shape[-1] // h)] + [final]
            shadow[i] = certify.compare(got, states, bounds, self.routed, self.shadows(batch.sample_ids[i]))
        return torch.cat([measured, shadow], -1)

    @contextlib.contextmanager
    def plain_mode(self) -> Iterator[None]:
        """transformers' plain path on this model's own weights, for the shadow: unpacked (a sample
        alone), eager attention, the decoder layers' own (uncompiled) forwards."""
        compiled = {k: self.parts.layers[k].__dict__.pop("forward") for k in self.owned if self.compiled}
        packed = self.packed
        self.packed = False
        self.model.set_attn_implementation("eager")
        try:
            yield
        finally:
            for k, forward in compiled.items():
                self.parts.layers[k].forward = forward
            self.set_packed(packed)
            self._outputs.clear()

    @torch.inference_mode()
    def plain(self, sequence: np.ndarray) -> list[torch.Tensor]:
        """One sample's taps and final state through the plain path (``plain_mode``), from
        ``output_hidden_states``, as the run stores them (``_as_captured``). What transformers does
        not return comes from hooks of the plain path's own, removed after it: the last decoder
        layer's raw output (its ``hidden_states`` entry is after the final norm) and a pre-norm
        final state (the norm's input). Every rank of a group calls it together."""
        kept: dict[object, torch.Tensor] = {}
        last = self.num_layers - 1
        hooks = [
            self.parts.layers[last].register_forward_hook(
                lambda _m, _i, o: kept.__setitem__(last, o[0] if isinstance(o, tuple) else o)
            )
        ]
        if self.prenorm:
            hooks.append(self.parts.norm.register_forward_pre_hook(lambda _m, args: kept.__setitem__("final", args[0])))
        try:
            with self.plain_mode():
                out = self.parts.body(**self.inputs([sequence]), output_hidden_states=True, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        taps = [self._as_captured(k, kept[k] if k == last else out.hidden_states[k + 1])[0] for k in self.layers]
        final = kept["final"] if self.prenorm else self._as_captured("final", out.last_hidden_state)
        return [*taps, final[0]]
