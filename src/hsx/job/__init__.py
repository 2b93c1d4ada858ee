"""What every job does around its own work, whatever its stage (``hsx extract``, ``hsx generate``):

- ``options``: the options every job shares (``JobOptions``: run folder, model, data, verification,
  space, telemetry), their bounds, and the command that asks for them again;
- ``folder``: the folder steps (stray temps, failed starts, foreign-folder and drift refusals, where
  a matched model now lives);
- ``space``: the output volume's projection, the space forecast and the disk guard;
- ``resume``: verify what is on disk, tidy what a crash left, settle finished shards (``Verifier``);
- ``prologue``: the resume prologue, written once: lock, stray temps, model location, header scan,
  space, verification, a full disk turned into a clean stop.

A job reads its spec through ``spec.JobSpec``, which both kinds of run's spec satisfy.
"""
