"""Head checkpoint formats, all in one place: which layout a folder holds, how it maps onto our heads,
and the tables the serving engines' loaders read (used by `eaglespec.export` and the tests).

Formats read (each checked against the target's ModelArgs, a mismatch is a one-line ValueError):

- "eagle": the official EAGLE-1/2 heads (SafeAILab/EAGLE, also what `EagleHead.save` writes):
  config.json + model.safetensors or pytorch_model.bin; keys `fc.weight` (+ `fc.bias`), `layers.0.*`
  without an input norm; an `embed_tokens.weight` copy of the target's embedding is ignored.
- "eagle3": the official EAGLE-3 heads and SpecForge's output (same layout): `fc.weight` (3H -> H),
  `midlayer.*` (attention on 2H), `norm.weight`, `lm_head.weight` over the draft vocabulary, `d2t`, `t2d`;
  config architectures ["LlamaForCausalLMEagle3"] with `draft_vocab_size`.
- "speculators-eagle" / "speculators-eagle3": vLLM's `speculators` library (config field
  `speculators_model_type`, the layer's sizes under `transformer_layer_config`; keys `fusion_fc.*` and
  `transformer.*` for EAGLE-1, `layers.0.*` and `embed_tokens.weight` for EAGLE-3).

Untrusted checkpoints load without pickle: safetensors, or torch.load(weights_only=True); a payload that
needs full unpickling is refused with one line.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .model import ModelArgs

# ---- key tables, transcribed from the public code -------------------------------------------------

# One Llama decoder layer, as `layers.0.` (EAGLE-1) or `midlayer.` (EAGLE-3) prefixes it. Module names:
# SafeAILab/EAGLE eagle/model/cnets.py (LlamaDecoderLayer: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
# post_attention_layernorm; layer 0 has no input_layernorm) and eagle/traineagle3/cnets.py
# (LlamaDecoderLayeremb adds hidden_norm and input_layernorm).
ATTN_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
MLP_KEYS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
EAGLE1_LAYER_KEYS = ATTN_KEYS + MLP_KEYS + ("post_attention_layernorm.weight",)
EAGLE3_LAYER_KEYS = ATTN_KEYS + MLP_KEYS + ("post_attention_layernorm.weight", "input_layernorm.weight",
                                            "hidden_norm.weight")
# EAGLE-3 top level: eagle/traineagle3/cnets.py Model (fc 3H->H no bias, norm, lm_head over draft_vocab_size,
# d2t/t2d buffers); SpecForge specforge/modeling/draft/llama3_eagle.py LlamaForCausalLMEagle3 (same names).
EAGLE3_TOP_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")

# speculators' names (src/speculators/models/eagle.py EagleSpeculator: fusion_fc, transformer,
# embedding_layernorm / pre_lm_head_layernorm when `layernorms`; vLLM's llama_eagle.py maps fusion_fc -> fc),
# and src/speculators/models/eagle3.py Eagle3Speculator: embed_tokens, fc, layers.0, norm, lm_head, d2t, t2d
# (its converter, src/speculators/convert/eagle/eagle3_converter.py, renames midlayer.* -> layers.0.*).
SPECULATORS_EAGLE1_RENAMES = (("fusion_fc.", "fc."), ("transformer.", "layers.0."))
SPECULATORS_EAGLE3_RENAMES = (("layers.0.", "midlayer."),)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"   # SGLang's and SpecForge's class; vLLM maps it to Eagle3LlamaForCausalLM
EAGLE1_ARCHITECTURE = "LlamaForCausalLMEagle"    # SGLang's and vLLM's EAGLE-1 class


@dataclasses.dataclass
class HeadCheckpoint:
    """A head in our canonical layout: `kind` "eagle" (EagleHead keys) or "eagle3" (official EAGLE-3 keys),
    `config` a flat LlamaConfig-style dict, `state` the tensors, `source` the format it was read as."""
    kind: str
    config: dict
    state: dict[str, torch.Tensor]
    source: str


# ---- reading a folder ----------------------------------------------------------------------------

def read_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the weights of a head folder, read without pickle."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object")
    return cfg, read_weights(path)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    for index_name, loader in (("model.safetensors.index.json", _load_safetensors),
                               ("pytorch_model.bin.index.json", _load_bin)):
        if (path / index_name).is_file():  # sharded (save_pretrained of a large head)
            shards = sorted(set(json.loads((path / index_name).read_text()).get("weight_map", {}).values()))
            sd = {}
            for shard in shards:
                sd.update(loader(path / shard))
            return sd
    if (path / "model.safetensors").is_file():
        return _load_safetensors(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return _load_bin(path / "pytorch_model.bin")
    raise ValueError(f"head {path} has no model.safetensors or pytorch_model.bin")


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file: {str(e).splitlines()[0]}") from None


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin through torch's restricted unpickler: tensors and plain containers only.
    Anything needing full unpickling (arbitrary classes, code) is refused rather than executed."""
    try:
        sd = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else "restricted unpickler refused it"
        raise ValueError(f"refusing {file}: it needs full unpickling, which could run code "
                         f"(torch.load weights_only=True: {reason[:160]}); convert it to safetensors") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{file} is not a readable PyTorch checkpoint: {str(e).splitlines()[0][:160]}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{file} does not hold a flat state dict of tensors")
    return sd


