"""Can the target be steered into writing task-like questions (the kinds MT-bench asks: writing with constraints,
maths, code, extraction) rather than generic requests? Two ways, 8 seeds each, T = 1, stopped at <|im_end|>:
 - a system message naming the kind of task the user will give;
 - the user's message started for it (the first words forced, the rest sampled).
Run from the repository root:  python docs/bench/issue10/magpie-steer-pilot.py [SEEDS]"""
import sys

from eaglespec.engine import Engine

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
e = Engine.load(compile=False)
tok = e.tokenizer
default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
systems = {"math": "You are a helpful AI assistant. The user gives you a math word problem to solve step by step.",
           "code": "You are a helpful AI assistant. The user asks you to write a Python function for a precise task."}
starts = {"write": "Write a", "extract": "Extract", "solve": "Solve"}
cases = {f"system:{k}": (s, "") for k, s in systems.items()} | {f"start:{k}": (default, w) for k, w in starts.items()}
for name, (system, start) in cases.items():
    prefix = tok.apply_chat_template([{"role": "system", "content": system}], tokenize=False) + "<|im_start|>user\n" + start
    ids = tok(prefix, add_special_tokens=False)["input_ids"]
    for seed in range(seeds):
        r = e.generate(input_ids=ids, max_new_tokens=80, method="vanilla", temperature=1.0, seed=seed, stop=["<|im_end|>"])
        print(name, seed, repr(start + r.text)[:300], flush=True)
