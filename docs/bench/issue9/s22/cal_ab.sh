# old (HEAD's code, /tmp/old) and new (working tree) calibrations, alternating; quiet machine
set -e
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then dir=/tmp/old; else dir=/work/main; fi
    start=$(date +%s)
    (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m eaglespec.cli calibrate --reps 31 --json) > /work/main/runs/s22/cal-$v-$i.json 2> /work/main/runs/s22/cal-$v-$i.err
    echo "$v $i $(( $(date +%s) - start )) s"
  done
done
