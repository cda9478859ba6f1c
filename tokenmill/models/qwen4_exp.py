"""Qwen4Exp (`qwen4_exp`; served as Qwen3.8-Flash-Next): Gated DeltaNet layers beside QSA indexed
attention, a residual of `hc_count` hyper-connection streams, PLE n-gram memory, MoE everywhere.

    streams = embed(ids) copied into hc_count streams                     [T, n, hidden]
    per layer:  streams += PLE(streams, ids)                              (layers in ple_layer_ids, 1-indexed)
                streams = attn_hyper_connection.around(streams, mixer)    (x, w = mix(streams); streams += w * mixer(x))
                streams = mlp_hyper_connection.around(streams, MoE)
    hidden = hyper_connection_mixer.mix(streams);  logits = lm_head(hidden)   (no final norm)

The token mixer of layer i is `layer_types[i]`: Qwen3.5's Gated DeltaNet (separate in_proj_qkv,
z, b, a; its gated output norm's activation is `output_gate_type`, else hidden_act) or QSA
indexed attention: Qwen3-Next's gated attention whose queries attend only the tokens their
indexer selects (layers/attention/qsa.py). The MoE is Qwen3-Next's (softmax top-k, a
sigmoid-gated shared expert). Checkpoints: `Qwen4ExpForCausalLM` (`model.*`), or
`Qwen4ExpForConditionalGeneration` whose text model is served (`model.language_model.*`; the
vision tower is not loaded, the MTP head only by qwen4_exp_mtp.py with the mtp speculative
method); a PLE table may come in `split_ngram_parts` row shards (`ngram_embedding.shard_{i}.weight`,
torch.chunk's split), and its hash constants are checked against the ones the config gives.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.layers.attention.qsa import QSAIndexer
from tokenmill.layers.attention.qsa_backends import qsa_backend
from tokenmill.layers.hyper_connections import HyperConnection
from tokenmill.layers.linear import Linear
from tokenmill.layers.linear_attention import GatedDeltaNet, RecurrentBatch
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.layers.ngram_memory import HASH_CONSTANTS, PLELayer
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM, ModelBuild, MTPHead
from tokenmill.models.llama import head_dim_of
from tokenmill.models.qwen3_next import GatedAttention, Qwen3NextForCausalLM, _TextOfMultimodal, layer_types, rotary_dim
from tokenmill.models.weights import PackedModules
from tokenmill.quantization.base import embedding

LINEAR_ATTENTION, INDEXED_ATTENTION = "linear_attention", "indexed_attention"
NGRAM_SHARD = re.compile(r"\.ngram_embedding\.shard_(\d+)\.weight$")


class IndexedAttention(GatedAttention):
    """Gated attention over the tokens the indexer selects: the K/V cache as GatedAttention's,
    the indexer's pooled keys and key window as cache layers of their own."""

    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, prefix: str, paged_raw_keys: bool = False) -> None:
        super().__init__(build, rotary, prefix)
        self.qsa = qsa_backend(build.attention_backend.name)
        self.qsa.check_supported(self.num_heads, self.num_kv_heads, torch.get_default_dtype(), self.kv_dtype)
        self.indexer = QSAIndexer(build.hf_config, rotary, self.qsa, quant=build.quant, prefix=f"{prefix}.indexer",
                                  block_size=build.block_size, use_triton=build.use_triton, paged_raw_keys=paged_raw_keys)

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        blocks = self.indexer(x, ctx)
        metadata = ctx.attention
        self.qsa.write_kv(k, v, self.kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        return self.qsa.attend(q, self.kv_cache, metadata, blocks, self.indexer.ratio, self.scale, self.k_scale,
                               self.v_scale)


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, layer_type: str, prefix: str,
                 ple_index: int | None, paged_raw_keys: bool = False) -> None:
        """paged_raw_keys: the QSA indexer keeps no per-request state (an MTP head's layer)."""
        super().__init__()
        config, quant = build.hf_config, build.quant
        self.ple = PLELayer(config, ple_index, quant=quant, prefix=f"{prefix}.ple") if ple_index is not None else None
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, f"{prefix}.linear_attn", quant, grouped_projections=False,
                                             state_dtype=build.state_dtype, use_triton=build.use_triton,
                                             output_gate=config.output_gate_type or config.hidden_act)
        elif layer_type == INDEXED_ATTENTION:
            if config.indexer_n_heads is None:
                raise ConfigError(f"{prefix}: an indexed_attention layer needs the indexer_* fields of the config")
            self.self_attn = IndexedAttention(build, rotary, f"{prefix}.self_attn", paged_raw_keys)
        else:
            raise ConfigError(f"{prefix}: layer type {layer_type!r} is not linear_attention or indexed_attention")
        self.mlp = SparseMoeBlock(config, f"{prefix}.mlp", quant=quant, use_triton=build.use_triton)
        self.attn_hyper_connection, self.mlp_hyper_connection = (
            HyperConnection(config.hidden_size, config.hc_count, config.hc_lowrank, config.rms_norm_eps, quant=quant,
                            prefix=f"{prefix}.{name}") for name in ("attn_hyper_connection", "mlp_hyper_connection"))

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, ctx: StepContext,
                recurrent: RecurrentBatch | None) -> torch.Tensor:
        """streams [T, hc_count, hidden] -> the streams after this layer."""
        if self.ple is not None:
            streams = streams + self.ple(streams, input_ids, ctx)
        streams = self.attn_hyper_connection.around(streams, lambda x: self.mix(x, ctx, recurrent))
        return self.mlp_hyper_connection.around(streams, self.mlp)

    def mix(self, x: torch.Tensor, ctx: StepContext, recurrent: RecurrentBatch | None) -> torch.Tensor:
        if recurrent is not None and hasattr(self, "linear_attn"):
            return self.linear_attn(x, recurrent)
        return self.self_attn(x, ctx)


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    """Shares Qwen3-Next's checkpoint naming, packed projections, norm refresh and logits; builds
    its own layers."""

    packed: PackedModules = {**Qwen3NextForCausalLM.packed, "ngram_embedding.*.weight": ("ngram_embedding.weight", "rows")}

    def __init__(self, build: ModelBuild) -> None:
        CausalLM.__init__(self, build)
        config = build.hf_config
        self.hc_count = config.hc_count
        rotary = RotaryEmbedding(config, head_dim_of(config), build.max_model_len, build.use_triton, rotary_dim(config))
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        types = layer_types(config)
        ple_ids = list(config.ple_layer_ids or [])
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(build, rotary, kind, f"model.layers.{i}",
                                 ple_ids.index(i + 1) if i + 1 in ple_ids else None)
            for i, kind in enumerate(types))
        self.has_recurrent_layers = LINEAR_ATTENTION in types
        self.hyper_connection_mixer = HyperConnection(config.hidden_size, config.hc_count, config.hc_lowrank,
                                                      config.rms_norm_eps, inject=False, quant=build.quant,
                                                      prefix="model.hyper_connection_mixer")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, method=build.quant.linear_method("lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        recurrent = RecurrentBatch.of(ctx) if self.has_recurrent_layers else None
        streams = HyperConnection.widen(self.embed_tokens(input_ids), self.hc_count)
        for i, layer in enumerate(self.layers):
            if i in ctx.keep_hidden:  # the streams entering layer i, side by side: [T, hc_count * hidden]
                ctx.hidden[i] = streams.flatten(1)
            streams = layer(streams, input_ids, ctx, recurrent)
        if len(self.layers) in ctx.keep_hidden:  # the streams before the final mixer: the MTP tap
            ctx.hidden[len(self.layers)] = streams.flatten(1)
        return self.hyper_connection_mixer.mix(streams)[0]

    def mtp_head(self, build: ModelBuild) -> MTPHead:
        from tokenmill.models.qwen4_exp_mtp import Qwen4ExpMTP

        return Qwen4ExpMTP(self, build)

    def mtp_keep_hidden(self) -> tuple[int, ...]:
        return (len(self.layers),)

    def layer_output_entries(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """Refused: this model records each layer's hyper-connection streams ([T, hc_count * hidden]);
        which hidden state a block drafter's target_layer_ids tap (one stream, the mixed streams)
        is not determined from the public drafters."""
        raise ConfigError(f"target_layer_ids {list(layer_ids)}: a block drafter over {type(self).__name__}'s "
                          "hyper-connection streams taps a hidden state no public implementation determines; "
                          "tokenmill does not guess it")


    def mtp_tap(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The streams after the last layer, before the final mixer ([T, hc_count * hidden]: the
        published Qwen4Exp MTP heads read this "pre-collapse" state, not the mixed hidden state)."""
        return ctx.hidden[len(self.layers)]

    def mtp_decoder_layer(self, build: ModelBuild, prefix: str, rope_theta: float | None = None) -> nn.Module:
        """The MTP head's layer: a QSA indexed-attention layer with the MoE and hyper-connections,
        no PLE, its indexer without per-request state; its rotary at `rope_theta` when the config's
        `mtp` section gives one."""
        config = build.hf_config
        if rope_theta is not None:
            config = copy.copy(config)
            config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": rope_theta}
        rotary = RotaryEmbedding(config, head_dim_of(config), build.max_model_len, build.use_triton, rotary_dim(config))
        return Qwen4ExpDecoderLayer(build, rotary, INDEXED_ATTENTION, prefix, None, paged_raw_keys=True)

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3-Next's names; PLE table shards as rows of one table; the PLE hash constants the
        checkpoint stores checked, not loaded."""
        for name, tensor in super().checkpoint_names(weights):
            if name.rsplit(".", 1)[-1] in HASH_CONSTANTS:
                expected = self.get_buffer(name)
                if not torch.equal(tensor.to(expected.device, expected.dtype), expected):
                    raise ModelLoadError(f"{name}: the checkpoint's PLE hash constants differ from the ones its config "
                                         "(seed, vocab_size, ngram_vocab_size_base, ple_layer_ids) gives")
                continue
            yield NGRAM_SHARD.sub(r".ngram_embedding.\1.weight", name), tensor


class Qwen4ExpForConditionalGeneration(_TextOfMultimodal, Qwen4ExpForCausalLM):
    pass
