"""`--compile`: the static-shape compiled decode, verify and draft steps emit plain greedy decoding's
tokens, with a head that gets drafts accepted (so the compiled cache writes and moves are exercised).
Compiled with inductor's default mode: the kernels differ from max-autotune's, the shapes and cache
logic under test do not."""
from __future__ import annotations

import pytest
import torch

from eaglespec.engine import Engine
from eaglespec.tree import TreeConfig, ancestor_mask


def test_compiled_engine_matches_eager_greedy(make_oracle_pair, same_or_tie):
    model, head = make_oracle_pair(noise=0.3, logit_scale=3.0)
    compiled = Engine(model, head=head, tree=TreeConfig(total_tokens=8), max_context=256, compile="default")
    eager = Engine(model, head=head, tree=TreeConfig(total_tokens=8))
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(3, model.args.vocab_size, (10 + 3 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        want = eager.generate(input_ids=prompt, max_new_tokens=40, method="vanilla", ignore_eos=True).token_ids
        for method in ("vanilla", "eagle"):
            r = compiled.generate(input_ids=prompt, max_new_tokens=40, method=method, ignore_eos=True)
            same_or_tie(model, prompt, r.token_ids, want)
            if method == "eagle":
                accepted += max(r.accept_lengths) > 2
    assert accepted >= 2  # drafts were accepted, so compacted caches were read back

    # a tree verification through the compiled step gives the eager forward's logits
    prompt = list(range(5, 25))
    compiled.generate(input_ids=prompt, max_new_tokens=1, method="vanilla")  # the prompt's K/V into the cache
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 4])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3])
    tokens = torch.randint(3, model.args.vocab_size, (1, 9), generator=torch.Generator().manual_seed(9))
    mask = torch.cat([torch.ones(9, len(prompt), dtype=torch.bool), ancestor_mask(parents)], dim=1)
    pos = (len(prompt) + depths)[None]
    with torch.inference_mode():
        got = compiled._verify_forward(tokens[0], pos[0], len(prompt), mask)[1][None]
        model.setup_cache(64)  # a fresh eager run of the same prompt and tree
        _, ref = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache_start=0)
        _, ref = model(tokens, pos, mask=mask, cache_start=len(prompt))
    assert torch.allclose(got, ref, atol=1e-4), float((got - ref).abs().max())


