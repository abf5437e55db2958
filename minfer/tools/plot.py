"""`minfer bench --plot FILE`: a bench report as a picture. Prefill tokens/s
against prompt length (median, with the stdev as error bars and the median
written at each point); beside it, when the report timed decoding at several KV
depths (-d), decode tokens/s against depth.

`python3 -m minfer.tools.plot REPORT.json FILE.png` draws a report saved with
`minfer bench -o json`, e.g. one measured on a machine without matplotlib.

matplotlib is optional (minfer[plot]); only this module imports it, and only
through its object API (no pyplot, so no display or GUI backend is involved).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import MinferError


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise MinferError("--plot needs matplotlib: python3 -m pip install 'minfer[plot]'") from None
    return Figure


def check_plot_target(path) -> None:
    """Raise MinferError unless a plot can be written to path: matplotlib
    imports, it knows the file type, the folder exists."""
    Figure = _figure_class()
    path = Path(path)
    kinds = Figure().canvas.get_supported_filetypes()
    kind = path.suffix.lstrip(".").lower()
    if kind not in kinds:
        raise MinferError(f"--plot {path}: cannot tell the image type from {path.suffix or 'no suffix'!r} "
                          f"(use .png, .svg or .pdf)")
    if not path.parent.is_dir():
        raise MinferError(f"--plot {path}: no folder {path.parent}")


def _series(r: dict, x_key: str, keep) -> tuple[list, list, list]:
    tests = sorted((t for t in r["tests"].values() if keep(t)), key=lambda t: t[x_key])
    return [t[x_key] for t in tests], [t["median"] for t in tests], [t["stdev"] for t in tests]


def _panel(ax, x, y, err, xlabel: str, ylabel: str) -> None:
    from matplotlib.ticker import StrMethodFormatter

    ax.errorbar(x, y, yerr=err, marker="o", capsize=3)
    if len(x) > 1 and x[0] > 0 and x[-1] / x[0] >= 4:
        ax.set_xscale("log", base=2)         # sweeps like 128, 256, ..., 8192
    ax.set_xticks(x)
    ax.set_xticklabels([str(v) for v in x], rotation=45 if len(x) > 6 else 0)
    ax.minorticks_off()
    for xi, yi in zip(x, y):
        ax.annotate(f"{yi:,.0f}" if yi >= 100 else f"{yi:.1f}", (xi, yi), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=8)
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0, top=max(yi + ei for yi, ei in zip(y, err)) * 1.15)
    ax.grid(True, alpha=0.3)


def plot_throughput(r: dict, path) -> None:
    """Write the picture of bench report r (minfer.tools.bench.run) to path."""
    Figure = _figure_class()
    pp = _series(r, "n_prompt", lambda t: t["n_prompt"] > 0)
    tg = _series(r, "n_depth", lambda t: t["n_gen"] > 0)
    depths = len(tg[0]) > 1
    fig = Figure(figsize=(6.4 * (2 if depths else 1), 4.4), constrained_layout=True)
    ax = fig.add_subplot(1, 2 if depths else 1, 1)
    _panel(ax, *pp, "prompt length (tokens)", "prefill tokens/s (median ± stdev)")
    if depths:
        n_gen = next(t["n_gen"] for t in r["tests"].values() if t["n_gen"] > 0)
        _panel(fig.add_subplot(1, 2, 2), *tg, "tokens in the KV cache before decoding",
               f"decode tokens/s over {n_gen} tokens")
    elif tg[0]:
        name = next(n for n, t in r["tests"].items() if t["n_gen"] > 0)
        ax.set_title(f"{name}: {tg[1][0]:,.1f} tokens/s", fontsize=9)
    who = f"{r['model_name']}: {r['backend']} on {r.get('device') or '?'}"
    made = f"minfer {r.get('minfer_version', '?')}" + (f" ({r['git_commit']})" if r.get("git_commit") else "") \
        + (f", {r['timestamp']}" if r.get("timestamp") else "")
    fig.suptitle(f"{who}\n{made}", fontsize=10)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """`python3 -m minfer.tools.plot REPORT.json FILE.png`: the picture of a report saved
    with `minfer bench -o json` (a run on a machine without matplotlib, drawn here)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python3 -m minfer.tools.plot", description=main.__doc__.splitlines()[0])
    ap.add_argument("report", help="a `minfer bench -o json` report")
    ap.add_argument("output", help="the image to write (.png, .svg, .pdf)")
    args = ap.parse_args(argv)
    try:
        check_plot_target(args.output)
        try:
            with open(args.report, encoding="utf-8") as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            raise MinferError(f"{args.report}: not a readable JSON report ({e})") from None
        if not isinstance(r, dict) or not isinstance(r.get("tests"), dict):
            raise MinferError(f"{args.report}: not a `minfer bench -o json` report (no tests)")
        plot_throughput(r, args.output)
    except MinferError as e:
        print(f"minfer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
