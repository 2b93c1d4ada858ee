"""A small trainer that consumes a live run through ``hsx.data.StreamDataset``, for the fault tests.

    python tests/stream_trainer.py RUN CKPT_DIR NAME [--every 2] [--max-tokens 300] [--plane URL]

A linear head on the aux states predicts the next token; plain PyTorch, one optimizer step per
batch. After each step it acknowledges the step, and every ``--every`` steps saves its checkpoint
(the weights and the ids each rank has trained, in that model's history, as one safetensors file
written to a temp name and renamed) and then declares it durable; its last step too, at the end
(``final.safetensors``). Started again, it resumes from its checkpoint's step. Prints
``acked STEP`` after each acknowledgement (the tests' progress points) and ``done`` at the end of
its stream. ``--plane``: the samples' bytes from the run's data plane (``hsx.plane``), RUN holding
only the records.

Started as rank ``RANK`` of ``WORLD_SIZE`` (the environment torchrun sets, with ``MASTER_ADDR`` and
``MASTER_PORT``), it is one rank of a DistributedDataParallel group over gloo, in the loop
docs/streaming.md gives: every rank acknowledges the step, a barrier, rank 0 saves the checkpoint
(the ids every rank trained, gathered), a barrier, every rank declares it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hsx.data import StreamDataset, collate_padded, describe

SEED, BUDGET = 7, 300


def save(head: torch.nn.Module, trained: torch.Tensor, step: int, path: Path, world: int) -> None:
    """Rank 0 writes the weights and every rank's trained ids (``trainedR``), durably, under ``path``."""
    everyone = [trained]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, trained)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = head.state_dict() | {f"trained{r}": t for r, t in enumerate(everyone)} | {"step": torch.tensor(step)}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint(ds: StreamDataset, head: torch.nn.Module, trained: torch.Tensor, step: int, path: Path, world: int):
    """docs/streaming.md's multi-rank checkpoint: every rank acknowledged ``step`` (a barrier), rank 0
    saves, and once it is durable (a barrier) every rank declares it."""
    if world > 1:
        dist.barrier()
    save(head, trained, step, path, world)
    if world > 1:
        dist.barrier()
    if step:
        ds.checkpointed(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("name")
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=BUDGET)
    ap.add_argument("--plane")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    info = describe(args.run)
    torch.manual_seed(0)
    head = torch.nn.Linear(len(info["layers"]) * info["hidden_size"], 2048)
    trained = torch.zeros(0, dtype=torch.int64)
    step = 0  # no checkpoint: from the start (what an earlier try acknowledged is trained again)
    path = args.ckpt / "checkpoint.safetensors"
    if path.exists():
        state = load_file(path)
        head.load_state_dict({k: v for k, v in state.items() if k in ("weight", "bias")})
        trained, step = state[f"trained{rank}"], int(state["step"])
    model = torch.nn.parallel.DistributedDataParallel(head) if world > 1 else head
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = StreamDataset(
        args.run,
        args.name,
        rank=rank,
        ranks=world,
        max_tokens=args.max_tokens,
        seed=SEED,
        resume_step=step,
        collate=collate_padded,
        poll=0.02,
        plane=args.plane,
    )
    for batch in ds:
        x, y = batch["aux_hidden_states"][:, :-1].float(), batch["input_ids"][:, 1:]
        mask = batch["loss_mask"][:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(model(x)[mask], y[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        trained = torch.cat([trained, batch["sample_ids"]])
        ds.ack(step)
        print(f"acked {step}", flush=True)
        if step % args.every == 0:
            checkpoint(ds, head, trained, step, path, world)
    checkpoint(ds, head, trained, step, args.ckpt / "final.safetensors", world)  # the last one, declared too
    ds.close()
    if world > 1:
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
