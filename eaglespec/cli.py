"""`eaglespec` command line. Each feature module registers its own subcommand through `add_cli`."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# subcommand modules; each has add_cli(subparsers) that sets `func` on its parser
SUBCOMMAND_MODULES = ("eaglespec.generate_cli", "eaglespec.regenerate", "eaglespec.features", "eaglespec.train",
                      "eaglespec.bench", "eaglespec.calibrate", "eaglespec.serve", "eaglespec.export",
                      "eaglespec.fuzz")


def add_engine_args(p: argparse.ArgumentParser, head: bool = True) -> None:
    """Flags every command that builds an Engine shares."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
    if head:
        g.add_argument("--head", default=None, help="EAGLE head folder, or 'random' / 'random-eagle3' (untrained EAGLE-1 / EAGLE-3 heads) "
                            "(default: the model's shipped head)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--max-context", type=int, default=None, help="cap the context length (tokens) (default: the model's)")
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the decode, verify and draft steps (the default where a C++ compiler is "
                        "found; the first run compiles for minutes, later runs load the cached kernels)")
    g.add_argument("--eager", action="store_true",
                   help="do not compile: run the same static-shape calls eagerly (starts at once, slower on CPU)")
    t = p.add_argument_group("draft tree")
    t.add_argument("--tree", default="dynamic", choices=["dynamic", "static", "chain"])
    t.add_argument("--tree-size", default="auto",
                   help="dynamic tree: 'auto' (size and depth chosen each round by the measured cost model, see "
                        "`eaglespec calibrate`) or a fixed number of draft nodes verified per round")
    # None: TreeConfig's own defaults (named here without importing torch: --help stays fast)
    t.add_argument("--top-k-draft", type=int, default=None, help="children per expanded node (dynamic) (default: 4)")
    t.add_argument("--depth", type=int, default=None, help="draft depth (default: 5)")
    t.add_argument("--total-tokens", type=int, default=None,
                   help="dynamic, auto size: the most draft nodes a round may verify; fixed size: same as "
                        "--tree-size N (default: 16)")
    t.add_argument("--ngram", type=int, default=None,
                   help="dynamic tree: also offer, each round, up to N tokens that followed the latest earlier "
                        "occurrence of the context's last 2-4 tokens (prompt lookup); 0 = the head's drafts only "
                        "(default: 4)")
    t.add_argument("--drafts", default="sampled", choices=["sampled", "top-k"],
                   help="at temperature > 0: draw each node's children from the head's distribution (accepted "
                        "more often where the target is unsure) or take its top-k; both are lossless, and greedy "
                        "decoding always takes the top-k")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable) (default: none)")


def tree_config(args):
    from .tree import TreeConfig
    kw = {"kind": args.tree}
    for name in ("top_k", "depth", "total_tokens", "ngram"):
        v = getattr(args, "top_k_draft" if name == "top_k" else name, None)
        if v is not None:
            kw[name] = v
    size = str(getattr(args, "tree_size", "auto") or "auto")
    if size != "auto":
        try:
            kw["total_tokens"] = int(size)
        except ValueError:
            raise ValueError(f"--tree-size must be 'auto' or a number of draft nodes, got '{size}'") from None
    # auto sizing is the dynamic tree's; static trees and chains have their shape by definition
    kw["auto"] = size == "auto" and args.tree == "dynamic"
    return TreeConfig(**kw)


def resolve_compile(args) -> bool:
    """Compiled is the default (it is the fast path); --eager, EAGLESPEC_EAGER=1 or no C++ compiler mean eager."""
    if getattr(args, "eager", False):
        if getattr(args, "compile", None):
            raise ValueError("--compile and --eager contradict each other: pass one")
        return False
    if getattr(args, "compile", None) is None and os.environ.get("EAGLESPEC_EAGER", "") not in ("", "0"):
        return False
    from .compiled import compiler_available
    why = compiler_available()
    if why is not None:
        print(f"eaglespec: running eager: cannot compile here ({why})", file=sys.stderr)
        return False
    return True


def compile_progress(quiet: bool = False):
    """A progress callback for Engine.warmup: one line per compiled shape on stderr, with elapsed time, so
    a first compile (minutes on CPU) visibly moves; cached kernels make later runs fly through it."""
    import time
    start = time.perf_counter()

    def show(i: int, n: int, what: str):
        if quiet:
            return
        end = "\n" if i == n else "\r"
        label = "ready" if i == n else f"compiling {what}"
        print(f"eaglespec: {label} [{i}/{n}] {time.perf_counter() - start:.0f} s" + " " * 12, end=end,
              file=sys.stderr, flush=True)
    return show


def build_engine(args, head: bool = True, warm: bool = True, greedy: bool | None = None):
    """The engine the flags ask for; a compiled one has every shape compiled (with progress) before it returns
    (greedy True / False: only the shapes greedy / sampled generations call, see Engine.warmup)."""
    import torch
    from .engine import Engine
    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = Engine.load(args.model, getattr(args, "head", None) if head else "random", device=args.device,
                         dtype=dtype, tree=tree_config(args), max_context=args.max_context,
                         compile=resolve_compile(args))
    engine.draft_sampling = getattr(args, "drafts", "sampled") == "sampled"
    if engine.compiled and warm:
        engine.warmup(progress=compile_progress(), greedy=greedy)  # on stderr: never mixes with JSON on stdout
    return engine


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to every option's help that has a default worth showing and does not
    already explain it (argparse's ArgumentDefaultsHelpFormatter would also print "default: None" and
    skip options without help)."""
    for action in parser._actions:
        help_ = action.help
        flag = isinstance(action, argparse.BooleanOptionalAction)
        if (not action.option_strings or help_ is argparse.SUPPRESS or action.default is None
                or (action.default is False and not flag) or action.default is argparse.SUPPRESS
                or "default" in (help_ or "").lower()):
            continue
        shown = "%(default)s"
        if flag:  # "default: False" reads better as the flag
            shown = action.option_strings[0 if action.default else 1]
        action.help = f"{help_} (default: {shown})" if help_ else f"default: {shown}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglespec", description="Lossless EAGLE speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        mod.add_cli(sub)
    for sub_parser in sub.choices.values():
        show_defaults(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"eaglespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eaglespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 1
    except Exception as e:  # last resort: one line, and the traceback only on request
        if os.environ.get("EAGLESPEC_DEBUG"):
            raise
        print(f"eaglespec: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set EAGLESPEC_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
