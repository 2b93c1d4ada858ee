"""Capture with vLLM: its ``extract_hidden_states`` speculative method plus hsx's KV connector.

For targets too large for transformers (multi-GPU MoE under tensor / data parallelism). The driver
(this module) runs ``vllm.LLM`` in-process and feeds it the plan's token ids as prompts with
``max_tokens=1``; vLLM schedules them (continuous batching, chunked prefill, prefix caching) and
its drafter copies the chosen layers' states into a cache-only KV layer; hsx's connector
(``vllm_connector``) writes each finished prompt's sample file through the store from inside
vLLM's worker. Feeding the prompts, checking vLLM's token ids against the plan's and each new
file's header, the disk guard and sealing are the extraction job's (``extract.vllm``).

Layers: vLLM's aux id j is the residual stream after layer j-1 (transformers
``hidden_states[j]``), so hsx layer k is vLLM id k+1; vLLM id N is the last layer's output
BEFORE the final norm, which the connector turns into ``hidden_states`` by applying the
checkpoint's own final RMSNorm (weight and eps read from the checkpoint), exactly as
transformers computes it. The spec's ``final_state`` records this.

Importing this module imports vLLM (that is the check that the backend is available) and
starts nothing.
"""

from __future__ import annotations

from pathlib import Path

import vllm

from hsx.capture import check_layers
from hsx.capture.vllm_connector import CONNECTOR, EXTRA_KEY, SinkConfig
from hsx.errors import CaptureFailed
from hsx.finalnorm import FinalNorm, locate
from hsx.spec import RunSpec
from hsx.store.format import FINAL_STATE, FinalStateNorm
from hsx.target import load_config

__version__ = vllm.__version__


def vllm_ids(layers: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """The vLLM aux ids to capture (ascending: vLLM returns them sorted whatever order it is
    given), the row of each hsx layer among them (in the spec's order), and the row of id N."""
    check_layers(layers, num_layers)
    ids = sorted({k + 1 for k in layers} | {num_layers})
    return ids, [ids.index(k + 1) for k in layers], ids.index(num_layers)


def final_norm(model_dir: Path) -> FinalNorm:
    """The checkpoint's final norm (``hsx.finalnorm.locate``), refused for (1 + weight) norms: the
    connector would apply them as transformers does, but no vLLM model of those families has been
    compared with the transformers backend."""
    norm = locate(model_dir)
    if norm.offset:
        model_type = load_config(model_dir).get("model_type", "")
        raise CaptureFailed(f"the vLLM backend does not handle {model_type}'s (1 + weight) final norm")
    return norm


def final_state(model_dir: Path, stored: FinalStateNorm) -> str:
    """What the run spec records as its final state for this backend: after the norm only (the
    connector could store vLLM id N as it is, but no pre-norm run through vLLM has been tested)."""
    if stored != "post":
        raise CaptureFailed("the vLLM backend stores the final state after the norm: drop --final-state pre")
    norm = final_norm(model_dir)
    divided = f", over {norm.divisor:g} (the LM head's input)" if norm.divisor != 1.0 else ""
    return (
        f"{FINAL_STATE} (vLLM backend: vLLM aux id N, the last layer's output before the norm, "
        f"then the checkpoint's RMSNorm {norm.tensor}, eps {norm.eps}, float32 statistics as transformers{divided})"
    )


def open_llm(
    run: Path,
    model_dir: Path,
    spec: RunSpec,
    longest: int,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
) -> vllm.LLM:
    """vLLM with the extract_hidden_states drafter and hsx's connector writing into ``run``.

    ``longest``: the plan's longest sample in tokens (sets vLLM's context length). Nothing is
    written until prompts are enqueued (``extract.vllm.VllmFeed``)."""
    from vllm.platforms import current_platform

    ids, aux_rows, final_row = vllm_ids(spec.layers, spec.model.num_layers)
    stride = 0 if spec.fidelity is None else spec.fidelity.stride
    sink = SinkConfig(
        run.resolve(), spec.shard_size, spec.layers, aux_rows, final_row, final_norm(model_dir), spec.codec.value,
        fidelity_stride=stride, model_dir=model_dir.resolve(),
    )  # fmt: skip
    return vllm.LLM(
        model=str(model_dir),
        dtype=spec.dtype,
        trust_remote_code=spec.trust_remote_code,
        tensor_parallel_size=tensor_parallel_size,
        **({"data_parallel_size": data_parallel_size} if data_parallel_size > 1 else {}),  # vLLM decides
        max_model_len=longest + 2,  # the prompt, the one sampled token, the drafter's slot
        max_num_batched_tokens=spec.batch_tokens,
        enforce_eager=current_platform.is_cpu(),
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": "hsx.capture.vllm_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {EXTRA_KEY: sink.to_dict()},
        },
    )


def close_llm(llm: vllm.LLM) -> None:
    """Stop vLLM's engine processes now rather than at interpreter exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already gone, or an engine without a separate core
        pass
