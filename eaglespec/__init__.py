import os as _os

# Compiled artifacts (inductor's FX graphs, generated C++, autotune choices) persist under
# ~/.cache/eaglespec/inductor (or $EAGLESPEC_CACHE/inductor). This must be set when eaglespec is first
# imported: torch fixes its cache folder (default /tmp/torchinductor_$USER, wiped on reboot) as soon as
# anything imports torch._dynamo, and merely building an nn.Module on a device context does that.
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _os.path.join(
    _os.environ.get("EAGLESPEC_CACHE", _os.path.join(_os.path.expanduser("~"), ".cache", "eaglespec")), "inductor"))
