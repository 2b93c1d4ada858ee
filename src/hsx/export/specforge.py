"""SpecForge 0.2 offline features: ``rows_{g}-{g+2000}/data_{i}.ckpt``, one torch.save dict each.

Its offline reader globs every ``*.ckpt`` under the folder; each draft type's normalizer reads its
own keys, all with ``input_ids`` [T] int64 and ``loss_mask`` [T] int64:
- ``eagle3``: ``hidden_state`` [1, T, H] (the target's final state after its norm: the draft's
  distillation target) and ``aux_hidden_state`` [1, T, 3H]; its draft asserts exactly three taps;
- ``dflash``: ``hidden_states`` [1, T, L*H] (one tap per draft layer); ``dspark`` adds
  ``target_last_hidden_states`` [1, T, H], the final state after the norm. Both raise on a sample
  without two consecutive loss tokens, so such samples are left out, and the summary names them.
A pickle format is produced here only because this is what that trainer reads.

Its target head always runs in bfloat16 (``TargetHead.from_pretrained``), and a state of another
dtype fails there (``expected m1 and m2 to have the same dtype``), so states are written in
bfloat16: the rounding the trainer's own head would apply. Its layer ids are SGLang's, which are
hsx's (``set_eagle3_layers_to_capture`` adds the one; its DFlash reads ``hidden_states[id + 1]``);
the export prints the ``specforge train`` config that names them.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from hsx.drafts import dflash_taps
from hsx.errors import ExportRefused, OptionError
from hsx.export.serialize import torch_bytes
from hsx.export.trainer import TrainerFormat, Written, put

GROUP = 2000
DTYPE = torch.bfloat16  # what its target head computes in


def formula_taps(n: int, num_layers: int) -> list[int] | None:
    """The taps SpecForge's DFlash computes for a draft of ``n`` layers, or None where the formula
    gives none hsx would take (then the draft config names them)."""
    try:
        return dflash_taps(n, num_layers)
    except OptionError:
        return None


def has_consecutive_loss(mask: np.ndarray) -> bool:
    """Two neighbouring loss tokens: what SpecForge's DFlash-family normalizer requires of a sample."""
    m = mask.astype(bool)
    return bool((m[1:] & m[:-1]).any())


class SpecForge(TrainerFormat):
    name = "specforge"
    no_teacher = (
        "SpecForge 0.2's offline samples hold states and tokens, and its loss recomputes the target from "
        "hidden_state through the target head it loads"
    )
    drafts = ("eagle3", "dflash", "dspark")
    description = (
        "SpecForge 0.2 offline: rows_{g}-{g+2000}/data_{i}.ckpt = torch.save({input_ids [T] int64, "
        "loss_mask [T] int64, eagle3: hidden_state [1,T,H] post-norm, aux_hidden_state [1,T,3H]; dflash: "
        "hidden_states [1,T,L*H]; dspark: + target_last_hidden_states [1,T,H] post-norm}), states in bfloat16"
    )

    def check(self) -> None:
        n = len(self.ctx.taps)
        if self.draft == "eagle3" and n != 3:
            raise ExportRefused(
                f"SpecForge's EAGLE-3 draft takes exactly 3 aux layers; this export has {n} ({self.ctx.taps})"
            )

    def job(self) -> dict:
        return {"dtype": "bfloat16"}

    def refuse(self, sid: int) -> str | None:
        if self.draft != "eagle3" and not has_consecutive_loss(self.ctx.plan.loss_mask(sid)):
            return "no two consecutive loss tokens (SpecForge's DFlash-family reader raises on it)"
        return None

    def holds_final(self) -> bool:
        return self.draft != "dflash"  # its DFlash reads the taps alone

    def final_state(self) -> str:
        if not self.holds_final():
            return "none (a DFlash draft reads the taps alone)"
        return f"{super().final_state()}, in bfloat16 (its target head's dtype)"

    def train_hint(self) -> str:
        """``specforge train`` with a config of the keys the export decides (JSON is YAML): the taps
        as its ids (hsx's), by EAGLE-3's aux layer ids or a DFlash draft's layer count, whose
        formula gives them. A DSpark draft, and taps the formula does not give, need a draft config
        (SpecForge makes DFlash's alone) naming them."""
        taps = self.ctx.taps
        model: dict = {"target_model_path": self.ctx.model_named()}
        formula = self.draft == "dflash" and taps == formula_taps(len(taps), self.ctx.spec.model.num_layers)
        if self.draft == "eagle3":
            model["aux_hidden_state_layer_ids"] = taps
        elif formula:
            model["draft_num_hidden_layers"] = len(taps)
        else:
            model["draft_model_config"] = "DRAFT.json"
        config = {"model": model, "data": {"hidden_states_path": str(self.ctx.dest.absolute())}}
        config["training"] = {"strategy": self.draft}
        hint = f"specforge train -c CONFIG.yaml, CONFIG.yaml holding {json.dumps(config)}"
        if "draft_model_config" in model:
            hint += (
                f"; DRAFT.json: a {self.draft} draft config with num_hidden_layers {len(taps)} and "
                f"dflash_config.target_layer_ids {taps}"
            )
        return hint

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        g = index // GROUP * GROUP
        record = {"input_ids": t["input_ids"].to(torch.int64), "loss_mask": t["loss_mask"].to(torch.int64)}
        final = self.ctx.final(sid, t, "post")[None].to(DTYPE) if self.holds_final() else None
        if self.draft == "eagle3":
            record |= {"hidden_state": final, "aux_hidden_state": self.ctx.aux(t)[None].to(DTYPE)}
        else:
            record["hidden_states"] = self.ctx.aux(t)[None].to(DTYPE)
            if self.draft == "dspark":
                record["target_last_hidden_states"] = final
        return [put(self.ctx.dest, f"rows_{g}-{g + GROUP}/data_{index}.ckpt", torch_bytes(record))]

    def finish(self, vocab) -> list[Written]:
        if vocab is None:
            return []
        d2t, t2d, _ = vocab
        name = f"vocab_mapping-{len(d2t)}.pt"  # --vocab-mapping-path: {"d2t": int64 [K], "t2d": bool [V]}
        return [put(self.ctx.dest, name, torch_bytes({"d2t": d2t, "t2d": t2d}))]
