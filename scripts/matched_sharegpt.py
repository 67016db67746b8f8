"""The ShareGPT records a regenerated corpus was made from, with their original (ChatGPT) answers, as
JSONL under the same conversation keys. The ablation's "today's recipe" arm then holds the same
conversations and the same held-out split as the regenerated arm, and differs only in who wrote the
answers.

    python scripts/matched_sharegpt.py corpora/smollm2-135m-instruct/regen OUT.jsonl [--max-conversations N]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglespec.data import LoadReport, iter_regenerated, records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("regenerated", help="an `eaglespec regenerate` folder")
    p.add_argument("out", help="the JSONL to write")
    p.add_argument("--max-conversations", type=int, default=None, help="the first N regenerated conversations")
    a = p.parse_args()
    wanted: dict[int, str] = {}  # source record -> its conversation key
    keys: set[str] = set()
    for r in iter_regenerated(Path(a.regenerated), LoadReport(source=a.regenerated)):
        if a.max_conversations is not None and r["key"] not in keys and len(keys) >= a.max_conversations:
            break
        keys.add(r["key"])
        wanted[int(r["source_index"])] = r["key"]
    if not wanted:
        print(f"matched_sharegpt: no regenerated records in {a.regenerated}", file=sys.stderr)
        return 2
    last, n = max(wanted), 0
    with open(a.out, "w") as f:
        for i, rec in enumerate(records("sharegpt", LoadReport(source="sharegpt"))):
            if i in wanted:
                f.write(json.dumps({"key": wanted[i], "conversations": rec["conversations"]}) + "\n")
                n += 1
            if i >= last:
                break
    print(f"{n:,} ShareGPT records ({len(keys):,} conversations) written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
