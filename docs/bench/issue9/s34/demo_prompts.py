"""tau of ten everyday prompts at T = 0 (the demo prompt is chosen near their median): python docs/bench/issue9/s34/demo_prompts.py"""
from eaglespec.cli import build_parser, build_engine
args = build_parser().parse_args(["generate", "x"])
eng = build_engine(args, greedy=True)
prompts = ["Explain in a few sentences why the sky is blue.",
 "Give me three tips for staying productive while working from home.",
 "What are the main differences between Python and JavaScript?",
 "Write a short story about a robot who learns to paint.",
 "Explain how a bill becomes a law in the United States.",
 "What are the health benefits of regular exercise?",
 "Describe the water cycle in simple terms.",
 "Write a haiku about autumn, then explain it.",
 "How do I make a cup of good coffee at home?",
 "Summarize the causes of the French Revolution."]
for p in prompts:
    r = eng.generate(messages=[{"role":"user","content":p}], max_new_tokens=128, temperature=0.0, method="eagle")
    print(f"{r.tau:.2f} {r.new_tokens} {p}", flush=True)
