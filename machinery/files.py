"""Files that survive a kill: what a run, a study and the model cache write and read back.

    with replacing(dest) as tmp:  write a file or a folder at tmp; it becomes dest
                                  when the block ends
    write_atomically(path, text)  the same for one text file
    append_jsonl(path, rows)      one JSON object per line, appended
    write_jsonl(path, rows)       a JSON-lines file replaced atomically
    read_jsonl_rows(path)         the rows back, a last line cut short by a kill dropped with a note
    drop_torn_tail(path)          rewrite a JSON-lines file without such a last line, before
                                  appending to it

A rename within one folder is atomic, so a reader (or a resumed run) sees the old file or the new
one, never half of one; an append cut short by a kill leaves a last line without its newline, the
only damage an append can do. Standard library only.
"""
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path


class DataError(ValueError):
    """A data file (a benchmark, or a run's JSON-lines) cannot be read; the message names the file,
    the line and what to do."""


def _remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def replacing(dest: Path):
    """A temporary path beside dest (same folder: the rename is atomic) to write a file or a folder
    to; it replaces dest when the block ends, and is removed instead when the block raises."""
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    os.replace(tmp, dest)


def write_atomically(path: Path, text: str):
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def jsonl_objects(path: Path, torn_tail_ok: bool = False):
    """(line number, object) for each non-blank line of a JSON-lines file; errors name the file and
    the line. With torn_tail_ok, a last line without its newline that does not parse (what a kill
    during an append leaves) is dropped with a note instead."""
    lines = path.read_bytes().split(b"\n")
    for lineno, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            if torn_tail_ok and lineno == len(lines):
                print(f"[t3rl] {path}:{lineno}: dropped a half-written last line "
                      f"(left by a kill during a write)", file=sys.stderr)
                return
            if isinstance(err, UnicodeDecodeError):
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} "
                                f"at column {err.start + 1}); save the file as UTF-8") from None
            raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg}); "
                            f"fix or delete that line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def read_jsonl_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (none when the file is missing): metrics.jsonl,
    rollouts.jsonl, study.jsonl."""
    return [row for _, row in jsonl_objects(path, torn_tail_ok=True)] if path.is_file() else []


def append_jsonl(path: Path, rows: list[dict]):
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_jsonl(path: Path, rows):
    """Replace a JSONL file with `rows`, atomically."""
    write_atomically(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def keep_jsonl(path: Path, keep):
    """Rewrite a JSONL file with only the rows `keep` accepts (resume drops what came after the
    checkpoint, and a torn last line with it)."""
    if path.is_file():
        write_jsonl(path, [r for r in read_jsonl_rows(path) if keep(r)])


def drop_torn_tail(path: Path):
    """Rewrite a JSONL file whose last line was cut by a kill during an append, without that line
    (a file that ends in a newline is left alone)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                keep_jsonl(path, lambda row: True)
