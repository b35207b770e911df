"""Run the app under uvicorn with a graceful SIGTERM: stop admitting (503), let in-flight
requests finish for up to ``shutdown_timeout`` seconds, abort the rest, exit normally. When the
engine dies (``ServeSettings.exit_on_engine_death``) the server stops and ``run()`` raises
:class:`EngineFailed` (the CLI exits 1), so a supervisor restarts it."""

from __future__ import annotations

import signal
from collections.abc import Callable

from llmopt.core.errors import LlmoptError
from llmopt.runtime import LLMEngine

from .app import ServerState, ServeSettings, create_app


class EngineFailed(LlmoptError):
    """The engine died while serving; the process should exit non-zero and be restarted."""

    exit_code = 1


class _Server:
    """A uvicorn server whose exit signals start draining and are not re-raised afterwards
    (uvicorn re-raises them, which would end the process with the signal instead of status 0)."""

    def __new__(cls, config, state: ServerState):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                state.draining = True
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True

            def run(self, *args, **kwargs) -> None:
                super().run(*args, **kwargs)
                failure = state.loop.dead if state.loop is not None else None
                if failure is not None and state.settings.exit_on_engine_death:
                    raise EngineFailed(f"the engine failed while serving: {failure}", "see the log above and restart the server")

        server = Server(config)
        state.on_fatal = lambda: setattr(server, "should_exit", True)
        return server


def build(loader: Callable[[], LLMEngine], settings: ServeSettings, host: str, port: int,
          shutdown_timeout: float = 30.0, log_level: str = "warning", max_connections: int | None = 1024):
    """``(uvicorn server, state)``; ``server.run()`` serves until SIGTERM / SIGINT or ``should_exit``.
    Beyond ``max_connections`` open connections (or tasks) uvicorn answers 503 at once."""
    import uvicorn

    state = ServerState(settings, loader)
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on", limit_concurrency=max_connections)
    return _Server(config, state), state
