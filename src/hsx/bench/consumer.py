"""``hsx bench --consumer``'s trainer: a process of its own that reads a run being extracted
through ``hsx.data.StreamDataset`` (every digest verified, every batch collated) and acknowledges,
and declares a checkpoint of, every batch, as a streaming trainer does, minus the training: what a
live consumer costs the extraction beside it.

    python -m hsx.bench.consumer RUN MAX_TOKENS [THREADS]    (prints the steps it acknowledged)

THREADS: torch's intra-op threads in this process (0 or none: torch's default, one a core).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hsx.data import StreamDataset, collate_padded

NAME = "bench"


def consume(run: Path, max_tokens: int) -> int:
    """Read the whole stream, acknowledging each batch at its step; the steps taken."""
    step = 0
    with StreamDataset(run, NAME, max_tokens=max_tokens, collate=collate_padded, log=lambda _: None) as ds:
        for step, _ in enumerate(ds, 1):
            ds.ack(step)
            ds.checkpointed(step)
    return step


if __name__ == "__main__":
    if len(sys.argv) > 3 and int(sys.argv[3]):
        import torch

        torch.set_num_threads(int(sys.argv[3]))
    print(consume(Path(sys.argv[1]), int(sys.argv[2])))
