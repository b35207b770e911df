"""Engine defaults saved with a model: a checkpoint's ``llmopt.json`` ``runtime`` block, or the
``runtime`` section of the recipe whose output folder is served; and the server's request limits
(:class:`ServeLimits`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llmopt.core.errors import LlmoptError
from llmopt.runtime.config import EngineConfig

RECIPE_FILE = "recipe.resolved.json"
RUN_FILE = "run.json"


@dataclasses.dataclass
class ServeLimits:
    """What one request may ask for; beyond these it gets a 4xx at once (OpenAI's error shape),
    never a 5xx or an unbounded amount of work on the engine thread.

    ``max_body_bytes``: a larger request body gets 413 before it is parsed. ``max_prompt_tokens``:
    a longer prompt gets 400 (always at most the model's context, ``max_model_len`` less one
    token to generate; ``None``: just that). ``max_n``: choices per request (also capped by the
    admission capacity, so a request that could never be admitted gets 400, not a permanent 429).
    ``max_stop_sequences`` / ``max_stop_chars``: the number and length of stop strings (the text
    held back while it could still become a stop string grows with their length).
    ``greedy_below``: a ``temperature`` below it samples greedily, as 0 does (dividing logits by
    1e-30 gives infinities and NaN probabilities; vLLM's rule, same threshold).
    ``engine_error_limit``: that many engine-loop errors in a row, with no good step between,
    mark the engine dead (``/health`` 503, everything in flight fails, the server exits non-zero).
    ``send_timeout_s``: a streamed event that cannot be sent within that many seconds (a client
    that stopped reading) aborts its request: the engine sequences stop, slots and KV blocks are freed.
    """

    max_body_bytes: int = 8 * 2**20
    max_prompt_tokens: int | None = None
    max_n: int = 16
    max_stop_sequences: int = 4
    max_stop_chars: int = 256
    greedy_below: float = 1e-5
    engine_error_limit: int = 3
    send_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_stop_sequences", "max_stop_chars", "engine_error_limit"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise LlmoptError(f"server limit {name} must be an integer >= 1, got {getattr(self, name)!r}", f"fix {name}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1):
            raise LlmoptError(f"server limit max_prompt_tokens must be None or an integer >= 1, got {self.max_prompt_tokens!r}",
                              "fix max_prompt_tokens")
        if not isinstance(self.send_timeout_s, (int, float)) or not self.send_timeout_s > 0:
            raise LlmoptError(f"server limit send_timeout_s must be a positive number of seconds, got {self.send_timeout_s!r}",
                              "fix send_timeout_s")
        if not 0 <= self.greedy_below < 1:
            raise LlmoptError(f"server limit greedy_below must be in [0, 1), got {self.greedy_below!r}", "fix greedy_below")


def resolve_served_model(model: str) -> tuple[str, dict, str | None]:
    """``(model to load, saved engine settings, where they came from)``.

    A recipe's output folder (it holds ``run.json``) serves the recipe's final checkpoint with
    the recipe's ``runtime`` settings; a checkpoint uses its ``llmopt.json`` ``runtime`` block,
    else the ``runtime`` of a recipe whose output folder holds it.
    """
    path = Path(model)
    if not path.is_dir():
        return model, {}, None
    if (path / RUN_FILE).is_file() and (path / RECIPE_FILE).is_file():
        final = _read(path / RUN_FILE).get("final")
        if not final or not Path(final).is_dir():
            raise LlmoptError(f"{path / RUN_FILE} names no finished checkpoint", f"finish the recipe (llmopt run) or serve a checkpoint folder")
        runtime = _read(path / RECIPE_FILE).get("runtime") or {}
        return str(final), _checked(runtime, path / RECIPE_FILE), str(path / RECIPE_FILE)
    record = path / "llmopt.json"
    if record.is_file() and isinstance(_read(record).get("runtime"), dict):
        return model, _checked(_read(record)["runtime"], record), str(record)
    recipe = path.parent / RECIPE_FILE
    if recipe.is_file():
        runtime = _read(recipe).get("runtime") or {}
        if runtime:
            return model, _checked(runtime, recipe), str(recipe)
    return model, {}, None


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LlmoptError(f"cannot read {file}: {exc}", "fix or remove the file") from exc
    return data if isinstance(data, dict) else {}


def _checked(runtime: dict, source: Path) -> dict:
    if not isinstance(runtime, dict):
        raise LlmoptError(f"{source}: 'runtime' must be a mapping", "e.g. \"runtime\": {\"max_num_seqs\": 32}")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(runtime) - known)
    if unknown:
        raise LlmoptError(f"{source}: unknown runtime setting '{unknown[0]}'", f"known settings: {', '.join(sorted(known))}")
    return dict(runtime)
