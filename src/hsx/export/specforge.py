"""SpecForge 0.2 offline EAGLE-3 features: ``rows_{g}-{g+2000}/data_{i}.ckpt``, one torch.save dict each.

Its offline reader globs every ``*.ckpt`` under the folder and reads ``input_ids`` [T] int64,
``loss_mask`` [T] int64, ``hidden_state`` [1, T, H] (the target's final state after its norm: the
draft's distillation target) and ``aux_hidden_state`` [1, T, 3H]. Its draft model asserts exactly
three aux layers. A pickle format is produced here only because this is what that trainer reads.

Its target head always runs in bfloat16 (``TargetHead.from_pretrained``), and a state of another
dtype fails there (``expected m1 and m2 to have the same dtype``), so states are written in
bfloat16: the rounding the trainer's own head would apply. Its layer ids are SGLang's, which are
hsx's (``set_eagle3_layers_to_capture`` adds the one); the export prints the setting.
"""

from __future__ import annotations

import torch

from hsx.errors import ExportRefused
from hsx.export.serialize import torch_bytes
from hsx.export.trainer import TrainerFormat, Written, put

GROUP = 2000
DTYPE = torch.bfloat16  # what its target head computes in


class SpecForge(TrainerFormat):
    name = "specforge"
    description = (
        "SpecForge 0.2 offline eagle3: rows_{g}-{g+2000}/data_{i}.ckpt = torch.save({input_ids [T] int64, "
        "loss_mask [T] int64, hidden_state [1,T,H] post-norm, aux_hidden_state [1,T,3H]}), states in bfloat16"
    )

    def check(self) -> None:
        n = len(self.ctx.spec.layers)
        if n != 3:
            raise ExportRefused(
                f"SpecForge's EAGLE-3 draft takes exactly 3 aux layers; this run has {n} ({self.ctx.spec.layers})"
            )

    def job(self) -> dict:
        return {"dtype": "bfloat16"}

    def final_state(self) -> str:
        return "post-norm (hsx's stored state), in bfloat16 (its target head's dtype)"

    def train_hint(self) -> str:
        return f"in the SpecForge config: model.aux_hidden_state_layer_ids: {self.ctx.spec.layers}"

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        g = index // GROUP * GROUP
        record = {
            "input_ids": t["input_ids"].to(torch.int64),
            "loss_mask": t["loss_mask"].to(torch.int64),
            "hidden_state": t["hidden_states"][None].to(DTYPE),
            "aux_hidden_state": t["aux_hidden_states"][None].to(DTYPE),
        }
        return [put(self.ctx.dest, f"rows_{g}-{g + GROUP}/data_{index}.ckpt", torch_bytes(record))]

    def finish(self, vocab) -> list[Written]:
        if vocab is None:
            return []
        d2t, t2d, _ = vocab
        name = f"vocab_mapping-{len(d2t)}.pt"  # --vocab-mapping-path: {"d2t": int64 [K], "t2d": bool [V]}
        return [put(self.ctx.dest, name, torch_bytes({"d2t": d2t, "t2d": t2d}))]
