"""Triton kernels, each beside the pure-PyTorch reference it is tested against.

Nothing here is imported by `import tokenmill`: every module in this package imports triton at
its top, so callers import the module they need only once they know triton is wanted. The
exceptions are the entry points that also run on CPU (gated_delta, gated_delta_ref,
causal_conv1d): they import their Triton modules only when a kernel is launched.
"""
