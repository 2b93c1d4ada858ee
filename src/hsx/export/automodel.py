"""NeMo-Automodel 0.7's EAGLE-3 offline cache (its ``precompute_eagle3``'s), what its ``train_eagle3``
recipe streams with ``cached_target_path`` (``CachedEagle3Dataset``): ``manifest.json`` (format
version 2), ``target_embeddings.safetensors`` (``weight``: the target's input embeddings, float32,
which the draft's embeddings start from) and ``shard-NNNNNN.safetensors``, each a block of
``shard_size`` samples stacked on dim 0 and padded to ``seq_length``.

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

Each sample is a shard of its own (``shard_size`` 1), so the export resumes sample by sample as
every other does; the manifest and the embeddings are written last.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import save

from hsx.errors import ExportRefused
from hsx.export.trainer import TrainerFormat, Written, put
from hsx.fidelity import read_weight
from hsx.target import LanguageModel
from hsx.teacher import Teacher

FORMAT_VERSION = 2  # the cache format its reader accepts
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # its manifest's names of the cache dtype
EMBEDDINGS = "target_embeddings.safetensors"


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
    name = "automodel"
    drafts = ("eagle3",)
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

    def job(self) -> dict:
        return {"seq_length": self.seq_length}

    @property
    def seq_length(self) -> int:
        """What every sample is padded to: the longest exported."""
        return int(self.ctx.plan.lengths[self.ctx.ids].max()) if self.ctx.ids else 0

    @property
    def vocab(self) -> int:
        return int(LanguageModel.of(self.ctx.model()).config["vocab_size"])

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
