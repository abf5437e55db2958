"""The measuring tools behind `minfer bench` and `minfer twin`: the benchmark
(bench.py) and its plot (plot.py), benchmark models from a real header plus
synthetic data (twin.py, synth.py), and what each record names (runinfo.py)."""
