"""``hsx verify --reference N``: the shadow after the fact. N files of any run (any backend, any
layout, finished or running) are recomputed in this process through transformers' plain path
(``hsx.certify``: the sample alone, unpacked, eager, uncompiled, ``output_hidden_states``) from
the run's checkpoint, in the run's dtype, and every stored tap and final state is compared with
the recomputation within the run's bound, the MoE near-tie rule included. A vLLM run, whose engine
holds its own weights and cannot recompute through the same ranks, is certified this way. The
result goes into the run's certificate (``reference``), and a failure there makes loaders refuse
the run until a later ``--reference`` passes.

A run stored with the lossy fp8 codec differs from the recomputation by the codec's own rounding
too (e4m3, a per-token scale: at most 2^-4 of a state's size), which widens each bound by as much.
"""

from __future__ import annotations

from pathlib import Path

from hsx import certify
from hsx.assess.checks import Check, ranges
from hsx.spec import CertifyCheck, RunSpec, now
from hsx.store import layout
from hsx.store.codec import Codec
from hsx.store.format import decode, read_checked
from hsx.store.scan import ShardScan

CODEC_ROUNDOFF = {Codec.FP8: 2.0**-4}  # a lossy codec's relative rounding of a stored state


def recompute(run: Path, spec: RunSpec, scans: list[ShardScan], model_dir: Path, files: int, device: str) -> Check:
    """Recompute ``files`` files, evenly spread over the good ones, on ``device``; record what was
    found in the run's certificate; fail naming each sample and tap beyond its bound."""
    import torch

    from hsx.capture import CapturedBatch
    from hsx.capture.transformers import TransformersBackend

    good = sorted(sid for s in scans for sid in s.good)
    chosen = good[:: max(1, len(good) // max(files, 1))][:files]
    backend = TransformersBackend.load(
        model_dir, spec.layers, spec.dtype, device, trust_remote_code=spec.trust_remote_code,
        quantized_compute="dequantized", prenorm=spec.final_norm == "pre",
    )  # fmt: skip
    backend.certifies(CertifyCheck(every=1, first=0))
    slack = CODEC_ROUNDOFF.get(Codec(spec.codec), 0.0)
    shadows: dict[int, certify.Shadow] = {}
    for sid in chosen:
        t = decode(read_checked(layout.sample_path(run, sid, spec.shard_size), sid))
        ids = t["input_ids"].numpy()
        final = t["hidden_states"].to(device)
        aux = t["aux_hidden_states"].to(device) if "aux_hidden_states" in t else final[:, :0]
        batch = CapturedBatch([sid], [len(ids)], aux[None], final[None], [0], [0])
        with torch.inference_mode():
            checked = backend.tap_checks(batch, {0: backend.plain(ids)}, slack)
        shadows[sid] = certify.figures(checked.cpu().numpy(), [len(ids)], spec.model.hidden_size)[0].shadow
    found = certify.Recomputed.of(shadows, device=device, recorded=now())
    certify.write_certificate(run, spec, reference=found)
    names = certify.tap_names(spec.layers)
    details = [
        f"{n}: largest difference {d:.3g} of its bound {b:.3g} ({d / b:.2f}), {k} tokens beyond"
        for n, d, b, k in zip(names, found.diff, found.bound, found.beyond, strict=True)
    ]
    figure = f"{len(chosen)} samples recomputed through transformers' plain path on {device}, every tap compared"
    data = found.model_dump()
    if found.failed:
        worst = {sid: [names[i] for i in shadows[sid].failed] for sid in found.failed}
        details.append("beyond the bound: " + "; ".join(f"sample {s}: {', '.join(v)}" for s, v in worst.items()))
        action = (
            f"find the cause before training on this run ({'; '.join(certify.CAUSES)}); samples {ranges(found.failed)}"
        )
        return Check("reference", "fail", figure, details=details, action=action, data=data)
    return Check("reference", "ok", figure, details=details, data=data)
