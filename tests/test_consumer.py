"""hsx.consumer and hsx.data.StreamDataset: a trainer reads a run's verified samples as they land,
leases and acknowledges them under its name, and continues exactly where its checkpoint stood."""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from conftest import (
    HANG_GUARD_S,
    TINY,
    conversations,
    extract_args,
    flip_byte,
    hsx,
    require,
    write_jsonl,
)
from hsx.assess.status import assess, render
from hsx.consumer import NOT_WRITTEN, RankRecord, folder, inspect, read_acks
from hsx.data import HsxDataset, SamplesUnavailableWarning, StreamDataset, collate_packed, stream_batches
from hsx.errors import ConsumerRefused
from hsx.extract.options import ExtractOptions
from hsx.extract.window import Pause, WindowState, delete_released, read_state, released
from hsx.plan import Plan
from hsx.spec import Window, differences, load_spec
from hsx.store import layout

BUDGET = 300  # tokens a batch: the 40 samples make 13 batches


def stream(run: Path, name: str = "draft", **kw) -> StreamDataset:
    return StreamDataset(run, name, max_tokens=BUDGET, seed=7, poll=0.01, log=kw.pop("log", lambda _: None), **kw)


def consume(ds: StreamDataset, steps: int | None = None, first: int = 1) -> list[list[int]]:
    """Train ``steps`` batches (all by default), acknowledging each at its step; the ids of each."""
    out = []
    for step, batch in enumerate(ds, first):
        out.append(batch["sample_ids"].tolist())
        assert ds.ack(step) == out[-1]
        if len(out) == steps:
            break
    return out


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    shutil.copytree(finished_run, tmp_path / "run", ignore=shutil.ignore_patterns("consumers"))
    return tmp_path / "run"


