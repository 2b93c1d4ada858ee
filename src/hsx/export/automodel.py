"""NeMo-Automodel 0.7's offline caches, what its recipes stream with ``cached_target_path``: one per
draft type it trains from a cache, EAGLE-3 (``train_eagle3``) and DSpark (``train_dspark``); its
DFlash recipes run the target online and read no cache. Each is ``manifest.json``, the target's
weights the draft starts from, and ``shard-NNNNNN.safetensors``, each a block of ``shard_size``
samples stacked on dim 0 and padded to ``seq_length``.

EAGLE-3 (its ``precompute_eagle3``'s, read by ``CachedEagle3Dataset``): manifest format version 2,
``target_embeddings.safetensors`` (``weight``: the target's input embeddings, float32).

Its rows are shifted as its target wrapper shifts them (SpecForge's EAGLE-3 preparation): row t
holds ``aux_hidden_states`` of position t, and ``input_ids``, ``loss_mask`` and the target's
distribution of position t + 1 (zeros past the end). So hsx's teacher row for masked position p
(the distribution over the token after p) goes to row p - 1. ``position_mask`` [S, 1] is the
shifted loss mask where the target's argmax is in the draft vocabulary. The distribution is the
run's ``--teacher``, exactly: a ``draft-vocab`` run's ``teacher_probs`` are ``target_probs`` over
its vocabulary (``selected_token_ids``); a ``topk:K`` run is Automodel's own top-k layout over the
full vocabulary (``target_probs_topk`` K, ``target_probs_values`` the K probabilities renormalized
to sum to 1, as its ``compress_target_probs`` does, and ``target_probs_indices`` their ids). A run
without a teacher has no ``target_probs`` to give: refused.

DSpark (its ``precompute_dspark``'s, read by ``CachedDSparkDataset``): manifest format version 1,
``target_weights.safetensors`` (``embed_tokens.weight`` and ``lm_head.weight`` in the cache's
dtype: its losses compute the target's distribution through that head), shards of ``input_ids``
and ``loss_mask`` int64 [S] as its chat dataset gives them (unshifted: its anchors read the loss
mask of the next position themselves), ``target_hidden_states`` [S, L*H] and
``target_last_hidden_states`` [S, H], the final state AFTER the norm (it hooks the final norm's
output). Its layer ids are hsx's (a hook on decoder layer k), but for the last layer, N-1: its
feature there is the post-norm state (transformers' ``hidden_states[N]``), where hsx's tap N-1 is
that layer's raw output; so that slot holds the final state after the norm. The manifest carries
every field its ``build_cache_manifest`` writes, which its resume check compares whole and its
recipe checks against the target and config (``complete`` true).

Each sample is a shard of its own (``shard_size`` 1), so the export resumes sample by sample as
every other does; the manifest and the weights are written last.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import ClassVar

import numpy as np
import torch
from safetensors.torch import save

from hsx.errors import ExportRefused
from hsx.export.trainer import Context, TrainerFormat, Written, put
from hsx.fidelity import head_name, read_weight
from hsx.target import LanguageModel, load_tokenizer
from hsx.teacher import Teacher

DSPARK = "dspark"
FORMAT_VERSION = 2  # the EAGLE-3 cache format its reader accepts
DSPARK_VERSION = 1  # the DSpark cache format its reader accepts
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # its manifest's names of the cache dtype
EMBEDDINGS = "target_embeddings.safetensors"
WEIGHTS = "target_weights.safetensors"


def shard(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def shifted(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` [T, ...] shifted left by one and zero-padded to ``length`` rows."""
    out = x.new_zeros((length, *x.shape[1:]))
    out[: x.shape[0] - 1] = x[1:]
    return out


