"""Logits parity with transformers: the engine's prefill logits (chunk by chunk through its batches
and cache) and every decode step's logits against one forward of transformers' model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.step_builder import build_step_input

# float32 on CPU must agree to 1e-4. bf16 on CUDA is held against the float32 reference with a
# tolerance of twice the error transformers' own bf16 model makes on the same input.
TARGETS = [
    pytest.param("cpu", "float32", id="cpu-fp32"),
    pytest.param("cuda", "bfloat16", id="cuda-bf16", marks=pytest.mark.gpu),
]


def tolerance(hf_model: torch.nn.Module, prompt: list[int], dtype: str) -> float:
    if dtype == "float32":
        return 1e-4
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
        low = hf_model.to("cuda", torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
    hf_model.to("cpu", torch.float32)
    return max(2 * rel_err(low, ref), 1e-2)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@contextmanager
def capture_logits(llm: LLM) -> Iterator[list[torch.Tensor]]:
    """Record the logits of every sampled row, eager or replayed from a CUDA graph."""
    seen: list[torch.Tensor] = []
    runner = llm.engine.runner
    original = runner._logits

    def recording(inputs):
        logits = original(inputs)
        if logits is not None:
            seen.append(logits.detach().float().cpu())
        return logits

    runner._logits = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del runner._logits


def prefill_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, chunk by chunk through the engine's batches and cache."""
    engine = llm.engine
    engine.add_request("prefill-probe", token_ids, SamplingParams(max_tokens=1))
    request = engine.requests["prefill-probe"]
    chunks = []
    while request.num_computed_tokens < len(token_ids):
        batch = engine.scheduler.schedule()
        step = build_step_input(batch, batch.sampling_requests(), engine.kv, (), engine.config)
        inputs = engine.runner.prepare_inputs(step)
        with torch.inference_mode():
            hidden = engine.runner.model(inputs.input_ids, inputs.ctx)
            chunks.append(engine.runner.model.compute_logits(hidden).float().cpu())
        engine.scheduler.finish_step(batch)
    engine.abort_request("prefill-probe")
    return torch.cat(chunks)


def check_parity(llm: LLM, hf_model: torch.nn.Module, prompt: list[int], steps: int, tol: float) -> None:
    exact = tol <= 1e-4
    ours = prefill_logits(llm, prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    print(f"parity: prefill relative error {rel_err(ours, ref):.2e} (tolerance {tol:.2e})")
    assert rel_err(ours, ref) < tol, f"prefill logits differ: {rel_err(ours, ref):.2e}"

    with capture_logits(llm) as seen:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0]
    generated = out.outputs[0].token_ids
    assert len(generated) == steps and len(seen) == steps
    with torch.no_grad():
        ref_all = hf_model(torch.tensor([prompt + generated])).logits[0]
    # bf16 on CUDA: decode steps are held to twice transformers' own bf16 error on the input they
    # see, the prompt and the tokens generated so far (its error grows along the sequence as ours does).
    runner = llm.engine.runner
    bf16_cuda = runner.device.type == "cuda" and runner.dtype == torch.bfloat16
    step_tol = max(tol, tolerance(hf_model, prompt + generated, "bfloat16")) if bf16_cuda else tol
    for i, logits in enumerate(seen):
        ref_step = ref_all[len(prompt) - 1 + i]
        assert rel_err(logits[0], ref_step) < step_tol, (
            f"decode step {i}: {rel_err(logits[0], ref_step):.2e} (tolerance {step_tol:.2e})")
        if exact:
            assert generated[i] == int(ref_step.argmax())


def assert_same_or_near_ties(reference: LLM, prompts: list[list[int]], expected: list[list[int]],
                             actual: list[list[int]], max_gap: float = 0.03) -> int:
    """Greedy tokens of another path (CUDA graphs, speculation, another kernel) against `reference`'s
    own: equal, or each sequence's first difference sits at a near-tie of the reference's logits
    there (its top token's logit minus the other path's token's at most `max_gap` of the largest
    |logit|), which bf16 rounding on another path may flip (SPEC-DECODING.md). Returns the ties."""
    ties = 0
    for prompt, want, got in zip(prompts, expected, actual, strict=True):
        assert len(want) == len(got)
        if want == got:
            continue
        i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
        logits = prefill_logits(reference, prompt + want[:i])[-1]
        gap = (logits[want[i]] - logits[got[i]]).item() / logits.abs().max().item()
        assert gap <= max_gap, (f"tokens differ at step {i} where the reference's logits are no near-tie: "
                                f"{gap:.2e} of the largest logit")
        ties += 1
    return ties
