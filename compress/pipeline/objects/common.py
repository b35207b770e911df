"""What the stages on a model object share: building their config, checking the model, and
turning the ``dataset`` argument into calibration windows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.core.errors import LlmoptError

IN_MEMORY = "<in memory>"  # the config's model / output fields for a model object
Refusal = tuple[str, Callable[[Any], bool], str, str]  # option, test of its value, problem, fix


def refuse(values: dict, refusals: tuple[Refusal, ...]) -> None:
    """Refuse options that need a checkpoint on disk: each refusal names the option, a test of
    its value, the problem and the fix."""
    for name, applies, problem, fix in refusals:
        if name in values and applies(values[name]):
            raise LlmoptError(problem, fix)


def layer_device(model: Any, device: str) -> str | None:
    """Where each layer of ``model`` is calibrated (``device`` as the stages take it; ``auto``
    keeps a model on a GPU on its own GPU); a model spread over several devices is refused."""
    from llmopt.calibration import resolve_device

    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        raise LlmoptError(f"the model is spread over several devices ({', '.join(devices)})",
                          "pass the checkpoint's path instead: llmopt streams each layer through one device")
    if device == "auto" and devices and devices[0].startswith("cuda"):
        return devices[0]
    target = resolve_device(device)
    return None if target is None else str(target)


def build(config_cls: type, values: dict) -> Any:
    """The stage's config from the API's options, with placeholders for the runner-owned fields."""
    import dataclasses

    from llmopt.pipeline.stages.base import build_config

    owned = {f.name: IN_MEMORY for f in dataclasses.fields(config_cls) if f.name in ("model", "output")}
    return build_config(config_cls, {**owned, **values}, label=lambda name: f"{name}=")


def calibration(config: Any, values: dict, dataset: Any, tokenizer: Any, model: Any, samples: int) -> tuple[Any, dict]:
    """Calibration windows from ``dataset`` (else the config's ``calib`` corpus), sized as the
    config says; data in memory gets what it holds where ``calib_samples`` / ``calib_seq_len``
    were not given (:func:`~llmopt.core.calibration_data.calibration_windows`)."""
    from llmopt.core.calibration_data import calibration_windows
    from llmopt.core.data import SELF, calibration_parts

    if dataset is not None and "calib" in values:
        raise LlmoptError("dataset= and calib= both name the calibration data", "pass one of them")
    data = config.calib if dataset is None else dataset
    if isinstance(data, str) and SELF in calibration_parts(data):
        raise LlmoptError(f"calibration text '{SELF}' is sampled from a checkpoint by llmopt's runtime",
                          "pass a corpus, texts or token ids as dataset=, or the model's path")
    return calibration_windows(data, tokenizer, samples=values.get("calib_samples"), seq_len=values.get("calib_seq_len"),
                               seed=config.seed, defaults=(samples, config.calib_seq_len),
                               vocab_size=getattr(model.config, "vocab_size", None))


def no_dataset(dataset: Any, what: str) -> None:
    """Refuse calibration data for a job that takes none."""
    if dataset is not None:
        raise LlmoptError(f"{what} takes no calibration data", "drop dataset=, or pick a calibrated method")


def prepare(model: Any, config_cls: type, values: dict, refusals: tuple[Refusal, ...], verb: str, again: str,
            placeholders: dict | None = None) -> Any:
    """Check the model (a float transformers causal LM in memory) and the options, build the
    stage's config (``placeholders`` fill its fields a model object stands for), and check the
    output path when one is given, all before any work."""
    from llmopt.checkpoints.attached import refuse_quantized
    from llmopt.checkpoints.in_memory import check_model_object
    from llmopt.core.atomic import check_output

    check_model_object(model, verb)
    refuse_quantized(model, again)
    refuse(values, refusals)
    config = build(config_cls, {**(placeholders or {}), **values})
    if "output" in values:
        check_output(Path(values["output"]), config.overwrite)
    return config


def finish(model: Any, record: dict, start: float, config: Any, values: dict, tokenizer: Any,
           weights: dict | None = None, ignore: list[str] | None = None) -> Any:
    """Attach the stage's record (and codes) to the model, write it to ``output`` if given; the model."""
    from llmopt.checkpoints.attached import attach, save_model
    from llmopt.checkpoints.provenance import finish_record

    attach(model, finish_record(record, start), weights, ignore)
    if "output" in values:
        save_model(model, values["output"], tokenizer, overwrite=config.overwrite)
    return model
