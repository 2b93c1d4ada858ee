"""The extraction stage's parts of a job (``job.stage.Stage``): ``Extract``, what every executor of it
shares. It creates a run or opens one (``extract.folder``; a run that follows its generate run grows
its plan: ``extract.follow``), and under the lock checks the plan is still the spec's and settles
the records of an earlier driver's workers; each executor does the work its own way
(``local.InProcess``, ``workers.driver.Workers``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hsx import certify, registry
from hsx.extract import folder
from hsx.extract.follow import follow, unchanged
from hsx.extract.options import ExtractOptions
from hsx.extract.summary import ExtractSummary
from hsx.job.model import Model
from hsx.job.stage import Stage
from hsx.lock import RunLock
from hsx.plan import Plan, load_plan
from hsx.progress import Progress
from hsx.spec import RunSpec, differences, load_spec

Log = Callable[[str], None]


class Extract(Stage[ExtractOptions, RunSpec, ExtractSummary]):
    measure_first = True  # the disk guard holds the forecast: an unmeasured zstd run starts, judged on its files

    def create(self, opts: ExtractOptions, model: Model, log: Log) -> Callable[[], RunSpec]:
        return folder.create_run(opts, model, log)

    def refuse_model(self, opts: ExtractOptions, model: Model) -> None:
        folder.refuse_model(opts, model)

    def load(self, run: Path) -> RunSpec:
        return load_spec(run)

    def asked(self, opts: ExtractOptions, model: Model, spec: RunSpec) -> dict:
        opts.refuse_unused(opts.backend or spec.backend, spec.generate_spec is not None)  # options it would ignore
        return folder.asked(opts, model, spec.model.num_layers)

    def differences(self, spec: RunSpec, asked: dict) -> list[str]:
        return differences(spec, asked)

    def opened(self, opts: ExtractOptions, spec: RunSpec, log: Log) -> RunSpec:
        folder.refuse_other_quantization(opts.out, spec)
        return folder.session_limits(opts, follow(opts.out, spec, log), log)

    def progress(self, opts: ExtractOptions, spec: RunSpec) -> Progress:
        return Progress(spec.plan.num_samples, spec.plan.num_tokens, spec.bytes_per_token, opts.out, opts.log_every)

    def locked(self, opts: ExtractOptions, spec: RunSpec, lock: RunLock, log: Log) -> None:
        unchanged(opts.out, spec)  # another resume grew the plan since this process read the spec: refused
        registry.settle(opts.out, lock.me, log)  # workers of a crashed scale-out driver: gone first

    def plan(self, run: Path, spec: RunSpec) -> Plan:
        return load_plan(run, spec)

    def summary(self, run: Path, spec: RunSpec) -> ExtractSummary:
        return ExtractSummary.of(run, spec)

    def ended(self, run: Path, spec: RunSpec, failure: str | None) -> None:
        certify.write_certificate(run, spec, failure)
