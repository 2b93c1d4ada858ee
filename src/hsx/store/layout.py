"""Where things live in a run folder. A sample's path depends only on its id and the shard size."""

from __future__ import annotations

from pathlib import Path

SPEC = "hsx.json"
REJECTS = "rejects.jsonl"
SHARDS = "shards"
SEALED = "SEALED"
QUARANTINE = "quarantine"
SUFFIX = ".safetensors"


def shard_of(sample_id: int, shard_size: int) -> int:
    return sample_id // shard_size


def shard_dir(run: Path, shard: int) -> Path:
    return run / SHARDS / f"{shard:06d}"


def sample_name(sample_id: int) -> str:
    return f"{sample_id:09d}{SUFFIX}"


def sample_path(run: Path, sample_id: int, shard_size: int) -> Path:
    return shard_dir(run, shard_of(sample_id, shard_size)) / sample_name(sample_id)


def shard_ids(shard: int, shard_size: int, num_samples: int) -> range:
    return range(shard * shard_size, min((shard + 1) * shard_size, num_samples))


def num_shards(num_samples: int, shard_size: int) -> int:
    return -(-num_samples // shard_size)


def parse_sample_name(name: str) -> int | None:
    stem = name.removesuffix(SUFFIX)
    if name.endswith(SUFFIX) and len(stem) == 9 and stem.isdigit():
        return int(stem)
    return None
