"""Block drafters' options and refusals (CPU, float32, tests/dflash_models.py's checkpoints):
drafter weights quantized at load (fp8 rows, NVFP4 W4A16) with the drafter's own copy of the
output head quantized separately while the target verifies with its own; a draft vocabulary;
penalties and min_tokens seeing every draft; the context and block steps through the static
buffers CUDA graphs replay; and every config field tokenmill cannot honour refused at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash_models import TARGET_CONFIGS, drafter, save_drafter, save_target
from mtp_cases import engine, workload
from test_mtp_spec import _StagedEagerly

from tokenmill import SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.runner.cuda_graphs import TokenInputSpec
from tokenmill.speculative.dflash import TAPPED, DFlashProposer

GAMMA = 3
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NAME = "llama"
VOCAB = TARGET_CONFIGS[NAME].vocab_size


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict:
    target_dir = tmp_path_factory.mktemp("target")
    target = save_target(NAME, target_dir)
    embedding = target.get_input_embeddings().weight.detach()
    drafts = {kind: save_drafter(drafter(TARGET_CONFIGS[NAME], kind, copy_from=embedding), tmp_path_factory.mktemp(kind))
              for kind in ("dflash", "dflash2")}
    prompts = workload(VOCAB - 1)
    plain = [o.outputs[0].token_ids for o in engine(target_dir, None).generate(prompts, PARAMS)]
    return {"target": target_dir, "drafts": drafts, "prompts": prompts, "plain": plain}


def spec(made: dict, kind: str = "dflash", **options: object) -> dict:
    return {"method": kind, "model": str(made["drafts"][kind]), "num_speculative_tokens": GAMMA, **options}


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("options,layer_method,head_method", [
    ({"quantization": "nvfp4"}, "Nvfp4OnLoadLinearMethod", "Nvfp4OnLoadLinearMethod"),
    ({"quantization": "fp8"}, "Fp8RowLinearMethod", "Fp8RowLinearMethod"),
    ({"head_quantization": "nvfp4"}, "UnquantizedLinearMethod", "Nvfp4OnLoadLinearMethod"),
    ({"quantization": "nvfp4", "head_quantization": "fp8"}, "Nvfp4OnLoadLinearMethod", "Fp8RowLinearMethod"),
])
def test_quantized_drafters_keep_the_output(kind: str, options: dict, layer_method: str, head_method: str, made: dict) -> None:
    llm = engine(made["target"], spec(made, kind, **options))
    model, target = llm.engine.proposer.model, llm.engine.runner.model
    assert type(model.layers[0].mlp.down_proj.method).__name__ == layer_method
    assert model.owns_output_head() and model.output_head is not target.lm_head
    assert type(model.output_head.method).__name__ == head_method
    assert target.lm_head.weight.dtype == torch.float32  # the target verifies with its own head
    if layer_method.startswith("Nvfp4"):
        assert model.layers[0].self_attn.kv_proj.weight.dtype == torch.uint8  # packed E2M1
    out = [o.outputs[0].token_ids for o in llm.generate(made["prompts"], PARAMS)]
    assert out == made["plain"] and llm.engine.stats().spec_num_accepted_tokens > 0


def test_a_draft_vocabulary_restricts_the_drafters_own_head(made: dict, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import Counter

    from tokenmill.speculative.draft_vocab import save_draft_vocab

    counts = Counter(t for out in made["plain"] for t in out)
    ids = sorted(t for t, _ in counts.most_common(max(2, len(counts) // 2)))
    drafted: list[int] = []
    draft = DFlashProposer._draft

    def recorded(self, requests, limits, outputs, anchors):
        draft(self, requests, limits, outputs, anchors)
        drafted.extend(t for r in requests for t in r.drafts.device_ids.tolist())

    monkeypatch.setattr(DFlashProposer, "_draft", recorded)
    llm = engine(made["target"], spec(made, draft_vocab=str(save_draft_vocab(ids, tmp_path / "v.txt"))))
    assert llm.engine.proposer.model.output_head.weight.shape[0] == len(ids)
    assert [o.outputs[0].token_ids for o in llm.generate(made["prompts"], PARAMS)] == made["plain"]
    assert drafted and set(drafted) <= set(ids) and llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_penalties_and_min_tokens_see_every_draft(kind: str, draft_sampling: str, made: dict) -> None:
    prompts = made["prompts"][:3]
    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.8, frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=12, stop_token_ids=[3, 9])]
    plain = [o.outputs[0].token_ids for o in engine(made["target"], None).generate(prompts, params)]
    llm = engine(made["target"], spec(made, kind, draft_sampling=draft_sampling))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_steps_staged_in_graph_buffers_draft_what_eager_steps_draft(kind: str, made: dict) -> None:
    """The context writes (1 and 1 + gamma rows per request, the tapped states a per-token input)
    and the block forward through the static buffers CUDA graphs replay (batches padded up to 4):
    the same drafts as eager steps, so the same acceptance, and plain decoding's output."""
    eager = engine(made["target"], spec(made, kind), max_num_batched_tokens=128)
    eager_out = [o.outputs[0].token_ids for o in eager.generate(made["prompts"], PARAMS)]
    staged = engine(made["target"], spec(made, kind), max_num_batched_tokens=128)
    proposer, runner = staged.engine.proposer, staged.engine.runner
    width = len(proposer.spec.target_layer_ids) * proposer.spec.target_hidden_size
    used: list[str] = []

    def staged_graphs(q: int, name: str, function, inputs=None) -> _StagedEagerly:
        graphs = _StagedEagerly(proposer.model, 4, runner.max_blocks_per_seq, runner.num_blocks, runner.block_size, 96,
                                runner.device, q, name, step_function=function, token_inputs=inputs)
        original = graphs.run_outputs
        graphs.run_outputs = lambda ids, ctx: used.append(name) or original(ids, ctx)
        return graphs

    for q in (1, 1 + GAMMA):
        proposer.context_graphs[q] = staged_graphs(q, f"context {q}", proposer._context_step,
                                                   {TAPPED: TokenInputSpec((width,), torch.float32)})
    proposer.block_graphs = staged_graphs(1 + GAMMA, "block", proposer._block_step)
    staged_out = [o.outputs[0].token_ids for o in staged.generate(made["prompts"], PARAMS)]
    assert eager_out == staged_out == made["plain"]
    assert {"block", f"context {1 + GAMMA}"} <= set(used)
    a, b = eager.engine.stats(), staged.engine.stats()
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens) == (b.spec_num_draft_tokens, b.spec_num_accepted_tokens)


