"""--data as users hold it: a ``save_to_disk`` folder, or a dataset by name from the local cache
(offline: no connection is attempted), read row for row as the same rows in a JSONL file are."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest

from conftest import conversations, require, write_jsonl
from hsx.errors import InputError
from hsx.input import check_source, read_conversations
from hsx.spec import DataFile

NAME = "hsx-test/tiny_chat"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return conversations(6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, rows) -> Path:
    """``DatasetDict.save_to_disk``: train (6 rows) and test (the first 2)."""
    datasets = require("datasets")
    path = tmp_path_factory.mktemp("ds") / "saved"
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


@pytest.fixture
def cache(tmp_path, rows, monkeypatch) -> list:
    """A Hugging Face datasets cache holding ``NAME`` as ``load_dataset`` leaves it after a download
    (train and test splits, prepared Arrow files), in a temp folder. Every connection attempted is
    refused and listed in the list returned (the libraries catch errors on their way to the cache)."""
    datasets = require("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = {s: tmp_path / f"{s}.parquet" for s in ("train", "test")}
    pq.write_table(pa.Table.from_pylist(rows), src["train"])
    pq.write_table(pa.Table.from_pylist(rows[:2]), src["test"])
    root = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", root)
    builder = Parquet(
        cache_dir=str(root / "build"),
        dataset_name="tiny_chat",
        hash="0123abcd",
        data_files={s: [str(p)] for s, p in src.items()},
    )
    builder.download_and_prepare()
    shutil.move(builder.cache_dir, root / "hsx-test___tiny_chat" / "default" / "0.0.0" / "0123abcd")

    attempts: list = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)  # what a connection to a host name asks first
    monkeypatch.setattr(socket.socket, "connect", no_network)
    return attempts


def turns(items) -> list:
    assert all(not hasattr(c, "reason") for c in items), items
    return [c.turns for c in items]


def test_a_saved_folder_reads_as_its_rows_in_a_file_with_split_and_limit(folder, rows, tmp_path):
    jsonl = turns(read_conversations([write_jsonl(tmp_path / "c.jsonl", rows)]))
    assert turns(read_conversations([folder], split="train")) == jsonl
    assert turns(read_conversations([folder], split="test")) == jsonl[:2]
    assert turns(read_conversations([folder, folder], split="train", limit=8)) == (jsonl + jsonl)[:8]
    first = next(iter(read_conversations([folder], split="train")))
    assert (first.source.file, first.source.row, first.source.id) == (str(folder), 0, "identity_0")
    with pytest.raises(InputError, match="has the splits train, test: choose one with --split"):
        check_source(folder)
    with pytest.raises(InputError, match="has the splits train, test: it has no split 'dev'"):
        check_source(folder, "dev")
    with pytest.raises(InputError, match="--split train applies to a Hugging Face dataset, not to a data file"):
        check_source(tmp_path / "c.jsonl", "train")
    single = tmp_path / "single"
    shutil.copytree(folder / "test", single)  # one Dataset's folder: no splits to choose
    assert turns(read_conversations([single])) == jsonl[:2]
    with pytest.raises(InputError, match="no splits: drop --split test"):
        check_source(single, "test")


def test_a_cached_dataset_is_read_by_name_offline_and_an_uncached_one_is_refused(cache, rows, tmp_path):
    jsonl = turns(read_conversations([write_jsonl(tmp_path / "c.jsonl", rows)]))
    assert turns(read_conversations([Path(NAME)], split="train", limit=4)) == jsonl[:4]
    assert turns(read_conversations([Path(NAME)], split="test")) == jsonl[:2]
    with pytest.raises(InputError, match="no dataset of that name in the local Hugging Face cache"):
        check_source(Path("hsx-test/not_cached"))
    with pytest.raises(InputError, match="no such data file"):  # a file's name is never looked up as a dataset
        check_source(Path("convs.jsonl"))
    assert cache == []  # no connection was attempted


def test_the_spec_records_what_was_read_name_split_limit_and_content(cache, folder):
    train = DataFile.of(Path(NAME), "train")
    assert train.name == NAME and train.size > 0
    assert DataFile.of(Path(NAME), "train", 4).key() != train.key()  # the limit
    assert DataFile.of(Path(NAME), "test").digest != train.digest  # the content of another split
    saved = DataFile.of(folder, "train")
    assert saved.name == str(folder.resolve()) and saved.key() == DataFile.of(folder, "train").key()
    whole = DataFile.of(folder / "dataset_dict.json")  # a file read whole is written as before: no split, no limit
    assert set(whole.model_dump()) == {"name", "size", "digest"}


def test_without_datasets_a_dataset_is_refused_naming_the_extra(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(InputError, match=r"needs the datasets package: pip install 'hsx\[datasets\]'"):
        check_source(folder, "train")


def test_extract_plans_the_first_rows_of_a_datasets_split(folder, tmp_path):
    import json

    from conftest import TINY
    from hsx.extract import ExtractOptions, extract

    out = tmp_path / "run"
    opts = ExtractOptions(out=out, model=str(TINY), data=[folder], split="test", limit=1, device="cpu", threads=1)
    extract(opts, log=lambda m: None)
    spec = json.loads((out / "hsx.json").read_text())
    assert spec["plan"]["num_samples"] == 1 and spec["plan"]["num_rejected"] == 0
    assert (spec["data"][0]["split"], spec["data"][0]["limit"]) == ("test", 1)


def test_column_reads_a_datasets_own_field_and_one_it_lacks_is_refused_by_name(rows, tmp_path):
    """A dataset whose turns sit under another name (``dialog``, OpenAI turns) reads as the same
    conversations; a column it does not have is refused, naming those it has; the spec records it."""
    datasets = require("datasets")
    from hsx.input import normalize
    from hsx.spec import differences

    dialog = [
        {"id": r["id"], "dialog": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
        for r in rows
    ]
    folder = tmp_path / "dialog"
    datasets.Dataset.from_list(dialog).save_to_disk(str(folder))
    got = list(read_conversations([folder], column="dialog", limit=3))
    assert turns(got) == [normalize(dialog[0], got[0].source, "dialog").turns] * 3
    assert [c.source.id for c in got] == ["identity_0", "identity_1", "identity_2"]
    check_source(folder, column="dialog")
    with pytest.raises(
        InputError, match=r"no row has a column 'messages' \(--column messages\); its rows have: dialog, id$"
    ):
        check_source(folder, column="messages")
    (reject,) = read_conversations([folder], limit=1)  # without --column: as before, no known field
    assert reject.reason.startswith("unknown schema: no 'conversations' or 'messages' list")

    read = DataFile.of(folder, column="dialog")
    assert read.model_dump()["column"] == "dialog" and "column" not in DataFile.of(folder).model_dump()
    assert read.key() == DataFile.of(folder).key()  # the column is compared apart, and named
    stored = type("Stored", (), {"data": [read]})()
    said = "data: the run read each row's turns from the column 'dialog' (--column dialog); asked for"
    assert differences(stored, {"data": [DataFile.of(folder, column="chat")]}) == [
        f"{said} the column 'chat' (--column chat)"
    ]
    assert differences(stored, {"column": "chat"}) == [
        f"{said} the column 'chat' (--column chat)"
    ]  # without --data too
    assert differences(stored, {"data": [DataFile.of(folder)]}) == [
        f"{said} 'conversations' or 'messages' (no --column)"
    ]
    assert differences(stored, {"data": [read], "column": "dialog"}) == differences(stored, {}) == []
