"""Held-out top-1 (depth 1 and depth 3) of the shipped line of EAGLE-1 heads against the regenerated conversations
behind each, on the fixed 40 held-out conversations (23,167 positions), as docs/training.md reports them; v9's point
is read from its evaluation (docs/bench/issue10/v9/texts-s27/heldout-v9.json, written by after.sh). Writes learning-curve.png here.

    python docs/bench/issue10/learning_curve.py
"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
# (regenerated conversations, top-1, depth-3 top-1, head): docs/training.md, "v4" to "v8"
POINTS = [(0, 0.507, 0.365, "ShareGPT only"), (809, 0.596, 0.455, "v3"), (1333, 0.612, 0.483, "v4"), (1877, 0.644, 0.510, "v5"),
          (4011, 0.668, 0.533, "v6"), (5157, 0.666, 0.534, "v7 (slices)"), (5993, 0.688, 0.556, "v8 (one pass)")]
v9 = HERE / "v9" / "texts-s27" / "heldout-v9.json"
if v9.is_file():
    e = json.loads(v9.read_text())
    POINTS.append((9436, e["top1"], e["top1_depth3"], "v9 (shipped)"))

fig, ax = plt.subplots(figsize=(7, 4.2))
xs = [p[0] for p in POINTS]
ax.plot(xs, [p[1] for p in POINTS], "o-", label="top-1, depth 1")
ax.plot(xs, [p[2] for p in POINTS], "s-", label="top-1, depth 3")
for x, y, _, name in POINTS:
    ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
ax.set_ylim(0.34, 0.73)
ax.axhline(0.70, color="grey", ls="--", lw=0.8)
ax.axhline(0.50, color="grey", ls=":", lw=0.8)
ax.text(2500, 0.703, "target: top-1 0.70", fontsize=7, color="grey")
ax.text(0, 0.488, "target: depth 3 0.50", fontsize=7, color="grey")
ax.set_xlabel("regenerated conversations behind the head")
ax.set_ylabel("held-out top-1 (40 conversations, 23,167 positions)")
ax.set_title("EAGLE-1 head for SmolLM2-135M-Instruct: learning curve")
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "learning-curve.png", dpi=110)
print("wrote", HERE / "learning-curve.png")
