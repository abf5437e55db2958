"""Which CUDA library files a minfer process loads, and from where.

Runs one short generation on the synthetic model with the default backend
("auto"), then lists the CUDA libraries mapped into this process
(/proc/self/maps) and what cuda.pathfinder finds for each, so a GPU install can
be checked to take cuBLAS, NVRTC and the runtime from the pip wheels
(site-packages/nvidia/...) rather than from a system toolkit.

    python3 /path/to/checkout/scripts/check/cuda_libs.py [MODEL_DIR]

Run by its path from outside the checkout (gpu_install_check.sh does), so that the
minfer it imports is the installed one; it imports nothing from scripts/.
"""
from __future__ import annotations

import re
import sys

LIBS = re.compile(r"/lib(cublas|cublasLt|nvrtc|nvrtc-builtins|cudart|cuda|nvJitLink)(\.so|-)[^/]*$")


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip())
        return 0
    import minfer
    from minfer import Engine
    from minfer.tools.synth import synth_model

    model = synth_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/minfer-cache")
    print(f"minfer {minfer.__version__} from {minfer.__file__}")
    with Engine.load(model, n_ctx=64) as engine:          # backend "auto"
        out = engine.generate("def fibonacci(n):", max_tokens=8, ignore_eos=True)
        print(f"backend {engine.backend.name}: {engine.backend.device_info()}")
        print(f"generated {len(out.ids)} tokens, decode {out.stats.decode_tps} tok/s")
        with open("/proc/self/maps") as f:
            mapped = sorted({line.split()[-1] for line in f if LIBS.search(line.strip())})
    print("CUDA libraries mapped into this process:")
    for path in mapped:
        print(f"  {path}{'   (pip wheel)' if '/site-packages/nvidia/' in path else ''}")
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:
        print(f"cuda.pathfinder does not import: {e}")
        return 1
    for name in ("cublas", "cublasLt", "nvrtc", "cudart"):
        try:
            lib = load_nvidia_dynamic_lib(name)
            print(f"pathfinder {name}: {lib.abs_path} (found via {getattr(lib, 'found_via', '?')})")
        except Exception as e:  # noqa: BLE001 - report, do not stop: this is a survey
            print(f"pathfinder {name}: not found ({type(e).__name__}: {' '.join(str(e).split())})")
    return 0 if engine.backend.name == "cuda" else 1


if __name__ == "__main__":
    sys.exit(main())
