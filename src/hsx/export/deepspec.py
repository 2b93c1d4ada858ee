"""DeepSpec's target cache, what its DFlash and DSpark trainers read (its ``CacheDataset``):
``manifest.json``, ``samples.idx`` and ``shard-*.bin``.

Version 2 of its layout: ``samples.idx`` holds one little-endian record per sample, in sample order
(ids dense from 0), of 56 bytes: sample id (u64), shard id (u32), length T (u32), then the byte
offsets in that shard (u64 each) of its five arrays, written back to back with no padding:
``input_ids`` int32 [T], ``attention_mask`` uint8 [T] (all ones), ``loss_mask`` uint8 [T],
``target_hidden_states`` bfloat16 [T, L*H] (the taps concatenated, one per draft layer) and
``target_last_hidden_states`` bfloat16 [T, H], the final state AFTER the final norm (its own
preparer keeps the base model's ``last_hidden_state``). Its reader takes bfloat16 states only.
The manifest names the shards (``shard_id`` dense from 0), the taps (``target_layer_ids``,
ascending: its preparer hooks decoder layer k's output, so its ids are hsx's), the hidden size and
dtypes, and the target model, which its trainer compares with its config's as a string.

Each sample is written as a shard of its own, so that an export resumes sample by sample as every
other export does; the index and manifest are rewritten last, from the plan's lengths.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

from hsx.export.trainer import TrainerFormat, Written, put

VERSION = 2  # the layout version its reader accepts
RECORD = struct.Struct("<QIIQQQQQ")  # sample id, shard id, length, byte offsets of the five arrays
DTYPE = torch.bfloat16  # the one dtype its reader reads states in


def offsets(length: int, taps: int, hidden: int) -> list[int]:
    """Byte offsets in a sample's shard of its five arrays, in the order they are written."""
    sizes = [4 * length, length, length, 2 * length * taps * hidden]
    return np.cumsum([0, *sizes]).tolist()


def _bf16_bytes(x: torch.Tensor) -> bytes:
    return x.to(DTYPE).contiguous().view(torch.uint16).numpy().tobytes()


class DeepSpec(TrainerFormat):
    name = "deepspec"
    no_teacher = "DeepSpec's target cache v2 holds states and tokens only"
    drafts = ("dflash", "dspark")
    description = (
        "DeepSpec target cache v2: manifest.json, samples.idx (<QIIQQQQQ per sample: id, shard, T, offsets), "
        "shard-{i:05d}.bin = input_ids int32 [T], attention_mask uint8 [T], loss_mask uint8 [T], "
        "target_hidden_states bf16 [T,L*H], target_last_hidden_states bf16 [T,H] post-norm"
    )

    def check(self) -> None:
        self.ctx.refuse_unsorted_taps("DeepSpec's reader")
        self.ctx.refuse_draft_vocab("DeepSpec's DFlash and DSpark drafts")

    def job(self) -> dict:
        return {"dtype": "bfloat16"}

    def shard(self, index: int) -> str:
        return f"shard-{index:05d}.bin"

    def final_state(self) -> str:
        return f"{super().final_state()}, in bfloat16 (the only dtype its reader reads)"

    def train_hint(self) -> str:
        """Its own ``train.py`` with a config of the draft type; the config must name the taps (its
        ids are hsx's) and the target as the manifest does, which its trainer checks."""
        taps = self.ctx.taps
        return (
            f"python train.py --config config/{self.draft}/{self.draft}_MODEL.py --opts "
            f'"data.target_cache_path={self.ctx.dest.absolute()}" --opts '
            f'"model.target_model_name_or_path={self.ctx.model_named()}", the config holding '
            f"model.target_layer_ids={taps} (its ids are hsx's; its draft projects all {len(taps)} taps whatever "
            "its num_draft_layers)"
        )

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        n = t["input_ids"].shape[0]
        data = b"".join(
            (
                t["input_ids"].to(torch.int32).numpy().tobytes(),
                np.ones(n, np.uint8).tobytes(),
                t["loss_mask"].to(torch.uint8).numpy().tobytes(),
                _bf16_bytes(self.ctx.aux(t)),
                _bf16_bytes(self.ctx.final(sid, t, "post")),
            )
        )
        return [put(self.ctx.dest, self.shard(index), data)]

    def finish(self, vocab) -> list[Written]:
        ctx = self.ctx
        records = []
        for index, sid in enumerate(ctx.ids):
            n = int(ctx.plan.lengths[sid])
            records.append(RECORD.pack(index, index, n, *offsets(n, len(ctx.taps), ctx.hidden)))
        manifest = {
            "version": VERSION,
            "num_samples": len(ctx.ids),
            "num_shards": len(ctx.ids),
            "target_layer_ids": ctx.taps,
            "hidden_dtype": "bfloat16",
            "token_dtype": "int32",
            "mask_dtype": "uint8",
            "index_record_size": RECORD.size,
            "hidden_size": ctx.hidden,
            "shards": [{"shard_id": i, "file_name": self.shard(i)} for i in range(len(ctx.ids))],
            "target_model_name_or_path": ctx.model_named(),
            "hsx_certificate": ctx.certificate_note(),  # what hsx checked of these states (hsx.certify)
        }
        return [
            put(ctx.dest, "samples.idx", b"".join(records)),
            put(ctx.dest, "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode()),
        ]
