"""README.md for every checkpoint llmopt writes: Hugging Face metadata (base model and relation,
library, tags, pipeline, the source's license), what made it (command, scheme, method), its
evaluation when there is one, and which consumers load it — from ``llmopt.json`` and config.json,
rewritten whenever ``llmopt.json`` is."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

CARD = "README.md"
VLLM_BITS = {4, 8}  # integer widths vLLM's compressed-tensors kernels take (W4A16 / W8A16 / W8A8)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # config.json keys of mixture-of-experts models
MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]$")  # names transformers renames on load


def _front_matter(text: str) -> dict[str, str]:
    """``key: value`` lines of a README's YAML front matter (flat keys only)."""
    found = re.match(r"^---\n(.*?)\n---", text, re.S)
    if not found:
        return {}
    return dict(m.groups() for m in re.finditer(r"^([A-Za-z_]+):\s*(\S.*)$", found.group(1), re.M))


def command_line() -> str | None:
    """The ``llmopt …`` command line of this process, when it is the CLI (its script or ``python -m llmopt``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    is_cli = (sys.argv and Path(sys.argv[0]).name == "llmopt") or (spec is not None and spec.name.startswith("llmopt"))
    return "llmopt " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if is_cli else None


def consumers(config: dict) -> dict[str, str]:
    """Per consumer (transformers, vLLM, llama.cpp, llmopt): ``loads`` or why it does not, from a
    checkpoint's config.json."""
    qc = config.get("quantization_config") or {}
    if not qc:
        return {"transformers": "loads", "vLLM": "loads", "llama.cpp": "after `llmopt export --type …` (GGUF)", "llmopt": "loads"}
    if qc.get("quant_method") == "bitsandbytes":
        return {"transformers": "loads (bitsandbytes)",
                "vLLM": "loads on GPUs (bitsandbytes; not measured by llmopt); its CPU build (0.32) has no bitsandbytes "
                        "method (measured)",
                "llama.cpp": "no GGUF type holds NF4: `llmopt export` writes it dequantized", "llmopt": "loads"}
    groups = (qc.get("config_groups") or {}).values()
    weights = [g.get("weights") or {} for g in groups]
    targets = [t for g in groups for t in g.get("targets") or []]
    embedding = any(re.search(r"embed_tokens|wte|word_embeddings", t) for t in targets)
    head = any(re.search(r"(^|\.)lm_head$", t) for t in targets)
    odd = sorted({f"{w.get('num_bits')}-bit" for w in weights if w.get("type") == "int" and w.get("num_bits") not in VLLM_BITS})
    # float zero points (llama.cpp's mins, naive-quantized): transformers reads them, vLLM does not
    floats = [str(w.get("zp_dtype", "")).startswith("torch.float") for w in weights]
    float_zero = any(floats)
    asym = any(w.get("symmetric") is False and not f for w, f in zip(weights, floats))
    activations = {(g.get("input_activations") or {}).get("type") for g in groups} - {None}
    moe = any(config.get(key) for key in MOE_KEYS)
    dense_copy = "`llmopt export --format hf` writes a dense copy"
    out = {"llmopt": "loads (`llmopt eval`, `llmopt serve`)"}
    out["transformers"] = (
        f"cannot load a quantized embedding (compressed-tensors); {dense_copy}" if embedding
        else f"cannot load integer zero points (compressed-tensors 0.20 builds them in another shape than it stores them, "
             f"measured); {dense_copy}" if asym
        else f"cannot load it: transformers 5.25 fails to convert these experts (int8 activations, or formats named by "
             f"Mixtral's on-disk names) into its fused experts (measured); {dense_copy}"
        if moe and ("int" in activations or any(MIXTRAL_EXPERT.search(t) for t in targets))
        else "loads")
    problems = ([f"no kernel for {', '.join(odd)} codes"] if odd else []) + (["no quantized embedding / head"] if embedding or head else [])
    # vLLM 0.32 takes naive-quantized integer weights only beside quantized activations (an assertion on load, measured)
    problems += ["no loader for float zero points (llama.cpp's mins, naive-quantized)"] if float_zero else []
    weight_only_8 = any((g.get("weights") or {}).get("num_bits") == 8 and (g.get("weights") or {}).get("type") == "int"
                        and not g.get("input_activations") for g in groups)
    # experts its CPU build (0.32) has no MoE kernel for (measured): FP8, int4 with int8 activations, asymmetric int4
    cpu_moe_gap = moe and ("float" in activations or asym or any(
        (g.get("weights") or {}).get("num_bits") == 4 and (g.get("input_activations") or {}).get("type") == "int" for g in groups))
    out["vLLM"] = ("cannot serve it: " + "; ".join(problems) + " (quantize with `--for vllm`)" if problems
                   else "loads on GPUs; its CPU build has no 8-bit weight-only kernel" if weight_only_8
                   else "loads on GPUs (not measured by llmopt); its CPU build (0.32) has no MoE kernel for these experts "
                        "(measured)" if cpu_moe_gap else "loads")
    out["llama.cpp"] = "after `llmopt export --type auto` (codes carried into GGUF blocks where a type holds them)"
    fp4_groups = [w for w in weights if w.get("type") == "float" and w.get("num_bits") == 4]
    if fp4_groups:  # NVFP4A16 (groups of 16) / MXFP4A16 (groups of 32)
        out["transformers"] = ("loads in bfloat16 (compressed-tensors 0.20 decompresses FP4 weights to bfloat16, so a "
                               "float32 load fails in its first matmul)")
        out["vLLM"] = "loads on GPUs with FP4 kernels (not measured by llmopt)"
        out["llmopt"] = "loads (`llmopt eval`, `llmopt serve`: E2M1 codes run on the fp8 kernel)"
        out["llama.cpp"] = ("after `llmopt export --type auto`: MXFP4 codes carried into MXFP4 blocks" if all(
            w.get("group_size") == 32 for w in fp4_groups) else "after `llmopt export --type auto`, in F16 (GGUF has no NVFP4 type)")
    if any(a.get("location") == "input" for g in ((qc.get("transform_config") or {}).get("config_groups") or {}).values()
           for a in g.get("apply") or []):  # R4: its consumers must transform those inputs at run time
        if out["transformers"].startswith("loads"):  # a checkpoint it cannot load says so first
            out["transformers"] = ("loads but ignores the online Hadamard in transform_config (transformers 5.25, measured): "
                                   "wrong outputs; use `llmopt.load_model`, or `llmopt export --format hf` for a dense copy")
        out["vLLM"] = ("its CPU build (0.32) cannot: no hadacore_transform op (measured); its GPU builds run "
                       "compressed-tensors' online Hadamards (not measured by llmopt)")
        out["llama.cpp"] = "no: GGUF cannot carry the online Hadamard; `llmopt export --format hf` writes a dense copy"
        out["llmopt"] = "loads (`llmopt eval`, `llmopt serve`: the Hadamard runs as a fast Walsh–Hadamard transform)"
    return out


