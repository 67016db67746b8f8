#!/bin/bash
cd /work/main
# OpenMP's wait policy, default against ACTIVE, in alternating processes; PAUSE=PID stops a background job
P=${PAUSE:-}; [ -n "$P" ] && kill -STOP $P
export COST_TABLE=${COST_TABLE:-runs/s24/table-fixed.json}  # one cached calibration table (a copy) for every process
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then order="default active"; else order="active default"; fi
  for s in $order; do
    if [ $s = active ]; then SETTING=$s OMP_WAIT_POLICY=ACTIVE .venv/bin/python docs/bench/issue9/s24-hugepages/omp_one.py 6 3; else SETTING=$s .venv/bin/python docs/bench/issue9/s24-hugepages/omp_one.py 6 3; fi
  done
done 2>&1 | grep "^{\|calibration"
[ -n "$P" ] && kill -CONT $P
