"""Exports of a run into the formats trainers read as they are: SpecForge, speculators, Model-Optimizer.

``core`` streams, verifies, resumes and writes the manifest; one module per trainer knows its
format; ``norm`` converts between the post-norm state hsx stores and the pre-norm state some want.
"""

from __future__ import annotations

from hsx.export.core import ExportOptions, ExportRefused, ExportSummary, run_export
from hsx.export.modelopt import ModelOpt
from hsx.export.specforge import SpecForge
from hsx.export.speculators import Speculators

FORMATS = {f.name: f for f in (SpecForge, Speculators, ModelOpt)}

__all__ = ["FORMATS", "ExportOptions", "ExportRefused", "ExportSummary", "run_export"]
