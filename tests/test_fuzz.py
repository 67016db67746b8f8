"""The differential fuzzer in CI: hundreds of random cases on a tiny target whose head usually drafts
right, every field of EAGLE's result (streamed, and through the server) against plain decoding's."""
from __future__ import annotations

import json


from eaglespec.cli import main
from eaglespec.fuzz import COMPILED_TREES, Case, Engines, fuzz, run_case
from eaglespec.testing import eagle3_oracle_pair, oracle_pair, tiny_tokenizer

CASES = 300


def tiny_engines() -> Engines:
    model, head = oracle_pair(noise=0.3, logit_scale=3.0)
    return Engines(model, tiny_tokenizer(), head)


def check(summary, cases: int):
    assert summary.cases == cases
    assert summary.diverged == 0, [c.to_json() for c, _ in summary.failures]
    assert summary.ties <= cases // 50  # the oracle pair is rarely tied; many ties would hide divergences
    assert summary.accepted >= cases // 2, "drafts were rarely accepted: acceptance paths went untested"


def test_fuzz_eager_cases_equal_plain_decoding_in_every_field():
    engines = tiny_engines()
    try:
        summary = fuzz(engines, CASES, seed=0, compiled_share=0.0, server_share=0.1, log=print)
    finally:
        engines.close()
    print(summary.line())
    check(summary, CASES)
    cov = summary.coverage
    for key in ("chat", "raw", "tree:dynamic", "tree:auto", "tree:static", "tree:chain", "vocab:head", "vocab:other",
                "stop", "no-stop", "extra-eos", "ignore-eos", "server:chat", "server:completions"):
        assert cov.get(key, 0) >= 5, (key, cov)


def test_fuzz_compiled_cases_equal_plain_decoding():
    """Sparse: one compiled engine (a compile costs tens of seconds here), a few cases through it."""
    engines = tiny_engines()
    try:
        summary = fuzz(engines, 6, seed=1, compiled_share=1.0, server_share=0.0, compiled_trees=COMPILED_TREES[:1])
    finally:
        engines.close()
    check(summary, 6)
    assert summary.coverage["compiled"] == 6


def test_fuzz_eagle3_cases_equal_plain_decoding_in_every_field():
    """The same random cases with an EAGLE-3 head (its own LM head; its other draft vocabulary is a
    random half of its rows), eager and, sparsely, compiled."""
    model, head = eagle3_oracle_pair(noise=0.3, logit_scale=3.0)
    engines = Engines(model, tiny_tokenizer(), head)
    try:
        summary = fuzz(engines, CASES // 2, seed=2, compiled_share=0.02, server_share=0.1,
                       compiled_trees=COMPILED_TREES[:1])
    finally:
        engines.close()
    print(summary.line())
    check(summary, CASES // 2)
    for key in ("tree:dynamic", "tree:auto", "tree:static", "tree:chain", "vocab:head", "vocab:other", "compiled"):
        assert summary.coverage.get(key, 0) >= 1, (key, summary.coverage)


def test_a_divergence_prints_a_one_line_reproduction(monkeypatch, capsys):
    """Plant a stopping bug (EAGLE keeps its whole last round); the fuzzer names it and the printed
    command replays the failing case."""
    from eaglespec import engine as engine_module
    real = engine_module.Stopper.feed

    def sloppy(self, tokens):
        outcome = real(self, tokens)
        if outcome.done and self.finish == "stop" and len(tokens) > outcome.consumed:
            self.out += tokens[outcome.consumed:]  # the rest of the round stays in token_ids
        return outcome

    monkeypatch.setattr(engine_module.Stopper, "feed", sloppy)
    assert main(["fuzz", "--tiny", "--cases", "40", "--compiled-share", "0", "--server-share", "0"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip().startswith("reproduce: ")]
    assert lines and "DIVERGED" in out and "result.token_ids" in out
    cmd = lines[0].split("reproduce: ", 1)[1]
    assert cmd.startswith("eaglespec fuzz --tiny --case ")
    import shlex
    argv = shlex.split(cmd)[1:]
    case = Case.from_json(argv[-1])
    assert json.loads(case.to_json()) == json.loads(argv[-1])
    assert main(argv) == 1  # the reproduction fails the same way
    monkeypatch.setattr(engine_module.Stopper, "feed", real)
    assert main(argv) == 0  # and passes once the bug is gone
    engines = tiny_engines()
    try:
        assert run_case(engines, case).status == "ok"
    finally:
        engines.close()


def test_bad_fuzz_arguments_are_one_line(capsys):
    for argv in (["--cases", "0"], ["--compiled-share", "2"], ["--case", "{not json"]):
        assert main(["fuzz", "--tiny", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("eaglespec: error: "), err
