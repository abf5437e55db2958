"""The `minfer` command: generate, tokenize, pull, perplexity (+ bench, twin, serve from their modules),
built on the Python front door (minfer.engine.Engine).

Bad input of any kind is one line `minfer: error: ...` on stderr and exit code 2
(MinferError, OSError on files, argument errors). Anything else is a bug and
keeps its traceback.

Text input (-p, --system, -f FILE, -f - for stdin) must be UTF-8: anything else
is an error naming the input and the byte offset (no replacement characters:
the tokens would silently differ from the text). Escape sequences in -p are
processed as llama.cpp does (minfer/text/escapes.py; --no-escape keeps them as
written); files, stdin and --system are taken as written. Prompt files are read up to
MAX_TEXT_BYTES. When the reader of stdout goes away (`minfer generate ... | head
-c 5`) the command stops quietly with status 141, which is what a shell reports
for a tool killed by SIGPIPE (`yes`, `cat`), so `set -o pipefail` sees the same.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .errors import MinferError
from .text.escapes import process_escapes

MAX_TEXT_BYTES = 64 << 20      # prompt and perplexity files: 64 MiB
# --backend's choices, checked when the arguments are parsed: minfer.backend.BACKENDS,
# written out so that parsing imports nothing heavy (tests/test_cli.py checks they agree)
BACKENDS = ("auto", "cpu", "cuda")
EXIT_SIGPIPE = 128 + 13        # the shell's status for a process killed by SIGPIPE

# subcommands that live in their own modules, each with add_arguments(parser) and
# main(args) -> int | None; imported only when invoked
EXTENSIONS = {"bench": "minfer.tools.bench", "twin": "minfer.tools.twin", "serve": "minfer.serve.server"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # one line, like every other bad input (argparse would print the usage first)
        self.exit(2, f"minfer: error: {message} (see `{self.prog} --help`)\n")


def _out(text: str) -> None:
    """Write exactly text to stdout (UTF-8 bytes, whatever the locale), now."""
    try:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise _StdoutClosed() from None


def model_path(model: str | None) -> str:
    """-m's file, or the default model (pulled on first use, which stderr reports)."""
    if model:
        return model
    from .pull import ensure_model
    return str(ensure_model(progress=True))


def _model_path(args) -> str:
    return model_path(args.model)


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinferError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _read_text(path: str) -> str:
    """The UTF-8 text of a file, or of stdin for "-", at most MAX_TEXT_BYTES."""
    what = "stdin" if path == "-" else path
    if path == "-":
        data = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)       # -f /dev/zero must not read for ever
    if len(data) > MAX_TEXT_BYTES:
        raise MinferError(f"{what} is larger than the {MAX_TEXT_BYTES >> 20} MiB limit for text input")
    return _utf8(data, what)


def _arg_text(text: str | None, flag: str, escapes: bool = False) -> str | None:
    """A command-line argument as checked UTF-8 text. Python decodes argv with
    surrogateescape, so undecodable bytes arrive as lone surrogates: recover the
    bytes and apply the same rule as to files. escapes: process llama.cpp's
    escape sequences first (they work on bytes: \\xc3\\xa9 is one character)."""
    if text is None:
        return None
    try:
        data = text.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as e:        # a surrogate that no byte produced
        raise MinferError(f"{flag} is not valid text (lone surrogate at character {e.start})") from None
    if escapes:
        processed = process_escapes(data)
        if processed != data:
            return _utf8(processed, f"{flag} (after escape processing; --no-escape keeps it as written)")
    return _utf8(data, flag)


def _prompt_text(args) -> str:
    """The text of -p (escapes processed unless --no-escape) or of -f FILE / -f -."""
    if args.file is not None:
        return _read_text(args.file)
    return _arg_text(args.prompt, "-p", escapes=not args.no_escape)


def _tps(x: float | None) -> str:
    """tokens/s for people: n/a where nothing was timed (one generated token)"""
    return "n/a" if x is None else f"{x:.2f}"


class _StdoutClosed(Exception):
    """The reader of stdout went away (EPIPE)."""


