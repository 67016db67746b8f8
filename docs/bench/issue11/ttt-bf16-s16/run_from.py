"""python run_from.py SRC ARGS...: run the eaglespec CLI from the source tree SRC (not the editable install)."""
import sys
src = sys.argv[1]
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "") and "editable" not in repr(f)]
sys.path.insert(0, src)
import eaglespec
assert eaglespec.__file__.startswith(src), eaglespec.__file__
print("eaglespec from", eaglespec.__file__, file=sys.stderr)
from eaglespec.cli import main
sys.exit(main(sys.argv[2:]))