def test_stream_serves_the_datasets_tensors_once_each_in_its_sequence_to_disjoint_ranks(run):
    plan = Plan(run)
    order = stream_batches(plan.lengths, 10, BUDGET, False, seed=7)
    assert sorted(i for b in order for i in b) == list(range(40))
    assert [min(b) // 10 for b in order] == sorted(min(b) // 10 for b in order)  # shard by shard
    assert [[min(b) // 10] * len(b) for b in order] == [[i // 10 for i in b] for b in order]  # never across shards
    offline = HsxDataset(run, verify=True)
    with stream(run, collate=collate_packed) as ds:
        assert len(ds) == len(order)
        for step, batch in enumerate(ds, 1):
            ids = batch["sample_ids"].tolist()
            assert ids == order[step - 1]
            assert ds.ack(step) == ids
            want = collate_packed([offline[i] for i in ids])
            assert want.keys() == batch.keys()
            assert all(torch.equal(want[k], batch[k]) for k in want)
    acks = read_acks(run, folder(run, "draft") / "acks-000000.jsonl").acks
    assert [a.ids for a in acks] == order and [a.step for a in acks] == list(range(1, len(order) + 1))
    # two ranks of another consumer: disjoint, every sample once, each its every other batch
    ranks = [stream(run, "pair", rank=r, ranks=2) for r in (0, 1)]
    got = [consume(ds) for ds in ranks]
    assert got == [order[0::2], order[1::2]]
    for ds in ranks:
        ds.close()
    views = {v.name: v for v in inspect(run)}
    assert views["draft"].acknowledged == views["pair"].acknowledged == set(range(40))
    assert views["pair"].step == len(order) // 2


def test_a_restart_continues_right_after_its_checkpoints_step_and_refuses_any_other(run):
    lines: list[str] = []
    ds = stream(run, log=lines.append)
    first = consume(ds, 5)
    ds.checkpointed(3)
    next(iter(ds))  # a sixth batch handed out, never acknowledged: leased
    assert inspect(run)[0].leased == set(ds.batches[5])
    ds.close()
    with pytest.raises(ConsumerRefused, match=r"never acknowledged step 6 \(acknowledged near it: 3, 4, 5\)"):
        stream(run, resume_step=6)
    with pytest.raises(ConsumerRefused, match="acknowledged steps up to 5: pass resume_step"):
        stream(run)
    with pytest.raises(ConsumerRefused, match=r"other parameters \(seed: 7 recorded, 8 asked\)"):
        StreamDataset(run, "draft", max_tokens=BUDGET, seed=8, resume_step=3)
    ds = stream(run, resume_step=3, log=lines.append)
    assert "steps 4..5 are rolled back (" in lines[-1] and lines[-1].endswith("samples are trained again)")
    rest = consume(ds, first=4)
    ds.close()
    assert first[:3] + rest == ds.batches  # nothing acknowledged twice, nothing leased lost
    acks = read_acks(run, folder(run, "draft") / "acks-000000.jsonl").acks
    assert [a.ids for a in acks] == ds.batches and [a.step for a in acks] == list(range(1, 14))


def acknowledged_twice(run: Path) -> None:
    """A consumer that trained two steps, acknowledged, then stopped."""
    ds = stream(run)
    consume(ds, 2)
    ds.close()


def test_a_torn_acknowledgement_is_no_acknowledgement_and_is_cut_off(run):
    acknowledged_twice(run)
    log = folder(run, "draft") / "acks-000000.jsonl"
    whole = log.read_bytes()
    log.write_bytes(whole + b'{"step": 3, "batches": 3, "ids": [1')  # a crash in the middle of the append
    with pytest.raises(ConsumerRefused, match="never acknowledged step 3"):
        stream(run, resume_step=3)
    ds = stream(run, resume_step=2)
    assert log.read_bytes() == whole and ds.position == 2
    ds.close()


def test_a_bad_file_is_waited_for_and_named_never_skipped(run):
    lines: list[str] = []
    ds = stream(run, log=lines.append)
    victim = ds.batches[0][0]
    path = run / "shards" / "000000" / f"{victim:09d}.safetensors"
    good = path.read_bytes()
    flip_byte(path, -3)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(next, iter(ds))
        try:
            deadline = time.monotonic() + HANG_GUARD_S
            while not any(f"sample {victim}" in line and "corrupt" in line for line in lines):
                assert time.monotonic() < deadline, "the damaged file was never named"
                time.sleep(0.01)
            while (
                waits := inspect(run)[0].ranks[0].record
            ).waiting_for is None:  # the head of the batch may be read first
                assert time.monotonic() < deadline, "the rank's record never said what it waits for"
                time.sleep(0.01)
            assert not first.done() and waits.waiting_for == victim and "corrupt" in waits.waiting_why
        finally:
            path.write_bytes(good)  # what hsx extract's repair writes back
        assert first.result()["sample_ids"].tolist() == ds.batches[0]
    ds.close()


def test_a_rank_held_elsewhere_is_taken_over_after_the_lease_timeout_and_its_leases_return(run):
    acknowledged_twice(run)
    record = folder(run, "draft") / "rank-000000.json"
    now = time.time()
    other = RankRecord(
        host="elsewhere", pid=1, pid_started=0, started=now, heartbeat=now, consumer="draft", leased=[1, 2]
    )
    record.write_text(other.model_dump_json())
    lines: list[str] = []
    ds = stream(run, resume_step=2, lease_timeout=0.5, log=lines.append)
    assert time.time() >= now + 0.5  # not before its heartbeat aged past the timeout
    assert lines[0].startswith("rank 0 of consumer draft: held by pid 1 on elsewhere, heartbeat ")
    assert lines[0].endswith("; waiting until it is 0.5s old (the lease timeout)")
    assert "2 samples leased by pid 1 on elsewhere" in lines[-1] and lines[-1].endswith("after the lease timeout")
    with pytest.raises(ConsumerRefused, match=rf"held by pid {os.getpid()} on {socket.gethostname()}"):
        stream(run, resume_step=2)  # alive on this host: refused at once
    ds.close()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid of this host that no longer lives
    dead = other.model_copy(update={"host": socket.gethostname(), "pid": gone.pid, "heartbeat": time.time()})
    record.write_text(dead.model_dump_json())
    ds = stream(run, resume_step=2, log=lines.append)  # no wait: the lease timeout is the default
    assert lines[-1].endswith("return to the stream as its process is gone") and f"pid {gone.pid}" in lines[-1]
    ds.close()


# ---------------------------------------------------------------- real faults: both sides killed -9, in both orders

TRAINER = Path(__file__).with_name("stream_trainer.py")


class Trainer:
    """``stream_trainer.py`` in a process of its own, its ``acked STEP`` lines read as they come."""

    def __init__(self, run: Path, ckpt: Path, name: str, *args: str, env: dict | None = None):
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {})
        cmd = [sys.executable, str(TRAINER), str(run), str(ckpt), name, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def acked(self) -> int:
        return sum(line.startswith("acked ") for line in list(self.lines))

    def kill_after(self, acks: int) -> None:
        """SIGKILL once it acknowledged ``acks`` steps (a progress point, never a clock)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.acked() < acks:
            assert self.proc.poll() is None, f"the trainer ended before {acks} steps: {''.join(self.lines)}"
            assert time.monotonic() < deadline, f"no step for {HANG_GUARD_S}s: {''.join(self.lines)}"
            time.sleep(0.005)
        self.proc.kill()
        self.proc.wait(timeout=HANG_GUARD_S)

    def finish(self) -> str:
        self.proc.wait(timeout=HANG_GUARD_S)
        self.reader.join()
        out = "".join(self.lines)
        assert self.proc.returncode == 0 and out.endswith("done\n"), out
        return out


class DiskPoll:
    """The bytes of sample files on disk that the run's window waits for (some consumer it names has
    not released them: not acknowledged at a step that rank's own checkpoint covers), looked at
    every 50 ms on a thread of its own; ``peak`` is the largest seen. The files are listed before
    the records are read, so a release in between can only lower a look, never raise it."""

    def __init__(self, run: Path, names: list[str]):
        self.run, self.names, self.peak, self.largest = run, names, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> DiskPoll:
        self._thread.start()
        return self

    def _look(self) -> None:
        files = {}
        for shard in os.scandir(self.run / "shards") if (self.run / "shards").exists() else []:
            for e in os.scandir(shard.path):
                if (sid := layout.parse_sample_name(e.name)) is not None:
                    try:
                        files[sid] = e.stat().st_size
                    except FileNotFoundError:  # deleted once released, between the listing and its stat
                        pass
        by_name = {v.name: v.released for v in inspect(self.run)}
        done = set.intersection(*(by_name.get(n, set()) for n in self.names))
        self.peak = max(self.peak, sum(b for sid, b in files.items() if sid not in done))
        self.largest = max([self.largest, *files.values()])

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self._look()

    def stop(self) -> int:
        """Stop polling; the documented bound: the window (its --window-limit, where it has one), a
        whole shard and the two batches in flight."""
        self._stop.set()
        self._thread.join()
        spec = load_spec(self.run)
        return spec.window.pause_at + spec.shard_size * self.largest + 2 * spec.batch_tokens * spec.bytes_per_token


def extractor(*args) -> subprocess.Popen:
    """``hsx ARGS`` in a process of its own, its output dropped."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hsx", *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_on_progress(out: Path, proc: subprocess.Popen, k: int) -> None:
    """SIGKILL an extraction of ``out`` once it wrote k more files, or waits at its window (progress
    points)."""
    before = set((out / "shards").rglob("*.safetensors"))
    deadline = time.monotonic() + HANG_GUARD_S
    while len(set((out / "shards").rglob("*.safetensors")) - before) < k:
        state = read_state(out)
        if state is not None and state.pid == proc.pid and state.paused_since is not None:
            break
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    proc.kill()
    proc.wait(timeout=HANG_GUARD_S)


def test_trainer_and_extractor_killed_9_in_both_orders_train_the_sequence_of_an_uninterrupted_stream(
    tmp_path, finished_run
):
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40, start=40))  # finished_run's 40 are held out
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    ckpt.mkdir()

    window = ("--window", "0.0003", "--consumer", "draft", "--delete-released")  # about 4 samples of 40
    producer = extractor(*extract_args(data, out, *window))
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / "hsx.json").exists():  # a consumer reads a run, which exists once its spec does
        assert producer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    disk = DiskPoll(out, ["draft"]).start()  # the window's bound holds throughout, resumes included
    trainer = Trainer(out, ckpt, "draft")
    trainer.kill_after(1)  # the consumer first, mid-stream
    kill_on_progress(out, producer, 2)  # then the producer, mid-batch (or as it waits at its window)
    producer, trainer = extractor("extract", "--out", out), Trainer(out, ckpt, "draft")
    kill_on_progress(out, producer, 2)  # the producer first
    producer = extractor("extract", "--out", out)
    trainer.kill_after(1)  # then the consumer
    trainer = Trainer(out, ckpt, "draft")
    assert producer.wait(timeout=HANG_GUARD_S) == 0
    trainer.finish()
    bound = disk.stop()
    assert 0 < disk.peak <= bound, (disk.peak, bound)
    # the reference: the sequence an uninterrupted stream of the same seed gives (hsx.data.stream_batches,
    # which the first test checks against what a stream hands out)
    sequence = [i for b in stream_batches(Plan(out).lengths, 10, BUDGET, False, seed=7) for i in b]
    final = load_file(ckpt / "final.safetensors")
    trained = final["trained0"].tolist()
    assert trained == sequence and sorted(trained) == list(range(40))
    acks = read_acks(out, folder(out, "draft") / "acks-000000.jsonl").acks
    assert [i for a in acks for i in a.ids] == sequence and [a.step for a in acks] == list(range(1, len(acks) + 1))
    report = assess(out, deep=True)
    line = report.get("consumers")
    assert report.exit_code == 0 and line.level == "ok"
    assert line.details[0].startswith(f"draft: finished, 40/40 acknowledged through step {len(acks)}, 0 leased")
    progress = report.get("progress").data  # what was deleted once released: consumed, never missing
    assert progress["samples_done"] == 40 and progress["consumed"] > 0
    # what it learned is in the states: on held-out samples it beats the same head fed shuffled states
    head = torch.nn.Linear(final["weight"].shape[1], final["weight"].shape[0])
    head.load_state_dict({"weight": final["weight"], "bias": final["bias"]})
    g = torch.Generator().manual_seed(0)
    hits = {"real": [0, 0], "shuffled": [0, 0]}
    held_out = HsxDataset(finished_run)
    with torch.no_grad():
        for i in range(len(held_out)):
            s = held_out[i]
            x, y, mask = s["aux_hidden_states"][:-1].float(), s["input_ids"][1:], s["loss_mask"][1:].bool()
            for kind, states in (("real", x), ("shuffled", x[torch.randperm(len(x), generator=g)])):
                hits[kind][0] += int((head(states).argmax(-1)[mask] == y[mask]).sum())
                hits[kind][1] += int(mask.sum())
    real, control = (hits[k][0] / hits[k][1] for k in ("real", "shuffled"))
    assert real > 2 * control, (real, control)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_ranks_over_gloo_in_the_documented_loop_train_each_sample_once_after_one_dies(tmp_path, finished_run):
    """Two DistributedDataParallel ranks (gloo) step together in docs/streaming.md's loop (ack, a
    barrier, rank 0 saves, a barrier, every rank declares) beside a deleting window. One rank is
    killed -9: status fails naming it (the window waits for it: the extraction pauses anyway); its
    partner, blocked at the next collective, is stopped too and the group restarted from the last
    checkpoint, as torchrun does. Each rank trains its sequence once, the disk stays within the
    window's bound, and every file is deleted once both ranks' own checkpoints cover it."""
    lengths = Plan(finished_run).lengths  # the same 40 conversations: a budget that gives both ranks as many steps
    budget = next(b for b in range(300, 600, 4) if len(stream_batches(lengths, 10, b, False, seed=7)) % 2 == 0)
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    ckpt.mkdir()
    window = ("--window", "0.0003", "--consumer", "ddp", "--delete-released")
    cmd = [sys.executable, "-m", "hsx", *map(str, extract_args(data, out, *window))]
    producer = subprocess.Popen(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / "hsx.json").exists():
        assert producer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    disk = DiskPoll(out, ["ddp"]).start()

    def group() -> list[Trainer]:
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        return [Trainer(out, ckpt, "ddp", "--max-tokens", str(budget), env=env | {"RANK": str(r)}) for r in (0, 1)]

    ranks = group()
    try:
        ranks[1].kill_after(3)  # after the checkpoint of step 2
        while "ddp rank 1 dead" not in (line := assess(out).get("consumers")).figure:
            assert time.monotonic() < deadline, line.figure
            time.sleep(0.05)
        assert assess(out).exit_code == 2
        ranks[0].proc.kill()
        ranks[0].proc.wait(timeout=HANG_GUARD_S)
        ranks = group()
        for t in ranks:
            t.finish()
        assert producer.wait(timeout=HANG_GUARD_S) == 0
    finally:
        for t in ranks:
            t.proc.kill()
        producer.kill()
    bound = disk.stop()
    assert 0 < disk.peak <= bound, (disk.peak, bound)
    order = stream_batches(Plan(out).lengths, 10, budget, False, seed=7)
    final = load_file(ckpt / "final.safetensors")
    for r in (0, 1):  # the trainer's own record of what each rank trained: its sequence, once
        assert final[f"trained{r}"].tolist() == [i for b in order[r::2] for i in b]
        acks = read_acks(out, folder(out, "ddp") / f"acks-{r:06d}.jsonl").acks
        assert [a.ids for a in acks] == order[r::2]
    hsx("extract", "--out", out)  # what the last checkpoint released after the extraction ended
    report = assess(out, deep=True)
    assert report.exit_code == 0 and report.get("progress").data["consumed"] == 40


