"""Triton kernels, each beside the pure-PyTorch reference it is tested against.

Nothing here is imported by `import tokenmill`: every module in this package imports triton at
its top, so callers import the module they need only once they know triton is wanted.
"""
