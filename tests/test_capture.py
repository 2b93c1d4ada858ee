"""Captured states against an independent reference: transformers' own output_hidden_states."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from conftest import TINY, conversations
from hsx.capture import default_layers
from hsx.capture.locate import UnsupportedModel, locate
from hsx.capture.transformers import TransformersBackend
from hsx.input import Source, normalize
from hsx.plan import Tokenize, batches_for
from hsx.target import load_tokenizer

LAYERS = [0, 1, 3, 5, 6]  # hsx ids; the last layer (7) is checked separately: HF stores it normed
TOL = 1e-5


@pytest.fixture(scope="module")
def samples():
    tok = load_tokenizer(TINY, False)
    tokenize = Tokenize(tok, 4096)
    return [tokenize(normalize(r, Source("f", i, ""))).samples[0] for i, r in enumerate(conversations(12, start=100))]


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()

    def run(ids):
        with torch.no_grad():
            out = model(torch.from_numpy(ids.astype("int64"))[None], output_hidden_states=True)
        return [h[0] for h in out.hidden_states]

    return run


def _check(batch, ref_states, i, n, layers):
    h = ref_states[0].shape[-1]
    aux, final = batch.sample(i)
    assert aux.shape[0] == final.shape[0] == n
    for j, k in enumerate(layers):
        assert (aux[:, j * h : (j + 1) * h] - ref_states[k + 1]).abs().max().item() <= TOL, f"layer {k}"
    assert (final - ref_states[-1]).abs().max().item() <= TOL


def test_one_sample_per_batch_equals_reference(samples, reference):
    backend = TransformersBackend.load(TINY, LAYERS, "float32", "cpu")
    for i, s in enumerate(samples[:4]):
        batch = backend.capture([i], [s.input_ids])
        _check(batch, reference(s.input_ids), 0, len(s.input_ids), LAYERS)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_length_sorted_multi_sample_batches_equal_reference(samples, reference, packed):
    backend = TransformersBackend.load(TINY, LAYERS, "float32", "cpu", packed=packed)
    lengths = [len(s.input_ids) for s in samples]
    batches = batches_for(range(len(samples)), lengths, budget=4 * max(lengths), packed=packed)
    assert any(len(b.ids) > 1 and len({lengths[i] for i in b.ids}) > 1 for b in batches)
    for b in batches:
        batch = backend.capture(list(b.ids), [samples[i].input_ids for i in b.ids])
        expect = (1, sum(lengths[i] for i in b.ids)) if packed else (len(b.ids), b.max_len)
        assert batch.aux.shape[:2] == expect
        for row, i in enumerate(b.ids):
            _check(batch, reference(samples[i].input_ids), row, lengths[i], LAYERS)


def test_last_layer_is_captured_before_the_norm(samples, reference):
    backend = TransformersBackend.load(TINY, [7], "float32", "cpu")
    s = samples[0]
    batch = backend.capture([0], [s.input_ids])
    ref = reference(s.input_ids)
    norm = backend.parts.norm
    assert (norm(batch.aux[0]) - ref[8]).abs().max().item() <= TOL  # HF's last entry is after the norm
    assert (batch.aux[0] - ref[8]).abs().max().item() > 1e-2  # so the raw output must differ from it


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_compiled_layout_is_first_traced_on_the_canonical_batches(samples, packed, monkeypatch):
    """A dynamic-shape graph's kernels are configured from the sizes of the batch it was first
    traced on; so, whatever batch comes first (a resume starts elsewhere in the plan), a compiled
    layout's first forward runs the canonical batches first, and only once."""
    from hsx.capture.transformers import WARM_UP_LENGTHS

    backend = TransformersBackend.load(TINY, LAYERS, "float32", "cpu", packed=packed)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the order of traces is the point here
    backend.set_compiled(True)
    shapes, body = [], backend.parts.body
    backend.parts.body = lambda **kw: shapes.append(tuple(kw["input_ids"].shape)) or body(**kw)
    first, second = samples[0].input_ids, samples[1].input_ids
    backend.capture([0], [first])
    backend.capture([1], [second])
    if packed:
        canonical = [(1, sum(lengths)) for lengths in WARM_UP_LENGTHS]
    else:
        canonical = [(len(lengths), max(lengths)) for lengths in WARM_UP_LENGTHS]
    real = [(1, len(first)), (1, len(second))]
    assert shapes == canonical + real
    backend.set_packed(not packed)  # the other layout is traced on its own canonical batches
    backend.capture([0], [first])
    assert len(shapes) == len(canonical + real) + len(WARM_UP_LENGTHS) + 1


def test_default_layers_follow_eagle3():
    assert default_layers(32) == [1, 15, 28]
    assert default_layers(61) == [1, 29, 57]
    assert default_layers(8) == [1, 3, 4]


def test_bad_layers_and_unsupported_layouts_are_clear_errors():
    with pytest.raises(ValueError, match="out of range"):
        TransformersBackend.load(TINY, [1, 8], "float32", "cpu")

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.stack = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    with pytest.raises(UnsupportedModel, match="cannot find a list of 3 decoder layers"):
        locate(Odd(), 3)
    odd = Odd()
    odd.model.layers = odd.model.stack
    with pytest.raises(UnsupportedModel, match="no final norm"):
        locate(odd, 3)


def _tiny(kind: str):
    import transformers as tf

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "qwen2":
        return tf.Qwen2Config(**common)
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if kind == "mistral":
        return tf.MistralConfig(**common, head_dim=16)
    if kind == "deepseek_v3":
        common["num_key_value_heads"] = 4  # multi-head latent attention has no grouped kv heads
        return tf.DeepseekV3Config(
            **common,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
        )
    raise ValueError(kind)


# Compiled: only the least Llama-like architecture, DeepSeek-V3 (routed experts with data-dependent
# shapes, multi-head latent attention), packed; each compile costs ~30 s of CI on CPU.
EAGER = [(kind, packed, False) for kind in ("qwen2", "qwen3", "mistral", "deepseek_v3") for packed in (False, True)]


@pytest.mark.parametrize("kind,packed,compiled", [*EAGER, ("deepseek_v3", True, True)])
def test_other_architectures_equal_reference(kind, packed, compiled, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny(kind)).to(torch.float32).eval()
    model.save_pretrained(tmp_path)
    layers = [0, 2, 3]
    backend = TransformersBackend.load(tmp_path, layers, "float32", "cpu", packed=packed, compiled=compiled)
    seqs = [torch.randint(0, 300, (n,)).numpy() for n in (17, 9)]
    batch = backend.capture([0, 1], seqs)
    for row, ids in enumerate(seqs):
        with torch.no_grad():
            ref = model(torch.from_numpy(ids)[None].long(), output_hidden_states=True).hidden_states
        _check(batch, [h[0] for h in ref], row, len(ids), layers)
