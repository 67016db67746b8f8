"""`eaglespec features`: the frozen target's features for every token of the training data, once,
into safetensors shards, so that several training epochs do not pay the target's forward again.

OUT/manifest.json describes the run; OUT/shard-00000.safetensors ... each hold `--shard-size`
conversations, flattened: input_ids (int32, N), loss_mask (uint8, N: 1 on assistant tokens),
features (float16/bfloat16, N x hidden), offsets (int64, conversations + 1), index (int64: the
conversation's position in the loaded data). With `--arch eagle3` they also hold aux_features
(N x 3 hidden: the hidden states entering the three layers listed as `aux_layers` in the manifest);
`features` stays, because the target's distribution (the training signal) is lm_head(features).
The split keys sit in each shard's metadata. Shards are written to a temporary file and renamed, so
an interrupted run resumes by skipping finished shards.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch

from .data import Example, encode_all, load_conversations, pack_by_length

FORMAT = "eaglespec-features"
FEATURE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def add_model_args(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the target's dtype (default: float32 on CPU, bfloat16 on CUDA)")


def add_autocast_arg(p, what: str) -> None:
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto",
                   help=f"bf16 mixed precision for {what} (auto: on CUDA only; bf16 also pays on a CPU with "
                        "AVX512_BF16 or AMX, where matmuls run about 2.5x faster than fp32; off: fp32)")


def autocast_for(device: torch.device, choice: str) -> Callable[[], ContextManager]:
    """A factory of the autocast context that `--autocast` asks for on `device`. "auto" keeps a CPU at
    fp32, so that numbers measured on a CPU stay comparable with earlier runs; bf16 on a CPU is opt-in."""
    if choice == "off" or (choice == "auto" and device.type != "cuda"):
        return contextlib.nullcontext
    if device.type == "cpu" and not cpu_has_bf16():
        _warn_slow_bf16()
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def forward_autocast(target, choice: str) -> Callable[[], ContextManager]:
    """The autocast of the target's forward: a target already in bf16 (CUDA's default) is unchanged by it,
    so there is nothing to turn on (or to record in a store's manifest)."""
    if target.embed_tokens.weight.dtype != torch.float32:
        return contextlib.nullcontext
    return autocast_for(target.embed_tokens.weight.device, choice)


@functools.cache
def _warn_slow_bf16() -> None:
    """Once per process: training asks for the context twice (its steps, its in-loop target forward)."""
    print("eaglespec: this CPU has no bf16 instructions (AVX512_BF16 or AMX): --autocast bf16 will be slower "
          "than fp32 here", file=sys.stderr)


def cpu_has_bf16() -> bool:
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def add_data_args(p):
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="sharegpt (default) | PATH.json | PATH.jsonl | hf:NAME")
    g.add_argument("--max-conversations", type=int, default=None, help="use the first N usable conversations; the records of one split ShareGPT chat count once "
                        "(default: all)")
    g.add_argument("--max-len", type=int, default=None, help="cut conversations to this many tokens (default 2048)")
    g.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per batch (sequences of similar length are batched together)")
    return g


def add_cli(sub) -> None:
    p = sub.add_parser("features", help="precompute the target's features for training into sharded files")
    add_model_args(p)
    add_data_args(p).add_argument(
        "--skip-conversations", type=int, default=0, metavar="N",
        help="leave out the first N usable conversations, e.g. those an earlier store holds (--max-conversations "
             "still counts from the first: --skip-conversations 1000 --max-conversations 4011 gives the "
             "1,001st to the 4,011th) (default: 0)")
    p.add_argument("--out", required=True, help="output folder (rerun the same command to resume)")
    p.add_argument("--shard-size", type=int, default=64, help="conversations per shard")
    p.add_argument("--feature-dtype", default="float16", choices=list(FEATURE_DTYPES),
                   help="on-disk dtype of the features (float16 keeps more mantissa; bfloat16 more range)")
    add_arch_args(p)
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the target's forward, one dynamic-shape graph (the default where a C++ "
                        "compiler is found: on the 2-core CPU it fuses the norms, rotary and SiLU that eager "
                        "runs as separate passes over memory; about a minute to compile once)")
    p.add_argument("--eager", action="store_true", help="do not compile the target's forward")
    add_autocast_arg(p, "the target's forward (features then differ from fp32 ones by about 1 %%)")
    p.set_defaults(func=run_features)


