"""The certificate line of ``hsx status``: what the run's checks of its taps found (``hsx.certify``),
as its ``certificate.json`` records it (a self-verifying record of this run: ``store.records``). States
on disk that failed a check fail the line (a person acts); a session a check stopped before it
wrote anything warns (nothing on disk is wrong: the resume is safe once the cause is fixed)."""

from __future__ import annotations

from pathlib import Path

from hsx import certify
from hsx.assess.checks import Check
from hsx.errors import RecordDamaged, SpecError
from hsx.spec import GENERATE
from hsx.store import layout


def line(run: Path, spec) -> Check:
    if spec.kind == GENERATE:
        return Check("certificate", "ok", "a generate run holds token ids: no states to certify")
    try:
        cert = certify.read_certificate(run)
    except (RecordDamaged, SpecError) as e:
        action = f"move {layout.CERTIFICATE} aside: the next session writes it"
        return Check("certificate", "fail", str(e), action=action)
    if cert is None and spec.certify is None:
        return Check("certificate", "ok", "not certified: the run was made before hsx checked its taps "
                     "(hsx verify --reference N recomputes samples and writes one)")  # fmt: skip
    figure = certify.line(cert)
    if cert is None:
        return Check("certificate", "ok", figure)
    data = {"verdict": cert.verdict, "stopped": cert.stopped, "failures": cert.failures}
    action = (
        "find the cause (the failure names the sample, the tap and the likely causes); loaders refuse the run "
        "until a session or hsx verify --reference passes (or allow_failed=True)"
    )
    if cert.failures:  # states on disk failed
        return Check("certificate", "fail", figure, action=action, data=data)
    if cert.stopped:  # a check stopped the last session before it wrote a wrong state: resuming is safe once fixed
        return Check("certificate", "warn", figure, action=action, data=data)
    return Check("certificate", "ok", figure, data=data)
