"""``llmopt serve``: an OpenAI-compatible HTTP server on llmopt's runtime (FastAPI + uvicorn).

One background thread owns the engine (:mod:`.engine_loop`); :mod:`.app` holds the endpoints,
auth and admission control; :mod:`.server` runs it with a graceful SIGTERM.
"""

from .app import ServerState, ServeSettings, create_app
from .server import build
from .settings import resolve_served_model

__all__ = ["ServeSettings", "ServerState", "build", "create_app", "resolve_served_model"]