# ---- detecting and converting --------------------------------------------------------------------

def detect_format(cfg: dict, sd: dict) -> str:
    """One of "eagle", "eagle3", "speculators-eagle", "speculators-eagle3" (ValueError otherwise)."""
    kind = cfg.get("speculators_model_type")
    if kind is not None:
        if kind not in ("eagle", "eagle3"):
            raise ValueError(f"speculators checkpoint of type '{kind}': only 'eagle' and 'eagle3' heads are supported")
        return f"speculators-{kind}"
    archs = cfg.get("architectures") or []
    if (any(k.startswith("midlayer.") for k in sd) or "layers.0.hidden_norm.weight" in sd
            or any("Eagle3" in a for a in archs)):
        return "eagle3"
    if "fc.weight" in sd or "model.fc.weight" in sd:
        return "eagle"
    raise ValueError("not an EAGLE head: no fc.weight, midlayer.* or speculators_model_type "
                     f"(keys: {sorted(sd)[:4]})")


def _rename(sd: dict, renames) -> dict:
    out = {}
    for k, v in sd.items():
        for old, new in renames:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out


def _drop_zero(sd: dict, key: str, why: str) -> None:
    """Drop a tensor our head has no place for, if it is all zeros (then it changes nothing); else refuse."""
    if key in sd:
        if bool(sd[key].float().abs().max() > 0):
            raise ValueError(f"{key} is non-zero, but {why}")
        del sd[key]


def _drop_ones(sd: dict, key: str, why: str) -> None:
    if key in sd:
        if not bool((sd[key].float() == 1).all()):
            raise ValueError(f"{key} is not the identity, but {why}")
        del sd[key]


def to_canonical(cfg: dict, sd: dict) -> HeadCheckpoint:
    """Map any supported layout onto ours (see the module docstring)."""
    source = detect_format(cfg, sd)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    # the embedding is the target's (frozen) in every format; copies of it are ignored
    sd = {k: v for k, v in sd.items() if not k.endswith("embed_tokens.weight")}
    if source == "speculators-eagle":
        if cfg.get("layernorms"):
            raise ValueError("speculators head with layernorms=true (the HASS variant: embedding_layernorm, "
                             "pre_lm_head_layernorm) is not supported")
        sd = _rename(sd, SPECULATORS_EAGLE1_RENAMES)
        sd.pop("lm_head.weight", None)  # the target's, when a converter saved it
        source_cfg = {**_layer_config(cfg), "bias": "fc.bias" in sd}
    elif source == "speculators-eagle3":
        sd = _rename(sd, SPECULATORS_EAGLE3_RENAMES)
        flat = _layer_config(cfg)
        for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
            if cfg.get(key) is not None:
                flat[key] = cfg[key]
        # speculators always writes this field; where it is missing, do what vLLM (which serves these
        # checkpoints) does: vllm/transformers_utils/configs/speculators/algos.py defaults it to True
        flat["norm_before_residual"] = bool(cfg.get("norm_before_residual", True))
        source_cfg = flat
    else:
        source_cfg = dict(cfg)
    source_cfg.update(rope_fields(source_cfg))
    if source in ("eagle3", "speculators-eagle3"):
        sd = _rename(sd, (("layers.0.", "midlayer."),))  # vLLM-renamed official heads
        # vLLM's own name for d2t (Eagle3LlamaForCausalLM.draft_id_to_target_id), same meaning; t2d follows
        # from it when a checkpoint dropped it as vLLM does
        if "draft_id_to_target_id" in sd and "d2t" not in sd:
            sd["d2t"] = sd.pop("draft_id_to_target_id")
        # speculators' first Eagle3Speculator built fc with a bias (src/speculators/models/eagle3.py);
        # EAGLE-3 has none, so only a zero one can be dropped
        _drop_zero(sd, "fc.bias", "EAGLE-3's fc has no bias")
        return HeadCheckpoint("eagle3", source_cfg, sd, source)
    # EAGLE-1/2: a converted head may carry an identity input norm for layer 0 (speculators' Identity has none)
    _drop_ones(sd, "layers.0.input_layernorm.weight", "the EAGLE-1 layer has no input norm")
    return HeadCheckpoint("eagle", source_cfg, sd, source)


