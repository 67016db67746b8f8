# Issue 9 reference runs on the twenty-fourth session default (int8 activations, packed weights on transparent huge pages; quiet, nothing else running), shipped head.
set -e
out=${OUT:-docs/bench/issue9/s24-hugepages}
mkdir -p $out
for i in 1 2; do eaglespec calibrate --reps 31 --json > $out/calibrate-$i.json; done
eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 --temperature 0 \
  --json $out/mt80-T0.json --report $out/mt80-T0
eaglespec bench --dataset mt_bench --max-turns 1 --limit 20 --methods vanilla,eagle --max-new-tokens 128 --temperature 1 \
  --json $out/mt20-T1.json --report $out/mt20-T1
