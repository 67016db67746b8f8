"""`eaglespec export HEAD --format {eagle3,speculators,eagle} --out DIR`: write a head in the layout a
serving engine loads. Each writer is a pure function (head -> config dict, state dict) whose keys, dtypes
and config fields are the ones these loaders read:

- eagle3 (EAGLE-3 heads): the official EAGLE-3 layout, which SGLang
  (python/sglang/srt/models/llama_eagle3.py, `--speculative-algorithm EAGLE3`) and vLLM
  (vllm/model_executor/models/llama_eagle3.py, method "eagle3") both load. SGLang matches `midlayer.*`
  by name (it silently skips `layers.0.*`); vLLM renames `midlayer.` to `layers.0.` and `d2t` to
  `draft_id_to_target_id`, and drops `t2d`.
- speculators (EAGLE-3 heads): vLLM's `speculators` format (config `speculators_model_type: eagle3`,
  `transformer_layer_config`, `speculators_config`; keys `layers.0.*` and the target's `embed_tokens`,
  as src/speculators/convert/eagle/eagle3_converter.py writes them), which `vllm serve DIR` detects.
- eagle (EAGLE-1 heads): the official EAGLE-1 layout with architectures ["LlamaForCausalLMEagle"], for
  vLLM method "eagle" and SGLang `--speculative-algorithm EAGLE`. Both engines read the config key `bias`
  as an *attention* bias (o_proj), so it is written false; the fc bias travels in the weights. SGLang's
  fc always has a bias (a head without one gets zeros); vLLM's has none and skips `fc.bias`, so a head
  with a non-zero fc bias drafts differently there (still lossless, fewer tokens accepted): a warning.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id of the default model's weights
FORMATS = ("eagle3", "speculators", "eagle")


def _tensor_dict(head, dtype):
    """The head's tensors: floating ones cast to `dtype`, d2t as int64 and t2d as bool (what the loaders
    allocate: vLLM's draft_id_to_target_id is a long parameter; SGLang adds an arange to d2t)."""
    out = {}
    for k, v in head.state_dict().items():
        v = v.detach().cpu()
        if k == "d2t":
            v = v.long()
        elif k == "t2d":
            v = v.bool()
        elif v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def _layer_fields(args) -> dict:
    """The decoder layer's LlamaConfig fields every loader reads (hidden sizes, heads, rope, norm eps)."""
    return {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        # EAGLE-3: one; EAGLE-1: as many as the head has (vLLM's and SGLang's llama_eagle build
        # num_hidden_layers layers, the first without an input norm, as ours)
        "num_hidden_layers": args.num_hidden_layers,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": args.rope_scaling,
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serving_aux_layers(head, n_target_layers: int) -> dict:
    """The three target layers as each engine names them. vLLM reads a top-level
    `eagle_aux_hidden_state_layer_ids` and captures the hidden state *entering* each (llama.py:
    `if idx in aux_hidden_state_layers` before layer idx), as ours are named; SGLang reads
    `eagle_config.eagle_aux_hidden_state_layer_ids` and captures id + 1 (set_eagle3_layers_to_capture).
    Both capture only before a layer, and vLLM adds the residual there, so layers 0 and L cannot be served."""
    aux = [int(i) for i in head.aux_layers]
    if any(not 1 <= i < n_target_layers for i in aux):
        raise ValueError(f"the head fuses target layers {aux}, but vLLM and SGLang capture hidden states entering "
                         f"layers 1..{n_target_layers - 1} only (the embedding and the last layer's output cannot be served)")
    return {"eagle_aux_hidden_state_layer_ids": aux,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux], "use_aux_hidden_state": True}}


def _require(head, arch: str, fmt: str) -> None:
    if getattr(head, "arch", "eagle") != arch:
        if arch == "eagle3":
            raise ValueError(f"--format {fmt} writes EAGLE-3 heads, and this is an EAGLE-1 head (its fc reads the "
                             "embedding and the target's last feature, not three layers): use --format eagle "
                             "(vLLM method \"eagle\", SGLang --speculative-algorithm EAGLE)")
        raise ValueError("--format eagle writes EAGLE-1 heads, and this is an EAGLE-3 head: use --format eagle3 "
                         "or --format speculators")


