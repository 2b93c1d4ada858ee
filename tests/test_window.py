"""The window's count of what the named consumers have not released (``extract.window.held``)."""

from __future__ import annotations

import shutil

from hsx.extract.window import Sealed, held
from hsx.spec import Window
from hsx.store import layout

NAMES = ["draft"]


def _on_disk(run) -> dict[int, int]:
    return {
        layout.parse_sample_name(p.name): p.stat().st_size
        for p in (run / layout.SHARDS).rglob("*")
        if layout.parse_sample_name(p.name) is not None
    }


def test_held_counts_every_unreleased_file_sealed_or_not_and_its_manifest_sizes_are_read_once(finished_run, tmp_path):
    """Sealed shards' sizes come from their manifests, kept between calls; a shard being written (no
    manifest yet) is looked at again each time. The bytes equal the files' own sizes either way, and
    a file deleted after the manifest was read is no longer counted."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (layout.shard_dir(run, 3) / layout.SEALED).unlink()  # shard 3 as one still being written
    window, sealed = Window(bytes=1, consumers=NAMES), Sealed(run)
    files = _on_disk(run)
    assert held(run, window, 10, [], sealed) == (sum(files.values()), NAMES)
    assert sorted(sealed.known) == ["000000", "000001", "000002"]  # the unsealed shard is not kept
    gone = layout.sample_path(run, 12, 10)
    gone.unlink()
    assert held(run, window, 10, [], sealed) == (sum(files.values()) - files[12], NAMES)
    assert held(run, window, 10, []) == held(run, window, 10, [], sealed)  # a fresh look agrees
