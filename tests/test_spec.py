"""The run spec's kind: recorded by every run, read from the spec by every reader, inferred for a spec
written before hsx recorded it."""

from __future__ import annotations

import json
import shutil

import pytest

from hsx.assess.status import assess
from hsx.errors import SpecError
from hsx.extract import ExtractOptions, extract
from hsx.genrun.spec import load_any, load_generate_spec
from hsx.spec import kind_of, load_spec
from hsx.store.layout import SPEC


def test_an_older_spec_without_a_kind_is_an_extraction_to_every_reader(finished_run, tmp_path):
    """Runs made by the previous release record no kind: they load as extractions, status and a resume
    take them so, and reading one as a generate run is refused by name."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    body = json.loads((run / SPEC).read_text())
    assert body.pop("kind") == "extract"  # what a new run records
    (run / SPEC).write_text(json.dumps(body, indent=2))

    assert kind_of(run) == "extract" and load_spec(run).kind == "extract" and load_any(run).kind == "extract"
    report = assess(run)
    assert report.exit_code == 0 and report.command == "extract", report.to_json()
    resumed = extract(ExtractOptions(out=run), log=lambda m: None)
    assert resumed.complete and resumed.written == 0 and resumed.already_done == 40
    with pytest.raises(SpecError, match=r"is an extraction run \(hsx extract\), not a generate run"):
        load_generate_spec(run)
    body["kind"] = "generate"  # a generate run read as an extraction: refused by name
    (run / SPEC).write_text(json.dumps(body))
    with pytest.raises(SpecError, match="is a generate run"):
        load_spec(run)
