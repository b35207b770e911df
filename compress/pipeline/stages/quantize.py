"""The quantize stage: checkpoint in → quantized compressed-tensors (or NF4) checkpoint out.

The scheme is parsed once, here, into a :class:`~llmopt.formats.schemes.QuantScheme` (group
size included); that object goes to the algorithms and, on every quantized weight, to the
writer that turns it into the saved ``quantization_config``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from llmopt.checkpoints.models import float_source, load_model
from llmopt.checkpoints.provenance import finish_record, read_provenance, versions
from llmopt.core.atomic import check_output
from llmopt.core.data import CALIB_HELP
from llmopt.core.errors import LlmoptError
from llmopt.core.patterns import check_ignore_pattern, ignore_matches
from llmopt.formats.schemes import PRESETS, QuantScheme
from llmopt.pipeline.stages.base import device_option, eval_option, option, overwrite_option
from llmopt.pipeline.stages.evaluate import evaluate_output
from llmopt.quant.apply import QuantizeResult
from llmopt.quant.channel_order import ChannelOrderResult, for_llama_cpp
from llmopt.quant.head_fisher import FISHER_ROWS
from llmopt.quant.method import QuantMethod
from llmopt.quant.outer import OUTER_CHOICES
from llmopt.quant.consumers import CONSUMERS
from llmopt.quant.llama_mixtures import MIXTURES
from llmopt.quant.planner import AutoPlanner
from llmopt.quant.registry import build_method, method_names
from llmopt.quant.rotation import ROTATIONS

ONLINE_HADAMARD = ("auto", "on", "off", "all")
from llmopt.quant.request import QuantizeRequest, resolve_scheme
from llmopt.quant.rtn import Rtn
from llmopt.quant.streaming import StreamedQuantization

NF4 = "NF4"
LEARNED = "learned"
AUTO = "AUTO"
CALIBRATION_DEFAULTS = {"calib": "austen", "calib_samples": 128, "calib_seq_len": 512}
LEARNED_ROTATION_DEFAULTS = {"rotate_steps": 50, "rotate_lr": 1.5}  # options that apply only with --rotate learned
# Fields of QuantizeConfig that are options of a method object (the same names as its fields);
# a value other than the field's default counts as given, and a method that lacks it refuses it.
METHOD_OPTIONS = ("act_order", "float_targets", "scale_refit", "damp", "alpha", "clip_search")


@dataclass
class QuantizeConfig:
    """Everything ``llmopt quantize`` / a recipe's quantize stage takes."""

    model: str = option(help="Model to quantize.", argument=True, runner_owned=True)
    output: str = option(help="Output checkpoint directory.", short="-o", runner_owned=True)
    scheme: str = option(help="W4A16, W4A16_ASYM, W8A16, W8A8, W4A8, FP8, FP8_DYNAMIC or NF4 (compressed-tensors names; "
                              "W8A8 / W4A8 / FP8_DYNAMIC also round each token's inputs at run time); "
                              "IQ4_NL: llama.cpp's non-uniform 4-bit grid, groups of 32 (int8 grid codes in the checkpoint, "
                              "IQ4_NL blocks in a GGUF export); "
                              "AUTO: a format per tensor from measured sensitivities (--target-bpw, --target-kld or --plan); "
                              "Q4_K_M, Q5_K_M, Q3_K_M … (llama.cpp's mixtures: its type for every tensor, codes found by "
                              "--method on those types' grids, carried exactly by a GGUF export).",
                         metavar="SCHEME")
    method: str = option("rtn", f"{', '.join(method_names())} (a scale transform then a quantizer).", metavar="METHOD")
    rotate: str = option("none", "Rotate the model first (QuaRot / SpinQuant's offline rotations, fused into the "
                         "weights): hadamard (randomized Hadamard on the residual stream and per attention head) or "
                         "orthogonal (random orthogonal); the output stays an ordinary checkpoint, its head untied. With a scheme "
                         "that quantizes activations (W8A8, W4A8, FP8_DYNAMIC) it adds an online Hadamard before each "
                         "MLP down_proj (R4, in compressed-tensors' transform_config), which its consumers must run. "
                         "learned: SpinQuant's residual rotation optimised on the calibration windows (Cayley SGD from the "
                         "randomized Hadamard, --rotate-steps, the model held in memory).",
                         choices=ROTATIONS)
    rotate_steps: int = option(LEARNED_ROTATION_DEFAULTS["rotate_steps"], "--rotate learned: Cayley-SGD steps, one calibration window each (about three "
                               "forward passes per step).", min=1)
    rotate_lr: float = option(LEARNED_ROTATION_DEFAULTS["rotate_lr"], "--rotate learned: the Cayley step size.")
    online_hadamard: str = option("auto", "Online Hadamards, fused into the weights and run by consumers on the inputs at "
                                  "inference (compressed-tensors' transform_config; transformers and GGUF cannot run them). "
                                  "on: before every MLP down_proj (R4, with --rotate); all: before every decoder Linear "
                                  "(QuIP's input rotation in blocks: the best W4A16 accuracy, with or without --rotate); "
                                  "off: none; auto: on with --rotate for schemes that quantize activations.",
                                  choices=ONLINE_HADAMARD)
    group_size: int | None = option(None, "int4 / IQ4_NL group size (32/64/128; 0: per-channel). Default 128 (IQ4_NL: 32).", min=0)
    strict_groups: bool = option(False, "Refuse layers the group size does not divide instead of using the largest divisor.")
    calib: str = option("austen", CALIB_HELP)
    calib_samples: int = option(128, "Calibration windows.", min=1)
    calib_seq_len: int = option(512, "Tokens per calibration window.", min=8)
    seed: int = option(0, "Seed for the calibration sample offsets.")
    ignore: tuple[str, ...] = option((), "Keep matching Linears in float: a regular expression found in the name ('self_attn', 'mlp\\.down_proj') "
                                    "or compressed-tensors' 're:REGEX' matched from its start (repeatable; lm_head stays "
                                    "float unless --head says otherwise).", metavar="REGEX")
    head: str = option("float", "Output head: float, int8 (per row) or int6 / int5 / int4 / nl4 (groups of 32; int5a / "
                       "int4a: with zero points; nl4: llama.cpp's IQ4_NL grid, int8 codes in the checkpoint, GGUF IQ4_NL); "
                       "a tied head shares the embedding's.", choices=OUTER_CHOICES)
    embedding: str = option("float", "Token embedding: float, int8 (per row) or int6 / int5a / int5 / int4a / int4 / nl4 "
                            "(groups of 32).", choices=OUTER_CHOICES)
    target_bpw: float | None = option(None, "AUTO: bits per weight to fill, as written: every file's bytes × 8 over the "
                                      "source's parameter count (codes, 16-bit scales, zero points, float tensors).")
    target_kld: float | None = option(None, "AUTO: predicted mean KL divergence to stay under, with the fewest bits "
                                      "(or, with --objective speed, the fastest decode).")
    objective: str = option("size", "AUTO with --target-kld: spend as few bits as possible (size) or as little decode time "
                            "as possible, each format's time measured once on this machine in the runtime (speed).",
                            choices=("size", "speed"))
    size_of: str = option("checkpoint", "AUTO: count bits as the checkpoint's safetensors hold them or as the "
                          "exported --type auto GGUF file does (Q4_0 4.5, Q5_0 5.5, Q8_0 8.5 … bits per weight, metadata included).",
                          choices=("checkpoint", "gguf"))
    plan: str | None = option(None, "AUTO: reuse a plan (a plan.json, or a checkpoint's llmopt.json) instead of measuring.",
                              metavar="PATH")
    for_consumer: str = option("llmopt", "AUTO: plan only formats the stack that will run the checkpoint has kernels for: "
                               "vllm (int4 groups; float embedding and head), llama.cpp (GGUF block types), "
                               "transformers (symmetric formats, float embedding) or llmopt (all).",
                               choices=CONSUMERS, short="--for", metavar="CONSUMER")
    imatrix: str | None = option(None, "An importance matrix in llama.cpp's format (llama-imatrix's GGUF file): --method rtn "
                                 "searches each group's range weighing every input column by its mean squared input.",
                                 metavar="FILE")
    save_imatrix: str | None = option(None, "Also write the calibration's importance matrix in llama.cpp's format to FILE "
                                      "(calibrated methods), for llama-quantize --imatrix.", metavar="FILE")
    sensitivity_samples: int = option(4, "AUTO: calibration windows for the sensitivity pass (one forward + backward each).", min=1)
    price_by: str | None = option(None, "AUTO: price each Linear's candidate formats by the error GPTQ leaves on the "
                                  "sensitivity pass's inputs (gptq: one GPTQ solve per Linear and candidate format) "
                                  "or by round-to-nearest's "
                                  "(rtn: no solves; faster on large models without a GPU) "
                                  "[default: gptq for GPTQ methods, else rtn].",
                                  choices=("gptq", "rtn"))
    act_order: bool | None = option(None, "GPTQ: activation ordering with static groups, so the saved format stays plain [default: on for GPTQ methods].")
    float_targets: bool = option(False, "GPTQ: fit each Linear to the float model's outputs, the float model's hidden "
                                 "states run alongside (asymmetric calibration, as GPTAQ), rather than to its own "
                                 "output on the quantized model's inputs (about 3x the calibration time).")
    scale_refit: bool | None = option(None, "GPTQ: once a Linear's codes are chosen, re-solve its group scales by least "
                                      "squares against its input Hessian, quantize once more on them and keep each row's "
                                      "better result (2-3x GPTQ's solve time; the calibration forwards are unchanged) "
                                      "[default: on for GPTQ methods].")
    damp: float = option(0.01, "GPTQ: dampening, fraction of the mean Hessian diagonal.")
    tune_steps: int = option(0, "After quantizing, tune multipliers on every quantized weight's scales "
                             "(codes fixed) end to end against the float model's next-token distributions on the "
                             "calibration windows, one window per step (0: off; e.g. 128; about 3 forward passes per step).", min=0)
    tune_lr: float | None = option(None, "Scale tuning: Adam's peak step on the log-multipliers (needs --tune-steps). "
                                   "Default 1e-3, scaled down (to 1e-4 at least) for a checkpoint whose calibration KLD "
                                   "starts under 0.01 (near-float checkpoints need finer steps).")
    tune_per: str = option("group", "Scale tuning: one multiplier per scale (group; per super-block where scales are "
                           "k·d multiples, IQ4_XS / Q6_K) or one per output row (row).", choices=("group", "row"))
    alpha: float = option(0.5, "SmoothQuant migration strength.", aliases=("smooth_alpha",))
    clip_search: bool | None = option(None, "Search each group's clipping range (default: on for calibrated methods).")
    device: str = device_option()
    overwrite: bool = overwrite_option()
    eval: bool = eval_option()

    def __post_init__(self) -> None:
        self.scheme = self.scheme.upper()
        self.method = self.method.lower()

    def build_method(self) -> QuantMethod:
        """The method object of ``--method`` with the method options given (LlmoptError if one does not apply)."""
        defaults = {f.name: f.default for f in fields(self)}
        given = {k: getattr(self, k) for k in METHOD_OPTIONS if getattr(self, k) != defaults[k]}
        if self.imatrix is not None and self.clip_search is None:
            given["clip_search"] = True  # the importance matrix weighs the range search
        try:
            method = build_method(self.method, given)
        except ValueError as exc:
            raise LlmoptError(str(exc), "check --method and its options: llmopt quantize --help") from exc
        if self.is_mixture or self.for_consumer == "llama.cpp":
            method = for_llama_cpp(method)
        return method

    @property
    def needs_calibration(self) -> bool:
        return (self.build_method().calibrated or (self.scheme == AUTO and self.plan is None) or self.tune_steps > 0
                or self.rotate == LEARNED)

    @property
    def is_auto(self) -> bool:
        return self.scheme == AUTO

    @property
    def is_mixture(self) -> bool:
        """A llama.cpp mixture name (Q4_K_M …): every tensor gets llama.cpp's type for it (IQ4_NL keeps
        its meaning as a preset: every Linear on that grid)."""
        return self.scheme in MIXTURES and self.scheme not in PRESETS

    @property
    def plans_per_tensor(self) -> bool:
        return self.is_auto or self.is_mixture

    def parse_scheme(self) -> QuantScheme | None:
        """The scheme object for this request (None for NF4), or LlmoptError for impossible combinations."""
        if self.scheme == NF4:
            return None
        accepted = [*PRESETS, NF4, AUTO, *(m for m in MIXTURES if m not in PRESETS)]
        if self.scheme not in accepted and not self.scheme.endswith("FP4"):  # NVFP4 / MXFP4 get their own line
            raise LlmoptError(f"unknown scheme {self.scheme!r}", f"choose one of {', '.join(accepted)}")
        try:
            if self.plans_per_tensor:  # the plan gives each tensor its own scheme; W4A16 g32 describes the run
                return self.build_method().check(resolve_scheme("W4A16", 32), True)
            return self.build_method().check(resolve_scheme(self.scheme, self.group_size), True)
        except ValueError as exc:
            raise LlmoptError(str(exc)) from exc

    def request(self) -> QuantizeRequest:
        """The request this config asks for (not for NF4); an AUTO plan is added by :func:`run_quantize`."""
        head_float = ["lm_head"] if self.head == "float" else []
        return QuantizeRequest(self.parse_scheme(), self.build_method(), (*head_float, *self.ignore), self.strict_groups,
                               head=self.head, embedding=self.embedding, device=self.device)

    def record(self, source: str, spec: str) -> dict:
        """The provenance record's first entries: what was quantized, and how."""
        return {"source": source, "source_spec": spec, "scheme": self.scheme, "method": self.method,
                "head": self.head, "embedding": self.embedding, "versions": versions()}

    def prepared(self, request: QuantizeRequest, record: dict, scale_dtype: str) -> QuantizeRequest:
        """``request`` with its scales stored in ``scale_dtype`` (the source's 16-bit dtype; float16
        for a llama.cpp mixture, whose blocks hold float16 scales: three more bits than bfloat16's,
        carried exactly), the ignore list and scale dtype recorded."""
        record["ignore"] = list(request.ignore)
        request = request.with_scale_dtype("float16" if self.is_mixture else scale_dtype)
        record["scale_dtype"] = request.scale_dtype
        record["group_size_asked"] = self.group_size
        return request

    def planner(self) -> AutoPlanner:
        return AutoPlanner(self.target_bpw, self.target_kld, self.objective, self.size_of, self.plan,
                           self.sensitivity_samples, self.price_by or self.build_method().quantizer.pricing, self.seed,
                           self.for_consumer)

    def check(self) -> None:
        """Refuse impossible requests, and options that do not apply, before any work starts."""
        from llmopt.calibration import resolve_device

        resolve_device(self.device)  # a bad name, or cuda without a GPU, fails now
        method = self.build_method()
        if self.scheme == NF4 and self.device not in ("auto", "cpu"):
            raise LlmoptError("NF4 is quantized by bitsandbytes on the CPU here; --device does not apply", "drop --device")
        for pattern in self.ignore:
            try:
                check_ignore_pattern(pattern)
            except ValueError as exc:
                raise LlmoptError(str(exc), "write a Python regular expression, e.g. 'mlp\\.down_proj' or 're:.*self_attn.*'") from exc
        if self.scheme == NF4:
            if method.transform is not None or not isinstance(method.quantizer, Rtn) or method.quantizer.clip_search:
                raise LlmoptError(f"NF4 is quantized by bitsandbytes and takes no --method {self.method}"
                                  + (" or --clip-search" if self.clip_search is not None else ""),
                                  "drop --method / --clip-search, or pick a W4A16 scheme")
            ignored = [name for name, on in (("--group-size", self.group_size is not None), ("--strict-groups", self.strict_groups),
                                             ("--clip-search", self.clip_search is not None)) if on]
            if ignored:
                raise LlmoptError(f"NF4 (bitsandbytes) takes no {', '.join(ignored)}", "drop those options, or pick a W4A16 scheme")
            if self.head != "float" or self.embedding != "float":
                raise LlmoptError("NF4 (bitsandbytes) keeps the embedding and head in float: --head/--embedding do not apply",
                                  "drop them, or pick a compressed-tensors scheme (W4A16, W8A16 …)")
        elif (self.head != "float" or self.embedding != "float") and self.parse_scheme().activations is not None:
            raise LlmoptError(f"--head/--embedding quantize weights only; {self.scheme} quantizes activations too",
                              "use them with W4A16, W4A16_ASYM or W8A16")
        if any(ignore_matches("lm_head", p) for p in self.ignore) and self.head != "float":
            raise LlmoptError(f"--ignore keeps lm_head in float but --head {self.head} asks to quantize it", "drop one of them")
        self._check_auto(method)
        self._check_imatrix(method)
        self._check_online_hadamard(method)
        self._check_learned_rotation()
        self._check_tuning()
        if not self.needs_calibration and not self.is_auto:
            changed = [f"--{k.replace('_', '-')}" for k, v in CALIBRATION_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise LlmoptError(f"{', '.join(changed)} only apply to calibrated methods, not {self.method}",
                                  "drop them, or pick --method gptq / awq / smoothquant")

    @property
    def online_mode(self) -> str:
        """Which Linears get an online Hadamard on their input: ``off``, ``down`` (R4) or ``all``."""
        if self.online_hadamard == "all":
            return "all"
        if self.rotate == "none" or self.online_hadamard == "off":
            return "off"
        scheme = self.parse_scheme()
        return "down" if self.online_hadamard == "on" or (scheme is not None and scheme.activations is not None) else "off"

    def _check_learned_rotation(self) -> None:
        if self.rotate != LEARNED:
            for name, default in LEARNED_ROTATION_DEFAULTS.items():
                if getattr(self, name) != default:
                    flag = "--" + name.replace("_", "-")
                    raise LlmoptError(f"{flag} applies only with --rotate learned", f"add --rotate learned, or drop {flag}")
            return
        if self.plans_per_tensor or self.scheme == NF4:
            raise LlmoptError(f"--rotate learned optimises the rotation for one scheme's grid; --scheme {self.scheme} has none",
                              "use --rotate hadamard with it, or a single scheme (W4A16, W4A8, W8A8 …)")
        if self.rotate_lr <= 0:
            raise LlmoptError(f"--rotate-lr must be positive, not {self.rotate_lr}", "e.g. --rotate-lr 1.5")

    def _check_online_hadamard(self, method: QuantMethod) -> None:
        if self.online_hadamard in ("on", "off") and self.rotate == "none":
            raise LlmoptError(f"--online-hadamard {self.online_hadamard} applies with --rotate",
                              "add --rotate hadamard, use --online-hadamard all, or drop --online-hadamard")
        if self.online_mode == "off":
            return
        where = "before each down_proj" if self.online_mode == "down" else "before every Linear"
        if self.is_mixture or (self.is_auto and (self.for_consumer == "llama.cpp" or self.size_of == "gguf")):
            what = f"--scheme {self.scheme}" if self.is_mixture else "an AUTO plan for llama.cpp (--for llama.cpp / --size-of gguf)"
            raise LlmoptError(f"{what} is written for GGUF, which cannot carry online transforms",
                              "use --online-hadamard off with it, or plan for llmopt / vllm")
        if self.scheme == NF4:
            raise LlmoptError("NF4 (bitsandbytes) checkpoints carry no online transforms", f"drop --online-hadamard {self.online_hadamard}")
        if method.transform is not None:
            raise LlmoptError(f"an online Hadamard {where}: --method {self.method} "
                              "cannot fold its input scales through it", "use --method rtn or gptq, or --online-hadamard off")
        if self.tune_steps:
            raise LlmoptError("--tune-steps does not run online Hadamards", "use --online-hadamard off with --tune-steps")

    def _check_tuning(self) -> None:
        for flag, given in (("--tune-lr", self.tune_lr is not None), ("--tune-per", self.tune_per != "group")):
            if given and self.tune_steps == 0:
                raise LlmoptError(f"{flag} applies only with --tune-steps", f"add --tune-steps N, or drop {flag}")
        if self.tune_steps == 0:
            return
        if self.tune_lr is not None and not self.tune_lr > 0:
            raise LlmoptError("--tune-lr must be positive", "e.g. --tune-lr 1e-3")
        scheme = self.parse_scheme()
        if scheme is None or scheme.activations is not None:
            raise LlmoptError(f"--tune-steps tunes the scales of weight-only schemes, not {self.scheme}",
                              "use it with W4A16, W4A16_ASYM, W8A16, IQ4_NL or AUTO, or drop it")

    def _check_imatrix(self, method: QuantMethod) -> None:
        if self.imatrix is not None:
            if method.calibrated or not isinstance(method.quantizer, Rtn):
                raise LlmoptError(f"--imatrix weighs RTN's range search; method {self.method} measures its own statistics",
                                  "use --imatrix with --method rtn, or drop it")
            if not Path(self.imatrix).is_file():
                raise LlmoptError(f"imatrix file {self.imatrix} does not exist", "give the file llama-imatrix wrote (-o FILE)")
        if self.save_imatrix is not None and not method.calibrated:
            raise LlmoptError(f"--save-imatrix writes the calibration's statistics; method {self.method} takes no calibration",
                              "use a calibrated method (gptq, awq, awq+gptq …), or drop --save-imatrix")

    def _check_mixture(self, method: QuantMethod) -> None:
        if not method.takes_plan:
            raise LlmoptError(f"--scheme {self.scheme} gives each tensor llama.cpp's type for it; method {self.method} "
                              "quantizes one scheme for all", "use --method gptq, awq+gptq or rtn")
        if self.head != "float" or self.embedding != "float" or self.group_size is not None:
            raise LlmoptError(f"--scheme {self.scheme} takes the head, embedding and group sizes from llama.cpp's mixture",
                              "drop --head / --embedding / --group-size")
        if self.ignore:
            raise LlmoptError(f"--scheme {self.scheme} quantizes every tensor llama.cpp quantizes: --ignore does not apply",
                              "drop --ignore, or use --scheme AUTO / W4A16")

    def _check_auto(self, method: QuantMethod) -> None:
        given = [f"--{k.replace('_', '-')}" for k in ("target_bpw", "target_kld", "plan") if getattr(self, k) is not None]
        if self.is_mixture:
            self._check_mixture(method)
        if not self.is_auto:
            given += ["--size-of"] if self.size_of != "checkpoint" else []
            given += ["--objective"] if self.objective != "size" else []
            given += ["--price-by"] if self.price_by is not None else []
            given += ["--for"] if self.for_consumer != "llmopt" else []
            if given:
                raise LlmoptError(f"{', '.join(given)} only apply to --scheme AUTO", "drop them, or use --scheme AUTO")
            return
        if len(given) != 1:
            raise LlmoptError("--scheme AUTO takes exactly one of --target-bpw, --target-kld and --plan",
                              "e.g. --scheme AUTO --target-bpw 4.85")
        if not method.takes_plan:
            raise LlmoptError(f"--scheme AUTO gives each Linear its own format; method {self.method} quantizes one scheme for all",
                              "use --method gptq (or awq+gptq)")
        if self.head != "float" or self.embedding != "float" or self.group_size is not None:
            raise LlmoptError("--scheme AUTO chooses the head, embedding and group sizes itself",
                              "drop --head / --embedding / --group-size")
        if self.plan is not None and (self.size_of != "checkpoint" or self.price_by is not None):
            raise LlmoptError("--size-of and --price-by shape a new plan; --plan reuses a plan as it is",
                              "drop --size-of / --price-by")
        if self.price_by is not None and self.price_by not in method.quantizer.prices:
            raise LlmoptError(f"--price-by {self.price_by}: method {self.method} prices its formats by "
                              f"{' or '.join(method.quantizer.prices)} only",
                              "drop --price-by, or use --method gptq / awq+gptq")
        try:
            self.planner().check()
        except ValueError as exc:
            raise LlmoptError(str(exc)) from exc


def run_quantize(config: QuantizeConfig, progress=None) -> dict:
    """Quantize ``config.model`` and save it; returns the provenance record written to ``llmopt.json``."""
    from llmopt.pipeline.rotate import rotate_checkpoint

    config.check()
    output = Path(config.output)
    check_output(output, config.overwrite)
    if config.save_imatrix is not None:
        check_output(Path(config.save_imatrix), config.overwrite)
    source, _ = float_source(config.model, "quantized again", "quantize the original float checkpoint instead")
    start = time.perf_counter()
    record = config.record(str(source), config.model)
    if config.rotate == "none" and config.online_mode == "off":
        return _quantize(config, source, record, start, progress)
    rotated = output.parent / f".{output.name}.rotated-{os.getpid()}"  # a float scratch copy, removed at the end
    shutil.rmtree(rotated, ignore_errors=True)
    try:
        residual = _learned_rotation(config, source) if config.rotate == LEARNED else None
        record["rotation"] = rotate_checkpoint(source, rotated, config.rotate, config.seed, config.online_mode, residual)
        return _quantize(config, rotated, record, start, progress, float_source=source)
    finally:
        shutil.rmtree(rotated, ignore_errors=True)


def _learned_rotation(config: QuantizeConfig, source: Path) -> tuple:
    """SpinQuant's learned residual rotation for ``source`` and ``config``'s scheme (and a record)."""
    from transformers import AutoTokenizer

    from llmopt.checkpoints.models import read_config
    from llmopt.checkpoints.remote_code import remote_code_kwargs
    from llmopt.core.console import progress_task
    from llmopt.core.data import calibration_ids
    from llmopt.quant.learned_rotation import learn_residual_rotation
    from llmopt.quant.rotation import Rotation
    from llmopt.self_calibration import sampler

    start = Rotation.for_config(read_config(source), "hadamard", config.seed).q
    tokenizer = AutoTokenizer.from_pretrained(source, **remote_code_kwargs())
    windows, calibration = calibration_ids(tokenizer, config.calib, min(config.calib_samples, config.rotate_steps),
                                           config.calib_seq_len, config.seed, sample_self=sampler(source, config.device))
    model, _ = load_model(source)
    request = config.request()
    with progress_task("learning the rotation", config.rotate_steps) as advance:
        matrix, learned = learn_residual_rotation(model.float(), start, windows, request.scheme, request.scheme.group_size,
                                                  config.rotate_steps, config.rotate_lr, tuple(request.ignore),
                                                  progress=lambda step, kld: advance())
    del model
    return matrix, {**learned, "calibration": calibration}


def _quantize(config: "QuantizeConfig", source: Path, record: dict, start: float, progress,
              float_source: Path | None = None) -> dict:
    """Quantize the float checkpoint ``source`` as ``config`` asks (after any rotation).
    ``float_source``: the unrotated model, which computes the same function; it samples the
    calibration text and teaches the scale tuning (the rotated copy may need online transforms)."""
    from llmopt.core.data import calibration_ids
    from llmopt.formats.compressed import save_nf4
    from llmopt.self_calibration import sampler

    output = Path(config.output)
    if config.scheme == NF4:
        model, tokenizer = load_model(source)
        record["ignore"] = ["lm_head", *config.ignore]
        save_nf4(model, tokenizer, output, record["ignore"], finish_record(record, start), overwrite=config.overwrite)
        return _evaluated(config, record)
    from transformers import AutoTokenizer

    from llmopt.checkpoints.remote_code import remote_code_kwargs

    tokenizer = AutoTokenizer.from_pretrained(source, **remote_code_kwargs())  # the model itself streams layer by layer from the checkpoint
    request = config.request()
    calib = None
    if config.needs_calibration:
        calib, record["calibration"] = calibration_ids(tokenizer, config.calib, config.calib_samples, config.calib_seq_len,
                                                       config.seed, sample_self=sampler(float_source or source, config.device))
    if config.plans_per_tensor:
        if config.is_auto:
            from llmopt.formats.hadamard import OnlineHadamard

            online = OnlineHadamard.of_provenance(record)  # the plan prices the formats on the transformed inputs
            options, record["plan"] = config.planner().make(source, calib, request.method, online)
        else:
            options, record["llama_mixture"] = _mixture_plan(source, config.scheme)
        ignore = request.ignore if options["head"] == "float" else tuple(p for p in request.ignore if p != "lm_head")
        request = replace(request, plan=options["plan"], head=options["head"], embedding=options["embedding"], ignore=ignore)
        record["head"], record["embedding"] = request.head, request.embedding
    request = config.prepared(request, record, _scale_dtype(source))
    pruned = read_provenance(source).get("sparsity") or {}
    if pruned.get("pattern") and pruned.get("pattern_valid"):
        record["source_sparsity"] = {"pattern": pruned["pattern"], "overall": pruned.get("overall", pruned.get("target", 0.0))}
    tune_ids = calib
    if not request.method.calibrated:
        calib = None  # the plan's sensitivities and the scale tuning use them; the method itself takes none
    if config.imatrix is not None:
        request = replace(request, imatrix=_read_imatrix(source, Path(config.imatrix), record))
    request = replace(request, record_inputs=config.save_imatrix is not None)
    quantized = output if not config.tune_steps else output.parent / f".{output.name}.untuned-{os.getpid()}"
    try:
        done = quantize_checkpoint(source, quantized, request, calib, tokenizer=tokenizer, record=record,
                                   overwrite=config.overwrite, progress=progress, started=start)
        if config.save_imatrix is not None:
            _save_imatrix(source, Path(config.save_imatrix), done.result.inputs, config)
        if config.tune_steps:
            record["scale_tuning"] = _tune(config, float_source or source, quantized, tune_ids)
    except ValueError as exc:
        raise LlmoptError(str(exc)) from exc
    finally:
        if quantized != output:
            shutil.rmtree(quantized, ignore_errors=True)
    return _evaluated(config, record)


def _read_imatrix(source: Path, path: Path, record: dict) -> dict[str, torch.Tensor]:
    """The importance matrix at ``path`` by the source's Linear names (through gguf's name map)."""
    from llmopt.checkpoints.models import read_config
    from llmopt.core.console import notice
    from llmopt.quant.imatrix import gguf_names, read_imatrix
    from llmopt.quant.llama_mixtures import checkpoint_shapes

    try:
        by_gguf = read_imatrix(path)
        linears, _, _ = checkpoint_shapes(source)
        names = gguf_names(read_config(source), list(linears))
    except ValueError as exc:
        raise LlmoptError(str(exc), "give the GGUF file llama-imatrix wrote for this model") from exc
    found = {hf: by_gguf[g] for hf, g in names.items() if g in by_gguf and by_gguf[g].numel() == linears[hf][1]}
    if not found:
        raise LlmoptError(f"{path} has no entry for any Linear of {source}", "give the imatrix made for this model")
    if len(found) < len(linears):
        notice(f"the imatrix covers {len(found)} of {len(linears)} Linears; the others are quantized unweighted")
    record["imatrix"] = {"file": str(path), "linears": len(found)}
    return found


def _save_imatrix(source: Path, path: Path, inputs: dict[str, tuple[torch.Tensor, int]], config: "QuantizeConfig") -> None:
    """Write the calibrated Linears' input statistics as llama.cpp's imatrix file (atomically)."""
    from llmopt.checkpoints.models import read_config
    from llmopt.core.atomic import atomic_file
    from llmopt.quant.imatrix import gguf_names, write_imatrix

    try:
        names = gguf_names(read_config(source), list(inputs))
    except LlmoptError as exc:
        raise LlmoptError(f"--save-imatrix: {exc.args[0]}", "drop --save-imatrix for this architecture") from exc
    entries = {names[n]: value for n, value in inputs.items() if n in names}
    with atomic_file(path, config.overwrite) as tmp:
        write_imatrix(tmp, entries, config.calib, config.calib_samples, config.calib_seq_len)


def _mixture_plan(source: Path, mixture: str) -> tuple[dict, dict]:
    """llama.cpp's types for ``mixture`` on ``source``, their counts printed."""
    from collections import Counter

    from llmopt.core.console import err
    from llmopt.quant.llama_mixtures import mixture_plan

    try:
        options, record = mixture_plan(source, mixture)
    except ValueError as exc:
        raise LlmoptError(str(exc), "pass a float Hugging Face causal-LM checkpoint") from exc
    counts = Counter(record["types"].values())
    err.print(f"llama.cpp {mixture}: " + ", ".join(f"{n} × {qtype}" for qtype, n in sorted(counts.items())))
    return options, record


def quantize_checkpoint(source: Path, output: Path, request: QuantizeRequest, calibration: torch.Tensor | None = None, *,
                        tokenizer: Any = None, record: dict | None = None, overwrite: bool = False, progress: Any = None,
                        max_shard_bytes: int | None = None, started: float | None = None) -> StreamedQuantization:
    """Stream the checkpoint ``source`` through ``request`` into a compressed-tensors checkpoint at
    ``output`` (atomically), layer by layer; ``record`` (the provenance so far) is completed and
    written as llmopt.json. The memory bound is printed for large checkpoints and a job that does
    not fit the free memory is refused first. ``started``: when the job began (for its wall time)."""
    from llmopt.calibration import resolve_device
    from llmopt.checkpoints.estimate import check_fits
    from llmopt.checkpoints.quantized_writer import QuantizedCheckpointWriter
    from llmopt.checkpoints.streaming import StreamedModel
    from llmopt.checkpoints.writer import DEFAULT_SHARD_BYTES
    from llmopt.core.atomic import atomic_dir
    from llmopt.formats.hadamard import OnlineHadamard, add_input_hooks
    from llmopt.quant.streaming import quantize_estimate, quantize_streaming

    start = time.perf_counter() if started is None else started
    record = {} if record is None else record
    announce = _announcer(Path(source))
    estimate = quantize_estimate(Path(source), request, calibration)
    if announce is not None:
        announce(estimate.describe())
    check_fits(estimate, (resolve_device(request.device) or torch.device("cpu")).type)
    stream = StreamedModel(source)
    stream.announce = announce
    online = OnlineHadamard.of_provenance(record)
    if online:  # the rotated source's Linears read Hadamard-transformed inputs
        add_input_hooks(stream.model, online)
    try:
        with atomic_dir(Path(output), overwrite) as tmp:
            writer = QuantizedCheckpointWriter(stream, tmp, max_shard_bytes or DEFAULT_SHARD_BYTES)
            done = quantize_streaming(stream, request, calibration, progress=progress)
            record.update(result_record(done.result, request.method), memory_estimate=estimate.to_dict())
            writer.finish(done.outer, done.result.weights, list(request.ignore), tokenizer, finish_record(record, start))
    finally:
        stream.close()
    return done


def result_record(result: QuantizeResult, method: QuantMethod) -> dict:
    """What a quantization did, for the provenance record (its notices printed as it is made)."""
    from llmopt.core.console import notice

    for line in result.notices:
        notice(line)
    return {
        "group_sizes": _group_size_summary(result.group_sizes),
        "quantized_modules": len(result.weights),
        "notices": result.notices,
        "options": {**_flat_options(method), "head_fisher_rows": FISHER_ROWS,
                    "gptq_after_awq": "sequential" if method.one_pass and method.transform is not None else None},
        "method_run": method.name,  # with what a consumer adds (llama.cpp: AWQ counting its rounding, or the channel order)
        **({"mlp_channel_orders": orders} if (orders := _channel_orders(result)) else {}),
        "quantize_seconds": round(result.seconds, 2),
        "engine_seconds": result.timings.to_dict(),
    }


def _channel_orders(result: QuantizeResult) -> dict[str, int]:
    """How many MLPs kept their stored channel order and how many were sorted, by which statistic."""
    return dict(Counter(r.order for r in result.mappings if isinstance(r, ChannelOrderResult)))


def _scale_dtype(source: Path) -> str:
    """Scales in the source's own 16-bit dtype (bfloat16 / float16), bfloat16 for a float32 source."""
    from llmopt.checkpoints.lazy import LazyCheckpoint
    from llmopt.formats.schemes import scale_dtype_for

    with LazyCheckpoint(source) as ckpt:
        return scale_dtype_for(ckpt.floating_dtype())


def _flat_options(method: QuantMethod) -> dict:
    """The method's options in one dict (the transform's, then the quantizer's)."""
    parts = [method.quantizer] if method.transform is None else [method.transform, method.quantizer]
    return {k: v for part in parts for k, v in part.options().items()}


def _tune(config: QuantizeConfig, source: Path, quantized: Path, ids) -> dict:
    """Tune the just-written checkpoint's scales and norms into ``config.output``."""
    from llmopt.checkpoints.rewrite import rewrite_tensors
    from llmopt.quant.scale_tuning import TuneSettings
    from llmopt.quant.tune_checkpoint import tune_checkpoint

    settings = TuneSettings(config.tune_steps, config.tune_lr, per=config.tune_per, seed=config.seed)
    replacements, report = tune_checkpoint(quantized, source, ids, settings, config.device)
    rewrite_tensors(quantized, Path(config.output), replacements, {"scale_tuning": report.to_dict()}, config.overwrite)
    return report.to_dict()


LONG_JOB_BYTES = 2**30  # print memory and time estimates for checkpoints of at least 1 GiB of weights


def _announcer(source: Path):
    """Where estimates go: stderr for long jobs; nowhere for small checkpoints (quick anyway)."""
    from llmopt.core.console import err

    if sum(f.stat().st_size for f in Path(source).glob("*.safetensors")) < LONG_JOB_BYTES:
        return None
    return lambda message: err.print(f"[dim]{message}[/dim]")


def _evaluated(config: QuantizeConfig, record: dict) -> dict:
    record["output"] = str(config.output)
    if config.eval:
        record["evaluation"] = evaluate_output(config.output, config.model)
    return record


def _group_size_summary(sizes: dict[str, int | None]) -> dict[str, int]:
    """How many Linears use each group size ("per-channel" for None)."""
    summary: dict[str, int] = {}
    for g in sizes.values():
        key = "per-channel" if g is None else str(g)
        summary[key] = summary.get(key, 0) + 1
    return summary
