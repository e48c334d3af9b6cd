"""`muser` command line: `muser inspect [FILE.gguf]`."""

from __future__ import annotations

import argparse
import sys

from muser_mlx import gguf, packaged
from muser_mlx.formats import block_format

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
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="muser", description="Run and study GGUF models with MLX.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_parser = commands.add_parser("inspect", help="show a GGUF file's metadata, tensors and byte counts")
    inspect_parser.add_argument(
        "file", nargs="?", help=f"a .gguf file (default: the packaged {packaged.DEFAULT_MODEL} model)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            path = args.file or packaged.model_path()
            print(inspect(path))
    except (gguf.GGUFError, packaged.ModelNotInstalledError, FileNotFoundError) as error:
        print(f"muser: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