def rope_fields(cfg: dict) -> dict:
    """The draft layer's RoPE as the head's own config defines it, LlamaConfig's defaults (theta 10000, no
    scaling) where it says nothing. That is what the official code (EConfig), vLLM and SGLang build the
    head's rotary embedding from: not the target's. The released EAGLE-3 training config
    (eagle/traineagle3/config.json) names no rope_theta, so its heads were trained with 10000.
    transformers >= 5 writes both into `rope_parameters`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if kind not in ("default", None) else None
    return {"rope_theta": float(theta), "rope_scaling": scaling}


def _layer_config(cfg: dict) -> dict:
    layer = cfg.get("transformer_layer_config") or cfg.get("transformer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config has no transformer_layer_config object")
    return dict(layer)


# ---- checking against the target -----------------------------------------------------------------

def _mismatch(what: str, got, want) -> ValueError:
    return ValueError(f"head {what} {got} != target {want}")


def check_fits(ckpt: HeadCheckpoint, target: ModelArgs) -> None:
    """Sizes that must equal the target's: hidden size, vocabulary, fc's input width, layer shapes."""
    cfg, sd, h = ckpt.config, ckpt.state, target.hidden_size
    if cfg.get("hidden_size", h) != h:
        raise _mismatch("hidden_size", cfg["hidden_size"], h)
    if cfg.get("target_hidden_size") not in (None, h):
        raise _mismatch("target_hidden_size", cfg["target_hidden_size"], h)
    if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise _mismatch("vocab_size", cfg["vocab_size"], target.vocab_size)
    fc = sd.get("fc.weight")
    if fc is None:
        raise ValueError("head has no fc.weight")
    n_in = 3 if ckpt.kind == "eagle3" else 2
    if fc.ndim != 2 or fc.shape[0] != h:
        raise _mismatch("hidden_size (fc.weight rows)", fc.shape[0] if fc.ndim == 2 else tuple(fc.shape), h)
    if fc.shape[1] != n_in * h:
        raise _mismatch(f"fc.weight input width (EAGLE-{3 if n_in == 3 else 1}: {n_in} x hidden)", fc.shape[1], n_in * h)
    if ckpt.kind == "eagle3":
        if "t2d" in sd and sd["t2d"].numel() != target.vocab_size:
            raise _mismatch("vocab_size (t2d length)", sd["t2d"].numel(), target.vocab_size)
        lm = sd.get("lm_head.weight")
        if lm is None:
            raise ValueError("EAGLE-3 head has no lm_head.weight (its own LM head over the draft vocabulary)")
        if lm.shape[1] != h:
            raise _mismatch("lm_head.weight width", lm.shape[1], h)
        draft = cfg.get("draft_vocab_size") or lm.shape[0]
        if lm.shape[0] != draft:
            raise ValueError(f"head lm_head.weight has {lm.shape[0]} rows but draft_vocab_size is {draft}")
        if "d2t" in sd and sd["d2t"].numel() != draft:
            raise ValueError(f"head d2t has {sd['d2t'].numel()} entries but draft_vocab_size is {draft}")
        if "d2t" not in sd and draft != target.vocab_size:
            raise ValueError(f"head drafts {draft} tokens of the target's {target.vocab_size} but has no d2t map")


def draft_ids_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary (EAGLE-3: target id = i + d2t[i]), checked to be in the vocabulary
    and strictly increasing (the official code builds d2t from sorted ids)."""
    from .head import check_draft_vocab
    ids = d2t.long() + torch.arange(d2t.numel())
    return check_draft_vocab(ids, vocab_size)


# ---- the entry point head.load_head uses ----------------------------------------------------------

def read_head(path: Path, target: ModelArgs) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of the head folder `path` in any supported format, mapped onto our layout
    (EagleHead's keys, or the official EAGLE-3 keys Eagle3Head uses) and checked against the target.
    One-line ValueError naming the folder when it is unreadable, unknown or does not fit."""
    cfg, sd = read_folder(path)
    try:
        ckpt = to_canonical(cfg, sd)
    except ValueError as e:
        raise ValueError(f"head {path}: {e}") from None
    try:
        check_fits(ckpt, target)
        if "d2t" in ckpt.state:
            draft_ids_from_d2t(ckpt.state["d2t"], target.vocab_size)
    except ValueError as e:
        raise ValueError(f"head {path} does not fit the target: {e}") from None
    return ckpt.config, ckpt.state
