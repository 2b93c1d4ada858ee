"""Capture stage: run the target and return the chosen layers' states for a batch of samples.

A backend turns a batch of token-id sequences into device tensors (``Capture``): ``aux`` [R, T, L*H]
(the hsx layer ids, concatenated in the order asked) and ``final`` [R, T, H] (last layer after the
final norm). Sample i lives at row ``rows[i]``, tokens ``offsets[i] : offsets[i] + lengths[i]``: one
sample per row, right-padded (padding is never stored), or all samples packed into one row. Given
the positions to check (``hsx.fidelity.positions``), it also measures each sample's fidelity on the
device, beside the forward (``fidelity``: ``hsx.fidelity.measure``'s rows); given a run's teacher
work (``hsx.teacher.Work``), the target's distribution at each masked position (``teacher``); and
each tap's checks with the shadow's recomputation of the samples it picks (``taps``: ``hsx.certify``).
Backends: ``transformers`` (forward hooks); ``vllm`` (its hidden-states drafter, whose KV
connector hands each finished sample's states to the store from inside vLLM's workers). Feeding,
sealing and the disk guard are the extraction job's (``extract.backends``); the store never sees
a backend, only these tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hsx.drafts import eagle3_taps as default_layers  # noqa: F401 - EAGLE-3's, the default taps
from hsx.errors import OptionError

if TYPE_CHECKING:
    from hsx.teacher import Rows, Work


@dataclass
class CapturedBatch:
    sample_ids: list[int]
    lengths: list[int]
    aux: torch.Tensor  # [R, T, L*H]
    final: torch.Tensor  # [R, T, H]
    rows: list[int]
    offsets: list[int]
    fidelity: torch.Tensor | None = None  # [samples, 4] on the device, where positions were checked
    teacher: Rows | None = None  # the target's distribution at each masked position, where the run stores it
    # [samples, taps + 1, certify.FIELDS + certify.SHADOW_FIELDS] on the device, where the run checks its taps
    # (the shadow's fields -1 for samples not recomputed)
    taps: torch.Tensor | None = None

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's states, [n, L*H] and [n, H], as views."""
        r, o, n = self.rows[i], self.offsets[i], self.lengths[i]
        return self.aux[r, o : o + n], self.final[r, o : o + n]


class Capture(Protocol):
    """An in-process backend, loaded: the device and dtype its states come in, and the states of
    one batch of samples (token ids in, tensors out)."""

    device: torch.device
    dtype: torch.dtype

    def capture(
        self,
        sample_ids: list[int],
        sequences: list[np.ndarray],
        checks: list[np.ndarray] | None = None,
        teach: Work | None = None,
    ) -> CapturedBatch: ...


def check_layers(layers: list[int], num_layers: int) -> None:
    if len(set(layers)) != len(layers):
        raise OptionError(f"duplicate layer ids in {layers}")
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise OptionError(
            f"layer ids {bad} out of range: the model has {num_layers} decoder layers, ids 0..{num_layers - 1}"
        )
