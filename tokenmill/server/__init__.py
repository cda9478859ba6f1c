"""The OpenAI-compatible HTTP server (FastAPI): see app.py and serve.py."""
