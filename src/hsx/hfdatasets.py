"""Hugging Face datasets as ``--data``: a ``save_to_disk`` folder, or a dataset by name read from the
local cache only (run time never reaches the internet: fetch it once beforehand with ``datasets``).

Needs the ``datasets`` package (the ``hsx[datasets]`` extra); without it such a source is refused by
name before anything is written. A source's identity for the spec is the digest of the Arrow files
of the split read (what ``datasets`` itself keeps), so a changed cache or folder is a changed input.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from hsx.errors import InputError
from hsx.fingerprint import digest_file

EXTRA = "pip install 'hsx[datasets]'"
FILE_TYPES = (".jsonl", ".ndjson", ".json", ".parquet")
BATCH = 64  # rows read at a time: a batch of large rows stays a small multiple of the row limit


def is_folder(path: Path) -> bool:
    """A folder ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``) wrote."""
    return path.is_dir() and any((path / n).is_file() for n in ("state.json", "dataset_dict.json"))


def is_name(path: Path) -> bool:
    """Could ``path`` be a dataset's name (``org/name`` or ``name``) rather than a file?"""
    text = str(path)
    return not path.exists() and text.count("/") <= 1 and not text.startswith((".", "/", "~"))


def is_source(path: Path) -> bool:
    """``path`` is read through ``datasets`` (a saved folder, or a name that is no file's)."""
    return is_folder(path) or (is_name(path) and path.suffix.lower() not in FILE_TYPES)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise InputError(f"reading a Hugging Face dataset needs the datasets package: {EXTRA}") from None
    datasets.disable_progress_bars()
    return datasets


@contextmanager
def offline(ds) -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` in offline mode for one call (their flags are read per
    call; the environment variable only at import): a dataset comes from the local cache or not at all."""
    import huggingface_hub.constants as hub

    before = ds.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    ds.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        ds.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


def load(path: Path, split: str | None):
    """The ``datasets.Dataset`` of ``path`` (its ``split``): from the folder, or from the local cache.
    Refused with the reason: not cached, no such split, or a choice of splits to make."""
    name = str(path)
    ds = _datasets()
    if is_folder(path):
        try:
            data = ds.load_from_disk(name)
        except Exception as e:  # a damaged folder: what datasets says of it
            raise InputError(f"{name}: not a readable datasets folder ({e})") from e
    else:
        try:
            with offline(ds):
                data = ds.load_dataset(name)
        except Exception as e:
            raise InputError(
                f"{name}: no such data file or datasets folder, and no dataset of that name in the local "
                f"Hugging Face cache ({ds.config.HF_DATASETS_CACHE}); hsx reads datasets offline only: fetch it "
                f"first (python -c \"import datasets; datasets.load_dataset('{name}')\") or give its files"
            ) from e
    if isinstance(data, ds.DatasetDict):
        splits = list(data)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in data:
            have = ", ".join(splits)
            ask = "choose one with --split" if split is None else f"it has no split {split!r}"
            raise InputError(f"{name} has the splits {have}: {ask}")
        return data[split]
    if split is not None:
        raise InputError(f"{name} holds a single dataset with no splits: drop --split {split}")
    return data


def batches(path: Path, split: str | None) -> Iterator:
    """The dataset's rows in order, as Arrow tables of ``BATCH`` rows (``hsx.input`` makes rows of them)."""
    yield from load(path, split).with_format("arrow").iter(batch_size=BATCH)


def identity(path: Path, split: str | None) -> tuple[int, str]:
    """(bytes, digest) of the Arrow files that hold the split: what the spec records of it."""
    files = [Path(f["filename"]) for f in load(path, split).cache_files]
    h = xxhash.xxh3_128()
    for f in files:
        h.update(f"{f.name}:{digest_file(f)}\n".encode())
    return sum(f.stat().st_size for f in files), h.hexdigest()
