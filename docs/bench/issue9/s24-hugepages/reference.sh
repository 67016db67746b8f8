# Issue 9 reference runs on the twenty-fourth session's default (int8 activations, packed weights on transparent huge
# pages; quiet, nothing else running), shipped head: the twenty-third session's commands, written here.
OUT=${OUT:-docs/bench/issue9/s24-hugepages} bash docs/bench/issue9/s23-int8/reference.sh