def padded(x: torch.Tensor, length: int) -> torch.Tensor:
    out = x.new_zeros((length, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


class Automodel(TrainerFormat):
    """What both caches share: the shards' names, padding and the target's shapes; ``build`` picks
    the draft type's cache."""

    name = "automodel"
    drafts = ("eagle3", DSPARK)
    untaken: ClassVar[dict[str, str]] = {
        "dflash": "Automodel 0.7 trains DFlash online only: its train_dflash recipe reads no cache"
    }

    @classmethod
    def build(cls, ctx: Context) -> TrainerFormat:
        return DSparkCache(ctx) if ctx.opts.draft == DSPARK else Eagle3Cache(ctx)

    def job(self) -> dict:
        return {"seq_length": self.seq_length}

    @property
    def seq_length(self) -> int:
        """What every sample is padded to: the longest exported."""
        return int(self.ctx.plan.lengths[self.ctx.ids].max()) if self.ctx.ids else 0

    @property
    def vocab(self) -> int:
        return int(LanguageModel.of(self.ctx.model()).config["vocab_size"])


class Eagle3Cache(Automodel):
    description = (
        "NeMo-Automodel 0.7 EAGLE-3 offline cache v2: manifest.json, target_embeddings.safetensors, "
        "shard-{i:06d}.safetensors = input_ids, attention_mask, loss_mask int64 [1,S], aux_hidden_states [1,S,3H], "
        "position_mask bool [1,S,1], target_probs [1,S,D] or target_probs_values/indices [1,S,K] (rows shifted)"
    )

    def __init__(self, ctx):
        super().__init__(ctx)
        self.teacher = Teacher.of_run(ctx.opts.run, ctx.spec.teacher)

    def check(self) -> None:
        if self.teacher is None:
            raise ExportRefused(
                "Automodel's EAGLE-3 cache holds the target's distribution over the draft vocabulary (target_probs), "
                "which this run does not store: extract with --teacher draft-vocab:FILE (its target_probs exactly) "
                "or --teacher topk:K (its top-k layout over the full vocabulary)"
            )
        if self.ctx.opts.draft_vocab is not None:
            raise ExportRefused(
                "Automodel's cache takes its draft vocabulary from the run's --teacher (draft-vocab: its vocabulary; "
                "topk: the full one): drop --draft-vocab"
            )

    def selected(self) -> np.ndarray:
        """The draft vocabulary's target ids (``selected_token_ids``)."""
        if self.teacher.vocab is not None:
            return self.teacher.vocab
        return np.arange(self.vocab)

    def final_state(self) -> str:
        return "none (Automodel's EAGLE-3 cache holds the taps and the target's distribution, not the final state)"

    def teacher_note(self) -> str:
        return f"the run's {self.ctx.spec.teacher}, as target_probs (rows shifted by one, as Automodel's are)"

    def train_hint(self) -> str:
        taps = self.ctx.taps
        return (
            f"automodel's train_eagle3 recipe with cached_target_path: {self.ctx.dest.absolute()}, the target "
            f"{self.ctx.model_named()} (its vocab_size and hidden_size are checked against the manifest), "
            f"mask_reasoning_content: false and mask_generation_prompt: false (hsx's loss masks are the plan's); "
            f"the taps are {taps} (aux_layer_ids: its ids are hsx's)"
        )

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        S, dtype = self.seq_length, t["hidden_states"].dtype
        mask = t["loss_mask"].to(torch.int64)
        rows = torch.nonzero(mask).flatten()  # hsx's teacher rows: positions p; Automodel's row p - 1
        keep = rows > 0
        at = rows[keep] - 1
        record = {
            "input_ids": shifted(t["input_ids"].to(torch.int64), S)[None],
            "attention_mask": padded(torch.ones_like(mask), S)[None],
            "loss_mask": shifted(mask, S)[None],
            "aux_hidden_states": padded(self.ctx.aux(t), S)[None],
        }
        if self.teacher.vocab is None:
            values = t["teacher_logprobs"][keep].float().exp()
            values = values / values.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            top = torch.zeros((S, values.shape[1]), dtype=torch.float32)
            ids = torch.zeros((S, values.shape[1]), dtype=torch.int32)
            top[at], ids[at] = values, t["teacher_ids"][keep]
            record["target_probs_values"], record["target_probs_indices"] = top.to(dtype)[None], ids[None]
            argmax_in = torch.ones(len(at), dtype=torch.bool)  # the full vocabulary holds every argmax
        else:
            probs = torch.zeros((S, len(self.teacher.vocab)), dtype=dtype)
            probs[at] = t["teacher_probs"][keep]
            record["target_probs"] = probs[None]
            argmax_in = torch.from_numpy(np.isin(t["teacher_argmax"][keep].numpy(), self.teacher.vocab))
        position = torch.zeros((S, 1), dtype=torch.bool)
        position[at, 0] = argmax_in
        record["position_mask"] = position[None]
        return [put(self.ctx.dest, shard(index), save({k: v.contiguous() for k, v in record.items()}))]

    def finish(self, vocab) -> list[Written]:
        ctx = self.ctx
        lm = LanguageModel.of(ctx.model())
        weight = read_weight(lm, f"{lm.prefix}model.embed_tokens.weight").to(torch.float32)
        selected = self.selected()
        topk = 0 if self.teacher.vocab is not None else ctx.spec.teacher.k
        manifest = {
            "format_version": FORMAT_VERSION,
            "target_model": ctx.model_named(),
            "target_vocab_size": self.vocab,
            "draft_vocab_size": len(selected),
            "seq_length": self.seq_length,
            "dtype": DTYPES[ctx.spec.dtype],
            "num_samples": len(ctx.ids),
            "shard_size": 1,
            "target_probs_topk": topk,
            "aux_hidden_dim": ctx.hidden * len(ctx.taps),
            "aux_layer_ids": list(ctx.taps),
            "selected_token_ids": selected.tolist(),
            "input_data": str(ctx.opts.run.absolute()),
            "split": None,
            "shuffle_seed": 0,
            "mask_reasoning_content": False,
            "mask_generation_prompt": False,
            "hsx_certificate": ctx.certificate_note(),  # what hsx checked of these states (hsx.certify)
        }
        return [
            put(ctx.dest, EMBEDDINGS, save({"weight": weight.contiguous()})),
            put(ctx.dest, "manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode()),
        ]


class DSparkCache(Automodel):
    no_teacher = (
        "Automodel's DSpark cache holds states and tokens; its losses compute the target's distribution from "
        "target_last_hidden_states through the lm_head it holds"
    )
    description = (
        "NeMo-Automodel 0.7 DSpark offline cache v1: manifest.json, target_weights.safetensors, "
        "shard-{i:06d}.safetensors = input_ids, loss_mask int64 [1,S], target_hidden_states [1,S,L*H] "
        "(layer N-1: post-norm), target_last_hidden_states [1,S,H] post-norm"
    )

    def check(self) -> None:
        self.ctx.refuse_unsorted_taps("Automodel's DSpark recipe", strictly=True)
        self.ctx.refuse_draft_vocab("Automodel's DSpark drafts")

    @property
    def last(self) -> int:
        """The last decoder layer: Automodel's feature there is the final state after the norm."""
        return self.ctx.spec.model.num_layers - 1

    def final_state(self) -> str:
        at = f"; tap {self.last} too (its id {self.last} is the post-norm state)" if self.last in self.ctx.taps else ""
        return f"{super().final_state()}, as target_last_hidden_states{at}"

    def train_hint(self) -> str:
        ctx = self.ctx
        args = ["python", "-m", "nemo_automodel.recipes.llm.train_dspark", "--config", "CONFIG.yaml"]
        args += [
            f"--recipe_args.{key}={value}"
            for key, value in (
                ("cached_target_path", ctx.dest.absolute()),
                ("target_model_name_or_path", ctx.model_named()),
                ("seq_length", self.seq_length),
                ("target_layer_ids", "[" + ",".join(map(str, ctx.taps)) + "]"),
                ("mask_reasoning_content", False),
                ("mask_generation_prompt", False),
            )
        ]
        dtype = ctx.spec.dtype
        cpu = "" if dtype == "float32" else f"; on CPU its recipe reads fp32 caches only (this one is {dtype})"
        return (
            f"{shlex.join(map(str, args))}  (CONFIG.yaml holds the rest of its recipe_args, mask_token_id among "
            f"them, which it requires; its layer ids are hsx's; hsx's loss masks are the plan's{cpu})"
        )

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        ctx, S = self.ctx, self.seq_length
        T, H = t["hidden_states"].shape
        post = ctx.final(sid, t, "post")
        taps = ctx.aux(t)
        if self.last in ctx.taps:  # its feature at the last layer is the post-norm state, not the raw output
            taps = taps.view(T, -1, H).clone()
            taps[:, ctx.taps.index(self.last)] = post
            taps = taps.view(T, -1)
        record = {
            "input_ids": padded(t["input_ids"].to(torch.int64), S)[None],
            "loss_mask": padded(t["loss_mask"].to(torch.int64), S)[None],
            "target_hidden_states": padded(taps, S)[None],
            "target_last_hidden_states": padded(post, S)[None],
        }
        return [put(ctx.dest, shard(index), save({k: v.contiguous() for k, v in record.items()}))]

    def chat_template_sha256(self) -> str:
        """The template the run's plan rendered with, hashed as its manifest hashes the tokenizer's."""
        template = load_tokenizer(self.ctx.model(), self.ctx.spec.trust_remote_code).chat_template or ""
        if isinstance(template, dict):  # a repository's named templates: the one asked for, else its default
            template = template.get(self.ctx.spec.chat_template or "default", "")
        return hashlib.sha256(template.encode()).hexdigest()

    def finish(self, vocab) -> list[Written]:
        ctx = self.ctx
        model = ctx.model()
        lm = LanguageModel.of(model)
        dtype = getattr(torch, ctx.spec.dtype)
        weights = {
            "embed_tokens.weight": read_weight(lm, f"{lm.prefix}model.embed_tokens.weight").to(dtype),
            "lm_head.weight": read_weight(lm, head_name(lm)).to(dtype),
        }
        H = ctx.hidden
        manifest = {
            "format_version": DSPARK_VERSION,
            "complete": True,
            "target_model": ctx.model_named(),
            "target_model_type": json.loads((model / "config.json").read_text())["model_type"],
            "target_vocab_size": self.vocab,
            "hidden_size": H,
            "num_hidden_layers": ctx.spec.model.num_layers,
            "seq_length": self.seq_length,
            "dtype": DTYPES[ctx.spec.dtype],
            "num_samples": len(ctx.ids),
            "shard_size": 1,
            "target_hidden_dim": H * len(ctx.taps),
            "target_last_hidden_dim": H,
            "target_layer_ids": list(ctx.taps),
            "train_data_path": str(ctx.opts.run.absolute()),
            "train_split": None,
            "shuffle_seed": 0,
            "mask_reasoning_content": False,
            "mask_generation_prompt": False,
            "chat_template_sha256": self.chat_template_sha256(),
            "hsx_certificate": ctx.certificate_note(),  # what hsx checked of these states (hsx.certify)
        }
        return [
            put(ctx.dest, WEIGHTS, save({k: v.contiguous() for k, v in weights.items()})),
            put(ctx.dest, "manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode()),
        ]
