"""`muser` command line: inspect, generate, chat, perplexity, serve."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from muser_mlx import gguf, packaged
from muser_mlx.formats import block_format
from muser_mlx.generate import MODEL_LOCK, continue_cache, load, prefill_chunks, stream_generate, summary

LIMITS = ("parallel", "max_queue", "max_body_bytes", "max_tokens_limit", "kv_memory", "prompt_cache_memory")
# Metadata keys worth a line each; long arrays are summarised by their length.
_ARRAY_PREVIEW = 8


def _format_value(value) -> str:
    if isinstance(value, list):
        if len(value) > _ARRAY_PREVIEW:
            return f"[{len(value)} items]"
        return repr(value)
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def embedding_accounting(table) -> list[str]:
    """The embedding chapter's byte count for a token_embd table (GGUF shape [hidden, vocab])."""
    hidden, vocab = table.shape
    fmt = block_format(table.ggml_type)
    row_bytes = fmt.row_bytes(hidden)
    return [
        f"  table: {table.name} {fmt.name} [hidden {hidden}, vocab {vocab}]",
        f"  row_bytes = ({hidden} / {fmt.block_size}) x {fmt.type_size} = {row_bytes:,} B",
        f"  table bytes = {vocab:,} x {row_bytes:,} = {vocab * row_bytes:,} B ({_mib(vocab * row_bytes)})",
        f"  per token: read {row_bytes:,} B (row) + 4 B (id), write {hidden * 4:,} B (f32 hidden)",
    ]


def inspect(path) -> str:
    lines = []
    with gguf.read(path) as model:
        lines.append(f"file: {model.path} ({model.size:,} bytes)")
        lines.append(f"architecture: {model.architecture}")
        lines.append(f"tensors: {len(model.tensors)}, metadata keys: {len(model.metadata)}, "
                     f"alignment: {model.alignment}")
        lines.append("")
        lines.append("metadata:")
        for key, value in model.metadata.items():
            lines.append(f"  {key} = {_format_value(value)}")
        lines.append("")
        lines.append(f"{'tensor':<40} {'type':<7} {'shape':<22} {'bytes':>14}")
        for tensor in model.tensors.values():
            shape = "[" + ", ".join(str(n) for n in tensor.shape) + "]"
            lines.append(f"{tensor.name:<40} {tensor.ggml_type.name:<7} {shape:<22} {tensor.nbytes:>14,}")
        lines.append("")
        lines.append("bytes per type:")
        total = sum(tensor.nbytes for tensor in model.tensors.values())
        for name, nbytes in sorted(model.bytes_by_type().items(), key=lambda item: -item[1]):
            lines.append(f"  {name:<7} {nbytes:>14,} B  {100 * nbytes / total:5.1f} %")
        lines.append(f"  {'total':<7} {total:>14,} B  ({_mib(total)})")
        if "token_embd.weight" in model.tensors:
            lines.append("")
            lines.append("embedding lookup (per token):")
            lines.extend(embedding_accounting(model.tensors["token_embd.weight"]))
        lines.append("")
        lines.extend(architecture_fields(model))
    return "\n".join(lines)


