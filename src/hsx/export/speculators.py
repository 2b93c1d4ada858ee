"""speculators 0.9 offline data: a ``datasets`` folder plus ``hidden_states/hs_{i}.safetensors``.

DEST is a ``Dataset.save_to_disk`` folder saved after ``set_format("torch")`` (its loader compares
each file's ``token_ids`` with the row's ``input_ids`` through ``torch.equal``, which needs
tensors; a mismatch silently drops the sample), columns ``input_ids``, ``loss_mask`` (0/1) and
``seq_len``. File i holds ``hidden_states`` [T, L+1, H] (the aux layers, then the final state
BEFORE the norm, which the trainer applies itself) and ``token_ids`` [T] int64. The dataset is
written last, through a temp folder, so a folder that loads has every hidden-state file.
"""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import save

from hsx.export.serialize import npy_bytes, torch_bytes
from hsx.export.trainer import TMP_DIR_MARK, TrainerFormat, Written, move_folder_contents, put
from hsx.store.format import digest


class Speculators(TrainerFormat):
    name = "speculators"
    needs_prenorm = True
    takes_prenorm = True  # always pre-norm: --prenorm asks for what it writes anyway
    description = (
        "speculators 0.9 offline: DEST = datasets.save_to_disk (format torch) with input_ids, loss_mask, seq_len; "
        "hidden_states/hs_{i}.safetensors = {hidden_states [T,L+1,H] (aux..., final pre-norm), token_ids [T] int64}"
    )

    def final_state(self) -> str:
        return f"pre-norm, last slot of hidden_states ({self.ctx.prenorm_source})"

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        T, H = t["hidden_states"].shape
        aux = t["aux_hidden_states"].reshape(T, -1, H)
        pre = self.ctx.prenorm(sid, t)
        states = torch.cat([aux, pre[:, None]], dim=1).contiguous()
        ids = t["input_ids"].to(torch.int64).contiguous()
        data = save({"hidden_states": states, "token_ids": ids})
        return [put(self.ctx.dest, f"hidden_states/hs_{index}.safetensors", data)]

    def finish(self, vocab) -> list[Written]:
        import datasets
        from datasets import Dataset

        datasets.disable_progress_bars()

        ctx, dest = self.ctx, self.ctx.dest
        out: list[Written] = []
        if vocab is not None:
            d2t, t2d, freq = vocab
            k = len(d2t)
            out.append(put(dest, "token_freq.pt", torch_bytes(freq)))
            out.append(put(dest, f"d2t-{k}.npy", npy_bytes(d2t.numpy())))
            out.append(put(dest, f"t2d-{k}.npy", npy_bytes(t2d.numpy())))
        rows = {
            "input_ids": [ctx.plan.input_ids(i).astype(np.int64) for i in ctx.ids],
            "loss_mask": [ctx.plan.loss_mask(i).astype(np.int64) for i in ctx.ids],
            "seq_len": [int(ctx.plan.lengths[i]) for i in ctx.ids],
        }
        ds = Dataset.from_dict(rows)
        ds.set_format("torch")
        tmp = dest / f"{TMP_DIR_MARK}dataset"
        ds.save_to_disk(str(tmp))
        names = move_folder_contents(tmp, dest, last=("dataset_info.json", "state.json"))
        for name in names:
            data = (dest / name).read_bytes()
            out.append(Written(name, len(data), digest(data)))
        return out
