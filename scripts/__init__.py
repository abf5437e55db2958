"""The GPU machine's checks (scripts/check/) and the measurement tools (scripts/bench/).

Every Python script here is a module, run from the repository root with

    python3 -m scripts.check.golden ...
    python3 -m scripts.bench.ab ...

so that scripts import each other (and the shared scripts.fields) as modules and
nothing edits sys.path; `--help` of each runs without a GPU (cupy is imported
only once a command needs it). The shell checks run as `bash scripts/check/NAME.sh`.
The one exception is scripts/check/cuda_libs.py, which gpu_install_check.sh runs
by its path from outside the checkout, so that it imports the installed minfer.
"""