@pytest.mark.parametrize("greedy", [None, True, False])
def test_warmup_compiles_every_graph_that_generation_uses(make_oracle_pair, greedy):
    """After `warmup`, generating compiles nothing more: a graph compiled lazily costs the first user
    request seconds to minutes (a stride-0 root hidden once recompiled the depth call). warmup(greedy=True)
    / (greedy=False), which skip the other temperature's graphs, cover every greedy / sampled generation."""
    from torch._dynamo.utils import counters
    model, head = make_oracle_pair(noise=0.3, logit_scale=3.0)
    engine = Engine(model, head=head, tree=TreeConfig(total_tokens=8), max_context=256, compile="default")
    engine.warmup(greedy=greedy)
    before = dict(counters["stats"])
    temps = {None: (0.0, 1.0), True: (0.0,), False: (1.0,)}[greedy]
    for seed in range(2):
        prompt = torch.randint(3, model.args.vocab_size, (12 + 5 * seed,),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        for method in ("vanilla", "eagle"):
            for t in temps:
                engine.generate(input_ids=prompt, max_new_tokens=24, method=method, ignore_eos=True,
                                temperature=t, seed=seed)
    assert dict(counters["stats"]) == before, (before, dict(counters["stats"]))


WARM_SCRIPT = r"""
import json, sys
import pytest
import torch
from eaglespec.engine import Engine
engine = Engine.load(sys.argv[1], head="random", device="cpu", compile=True)
engine.warmup()
engine.generate(input_ids=[1, 2, 3], method="eagle", max_new_tokens=6, ignore_eos=True)
from torch._dynamo.utils import counters
out = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
print(json.dumps({**out, "packed": engine.packed_gemm}))
"""


def test_compiled_graphs_are_cached_for_the_next_process(tiny_checkpoint, tmp_path):
    """A second process reuses the compiled graphs from the FX graph cache under ~/.cache/eaglespec.
    Until the fp32 linears were kept out of MKL packing, every graph held an mkldnn tensor the cache
    cannot pickle ("bypass"), and each process compiled everything again. On torch's GEMM the one-row
    graphs keep MKL's GEMV (faster there), so they alone are compiled again; on our packed GEMM
    (cpugemm.py, the CPU default) nothing is frozen and every graph is reused."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "EAGLESPEC_CACHE": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)

    def run():
        out = subprocess.run([sys.executable, "-c", WARM_SCRIPT, str(tiny_checkpoint("llama"))], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (tmp_path / "cache" / "inductor").is_dir()  # not /tmp/torchinductor_$USER
    # bypassed: the one-row graphs only (the target's one-token step, and the head's one-token call)
    most_bypassed = 0 if first.pop("packed") else 2
    second.pop("packed")
    assert first.get("fxgraph_cache_bypass", 0) <= most_bypassed and first.get("fxgraph_cache_miss", 0) >= 3, first
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"] + first.get("fxgraph_cache_hit", 0), second
    assert second.get("fxgraph_cache_miss", 0) == 0 and second.get("fxgraph_cache_bypass", 0) <= most_bypassed, second


def test_a_warm_compiled_engine_follows_a_changed_draft_top_k(make_oracle_pair, same_or_tie):
    """Warm calls skip re-checking guards (compiled.StaticCall): the draft graphs read the engine's top-k,
    which `bench` changes between methods, so a new top-k must compile new graphs, not reuse the old."""
    from dataclasses import replace
    torch._dynamo.reset()
    model, head = make_oracle_pair(noise=0.3)
    compiled = Engine(model, head=head, tree=TreeConfig(total_tokens=8, top_k=4), max_context=256, compile="default")
    eager = Engine(model, head=head)
    prompt = [1, 5, 9, 2, 7]
    want = eager.generate(input_ids=prompt, max_new_tokens=24, method="vanilla", ignore_eos=True).token_ids
    for k in (4, 2, 4, 3):
        compiled.tree = replace(compiled.tree, top_k=k)
        got = compiled.generate(input_ids=prompt, max_new_tokens=24, method="eagle", ignore_eos=True)
        same_or_tie(model, prompt, got.token_ids, want)
        assert compiled._expand_call._warm and all(s[1] in (2, 3, 4) for s in compiled._expand_call._warm)


def test_generate_warms_the_graphs_its_sampling_settings_call(make_oracle_pair):
    """`generate`/`chat` warm greedy graphs at T = 0, the sampled fused call at T > 0, and everything where a top-k
    or top-p filter sends sampled rounds to the separate calls (Engine.fuses_sampling)."""
    from argparse import Namespace
    from eaglespec.generate_cli import _warms_for
    from eaglespec.sampling import SamplingParams
    assert _warms_for(Namespace(temperature=0.0, top_p=0.9, top_k=5)) is True
    assert _warms_for(Namespace(temperature=0.7, top_p=1.0, top_k=0)) is False
    assert _warms_for(Namespace(temperature=0.7, top_p=0.9, top_k=0)) is None
    assert _warms_for(Namespace(temperature=0.7, top_p=1.0, top_k=5)) is None
    model, head = make_oracle_pair()
    engine = Engine(model, head=head)
    assert engine.fuses_sampling(SamplingParams(0.7)) and not engine.fuses_sampling(SamplingParams(0.7, top_p=0.9))
    assert not engine.fuses_sampling(SamplingParams(0.7, top_k=5)) and not engine.fuses_sampling(SamplingParams(0.0))
    assert engine.calls_for(False) == (False, False, True) and engine.calls_for(True) == (False, True, False)
    assert engine.calls_for(None) == (True, True, True)
    engine.draft_sampling = False  # top-k drafts at T > 0 verify on the host
    assert engine.calls_for(False) == (True, False, False)