def _stdout_closed() -> int:
    """Stop quietly, as a tool killed by SIGPIPE would. Output still buffered is
    flushed at interpreter exit; point fd 1 at /dev/null so that flush cannot
    raise a second BrokenPipeError ("Exception ignored ...")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass        # stdout is not a file descriptor (captured in a test): nothing to flush
    return EXIT_SIGPIPE


# --- generate -----------------------------------------------------------------
def cmd_generate(args) -> int:
    from .engine import Engine, ModelFile
    from .sampling import SamplingParams
    from .text.prompt import check_fits, prompt_ids
    from .text.stops import StopMatcher

    prompt = _prompt_text(args)
    system = _arg_text(args.system, "--system")
    # escapes processed as in -p (llama.cpp does so for its -r), so --stop '\n' is a newline
    stop = StopMatcher([_arg_text(t, "--stop", escapes=not args.no_escape) for t in args.stop]).stops
    if prompt == "":
        raise MinferError("empty prompt: give some text with -p or -f")
    if args.n_predict < 0:
        raise MinferError(f"-n must be >= 0, got {args.n_predict}")
    sampling = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, seed=args.seed)   # checked before any load
    model = _model_path(args)
    mf = ModelFile.open(model, args.ctx_size)
    ids = prompt_ids(mf.tokenizer, prompt, chat=args.chat, system=system)
    check_fits(len(ids), mf.n_ctx)                      # before the weights are loaded
    engine = Engine.from_file(mf, args.backend, progress=not args.quiet)
    engine.backend.set_deterministic(args.deterministic)
    if not args.no_warmup:
        engine.warmup()
    # --json: stdout is one JSON object at the end, nothing streamed before it
    gen = engine.generate(ids, args.n_predict, ignore_eos=args.ignore_eos,
                          on_text=None if args.json else _out, sampling=sampling, stop=stop)
    s = gen.stats
    if args.json:
        _out(json.dumps({"model": str(model), "backend": engine.backend.name, **gen.to_dict()},
                        ensure_ascii=False) + "\n")
    note = {"context": " (context full)", "eog": " (end of generation)",
            "stop": f" (stop string {s.stop_string!r})"}.get(s.stop, "")
    print(("" if args.json else "\n") + f"prompt: {s.n_prompt} tokens, {_tps(s.prompt_tps)} tok/s | "
          f"generation: {s.n_generated} tokens, {_tps(s.decode_tps)} tok/s{note} "
          f"[{engine.backend.name}]", file=sys.stderr)
    return 0


# --- tokenize -----------------------------------------------------------------
def cmd_tokenize(args) -> int:
    from .text.tokenizer import open_tokenizer

    text = _prompt_text(args)           # -p or -f: one of them, argparse made sure
    # the tokenizer part of the file only: vocabulary-only GGUFs tokenize too
    tok = open_tokenizer(_model_path(args))
    ids = tok.encode(text, parse_special=not args.no_parse_special,
                     add_bos=False if args.no_bos else None)
    out = json.dumps([int(i) for i in ids]) + "\n"
    if args.show_count:             # llama-tokenize's line, after the ids
        out += f"Total number of tokens: {len(ids)}\n"
    _out(out)
    return 0


# --- pull ---------------------------------------------------------------------
def cmd_pull(args) -> int:
    from .pull import pull

    _out(f"{pull(args.name, progress=True, force=args.force)}\n")
    return 0


# --- perplexity ---------------------------------------------------------------
def cmd_perplexity(args) -> int:
    from .engine import Engine, ModelFile
    from .perplexity import chunks_per_forward, perplexity, perplexity_tokens

    if args.chunks is not None and args.chunks < 1:
        raise MinferError(f"--chunks must be at least 1, got {args.chunks}")
    chunks_per_forward(args.ctx_size, args.batch_size)              # -c and -b: before any file is read
    text = _read_text(args.file)
    mf = ModelFile.open(_model_path(args), args.ctx_size)
    tokens = perplexity_tokens(mf.tokenizer, text, args.ctx_size)     # before the weights load
    engine = Engine.from_file(mf, args.backend, progress=not args.quiet)
    res = perplexity(engine, text, n_ctx=args.ctx_size, progress=not args.quiet,
                     on_chunk=lambda i, p: _out(f"[{i}]{p:.4f},"), tokens=tokens, max_chunks=args.chunks,
                     batch_size=args.batch_size)
    _out(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.err:.5f}\n")
    if not args.quiet:
        print(f"perplexity: {res.n_chunks * res.n_ctx} tokens in {res.forward_s:.2f} s of forwards "
              f"({res.forward_tps:.0f} t/s), {res.chunks_per_forward} chunk(s) a forward", file=sys.stderr)
    return 0


# --- extension subcommands -----------------------------------------------------
def _run_extension(name: str, argv: list[str]) -> int:
    modname = EXTENSIONS[name]
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:
            raise                       # the module exists but is broken: a bug, show it
        raise MinferError(f"`minfer {name}` is not available in this installation ({modname} missing)") from None
    p = _Parser(prog=f"minfer {name}", description=(mod.__doc__ or "").strip().splitlines()[0]
                if mod.__doc__ else None)
    mod.add_arguments(p)
    return mod.main(p.parse_args(argv)) or 0


class _Version(argparse.Action):
    """--version: the line is made only when asked (it may run git)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version (and git commit) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from .tools.runinfo import version_line
        _out(version_line() + "\n")
        parser.exit(0)


