"""DFlash and DFlash2 block drafters: a few decoder layers conditioned on the target's hidden
states, drafting a whole block of tokens in one forward.

Layout followed: z-lab/dflash's `DFlashDraftModel` / `DFlash2DraftModel` (dflash/model.py) and
the published checkpoints' tensor names (SGLang's and vLLM's drafters load the same):
`fc.weight` [H, n * H_target], `hidden_norm.weight`, `norm.weight`, Qwen3-style
`layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`; DFlash2 adds
`layers.{i}.{attention_conv, mlp_conv}.{base_kernel, kernel_projection.weight}` and
`candidate_selector.*` (models/dflash2.py). No embedding and no output head: the target's are
used (a checkpoint that stores `lm_head.weight` has its own head).

The math (upstream's): the context of position p is `hidden_norm(fc(cat of the target's layer
outputs at target_layer_ids, at p)))`; every draft layer's keys and values over the context are
its k_proj / v_proj of it (k_norm, rotary at p). A block [anchor, MASK x (B - 1)] at positions
P..P+B-1, embedded with the target's embedding (x input_embedding_scale), runs the layers with
attention over the context of positions < P and the whole block, not causal within it (unless
the config says is_causal); the final norm's rows 1..B-1, through the output head
(x output_multiplier, softcapped), are the drafts' logits at positions P+1..P+B-1. A
sliding_attention layer sees no key more than its window before the row (causal within the
block by default, as upstream's are).

tokenmill keeps the context's keys and values in the drafter's paged cache (vLLM's layout):
`write_context` writes a target step's rows at their slots right behind the step; a block
forward writes its own rows' keys and values at theirs (positions the target has not computed:
rewritten by its next step's context) and attends over the cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.layers.attention.paged_kv import PagedKVLayer
from tokenmill.layers.linear import Linear
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.step_context import StepContext
from tokenmill.models.dflash2 import CandidateSelector, GroupedDynamicConv, block_rows
from tokenmill.models.dflash_config import DFlashSpec, LayerAttention
from tokenmill.models.interface import ModelBuild, StepModel
from tokenmill.models.llama import head_dim_of
from tokenmill.models.weights import PackedModules, load_checkpoint

PACKED: PackedModules = {
    "k_proj": ("kv_proj", 0),
    "v_proj": ("kv_proj", 1),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # upstream's HF module stores the selector's codebooks as nn.Embedding weights
    "predecessor_codebook.weight": ("predecessor_codebook", None),
    "successor_codebook.weight": ("successor_codebook", None),
}


class DFlashAttention(PagedKVLayer):
    """The block's queries over the paged cache (a cache layer): q from the block rows, keys and
    values of the block rows and, written separately (`write_context`), of the context."""

    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, prefix: str, attention: LayerAttention) -> None:
        super().__init__()
        config, quant = build.hf_config, build.quant
        self.init_paged_kv(build.attention_backend, build.cache_dtype(), build.block_size, config.num_attention_heads,
                           config.num_key_value_heads, head_dim_of(config))
        kv = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias,
                             method=quant.linear_method(f"{prefix}.q_proj"))
        self.kv_proj = Linear(config.hidden_size, [kv, kv], bias=bias, method=quant.linear_method(f"{prefix}.kv_proj"))
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias,
                             method=quant.linear_method(f"{prefix}.o_proj"))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, build.use_triton)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, build.use_triton)
        self.rotary = rotary
        self.causal, self.window = attention.causal, attention.window
        self.scale = self.head_dim**-0.5

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_proj(x).split(self.kv_proj.output_sizes, dim=-1)
        return self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)), v.reshape(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        k, v = self._keys_values(x)
        q, k = self.rotary(ctx.positions, q, k)
        out = self.backend.forward(q, k, v, self.kv_cache, ctx.attention, self.scale, self.k_scale, self.v_scale,
                                   causal=self.causal, window=self.window)
        return self.o_proj(out.flatten(1))

    def write_context(self, context: torch.Tensor, ctx: StepContext) -> None:
        """Keys and values of context rows (the projected target states) at their positions and slots."""
        k, v = self._keys_values(context)
        self.backend.write(self.rotary.rotate(ctx.positions, k), v, self.kv_cache, ctx.attention.slot_mapping,
                           self.k_scale, self.v_scale)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; DFlash2 wraps each in its grouped dynamic convolution
    (`prepare` on the sublayer's input, `finish` on its output)."""

    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, index: int, spec: DFlashSpec) -> None:
        super().__init__()
        config, prefix = build.hf_config, f"layers.{index}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, build.use_triton)
        self.self_attn = DFlashAttention(build, rotary, f"{prefix}.self_attn", spec.layers[index])
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, build.use_triton)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                            build.quant, f"{prefix}.mlp", build.use_triton)
        self.attention_conv = self.mlp_conv = None
        if spec.conv is not None:
            self.attention_conv = GroupedDynamicConv(config.hidden_size, spec.conv, build.quant, f"{prefix}.attention_conv")
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, spec.conv, build.quant, f"{prefix}.mlp_conv")

    def forward(self, x: torch.Tensor, ctx: StepContext, rows: torch.Tensor | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            assert rows is not None
            h, kernel = self.attention_conv.prepare(h, rows)
            h = self.attention_conv.finish(self.self_attn(h, ctx), kernel, rows)
        else:
            h = self.self_attn(h, ctx)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            assert rows is not None
            h, kernel = self.mlp_conv.prepare(h, rows)
            h = self.mlp_conv.finish(self.mlp(h), kernel, rows)
        else:
            h = self.mlp(h)
        return x + h


class DFlashDraftModel(StepModel):
    """`forward` runs blocks (every request's rows are one block, starting at its anchor) and
    returns the final norm's rows; `write_context` writes the context of target rows;
    `compute_logits` is the output head's, scaled and softcapped as the drafter's config says."""

    packed: PackedModules = PACKED

    def __init__(self, build: ModelBuild, spec: DFlashSpec, embedding: nn.Embedding, head: nn.Module | None) -> None:
        """embedding: the target's (shared, not a parameter); head: the target's output head, or
        None for one of the drafter's own (`lm_head`, from its checkpoint or set before processing)."""
        super().__init__()
        config = build.hf_config
        self.config, self.spec = config, spec
        if embedding.embedding_dim != config.hidden_size:
            raise ConfigError(f"the drafter's hidden_size {config.hidden_size} is not the target embedding's "
                              f"{embedding.embedding_dim}; a drafter with its own embedding is not implemented")
        if spec.mask_token_id >= embedding.num_embeddings:
            raise ConfigError(f"dflash_config.mask_token_id {spec.mask_token_id} is outside the target's embedding "
                              f"({embedding.num_embeddings} rows)")
        object.__setattr__(self, "_embed_tokens", embedding)
        rotary = RotaryEmbedding(config, head_dim_of(config), build.max_model_len, build.use_triton)
        self.layers = nn.ModuleList(DFlashDecoderLayer(build, rotary, i, spec) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        taps = len(spec.target_layer_ids)
        self.fc = Linear(taps * spec.target_hidden_size, config.hidden_size, bias=False,
                         method=build.quant.linear_method("fc"))
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.candidate_selector = None
        if spec.selector is not None:
            self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, spec.selector, build.quant)
        if head is None:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False,
                                  method=build.quant.linear_method("lm_head"))
        else:
            object.__setattr__(self, "_shared_head", head)

    @property
    def output_head(self) -> nn.Module:
        own = self._modules.get("lm_head")
        return own if own is not None else self._shared_head

    def set_output_head(self, head: nn.Module) -> None:
        """A head of the drafter's own (a draft vocabulary's rows, a separately quantized copy)."""
        self.lm_head = head

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self._embed_tokens(input_ids)
        if self.spec.input_embedding_scale != 1.0:
            x = x * self.spec.input_embedding_scale
        rows = block_rows(ctx) if self.spec.conv is not None else None
        for layer in self.layers:
            x = layer(x, ctx, rows)
        return self.norm(x)

    def write_context(self, states: torch.Tensor, ctx: StepContext) -> None:
        """The context of target rows ([T, n * H_target]: the tapped layers side by side) into every layer's cache."""
        context = self.hidden_norm(self.fc(states))
        for layer in self.layers:
            layer.self_attn.write_context(context, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.output_head(hidden)
        if self.spec.output_multiplier != 1.0:
            logits = logits.float() * self.spec.output_multiplier
        if self.spec.final_logit_softcapping is not None:
            cap = self.spec.final_logit_softcapping
            logits = torch.tanh(logits.float() / cap) * cap
        return logits

    def owns_output_head(self) -> bool:
        return "lm_head" in self._modules

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def skip(name: str) -> bool:
            return "rotary_emb" in name

        load_checkpoint(self, _drafter_names(weights), self.packed, skip)


def _drafter_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under this module's names (a `model.` prefix some exports add dropped);
    an embedding is refused (the target's is used)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith("embed_tokens."):
            raise ConfigError("the drafter checkpoint stores its own embed_tokens; drafters with their own embedding "
                              "are not implemented (the target's is used)")
        yield name, tensor
