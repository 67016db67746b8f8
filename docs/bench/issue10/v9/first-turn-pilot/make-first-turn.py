"""The regenerated corpus cut to each record's first exchange (system/user turns, then the first answer), keys
kept, so the held-out split is the same conversations: runs/s24/first/regen-first-turn.jsonl."""
import glob, gzip, json, sys
out = sys.argv[1] if len(sys.argv) > 1 else "runs/s24/first/regen-first-turn.jsonl"
with open(out, "w") as f:
    for shard in sorted(glob.glob("corpora/smollm2-135m-instruct/regen/shard-*.jsonl.gz")):
        for line in gzip.open(shard, "rt"):
            r = json.loads(line)
            i = next((k for k, m in enumerate(r["messages"]) if m["role"] == "assistant"), None)
            if i is not None:
                f.write(json.dumps({"key": r["key"], "temperature": r["temperature"], "source_index": r["source_index"],
                                    "messages": r["messages"][:i + 1]}) + "\n")
