"""Triton kernels of the mixture-of-experts layer (tokenmill/layers/moe holds their references):

- routing.py: router logits -> top-k weights and expert ids, grouped selection included.
- align.py: the slots (token, choice) of a batch sorted by expert, each expert's run padded to
  the grouped GEMM's row block.
- grouped_gemm.py: prefill and large batches; one grouped GEMM for gate-up fused with
  SiLU-and-mul, one for down with the routing weight in its epilogue.
- few_row.py: decode and small batches; each program streams one selected expert's strip of
  weights once for all the tokens that chose it.
- combine.py: the sum over each token's k weighted expert outputs (plus a shared expert's).
- experts.py: `fused_experts`, which picks the path by token count.
"""
