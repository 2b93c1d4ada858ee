"""``hsx extract``: set up a run (plan + spec) or resume one, then capture and store what is missing.

    hsx extract --model M --data D --out OUT     new run: plan, spec, then extraction
    hsx extract --out OUT                         resume: everything comes from OUT/hsx.json

The extraction job, stage by stage (what every job shares, lock, verification, space, the resume
prologue, lives in ``hsx.job``):

- ``options``: what the operator asked for (``ExtractOptions``), parsed once, defaults in one place;
- ``stage``: the extraction's parts of a job (``job.stage``): how a run is created and opened;
- ``folder``: a new run's plan and rejects, and what a resume asks for in the spec's terms;
- ``pipeline``: one process's capture -> staging -> writer pipeline (``Extractor``);
- ``executor``: the contract the three ways it runs meet, and ``extract``, which picks one:
  ``local`` (this process), ``group`` (a tensor/expert-parallel group of this node's devices),
  ``workers`` (Ray workers); ``outcome``: what crosses their processes.
"""

from __future__ import annotations

from hsx.errors import CleanStop, Crashed, Refused
from hsx.extract.executor import extract
from hsx.extract.options import ExtractOptions
from hsx.extract.summary import ExtractSummary

__all__ = ["CleanStop", "Crashed", "ExtractOptions", "ExtractSummary", "Refused", "extract"]