def eagle3_checkpoint(head, n_target_layers: int, dtype) -> tuple[dict, dict]:
    """Official EAGLE-3 layout (Eagle3Head's own keys: fc, midlayer.*, norm, lm_head, d2t, t2d)."""
    _require(head, "eagle3", "eagle3")
    if head.args.qkv_bias:
        raise ValueError("this EAGLE-3 head has q/k/v biases, which SGLang's LlamaForCausalLMEagle3 builds without")
    sd = _tensor_dict(head, dtype)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **_layer_fields(head.args),
        "target_hidden_size": head.args.hidden_size,   # fc reads 3 x this (vLLM, SGLang, SpecForge)
        "draft_vocab_size": int(sd["lm_head.weight"].shape[0]),
        # vLLM and SGLang build o_proj/fc biases from `bias`/`attention_bias`: EAGLE-3 has none
        "bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        # vLLM's Eagle3 layer reads it (default False); SGLang has only the official order (False)
        "norm_before_residual": bool(head.midlayer.norm_before_residual),
        **serving_aux_layers(head, n_target_layers),
        "torch_dtype": _dtype_name(dtype),
    }
    if config["norm_before_residual"]:
        print("eaglespec: warning: norm_before_residual=true: vLLM honours it, SGLang's LlamaForCausalLMEagle3 "
              "always uses the official order (its drafts will differ)", file=sys.stderr)
    return config, sd


def speculators_checkpoint(head, n_target_layers: int, dtype, embed_tokens, verifier: str,
                           verifier_architectures: list[str], speculative_tokens: int) -> tuple[dict, dict]:
    """vLLM `speculators` EAGLE-3 layout: layers.0.* instead of midlayer.*, the target's embedding included."""
    _require(head, "eagle3", "speculators")
    if head.args.qkv_bias:
        raise ValueError("this EAGLE-3 head has q/k/v biases, which speculators' Eagle3 layer builds without")
    if speculative_tokens < 1:
        raise ValueError("--speculative-tokens must be at least 1")
    sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
          for k, v in _tensor_dict(head, dtype).items()}
    sd["embed_tokens.weight"] = embed_tokens.detach().cpu().to(dtype).contiguous()
    layer = {"model_type": "llama", **_layer_fields(head.args), "attention_bias": False, "mlp_bias": False}
    aux = serving_aux_layers(head, n_target_layers)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": int(sd["lm_head.weight"].shape[0]),
        "norm_before_residual": bool(head.midlayer.norm_before_residual),  # vLLM's default when absent is True
        "target_hidden_size": head.args.hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux["eagle_aux_hidden_state_layer_ids"],
        # vLLM's validate_speculators_config requires proposal_methods[0].speculative_tokens and
        # verifier.name_or_path (vllm/transformers_utils/configs/speculators/base.py)
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": _dtype_name(dtype),
    }
    return config, sd


def eagle1_checkpoint(head, dtype) -> tuple[dict, dict, list[str]]:
    """Official EAGLE-1 layout for vLLM/SGLang; returns warnings for what those engines will not use."""
    import torch
    _require(head, "eagle", "eagle")
    sd = _tensor_dict(head, dtype)
    warnings = []
    if "fc.bias" not in sd:  # SGLang's LlamaForCausalLMEagle builds fc with a bias: give it the one we mean
        sd["fc.bias"] = torch.zeros(head.args.hidden_size, dtype=dtype)
    elif bool(sd["fc.bias"].float().abs().max() > 0):
        warnings.append("the head's fc has a non-zero bias: SGLang uses it, but vLLM's EAGLE-1 loader builds fc "
                        "without one and skips it, so under vLLM its drafts differ (output still lossless, "
                        "fewer tokens accepted)")
    if "d2t" in sd:
        warnings.append(f"the head's reduced draft vocabulary ({sd['d2t'].numel()} tokens) is not exported: vLLM "
                        "and SGLang draft EAGLE-1 heads over the whole vocabulary")
        del sd["d2t"], sd["t2d"]
    config = {
        "architectures": ["LlamaForCausalLMEagle"],
        "model_type": "llama",
        **_layer_fields(head.args),
        # vLLM and SGLang read `bias` as the attention's bias (o_proj too); the fc bias is in the weights
        "bias": False,
        "attention_bias": False,
        # both Llama layers (vLLM llama.py, SGLang llama.py LlamaDecoderLayer) take the q/k/v bias from this key
        "qkv_bias": bool(head.args.qkv_bias),
        "mlp_bias": False,
        "torch_dtype": _dtype_name(dtype),
    }
    return config, sd, warnings


