"""speculators 0.9 offline data: a ``datasets`` folder plus ``hidden_states/hs_{i}.safetensors``.

DEST is what ``Dataset.save_to_disk`` writes after ``set_format("torch")`` (its loader compares
each file's ``token_ids`` with the row's ``input_ids`` through ``torch.equal``, which needs
tensors; a mismatch silently drops the sample), columns ``input_ids``, ``loss_mask`` (0/1) and
``seq_len``, written here with pyarrow alone (one Arrow stream file, ``dataset_info.json``,
``state.json``), so the export needs no ``datasets``. File i holds ``hidden_states`` [T, L+1, H]
(the exported taps, then the final state BEFORE the norm, which the trainer applies itself) and
``token_ids`` [T] int64; every speculator type reads it so (MTP: no taps, [T, 1, H]). The
dataset is written last, ``state.json`` (what ``load_from_disk`` opens) at its very end, so a folder
that loads has every hidden-state file.

speculators reads no layer ids from its data: its trainer assumes EAGLE-3's default layers unless
``--target-layer-ids`` is passed (vLLM's ids, hsx id + 1), so the export prints its training command.
"""

from __future__ import annotations

import json
import shlex

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save

from hsx.drafts import DRAFT_TYPES, MTP
from hsx.errors import ExportRefused
from hsx.export.serialize import npy_bytes, torch_bytes
from hsx.export.trainer import TrainerFormat, Written, put
from hsx.store.format import digest

ARROW = "data-00000-of-00001.arrow"
# The targets whose native MTP head speculators 0.9 fine-tunes (its ``mtp_model_classes``: model types
# qwen3, qwen3_next, qwen3_5_text, qwen3_5_moe_text), by the architectures transformers gives them
MTP_ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
TOKENS = {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"}
FEATURES = {"input_ids": TOKENS, "loss_mask": TOKENS, "seq_len": {"dtype": "int64", "_type": "Value"}}


def dataset_files(columns: dict[str, list]) -> list[tuple[str, bytes]]:
    """The files of a ``save_to_disk`` folder (format torch) holding ``columns``, in writing order."""
    tokens = pa.list_(pa.int64())
    schema = pa.schema(
        [("input_ids", tokens), ("loss_mask", tokens), ("seq_len", pa.int64())],
        metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})},
    )
    table = pa.table({k: pa.array(columns[k], type=schema.field(k).type) for k in schema.names}, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    info = {"citation": "", "description": "", "features": FEATURES, "homepage": "", "license": ""}
    state = {
        "_data_files": [{"filename": ARROW}],
        "_fingerprint": digest(data).rsplit(":", 1)[-1][:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    as_json = lambda obj: json.dumps(obj, indent=2).encode()  # noqa: E731
    return [(ARROW, data), ("dataset_info.json", as_json(info)), ("state.json", as_json(state))]


class Speculators(TrainerFormat):
    name = "speculators"
    no_teacher = (
        "speculators 0.9's data files hold hidden_states, verifier_last_hidden_states, input_ids and loss_mask, "
        "and its losses recompute the target through the verifier's LM head"
    )
    drafts = DRAFT_TYPES
    reads = "pre"  # its verifier_norm is applied in the trainer, even for its CE loss's target argmax
    description = (
        "speculators 0.9 offline: DEST = datasets.save_to_disk (format torch) with input_ids, loss_mask, seq_len; "
        "hidden_states/hs_{i}.safetensors = {hidden_states [T,L+1,H] (taps..., final pre-norm), token_ids [T] int64}"
    )

    def check(self) -> None:
        architecture = self.ctx.spec.model.architecture
        if self.draft == MTP and architecture not in MTP_ARCHITECTURES:
            raise ExportRefused(
                f"speculators' MTP draft fine-tunes the target's own MTP head, for Qwen3-family targets alone "
                f"({', '.join(MTP_ARCHITECTURES)}); this run's target is {architecture}: train another draft type "
                "(--draft eagle3, dflash ...)"
            )

    def final_state(self) -> str:
        return f"{super().final_state()}, last slot of hidden_states"

    def sample(self, index: int, sid: int, t: dict[str, torch.Tensor]) -> list[Written]:
        T, H = t["hidden_states"].shape
        aux = self.ctx.aux(t).reshape(T, -1, H)
        pre = self.ctx.final(sid, t, "pre")
        states = torch.cat([aux, pre[:, None]], dim=1).contiguous()
        ids = t["input_ids"].to(torch.int64).contiguous()
        data = save({"hidden_states": states, "token_ids": ids})
        return [put(self.ctx.dest, f"hidden_states/hs_{index}.safetensors", data)]

    def train_hint(self) -> str:
        ctx = self.ctx
        args = ["speculators", "train", "--speculator-type", self.draft]
        args += ["--verifier-name-or-path", ctx.model_named(), "--data-path", ctx.dest.absolute()]
        if ctx.taps:  # vLLM's aux ids: hsx id + 1; MTP reads the final state alone
            args += ["--target-layer-ids", *(k + 1 for k in ctx.taps)]
        args += ["--draft-vocab-size", ctx.opts.draft_vocab] if ctx.opts.draft_vocab is not None else []
        return shlex.join(map(str, args))

    def finish(self, vocab) -> list[Written]:
        ctx, dest = self.ctx, self.ctx.dest
        out: list[Written] = []
        if vocab is not None:
            d2t, t2d, freq = vocab
            k = len(d2t)
            out.append(put(dest, "token_freq.pt", torch_bytes(freq)))
            out.append(put(dest, f"d2t-{k}.npy", npy_bytes(d2t.numpy())))
            out.append(put(dest, f"t2d-{k}.npy", npy_bytes(t2d.numpy())))
        columns = {
            "input_ids": [ctx.plan.input_ids(i).astype(np.int64) for i in ctx.ids],
            "loss_mask": [ctx.plan.loss_mask(i).astype(np.int64) for i in ctx.ids],
            "seq_len": [int(ctx.plan.lengths[i]) for i in ctx.ids],
        }
        return out + [put(dest, name, data) for name, data in dataset_files(columns)]
