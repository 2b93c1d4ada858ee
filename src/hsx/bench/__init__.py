"""Benchmarks, side by side with what they measure: ``extract`` (forward pass against the whole
extraction, codecs, quantized variants), ``generate`` (regeneration against the bare engine),
``scale`` (status and verify at full size) and ``codec`` (each storage codec's rate and bytes).
Nothing in the stages imports this package; it sits above them."""

from collections.abc import Iterable

# the options of ``hsx bench`` that only one of its two benchmarks reads, by parameter name
GENERATE_ONLY = ("max_new_tokens", "tensor_parallel_size")
EXTRACT_ONLY = (
    "device", "mean_len", "min_len", "max_len", "batch_tokens", "naive_samples", "writers", "compile", "codecs",
    "fp8_model", "int4_experts",
)  # fmt: skip


def check_mode(given: Iterable[str], generate: bool) -> None:
    """Refuse (``OptionError``) an option given on the command line that the chosen benchmark
    would not read: the extraction bench's with ``--generate``, the generate bench's without it."""
    from hsx.errors import OptionError

    given = set(given)
    foreign = GENERATE_ONLY if not generate else EXTRACT_ONLY
    stray = [f"--{name.replace('_', '-')}" for name in foreign if name in given]
    if stray:
        which = "the generate bench (--generate)" if not generate else "the extraction bench (no --generate)"
        raise OptionError(f"{', '.join(stray)} {'apply' if len(stray) > 1 else 'applies'} to {which} only")