def add_arch_args(p) -> None:
    p.add_argument("--arch", default="eagle", choices=["eagle", "eagle3"],
                   help="eagle: EAGLE-1/2 heads, fed the target's last feature; eagle3: EAGLE-3 heads, fed the "
                        "hidden states entering three target layers (stored features: 4x the disk per token)")
    p.add_argument("--aux-layers", default=None, metavar="A,B,C",
                   help="eagle3: the target layers whose entering hidden states are taken (default: EAGLE-3's "
                        "2, L//2, L-3; L = the last layer's output)")


def parse_aux_layers(spec: str | None, n_layers: int) -> tuple[int, ...]:
    from .model import check_aux_layers, default_aux_layers
    if spec is None:
        return default_aux_layers(n_layers)
    try:
        layers = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--aux-layers must be three integers like 2,15,27, got '{spec}'") from None
    return check_aux_layers(layers, n_layers)


# ---- shared by `features` and `train` -------------------------------------------------------------

def check_positive(**values) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def load_model(args):
    from .loading import load_target, load_tokenizer
    dtype = getattr(torch, args.dtype) if args.dtype else None
    target, folder = load_target(args.model, device=args.device, dtype=dtype)
    return target, load_tokenizer(folder), folder


def load_examples(tokenizer, data: str, max_conversations: int | None, max_len: int, log=print,
                  skip: int = 0) -> tuple[list[Example], str]:
    """Conversations of `data` tokenized with the target's template; prints and returns the summary line."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template: training data cannot be rendered")
    conversations, report = load_conversations(data, max_conversations, skip=skip)
    examples = encode_all(tokenizer, conversations, max_len, report, progress=True)
    summary = report.summary(len(examples), len({e.key for e in examples}))
    log(summary)
    if not examples:
        raise ValueError(f"no usable conversations in {data} after tokenizing (max-len {max_len})")
    return examples, summary


def model_spec(model: str | None) -> str:
    """--model as recorded: an existing path made absolute (training may run elsewhere)."""
    if not model:
        return "default"
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def model_fingerprint(model) -> str:
    """Identifies the target's weights well enough to refuse features computed with another model."""
    h = hashlib.sha256(json.dumps(model.args.to_dict(), sort_keys=True, default=str).encode())
    for w in (model.norm.weight, model.lm_head.weight[:64], model.layers[-1].mlp.down_proj.weight[:8]
              if hasattr(model.layers[-1], "mlp") else model.embed_tokens.weight[:64]):
        h.update(w.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def pad_batch(seqs: list[list[int]] | list[torch.Tensor], value=0, dtype=torch.long) -> torch.Tensor:
    """Right-padded (B, T): with causal attention a real token never sees a pad to its right."""
    t = max(len(s) for s in seqs)
    out = torch.full((len(seqs), t), value, dtype=dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s, dtype=dtype)
    return out


def target_features(target, ids: torch.Tensor, aux_layers=None) -> torch.Tensor:
    """The features (after the final norm) of right-padded `ids` (B, T); no logits needed. With
    `aux_layers` (EAGLE-3): (B, T, 4H), the features then the hidden states entering those layers."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    if aux_layers is None:
        feats, _ = target(ids, positions, logits=False)
        return feats
    feats, _, aux = target(ids, positions, logits=False, aux_layers=aux_layers)
    return torch.cat([feats, aux], dim=-1)


def compiled_forward(target):
    """The target's forward as one graph over any (batch, length): batches come padded to many lengths, and
    a static graph per length would spend more time compiling than it saves. Not the engine's static
    calls (compiled.py): no KV cache, no freezing, inductor's defaults."""
    print("features: compiling the target's forward (once per process; --eager skips it)", file=sys.stderr)
    return torch.compile(target, dynamic=True)


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Positions in `lengths`, longest first, packed into batches of at most batch_tokens padded tokens."""
    return pack_by_length(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, batch_tokens)


# ---- the command ------------------------------------------------------------------------------------

def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def run_features(args) -> int:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .cli import resolve_compile
    check_positive(max_conversations=args.max_conversations, max_len=args.max_len,
                   batch_tokens=args.batch_tokens, shard_size=args.shard_size)
    skip = args.skip_conversations
    if skip < 0:
        raise ValueError(f"--skip-conversations must be >= 0, got {skip}")
    if args.max_conversations is not None and skip >= args.max_conversations:
        raise ValueError(f"--skip-conversations {skip} leaves nothing of --max-conversations {args.max_conversations}")
    data, max_len = args.data or "sharegpt", args.max_len or 2048
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    target, tokenizer, folder = load_model(args)
    aux = parse_aux_layers(args.aux_layers, target.args.num_hidden_layers) if args.arch == "eagle3" else None
    forward = compiled_forward(target) if resolve_compile(args) else target
    device = target.embed_tokens.weight.device
    autocast = forward_autocast(target, args.autocast)
    examples, summary = load_examples(tokenizer, data, args.max_conversations, max_len, skip=skip)
    shards = [examples[i:i + args.shard_size] for i in range(0, len(examples), args.shard_size)]
    manifest = {
        "format": FORMAT, "version": 1,
        "model": model_spec(args.model), "model_folder": str(folder), "model_fingerprint": model_fingerprint(target),
        "hidden_size": target.args.hidden_size, "vocab_size": target.args.vocab_size,
        "data": data, "max_conversations": args.max_conversations, "max_len": max_len,
        "feature_dtype": args.feature_dtype, "shard_size": args.shard_size, "data_summary": summary,
        "n_conversations": len(examples), "n_tokens": sum(len(e.ids) for e in examples),
        "n_assistant_tokens": sum(sum(e.mask) for e in examples),
        "shards": [{"file": shard_name(i), "conversations": len(s), "tokens": sum(len(e.ids) for e in s)}
                   for i, s in enumerate(shards)],
        "complete": False,
        **({"arch": "eagle3", "aux_layers": list(aux)} if aux is not None else {}),
        # recorded only when on, so stores written before the option existed still resume
        **({"autocast": "bf16"} if autocast is not contextlib.nullcontext else {}),
        **({"skip_conversations": skip} if skip else {}),
    }
    out.mkdir(parents=True, exist_ok=True)
    check_resumable(out, manifest)
    done = [shard_matches(out / shard_name(i), s) for i, s in enumerate(shards)]
    write_json(out / "manifest.json", manifest)

    total = manifest["n_tokens"]
    initial = sum(s["tokens"] for s, d in zip(manifest["shards"], done) if d)
    if any(done):
        print(f"resuming: {sum(done)} of {len(shards)} shards already in {out}")
    fdtype = FEATURE_DTYPES[args.feature_dtype]
    start = time.perf_counter()
    bar = tqdm(total=total, initial=initial, unit="tok", unit_scale=True, desc="features", smoothing=0.1)
    for i, shard in enumerate(shards):
        if done[i]:
            continue
        feats = [None] * len(shard)
        for b in length_batches([len(e.ids) for e in shard], args.batch_tokens):
            ids = pad_batch([shard[j].ids for j in b]).to(device)
            with torch.inference_mode(), autocast():
                f = target_features(forward, ids, aux)
            if fdtype == torch.float16 and f.abs().max() > 65000:
                raise ValueError("features overflow float16: rerun with --feature-dtype bfloat16")
            for row, j in enumerate(b):
                feats[j] = f[row, : len(shard[j].ids)].to(device="cpu", dtype=fdtype)
            bar.update(sum(len(shard[j].ids) for j in b))
        lengths = torch.tensor([len(e.ids) for e in shard])
        h = target.args.hidden_size
        flat = torch.cat(feats)
        tensors = {
            "input_ids": torch.tensor([t for e in shard for t in e.ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for e in shard for m in e.mask], dtype=torch.uint8),
            "features": flat[:, :h].contiguous(),
            **({"aux_features": flat[:, h:].contiguous()} if aux is not None else {}),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "index": torch.tensor([e.index for e in shard], dtype=torch.long),
        }
        tmp = out / (shard_name(i) + ".tmp")
        save_file(tensors, str(tmp), metadata={"keys": json.dumps([e.key for e in shard])})
        tmp.replace(out / shard_name(i))
    bar.close()
    manifest["complete"] = True
    manifest["seconds"] = round(time.perf_counter() - start, 1)
    write_json(out / "manifest.json", manifest)
    done_tokens = total - initial
    rate = done_tokens / max(time.perf_counter() - start, 1e-9)
    print(f"features: {len(examples):,} conversations, {total:,} tokens in {len(shards)} shards in {out} "
          f"({done_tokens:,} computed now at {rate:,.0f} tok/s)")
    return 0


# A rerun with a larger --max-conversations keeps every finished shard that holds the same conversations.
RESUME_KEYS = ("model_fingerprint", "data", "max_len", "feature_dtype", "shard_size", "arch", "aux_layers", "autocast",
               "skip_conversations")


def shard_matches(path: Path, shard: list[Example]) -> bool:
    """A finished shard file that holds exactly these conversations (so it need not be recomputed)."""
    if not path.is_file():
        return False
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads(f.metadata()["keys"]) == [e.key for e in shard]
    except Exception:  # a damaged shard is recomputed
        return False


def check_resumable(out: Path, manifest: dict) -> None:
    path = out / "manifest.json"
    if not path.is_file():
        if any(out.glob("shard-*.safetensors")):
            raise ValueError(f"{out} holds shards but no manifest.json: use an empty --out folder")
        return
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON: delete {out} or use another --out") from None
    diff = [k for k in RESUME_KEYS if old.get(k) != manifest.get(k)]
    if old.get("format") != FORMAT or diff:
        raise ValueError(f"{out} holds features of a different run (differs in: {', '.join(diff) or 'format'}): "
                         "use another --out or repeat the original command")


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


# ---- reading them back --------------------------------------------------------------------------------

class FeatureStore:
    """Random access to the conversations of a features folder (memory-mapped, read per slice)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open
        self.folder = Path(folder).expanduser()
        path = self.folder / "manifest.json"
        if not path.is_file():
            raise ValueError(f"no features in {self.folder} (missing manifest.json): run `eaglespec features --out {folder}`")
        try:
            self.manifest = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not valid JSON") from None
        m = self.manifest
        missing = [s["file"] for s in m.get("shards", []) if not (self.folder / s["file"]).is_file()]
        if m.get("format") != FORMAT:
            raise ValueError(f"{path} is not an eaglespec features manifest")
        if missing or not m.get("complete"):
            n = len(m.get("shards", []))
            raise ValueError(f"features in {self.folder} are incomplete ({n - len(missing)} of {n} shards done): "
                             "rerun the same `eaglespec features` command to finish them")
        self.files, self.rows, self.keys, self.index, self.lengths = [], [], [], [], []
        for f, s in enumerate(m["shards"]):
            handle = safe_open(str(self.folder / s["file"]), framework="pt")
            self.files.append(handle)
            offsets = handle.get_tensor("offsets").tolist()
            self.keys += json.loads(handle.metadata()["keys"])
            self.index += handle.get_tensor("index").tolist()
            for a, b in zip(offsets[:-1], offsets[1:]):
                self.rows.append((f, a, b))
                self.lengths.append(b - a)

    def __len__(self) -> int:
        return len(self.rows)

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (T,) long and assistant mask (T,) bool, without reading the features."""
        f, a, b = self.rows[i]
        h = self.files[f]
        return h.get_slice("input_ids")[a:b].long(), h.get_slice("loss_mask")[a:b].bool()

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        """The layers an EAGLE-3 store holds (None: an EAGLE-1 store, the last feature only)."""
        layers = self.manifest.get("aux_layers")
        return tuple(layers) if layers else None

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids (T,) long, assistant mask (T,) bool, features (T, H) in the stored dtype; for an EAGLE-3
        store (T, 4H): the features then the three aux layers, as `target_features` gives them."""
        f, a, b = self.rows[i]
        h = self.files[f]
        feats = h.get_slice("features")[a:b]
        if self.aux_layers is not None:
            feats = torch.cat([feats, h.get_slice("aux_features")[a:b]], dim=-1)
        return h.get_slice("input_ids")[a:b].long(), h.get_slice("loss_mask")[a:b].bool(), feats
