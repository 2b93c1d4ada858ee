"""Exports of a run into the formats trainers read as they are: SpecForge, speculators, Model-Optimizer, DeepSpec.

``core`` streams, verifies, resumes and writes the manifest; ``trainer`` is what a format is and
writes with; one module per trainer knows its format; ``norm`` converts between the post-norm
state hsx stores and the pre-norm state some want; ``vocab`` builds draft-vocabulary maps.
"""

from __future__ import annotations

from hsx.errors import ExportRefused
from hsx.export.core import FORMATS, ExportSummary, run_export
from hsx.export.trainer import ExportOptions

__all__ = ["FORMATS", "ExportOptions", "ExportRefused", "ExportSummary", "run_export"]