# ---------------------------------------------------------------- a real trainer's own loop


def test_speculators_trains_an_eagle3_draft_in_its_own_loop_on_a_live_run(tmp_path, finished_run, monkeypatch):
    """speculators' ``Trainer`` (its loop, optimizer, checkpointer, logged metrics) reads a run being
    extracted through ``StreamDataset`` with speculators' own ``CollateFn``; it acknowledges each
    optimizer step through its ``step_callback`` and declares each checkpoint it saves. Shims, for
    a CPU only: the device (``get_local_rank``, no accelerator to synchronize) and the eager loss.
    The bundled model's final norm has unit weight, so its post-norm state is its norm's own fixed
    point: speculators' ``verifier_norm`` of it gives the target's lm_head input back (checked).
    (On the bundled random target a few steps learn no more than the tokens' frequencies; the
    held-out control of a draft trained in speculators' loop from a live run is in test_controls,
    on a target whose predictions depend on context.)"""
    require("speculators")
    import speculators.train.trainer as sp
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from torch.utils.data import DataLoader
    from transformers import AutoConfig

    monkeypatch.setattr(sp, "get_local_rank", lambda: "cpu")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(20, start=40))
    out = tmp_path / "run"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    producer = subprocess.Popen([sys.executable, "-m", "hsx", *map(str, extract_args(data, out))], env=env)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / "hsx.json").exists():
        assert producer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    collate = CollateFn(512, 64, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)

    def batch(samples: list[dict]) -> dict:
        """speculators' samples (as its BaseDataset gives them) from hsx's."""
        return collate(
            [
                {
                    "hidden_states": s["aux_hidden_states"],
                    "verifier_last_hidden_states": s["hidden_states"],
                    "input_ids": s["input_ids"],
                    "loss_mask": s["loss_mask"],
                    "lengths": torch.tensor([len(s["input_ids"])]),
                    "position_ids": torch.arange(len(s["input_ids"])),
                }
                for s in samples
            ]
        )

    tiny = AutoConfig.from_pretrained(TINY)
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        tiny, verifier_name_or_path=str(TINY), num_layers=1, draft_vocab_size=2048, norm_before_residual=True,
        ttt_steps=2, target_layer_ids=[2, 4, 5], draft_attn_impl="eager",
    )  # fmt: skip
    train_kw, val_kw = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", ttt_steps=2, ttt_step_loss_decay=1.0, loss_implementation="eager"
    )
    stream = StreamDataset(out, "eagle3", max_tokens=512, packed=True, seed=0, collate=batch, log=lambda _: None)
    config = sp.TrainerConfig(
        lr=1e-2, num_epochs=1, save_path=str(tmp_path / "ckpt"), train_call_kwargs=train_kw, val_call_kwargs=val_kw,
        hidden_states_dtype=torch.float32, scheduler_type="none", checkpoint_freq=0.25, log_freq=1,
    )  # fmt: skip

    class Streaming(sp.Trainer):
        """Declares each checkpoint its own checkpointer saved (the one hook a stream needs)."""

        def maybe_save_checkpoint(self, epoch, local_step=0):
            super().maybe_save_checkpoint(epoch, local_step)
            stream.checkpointed(self.global_step)

    logged: list[dict] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.msg)
    logging.getLogger("speculators.metrics").addHandler(handler)
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    trainer = Streaming(model, config, DataLoader(stream, batch_size=None))
    trainer.device_type = "cpu"
    try:
        trainer.train_epoch(0, step_callback=lambda: stream.ack(trainer.global_step))
    finally:
        logging.getLogger("speculators.metrics").removeHandler(handler)
    stream.close()
    assert producer.wait(timeout=HANG_GUARD_S) == 0
    acks = read_acks(out, folder(out, "eagle3") / "acks-000000.jsonl").acks
    assert trainer.global_step == len(stream) == len(acks) and [a.step for a in acks] == list(range(1, len(acks) + 1))
    assert [a.ids for a in acks] == stream.batches and sorted(i for a in acks for i in a.ids) == list(range(20))
    assert 0 < inspect(out)[0].checkpoint.step < len(acks)  # a mid-stream checkpoint was declared
    losses = [m["train"]["loss"] for m in logged]
    assert len(losses) == len(acks) and losses[-1] < losses[0]  # its own logged steps, one per batch
    with torch.no_grad():
        post = HsxDataset(out)[0]["hidden_states"]
        assert torch.allclose(model.verifier_norm(post), post, atol=1e-5)


