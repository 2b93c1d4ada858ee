"""The generate stage: regenerate a dataset's assistant turns with the target model, crash-safe and
token-exact, so that extraction can read the target's own answers (``hsx extract --data GEN``).

``engine`` is the contract every generation backend meets (one backend per file beside it, opened
by name through ``engines.open_engine``); ``job`` is the loop that keeps an engine full and writes
one verified file per conversation (``record``); docs/generate.md tells the whole story.
"""
