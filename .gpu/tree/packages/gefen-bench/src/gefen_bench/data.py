"""Datasets that ship with every install: no download, ever.

* :func:`stdlib_corpus` — the Python standard library's own ``.py`` sources as a byte-level
  corpus (one ``uint8`` token per byte, vocabulary 256), split *by file* into train,
  validation and held-out (test) streams with a hash of each file's path relative to the
  standard-library root, so the split does not depend on the machine or on file order.
* :func:`digits_splits` — scikit-learn's bundled ``load_digits()`` (1797 handwritten 8x8
  digits), split into stratified train / validation / held-out sets with a fixed seed;
  :func:`save_digits_splits` / :func:`load_digits_splits` hand them to worker processes
  through a file, so that each worker is spared importing scikit-learn (~1 s on 2 cores).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

# Directory names whose files are left out: test suites (not representative source text and
# absent from some distributions' Python builds) and third-party packages.
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)

# Fraction of files per split, in 1/100ths of the path hash space.
_TEST_PERCENT = 5
_VAL_PERCENT = 5


@dataclass(frozen=True)
class ByteCorpus:
    """Byte-level token streams.

    Attributes:
        train, val, test: ``uint8`` 1-D tensors, files concatenated in sorted path order with a
            ``b"\\n"`` separator.
        files: number of files per split, ``{"train": int, "val": int, "test": int}``.
        root: the standard-library directory the text was read from.
    """

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    files: dict[str, int]
    root: str


def stdlib_root() -> Path:
    """Directory of this interpreter's pure-Python standard library (``sysconfig`` ``stdlib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files under the standard library, test directories excluded.

    Raises:
        FileNotFoundError: the directory holds no ``.py`` file (e.g. a zipped stdlib).
    """
    root = stdlib_root() if root is None else root
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    if not found:
        raise FileNotFoundError(
            f"no .py files under the standard library directory {root}; the byte-level corpus "
            "needs an unzipped standard library"
        )
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def split_of(relative_path: str) -> str:
    """``"train"``, ``"val"`` or ``"test"`` for a file: CRC-32 of its POSIX relative path."""
    bucket = zlib.crc32(relative_path.encode("utf-8")) % 100
    if bucket < _TEST_PERCENT:
        return "test"
    if bucket < _TEST_PERCENT + _VAL_PERCENT:
        return "val"
    return "train"


def stdlib_corpus(max_train_bytes: int | None = None, root: Path | None = None) -> ByteCorpus:
    """Read the standard library's sources into train/val/test byte streams.

    Args:
        max_train_bytes: keep only the first this-many training bytes (files in sorted order);
            ``None`` keeps all (about 11 MB on CPython 3.11).
        root: override the standard-library directory (tests).

    Returns:
        A :class:`ByteCorpus`.
    """
    root = stdlib_root() if root is None else root
    chunks: dict[str, list[bytes]] = {"train": [], "val": [], "test": []}
    sizes = {"train": 0, "val": 0, "test": 0}
    for path in stdlib_source_files(root):
        split = split_of(path.relative_to(root).as_posix())
        if split == "train" and max_train_bytes is not None and sizes["train"] >= max_train_bytes:
            continue
        data = path.read_bytes() + b"\n"
        chunks[split].append(data)
        sizes[split] += len(data)

    def stream(split: str) -> torch.Tensor:
        raw = b"".join(chunks[split])
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    train = stream("train")
    if max_train_bytes is not None:
        train = train[:max_train_bytes]
    return ByteCorpus(
        train=train,
        val=stream("val"),
        test=stream("test"),
        files={k: len(v) for k, v in chunks.items()},
        root=str(root),
    )


def window_offsets(stream_len: int, seq_len: int, count: int, seed: int) -> torch.Tensor:
    """``count`` random window starts in ``[0, stream_len - seq_len - 1)`` (int64), by ``seed``.

    The same seed gives the same data order for every optimizer.
    """
    if stream_len < seq_len + 2:
        raise ValueError(f"stream of {stream_len} bytes is too short for seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, stream_len - seq_len - 1, (count,), generator=gen)


def eval_offsets(stream_len: int, seq_len: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced window starts covering the stream (int64): a fixed held-out set."""
    last = stream_len - seq_len - 1
    if last < 0:
        raise ValueError(f"stream of {stream_len} bytes is too short for seq_len={seq_len}")
    return torch.linspace(0, last, count).long()


def gather_windows(stream: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Windows of ``seq_len + 1`` bytes as int64 ``[len(offsets), seq_len + 1]``."""
    idx = offsets[:, None] + torch.arange(seq_len + 1)[None, :]
    return stream[idx].long()


@dataclass(frozen=True)
class DigitsSplits:
    """``load_digits`` as float32 images ``[N, 1, 8, 8]`` scaled to [0, 1] and int64 labels."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits_splits(split_seed: int = 0) -> DigitsSplits:
    """scikit-learn's bundled digits: 60% train, 15% validation, 25% held-out, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    idx = list(range(len(y)))
    rest, test = train_test_split(idx, test_size=0.25, random_state=split_seed, stratify=y)
    train, val = train_test_split(
        rest, test_size=0.2, random_state=split_seed, stratify=y[rest]
    )
    t = torch.tensor
    return DigitsSplits(
        x[t(train)], y[t(train)], x[t(val)], y[t(val)], x[t(test)], y[t(test)]
    )


def save_digits_splits(path: Path, split_seed: int = 0) -> Path:
    """Write :func:`digits_splits` to ``path`` (``torch.save`` of a dict of tensors, ~0.5 MB)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(asdict(digits_splits(split_seed)), path)
    return path


def load_digits_splits(path: Path) -> DigitsSplits:
    """The splits :func:`save_digits_splits` wrote (tensors only: ``weights_only=True``).

    Raises:
        ValueError: the file does not hold exactly the :class:`DigitsSplits` fields.
    """
    loaded = torch.load(path, weights_only=True)
    expected = {f.name for f in fields(DigitsSplits)}
    if not isinstance(loaded, dict) or set(loaded) != expected:
        raise ValueError(f"{path} does not hold digits splits (expected the keys "
                         f"{sorted(expected)}); write it with save_digits_splits()")
    return DigitsSplits(**loaded)