# ---------------------------------------------------------------- the producer's window


def test_a_batch_larger_than_the_window_is_written_alone_and_the_pause_names_whom_it_waits_for(tmp_path):
    """A window of one byte: every batch is larger. With nothing held a batch goes (it waited forever,
    silently: no release could make room for it, and window.json named no consumer); then the
    extraction pauses for the consumer that has released nothing, named in its log, window.json and
    status."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40))
    out, log = tmp_path / "run", tmp_path / "extract.log"
    cmd = [sys.executable, "-m", "hsx", *map(str, extract_args(data, out, "--window", "1e-9", "--consumer", "draft"))]
    with open(log, "w") as err:
        producer = subprocess.Popen(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while (state := read_state(out)) is None or state.paused_since is None:
            assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        said = log.read_text()
        assert "is larger than the window (1 B); each such batch is written alone" in said, said
        assert state.waiting_for == ["draft"] and "window: paused, " in said and "not released by draft" in said
        assert state.held > 0 and list((out / "shards").rglob("*.safetensors"))
        line = assess(out).get("consumers").figure
        assert "the extractor waits since " in line and line.endswith(" for draft"), line
    finally:
        producer.kill()
        producer.wait()


def test_a_stalled_consumer_pauses_the_extraction_at_its_window_and_its_releases_let_it_go_on(tmp_path):
    """With --delete-released, released files are deleted (recorded consumed first): status, the
    dataset and a resume count them done, never missing or to be redone; what the trainer released
    after the extraction's last batch is deleted by the resume of the finished run."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40, start=40))
    out, log = tmp_path / "run", tmp_path / "extract.log"
    window = 300_000  # bytes: a few of the tiny model's samples (about 70 kB each), a shard is about 0.7 MB
    window_args = ("--window", "0.0003", "--consumer", "draft", "--delete-released")
    cmd = [sys.executable, "-m", "hsx", *map(str, extract_args(data, out, *window_args))]
    with open(log, "w") as err:
        producer = subprocess.Popen(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=err, stderr=err)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / "hsx.json").exists():
        assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    assert load_spec(out).window == Window(bytes=window, consumers=["draft"], delete=True)
    disk = DiskPoll(out, ["draft"]).start()
    ds = stream(run=out)
    batches = iter(ds)
    for step in (1, 2):  # two steps, each checkpointed: released
        next(batches)
        ds.ack(step)
        ds.checkpointed(step)
    # then it stalls, alive: the extraction fills the window and waits, logged and in status
    while (state := read_state(out)) is None or state.paused_since is None:
        assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    assert "window: paused, " in log.read_text() and "not released by draft" in log.read_text()
    written = list((out / "shards").rglob("*.safetensors"))
    # the window, what a waiting reader got (at most a whole shard: the folders on disk may hold less,
    # released files deleted, the last one being written), and the two batches in flight at a pause
    # (the one the fidelity check holds back, and the next, decided before it was written)
    spec = load_spec(out)
    shard_bytes = spec.shard_size * max(p.stat().st_size for p in written)
    in_flight = 2 * spec.batch_tokens * spec.bytes_per_token
    assert len(written) < 40 and state.held <= window + shard_bytes + in_flight
    line = assess(out).get("consumers")
    assert "for draft; the extractor waits since " in line.figure, line.figure
    for step, _ in enumerate(batches, 3):  # it goes on: each step released a step later, the extraction follows
        ds.ack(step)
        ds.checkpointed(step - 1)
    assert producer.wait(timeout=HANG_GUARD_S) == 0, log.read_text()
    bound = disk.stop()
    assert 0 < disk.peak <= bound, (disk.peak, bound)
    assert "window: goes on after " in log.read_text()
    report = assess(out)
    assert report.exit_code == 0 and "the extractor waits" not in report.get("consumers").figure
    other = Window(bytes=10**9, consumers=["draft"])  # a resume asking another window is refused by name
    assert differences(load_spec(out), {"window": other}) == [
        "window: run has 300.0 kB for draft, deleting released files, asked for 1.0 GB for draft"
    ]
    # the deleted files: consumed, never missing, never redone
    left = {p.name for p in (out / "shards").rglob("*.safetensors")}
    progress = report.get("progress").data
    assert len(left) < 40 and progress["samples_done"] == 40 and progress["consumed"] == 40 - len(left)
    assert assess(out, deep=True).exit_code == 0
    with pytest.warns(SamplesUnavailableWarning, match=f"{40 - len(left)} consumed"):
        assert len(HsxDataset(out)) == len(left)
    with pytest.raises(ConsumerRefused, match="consumer late would wait for them forever"):
        StreamDataset(out, "late")  # a consumer the window never waited for: its samples may be gone
    # the last step, released once the extraction ended: its files, and any released after the
    # extraction's own last look, are deleted by the resume of the finished run (with Ray workers:
    # their driver sweeps as one process does)
    ds.checkpointed(step)
    ds.close()
    resume = hsx("extract", "--out", out, "--workers", "1")
    assert "40/40 done, 0 written now" in resume.stdout, resume.stdout
    assert f"window: deleted {len(left)} released files, recorded consumed" in resume.stderr, resume.stderr
    assert not list((out / "shards").rglob("*.safetensors"))
    report = assess(out, deep=True)
    assert report.exit_code == 0 and report.get("progress").data["consumed"] == 40


