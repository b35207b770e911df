"""The export stage: a checkpoint written as GGUF (llama.cpp), dense safetensors or compressed-tensors."""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.core.errors import LlmoptError
from llmopt.formats.export import DTYPES, FORMATS
from llmopt.formats.gguf_blocks import USER_TYPES
from llmopt.pipeline.stages.base import option
from llmopt.quant.llama_mixtures import MIXTURES

# the mixtures `--type` takes by name (Q8_0, Q6_K, IQ4_NL, IQ4_XS name single types there)
EXPORT_MIXTURES = tuple(m for m in MIXTURES if m not in USER_TYPES)

GGUF_ONLY = ("type", "dense_type", "requantize", "verify", "verify_text")


@dataclass
class ExportConfig:
    """Everything ``llmopt export`` / a recipe's export stage takes."""

    model: str = option(help="Model to export.", argument=True, runner_owned=True)
    output: str = option(help="Output: a .gguf file, or a directory for hf / compressed-tensors.", short="-o", runner_owned=True)
    format: str | None = option(None, "Output format (default: gguf when OUTPUT ends in .gguf, else hf).", choices=FORMATS, aliases=("fmt",))
    type: str = option("auto", "GGUF tensor type. auto: exact where a block type holds our codes (int4 sym → Q4_0, int4 asym → Q4_1, "
                       "int8 sym → Q8_0), else F16; lossless float for dense checkpoints. A llama.cpp mixture (Q4_K_M, Q5_K_M, "
                       "Q3_K_M …): llama.cpp's type for every tensor — a checkpoint quantized with --scheme of that name is "
                       "carried exactly, a float one is rounded to those types first (no calibration).",
                       choices=(*USER_TYPES, *EXPORT_MIXTURES), case_sensitive=False,
                       aliases=("gguf_type",))
    dense_type: str | None = option(None, "GGUF type for float matrices (embeddings, lm_head, unquantized layers); default: --type for "
                                    "dense checkpoints (output matrix Q6_K with 4-bit types, as llama.cpp), F16 for quantized ones.",
                                    choices=USER_TYPES, case_sensitive=False)
    requantize: bool = option(False, "Allow rounding quantized weights again into a type that cannot hold their codes (e.g. int8 → Q4_0, int4 → Q4_K).")
    verify: bool = option(False, "Also load the GGUF through transformers' GGUF loader and compare token ids and logits with the source.")
    verify_text: str | None = option(None, "Text for --verify (default: two short sentences).", metavar="TEXT")
    dtype: str = option("auto", "--format hf: dtype of the written weights (auto: the checkpoint's).", choices=("auto", *DTYPES))
    overwrite: bool = option(False, "Replace an existing output.", runner_owned=True)

    @property
    def resolved_format(self) -> str:
        return self.format or ("gguf" if str(self.output).lower().endswith(".gguf") else "hf")

    def check(self) -> None:
        """Refuse options that do not apply to the chosen format."""
        fmt = self.resolved_format
        if fmt == "gguf":
            if self.dtype != "auto":
                raise LlmoptError("--dtype applies to --format hf only; GGUF types are chosen with --type / --dense-type",
                                  "drop --dtype, or export with --format hf")
            return
        given = [f"--{name.replace('_', '-')}" for name in GGUF_ONLY
                 if getattr(self, name) not in (None, False, "auto")]
        if given:
            raise LlmoptError(f"{', '.join(given)} apply to --format gguf only, not {fmt}", "drop them, or export to a .gguf file")
        if fmt == "compressed-tensors" and self.dtype != "auto":
            raise LlmoptError("--dtype applies to --format hf only; compressed-tensors keeps the checkpoint's codes", "drop --dtype")


def run_export(config: ExportConfig, progress=None):
    """Export and return the exporter's report (``to_dict()`` for the record)."""
    from llmopt.formats.export import export_model

    config.check()
    fmt = config.resolved_format
    if fmt == "gguf" and config.type.upper() in EXPORT_MIXTURES:
        return _export_mixture(config, progress)
    if fmt == "gguf":
        return export_model(config.model, config.output, "gguf", gguf_type=config.type, dense_type=config.dense_type,
                            requantize=config.requantize, overwrite=config.overwrite, verify=config.verify,
                            verify_text=config.verify_text)
    return export_model(config.model, config.output, fmt, dtype=config.dtype, overwrite=config.overwrite)


def _export_mixture(config: ExportConfig, progress=None):
    """A GGUF file of llama.cpp's mixture ``config.type``: a checkpoint quantized as that mixture is
    carried exactly; a float checkpoint is first rounded to the mixture's types (RTN, into a scratch
    checkpoint beside the output, removed afterwards)."""
    import os
    import shutil
    from pathlib import Path

    from llmopt.checkpoints.models import read_config, resolve_model
    from llmopt.checkpoints.provenance import read_provenance
    from llmopt.formats.export import export_model
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    mixture = config.type.upper()
    if config.dense_type or config.requantize:
        raise LlmoptError(f"--type {mixture} sets every tensor's type: --dense-type / --requantize do not apply",
                          "drop them")
    path = resolve_model(config.model)
    settings = read_config(path)
    options = dict(requantize=False, overwrite=config.overwrite, verify=config.verify, verify_text=config.verify_text,
                   mixture=mixture)
    if settings.get("quantization_config"):
        made = (read_provenance(path).get("llama_mixture") or {}).get("mixture")
        if made != mixture:
            raise LlmoptError(f"{config.model} was not quantized as llama.cpp's {mixture} ({made or 'another scheme'})",
                              f"export it with --type auto, or quantize the float model with --scheme {mixture}")
        return export_model(str(path), config.output, "gguf", gguf_type="auto", **options)
    output = Path(config.output)
    scratch = output.parent / f".{output.name}.{mixture.lower()}-{os.getpid()}"
    try:
        run_quantize(QuantizeConfig(model=str(path), output=str(scratch), scheme=mixture, method="rtn"), progress)
        report = export_model(str(scratch), config.output, "gguf", gguf_type="auto", **options)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.notes.append(f"{mixture} from a float checkpoint: rounded to llama.cpp's types without calibration; "
                        f"llmopt quantize --scheme {mixture} --method gptq finds better codes on the same types")
    return report
