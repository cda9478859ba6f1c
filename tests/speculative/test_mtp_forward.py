"""The MTP head's math against a reference written here, for every family (random heads, CPU, float32).

The reference recomputes every proposal from scratch: the target's hidden states from
transformers (the tap each family's head reads), the head's input fused as its published layout
says (the norms, the concatenation order, the fc / eh_proj / fc_embedding + fc_hidden, DeepSeek's
zeroed first-position embedding), then the head's decoder layer as transformers' own layer, run as
the only layer of a one-layer transformers model over the whole causal sequence (every row the
head has seen, no cache), its final norm (Qwen3-Next's mtp.norm, DeepSeek's shared_head.norm) or
mixer (Qwen4Exp's) and the target's output head. Chained drafts read the head's own output at the
position before (after mtp.norm for Qwen3-Next, before shared_head.norm for DeepSeek, the streams
before the mixer for Qwen4Exp). Each proposal the engine makes (paged head KV, catch-up rows
following the target, chunked prefill, prefix hits, preemption) must give the reference's logits
at every draft position.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from mtp_cases import engine, make_checkpoint, vocab_of, workload
from mtp_models import MTPCheckpoint, plain_norm, zero_centered_norm
from transformers import AutoModelForCausalLM, Qwen4ExpForCausalLM

from tokenmill import SamplingParams
from tokenmill.speculative.draft_sampling import DraftSampler

GAMMA = 3
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Reference:
    """A family's MTP math, from transformers' layer and the head's tensors."""

    def __init__(self, name: str, ck: MTPCheckpoint) -> None:
        self.name, self.ck = name, ck
        self.family = "qwen4exp" if name.startswith("qwen4exp") else "deepseek" if name.startswith("deepseek") else "qwen"
        config = copy.deepcopy(ck.target.config)
        self.eps = config.rms_norm_eps
        config.num_hidden_layers = 1
        if self.family == "deepseek":
            config.first_k_dense_replace = 0  # the MTP layer is an MoE layer (index N >= first_k_dense_replace)
            config.num_nextn_predict_layers = 0
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        elif self.family == "qwen4exp":
            config.layer_types, config.ple_layer_ids = ["indexed_attention"], []
            self.model = Qwen4ExpForCausalLM(config).float()
        else:
            config.layer_types = ["full_attention"]
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = {f"model.layers.0.{n}": t for n, t in ck.layer.state_dict().items()}
        target = ck.target.state_dict()
        state["model.embed_tokens.weight"] = target["model.embed_tokens.weight"]
        state["lm_head.weight"] = target.get("lm_head.weight", target["model.embed_tokens.weight"])
        x = ck.extras
        if self.family == "qwen":
            state["model.norm.weight"] = x["mtp.norm.weight"]
        elif self.family == "deepseek":
            n = ck.target.config.num_hidden_layers
            state["model.norm.weight"] = x[f"model.layers.{n}.shared_head.norm.weight"]
            self.x = {k.split(f"model.layers.{n}.", 1)[1]: v for k, v in x.items()}
        else:
            state.update({"model." + k[len("mtp."):]: v for k, v in x.items() if k.startswith("mtp.hyper_connection_mixer.")})
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m or "inv_freq" in m for m in missing), (missing, unexpected)
        self.model.eval()
        self.output_of = self.model.model.hyper_connection_mixer if self.family == "qwen4exp" else self.model.model.norm

    def target_tap(self, ids: list[int]) -> torch.Tensor:
        """[T, width]: what the head reads of the target at each of these positions."""
        seen: list[torch.Tensor] = []
        model = self.ck.target.model
        if self.family == "qwen4exp":
            handle = model.hyper_connection_mixer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
            model(input_ids=torch.tensor([ids]))
            handle.remove()
            return seen[0][0]
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    def fuse(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The head's layer input [T, width] for rows at positions 0..T-1."""
        x, eps = self.ck.extras, self.eps
        emb = self.ck.target.model.embed_tokens(next_ids)
        if self.family == "qwen":
            cat = torch.cat([zero_centered_norm(emb, x["mtp.pre_fc_norm_embedding.weight"], eps),
                             zero_centered_norm(hidden, x["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
            return cat @ x["mtp.fc.weight"].T
        if self.family == "deepseek":
            emb = emb.clone()
            emb[0] = 0.0  # vLLM zeroes the embedding at position 0
            cat = torch.cat([plain_norm(emb, self.x["enorm.weight"], eps), plain_norm(hidden, self.x["hnorm.weight"], eps)], -1)
            return cat @ self.x["eh_proj.weight"].T
        streams = zero_centered_norm(hidden, x["mtp.pre_fc_norm_hidden.weight"], eps)  # one statistic per row
        streams = streams.view(len(next_ids), -1, emb.shape[-1]) @ x["mtp.fc_hidden.weight"].T
        e = zero_centered_norm(emb, x["mtp.pre_fc_norm_embedding.weight"], eps) @ x["mtp.fc_embedding.weight"].T
        return (streams + e[:, None]).flatten(1)

    def run(self, next_ids: torch.Tensor, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, V], chained output [T, width]) of the layer over the whole sequence."""
        layer, outputs = self.model.model.layers[0], []

        def swap(module, args, kwargs):
            assert args[0].shape[-1] == fused.shape[-1]
            return (fused[None], *args[1:]), kwargs

        hooks = [layer.register_forward_pre_hook(swap, with_kwargs=True),
                 self.output_of.register_forward_pre_hook(lambda m, args: outputs.append(args[0][0]))]
        try:
            logits = self.model(input_ids=next_ids[None]).logits[0]
        finally:
            for hook in hooks:
                hook.remove()
        chained = outputs[0]
        if self.family == "qwen":  # Qwen3-Next chains the normed output
            chained = zero_centered_norm(chained, self.ck.extras["mtp.norm.weight"], self.eps)
        return logits, chained

    @torch.no_grad()
    def proposal(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """The head's logits at each draft position of a proposal after `tokens`, chaining `drafts`."""
        hidden = self.target_tap(tokens[:-1])
        next_ids = torch.tensor(tokens[1:])
        out = []
        for j in range(len(drafts)):
            logits, chained = self.run(next_ids, self.fuse(next_ids, hidden))
            out.append(logits[-1])
            next_ids = torch.cat([next_ids, torch.tensor([drafts[j]])])
            hidden = torch.cat([hidden, chained[-1:]])
        return out


CASES = ["qwen3_next", "qwen3_5", "qwen4exp", "deepseek-v3", "deepseek-v3-neox-tied"]


@pytest.mark.parametrize("name", CASES)
def test_every_proposal_gives_the_references_logits(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_checkpoint(name, tmp_path, mode="random")
    reference = Reference(name, ck)
    proposals: list[tuple[list[list[int]], list[torch.Tensor], list[int]]] = []
    draft = DraftSampler.draft

    def recorded(self, requests, limits, logits, next_logits):
        steps = [logits.clone()]

        def recording(step: int, previous: torch.Tensor) -> torch.Tensor:
            steps.append(next_logits(step, previous).clone())
            return steps[-1]

        draft(self, requests, limits, logits, recording)
        proposals.append(([list(r.all_token_ids) for r in requests], steps, [r.drafts.device_ids.tolist() for r in requests]))

    monkeypatch.setattr(DraftSampler, "draft", recorded)
    llm = engine(tmp_path, {"method": "mtp", "num_speculative_tokens": GAMMA}, num_blocks=12)
    llm.generate(workload(vocab_of(name)), PARAMS)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    checked = 0
    for tokens, steps, drafts in proposals:
        for b, (request_tokens, request_drafts) in enumerate(zip(tokens, drafts)):
            expected = reference.proposal(request_tokens, request_drafts)
            for j, row in enumerate(expected):
                torch.testing.assert_close(steps[j][b], row, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked > 50
