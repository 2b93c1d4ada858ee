"""A small trainer that consumes a live run through ``hsx.data.StreamDataset``, for the fault tests.

    python tests/stream_trainer.py RUN CKPT_DIR NAME [--every 2]

A linear head on the aux states predicts the next token; plain PyTorch, one optimizer step per
batch. After each step it acknowledges the step, and every ``--every`` steps saves its checkpoint
(the weights and the ids it has trained, in that model's history, as one safetensors file written
to a temp name and renamed) and then declares it durable. Started again, it resumes from its
checkpoint's step. Prints ``acked STEP`` after each acknowledgement (the tests' progress points)
and ``done`` at the end of its stream.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hsx.data import StreamDataset, collate_padded, describe

SEED, BUDGET = 7, 300


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("name")
    ap.add_argument("--every", type=int, default=2)
    args = ap.parse_args()
    info = describe(args.run)
    torch.manual_seed(0)
    head = torch.nn.Linear(len(info["layers"]) * info["hidden_size"], 2048)
    trained = torch.zeros(0, dtype=torch.int64)
    step = 0  # no checkpoint: from the start (what an earlier try acknowledged is trained again)
    path = args.ckpt / "checkpoint.safetensors"
    if path.exists():
        state = load_file(path)
        head.load_state_dict({k: v for k, v in state.items() if k not in ("trained", "step")})
        trained, step = state["trained"], int(state["step"])
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    ds = StreamDataset(
        args.run, args.name, max_tokens=BUDGET, seed=SEED, resume_step=step, collate=collate_padded, poll=0.02
    )
    for batch in ds:
        x, y = batch["aux_hidden_states"][:, :-1].float(), batch["input_ids"][:, 1:]
        mask = batch["loss_mask"][:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(head(x)[mask], y[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        trained = torch.cat([trained, batch["sample_ids"]])
        ds.ack(step)
        print(f"acked {step}", flush=True)
        if step % args.every == 0:
            state = head.state_dict() | {"trained": trained, "step": torch.tensor(step)}
            tmp = args.ckpt / ".checkpoint.tmp"
            save_file(state, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            ds.checkpointed(step)
    state = head.state_dict() | {"trained": trained, "step": torch.tensor(step)}
    save_file(state, args.ckpt / "final.safetensors")
    ds.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
