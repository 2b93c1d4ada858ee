"""The job's model, resolved once and handed down: ``Model``.

Every step of a job that needs the model reads this one object: a new run's checks, planning and
spec (its folder, identity and tokenizer), a resume's drift check (what ``--model`` is), the work
(where the run's model is now). Each is found on first use and kept, so a job resolves the model
once and loads its tokenizer once, and a resume with nothing to do touches neither.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from hsx import target
from hsx.spec import JobSpec, ModelIdentity


class Model:
    """``given``: ``--model`` as typed (None on a resume that does not name it). A new run's model is
    ``given``; a resume's is where its run has it now (``resumes``), checked against the spec's
    fingerprint unless the drift check already compared ``given``'s identity with it."""

    def __init__(self, given: str | None, trust_remote_code: bool = False):
        self.given, self.trust_remote_code = given, trust_remote_code
        self.run: Path | None = None
        self.spec: JobSpec | None = None

    @classmethod
    def of_run(cls, given: str | None, trust_remote_code: bool, run: Path, spec: JobSpec) -> Model:
        """The model of a run already opened elsewhere (a tensor-parallel group's rank 0)."""
        model = cls(given, trust_remote_code)
        model.resumes(run, spec)
        return model

    def resumes(self, run: Path, spec: JobSpec) -> None:
        """The job resumes ``run``: its model is the spec's, and its tokenizer may run the code the run's
        start allowed."""
        self.run, self.spec = run, spec
        self.trust_remote_code = self.trust_remote_code or spec.trust_remote_code

    @cached_property
    def named(self) -> Path:
        """The folder ``--model`` names."""
        assert self.given is not None, "no --model was given"
        return target.resolve(self.given)

    @cached_property
    def identity(self) -> ModelIdentity:
        """What identifies the model ``--model`` names (its fingerprint reads the weight files' probes)."""
        assert self.given is not None, "no --model was given"
        return target.identity(self.given, self.named)

    @cached_property
    def dir(self) -> Path:
        """Where the job's model is: the one named (a new run's), or where the run resumed has it now,
        every file checked against the run's record (``target.model_dir_for``; a run made before hsx
        kept one: the fingerprint, of ``--model`` where given, read once). The drift check reads it,
        so a model that is not the run's is refused here before anything is recorded of it."""
        if self.spec is None:
            return self.named
        known = self.identity if self.given is not None else None
        return target.model_dir_for(self.run, self.spec, self.given, known=known, keep=True)

    @cached_property
    def tokenizer(self):
        return target.load_tokenizer(self.dir, self.trust_remote_code)