def test_window_limit_lets_a_lagging_trainer_hold_more_than_the_window_up_to_the_limit_said_and_recorded(tmp_path):
    """--window-limit: a trainer that acknowledges a step and never declares a checkpoint releases
    nothing. Without the option the extraction pauses at its window; with it, it goes on past the
    window (said once in the log, with the numbers), up to the limit, and pauses there; the disk,
    polled throughout, holds more than the window and stays within the limit's bound. The spec
    records the limit; status warns (exit 0, never "nothing wrong") by how much the run is past its
    window; a resume keeps the limit (it pauses at it again), and one asking another is refused."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(40, start=100))
    out, log = tmp_path / "run", tmp_path / "extract.log"
    window = ("--window", "0.0003", "--window-limit", "0.0009", "--consumer", "draft")

    def produce(*args: str) -> subprocess.Popen:
        with open(log, "a") as err:
            cmd = [sys.executable, "-m", "hsx", *map(str, args)]
            return subprocess.Popen(
                cmd, env=os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}, stdout=err, stderr=err
            )

    def paused(producer: subprocess.Popen) -> WindowState:
        while (state := read_state(out)) is None or state.pid != producer.pid or state.paused_since is None:
            assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        return state

    producer = produce(*extract_args(data, out, *window))
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / "hsx.json").exists():
        assert producer.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    assert load_spec(out).window == Window(bytes=300_000, consumers=["draft"], limit=900_000)
    disk = DiskPoll(out, ["draft"]).start()
    ds = stream(out)
    next(iter(ds))
    ds.ack(1)  # and no checkpointed: it releases nothing
    try:
        state = paused(producer)
        said = log.read_text()
        assert said.count("window: past its window, ") == 1, said
        assert re.search(r"window: past its window, [\d.]+ kB of samples not released by draft \(window 300\.0 kB\); "
                         r"going on while they lag, up to 900\.0 kB \(--window-limit\)", said), said  # fmt: skip
        assert "(window 300.0 kB, up to 900.0 kB by --window-limit); waiting for them to release" in said, said
        assert state.limit == 900_000 and state.past_since is not None and state.held > 300_000
        assert len(list((out / "shards").rglob("*.safetensors"))) < 40
    finally:
        producer.terminate()
        producer.wait(timeout=HANG_GUARD_S)
    bound = disk.stop()
    assert 300_000 < disk.peak <= bound, (disk.peak, bound)
    line = assess(out).get("consumers")
    assert line.level == "warn" and "past its window by " in line.figure, line
    assert line.figure.endswith(" (allowed up to 900.0 kB by --window-limit)"), line.figure
    assert line.data["window"]["past_by"] == line.data["window"]["held"] - 300_000 > 0
    printed = io.StringIO()
    report = assess(out)
    render(report, Console(file=printed, width=200))
    last = printed.getvalue().splitlines()[-1]
    assert report.exit_code == 0 and "nothing wrong" not in printed.getvalue(), printed.getvalue()
    assert last.startswith("exit 0: nothing to repair; warnings: ") and "consumers" in last, last
    producer = produce("extract", "--out", out)  # the resume keeps the limit: paused at it again
    try:
        paused(producer)
        assert log.read_text().count("up to 900.0 kB by --window-limit); waiting for them to release") == 2
    finally:
        producer.terminate()
        producer.wait(timeout=HANG_GUARD_S)
    ds.close()
    other = ExtractOptions(out=out, window=0.0003, window_limit=0.002, consumer=["draft"]).window_asked()
    assert differences(load_spec(out), {"window": other}) == [
        "window: run has 300.0 kB for draft, past it up to 900.0 kB while they lag, asked for 300.0 kB for draft, "
        "past it up to 2.0 MB while they lag"
    ]


def test_a_resume_of_an_extractor_killed_mid_shard_first_finishes_the_shard_a_consumer_waits_on(tmp_path):
    """An extractor killed -9 at its window's pause, mid-shard, while its trainer stalls; the trainer
    goes on, trains what is there and waits for a sample of that shard; then the resume. It wrote
    the shards no one reads yet first and that shard last, and the waiting consumer lifted the pause
    for all of them: the disk went past the window's bound. Now it finishes that shard first, the
    disk (polled throughout) stays within the bound, and the trainer trains every sample once."""
    data = write_jsonl(tmp_path / "convs.jsonl", conversations(60, start=40))
    out = tmp_path / "run"
    small = ("--shard-size", "10", "--batch-tokens", "128", "--writers", "2", "--device", "cpu", "--codec", "raw")
    window = ("--window", "0.0005", "--consumer", "draft")
    cmd = [sys.executable, "-m", "hsx", "extract", "--model", TINY, "--data", data, "--out", out, *small, *window]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    producer = subprocess.Popen(list(map(str, cmd)), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (out / "hsx.json").exists():
        assert producer.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    disk = DiskPoll(out, ["draft"]).start()
    ds = stream(out)
    batches = iter(ds)
    for step in (1, 2):
        next(batches)
        ds.ack(step)
        ds.checkpointed(step)

    def files() -> list[int]:
        return sorted(i for p in (out / "shards").rglob("*") if (i := layout.parse_sample_name(p.name)) is not None)

    def in_last_shard() -> int:
        return len([i for i in files() if i // 10 == files()[-1] // 10])

    # killed at its pause, or once it wrote into the second shard (progress points), mid-shard: where
    # the pause fell at a shard's end, the trainer takes a step more (its release lets the producer on)
    step, seen, released_at = 2, 0, time.time()

    def a_step_more() -> None:
        nonlocal step, released_at
        step += 1
        next(batches)
        ds.ack(step)
        ds.checkpointed(step)
        released_at = time.time()

    while True:
        while len(files()) <= seen or (
            ((state := read_state(out)) is None or state.paused_since is None) and len(files()) < 13
        ):
            assert producer.poll() is None and time.monotonic() < deadline
            # paused at a shard's end, it looked again after the step's release and still holds more
            # than its window, nothing new written: a step more (one step did not always free enough)
            if seen and len(files()) <= seen and (now := read_state(out)) and now.paused_since and now.t > released_at:
                a_step_more()
            time.sleep(0.005)
        producer.send_signal(signal.SIGSTOP)
        if in_last_shard() < 10:
            break
        seen = len(files())
        producer.send_signal(signal.SIGCONT)
        a_step_more()
    producer.kill()
    producer.wait(timeout=HANG_GUARD_S)
    partial = files()[-1] // 10
    assert 0 < in_last_shard() < 10, files()  # killed mid-shard

    def train() -> None:
        for n, _ in enumerate(batches, step + 1):
            ds.ack(n)
            ds.checkpointed(n)

    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(train)
        while (rec := inspect(out)[0].ranks[0].record).waiting_why != NOT_WRITTEN or rec.waiting_for // 10 != partial:
            assert not trainer.done() and time.monotonic() < deadline, rec
            time.sleep(0.01)
        resume = subprocess.run(
            [sys.executable, "-m", "hsx", "extract", "--out", str(out)], env=env, capture_output=True, text=True
        )
        assert resume.returncode == 0, resume.stderr
        trainer.result(timeout=HANG_GUARD_S)
    bound = disk.stop()
    assert 0 < disk.peak <= bound, (disk.peak, bound)
    acks = read_acks(out, folder(out, "draft") / "acks-000000.jsonl").acks
    assert [a.ids for a in acks] == ds.batches and sorted(i for a in acks for i in a.ids) == list(range(60))
    ds.close()


# ---------------------------------------------------------------- ranks, reads and status


def test_each_rank_releases_only_what_its_own_checkpoint_covers_and_declares_only_steps_it_acknowledged(run):
    """Two ranks stepping apart: rank 0 saved step 3, rank 1 only step 1. One checkpoint for the
    consumer let rank 0's release rank 1's steps 2-3, which rank 1's restart from step 1 must train
    again (a deleting window deleted them: it waited forever). A rank declaring a checkpoint of a
    step it has not acknowledged (saved by another rank before its own ack: the docs' loop needs
    the barrier) is refused, since it could not resume from it."""
    ranks = [stream(run, "pair", rank=r, ranks=2) for r in (0, 1)]
    got = [consume(ds, 3) for ds in ranks]
    with pytest.raises(ConsumerRefused, match=r"declares a checkpoint of step 4, which it has not acknowledged \(last"):
        ranks[1].checkpointed(4)
    ranks[0].checkpointed(3)
    ranks[1].checkpointed(1)
    saved = {i for b in got[0] for i in b} | set(got[1][0])
    assert inspect(run)[0].released == saved
    assert released(Window(bytes=1, consumers=["pair"]), inspect(run)) == saved
    assert inspect(run)[0].checkpoint.step == 1  # the step every rank's checkpoint covers
    ranks[1].close()
    again = stream(run, "pair", rank=1, ranks=2, resume_step=1)  # what it did not save is trained again
    assert consume(again, first=2) == again.batches[1:]
    again.close()
    ranks[0].close()


def test_a_sample_being_read_is_not_one_not_written_and_a_wait_lifts_the_pause_for_its_shard_alone(run, monkeypatch):
    """The window's pause lets through the shard a consumer waits on (a file not there). A read in
    progress (slow storage) was recorded as 'not written yet' and lifted every pause; now it is
    'being read' and lifts none; a wait for a file of shard 0 lifts the pause for shard 0 only."""
    import hsx.data

    ds = stream(run)
    head = ds.batches[0][0]
    opened, go = threading.Event(), threading.Event()
    real = hsx.data.load_sample

    def slow(run_, path, sid, *args):
        if sid == head:
            opened.set()
            assert go.wait(HANG_GUARD_S)
        return real(run_, path, sid, *args)

    monkeypatch.setattr(hsx.data, "load_sample", slow)
    window = Window(bytes=1, consumers=["draft"])

    def fits(shard: int) -> bool:
        return Pause(run, window, 10, lambda _: None, lambda: (shard, set()))._fits(1)[0]

    def waits(why: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while (rec := inspect(run)[0].ranks[0].record).waiting_for != head or rec.waiting_why != why:
            assert time.monotonic() < deadline, rec
            time.sleep(0.01)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(next, iter(ds))
        try:
            assert opened.wait(HANG_GUARD_S)
            waits("being read")
            assert not fits(0) and not fits(1)
        finally:
            go.set()
        assert first.result()["sample_ids"].tolist() == ds.batches[0]
    ds.close()
    path = layout.sample_path(run, ds.batches[1][0], 10)
    body = path.read_bytes()
    path.unlink()
    ds = stream(run, resume_step=0)
    head = ds.batches[1][0]
    it = iter(ds)
    next(it)
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(next, it)
        waits(NOT_WRITTEN)
        assert fits(0) and not fits(1)  # its shard's batches go through; no other shard's
        assert Pause(run, window, 10, lambda _: None, lambda: (1, {head}))._fits(1)[0]  # held back past the gate
        path.write_bytes(body)
        assert second.result()["sample_ids"].tolist() == ds.batches[1]
    ds.close()


def test_status_fails_on_a_dead_rank_a_corrupt_or_deleted_sample_waited_for_and_names_a_dead_trainer(run):
    """Each thing that keeps a consumer from finishing fails the consumers line, with its exit code
    (a corrupt sample: 1, hsx extract redoes it, and a resume is offered; else 2), never 'nothing
    wrong'. A rank whose process died is taken over as a dead trainer's, not an extractor's."""
    ds = stream(run, "pair", rank=0, ranks=2)
    consume(ds, 1)
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead.kill()
    dead.wait()
    record = folder(run, "pair") / "rank-000001.json"
    now = time.time()
    left = RankRecord(host=socket.gethostname(), pid=dead.pid, pid_started=now, started=now, heartbeat=now)
    record.write_text(left.model_copy(update={"consumer": "pair", "rank": 1, "leased": [1]}).model_dump_json())
    report = assess(run)
    line = report.get("consumers")
    assert report.exit_code == 2 and line.level == "fail" and "pair rank 1 dead" in line.figure, line.figure
    assert line.action.startswith("restart the trainer from its last checkpoint")
    lines: list[str] = []
    other = stream(run, "pair", rank=1, ranks=2, log=lines.append)
    assert lines[0].startswith(
        f"taking over a lock left by a dead trainer (rank 1 of consumer pair: held by pid {dead.pid} "
    )
    other.close()
    ds.close()
    shutil.rmtree(folder(run, "pair"))
    # a corrupt sample the trainer waits for: hsx extract redoes it (exit 1, and a resume is offered)
    ds = stream(run)
    victim = layout.sample_path(run, ds.batches[0][0], 10)
    good = victim.read_bytes()
    flip_byte(victim, -3)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(next, iter(ds))
        try:
            deadline = time.monotonic() + HANG_GUARD_S
            while "does not verify" not in (line := assess(run).get("consumers")).figure:
                assert time.monotonic() < deadline, line.figure
                time.sleep(0.01)
            report = assess(run)
            assert report.exit_code == 1 and report.resume is not None
            assert not any("nothing to resume" in n for n in report.next), report.next
            action = report.get("consumers").action
            assert action == f"hsx extract --out {run} redoes it (the trainer goes on once it verifies)"
        finally:
            victim.write_bytes(good)
        first.result()
    # a sample deleted as consumed (released by the consumers a deleting window names): refused, and status says so
    ds.ack(1)
    gone = ds.batches[1]
    assert delete_released(run, set(gone), 10) == len(gone)
    with ThreadPoolExecutor(1) as pool, pytest.raises(ConsumerRefused, match="was deleted as consumed") as refused:
        pool.submit(next, iter(ds)).result(timeout=HANG_GUARD_S)
    assert int(re.search(r"sample (\d+) was deleted", str(refused.value)).group(1)) in gone
    report = assess(run)
    line = report.get("consumers")  # the sample the rank's record names: the last of its reads refused
    waits = re.search(r"draft rank 0 waits for sample (\d+), deleted as consumed", line.figure)
    assert report.exit_code == 2 and waits and int(waits.group(1)) in gone, line.figure
    ds.close()