def _edited(made: dict, tmp_path: Path, kind: str = "dflash", config: dict | None = None,
            section: dict | None = None, extra: dict[str, torch.Tensor] | None = None) -> Path:
    d = drafter(TARGET_CONFIGS[NAME], kind)
    d.config.update(config or {})
    d.config["dflash_config"].update(section or {})
    d.tensors.update(extra or {})
    return save_drafter(d, tmp_path / "edited")


@pytest.mark.parametrize("config,section,message", [
    ({}, {"frobnicate": 1}, r"dflash_config sets \['frobnicate'\]"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, {}, "chunked_attention"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None}, {}, "sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "is_causal": False}, {},
     r"sliding_window 4 is narrower than the block \(8\)"),
    ({"sliding_window": None}, {"use_swa": True}, "swa_window_size"),
    ({}, {"attention_sink_bias": True}, "attention_sink_bias"),
    ({}, {"use_aux_hidden_state": False}, "use_aux_hidden_state"),
    ({}, {"target_layer_ids": [0, 3]}, r"target_layer_ids \[0, 3\]: \[3\]"),
    ({}, {"mask_token_id": 64}, "mask_token_id 64 is outside"),
    ({}, {"mask_token_id": None}, "mask_token_id must be a token id"),
    ({"vocab_size": 80}, {}, "vocab_size 80 is not the target's 64"),
    ({"target_hidden_size": 32}, {}, "reads target layers of 32 features"),
    ({"draft_vocab_size": 32}, {}, "draft_vocab_size 32"),
    ({"hidden_act": "gelu"}, {}, "hidden_act"),
    ({}, {"conv_kernel_size": 2}, "of a DFlash2 drafter but the architecture is DFlashDraftModel"),
])
def test_config_fields_that_cannot_be_honoured_are_refused(config: dict, section: dict, message: str, made: dict,
                                                            tmp_path: Path) -> None:
    path = _edited(made, tmp_path, config=config, section=section)
    with pytest.raises(ConfigError, match=message):
        engine(made["target"], {"method": "dflash", "model": str(path), "num_speculative_tokens": GAMMA})


