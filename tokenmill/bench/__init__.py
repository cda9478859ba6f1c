"""`tokenmill bench`: a pure HTTP client harness for any OpenAI-compatible server.

Modes (one module each): depth (llama-benchy's method), serve (vLLM's serving metrics),
steady (steady-state decode), compare (A/B tables of saved results), tools (tool-calling
evaluation). Shared rooms: client (streaming requests), corpus (prompt text and token
counts), stats, table, plot, progress.
"""
