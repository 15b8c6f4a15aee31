"""`colibri serve`: an OpenAI- and Anthropic-compatible HTTP server over one Engine.

app.py builds the FastAPI app (create_app), service.py holds what the endpoints share,
openai_api.py / anthropic_api.py translate requests and responses, tools.py parses tool calls,
metrics.py exposes Prometheus figures, cli.py is the command. The HTTP layer only
translates: generation, batching and caching live in the engine.
"""

from colibri.serve.app import create_app
from colibri.serve.service import Service

__all__ = ["Service", "create_app"]
