"""What every job does around its own work, whatever its stage (``hsx extract``, ``hsx generate``):

- ``stage``: the job, written once: ``run`` (the model resolved once, the run created or opened and
  its drift refused, then launched) and ``session`` (lock, prologue, the stage's work, the clean
  stop of a full disk, the summary), and ``Stage``, the parts each stage fills in;
- ``model``: the job's model, resolved once and handed down (its tokenizer loaded once);
- ``options``: the options every job shares (``JobOptions``: run folder, model, data, verification,
  space, telemetry), their bounds, and the commands that ask for them again or resume;
- ``folder``: the folder steps (stray temps, failed starts, foreign-folder and drift refusals, where
  a matched model now lives);
- ``space``: the output volume's projection, the space forecast and the disk guard;
- ``resume``: verify what is on disk, tidy what a crash left, settle finished shards (``Verifier``),
  and the summary every stage extends (``Summary``);
- ``prologue``: the resume prologue, written once: lock, stray temps, model location, header scan,
  space, verification, a full disk turned into a clean stop.

A job reads its spec through ``spec.JobSpec``, which both kinds of run's spec satisfy.
"""