def test_dflash2_refusals(made: dict, tmp_path: Path) -> None:
    base = {"method": "dflash2", "num_speculative_tokens": GAMMA}
    for section, message in [({"conv_group_size": 5}, "conv_group_size 5 does not divide"),
                             ({"selector_top_k": 0}, "selector_top_k must be a positive integer"),
                             ({"conv_kernel_size": 9}, "conv_kernel_size 9 exceeds block_size 8")]:
        path = _edited(made, tmp_path, "dflash2", section=section)
        with pytest.raises(ConfigError, match=message):
            engine(made["target"], {**base, "model": str(path)})
    vocab = tmp_path / "v.txt"
    vocab.write_text("1 2 3")
    with pytest.raises(ConfigError, match="draft_vocab"):
        engine(made["target"], {**base, "model": str(made["drafts"]["dflash2"]), "draft_vocab": str(vocab)})


def test_checkpoint_contents_that_cannot_be_honoured_are_refused(made: dict, tmp_path: Path) -> None:
    spec_of = {"method": "dflash", "num_speculative_tokens": GAMMA}
    path = _edited(made, tmp_path, extra={"embed_tokens.weight": torch.zeros(VOCAB, 48)})
    with pytest.raises(ConfigError, match="its own embed_tokens"):
        engine(made["target"], {**spec_of, "model": str(path)})
    path = _edited(made, tmp_path)
    torch.save(torch.zeros(48), path / "mask_embedding.pt")
    with pytest.raises(ConfigError, match="mask_embedding.pt"):
        engine(made["target"], {**spec_of, "model": str(path)})
    (path / "mask_embedding.pt").unlink()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="needs a DFlash drafter checkpoint"):
        engine(made["target"], {**spec_of, "model": str(path)})


def test_hyper_connection_targets_are_refused() -> None:
    from tokenmill.models.qwen4_exp import Qwen4ExpForCausalLM
    from tokenmill.models.raon import RaonForCausalLM

    for cls in (Qwen4ExpForCausalLM, RaonForCausalLM):
        with pytest.raises(ConfigError, match="hyper-connection streams"):
            cls.layer_output_entries(object.__new__(cls), [1, 2])


def test_speculation_turns_off_past_disable_by_batch_size(made: dict, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With more decoding requests than the limit a step drafts nothing (they decode plainly),
    logged as it turns off and on; the output is plain decoding's either way. Without a limit the
    rule takes the batch the captured verify graphs hold (none on the CPU: no limit)."""
    import logging
    from types import SimpleNamespace

    from tokenmill.speculative.proposers import BatchSizeRule

    sizes: list[int] = []
    propose = DFlashProposer.propose

    def recorded(self, requests, limits):
        sizes.append(len(requests))
        propose(self, requests, limits)

    monkeypatch.setattr(DFlashProposer, "propose", recorded)
    llm = engine(made["target"], spec(made, disable_by_batch_size=2))
    with caplog.at_level(logging.INFO, logger="tokenmill.speculative.proposers"):
        out = [o.outputs[0].token_ids for o in llm.generate(made["prompts"], PARAMS)]
    assert out == made["plain"]
    assert sizes and max(sizes) == 2 and llm.engine.stats().spec_num_drafts > 0
    assert "speculation off: 3 decoding requests are more than 2" in caplog.text
    assert "speculation on again" in caplog.text
    config = SimpleNamespace(speculative=SimpleNamespace(disable_by_batch_size=None))
    graphs = [SimpleNamespace(max_batch=64), SimpleNamespace(max_batch=32)]  # decode, verify
    assert BatchSizeRule.of(config, SimpleNamespace(graphs=graphs)).limit == 32  # type: ignore[arg-type]
    assert BatchSizeRule.of(config, SimpleNamespace(graphs=[])).limit is None  # type: ignore[arg-type]
    assert BatchSizeRule(None).allows(10_000)


def test_a_drafter_that_does_not_fit_is_refused_with_its_bytes(made: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device's memory is known, the drafter's weights are sized before they are built
    and refused when the device has no room left for them beside the target."""
    from tokenmill.runner import memory

    gib = 2**30
    asked: list[str] = []

    def device_memory(device: torch.device) -> tuple[int, int]:
        asked.append(str(device))  # the target's check first, then the drafter's once the target holds most of it
        return (8 * gib, 8 * gib) if len(asked) == 1 else (gib // 4, 8 * gib)

    monkeypatch.setattr(memory, "device_memory", device_memory)
    with pytest.raises(ConfigError, match=r"the DFlash drafter does not fit: its weights need 0\.00 GiB \([\d,]+ bytes\)"):
        engine(made["target"], spec(made))
    assert len(asked) >= 2
