"""Local evaluation inputs: text files and dataset records. Nothing is downloaded.

Records (one dict per item, with the dataset's own fields) come from JSON lines (plain, .gz,
.xz), parquet, a `datasets.save_to_disk` folder (its Arrow shards, read with pyarrow) or one
Arrow file. Text (for perplexity) is UTF-8, plain, .gz or .xz.
"""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path
from typing import IO, Any

from colibri.errors import ColibriError


class EvalError(ColibriError):
    """Bad evaluation input: a missing or malformed file, a missing field, an empty text."""


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _exists(path: Path) -> None:
    if not path.exists():
        raise EvalError(f"{path}: no such file or directory")


def read_text(path: str | Path) -> str:
    """The whole text of a UTF-8 file (plain, .gz or .xz). Raises EvalError when it is
    missing, unreadable, not UTF-8 or empty (whitespace only)."""
    path = Path(path)
    _exists(path)
    try:
        with _open_text(path) as f:
            text = f.read()
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as exc:
        raise EvalError(f"{path}: cannot read text ({exc})") from None
    if not text.strip():
        raise EvalError(f"{path}: empty text")
    return text


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise EvalError(
            "reading parquet / Arrow files needs pyarrow: pip install 'colibri[eval]'"
        ) from None
    return pyarrow


def _arrow_file(path: Path) -> list[dict[str, Any]]:
    pa = _pyarrow()
    try:
        try:
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:  # datasets' format
                table = reader.read_all()
        except pa.ArrowInvalid:
            with pa.ipc.open_file(pa.memory_map(str(path))) as reader:
                table = reader.read_all()
    except (OSError, pa.ArrowException) as exc:
        raise EvalError(f"{path}: not an Arrow file ({exc})") from None
    return table.to_pylist()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a local dataset file or folder (see the module docstring), in order.

    Raises EvalError naming the file (and line) when it is missing, malformed or empty, or a
    folder is a `DatasetDict` (then the message names its splits).
    """
    path = Path(path)
    _exists(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise EvalError(
                f"{path}: a dataset with several splits; give one split's folder "
                f"({', '.join(str(path / s) for s in splits)})"
            )
        shards = sorted(path.glob("*.arrow"))
        if not shards:
            raise EvalError(f"{path}: no .arrow files (not a datasets.save_to_disk folder)")
        records = [r for shard in shards for r in _arrow_file(shard)]
    elif path.suffix == ".parquet":
        pa = _pyarrow()
        try:
            records = pa.parquet.read_table(str(path)).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise EvalError(f"{path}: not a parquet file ({exc})") from None
    elif path.suffix == ".arrow":
        records = _arrow_file(path)
    else:
        records = []
        try:
            with _open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                    except ValueError as exc:
                        raise EvalError(f"{path}:{lineno}: not JSON ({exc})") from None
                    if not isinstance(r, dict):
                        raise EvalError(f"{path}:{lineno}: a JSON object per line expected")
                    records.append(r)
        except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as exc:
            raise EvalError(f"{path}: cannot read ({exc})") from None
    if not records:
        raise EvalError(f"{path}: no records")
    return records