def write_checkpoint(out: Path, config: dict, sd: dict, force: bool = False) -> None:
    from safetensors.torch import save_file
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty (pass --force to overwrite its config.json and model.safetensors)")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})  # transformers-style loaders expect format=pt
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def serve_commands(fmt: str, out: Path, model: str) -> list[str]:
    out = str(out)
    if fmt == "eagle":
        return [f"python -m sglang.launch_server --model-path {model} --speculative-algorithm EAGLE "
                f"--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 4 "
                f"--speculative-num-draft-tokens 16",
                f"vllm serve {model} --speculative-config '{{\"method\": \"eagle\", \"model\": \"{out}\", "
                f"\"num_speculative_tokens\": 5}}'"]
    cmds = [f"vllm serve {model} --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\", "
            f"\"num_speculative_tokens\": 5}}'"]
    if fmt == "eagle3":
        cmds.insert(0, f"python -m sglang.launch_server --model-path {model} --speculative-algorithm EAGLE3 "
                       f"--speculative-draft-model-path {out} --speculative-num-steps 5 "
                       f"--speculative-eagle-topk 4 --speculative-num-draft-tokens 16")
    else:
        cmds.append(f"vllm serve {out}   # the verifier named in its config")
    return cmds


def run(args: argparse.Namespace) -> int:
    import torch
    from .head import load_head
    from .loading import load_config, load_target
    dtype = getattr(torch, args.dtype)
    target, folder = load_target(args.model, device="cpu", dtype=torch.float32)
    head = load_head(args.head, target.args)
    n_layers = target.args.num_hidden_layers
    warnings = []
    if args.format == "eagle3":
        config, sd = eagle3_checkpoint(head, n_layers, dtype)
    elif args.format == "speculators":
        verifier = args.verifier or args.model or DEFAULT_VERIFIER
        archs = ["LlamaForCausalLM"]
        if folder.is_dir() and (folder / "config.json").is_file():
            archs = load_config(folder).get("architectures") or archs
        config, sd = speculators_checkpoint(head, n_layers, dtype, target.embed_tokens.weight, verifier, archs,
                                            args.speculative_tokens)
    else:
        config, sd, warnings = eagle1_checkpoint(head, dtype)
    write_checkpoint(Path(args.out), config, sd, force=args.force)
    for w in warnings:
        print(f"eaglespec: warning: {w}", file=sys.stderr)
    model = args.model or str(folder)  # the default model's converted folder: the weights the head was trained on
    print(f"wrote {args.format} checkpoint to {args.out} ({len(sd)} tensors, {args.dtype}); serve it with:")
    for cmd in serve_commands(args.format, Path(args.out), model):
        print(f"  {cmd}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a head in the layout vLLM or SGLang loads",
        description="Write HEAD (any format eaglespec reads) as a folder vLLM or SGLang loads: eagle3 (official "
                    "EAGLE-3 layout: SGLang EAGLE3, vLLM method eagle3), speculators (vLLM's speculators format) "
                    "or eagle (EAGLE-1 heads: vLLM method eagle, SGLang EAGLE). See docs/serving.md.")
    p.add_argument("head", help="head folder (ours, official EAGLE-1/2/3, SpecForge or speculators)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="folder to write (config.json + model.safetensors)")
    p.add_argument("--model", default=None,
                   help="the head's target: HF folder, hub id or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype in the file (the engines cast to their own)")
    p.add_argument("--verifier", default=None,
                   help=f"speculators: the target's name_or_path recorded in the config (default: --model, or {DEFAULT_VERIFIER})")
    p.add_argument("--speculative-tokens", type=int, default=5,
                   help="speculators: draft tokens per step recorded in the config")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out folder")
    p.set_defaults(func=run)
