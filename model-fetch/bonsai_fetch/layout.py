"""What the model directory must hold: tensor names and config.json as vLLM 0.32 wants them, and the checks
that sources fit together (a prism_ternary upload, a vision tower of the right width and tokenizer, an MTP head
with the model's exact names, shapes and dtypes).

vLLM's `Qwen3_5ForConditionalGeneration` maps `model.visual.*` -> `visual.*`, `model.language_model.*` ->
`language_model.model.*`, `lm_head.*` -> `language_model.lm_head.*` and leaves `mtp.*` to the drafter
(`Qwen3_5MTP`); its config is `qwen3_5` with the language model under `text_config` and the vision tower under
`vision_config`, `quantization_config` at the top level.
"""

from __future__ import annotations

import json
from pathlib import Path

from bonsai_fetch import st
from bonsai_fetch.errors import FetchError, IncompatibleError
from bonsai_vllm.ternary.format import TERNARY_MODULES, PrismTernaryConfig

# Keys of a flat (text-only) config that describe the checkpoint, not the language model.
_TOP_LEVEL_ONLY = ("architectures", "quantization_config", "quantization", "auto_map", "transformers_version",
                   "_name_or_path", "text_config", "vision_config")
_VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                  "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}


def read_token_counts(path: Path) -> dict[int, int]:
    """A token-count file: JSON `{"id": count}` or `[count, ...]`, or text lines `id count` (tab or space)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    try:
        if isinstance(data, dict):
            return {int(k): int(v) for k, v in data.items()}
        if isinstance(data, list):
            return {i: int(v) for i, v in enumerate(data)}
        counts = {}
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                tid, n = line.split()[:2]
                counts[int(tid)] = int(n)
        return counts
    except (TypeError, ValueError) as e:
        raise FetchError(f"{path}: not a token-count file ({e}); use JSON {{\"token id\": count}}, a JSON list of "
                         "counts indexed by id, or lines 'id count'") from None


def weight_name(name: str) -> str | None:
    """The output name of a language-model tensor, or None for tensors that go elsewhere (mtp, vision)."""
    if name.startswith(("mtp.", "model.visual.", "visual.")):
        return None
    if name.startswith(("model.language_model.", "lm_head.")):
        return name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def text_part(config: dict) -> dict:
    """The language model's config: `text_config`, or a flat config without its checkpoint-level keys."""
    if isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
    else:
        text = {k: v for k, v in config.items() if k not in _TOP_LEVEL_ONLY}
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_text"
    return text


def assemble_config(weights_cfg: dict, vision_cfg: dict | None) -> dict:
    """config.json of the output: multimodal `qwen3_5` with the vision source's vision part, or text-only."""
    qcfg = weights_cfg.get("quantization_config")
    text = text_part(weights_cfg)
    if vision_cfg is None:
        return {**text, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                "quantization_config": qcfg}
    vision = vision_cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise IncompatibleError("the vision source's config.json has no vision_config: it is not a multimodal "
                                "Qwen3.5 checkpoint (set BONSAI_VISION_REPO to the base model, or 'off')")
    out_width = vision.get("out_hidden_size")
    if out_width is not None and out_width != text.get("hidden_size"):
        raise IncompatibleError(f"the vision tower's output width {out_width} is not the language model's hidden "
                                f"size {text.get('hidden_size')}: the vision source belongs to another model")
    cfg = {k: v for k, v in vision_cfg.items()
           if k not in ("quantization", "quantization_config", "text_config", "auto_map", "_name_or_path")}
    cfg.update(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text,
               quantization_config=qcfg, tie_word_embeddings=text.get("tie_word_embeddings", False))
    return cfg


def check_vision_tokens(vision_cfg: dict, tokenizer_json: Path) -> None:
    """The vision source's special-token ids must be those tokens in the model's tokenizer."""
    if not tokenizer_json.is_file():
        return
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_json.read_text()).get("added_tokens", [])}
    for key, token in _VISION_TOKENS.items():
        if key in vision_cfg and added.get(token) != vision_cfg[key]:
            raise IncompatibleError(f"the vision source says {key} = {vision_cfg[key]}, but the model's tokenizer "
                                    f"has {token} at {added.get(token)}: the vision tower comes from a model with "
                                    "another tokenizer")


def check_prism_config(cfg: dict, where: str) -> PrismTernaryConfig:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "prism_ternary":
        found = q.get("quant_method") if isinstance(q, dict) else None
        raise IncompatibleError(f"{where}: config.json is not a prism_ternary checkpoint (quant_method {found!r}); "
                                "BONSAI_MODEL_REPO must be the vLLM-format ternary upload")
    try:
        return PrismTernaryConfig.from_dict(q)
    except ValueError as e:
        raise IncompatibleError(f"{where}: {e}") from None


def check_ternary_headers(refs: dict[str, st.TensorRef], qcfg: PrismTernaryConfig, where: str) -> None:
    """Header-level format check of the ternary modules (dtypes, shapes, a sign vector per width)."""
    for name, ref in refs.items():
        if not name.endswith(".scales"):
            continue
        prefix = name.removesuffix(".scales")
        weight = refs.get(f"{prefix}.weight")
        if prefix.rsplit(".", 1)[-1] not in TERNARY_MODULES or weight is None:
            continue
        width = weight.shape[1] * 16 if len(weight.shape) == 2 else -1
        if weight.dtype != "I32" or ref.dtype != "F16" or ref.shape != (weight.shape[0], width // qcfg.group_size):
            raise IncompatibleError(f"{where}: {prefix} is not prism_ternary-packed (weight {weight.dtype} "
                                    f"{list(weight.shape)}, scales {ref.dtype} {list(ref.shape)})")
        if width not in qcfg.signs:
            raise IncompatibleError(f"{where}: {prefix} has input width {width} but the config has sign vectors "
                                    f"only for {sorted(qcfg.signs)}")


def mtp_signature(refs: dict[str, st.TensorRef]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {n: (r.dtype, r.shape) for n, r in refs.items() if n.startswith("mtp.")}


def check_mtp_head(head: dict[str, st.TensorRef], original: dict[str, tuple[str, tuple[int, ...]]],
                   where: str) -> None:
    """A replacement MTP head must have exactly the original's tensor names, shapes and dtypes."""
    if not original:
        raise IncompatibleError(f"{where}: the model checkpoint has no mtp.* head to check the replacement "
                                "against; set BONSAI_MTP_REPO=off")
    got = mtp_signature(head)
    stray = sorted(n for n in head if not n.startswith("mtp."))
    missing, extra = sorted(set(original) - set(got)), sorted(set(got) - set(original))
    wrong = [f"{n}: {got[n][0]} {list(got[n][1])} (model has {original[n][0]} {list(original[n][1])})"
             for n in sorted(set(got) & set(original)) if got[n] != original[n]]
    if stray or missing or extra or wrong:
        parts = []
        if stray:
            parts.append(f"names outside mtp.*: {stray[:3]}")
        if missing:
            parts.append(f"missing {len(missing)} tensors, e.g. {missing[:3]}")
        if extra:
            parts.append(f"{len(extra)} tensors the model does not have, e.g. {extra[:3]}")
        if wrong:
            parts.append(f"{len(wrong)} differ in shape or dtype, e.g. {wrong[:2]}")
        raise IncompatibleError(f"{where} does not fit this model's MTP head: " + "; ".join(parts) +
                                ". Use a head trained for this model, or BONSAI_MTP_REPO=off to keep the original")
