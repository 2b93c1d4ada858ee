"""hsx bench: what extraction costs next to the bare forward pass, measured side by side in one run.

On one model, one set of samples and the same batches it times:
- forward: the padded batches through the model, outputs discarded (the ceiling for padded work);
- naive: what public dump scripts do (one sample per forward, output_hidden_states=True, .cpu(),
  torch.save per file), on a subset;
- hsx: the real extraction path (hooks, staging, digests, fsync'd atomic writes, sealing);
- the same two for the packed (padding-free) layout, where the model supports it, and again with
  the decoder layers compiled (on CUDA by default, as ``hsx extract`` does);
- codecs: hsx's extraction again on the last layout with each storage codec (zstd, fp8), the same
  batches, and after the table the stored / raw bytes of each, its tok/s against raw's, and its
  encode MB/s on one core and on the writer threads at once (a sample of this model's own states,
  on the host), and where the run encoded it (fp8 on CUDA: on the device, before the copy);
- fidelity: on the last layout, the fidelity check (``hsx.fidelity``: the target's head on 1 in
  ``--fidelity-stride`` masked tokens, on the device) timed on its own after each batch's capture,
  the same batches: its cost as a share of the forward pass. Every synthetic token is masked, so
  this is the most a run's check costs (chat data masks its answers only); and beside it the
  ``--teacher topk:64`` rows (``hsx.teacher``: the head on every masked token, log-softmax, top-64)
  timed the same way, the most they cost;
- consumer (``consumer=True``): hsx's extraction again on the last layout with a trainer's stream
  beside it in a process of its own (``bench.consumer``: ``StreamDataset`` reading, verifying and
  collating every sample as it lands, acknowledging every batch), against the same without one;
  and again with the trainer's process on one torch intra-op thread (as a DataLoader worker);
- taps (``hsx.certify``): every hsx row checks every sample's taps on the device; on the last layout,
  hsx's extraction again with the shadow at ``--reference-every`` ("shadow": 1 in N samples by id,
  and ids 0-3, recomputed through transformers' plain path), and the shadow timed on its own on a few
  samples: its per-token time against the forward's, and what that costs a run at 1 in N samples.
- disk: fsync'd writes of sample-sized files from the writer threads, alone (is the disk the limit?).
- fp8 (``fp8=True``, CUDA): the same model then built as a block-FP8 checkpoint loads (its random
  weights quantized 128x128, on hsx's FP8 kernels: ``capture.quantized.fp8``), forward-only and hsx's
  extraction on the last layout again, next to the bf16 rows; the log gives its forward against
  bf16's, hsx against its own forward, and its weight bytes against bf16's.
Each line reports tokens/s, GB/s written, the ratio to padded forward-only, peak host RSS and peak
device memory; after the table, how long each hsx run's forward pass waited for the disk (0 when
writing kept up: then any gap to forward-only is the end-of-run wait and capture itself).
Default model: the Llama-3.1-8B shape with random weights (no download) on CUDA, the bundled tiny
model on CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from hsx.bench.codec import CodecResult, measure_states
from hsx.capture import varlen
from hsx.capture.transformers import TransformersBackend
from hsx.extract.options import Toggle, check_device, default_device
from hsx.fingerprint import ModelFingerprint, digest_json
from hsx.plan import Sample, batches_for
from hsx.spec import CertifyCheck, FidelityCheck, ModelIdentity, PlanIdentity, RunSpec, TokenizerIdentity, now, who
from hsx.store.codec import Codec
from hsx.store.format import SampleTensors

TEACHER_K = 64  # the --teacher topk:K the benchmark times
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
)


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float
    bytes: int = 0
    peak_rss: int = 0
    peak_device: int = 0
    waited_for_disk: float | None = None  # hsx rows: seconds the forward pass waited for writes
    codec: Codec | None = None  # hsx rows: how the states were stored
    stored_ratio: float | None = None  # codec rows: bytes written / what raw wrote for the same samples
    encode: CodecResult | None = None  # codec rows: encoding one sample of this model's states
    encoded_on: str | None = None  # codec rows: "device" (before the copy: fp8 on CUDA) or "host" (writers)
    expert_bytes: int | None = None  # MoE rows: bytes of the routed experts as held (bf16, or INT4 packed)
    checked: int | None = None  # the fidelity check's and the teacher's rows: tokens they computed at
    checked: int | None = None  # the fidelity check's row: tokens it checked
    every: int | None = None  # the shadow's row: 1 in this many samples recomputed in a run

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@contextmanager
def measured(name: str, device: torch.device, results: list[Result]) -> Iterator[Result]:
    """Time a phase (device synchronised), sampling peak RSS and peak device memory."""
    res = Result(name, 0, 0.0)
    proc, stop = psutil.Process(), threading.Event()

    def sample_rss() -> None:
        while not stop.wait(0.05):
            res.peak_rss = max(res.peak_rss, proc.memory_info().rss)

    watcher = threading.Thread(target=sample_rss, daemon=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    watcher.start()
    t0 = time.perf_counter()
    yield res
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        res.peak_device = torch.cuda.max_memory_allocated(device)
    res.seconds = time.perf_counter() - t0
    stop.set()
    watcher.join()
    res.peak_rss = max(res.peak_rss, proc.memory_info().rss)
    results.append(res)


def lognormal_lengths(n: int, mean: int, lo: int, hi: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sigma = 0.8
    raw = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=n)
    return np.clip(raw.round(), lo, hi).astype(np.int64)


def build_model(model: str | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if model is not None and not any(Path(model).glob("*.safetensors")):  # a config alone: that shape, random
        from transformers import AutoConfig

        torch.manual_seed(0)
        with torch.device(device):
            config = AutoConfig.from_pretrained(model)
            m = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return m, f"{Path(model).name} (random weights)"
    if model is not None:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(device), model
    if device.type == "cpu":
        from hsx.tinymodel import bundled_path

        path = bundled_path("tiny-llama")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa"), "tiny-llama"
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_8B), dtype=dtype, attn_implementation="sdpa")
    return m, "llama-3.1-8b-shape (random weights)"


def synthetic_run(
    run: Path,
    model,
    name: str,
    layers: list[int],
    dtype: str,
    lengths: np.ndarray,
    batch_tokens: int,
    packed: bool,
    compiled: bool = False,
    seed: int = 0,
    codec: Codec = Codec.RAW,
    stride: int = 8,
    reference_every: int = 0,
) -> tuple[RunSpec, object]:
    """A run folder whose plan holds random token ids of the given lengths (no tokenizer, no data),
    checking its fidelity as a run on dataset data does, 1 in ``stride`` masked tokens, and its taps
    (the shadow at 1 in ``reference_every`` samples; 0: none)."""
    from hsx.plan import Plan, write_plan

    rng = np.random.default_rng(seed)
    cfg = model.config
    samples = (
        Sample(
            rng.integers(0, cfg.vocab_size, size=int(n)).astype(np.int32),
            np.ones(int(n), np.int8),
            False,
            "synthetic",
            i,
            "",
        )
        for i, n in enumerate(lengths)
    )
    info, _ = write_plan(run, samples, int(lengths.max()))
    spec = RunSpec(
        created=now(),
        created_by=who(),
        backend="transformers",
        model=ModelIdentity(
            path=name,
            architecture=type(model).__name__,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            fingerprint=ModelFingerprint(config=digest_json(cfg.to_dict()), weights=[]),
        ),
        tokenizer=TokenizerIdentity(digest="none", chat_template="none"),
        layers=layers,
        dtype=dtype,
        max_length=int(lengths.max()),
        batch_tokens=batch_tokens,
        shard_size=1000,
        packed=packed,
        compiled=compiled,
        codec=codec,
        data=[],
        plan=PlanIdentity.of(info, 0),
        fidelity=FidelityCheck(mode="baseline", stride=stride),
        certify=CertifyCheck(every=reference_every),
    )
    spec.save(run)
    return spec, Plan(run)


@contextmanager
def live_consumer(run: Path, max_tokens: int, threads: int | None = None) -> Iterator[None]:
    """A trainer's stream of ``run`` (``bench.consumer``) in a process of its own while the body
    extracts it; it must read every batch (waited for after). ``threads``: its torch intra-op
    threads (None: torch's default, one a core)."""
    cmd = [sys.executable, "-m", "hsx.bench.consumer", str(run), str(max_tokens), str(threads or 0)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield
        out, err = proc.communicate(timeout=3600)
    finally:
        proc.kill()
    if proc.returncode != 0 or not out.strip().isdigit():
        raise RuntimeError(f"the bench's consumer failed (exit {proc.returncode}): {err[-2000:]}")


def forward_only(backend: TransformersBackend, plan, batches) -> int:
    tokens = 0
    for b in batches:
        backend.forward(backend.inputs([plan.input_ids(i) for i in b.ids]))
        tokens += b.tokens
    return tokens


def naive(model, plan, ids: list[int], out: Path, device: torch.device) -> tuple[int, int]:
    """The public-script baseline: every layer materialised, pageable copies, torch.save, no fsync."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = nbytes = 0
    with torch.inference_mode():
        for i in ids:
            x = torch.from_numpy(plan.input_ids(i).astype(np.int64))[None].to(device)
            hs = model(x, output_hidden_states=True).hidden_states
            states = {"hidden_states": [h[0].cpu() for h in hs], "input_ids": x[0].cpu()}
            path = out / f"{i}.pt"
            torch.save(states, path)
            tokens += x.shape[1]
            nbytes += path.stat().st_size
    return tokens, nbytes


def disk_probe(folder: Path, file_bytes: int, files: int, threads: int) -> tuple[int, float]:
    """fsync'd atomic writes of sample-sized files from ``threads`` threads: the disk's own rate."""
    from concurrent.futures import ThreadPoolExecutor

    from hsx.store.durable import write_parts

    folder.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(file_bytes)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: write_parts(folder / f"{i}.bin", [payload], sync_dir=False), range(files)))
    return file_bytes * files, time.perf_counter() - t0


def run_bench(
    model: str | None,
    device: str | None,
    samples: int,
    mean_len: int,
    min_len: int,
    max_len: int,
    batch_tokens: int,
    naive_samples: int,
    writers: int,
    workdir: Path | None,
    compile: Toggle = "auto",
    log: Callable[[str], None] = print,
    codecs: tuple[Codec, ...] = tuple(Codec),
    int4_experts: bool = False,
    fp8: bool = False,
    fidelity_stride: int = 8,
    consumer: bool = False,
    reference_every: int = 1000,
) -> list[Result]:
    """``device``: checked as extraction checks it (None: CUDA where there is one).
    ``compile``: also measure the packed layout with compiled layers (auto: on CUDA only).
    ``codecs``: the storage codecs measured on the last layout next to raw (raw alone: none).
    ``int4_experts``: a MoE model's last layout again with its routed experts INT4-packed
    (compressed-tensors pack-quantized, group 32, from its own weights), expanded per layer.
    ``fp8``: then the same model as a block-FP8 checkpoint, on the last layout (not with
    ``int4_experts``: each rebuilds the model). ``fidelity_stride``: the runs' fidelity sampling,
    and the check's cost measured on the last layout. ``consumer``: the last layout's extraction
    again with a live trainer's stream beside it (``live_consumer``). ``reference_every``: the
    shadow's sampling of the last layout's extraction with it, and of its cost projected to a run."""
    from hsx.extract.backends import Resources
    from hsx.extract.pipeline import Extractor
    from hsx.progress import Progress
    from hsx.store import layout
    from hsx.store.scan import ShardScan

    if device is not None:
        check_device(device)
    dev = torch.device(device or default_device())
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    model = check_options(model, str(dev), dtype_name, min_len, max_len, workdir, int4_experts, fp8)
    net, name = build_model(model, dev, dtype)
    net.eval()
    n_layers = net.config.num_hidden_layers
    from hsx.capture import default_layers

    layers = default_layers(n_layers)
    lengths = lognormal_lengths(samples, mean_len, min_len, max_len)
    backend = TransformersBackend(net, layers)
    can_pack = bool(getattr(net, "_supports_attention_backend", False))
    root = Path(tempfile.mkdtemp(prefix="hsx-bench-", dir=workdir))
    log(
        f"model {name} on {dev} ({dtype_name}), layers {layers}; {samples} samples, {int(lengths.sum()):,} tokens "
        f"(mean {lengths.mean():.0f}, {min_len}..{max_len}), batches of <= {batch_tokens} tokens; output in {root}"
    )
    results: list[Result] = []
    from hsx.staging import Staging, staging_for

    # pinned host slots are allocated once, like the model is loaded once: setup, not per-token cost;
    # one ring for the states as captured, one more for fp8's encoded on the device (CUDA)
    width, hidden = len(layers) * net.config.hidden_size, net.config.hidden_size
    rings: dict[Codec, Staging] = {}

    def staging_of(codec: Codec) -> Staging:
        key = codec if codec is Codec.FP8 else Codec.RAW
        if key not in rings:
            rings[key] = staging_for(dev, dtype, width, hidden, max(batch_tokens, max_len), 4 << 30, key)
        return rings[key]

    def extract(run: Path, spec: RunSpec, plan, tag: str) -> Result:
        """hsx's real extraction of every sample, timed."""
        todo = [
            ShardScan(s, layout.shard_ids(s, spec.shard_size, samples))
            for s in range(layout.num_shards(samples, spec.shard_size))
        ]
        progress = Progress(samples, spec.plan.num_tokens, spec.bytes_per_token)
        staging = staging_of(spec.codec)
        earlier = staging.waited  # the ring is shared by the variants
        backend.certifies(spec.certify)
        with measured(f"hsx extract ({tag})", dev, results) as r:
            extractor = Extractor(
                run, spec, plan, backend, Resources(device, writers), progress, staging=staging, log=log
            )
            with progress.live():
                try:
                    extractor.run_shards(todo)
                finally:
                    extractor.close()  # waits for the ring's copies; the ring serves the next variant
            _, r.tokens, r.bytes = progress.session()
        r.waited_for_disk = progress.waited_for_disk() - earlier if progress.waited_for_disk else None
        r.codec = spec.codec
        if spec.codec is not Codec.RAW:
            r.encoded_on = "device" if staging.encodes is spec.codec else "host"
        return r

    def synthetic(run: Path, packed: bool, compiled: bool, codec: Codec = Codec.RAW, every: int = 0):
        return synthetic_run(
            run, net, name, layers, dtype_name, lengths, batch_tokens, packed, compiled, codec=codec,
            stride=fidelity_stride, reference_every=every,
        )  # fmt: skip

    try:
        compiled_too = dev.type == "cuda" if compile == "auto" else compile == "on"
        variants = [(False, False)] + ([(True, False)] + ([(True, True)] if compiled_too else []) if can_pack else [])
        for packed, compiled in variants:
            backend.set_packed(packed)
            backend.set_compiled(compiled)
            tag = ("packed" if packed else "padded") + (", compiled" if compiled else "")
            run = root / f"run-{len(results)}"
            spec, plan = synthetic(run, packed, compiled)
            batches = [
                b
                for s in range(layout.num_shards(samples, spec.shard_size))
                for b in batches_for(layout.shard_ids(s, spec.shard_size, samples), plan.lengths, batch_tokens, packed)
            ]
            t0 = time.perf_counter()
            forward_only(backend, plan, batches)  # warm-up on every shape: kernel choice, allocator, compile
            log(f"{tag}: warm-up pass (with any compiling) {time.perf_counter() - t0:.1f} s")
            with measured(f"forward only ({tag})", dev, results) as r:
                r.tokens = forward_only(backend, plan, batches)
            if (packed, compiled) == variants[-1]:
                check_cost(backend, plan, batches, spec.fidelity, tag, dev, results)
            if not packed and naive_samples:
                subset = list(range(0, samples, max(1, samples // naive_samples)))[:naive_samples]
                with measured("naive (1/forward, all layers, torch.save)", dev, results) as r:
                    r.tokens, r.bytes = naive(net, plan, subset, root / "naive", dev)
                shutil.rmtree(root / "naive")
            calls = dict(varlen.CALLS)
            raw = extract(run, spec, plan, tag)
            if (packed, compiled) == variants[-1]:  # the shadow: in a run at 1 in N, and timed on its own
                srun = root / f"run-{len(results)}"
                sspec, splan = synthetic(srun, packed, compiled, every=reference_every)
                extract(srun, sspec, splan, f"{tag}, shadow")  # at 1 in ``reference_every``
                shutil.rmtree(srun)
                shadow_cost(backend, plan, tag, reference_every, dev, results)
            if packed:
                kernel, singles = (varlen.CALLS[k] - calls[k] for k in ("kernel", "per_sample"))
                log(f"{tag}: packed attention ran {kernel} varlen-kernel and {singles} per-sample calls")
            if (packed, compiled) == variants[-1] and any(c is not Codec.RAW for c in codecs):
                # the same batches stored through each codec; encoding timed on one of these files
                sample = typical_sample(run, spec, plan)
                encoded = {r.codec: r for r in measure_states(sample, layers, writers)}
                raw.stored_ratio, raw.encode = 1.0, encoded[Codec.RAW]
                for codec in (c for c in Codec if c in codecs and c is not Codec.RAW):
                    crun = root / f"run-{len(results)}"
                    cspec, cplan = synthetic(crun, packed, compiled, codec)
                    r = extract(crun, cspec, cplan, f"{tag}, {codec}")
                    r.stored_ratio, r.encode = r.bytes / raw.bytes, encoded[codec]
                    shutil.rmtree(crun)
            if consumer and (packed, compiled) == variants[-1]:
                crun = root / f"run-{len(results)}"
                cspec, cplan = synthetic(crun, packed, compiled)
                with live_consumer(crun, batch_tokens):
                    extract(crun, cspec, cplan, f"{tag}, live consumer")
                shutil.rmtree(crun)
                # the same with one intra-op thread in the trainer's process, as a DataLoader worker
                # runs: whether its collation on every core is what the extraction loses
                cspec, cplan = synthetic(crun, packed, compiled)
                with live_consumer(crun, batch_tokens, threads=1):
                    extract(crun, cspec, cplan, f"{tag}, live consumer, 1 thread")
                shutil.rmtree(crun)
            shutil.rmtree(run)
        if fp8:
            run = root / "run-fp8"

            def make() -> tuple[Path, RunSpec, object]:
                spec, plan = synthetic_run(
                    run, net, f"{name}, block FP8", layers, dtype_name, lengths, batch_tokens, *variants[-1],
                    stride=fidelity_stride,
                )  # fmt: skip
                return run, spec, plan

            fp8_variant(backend, make, extract, dev, results, log)
        if int4_experts:
            packed_experts_run(backend, net, dev, results, *variants[-1], extract, log, root, synthetic)
        per_file = int(lengths.mean()) * spec.bytes_per_token
        files = max(8, min(256, (2 << 30) // max(per_file, 1)))
        with measured(f"disk alone ({writers} threads, fsync)", dev, results) as r:
            r.bytes, _ = disk_probe(root / "disk", per_file, files, writers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log(f"packed attention calls: {varlen.CALLS['kernel']} varlen kernel, {varlen.CALLS['per_sample']} per-sample")
    return results


def check_cost(backend, plan, batches, check: FidelityCheck, tag: str, dev: torch.device, results: list) -> None:
    """The fidelity check's own time on the forward's batches: each batch captured, then checked as
    ``capture`` checks it (``fidelity.measure``), the device synchronised around each phase, so the
    check's time is its own (an upper bound: in a run its launches overlap the next batch). The table
    gives it as a share of the forward-only row of the same batches, measured just before."""
    from hsx import fidelity

    def sync() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    from hsx.spec import TeacherSpec
    from hsx.teacher import Teacher

    teacher = Teacher(TeacherSpec(kind="topk", k=TEACHER_K))
    capture = Result(f"capture ({tag})", 0, 0.0)
    checked = Result(f"fidelity check ({tag})", 0, 0.0, checked=0)
    taught = Result(f"teacher topk:{TEACHER_K} ({tag})", 0, 0.0, checked=0)
    for timed in (False, True):  # the first pass warms the head's kernels up
        for b in batches if timed else batches[:2]:
            ids, seqs = list(b.ids), [plan.input_ids(i) for i in b.ids]
            checks = fidelity.checks_for(check, plan, ids)
            t0 = sync()
            batch = backend.capture(ids, seqs)
            t1 = sync()
            with torch.inference_mode():
                fidelity.measure(
                    backend.head, batch.final, batch.rows, batch.offsets, seqs, checks, normed=not backend.prenorm
                )
            t2 = sync()
            work = teacher.work(plan, ids)
            with torch.inference_mode():
                work.compute(backend.head, batch.final, batch.rows, batch.offsets, normed=not backend.prenorm)
            t3 = sync()
            if timed:
                capture.tokens, capture.seconds = capture.tokens + b.tokens, capture.seconds + t1 - t0
                checked.tokens, checked.seconds = checked.tokens + b.tokens, checked.seconds + t2 - t1
                checked.checked += sum(map(len, checks))
                taught.tokens, taught.seconds = taught.tokens + b.tokens, taught.seconds + t3 - t2
                taught.checked += sum(map(len, work.positions))
    results += [capture, checked, taught]


def shadow_cost(backend, plan, tag: str, every: int, dev: torch.device, results: list, most: int = 8) -> None:
    """The shadow's own time (``hsx.certify``): ``most`` samples spread over the plan, each through
    the plain path and compared with its capture, the device synchronised around it. The table
    gives its per-token time against the forward-only row of the same layout, and that share at
    1 in ``every`` samples: what the shadow costs a run."""

    def sync() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    backend.certifies(CertifyCheck(every=1, first=0))
    row = Result(f"shadow ({tag})", 0, 0.0, every=every)
    ids = list(range(0, len(plan.lengths), max(1, len(plan.lengths) // most)))[:most]
    for timed in (False, True):  # the first pass warms eager attention's kernels up
        for sid in ids if timed else ids[:1]:
            seq = plan.input_ids(sid)
            batch = backend.capture([sid], [seq])
            t0 = sync()
            with torch.inference_mode():
                backend.tap_checks(batch, {0: backend.plain(seq)})
            t1 = sync()
            if timed:
                row.tokens, row.seconds = row.tokens + len(seq), row.seconds + t1 - t0
    backend.certifies(None)
    results.append(row)


def check_options(
    model: str | None,
    device: str,
    dtype: str,
    min_len: int,
    max_len: int,
    workdir: Path | None,
    int4_experts: bool,
    fp8: bool,
) -> str | None:
    """Every combination of the extraction bench's options runs or is refused here by name
    (``OptionError``) before anything is built or written. Returns the model folder, resolved."""
    from hsx import target
    from hsx.capture.transformers import EXPERT_COUNTS
    from hsx.errors import OptionError

    if min_len > max_len:
        raise OptionError(f"--min-len {min_len} is above --max-len {max_len}")
    if workdir is not None and not workdir.is_dir():
        raise OptionError(f"--workdir {workdir}: no such folder")
    if model is not None:
        model = str(target.resolve(model))
    if fp8 and int4_experts:
        raise OptionError("--fp8-model and --int4-experts each rebuild the model: one of them per run")
    if fp8:
        from hsx.capture.quantized.fp8 import gemm_blocker

        if (blocker := gemm_blocker(device, dtype, [128, 128])) is not None:
            raise OptionError(f"the block-FP8 model cannot run here: {blocker}")
    if int4_experts:
        config = target.load_config(Path(model)) if model is not None else {}
        if not any(config.get(k) for k in EXPERT_COUNTS):
            which = model or f"the default model on {device}"
            raise OptionError(f"--int4-experts packs routed experts, and {which} has none: give a MoE --model")
    return model


def to_block_fp8(model) -> tuple[int, int]:
    """``model`` (bf16) as a block-FP8 checkpoint of it loads: every linear layer but the head, and
    the routed experts, as transformers' FP8 modules holding the weights quantized 128x128 (the
    bf16 weights freed), then put on hsx's FP8 kernels, as ``hsx extract`` runs such a checkpoint.
    Returns the bytes of the weights quantized, before and after (values and scales)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, replace_with_fp8_linear

    from hsx.capture.quantized import fp8

    dense = dict(model.named_modules())
    before = after = 0
    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=config, pre_quantized=True)
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            names = ("weight",)
        elif isinstance(module, FP8Experts):
            names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
        else:
            continue
        for weight in names:
            original = getattr(dense[name], weight).data
            values, scale = fp8.quantize_weight(original)
            before += original.numel() * original.element_size()
            after += values.numel() + scale.numel() * scale.element_size()
            setattr(module, weight, torch.nn.Parameter(values, requires_grad=False))
            scale_name = "weight_scale_inv" if weight == "weight" else f"{weight}_scale_inv"
            setattr(module, scale_name, torch.nn.Parameter(scale, requires_grad=False))
        dense[name] = None  # the bf16 weights go as soon as their layer is quantized
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"not quantized: {left[:3]}"
    fp8.install(model)
    return before, after


def fp8_variant(
    backend: TransformersBackend,
    make: Callable[[], tuple[Path, RunSpec, object]],
    extract: Callable[[Path, RunSpec, object, str], Result],
    dev: torch.device,
    results: list[Result],
    log: Callable[[str], None],
) -> None:
    """The bench's model again as a block-FP8 checkpoint, on the layout ``make`` builds a run for:
    forward-only and hsx's extraction, and what they and its weights are against bf16's."""
    from hsx.capture.quantized import fp8
    from hsx.plan import batches_for
    from hsx.store import layout

    bf16_fwd = next(r for r in reversed(results) if r.name.startswith("forward only"))  # the same layout's
    bf16_bytes = fp8.weight_bytes(backend.model)
    before, after = to_block_fp8(backend.model)
    ratio = fp8.weight_bytes(backend.model) / bf16_bytes
    run, spec, plan = make()
    torch._dynamo.reset()  # the layers' modules changed: trace them afresh
    backend.set_compiled(spec.compiled)
    tag = ("packed" if spec.packed else "padded") + (", compiled" if spec.compiled else "") + ", FP8 model"
    n = spec.plan.num_samples
    batches = [
        b
        for s in range(layout.num_shards(n, spec.shard_size))
        for b in batches_for(layout.shard_ids(s, spec.shard_size, n), plan.lengths, spec.batch_tokens, spec.packed)
    ]
    t0 = time.perf_counter()
    forward_only(backend, plan, batches)
    log(f"{tag}: warm-up pass (with any compiling) {time.perf_counter() - t0:.1f} s")
    with measured(f"forward only ({tag})", dev, results) as fwd:
        fwd.tokens = forward_only(backend, plan, batches)
    hsx = extract(run, spec, plan, tag)
    log(
        f"block FP8: forward {fwd.rate / bf16_fwd.rate:.2f}x the bf16 forward ({bf16_fwd.name}); hsx "
        f"{hsx.rate / fwd.rate:.2f}x its own forward; weights {ratio:.3f}x bf16's bytes "
        f"({fp8.weight_bytes(backend.model) / 1e9:.2f} GB; the quantized layers {after / before:.3f}x, the "
        "embeddings and head stay bf16)"
    )


def packed_experts_run(backend, net, dev, results, packed, compiled, extract, log, root, synthetic) -> None:
    """The last layout again with the routed experts INT4-packed: forward-only and hsx rows, each
    row of the pair carrying the bytes its routed experts take (bf16 rows: the dense parameters)."""
    from hsx.capture.quantized import experts, int4
    from hsx.store import layout

    tag = ("packed" if packed else "padded") + (", compiled" if compiled else "")
    dense = experts.stored_bytes(net)
    if not dense:
        log("--int4-experts: this model has no routed experts; skipped")
        return
    for r in results:
        if r.name in (f"forward only ({tag})", f"hsx extract ({tag})"):
            r.expert_bytes = dense
    t0 = time.perf_counter()
    experts.from_dense(net, int4.Int4Experts(32), int4.quantize, compiled=dev.type == "cuda")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    stored = experts.stored_bytes(net)
    log(
        f"routed experts INT4-packed in {time.perf_counter() - t0:.1f} s: {dense / 1e9:.2f} GB -> {stored / 1e9:.2f} GB"
    )
    backend.set_packed(packed)
    run = root / "run-int4"
    spec, plan = synthetic(run, packed, compiled)
    batches = [
        b
        for s in range(layout.num_shards(len(plan.lengths), spec.shard_size))
        for b in batches_for(
            layout.shard_ids(s, spec.shard_size, len(plan.lengths)), plan.lengths, spec.batch_tokens, packed
        )
    ]
    # expanded per layer, then (CUDA, triton) read packed by the dequantizing GEMM: the same batches
    dtype = str(next(net.parameters()).dtype).removeprefix("torch.")
    blocker = int4.gemm_blocker(str(dev), dtype, net.config.get_text_config().to_dict())
    if blocker is not None:
        log(f"int4 experts on the dequantizing grouped GEMM (--quantized-compute int4): skipped, {blocker}")
    for dequantizing in (False, True) if blocker is None else (False,):
        for _, module in experts.stored_modules(net):
            module.dequantizing = dequantizing
        torch._dynamo.reset()  # the layers hold other modules now: compile afresh
        backend.set_compiled(compiled)
        tag4 = f"{tag}, int4 experts" + (", dequantizing GEMM" if dequantizing else "")
        if not run.exists():
            spec, plan = synthetic(run, packed, compiled)  # the same synthetic run again
        t0 = time.perf_counter()
        forward_only(backend, plan, batches)
        log(f"{tag4}: warm-up pass (with any compiling) {time.perf_counter() - t0:.1f} s")
        with measured(f"forward only ({tag4})", dev, results) as r:
            r.tokens = forward_only(backend, plan, batches)
        r.expert_bytes = stored
        extract(run, spec, plan, tag4).expert_bytes = stored
        shutil.rmtree(run)


def typical_sample(run: Path, spec: RunSpec, plan) -> SampleTensors:
    """The written sample nearest the mean length, as the writer had it: this model's real states."""
    from safetensors.torch import load_file

    from hsx.store import layout

    sid = int(np.abs(plan.lengths - plan.lengths.mean()).argmin())
    t = load_file(layout.sample_path(run, sid, spec.shard_size))
    return SampleTensors(sid, t["input_ids"], t["loss_mask"], t["aux_hidden_states"], t["hidden_states"])


def table(results: list[Result]) -> str:
    base = next((r.rate for r in results if r.name == "forward only (padded)"), 0.0)
    rows = [f"{'variant':<42} {'tokens':>9} {'s':>7} {'tok/s':>9} {'GB/s':>6} {'x fwd':>6} {'RSS GB':>7} {'dev GB':>7}"]
    for r in results:
        ratio = f"{r.rate / base:6.2f}" if base and r.tokens else "     -"
        gbs = r.bytes / r.seconds / 1e9 if r.seconds else 0
        rows.append(
            f"{r.name:<42} {r.tokens:>9,} {r.seconds:>7.2f} {r.rate:>9,.0f} {gbs:>6.2f} {ratio} "
            f"{r.peak_rss / 1e9:>7.2f} {r.peak_device / 1e9:>7.2f}"
        )
    naive_r = next((r for r in results if r.name.startswith("naive")), None)
    for r in results:
        if r.name.startswith("hsx extract") and naive_r is not None and naive_r.rate:
            rows.append(f"{r.name} / naive: {r.rate / naive_r.rate:.2f}x")
    for r in results:
        if ", live consumer" in r.name:
            alone = next(x for x in results if x.name == r.name.split(", live consumer")[0] + ")")
            rows.append(
                f"{r.name} / without: {r.rate / alone.rate:.3f}x tok/s (a trainer in its own process reading, "
                "verifying and acknowledging every batch as it lands)"
            )
    for r in results:
        if r.waited_for_disk is not None:
            rows.append(f"{r.name}: the forward pass waited {r.waited_for_disk:.2f} s for the disk")
    for r in (r for r in results if r.checked is not None):
        tag = r.name.split(" (", 1)[1].removesuffix(")")
        fwd = next(x for x in results if x.name == f"forward only ({tag})")
        what = "checked" if r.name.startswith("fidelity") else "given their top-64"
        rows.append(
            f"{r.name}: {100 * r.seconds / fwd.seconds:.2f}% of the forward pass ({r.checked:,} of {r.tokens:,} "
            f"tokens {what}, every synthetic token masked; timed apart, on the same batches)"
        )
    for r in (r for r in results if r.every is not None):
        tag = r.name.removeprefix("shadow (").removesuffix(")")
        fwd = next(x for x in results if x.name == f"forward only ({tag})")
        per_token = fwd.rate / r.rate if r.rate else 0.0
        rows.append(
            f"{r.name}: {per_token:.2f}x the forward pass's time per token (the sample alone, eager, uncompiled, "
            f"compared; timed apart on {r.tokens:,} tokens); at 1 in {r.every} samples: "
            f"{100 * per_token / r.every:.3f}% of the forward pass"
        )
    moe = [r for r in results if r.expert_bytes is not None]
    unpacked = {r.name.split(" (")[0]: r for r in moe if ", int4 experts" not in r.name}  # forward only, hsx
    for packed in (r for r in moe if ", int4 experts" in r.name):
        dense = unpacked[packed.name.split(" (")[0]]
        rows.append(
            f"{packed.name} / dense experts: tok/s {packed.rate / dense.rate:.3f}x, routed-expert memory "
            f"{packed.expert_bytes / 1e9:.3f} / {dense.expert_bytes / 1e9:.3f} GB "
            f"= {packed.expert_bytes / dense.expert_bytes:.3f}x"
        )
    coded = [r for r in results if r.stored_ratio is not None and r.encode is not None]
    if coded:
        raw = next(r for r in coded if r.codec is Codec.RAW)
        n = raw.encode.threads
        rows.append(
            f"{'codec':<6} {'stored/raw':>10} {'tok/s':>9} {'x raw':>6} {'enc MB/s 1 core':>15} "
            f"{f'enc MB/s {n} thr':>15} {'per thr':>8} {'dec MB/s':>9} {'encoded on':>10}"
        )
        for r in coded:
            e = r.encode
            rows.append(
                f"{r.codec:<6} {r.stored_ratio:>10.4f} {r.rate:>9,.0f} {r.rate / raw.rate:>6.3f} "
                f"{e.encode_mbs:>15,.0f} {e.encode_mbs_n:>15,.0f} {e.encode_mbs_n / n:>8,.0f} {e.decode_mbs:>9,.0f} "
                f"{r.encoded_on or '-':>10}"
            )
        rows.append(pick(coded))
    return "\n".join(rows)


KEEPS_PACE = 0.97  # a codec worth its bytes here writes at >= this fraction of raw's tok/s


def pick(coded: list[Result]) -> str:
    """Which codec to choose on this machine, from the codec rows of one run: the fewest bytes among
    the lossless codecs that keep pace with raw (``KEEPS_PACE``), and fp8 beside it where it keeps
    pace too (lossy: its error bound must suit the trainer)."""
    raw = next(r for r in coded if r.codec is Codec.RAW)
    pace = [r for r in coded if r.codec is Codec.RAW or r.rate >= KEEPS_PACE * raw.rate]
    lossless = min((r for r in pace if r.codec is not Codec.FP8), key=lambda r: r.stored_ratio)
    text = f"pick here: --codec {lossless.codec} (lossless"
    if lossless is not raw:
        text += f", {lossless.stored_ratio:.3f}x raw's bytes at {lossless.rate / raw.rate:.3f}x its tok/s"
    text += ")"
    slow = [f"{r.codec} {r.rate / raw.rate:.3f}x" for r in coded if r not in pace]
    if slow:
        text += f"; under {KEEPS_PACE}x raw's tok/s: {', '.join(slow)}"
    fp8 = next((r for r in pace if r.codec is Codec.FP8), None)
    if fp8 is not None:
        text += f"; lossy: --codec fp8 keeps pace at {fp8.stored_ratio:.3f}x the bytes"
    return text
