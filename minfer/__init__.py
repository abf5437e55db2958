"""minfer: run GGUF-quantized language models on an NVIDIA GPU, with a NumPy
reference on the CPU.

    from minfer import Engine
    with Engine.load("model.gguf") as engine:
        print(engine.generate("def fibonacci(n):", max_tokens=64).text)

The names below are imported on first use, so `import minfer` (and the `minfer`
command, which imports this package first) stays cheap.
"""

__version__ = "0.1.0"      # the one place the version is written (pyproject reads it)

__all__ = ["Engine", "Generation", "GenerationStats", "MinferError", "SamplingParams", "ScoreResult",
           "TokenLogprob", "__version__"]

_EXPORTS = {"Engine": "minfer.engine", "Generation": "minfer.generate",
            "GenerationStats": "minfer.generate", "MinferError": "minfer.errors",
            "SamplingParams": "minfer.sampling", "ScoreResult": "minfer.engine",
            "TokenLogprob": "minfer.generate"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'minfer' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
