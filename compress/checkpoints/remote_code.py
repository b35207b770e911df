"""``--trust-remote-code``: running a checkpoint's own Python code (its config's ``auto_map``)
is opt-in, per process or per call, never the default.

A trusted checkpoint's configuration and causal-LM classes are registered with transformers'
Auto classes for the rest of the process, so every loader (ours, the runtime's, the streaming
quantizer's) builds it without being told; tokenizers we load get ``trust_remote_code`` too.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from llmopt.core.errors import LlmoptError

_trusted = False


@contextmanager
def trusting(trust: bool | None):
    """Within the block, checkpoints may (True) or may not (False) run their own code; None keeps
    the setting around it."""
    global _trusted
    before = _trusted
    if trust is not None:
        _trusted = bool(trust)
    try:
        yield
    finally:
        _trusted = before


def remote_code_kwargs() -> dict:
    """For a ``from_pretrained`` call: ``trust_remote_code`` when trusted, else nothing."""
    return {"trust_remote_code": True} if _trusted else {}


def needs_remote_code(config: dict) -> bool:
    """True when transformers cannot build ``config`` with the classes it knows (or was given)."""
    if not config.get("auto_map"):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return config.get("model_type") not in CONFIG_MAPPING


def check_remote_code(path: Path, config: dict, spec: str) -> None:
    """Refuse a checkpoint that needs its own code unless trusted; register its classes if trusted."""
    if not needs_remote_code(config):
        return
    if not _trusted:
        classes = ", ".join(config["auto_map"]) if isinstance(config["auto_map"], dict) else "custom classes"
        raise LlmoptError(f"{spec} needs its own Python code to load (config.json auto_map: {classes})",
                          "pass --trust-remote-code if you trust that repository's code")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    try:
        config_class = type(AutoConfig.from_pretrained(path, trust_remote_code=True))
        AutoConfig.register(config["model_type"], config_class, exist_ok=True)
        if "AutoModelForCausalLM" in config["auto_map"]:
            model_class = get_class_from_dynamic_module(config["auto_map"]["AutoModelForCausalLM"], str(path))
            model_class.register_for_auto_class("AutoModelForCausalLM")  # save_pretrained copies its code
            AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    except (ImportError, OSError, ValueError, AttributeError, KeyError) as exc:
        raise LlmoptError(f"cannot load the code of {spec}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                          "check the repository's Python files and their requirements") from exc