def architecture_fields(model) -> list[str]:
    """What the file's architecture reads from it (models.config_for's ModelConfig, field by
    field), or why it cannot run (the ModelConfigError naming the key, tensor or architecture)."""
    from muser_mlx.models import ModelConfigError, config_for

    try:
        config = config_for(model.metadata, model.tensors)
    except ModelConfigError as error:
        return [f"not supported: {error}"]
    lines = [f"{config.architecture} model:"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "rope_freqs" and value is not None:
            value = f"{len(value)} pairs, {value[0]:.4g} .. {value[-1]:.4g} (scaled or factored)"
        elif field.name == "swa_layers":
            value = "".join("S" if sliding else "F" for sliding in value) + " (S: sliding window, F: full)"
        lines.append(f"  {field.name} = {value}")
    return lines


def perplexity(model, tokenizer, text: str, context: int, prefill_step: int):
    """Teacher-forced scoring: the text's tokens in windows of `context`, each window run in
    prefill chunks with a fresh cache; every token after a window's first is predicted from
    the ones before it. Returns (perplexity, tokens scored, seconds). A progress bar counts
    the tokens scored on a terminal (stderr), and nothing is shown elsewhere."""
    if context < 2:
        raise ValueError(f"--context must be at least 2 tokens (a window scores each token after its "
                         f"first), got {context}")
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError("the text has fewer than 2 tokens: nothing to score")
    nll, scored = 0.0, 0
    tic = time.perf_counter()
    with tqdm(total=len(ids) - 1, desc="scoring", unit="token", disable=None, leave=False) as bar:
        for start in range(0, len(ids) - 1, context):
            window = ids[start : start + context]
            if len(window) < 2:
                break
            cache = model.make_cache()
            for chunk_start, chunk_end in prefill_chunks(len(window) - 1, prefill_step):
                chunk = window[chunk_start:chunk_end]
                targets = window[chunk_start + 1 : chunk_end + 1]
                with MODEL_LOCK:
                    logits = model(mx.array([chunk], dtype=mx.int32), cache)[0]
                    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                    picked = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
                    nll -= mx.sum(picked).item()
                scored += len(targets)
                bar.update(len(targets))
    return math.exp(nll / scored), scored, time.perf_counter() - tic


def byte_count(text: str) -> int:
    """A size: bytes, or a number with a unit (KB, MB, GB: powers of 1000; KiB, MiB, GiB: of 1024)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    number = text.strip().lower().rstrip("bgikm ")
    unit = text.strip().lower()[len(number):].strip()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GB, 512MiB, 1000000)") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(value)


def _add_limits(parser):
    """`muser serve`'s limits: those given become server.Limits's fields (the others keep its
    defaults, said here; the web stack is not imported to build the parser)."""
    given = dict(default=argparse.SUPPRESS)
    parser.add_argument("--parallel", type=int, **given,
                        help="sequences decoded together in one batched step (default 8)")
    parser.add_argument("--max-queue", type=int, **given,
                        help="requests that may wait for a slot; beyond them a 429 with Retry-After (default 64)")
    parser.add_argument("--max-body-bytes", type=byte_count, **given,
                        help="a larger request body gets a 413 (default 16MiB)")
    parser.add_argument("--max-tokens-limit", type=int, **given,
                        help="the most tokens one request generates: max_tokens is capped to it (default 4096)")
    parser.add_argument("--kv-memory", type=byte_count, **given,
                        help="KV cache the running sequences may hold together, e.g. 2GB; a prompt that does "
                             "not fit waits for others to finish (default: no bound)")
    parser.add_argument("--prompt-cache-memory", type=byte_count, **given,
                        help="finished sequences' caches kept for later prompts, the least recently used "
                             "dropped (default 256MiB)")


def _add_sampling(parser):
    parser.add_argument("--model", help="a .gguf file (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--system", help="system message (chat)")


def _sampling(args) -> dict:
    return dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def _messages(args, user: str) -> list[dict]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": user}]


def _stream(model, tokenizer, prompt, args, cache=None):
    response = None
    for response in stream_generate(model, tokenizer, prompt, args.max_tokens, cache=cache,
                                    **_sampling(args)):
        print(response.text, end="", flush=True)
    print()
    return response


def run_generate(args) -> None:
    model, tokenizer = load(args.model)
    prompt = args.prompt
    if args.chat:
        prompt = tokenizer.apply_chat_template(_messages(args, prompt), tokenize=True)
    response = _stream(model, tokenizer, prompt, args)
    if response is not None:
        print("=" * 10)
        print(summary(response))


def run_chat(args) -> None:
    """Interactive chat. The cache lives across turns: each turn feeds only the tokens that
    extend what the cache already holds (the whole conversation is re-rendered, then the
    common prefix is skipped); if the rendering diverges, the conversation is re-read."""
    model, tokenizer = load(args.model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    cache, cached = None, []  # continue_cache makes the first
    print("muser chat: an empty line or Ctrl-D ends the session.")
    while True:
        try:
            user = input(">> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        # Only what extends the cache is fed; where the re-rendered history differs from what
        # was fed (e.g. the reply re-tokenizes differently), the cache steps back to the common
        # prefix, or starts again where it cannot (a sliding window that has wrapped).
        cache, kept = continue_cache(model, cache, cached, ids)
        tokens = []
        response = None
        for response in stream_generate(model, tokenizer, ids[kept:], args.max_tokens, cache=cache,
                                        cached_ids=ids[:kept], **_sampling(args)):
            print(response.text, end="", flush=True)
            tokens.append(response.token)
        print()
        cached = ids + tokens[:-1]  # the last sampled token was never fed
        messages.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})


def run_perplexity(args) -> None:
    model, tokenizer = load(args.model)
    text = Path(args.text_file).read_text(encoding="utf-8")
    context = min(args.context, model.config.context)
    value, scored, seconds = perplexity(model, tokenizer, text, context, args.prefill_step)
    print(f"perplexity {value:.4f} over {scored} tokens (windows of {context}), "
          f"{scored / seconds:.1f} tokens/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="muser", description="Run and study GGUF models with MLX.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser("inspect", help="show a GGUF file's metadata, tensors and byte counts")
    inspect_parser.add_argument(
        "file", nargs="?", help=f"a .gguf file (default: the packaged {packaged.DEFAULT_MODEL} model)"
    )
    generate_parser = commands.add_parser("generate", help="generate text, streaming it as it comes")
    _add_sampling(generate_parser)
    generate_parser.add_argument("--prompt", required=True)
    generate_parser.add_argument("--chat", action="store_true",
                                 help="wrap the prompt in the model's chat template")
    chat_parser = commands.add_parser("chat", help="interactive chat (the cache is kept between turns)")
    _add_sampling(chat_parser)
    ppl_parser = commands.add_parser("perplexity", help="teacher-forced perplexity of a text file")
    ppl_parser.add_argument("--model", help="a .gguf file (default: the packaged SmolLM2-135M-Instruct)")
    ppl_parser.add_argument("--text-file", required=True)
    ppl_parser.add_argument("--context", type=int, default=512, help="tokens per scored window")
    ppl_parser.add_argument("--prefill-step", type=int, default=512, help="rows per model call")
    serve_parser = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, "
                                                     "/v1/completions, /v1/models)")
    serve_parser.add_argument("--model", help="a .gguf file (default: the packaged SmolLM2-135M-Instruct)")
    serve_parser.add_argument("--host", default="127.0.0.1")
    serve_parser.add_argument("--port", type=int, default=8080, help="0: any free port (printed)")
    _add_limits(serve_parser)
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            path = args.file or packaged.model_path()
            print(inspect(path))
        elif args.command == "generate":
            run_generate(args)
        elif args.command == "chat":
            run_chat(args)
        elif args.command == "perplexity":
            run_perplexity(args)
        elif args.command == "serve":
            from muser_mlx.server import Limits, serve  # the web stack loads only for this command
            limits = Limits(**{name: value for name, value in vars(args).items() if name in LIMITS})
            serve(args.model, args.host, args.port, limits)
    except (ValueError, packaged.ModelNotInstalledError, FileNotFoundError) as error:
        print(f"muser: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
