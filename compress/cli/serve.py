"""``llmopt serve``: an OpenAI-compatible HTTP server on llmopt's runtime."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import click

from llmopt.cli.common import MODEL_HELP, hub_options, user_errors
from llmopt.core.errors import LlmoptError
from llmopt.cli.engine_options import engine_options, engine_settings



def _check_port(host: str, port: int) -> None:
    """A clear error now, rather than uvicorn's after the model has loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LlmoptError(f"port {port} on {host} is already in use", "pass another --port, or stop the other server") from None
            raise LlmoptError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", "check --host and --port") from None


@click.command("serve", epilog=MODEL_HELP)
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default; 0.0.0.0 exposes the server).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--api-key", envvar="LLMOPT_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint but /health (env: LLMOPT_API_KEY).")
@click.option("--served-model-name", help="The model id clients pass (default: MODEL as given).")
@click.option("--max-waiting", default=128, show_default=True, type=click.IntRange(0),
              help="Sequences that may queue beyond --max-num-seqs; more get 429 at once.")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(0),
              help="On SIGTERM, seconds in-flight requests get to finish before they are aborted.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), help="A Jinja chat template file (default: the tokenizer's).")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1),
              help="Open connections at most; beyond it uvicorn answers 503 at once.")
@click.option("--send-timeout", default=30.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds one streamed event may take to send; a client that stops reading longer is aborted "
                   "(its KV blocks freed).")
@engine_options()
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]),
              help="uvicorn's log level (info shows every request).")
@user_errors
@hub_options()
def serve_command(model, host, port, api_key, served_model_name, max_waiting, shutdown_timeout, chat_template,
                  max_connections, send_timeout, log_level, **engine):
    """Serve MODEL over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions (streaming
    with server-sent events), /v1/models, /tokenize, /detokenize, /version, /health and /metrics
    (Prometheus, vLLM's metric names).

    Engine settings saved with the model (a checkpoint's llmopt.json 'runtime' block, or the
    runtime section of the recipe whose output folder is served) apply unless an option overrides them.
    SIGTERM stops admitting requests, lets in-flight ones finish (--shutdown-timeout) and exits 0.

    \b
    Examples:
      llmopt serve out/w4-gptq --port 8000
      LLMOPT_API_KEY=secret llmopt serve demo --max-num-seqs 16 --max-waiting 32
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "demo", "prompt": "The capital of France is", "max_tokens": 16}'
    """
    from llmopt.core.console import err
    from llmopt.runtime import LLMEngine
    from llmopt.runtime.threads import call_in_passing_thread
    from llmopt.serve import ServeSettings, build, resolve_served_model
    from llmopt.serve.settings import ServeLimits

    if api_key is not None and not api_key.strip():
        raise LlmoptError("--api-key is empty", "pass a non-empty key or leave it out")
    template = Path(chat_template).read_text() if chat_template else None
    _check_port(host, port)
    path, saved, source = resolve_served_model(model)
    settings = dict(saved)
    settings.update(engine_settings(engine, saved))
    if source:
        err.print(f"[dim]engine settings from {source}: {saved}[/dim]", highlight=False)
    engine = call_in_passing_thread(lambda: LLMEngine(path, **settings))  # one OpenMP pool: the engine thread's
    limits = ServeLimits(send_timeout_s=send_timeout)
    server, state = build(lambda: engine, ServeSettings(served_model_name or model, api_key, max_waiting, template, limits),
                          host, port, shutdown_timeout, log_level, max_connections)
    where = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    err.print(f"serving {path} ({engine.config.device}, {engine.config.dtype}) as '{state.settings.model_name}' "
              f"on {where}/v1 "
              f"({engine.config.max_num_seqs} sequences at once, {max_waiting} more may wait"
              f"{', API key required' if api_key else ''}); Ctrl-C or SIGTERM stops it", highlight=False)
    server.run()
    if state.load_error:
        raise LlmoptError(f"the server could not start the engine: {state.load_error}", "see the message above")
