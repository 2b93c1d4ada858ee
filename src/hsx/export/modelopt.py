"""Model-Optimizer 0.47 offline EAGLE-3 dumps: a tree of ``*.pt`` files, one torch.save dict each.

Its ``OfflineSupervisedDataset`` loads each with ``weights_only=True``: ``input_ids`` [T] int64,
``hidden_states`` [T, H], ``aux_hidden_states`` [T, L*H], ``loss_mask`` [T] int64 and
``conversation_id`` (a str, so the safe loader accepts it); 2-D, no batch dim (a batch dim is not
rejected there, it silently yields wrong shapes). ``hidden_states`` is post-norm by default; with
``--prenorm`` it is the pre-norm state and ``hidden_states_prenorm: True`` tells the trainer to
apply the base model's norm. The draft-vocab map is written as ``d2t-{K}.pth``: the example
scripts glob ``*.pt`` for samples, so it must not end in ``.pt``.
"""

from __future__ import annotations

import torch

from hsx.export.serialize import torch_bytes
from hsx.export.trainer import TrainerFormat, Written, put

PER_FOLDER = 1000


class ModelOpt(TrainerFormat):
    name = "modelopt"
    takes_prenorm = True
    description = (
        "Model-Optimizer 0.47 offline eagle: {k:06d}/{i:09d}.pt = torch.save({input_ids [T] int64, "
        "hidden_states [T,H], aux_hidden_states [T,L*H], loss_mask [T] int64, conversation_id str"
        "[, hidden_states_prenorm True]})"
    )

    def __init__(self, ctx):
        super().__init__(ctx)
        self.needs_prenorm = ctx.opts.prenorm

    def job(self) -> dict:
        return {"prenorm": self.ctx.opts.prenorm}

    def final_state(self) -> str:
        if self.ctx.opts.prenorm:
            return f"pre-norm, flagged hidden_states_prenorm ({self.ctx.prenorm_source})"
        return super().final_state()

    def train_hint(self) -> str:
        return (
            f"in the eagle config: eagle_aux_hidden_state_layer_ids: {self.ctx.spec.layers} (its ids are hsx's); "
            f"load the base model in {self.ctx.spec.dtype}, the states' dtype"
        )

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        final = self.ctx.prenorm(sid, t) if self.ctx.opts.prenorm else t["hidden_states"]
        record = {
            "input_ids": t["input_ids"].to(torch.int64),
            "hidden_states": final,
            "aux_hidden_states": t["aux_hidden_states"],
            "loss_mask": t["loss_mask"].to(torch.int64),
            "conversation_id": self.ctx.source_id(sid),
        }
        if self.ctx.opts.prenorm:
            record["hidden_states_prenorm"] = True
        return [put(self.ctx.dest, f"{index // PER_FOLDER:06d}/{index:09d}.pt", torch_bytes(record))]

    def finish(self, vocab) -> list[Written]:
        if vocab is None:
            return []
        d2t = vocab[0]  # data.draft_vocab_cache: int64 [K], target id = draft id + d2t[draft id]
        return [put(self.ctx.dest, f"d2t-{len(d2t)}.pth", torch_bytes(d2t))]
