"""Prompts the target writes itself (Magpie, arXiv 2406.08464): its chat template up to the start of a user turn,
then sampling at T = 1 until <|im_end|>. Prints one prompt per seed. Run from the repository root:
    python docs/bench/issue10/magpie-pilot.py [SEEDS]"""
import sys

from eaglespec.engine import Engine

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
e = Engine.load(compile=False)
tok = e.tokenizer
system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default
prefix = tok.apply_chat_template([{"role": "system", "content": system}], tokenize=False) + "<|im_start|>user\n"
ids = tok(prefix, add_special_tokens=False)["input_ids"]
for seed in range(seeds):
    r = e.generate(input_ids=ids, max_new_tokens=60, method="vanilla", temperature=1.0, seed=seed, stop=["<|im_end|>"])
    print(seed, repr(r.text))
