"""Merge several preprocessed .bin/.idx pairs into one (Megatron's indexed dataset formats).

    python tools/merge_preprocessed_data.py --datasets data/part0_text_document data/part1_text_document \
        --output-prefix data/all_text_document [--dataset-impl mmap]

Tokens are streamed in bounded-memory chunks; documents keep their order (all of A, then all of B, ...). Every input
is validated first and all must share one token dtype, so a refused merge writes nothing. The output is written under
temporary names and renamed into place at the end. Imports only numpy and megatron.data.indexed_dataset.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import indexed_dataset  # noqa: E402
from megatron.settings.cli_parser import FlagParser  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", required=True,
                        help="prefixes (without .bin/.idx) of the pairs to merge, in output order")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged pair (writes PREFIX.bin/.idx)")
    parser.add_argument("--dataset-impl", default="mmap", choices=["mmap", "lazy", "cached", "infer"],
                        help="format of the inputs and the output; 'infer' takes it from the first input")
    return parser.parse_args(argv)


def _strip_ext(prefix: str) -> str:
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext) and not indexed_dataset.dataset_exists(prefix, "mmap"):
            return prefix[: -len(ext)]
    return prefix


def _inspect(prefix: str, impl: str) -> tuple[str, object, int, int]:
    """(impl, dtype, sequences, tokens) of a validated input pair."""
    found = indexed_dataset.infer_dataset_impl(prefix) if indexed_dataset.dataset_exists(prefix, impl) else None
    if found is None:
        missing = [p for p in (indexed_dataset.index_file_path(prefix), indexed_dataset.data_file_path(prefix))
                   if not os.path.exists(p)]
        raise indexed_dataset.IndexedDatasetError(f"--datasets: {' and '.join(missing)} not found")
    family = "mmap" if impl == "mmap" else "legacy"
    found_family = "mmap" if found == "mmap" else "legacy"
    if impl != "infer" and family != found_family:
        raise indexed_dataset.IndexedDatasetError(
            f"--datasets: {prefix} is a{'n mmap' if found == 'mmap' else ' legacy lazy/cached'} dataset but "
            f"--dataset-impl is {impl}; pass --dataset-impl {'mmap' if found == 'mmap' else 'lazy'} (or infer)"
        )
    if found == "mmap":
        index = indexed_dataset.MMapIndex(indexed_dataset.index_file_path(prefix))
        indexed_dataset.check_bin_size(prefix, index)
        return "mmap", index.dtype, len(index), int(index.sizes.sum(dtype="int64"))
    ds = indexed_dataset.IndexedDataset(prefix)
    return "lazy", ds.dtype, len(ds), int(ds.data_offsets[-1])


def merge(datasets: list[str], output_prefix: str, impl: str = "mmap") -> dict:
    """Validate every input, then stream them into ``output_prefix``; returns a summary dict."""
    datasets = [_strip_ext(os.fspath(d)) for d in datasets]
    output_prefix = _strip_ext(os.fspath(output_prefix))
    if output_prefix in datasets:
        raise indexed_dataset.IndexedDatasetError(
            f"--output-prefix {output_prefix} is also one of --datasets; choose a new prefix"
        )
    infos = [_inspect(d, impl) for d in datasets]
    if impl == "infer":
        first_family = infos[0][0]
        for d, info in zip(datasets, infos):
            if info[0] != first_family:
                raise indexed_dataset.IndexedDatasetError(
                    f"--datasets mixes formats: {datasets[0]} is {first_family} but {d} is {info[0]}; convert first"
                )
        impl = first_family
    dtypes = {str(info[1]) for info in infos}
    if len(dtypes) > 1:
        listing = ", ".join(f"{d} ({info[1]})" for d, info in zip(datasets, infos))
        raise indexed_dataset.IndexedDatasetError(
            f"--datasets have different token dtypes: {listing}; they were preprocessed with different vocabularies "
            "(uint16 below 65500 tokens, int32 otherwise) and cannot be merged — re-run preprocess_data.py with one "
            "tokenizer"
        )
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    builder = indexed_dataset.make_builder(indexed_dataset.data_file_path(output_prefix), impl, dtype=infos[0][1])
    try:
        for d in datasets:
            builder.merge_file_(d)
    except BaseException:
        builder.abort()
        raise
    builder.finalize(indexed_dataset.index_file_path(output_prefix))
    return {
        "datasets": len(datasets),
        "sequences": sum(info[2] for info in infos),
        "tokens": sum(info[3] for info in infos),
        "dtype": str(infos[0][1]),
        "impl": impl,
    }


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    start = time.time()
    try:
        summary = merge(args.datasets, args.output_prefix, args.dataset_impl)
    except (indexed_dataset.IndexedDatasetError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"merged {summary['datasets']} datasets ({summary['sequences']} sequences, {summary['tokens']} tokens, "
        f"{summary['dtype']}, {summary['impl']}) into {args.output_prefix}.bin/.idx in {time.time() - start:.2f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
