"""Trainer files serialized in memory, so each is then written whole, atomically, with its digest."""

from __future__ import annotations

import io

import numpy as np
import torch


def torch_bytes(obj: object) -> bytes:
    """``torch.save`` of ``obj``: the pickled dicts and tensors the trainers read."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    """``np.save`` of ``array``, without pickle."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()
