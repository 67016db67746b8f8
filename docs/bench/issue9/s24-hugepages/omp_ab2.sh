#!/bin/bash
cd /work/main
P=$(cat runs/s24/v9.pid); kill -STOP $P
export COST_TABLE=runs/s24/table-fixed.json
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then order="default active"; else order="active default"; fi
  for s in $order; do
    if [ $s = active ]; then SETTING=$s OMP_WAIT_POLICY=ACTIVE .venv/bin/python runs/s24/omp_one.py 6 3; else SETTING=$s .venv/bin/python runs/s24/omp_one.py 6 3; fi
  done
done 2>&1 | grep "^{\|calibration"
kill -CONT $P
