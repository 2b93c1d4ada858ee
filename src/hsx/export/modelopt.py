"""Model-Optimizer 0.47 offline EAGLE-3 and DFlash/DSpark dumps: a tree of ``*.pt`` files, one torch.save dict each.

Its ``OfflineSupervisedDataset`` loads each with ``weights_only=True``: ``input_ids`` [T] int64,
``hidden_states`` [T, H], ``aux_hidden_states`` [T, L*H], ``loss_mask`` [T] int64 and
``conversation_id`` (a str, so the safe loader accepts it); 2-D, no batch dim (a batch dim is not
rejected there, it silently yields wrong shapes). ``hidden_states`` is post-norm by default; with
``--prenorm`` it is the pre-norm state and ``hidden_states_prenorm: True`` tells the trainer to
apply the base model's norm. Its DFlash (and DSpark, a DFlash projector) reads the same files, the
taps as ``aux_hidden_states``: one per draft layer, named by ``dflash_architecture_config.target_layer_ids``
(it refuses another count). The draft-vocab map is written as ``d2t-{K}.pth``: the example
scripts glob ``*.pt`` for samples, so it must not end in ``.pt``.
"""

from __future__ import annotations

import torch

from hsx.export.serialize import torch_bytes
from hsx.export.trainer import TrainerFormat, Written, put
from hsx.store.format import FinalStateNorm

PER_FOLDER = 1000


class ModelOpt(TrainerFormat):
    name = "modelopt"
    no_teacher = (
        "Model-Optimizer 0.47's models take base_model_logits from a batch, but its OfflineSupervisedDataset and "
        "EagleOfflineDataCollator load none (it recomputes them through the base model's head); full-vocabulary "
        "logits would also cost vocab x dtype bytes a token"
    )
    drafts = ("eagle3", "dflash", "dspark")
    takes_prenorm = True
    description = (
        "Model-Optimizer 0.47 offline eagle / dflash: {k:06d}/{i:09d}.pt = torch.save({input_ids [T] int64, "
        "hidden_states [T,H], aux_hidden_states [T,L*H], loss_mask [T] int64, conversation_id str"
        "[, hidden_states_prenorm True]})"
    )

    def side(self) -> FinalStateNorm:
        return "pre" if self.ctx.opts.prenorm else "post"

    def job(self) -> dict:
        return {"prenorm": self.ctx.opts.prenorm}

    def final_state(self) -> str:
        flag = ", flagged hidden_states_prenorm" if self.ctx.opts.prenorm else ""
        return f"{super().final_state()}{flag}"

    def train_hint(self) -> str:
        taps, dtype = self.ctx.taps, self.ctx.spec.dtype
        if self.draft == "eagle3":
            setting = f"in the eagle config: eagle_aux_hidden_state_layer_ids: {taps}"
        else:
            kind = ", projector_type: dspark, markov_rank: R (it has no default)" if self.draft == "dspark" else ""
            setting = f"in dflash_architecture_config: num_hidden_layers: {len(taps)}, target_layer_ids: {taps}{kind}"
        return f"{setting} (its ids are hsx's); load the base model in {dtype}, the states' dtype"

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        record = {
            "input_ids": t["input_ids"].to(torch.int64),
            "hidden_states": self.ctx.final(sid, t, self.side()),
            "aux_hidden_states": self.ctx.aux(t),
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
