"""Benchmarks, side by side with what they measure: ``extract`` (forward pass against the whole
extraction, codecs, quantized variants), ``generate`` (regeneration against the bare engine),
``scale`` (status and verify at full size) and ``codec`` (each storage codec's rate and bytes).
Nothing in the stages imports this package; it sits above them."""