def base_model(record: dict) -> str | None:
    """The Hub id of the model a checkpoint was made from (its source's, when that came from the Hub)."""
    from llmopt.checkpoints.hub import hub_origin

    origin = record.get("hub") or hub_origin(record.get("source")) or {}
    return origin.get("repo_id")


def source_license(directory: Path, record: dict) -> str | None:
    """The license a checkpoint's README states, else its source's."""
    for folder in (Path(directory), Path(str(record.get("source") or ""))):
        card = folder / CARD
        found = _front_matter(card.read_text(errors="replace")).get("license") if card.is_file() else None
        if found:
            return found
    return None


def card_text(directory: Path, record: dict) -> str:
    """The README.md of the checkpoint in ``directory`` described by ``record`` (its llmopt.json)."""
    source = record.get("source_spec") or record.get("source") or ""
    base = base_model(record)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    license_ = source_license(Path(str(record.get("source") or "")), {})
    scheme, method = record.get("scheme"), record.get("method")
    stage = record.get("stage") or ("quantize" if scheme else "prune" if record.get("sparsity") or record.get("depth")
                                    or record.get("width") else "distill" if "teacher" in record else "export")
    relation = {"quantize": "quantized", "distill": "finetune"}.get(stage)
    tags = ["llmopt", *(["compressed-tensors"] if config.get("quantization_config") else []),
            *([scheme.lower()] if scheme else []), *([method.lower()] if method else [])]
    meta = ["library_name: transformers", "pipeline_tag: text-generation", "tags:", *[f"- {t}" for t in dict.fromkeys(tags)]]
    if base:
        meta = [f"base_model: {base}", *([f"base_model_relation: {relation}"] if relation else []), *meta]
    if license_:
        meta.append(f"license: {license_}")
    what = " ".join(x for x in (scheme, "by " + method if method else None) if x) or stage
    rotated = _rotation_words(record.get("rotation"))
    lines = ["---", *meta, "---", "", f"# {directory.name.removeprefix('.').split('.tmp')[0] or 'checkpoint'}", "",
             f"{what} of `{source}`{f', {rotated},' if rotated else ''} made with llmopt {record.get('versions', {}).get('llmopt', '')}.".replace("  ", " "), ""]
    command = record.get("command")
    if command:
        lines += ["```bash", command, "```", ""]
    qad = record.get("quantization_aware_distillation")
    if isinstance(qad, dict):
        lines += [f"Then trained by quantization-aware distillation against `{qad.get('teacher')}` ({qad.get('steps')} steps, "
                  f"{qad.get('codes_changed', 0):,} codes moved; same format):", ""]
        if qad.get("command"):
            lines += ["```bash", qad["command"], "```", ""]
    evaluation = record.get("evaluation")
    if isinstance(evaluation, dict):
        figures = {k: v for k, v in evaluation.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if figures:
            lines += ["## Evaluation", "", "| measure | value |", "|---|---:|",
                      *[f"| {k} | {v:.4g} |" for k, v in figures.items()], ""]
    if record.get("source_sparsity"):
        lines += [f"Keeps its source's {record['source_sparsity']['pattern']} sparsity (compressed-tensors `sparsity_config`).", ""]
    lines += ["## Runs with", "", "| consumer | |", "|---|---|",
              *[f"| {name} | {note} |" for name, note in consumers(config).items()], "",
              "How it was made, in full: `llmopt.json`.", ""]
    return "\n".join(lines)


def write_model_card(directory: str | Path, record: dict) -> None:
    """Write README.md into ``directory`` (a checkpoint being built or finished) from ``record``."""
    directory = Path(directory)
    (directory / CARD).write_text(card_text(directory, record))


def _rotation_words(rotation: dict | None) -> str | None:
    """How the weights were rotated before quantizing, in words (None when they were not)."""
    if not rotation:
        return None
    from llmopt.formats.hadamard import OnlineHadamard

    blocks = sorted({t.block for t in OnlineHadamard.from_record(rotation.get("online"))})
    words = [] if rotation.get("kind") in (None, "none") else [f"a {rotation['kind']} rotation (fused)"]
    if blocks:
        words.append(f"online Hadamards in blocks of {' / '.join(map(str, blocks))}")
    return ("after " + " and ".join(words)) if words else None
