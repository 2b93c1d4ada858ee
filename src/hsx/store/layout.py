"""Every name in a run folder, in one place. A sample's path depends only on its id and the shard size.

OUT/
  hsx.json                 SPEC: the run spec, written once, last of the set-up
  model-location.json      LOCATION: where the model lives now (beside the spec, which never changes)
  fidelity.json            FIDELITY: a dataset run's fidelity baseline (beside the spec: measured after it)
  taps.json                TAP_BANDS: each tap's RMS band, set by the run's first samples (hsx.certify)
  certificate.json         CERTIFICATE: what the run's checks found, tap by tap (hsx.certify), bound to its identity
  model-files.json         MODEL_FILES: each file of the model: where it stands (size, mtime, inode), its digest
  plan/plan.parquet        PLAN_DIR / PLAN_FILE: the frozen, tokenized work list
  plan/growth.json         GROWTH: samples appended since (an extraction following its generate run),
  plan/part-000001.parquet   and the files holding them (part_name)
  rejects.jsonl            REJECTS: every input row not in the plan, with its reason
  teacher-vocab.npy        TEACHER_VOCAB: a --teacher draft-vocab run's draft vocabulary (target ids, int64)
  shards/000012/000012345.safetensors, shards/000012/SEALED
  sealed/000012.json       SEALS: the run's own record of each shard it sealed (outside the shard's
                           folder: a folder deleted whole is data lost, not data not yet written)
  quarantine/              QUARANTINE: files moved aside (never deleted) with the reason
  lock.json, .lock.json.guard, metrics.json, metrics-history.jsonl   while a run is (or was) going
  workers/                 WORKERS: the scale-out workers' heartbeats, and STOP
  group.json               GROUP: the ranks of a running tensor-parallel group (pids, devices)
  consumers/NAME/          CONSUMERS: a trainer's leases, acknowledgements and checkpoint step (hsx.consumer)
  consumed/000012.json     CONSUMED: the files of shard 12 deleted once every consumer released them
                           (--window with --delete-released): done and gone on purpose, never missing
  consumed/.guard          consumed_guard: flocked while a process records and deletes released files
  failed-start.json        FAILED_START: a start that never became a run (job.folder.Failure)
  crash.json               CRASH: a session's unexpected error, until a later session completes
  interconnect.json        INTERCONNECT: the node's GPU links as measured before multi-GPU jobs (hsx.interconnect)
"""

from __future__ import annotations

from pathlib import Path

SPEC = "hsx.json"
LOCATION = "model-location.json"
FIDELITY = "fidelity.json"
TAP_BANDS = "taps.json"
CERTIFICATE = "certificate.json"
MODEL_FILES = "model-files.json"  # every file of the run's model as it stands, with digests (target.check_files)
PLAN_DIR = "plan"
PLAN_FILE = "plan.parquet"
GROWTH = "growth.json"
PLAN_REJECTS = "rejects.jsonl"  # in a generate run's plan/: the rows planning rejected (the run's adds later ones)
REJECTS = "rejects.jsonl"
TEACHER_VOCAB = "teacher-vocab.npy"  # written before the spec, which records its digest
SHARDS = "shards"
SEALED = "SEALED"
SEALS = "sealed"
QUARANTINE = "quarantine"
SUFFIX = ".safetensors"
LOCK = "lock.json"
GUARD = ".lock.json.guard"  # flocked while a lock is judged and taken; never holds data
METRICS = "metrics.json"
HISTORY = "metrics-history.jsonl"
WORKERS = "workers"
GROUP = "group.json"
CONSUMERS = "consumers"
CONSUMED = "consumed"
INTERCONNECT = "interconnect.json"
FAILED_START = "failed-start.json"  # a start that never became a run: why, and the command that starts it again
CRASH = "crash.json"  # the last session met an error hsx did not expect: what, where, when, the log's last lines
STOP = "STOP"  # in WORKERS: written by a driver that stops handing out work (disk full, a worker failed)

# what a run folder may hold before its spec exists (an interrupted set-up, or a lock taken early)
SETUP_FILES = frozenset({PLAN_DIR, REJECTS, TEACHER_VOCAB, LOCK, GUARD, METRICS, HISTORY, GROUP, FAILED_START})


def part_name(n: int) -> str:
    """The ``n``-th file of samples appended to a plan (1-based)."""
    return f"part-{n:06d}.parquet"


def consumed_record(run: Path, shard: int) -> Path:
    return run / CONSUMED / f"{shard:06d}.json"


def consumed_guard(run: Path) -> Path:
    return run / CONSUMED / ".guard"


def shard_of(sample_id: int, shard_size: int) -> int:
    return sample_id // shard_size


def shard_dir(run: Path, shard: int) -> Path:
    return run / SHARDS / f"{shard:06d}"


def sample_name(sample_id: int) -> str:
    return f"{sample_id:09d}{SUFFIX}"


def sample_path(run: Path, sample_id: int, shard_size: int) -> Path:
    return shard_dir(run, shard_of(sample_id, shard_size)) / sample_name(sample_id)


def seal_record(run: Path, shard: int) -> Path:
    return run / SEALS / f"{shard:06d}.json"


def shard_ids(shard: int, shard_size: int, num_samples: int) -> range:
    return range(shard * shard_size, min((shard + 1) * shard_size, num_samples))


def num_shards(num_samples: int, shard_size: int) -> int:
    return -(-num_samples // shard_size)


def parse_sample_name(name: str) -> int | None:
    stem = name.removesuffix(SUFFIX)
    if name.endswith(SUFFIX) and len(stem) == 9 and stem.isdigit():
        return int(stem)
    return None
