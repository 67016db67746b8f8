"""`--help` of every subcommand says what each option defaults to."""
import argparse

from eaglespec.cli import build_parser


def test_every_option_of_every_subcommand_shows_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in sub.choices.items():
        for action in p._actions:
            if (not action.option_strings or action.help is argparse.SUPPRESS or action.required
                    or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction))):
                continue
            if "default" not in (action.help or "").lower():
                missing.append(f"{name} {action.option_strings[-1]}")
        text = p.format_help()
        assert "default" in text, name
    assert not missing, missing


def test_defaults_are_rendered(capsys):
    parser = build_parser()
    try:
        parser.parse_args(["serve", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "(default: 8000)" in out.replace("\n", " ").replace("  ", " ") or "default: 8000" in out



def test_the_tree_defaults_named_in_help_are_treeconfigs():
    from eaglespec.tree import TreeConfig
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.option_strings[-1]: a.help for a in sub.choices["generate"]._actions if a.option_strings}
    cfg = TreeConfig()
    assert f"(default: {cfg.top_k})" in helps["--top-k-draft"]
    assert f"(default: {cfg.depth})" in helps["--depth"]
    assert f"(default: {cfg.total_tokens})" in helps["--total-tokens"]