def add_model_arg(p) -> None:
    p.add_argument("-m", "--model", metavar="PATH",
                   help="GGUF file (default: the pulled Qwen2.5-Coder-1.5B-Instruct Q4_K_M, "
                        "downloaded on first use)")


def add_backend_arg(p) -> None:
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto (default: cuda when cupy and a device are usable, else cpu), cpu or cuda")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="minfer", description="Run GGUF-quantized LLMs on an NVIDIA GPU, "
                                            "with a NumPy reference on the CPU.")
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def no_escape_arg(p):
        p.add_argument("--no-escape", action="store_true",
                       help="take -p as written (default: process escapes like \\n, \\t, \\xHH as llama.cpp does)")

    g = sub.add_parser("generate", help="generation (greedy by default), streamed to stdout")
    add_model_arg(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text (special tokens like <|im_start|> are parsed)")
    src.add_argument("-f", "--file", help="read the prompt from FILE (- for stdin), as written")
    no_escape_arg(g)
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size (default: min(training context, 4096))")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message for --chat")
    add_backend_arg(g)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end the text before the first occurrence of STR (repeatable: the earliest of "
                        "them; escapes processed as in -p; llama-cli's -r, OpenAI's and llama-server's stop)")
    smp = g.add_argument_group("sampling (llama-cli's flags; the default --temp 0 is greedy)")
    smp.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    smp.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    smp.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to probability p "
                                                             "(default 1: off)")
    smp.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least min-p times as likely as "
                                                             "the most likely (default 0: off)")
    smp.add_argument("--repeat-penalty", type=float, default=1.0,
                     help="penalize the last 64 tokens (default 1: off)")
    smp.add_argument("--seed", type=int, default=0,
                     help="seed of the draws (default 0); the same seed, the same text")
    g.add_argument("--deterministic", action="store_true",
                   help="the text independent of how the prompt is batched, chunked or cached (a row's "
                        "arithmetic fixed by what the row is: Engine.load's deterministic)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up run after load (short prefills and one decode step on a "
                        "throwaway cache, as llama.cpp's): the first prompt then pays the backend's "
                        "one-time start-up")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (prompt and generated ids, text, stop reason "
                        "and stop string, timings) instead of streaming the text")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar and no line naming the backend auto chose")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("tokenize", help="print token ids as a JSON list")
    add_model_arg(t)
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="text to tokenize")
    src.add_argument("-f", "--file", help="read the text from FILE (- for stdin), as written")
    no_escape_arg(t)
    t.add_argument("--no-parse-special", action="store_true",
                   help="treat special-token text like <|im_end|> as plain text")
    t.add_argument("--no-bos", action="store_true", help="add no BOS token even where the model adds one")
    t.add_argument("--show-count", action="store_true",
                   help="then print 'Total number of tokens: N' (as llama-tokenize does)")
    t.set_defaults(func=cmd_tokenize)

    pl = sub.add_parser("pull", help="download, verify and cache a model")
    pl.add_argument("name", nargs="?", default=None,
                    help="model name (default qwen2.5-coder-1.5b-instruct-q4_k_m)")
    pl.add_argument("--force", action="store_true", help="download again even if cached")
    pl.set_defaults(func=cmd_pull)

    pp = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    add_model_arg(pp)
    pp.add_argument("-f", "--file", required=True, help="text file (- for stdin)")
    pp.add_argument("-c", "--ctx-size", type=int, default=512, help="chunk size in tokens (default 512)")
    pp.add_argument("--chunks", type=int, default=None, help="evaluate at most N chunks (default: all)")
    pp.add_argument("-b", "--batch-size", type=int, default=None, metavar="N",
                    help="tokens per forward, whole chunks: a multiple of -c (default: llama-perplexity's "
                         "2048 rounded down to whole chunks, 4 chunks of 512; -b equal to -c evaluates "
                         "one chunk at a time)")
    add_backend_arg(pp)
    pp.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar and no line naming the backend auto chose")
    pp.set_defaults(func=cmd_perplexity)

    for name, modname in EXTENSIONS.items():
        # listed for --help only: main() hands `minfer NAME ...` to the module before parsing
        sub.add_parser(name, help=f"see `minfer {name} --help` ({modname})")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in EXTENSIONS:     # the module parses its own arguments
            return _run_extension(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        rc = args.func(args)
        sys.stdout.flush()          # here, not at exit, where EPIPE cannot be handled
        return rc
    except MinferError as e:
        msg = " ".join(str(e).split("\n"))
    except (_StdoutClosed, BrokenPipeError):
        # the CLI writes to no pipe but stdout (pip runs with its output captured):
        # a broken pipe here is the reader of stdout gone (bench and twin print())
        return _stdout_closed()
    except OSError as e:
        msg = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
    except KeyboardInterrupt:
        return 130
    print(f"minfer: error: {msg}", file=sys.stderr)
    return 2
