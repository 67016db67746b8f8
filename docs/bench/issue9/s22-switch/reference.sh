# Issue 9 reference runs on the GGUF-block default with the speculate-or-not switch (quiet), shipped head.
set -e
out=docs/bench/issue9/s22-switch
eaglespec bench --dataset mt_bench --max-turns 1 --limit 20 --methods vanilla,eagle --max-new-tokens 128 --temperature 1 \
  --json $out/mt20-T1.json --report $out/mt20-T1
eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 --temperature 0 \
  --json $out/mt80-T0.json --report $out/mt80-T0
